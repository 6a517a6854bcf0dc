"""The JSON Schema of the spec language, generated from the pydantic models (never hand-written)."""

from __future__ import annotations

import json
from pathlib import Path

from composer.lang.spec import spec_model

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "schemas" / "spec.schema.json"


def spec_schema(builtins_only: bool = True) -> dict:
    """The committed schema covers built-in kinds only; builtins_only=False adds installed plugins' kinds."""
    schema = spec_model(builtins_only=builtins_only).model_json_schema(by_alias=True, mode="validation")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$id": "https://algorithm-composer/spec.schema.json", **schema}
    return _fix_inf(_by_kind(schema, schema.get("$defs", {})))


def _kind_refs(members: list, defs: dict) -> dict[str, str] | None:
    """kind -> $ref when every member is a reference to a component model (its `kind` a constant), else None."""
    out = {}
    for m in members:
        target = defs.get(m.get("$ref", "").rsplit("/", 1)[-1]) if set(m) == {"$ref"} else None
        kind = (target or {}).get("properties", {}).get("kind", {}).get("const")
        if kind is None:
            return None
        out[kind] = m["$ref"]
    return out


def _dispatch(refs: dict[str, str], defs: dict, partial: bool) -> dict:
    """A component union as `kind` enum + one if/then per kind.

    A generic validator then names the wrong field of the chosen kind (a `oneOf` only says "not valid under
    any of the given schemas"); editors complete `kind` from the enum and the fields from the matching `then`.
    A partial (inside a phase or stage) may leave `kind` out: it patches the base spec's component, so its
    keys must be fields of some kind of the section.
    """
    node = {"type": "object",
            "properties": {"kind": {"enum": list(refs), "description": "Component kind (`composer list` shows "
                                    "each kind's fields)."}},
            "allOf": [{"if": {"type": "object", "properties": {"kind": {"const": k}}, "required": ["kind"]},
                       "then": {"$ref": r}}
                      for k, r in refs.items()]}
    if partial:
        names = sorted({f for r in refs.values() for f in defs[r.rsplit("/", 1)[-1]].get("properties", {})})
        node["allOf"].append({"if": {"type": "object", "not": {"required": ["kind"]}},
                              "then": {"propertyNames": {"enum": names}, "anyOf": [{"$ref": r} for r in refs.values()]}})
    else:
        node["required"] = ["kind"]
        node["discriminator"] = {"propertyName": "kind", "mapping": dict(refs)}
    return node


def _by_kind(value, defs: dict):
    """Rewrite every component union of pydantic's schema (oneOf + discriminator, or anyOf of partials)."""
    if isinstance(value, list):
        return [_by_kind(v, defs) for v in value]
    if not isinstance(value, dict):
        return value
    value = {k: _by_kind(v, defs) for k, v in value.items()}
    if "oneOf" in value and "discriminator" in value:
        refs = _kind_refs(value["oneOf"], defs)
        if refs:
            rest = {k: v for k, v in value.items() if k not in ("oneOf", "discriminator")}
            return {**rest, **_dispatch(refs, defs, partial=False)}
    if "anyOf" in value:
        members = [m for m in value["anyOf"] if m != {"type": "null"}]
        refs = _kind_refs(members, defs) if members else None
        if refs:
            rest = {k: v for k, v in value.items() if k != "anyOf"}
            return {**rest, **_nullable(_dispatch(refs, defs, partial=True), len(members) < len(value["anyOf"]))}
        if len(members) == 1 and len(value["anyOf"]) == 2 and _is_dispatch(members[0]):
            # an optional component: `null` joins the union's own node, so that no anyOf hides which field is wrong
            return {**{k: v for k, v in value.items() if k != "anyOf"}, **_nullable(members[0], True)}
    return value


def _is_dispatch(node: dict) -> bool:
    return "allOf" in node and "enum" in node.get("properties", {}).get("kind", {})


def _nullable(node: dict, nullable: bool) -> dict:
    return {**node, "type": ["object", "null"]} if nullable else node


def _fix_inf(value):
    # JSON has no infinity: defaults such as beta1=.inf are written as the string "Infinity"
    if isinstance(value, dict):
        return {k: _fix_inf(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fix_inf(v) for v in value]
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def write_schema(path: Path | None = None, builtins_only: bool = True) -> Path:
    path = path or DEFAULT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec_schema(builtins_only), indent=2, sort_keys=False) + "\n")
    return path
