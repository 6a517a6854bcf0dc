"""The spec language's reference, generated from the spec models and the component registry.

One structure (sections, kinds, fields with type, allowed values, default and description, plus each
kind's docstring: what it is, the formula, the paper) with two renderings: rich text for `composer
list` and Markdown for docs/reference.md. Torch-free, like validation.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass, field

from pydantic import BaseModel, create_model
from pydantic_core import PydanticUndefined

from composer import registry
from composer.errors import did_you_mean
from composer.lang.schema_errors import _yaml_value
from composer.lang.spec import Data, Policy, Rollout, Sync, Train, spec_model

REGEN = "composer list --markdown --out docs/reference.md"
COMPONENT_SECTIONS = registry.SECTIONS  # sources, guide, signal, objective
# the top-level keys of a spec, in the order a spec is read (and the README's spec-language section)
SPEC_KEYS = ("name", "summary", "extends", "plugins", "policy", "data", "sources", "rollout", "signal", "objective",
             "terms", "sync", "phases", "stages", "train")
VERIFIER_TOPICS = ("verifier", "verifiers")
# sections with fields of their own; phases/stages/terms come from spec_model (they depend on the registry)
_MODELS = {"policy": Policy, "data": Data, "rollout": Rollout, "sync": Sync, "train": Train}
_ITEM_OF = {"terms": "one term", "phases": "one phase", "stages": "one stage"}


PLAIN_DEFAULTS = ("required", "not set", "all defaults")


@dataclass
class FieldDoc:
    name: str
    type: str  # "integer >= 1", "list of string", "objective component"
    allowed: list[str]  # enum values or kinds; empty: any value of the type
    default: str  # YAML text; "required" or "not set"
    description: str


@dataclass
class Entry:
    """One section or one component kind."""

    topic: str  # "train", "objective", "objective/grpo", "verifiers"
    summary: str  # one line
    doc: str = ""  # the full docstring of a kind (formula, paper)
    fields: list[FieldDoc] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # ports, references, where it comes from
    fields_title: str = ""  # a line before the fields ("Fields of one stage:")
    kinds: list[Entry] = field(default_factory=list)  # a component section's kinds
    rows: list[tuple[str, str]] = field(default_factory=list)  # verifiers: (name, description)


# ------------------------------------------------------------------------------------------ types

def _bound(p: dict) -> str:
    parts = []
    for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in p:
            parts.append(f"{sym} {_yaml_value(p[key])}")
    if "minLength" in p:
        parts.append(f"at least {p['minLength']} character" + ("s" if p["minLength"] != 1 else ""))
    if "pattern" in p:
        parts.append(f"matching {p['pattern']}")
    if "minItems" in p and p.get("minItems") == p.get("maxItems"):
        parts.append(f"exactly {p['minItems']} items")
    else:
        parts += [f"at least {p['minItems']} items"] if "minItems" in p else []
        parts += [f"at most {p['maxItems']} items"] if "maxItems" in p else []
    return (" " + ", ".join(parts)) if parts else ""


def _kinds_of(p: dict, defs: dict) -> list[str]:
    """The kinds of a component union (pydantic's oneOf + discriminator, or an anyOf of partials)."""
    if "discriminator" in p:
        return list(p["discriminator"].get("mapping", {}))
    refs = [m.get("$ref", "") for m in p.get("anyOf", []) if m != {"type": "null"}]
    kinds = [defs.get(r.rsplit("/", 1)[-1], {}).get("properties", {}).get("kind", {}).get("const") for r in refs]
    return kinds if refs and all(kinds) else []


def _type(p: dict, defs: dict) -> tuple[str, list[str]]:
    """(type words, allowed values) of a JSON Schema property."""
    kinds = _kinds_of(p, defs)
    if kinds:
        section = next((s for s in COMPONENT_SECTIONS if kinds[0] in registry.kinds(s)), "component")
        partial = "discriminator" not in p
        what = {"sources": "source"}.get(section, section)
        return (f"partial {what} (`kind` optional)" if partial else f"{what} component"), kinds
    if "const" in p:
        return "string", [str(p["const"])]
    if "enum" in p:
        return p.get("type", "string"), [str(v) for v in p["enum"]]
    if "$ref" in p:
        name = p["$ref"].rsplit("/", 1)[-1]
        if name.endswith("Partial"):
            base = name[: -len("Partial")].replace("PhaseTrain", "Train").lower()
            return f"partial {base} (mapping)", []
        return f"{name.lower()} (mapping)", []
    if "anyOf" in p:
        parts = [_type(m, defs) for m in p["anyOf"] if m != {"type": "null"}]
        words = " or ".join(dict.fromkeys(t for t, _ in parts))
        return words + _bound(p), [v for _, allowed in parts for v in allowed]
    t = p.get("type")
    if t == "array":
        item, allowed = _type(p.get("items", {}), defs)
        return f"list of {item}" + _bound(p), allowed
    if t == "object":
        value = p.get("additionalProperties")
        if isinstance(value, dict) and value:
            item, allowed = _type(value, defs)
            return f"mapping of name to {item}", allowed
        return "mapping", []
    if t is None:
        return "any", []
    return t + _bound(p), []


def _default(f, name: str = "") -> str:
    if f.is_required() or name == "kind":  # a component's kind has a default only to name the class
        return "required"
    value = f.get_default(call_default_factory=True)
    if value is None or value is PydanticUndefined:
        return "not set"
    if isinstance(value, BaseModel):
        kind = getattr(value, "kind", None)
        return f"{{kind: {kind}}}" if isinstance(kind, str) else "all defaults"
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.:/+-]+", value):
        return value  # plain YAML scalar, no quotes needed
    return _yaml_value(value)


def fields_of(model: type[BaseModel], skip: tuple = ()) -> list[FieldDoc]:
    """Every field of a pydantic model: type, allowed values, default and description."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    defs, props = schema.get("$defs", {}), schema.get("properties", {})
    out = []
    for name, f in model.model_fields.items():
        key = f.alias or name
        if key in skip:
            continue
        typ, allowed = _type(props.get(key, {}), defs)
        out.append(FieldDoc(key, typ, allowed, _default(f, key), f.description or ""))
    return sorted(out, key=lambda d: d.name != "kind")  # `kind` first: it decides the other fields


# ------------------------------------------------------------------------------------------ entries

def _included(cls, builtins_only: bool) -> bool:
    return not (builtins_only and cls.plugin)


def kind_entry(section: str, cls) -> Entry:
    doc = inspect.cleandoc(cls.__doc__ or "")
    notes = []
    if cls.provides:
        notes.append("provides: " + ", ".join(cls.provides))
    if cls.needs:
        notes.append("needs: " + ", ".join(cls.needs) + (" (from its signal)" if section == "objective" else ""))
    for fname, kinds in cls.refs.items():
        f = cls.model_fields.get(fname)
        key = (f.alias if f is not None else None) or fname
        notes.append(f"`{key}` names a source of kind " + " or ".join(kinds))
    if getattr(cls, "pi", ""):
        notes.append(f"privileged information: {cls.pi}")
    notes.append("from: " + (cls.plugin or "built-in"))
    fields = fields_of(cls)
    for name, mf in cls.model_fields.items():  # a nested settings block that is no component (ppo.critic): its fields
        sub = mf.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and not issubclass(sub, registry.Component):
            fields += [FieldDoc(f"{mf.alias or name}.{d.name}", d.type, d.allowed, d.default, d.description)
                       for d in fields_of(sub)]
    return Entry(f"{section}/{cls.kind_name()}", cls.summary(), doc, fields, notes)


def component_entry(section: str, builtins_only: bool = False) -> Entry:
    text = {"sources": "`sources:` privileged-information sources, each a named entry `name: {kind: ..., ...}`; "
                       "signals, guides and other sources refer to them by name.",
            "guide": "`rollout.guide:` who else writes tokens into rollouts (default `{kind: none}`).",
            "environment": "`rollout.environment:` who answers the policy between its turns (default `{kind: none}`: "
                           "one policy turn); an active environment makes each rollout an episode whose answers are "
                           "`environment` tokens, never trained. A plugin registers its own kind (reset / step, text "
                           "in and out).",
            "signal": "`signal:` (or a term's `signal`): where the learning signal comes from.",
            "objective": "`objective:` (or a term's `objective`): how the signal becomes a loss.",
            "estimator": "`objective.estimator:` (grpo): how rewards and groups become advantages.",
            "token_selection": "`objective.token_selection:` (grpo): tokens of the whole step chosen by a statistic "
                               "(KL-Cov, Clip-Cov), whose loss term changes.",
            "off_policy_weight": "`objective.off_policy_weight:` (grpo): the importance weight of loss tokens the policy "
                                 "did not write (a trace of the `traces` guide, a guide's prefix), a function of the "
                                 "current policy's probability alone (LUFFY's policy shaping).",
            "correction": "`objective.correction:` (grpo): rollout correction, each policy token's loss weighted by a "
                          "function of pi_old / mu, the trainer over the sampler (TIS, MIS, IcePop), apart from the "
                          "policy ratio's bound."}[section]
    kinds = [kind_entry(section, c) for _, c in sorted(registry.kinds(section).items())
             if _included(c, builtins_only)]
    return Entry(section, text, kinds=kinds)


def verifier_entry(builtins_only: bool = False) -> Entry:
    rows = [(n, v.description) for n, v in sorted(registry.VERIFIERS.items())
            if not (builtins_only and not v.module.startswith("components."))]
    return Entry("verifiers", "Verifier names for `outcome_reward.verifier` (`auto`: the task's own).", rows=rows)


def section_entry(key: str, builtins_only: bool = False) -> Entry:
    """A top-level section of the spec, with every field where it has fields."""
    if key in COMPONENT_SECTIONS:
        return component_entry(key, builtins_only)
    spec = spec_model(builtins_only=builtins_only)
    f = spec.model_fields[key]
    if key in _MODELS:
        fields = fields_of(_MODELS[key], skip=("guide", "environment"))
        for name, mf in _MODELS[key].model_fields.items():  # a nested settings block (policy.lora): its fields too
            try:
                sub = _item_model(mf.annotation)
            except TypeError:
                continue
            if name not in ("guide", "environment"):
                fields += [FieldDoc(f"{name}.{d.name}", d.type, d.allowed, d.default, d.description)
                           for d in fields_of(sub)]
        if key == "rollout":
            guide = spec.model_fields["rollout"].annotation.model_fields["guide"]
            kinds = [k for k, c in sorted(registry.kinds("guide").items()) if _included(c, builtins_only)]
            fields.append(FieldDoc("guide", "guide component", kinds, _default(guide), guide.description or ""))
            env = spec.model_fields["rollout"].annotation.model_fields["environment"]
            kinds = [k for k, c in sorted(registry.kinds("environment").items()) if _included(c, builtins_only)]
            fields.append(FieldDoc("environment", "environment component", kinds, _default(env),
                                   env.description or ""))
        return Entry(key, f.description or "", fields=fields)
    if key in _ITEM_OF:
        note = {"phases": ("Each phase is merged over the base spec for the steps from the previous phase's "
                           "`until` up to its own; the last `until` is train.steps. A changed `kind` replaces a "
                           "component whole"),
                "stages": ("Each stage is merged over the base spec and runs its own train.steps, starting from "
                           "the previous stage's weights. A changed `kind` replaces a component whole"),
                "terms": ("Write `terms:` instead of `signal:` + `objective:`; the terms' losses are summed with "
                          "their weights")}[key]
        item = _item_model(f.annotation)
        fields = fields_of(item)
        if key == "terms":  # a term's gate: its conditions, as gate.<field> (composer list gate)
            from composer.gates import Gate

            fields += [FieldDoc(f"gate.{d.name}", d.type, d.allowed, d.default, d.description) for d in fields_of(Gate)]
        return Entry(key, f.description or "", fields=fields, notes=[note],
                     fields_title=f"Fields of {_ITEM_OF[key]}:")
    return Entry(key, f.description or "", fields=fields_of(_only(spec, key)))


def _item_model(annotation) -> type[BaseModel]:
    """The model inside list[...] / Optional[...]."""
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        if typing.get_args(arg):
            return _item_model(arg)
    raise TypeError(f"no model in {annotation!r}")


def _only(spec: type[BaseModel], key: str) -> type[BaseModel]:
    """A one-field model, so that a scalar section is described like any field."""
    f = spec.model_fields[key]
    return create_model(f"Top_{key}", **{key: (f.annotation, f)})


def overview(builtins_only: bool = False) -> list[FieldDoc]:
    """One row per top-level key of a spec."""
    return fields_of(spec_model(builtins_only=builtins_only))


# ------------------------------------------------------------------------------------------ topics

GATE_TOPICS = ("gate", "gates", "terms.gate")


def gate_entry() -> Entry:
    """`terms[].gate`: the row predicate a term trains on (composer/gates.py)."""
    from composer.gates import Gate

    return Entry("gate", "`terms[].gate:` " + (Gate.__doc__ or "").strip(), fields=fields_of(Gate),
                 notes=["written under a term: terms: [{signal: ..., objective: ..., gate: {outcome: failure}}]",
                        "rows outside the gate get no loss from the term and do not count in its normaliser; "
                        "`explain` prints each gate in words, and the run logs the fraction of rows it kept"])


def topics() -> list[str]:
    return [*SPEC_KEYS, "guide", "environment", "estimator", "token_selection", "off_policy_weight", "correction", "gate",
            "verifiers"]


class UnknownTopic(ValueError):
    def __init__(self, message: str, word: str, choices):
        super().__init__(message)
        self.hint = did_you_mean(word, choices)


def entries_for(topic: str, builtins_only: bool = False) -> list[Entry]:
    """`train`, `objective`, `objective/grpo`, `grpo` (a kind name found in one section), `verifiers`."""
    topic = topic.strip().strip("/")
    if topic in VERIFIER_TOPICS:
        return [verifier_entry(builtins_only)]
    if topic in GATE_TOPICS:
        return [gate_entry()]
    if "/" in topic:
        section, kind = topic.split("/", 1)
        section = {"rollout.guide": "guide", "rollout.environment": "environment"}.get(section, section)
        if section not in COMPONENT_SECTIONS:
            raise UnknownTopic(f"'{section}' has no kinds; sections with kinds: {', '.join(COMPONENT_SECTIONS)}",
                               section, COMPONENT_SECTIONS)
        known = {k: c for k, c in registry.kinds(section).items() if _included(c, builtins_only)}
        if kind not in known:
            raise UnknownTopic(f"no {section} kind '{kind}'; kinds: {', '.join(sorted(known))}", kind, known)
        return [kind_entry(section, known[kind])]
    if topic in SPEC_KEYS or topic in COMPONENT_SECTIONS:
        return [section_entry(topic, builtins_only)]
    found = [(s, c) for s in COMPONENT_SECTIONS for k, c in registry.kinds(s).items()
             if k == topic and _included(c, builtins_only)]
    if len(found) == 1:
        return [kind_entry(*found[0])]
    kinds = [k for sec in COMPONENT_SECTIONS for k in registry.kinds(sec)]
    raise UnknownTopic(f"unknown topic '{topic}': a top-level key ({', '.join(SPEC_KEYS)}), guide, gate, verifiers, "
                       "or SECTION/KIND (objective/grpo)", topic, topics() + kinds)


# ------------------------------------------------------------------------------------------ Markdown

def _md_cell(text: str) -> str:
    """A table cell: one line, `|` escaped, `<` escaped outside code spans (GitHub would read it as HTML)."""
    parts = text.replace("\n", " ").split("`")
    parts = [p.replace("<", "&lt;") if i % 2 == 0 else p for i, p in enumerate(parts)]
    return "`".join(parts).replace("|", "\\|")


def _md_code(text: str) -> str:
    return f"``{text}``" if "`" in text else f"`{text}`"


def _md_fields(fields: list[FieldDoc], head: str = "field") -> list[str]:
    out = [f"| {head} | type | allowed values | default | description |", "| --- | --- | --- | --- | --- |"]
    for f in fields:
        allowed = ", ".join(_md_code(v) for v in f.allowed)
        default = f.default if f.default in PLAIN_DEFAULTS else _md_code(f.default)
        out.append(f"| {_md_code(f.name)} | {_md_cell(f.type)} | {_md_cell(allowed)} | {_md_cell(default)} | "
                   f"{_md_cell(f.description)} |")
    return out


def _md_entry(e: Entry, level: int) -> list[str]:
    out = [f"{'#' * level} `{e.topic}`", ""]
    if e.doc:
        out += ["```text", e.doc, "```", ""]
    elif e.summary:
        out += [_md_cell(e.summary), ""]
    if e.notes:
        out += [_md_cell("; ".join(n.rstrip(".") for n in e.notes)) + ".", ""]
    if e.fields_title:
        out += [e.fields_title, ""]
    if e.fields:
        out += _md_fields(e.fields) + [""]
    if e.rows:
        out += ["| name | description |", "| --- | --- |"]
        out += [f"| {_md_code(n)} | {_md_cell(d)} |" for n, d in e.rows] + [""]
    for k in e.kinds:
        out += _md_entry(k, level + 1)
    return out


def markdown(builtins_only: bool = True) -> str:
    """The whole reference page (docs/reference.md)."""
    out = ["# Spec reference", "",
           f"Generated from the spec models and the component registry by `{REGEN}`"
           + (" (built-in kinds only)" if builtins_only else "") + "; a test fails when it is stale. The same "
           "text in a terminal: `composer list SECTION` or `composer list SECTION/KIND` (e.g. "
           "`composer list objective/advantage_regression`).", "",
           "## Top-level sections", "",
           ("A spec is one YAML mapping with these keys. Defaults are the components' own; a key left out "
            "takes its default."), ""]
    out += _md_fields(overview(builtins_only), head="key") + [""]
    for key in SPEC_KEYS:
        if key in ("name", "summary", "extends", "plugins"):
            continue
        for e in entries_for(key, builtins_only):
            out += _md_entry(e, 2)
        if key == "rollout":
            out += _md_entry(component_entry("guide", builtins_only), 2)
            out += _md_entry(component_entry("environment", builtins_only), 2)
        if key == "objective":  # the kinds of grpo's `estimator` field
            out += _md_entry(component_entry("estimator", builtins_only), 2)
            out += _md_entry(component_entry("token_selection", builtins_only), 2)  # and of its `token_selection`
            out += _md_entry(component_entry("off_policy_weight", builtins_only), 2)  # and `off_policy_weight`
            out += _md_entry(component_entry("correction", builtins_only), 2)  # and `correction`
    out += _md_entry(verifier_entry(builtins_only), 2)
    return "\n".join(re.sub(r"[ \t]+$", "", line) for line in out).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------------ terminal
# Everything printed goes through rich.text.Text (never markup: formulas hold [brackets]) and wraps at the
# terminal's width (never an ellipsis: a cut field name cannot be typed).

def _fields_grid(fields: list[FieldDoc]):
    """name | type, allowed values, default, and the description below them."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", overflow="fold")
    grid.add_column(overflow="fold")
    for f in fields:
        cell = Text(f.type)
        if f.allowed:
            cell.append("; one of: ", style="dim")
            cell.append(", ".join(f.allowed))
        cell.append("; default: ", style="dim")
        cell.append(f.default)
        if f.description:
            cell.append("\n" + f.description)
        grid.add_row(Text(f.name), cell)
    return grid


def _indented(renderable, left: int = 2):
    from rich.padding import Padding

    return Padding(renderable, (0, 0, 0, left), expand=False)


def render_entry(console, e: Entry, level: int = 0) -> None:
    from rich.text import Text

    console.print(Text(e.topic, style="bold underline" if not level else "bold"))
    body = e.doc or e.summary
    if body:
        console.print(_indented(Text(body)))
    if e.notes:
        console.print(_indented(Text("; ".join(n.rstrip(".") for n in e.notes) + ".", style="dim")))
    if e.fields_title:
        console.print(_indented(Text(e.fields_title)))
    if e.fields:
        console.print(_indented(_fields_grid(e.fields)))
    if e.rows:
        grid = _fields_grid([])
        for name, desc in e.rows:
            grid.add_row(Text(name), Text(desc))
        console.print(_indented(grid))
    for k in e.kinds:
        console.print()
        render_entry(console, k, level + 1)


def _table(title: str, *columns: str):
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title, style="bold"), title_justify="left", show_lines=False, expand=False)
    for i, c in enumerate(columns):
        table.add_column(c, style="bold" if i == 0 else None, overflow="fold")
    return table


def render_overview(console, builtins_only: bool = False) -> None:
    """`composer list`: every top-level key, every kind with its summary, every verifier."""
    from rich.text import Text

    table = _table("The spec language: top-level keys (`composer list KEY` shows every field)",
                   "key", "type", "what it is")
    for f in overview(builtins_only):
        typ = f.type + (f" ({', '.join(f.allowed)})" if f.allowed else "")
        table.add_row(Text(f.name), Text(typ), Text(f.description))
    console.print(table)
    for section in COMPONENT_SECTIONS:
        e = component_entry(section, builtins_only)
        table = _table(f"{section} kinds (`composer list {section}/KIND` shows its fields, formula and paper)",
                       "kind", "description", "from")
        for k in e.kinds:
            table.add_row(Text(k.topic.split("/", 1)[1]), Text(k.summary),
                          Text(next(n for n in k.notes if n.startswith("from: "))[len("from: "):]))
        console.print(table)
    table = _table("verifiers (outcome_reward.verifier)", "name", "description")
    for name, desc in verifier_entry(builtins_only).rows:
        table.add_row(Text(name), Text(desc))
    console.print(table)
    console.print(Text(f"The whole reference as Markdown: docs/reference.md (`{REGEN}`).", style="dim"))


def entry_markdown(e: Entry) -> list[str]:
    """One section or kind as Markdown (`composer list TOPIC --markdown`)."""
    return _md_entry(e, 2)
