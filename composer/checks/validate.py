"""Validation in layers (DESIGN.md section 3): YAML, schema, graph, method semantics.

Each layer reports all its problems together; validation stops at the first layer that fails.
Nothing here imports torch, transformers or lightning.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from composer import registry
from composer.checks import graph
from composer.checks import data as data_checks
from composer.checks import inert
from composer.checks import rules
from composer.errors import Diagnostic, Location, SpecError
from composer.lang.loader import LoadedSpec, deep_merge, load_spec
from composer.lang.schema_errors import diagnostics_from
from composer.lang.spec import PARTIAL_KEYS, Train, spec_model


@dataclass
class Segment:
    """A step range with its resolved spec: the base, or the base with one phase or stage merged in."""

    name: str  # "main", "phase0", or the stage name
    start: int
    end: int  # exclusive
    spec: Any
    data: dict
    origin: tuple = ()  # ("phases", i) or ("stages", i): where its overrides stand

    @property
    def stage(self) -> str | None:
        return self.name if self.origin[:1] == ("stages",) else None


@dataclass
class Validated:
    loaded: LoadedSpec
    spec: Any
    segments: list[Segment]
    warnings: list[Diagnostic] = field(default_factory=list)

    @property
    def total_steps(self) -> int:
        return self.segments[-1].end if self.segments else 0


def _locate(diags: list[Diagnostic], loaded: LoadedSpec, origin: tuple = ()) -> list[Diagnostic]:
    for d in diags:
        if d.location is None:
            d.location = None
            if origin and _in_segment(loaded, origin, d.path):
                d.location = loaded.locate(origin + d.path)
                d.path = origin + d.path
            if d.location is None:
                d.location = loaded.locate(d.path) or Location(loaded.file, 1, 1)
    return diags


def _depth(data, path) -> int:
    """How many leading elements of `path` exist in `data`."""
    n = 0
    while n < len(path) and _exists(data, path[: n + 1]):
        n += 1
    return n


def _in_segment(loaded: LoadedSpec, origin: tuple, path: tuple) -> bool:
    """Whether the phase/stage at `origin` wrote what `path` names (rather than the base spec)."""
    phase = loaded.data
    for p in origin:
        phase = phase[p] if _exists(phase, (p,)) else {}
    here = _depth(phase, path)
    if any(isinstance(_get(phase, path[:k]), list) for k in range(1, here + 1)):
        return True  # a list the phase wrote (its `terms`) replaces the base spec's whole: all under it is the phase's
    return here >= 1 and here >= _depth(loaded.data, path)


def _get(data, path):
    for p in path:
        data = data[p]
    return data


def _exists(data, path) -> bool:
    cur = data
    for p in path:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and isinstance(p, int) and 0 <= p < len(cur):
            cur = cur[p]
        else:
            return False
    return True


def _label(seg: Segment) -> str:
    if seg.origin[:1] == ("phases",):
        return f"phase {seg.origin[1]} (steps {seg.start}-{seg.end})"
    return f"stage '{seg.name}'"


def _nan_paths(value, path: tuple):
    if isinstance(value, float) and value != value:
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _nan_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nan_paths(v, path + (i,))


PLUGIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
TRUST_HINT = (f"importing a module runs its code: if you trust this spec and the module, rerun with --allow-plugins "
              f"(or {registry.ALLOW_PLUGINS_ENV}=1); an installed plugin package (entry point "
              f"`{registry.ENTRY_POINT_GROUP}`) loads without it")


SHADOW_HINT = ("rename the kind (or verifier) in the plugin's code, and use that name in the spec; the built-in one "
               "is the one its documentation describes and `composer check` verifies")


def entry_point_gate(loaded: LoadedSpec) -> list[Diagnostic]:
    """An installed plugin that tried to replace a built-in kind or verifier: every spec is refused until it is
    fixed or uninstalled (the names a spec uses would not mean what their documentation says)."""
    return [Diagnostic("schema", msg, (), Location(str(loaded.file), 1, 1),
                       "fix the plugin package (a plugin adds names) or `pip uninstall` it")
            for msg in registry.entry_point_refusals()]


def load_plugins(loaded: LoadedSpec) -> tuple[list[Diagnostic], list[Diagnostic]]:
    """Import the modules the spec names in `plugins:` (and nothing else): (errors, warnings).

    A module is imported only when the person running the command allows it (validating a spec someone
    sent must never run code), already imported or not (a bundle would ship it); an installed
    entry-point plugin's module is accepted; a standard-library module is never a plugin. A plugin that tries to
    replace a built-in kind or verifier is an error at its `plugins:` entry (the trust boundary of names).
    """
    names = loaded.data.get("plugins") or []
    if not isinstance(names, list):
        return [], []  # the schema layer reports the type
    errors, warnings = [], []
    for i, name in enumerate(names):
        if not isinstance(name, str):
            continue
        where = loaded.locate(("plugins", i))
        if not PLUGIN_NAME.match(name):
            errors.append(Diagnostic("schema", f"{name!r} is not a module name", ("plugins", i), where,
                                     "write a dotted module name, e.g. my_package.components"))
            continue
        if name.split(".")[0] in sys.stdlib_module_names:
            errors.append(Diagnostic("schema", f"'{name}' is a standard-library module, not a plugin", ("plugins", i),
                                     where, "remove it from plugins: (a bundle would ship this machine's copy "
                                     "over the cluster's)"))
            continue
        if name in sys.modules and registry.installed_plugin(name):
            continue  # an installed entry-point plugin: the user's own choice, already imported
        if not registry.spec_plugins_allowed():
            errors.append(Diagnostic("schema", f"the spec asks to import module '{name}'; not imported", ("plugins", i),
                                     where, TRUST_HINT))
            continue
        before = len(registry.PLUGIN_ERRORS)
        try:
            with registry.loading_plugin(name, f"plugin module '{name}'"):
                importlib.import_module(name)
        except Exception as e:  # a plugin's own errors must become a diagnostic, not a traceback
            errors.append(Diagnostic("schema", f"plugin module '{name}' cannot be imported: {type(e).__name__}: {e}",
                                     ("plugins", i), where, "install the package that provides it (pip install -e), put the folder that holds it on PYTHONPATH, or fix the module name"))
        errors += [Diagnostic("schema", msg, ("plugins", i), where, SHADOW_HINT) for msg in registry.refusals(name)]
        registry.SPEC_PLUGIN_ERRORS.extend(registry.PLUGIN_ERRORS[before:])
        warnings += [Diagnostic("schema", f"plugin module '{name}': {msg}", ("plugins", i), where,
                                "the built-in kind stays in use", severity="warning")
                     for msg in registry.PLUGIN_ERRORS[before:]]
    return errors, warnings


# What a phase or stage may set under `train:` and `rollout:`: everything the step reads from the segment
# in force. The rest is fixed for the run (the engine, devices, the seed, checkpointing).
SEGMENT_TRAIN = ("prompts_per_step", "lr", "betas", "weight_decay", "warmup_steps", "lr_schedule", "grad_clip",
                 "entropy_coef", "eval_every", "reference", "reset_every", "reset_what", "freeze_policy")
RUN_ROLLOUT = ("engine", "precision", "gpu_memory_utilization", "tensor_parallel_size")


def _segment_settings(loaded: LoadedSpec, origin: tuple, staged: bool) -> list[Diagnostic]:
    """Run-level settings a phase or stage cannot change, and a stage's own step count."""
    part = loaded.data[origin[0]][origin[1]]
    out = []
    if not isinstance(part, dict):
        return out
    train = part.get("train") if isinstance(part.get("train"), dict) else {}
    rollout = part.get("rollout") if isinstance(part.get("rollout"), dict) else {}
    what = "stage" if staged else "phase"
    allowed = SEGMENT_TRAIN + (("steps", "optimizer_at_stage", "critic_at_stage") if staged else ())
    for key in train:
        if key not in allowed and key in Train.model_fields:
            out.append(Diagnostic("semantics", f"train.{key} is a setting of the whole run; a {what} cannot change it",
                                  origin + ("train", key), None,
                                  f"set train.{key} at the top level; a {what} may set train."
                                  + ", train.".join(allowed), rule="segment_settings"))
    for key in rollout:
        if key in RUN_ROLLOUT:
            out.append(Diagnostic("semantics", f"rollout.{key} is fixed for the run (the engine is built once); a "
                                  f"{what} cannot change it", origin + ("rollout", key), None,
                                  f"set rollout.{key} at the top level", rule="segment_settings"))
    if staged and "steps" not in train:
        out.append(Diagnostic("semantics", f"stage '{part.get('name', origin[1])}' does not say how many steps it "
                              "runs", origin, None, "give every stage its own `train: {steps: N}` (in a staged "
                              "spec each stage counts its own steps; the run is their sum)", rule="staged_steps"))
    return out


def _staged_top_steps(loaded: LoadedSpec) -> list[Diagnostic]:
    """train.steps at the top level of a staged spec would be ignored: refused, with the way to say it."""
    train = loaded.data.get("train")
    if not isinstance(train, dict) or "steps" not in train:
        return []
    n = len(loaded.data.get("stages") or [])
    return [Diagnostic("semantics", "train.steps at the top level does not apply to a staged spec: each stage runs "
                       "its own train.steps", ("train", "steps"), None,
                       "remove it, and set each stage's steps (in the file: `train: {steps: N}` under the stage; "
                       f"as overrides: {' '.join(f'stages.{i}.train.steps=N' for i in range(n))})",
                       rule="staged_steps")]


def patch_terms(base_terms, over_terms):
    """A phase's or stage's `terms` over the base's: when every entry names a term of the base (`name`), those
    terms are patched in place (deep-merged; a different kind replaces a component whole) and the others kept,
    so a phase that changes one term's weight need not repeat the rest; otherwise the list replaces the base's."""
    if not (isinstance(base_terms, list) and isinstance(over_terms, list) and over_terms):
        return over_terms
    names = [t.get("name") if isinstance(t, dict) else None for t in base_terms]
    if not all(isinstance(t, dict) and t.get("name") is not None and t.get("name") in names for t in over_terms):
        return over_terms
    patches = {t["name"]: t for t in over_terms}
    return [deep_merge(t, patches[n]) if n in patches else t for t, n in zip(base_terms, names)]


def _segment_data(base: dict, part: dict) -> dict:
    over = {k: v for k, v in part.items() if k in PARTIAL_KEYS}
    if "terms" in over:
        over["terms"] = patch_terms(base.get("terms"), over["terms"])
    merged = deep_merge(base, over)
    merged.pop("phases", None)
    merged.pop("stages", None)
    return merged


def _validate_segment(model, data: dict, loaded: LoadedSpec, origin: tuple) -> tuple[Any, list[Diagnostic]]:
    try:
        return model.model_validate(data), []
    except ValidationError as e:
        view = LoadedSpec(data, loaded.positions, loaded.file)

        def locate(path):
            if origin and _in_segment(loaded, origin, path):
                return loaded.locate(origin + path)
            return loaded.locate(path)

        diags = diagnostics_from(e, view, model, locate=locate)
        for d in diags:  # a problem the phase or stage wrote is named by its own path
            if _in_segment(loaded, origin, d.path):
                d.path = origin + d.path
        return None, diags


REMOTE_CODE_HINT = (f"a model folder's own Python runs only when the person running the command allows it: if you "
                    f"trust the folder, rerun with --trust-remote-code (or {registry.TRUST_REMOTE_CODE_ENV}=1)")


def _trusted_paths(value, path: tuple):
    """Where the spec sets `trust_remote_code` to something other than false."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "trust_remote_code" and v not in (False, None):
                yield path + (k,)
            else:
                yield from _trusted_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _trusted_paths(v, path + (i,))


def remote_code_gate(loaded: LoadedSpec) -> list[Diagnostic]:
    """A spec asking to run a model folder's code, refused unless the user opted in (the trust boundary)."""
    if registry.remote_code_allowed():
        return []
    return [Diagnostic("schema", "the spec asks to run the Python code a model folder ships; not allowed", p,
                       loaded.locate(p) or Location(loaded.file, 1, 1), REMOTE_CODE_HINT)
            for p in _trusted_paths(loaded.data, ())]


def validate_loaded(loaded: LoadedSpec) -> Validated:
    """Run layers 2-4 on loaded YAML. Raises SpecError with every diagnostic of the failing layer."""
    registry.load_all()
    diags, plugin_warnings = load_plugins(loaded)
    diags += entry_point_gate(loaded) + remote_code_gate(loaded)
    if diags:
        raise SpecError(diags + plugin_warnings)
    model = spec_model()
    spec = _schema_layer(model, loaded)
    base = {k: v for k, v in loaded.data.items() if k not in ("phases", "stages", "extends")}
    segments = _segments(model, spec, loaded, base)
    used = _graph_layer(spec, segments, loaded, base)
    warnings = plugin_warnings + [Diagnostic("graph", f"source '{n}' is declared but nothing reads it", ("sources", n),
                                             loaded.locate(("sources", n)), "remove it, or refer to it from a signal, "
                                             "guide or another source", severity="warning")
                                  for n in spec.sources if n not in used]
    return Validated(loaded, spec, segments, warnings + _rules_layer(spec, segments, loaded, warnings))


def _schema_layer(model, loaded: LoadedSpec):
    """Layer 2: the pydantic spec, or SpecError with located diagnostics (a .nan anywhere is one)."""
    nans = [Diagnostic("schema", "not a number (.nan)", p, loaded.locate(p) or Location(loaded.file, 1, 1),
                       "write a number: no setting takes .nan") for p in _nan_paths(loaded.data, ())]
    try:
        spec = model.model_validate(loaded.data)
    except ValidationError as e:
        raise SpecError(nans + [d for d in diagnostics_from(e, loaded, model)
                                if d.path not in {n.path for n in nans}]) from None
    if nans:
        raise SpecError(nans)
    return spec


def _segments(model, spec, loaded: LoadedSpec, base: dict) -> list[Segment]:
    """Phases and stages as step ranges: each resolved segment must be a valid spec on its own."""
    if spec.stages:
        return _stage_segments(model, spec, loaded, base)
    if spec.phases:
        return _phase_segments(model, spec, loaded, base)
    return [Segment("main", 0, spec.train.steps, spec, base)]


def _stage_segments(model, spec, loaded: LoadedSpec, base: dict) -> list[Segment]:
    settings = _staged_top_steps(loaded)
    for i in range(len(spec.stages)):
        settings += _segment_settings(loaded, ("stages", i), True)
    if settings:
        raise SpecError(_locate(settings, loaded))
    segments, diags, start = [], [], 0
    for i, st in enumerate(spec.stages):
        data = _segment_data(base, loaded.data["stages"][i])
        seg_spec, d = _validate_segment(model, data, loaded, ("stages", i))
        for x in d:
            x.message = f"in stage '{st.name}': {x.message}"
        diags += d
        if seg_spec is not None:
            segments.append(Segment(st.name, start, start + seg_spec.train.steps, seg_spec, data, ("stages", i)))
            start += seg_spec.train.steps
    if diags:
        raise SpecError(_locate(diags, loaded))
    return segments


def _phase_segments(model, spec, loaded: LoadedSpec, base: dict) -> list[Segment]:
    settings = [d for i in range(len(spec.phases)) for d in _segment_settings(loaded, ("phases", i), False)]
    if settings:
        raise SpecError(_locate(settings, loaded))
    segments, diags, start = [], [], 0
    for i, ph in enumerate(spec.phases):
        data = _segment_data(base, loaded.data["phases"][i])
        seg_spec, d = _validate_segment(model, data, loaded, ("phases", i))
        for x in d:
            x.message = f"in phase {i} (steps {start}-{ph.until}): {x.message}"
        diags += d
        end = min(ph.until, spec.train.steps)
        if seg_spec is not None and end > start:
            segments.append(Segment(f"phase{i}", start, end, seg_spec, data, ("phases", i)))
        start = max(start, ph.until)
    if diags:
        raise SpecError(_locate(diags, loaded))
    return segments


def _graph_layer(spec, segments: list[Segment], loaded: LoadedSpec, base: dict) -> set[str]:
    """Layer 3: the graph of each segment (and of the base spec under phases or stages); the sources read."""
    used: set[str] = set()
    diags: list[Diagnostic] = []
    for seg in segments or [Segment("main", 0, 0, spec, base)]:
        g, d = graph.check(seg.spec)
        for x in d:
            if seg.origin:
                x.message = f"in {_label(seg)}: {x.message}"
        diags += _locate(d, loaded, seg.origin)
        used |= graph.used_sources(g)
    if segments and segments[0].origin:  # phases or stages: the base spec, which the rules also read, too
        diags += _locate(graph.check(spec)[1], loaded)
    if diags:
        raise SpecError(_dedupe(diags))
    return used


def _rules_layer(spec, segments: list[Segment], loaded: LoadedSpec, warnings: list[Diagnostic]) -> list[Diagnostic]:
    """Layer 4: method semantics, on the base spec and each segment; its warnings (SpecError on an error,
    carrying the earlier `warnings` too)."""
    diags = _locate(rules.check(spec, "base"), loaded)
    steps_at = loaded.locate(("train", "steps"))
    if not (steps_at and steps_at.file.startswith("<override")):  # phases the file itself does not run
        for d in diags:
            if d.rule == "phases_run":
                d.severity = "error"
    for seg in segments:
        d = rules.check(seg.spec, seg.name)
        for x in d:
            if seg.origin:
                x.message = f"in {_label(seg)}: {x.message}"
        diags += _locate(d, loaded, seg.origin)
    diags += inert.check(loaded, segments)  # settings that can never act where they stand
    diags += data_checks.check(loaded, spec, segments)  # data files, their columns and rows against the context
    errors = [d for d in _dedupe(diags) if d.severity == "error"]
    found = [d for d in _dedupe(diags) if d.severity == "warning"]
    if errors:
        raise SpecError(errors + warnings + found)
    return found


def _dedupe(diags: list[Diagnostic]) -> list[Diagnostic]:
    seen, out = set(), []
    for d in diags:
        key = (d.path, d.message.split(": ", 1)[-1] if d.message.startswith("in ") else d.message)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def validate_file(path: str | Path, overrides: list[str] | None = None) -> Validated:
    """Load and validate a spec file. Raises SpecError."""
    return validate_loaded(load_spec(path, overrides))
