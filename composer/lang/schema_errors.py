"""Layer 2: turn pydantic validation errors into located, friendly diagnostics."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from composer import registry
from composer.errors import Diagnostic, Location, did_you_mean
from composer.lang.loader import LoadedSpec


def data_path(data: Any, loc: tuple) -> tuple:
    """Map a pydantic error location onto the path in the data, skipping union tags and validator names."""
    path, cur = [], data
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            path.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            path.append(part)
            cur = cur[part]
        elif isinstance(cur, dict) and isinstance(part, str) and not path_is_tag(cur, part):
            path.append(part)  # a missing field: the path ends here
            cur = None
        # else: a union tag ("policy_model") or a validator name: not part of the data
    return tuple(path)


def path_is_tag(cur: dict, part: str) -> bool:
    return cur.get("kind") == part


def _unwrap(annotation, value) -> type[BaseModel] | None:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0], value)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        for opt in options:
            m = _unwrap(opt, value)
            if m is not None and (not isinstance(value, dict) or "kind" not in m.model_fields
                                  or m.model_fields["kind"].default == value.get("kind")):
                return m
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def model_at(model: type[BaseModel], data: Any, path: tuple) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at `path` of `data`."""
    cur_model, cur = model, data
    i = 0
    while i < len(path):
        key = path[i]
        field = _field(cur_model, key)
        if field is None:
            return None
        value = cur.get(key) if isinstance(cur, dict) else None
        ann = field.annotation
        # containers: list[X] / dict[str, X] consume one more path element
        for _ in range(3):
            origin = typing.get_origin(ann)
            if origin is typing.Union:
                args = [a for a in typing.get_args(ann) if a is not type(None)]
                ann = args[0] if len(args) == 1 else ann
                if len(args) != 1:
                    break
            elif origin in (list, dict) and i + 1 < len(path):
                ann = typing.get_args(ann)[-1]
                i += 1
                value = value[path[i]] if isinstance(value, (list, dict)) and _has(value, path[i]) else None
            else:
                break
        nxt = _unwrap(ann, value)
        if nxt is None:
            return None
        cur_model, cur = nxt, value
        i += 1
    return cur_model


def _has(container, key) -> bool:
    if isinstance(container, dict):
        return key in container
    return isinstance(key, int) and 0 <= key < len(container)


def _field(model: type[BaseModel], key):
    if not isinstance(key, str):
        return None
    for name, f in model.model_fields.items():
        if name == key or f.alias == key:
            return f
    return None


def field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def diagnostics_from(err: ValidationError, spec: LoadedSpec, model: type[BaseModel], prefix: tuple = (),
                     locate=None) -> list[Diagnostic]:
    """Friendly diagnostics for every pydantic error, located in the YAML."""
    locate = locate or spec.locate
    out, seen = [], set()
    by_path: dict[tuple, list] = {}  # value errors per path: the members of a plain union are merged into one
    for e in err.errors():
        loc = tuple(e["loc"])
        data_root = spec.data
        for p in prefix:
            data_root = data_root[p]
        path = prefix + data_path(data_root, loc)
        etype, ctx, value = e["type"], e.get("ctx") or {}, e.get("input")
        hint = ""
        if etype == "extra_forbidden":
            parent = model_at(model, spec.data, path[:-1])
            allowed = field_names(parent) if parent else []
            msg = f"unknown key '{path[-1]}'" + _where(parent, path[:-1])
            hint = did_you_mean(path[-1], allowed)
        elif etype == "union_tag_invalid":
            expected = [t.strip().strip("'") for t in str(ctx.get("expected_tags", "")).split(",")]
            msg = f"unknown kind '{ctx.get('tag')}'"
            hint = did_you_mean(ctx.get("tag"), expected)
            if "did you mean" in hint:
                hint += " Valid kinds: " + ", ".join(expected)
            path = path + ("kind",) if path[-1:] != ("kind",) else path
        elif etype == "union_tag_not_found":
            msg = "missing `kind`"
            hint = "add `kind:` (`composer list` shows the kinds of each section)"
        elif etype == "missing":
            parent = model_at(model, spec.data, path[:-1])
            f = _field(parent, path[-1]) if parent else None
            msg = f"missing required field '{path[-1]}'"
            hint = f"add `{path[-1]}:`" + (f" ({f.description})" if f is not None and f.description else "")
        elif etype in ("model_type", "dict_type", "model_attributes_type"):
            msg = f"expected a mapping, got {type(value).__name__} {_short(value)}"
            hint = _field_hint(model, spec.data, path) or "write `key: value` pairs"
            if isinstance(value, str) and path and any(value in registry.kinds(sec) for sec in registry.SECTIONS):
                hint = f"a component is a mapping: write `{path[-1]}: {{kind: {value}}}`"
        else:
            by_path.setdefault(path, []).append(e)
            continue
        key = (path, msg)
        if key in seen:
            continue
        seen.add(key)
        out.append(Diagnostic("schema", msg, path, locate(path) or Location(spec.file, 1, 1), hint))
    for path, errs in by_path.items():
        value = errs[0].get("input")
        if len(errs) == 1:
            e = errs[0]
            if e["type"] in ("literal_error", "enum"):
                expected = (e.get("ctx") or {}).get("expected", "")
                msg = f"{value!r} is not allowed; expected {expected}"
            elif e["type"] == "finite_number":  # registry.NumbersNotBooleans: inf and nan mean nothing as a setting
                msg = (f"{_short(value)} is not a finite number: infinity and nan are no setting here (only a field "
                       "that documents `.inf` takes it); write a number")
            else:
                msg = f"{e['msg']}" + (f", got {_short(value)}" if not isinstance(value, (dict, list)) else "")
        else:
            wanted = []
            for e in errs:
                w = _expectation(e)
                if w not in wanted:
                    wanted.append(w)
            msg = f"{_short(value)} is not allowed here; expected " + " or ".join(wanted)
        options = []
        for e in errs:
            if e["type"] in ("literal_error", "enum"):
                expected = str((e.get("ctx") or {}).get("expected", ""))
                options += [o.strip().strip("'\"") for o in expected.replace(" or ", ",").split(",") if o.strip()]
        hint = did_you_mean(value, options) if options and isinstance(value, str) else ""
        if not hint or not hint.startswith("did you mean"):
            hint = _field_hint(model, spec.data, path) or hint
        out.append(Diagnostic("schema", msg, path, locate(path) or Location(spec.file, 1, 1), hint))
    return out


def _where(parent, path: tuple) -> str:
    """' in the grpo objective', ' at the top level of the spec', ' in rollout'."""
    if parent is not None and isinstance(getattr(parent, "section", None), str) and parent.section \
            and "kind" in parent.model_fields:
        return f" in the {parent.kind_name()} {parent.section.rstrip('s')}"
    if not path:
        return " at the top level of the spec"
    from composer.errors import dotted
    return f" in {dotted(path)}"


def _expectation(e: dict) -> str:
    """What a pydantic error says the value should be, as a phrase: "a valid number", "'policy' or 'behavior'"."""
    text = str(e.get("msg", ""))
    text = text[len("Input should be "):] if text.startswith("Input should be ") else text
    return text.split(",")[0]


def _field_hint(model: type[BaseModel], data: Any, path: tuple) -> str:
    """The field's description and default, as a hint for a value of the wrong type or range."""
    f = None
    for cut in (1, 2):  # the field itself, or the list/dict field an item belongs to
        if len(path) < cut:
            break
        parent = model_at(model, data, path[:-cut])
        f = _field(parent, path[-cut]) if parent is not None else None
        if f is not None:
            break
    if f is None:
        return ""
    text = f.description or ""
    default = f.get_default(call_default_factory=True)
    if default is not PydanticUndefined and default is not None and not isinstance(default, BaseModel):
        text += f" Default: {_yaml_value(default)}."
    return text.strip()


def _yaml_value(value) -> str:
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
