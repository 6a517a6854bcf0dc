"""Settings that can never act, refused at validation (layer 4, after composer/checks/rules.py).

A rule of rules.py sees one resolved segment. A setting written once in the base spec governs every phase that
does not override it, and may act in one phase and not in another (an off_policy_ok that matters only in the
lagged phase): refusing it because one segment cannot use it would be wrong. So each check here looks at one
segment and reports every setting it examines, as `Finding(path, inert, ...)`; `check` groups the findings by
where the spec wrote the setting (the base spec, or the phase or stage that wrote it) and refuses a setting only
when it is inert in every segment it governs.

The checks (each names its rule in the diagnostic):
  sync_settings     sync.reuse / sync.off_policy_ok where nothing they allow happens (a sync every step, ...)
  objective_settings what an objective reports through `Objective.inert(spec)`: a KL estimator with kl_coef 0,
                    impossible clip bounds (clip_low > 1), `clip` hidden by clip_low and clip_high, a clip that one
                    on-policy update per step keeps from acting (a warning), fields of another measure/estimator
  gate_selects      a term gate whose conditions no rollout row can meet together (searched exhaustively over the
                    group sizes the run can make)
  reward_parts      a reward part that repeats a reward already in the sum
  filter_keeps      a rollout filter that provably keeps no row (or only empty answers)
  schedule_acts     a schedule that never changes over the steps it governs (its `begin` at or after the end),
                    a scheduled term weight that is 0 there (the term never trains)

No torch: validation stays instant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel

from composer.errors import Diagnostic, Location


@dataclass
class Finding:
    """A setting a check examined in one segment, at `path` in the segment's resolved spec."""

    path: tuple
    inert: bool
    message: str = ""
    hint: str = ""
    severity: str = "error"
    scheduled: bool = False  # depends on the run's length: a warning when train.steps came from an override


CHECKS: dict[str, Callable] = {}


def inert_check(name: str):
    def deco(fn):
        CHECKS[name] = fn
        return fn

    return deco


def _terms(spec):
    """(path prefix, term or None, signal, objective) of each signal/objective pair."""
    if spec.terms:
        for i, t in enumerate(spec.terms):
            yield ("terms", i), t, t.signal, t.objective
    elif spec.signal is not None or spec.objective is not None:
        yield (), None, spec.signal, spec.objective


# ------------------------------------------------------------------------------------------------ sync

@inert_check("sync_settings")
def sync_settings(spec, seg) -> Iterable[Finding]:
    s, t = spec.sync, spec.train
    objs = [o for _p, _t, _s, o in _terms(spec) if o is not None]
    if s.reuse and "reuse" in s.model_fields_set:
        yield Finding(("sync", "reuse"), s.every == 1,
                      "sync.reuse with sync.every: 1: the buffer is sampled anew at every step, so every step trains "
                      "once on fresh rollouts, exactly as without reuse",
                      "remove sync.reuse, or set sync.every > 1 (e.g. 10) to train several steps on one sampled buffer")
    if s.off_policy_ok and "off_policy_ok" in s.model_fields_set:
        lag = s.every > 1 and any(o.capabilities().on_policy_only for o in objs)
        repeats = t.epochs * t.mini_batches > 1 and any(type(o).several_updates is None for o in objs)
        if s.every == 1 and t.epochs * t.mini_batches == 1:
            why = ("with a sync every step and one update per step, every rollout is trained on by the weights "
                   "that sampled it: there is no lag to allow")
        else:
            why = ("nothing it permits happens here: no on-policy objective reads lagged rollouts and no objective "
                   "without an importance ratio is updated several times per step")
        yield Finding(("sync", "off_policy_ok"), not (lag or repeats), f"sync.off_policy_ok: {why}",
                      "remove off_policy_ok (it only permits sync.every > 1 with an objective that assumes on-policy "
                      "data, or several updates per step without an importance ratio)")


# ------------------------------------------------------------------------------------------- objectives

@inert_check("objective_settings")
def objective_settings(spec, seg) -> Iterable[Finding]:
    for base, _t, _sig, obj in _terms(spec):
        if obj is None:
            continue
        found = {}
        for x in obj.inert(spec):
            found.setdefault(x.field, x)
        for field in sorted(obj.model_fields_set):
            x = found.get(field)
            path = base + ("objective", field)
            if x is None:
                yield Finding(path, False)
            else:
                yield Finding(path, True, f"{obj.kind_name()}: {x.reason}", x.hint, x.severity)


# ------------------------------------------------------------------------------------------------ gates

CONDITIONS = ("outcome", "group_success_at_most", "group_success_above", "sibling_success")


def _holds(gate, field: str, size: int, hits: int, own: int) -> bool:
    """One gate condition on a row with own success `own` (0/1) in a group of `size` rows with `hits`
    successes (as composer/gates.py computes them, with its 1e-9 tolerance)."""
    rate = hits / size
    v = getattr(gate, field)
    if field == "outcome":
        return own == (1 if v == "success" else 0)
    if field == "group_success_at_most":
        return rate <= v + 1e-9
    if field == "group_success_above":
        return rate > v + 1e-9
    return (hits - own > 0) == v  # sibling_success


def _worlds(sizes, own_row: bool):
    for size in sizes:
        for hits in range(size + 1):
            for own in ((0, 1) if own_row else (0,)):
                if own <= hits and (own or hits < size):  # the row's own success is one of the hits
                    yield size, hits, own


def _selectable(gate, fields, sizes, own_row: bool) -> bool:
    return any(all(_holds(gate, f, *w) for f in fields) for w in _worlds(sizes, own_row))


@inert_check("gate_selects")
def gate_selects(spec, seg) -> Iterable[Finding]:
    """Every (group size, successes in the group, the row's own outcome) the run can make is tried: a gate that
    no such row passes never selects a row, whatever the policy does. Entropy quantiles are relative to the
    step's rows and always select some; they are left out."""
    n = spec.rollout.samples_per_prompt
    sizes = range(1, n + 1) if spec.rollout.filter.truncated == "drop" else [n]  # dropped rows shrink a group
    for base, t, sig, _obj in _terms(spec):
        g = getattr(t, "gate", None)
        if g is None:
            continue
        own_row = not (sig.makes_batch or sig.targets_rows or getattr(sig, "off_policy", "none") != "none")
        fields = [f for f in CONDITIONS if getattr(g, f) is not None and (own_row or f.startswith("group"))]
        if not fields:
            continue
        ok = _selectable(g, fields, sizes, own_row)
        culprit = fields
        if not ok:  # the smallest set of conditions that already selects nothing
            for k in range(1, len(fields) + 1):
                subsets = [c for c in _subsets(fields, k) if not _selectable(g, c, sizes, own_row)]
                if subsets:
                    culprit = subsets[0]
                    break
        words = ", ".join(f"{f}: {_val(getattr(g, f))}" for f in culprit)
        groups = f"groups of {n}" + (" or fewer (truncated: drop)" if len(sizes) > 1 else "")
        yield Finding(base + ("gate", culprit[-1]), not ok,
                      f"the gate {{{words}}} can never select a row (in {groups}, no rollout row meets "
                      f"{'it' if len(culprit) == 1 else 'these together'}): the term never trains, its loss is 0",
                      "sample several responses per prompt: a group of one has no sibling"
                      if max(sizes) == 1 and "sibling_success" in culprit else
                      "drop or change one of these conditions (a row that succeeded is in a group with a success "
                      "rate above 0; a failed row in one with a rate below 1; no rate exceeds 1)")


def _subsets(items, k):
    from itertools import combinations

    return [list(c) for c in combinations(items, k)]


def _val(v):
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------------------------------- rewards

@inert_check("reward_parts")
def reward_parts(spec, seg) -> Iterable[Finding]:
    for base, _t, sig, _obj in _terms(spec):
        plus = getattr(sig, "plus", None) if sig is not None and sig.kind_name() == "reward" else None
        if not plus:
            continue
        counted = {sig.source: spec.sources.get(sig.source)}
        for name, w in plus.items():
            path = base + ("signal", "plus", name)  # an infinite weight is refused by the schema
            src = spec.sources.get(name)
            same = next((n for n, s in counted.items() if n == name or (s is not None and src is not None
                                                                         and _same_source(s, src))), None)
            if same is not None:
                what = ("the signal's own source" if same == sig.source and same == name
                        else f"the same reward as '{same}' (same kind and settings)")
                yield Finding(path, True, f"plus adds '{name}', {what}, which the sum already holds: that reward is "
                              f"counted twice (the sum adds {w:g} x it on top of the first)",
                              f"remove '{name}' from plus (to weight the reward itself, scale it in its source or "
                              "weight the term)")
            else:
                yield Finding(path, False)
            counted[name] = src


def _same_source(a, b) -> bool:
    return type(a) is type(b) and a.model_dump() == b.model_dump()


# ---------------------------------------------------------------------------------------------- filters

@inert_check("filter_keeps")
def filter_keeps(spec, seg) -> Iterable[Finding]:
    flt = spec.rollout.filter
    if flt.truncated in ("drop", "mask") and "truncated" in flt.model_fields_set:
        yield Finding(("rollout", "filter", "truncated"), spec.rollout.max_new_tokens <= 1,
                      f"truncated: {flt.truncated} with rollout.max_new_tokens {spec.rollout.max_new_tokens}: a "
                      "response of one token is cut unless that token is the end of text, so the filter keeps only "
                      "empty answers: nothing is learnt",
                      "raise rollout.max_new_tokens to what an answer needs, or use truncated: keep")
    if flt.equal_groups == "drop" and "equal_groups" in flt.model_fields_set:
        yield Finding(("rollout", "filter", "equal_groups"), spec.rollout.samples_per_prompt <= 1,
                      "equal_groups: drop with samples_per_prompt 1: a group of one rollout always has equal "
                      "rewards, so every prompt is dropped and every step is filled with dropped prompts",
                      "sample several responses per prompt (DAPO: 16), or remove equal_groups: drop")


# -------------------------------------------------------------------------------------------- schedules

def _changes(sched, a: int, b: int) -> bool:
    """Whether the schedule takes more than one value over global steps a..b-1."""
    if sched.start == sched.end or b - a <= 1:
        return False
    lo, hi = a - sched.begin, b - 1 - sched.begin  # offsets from begin of the first and last step
    if sched.kind == "step":
        return lo < sched.steps <= hi
    return min(max(lo, 0), sched.steps) != min(max(hi, 0), sched.steps)  # strictly monotone on [0, steps]


def _schedules(value, path: tuple):
    from composer.lang.curves import Schedule

    if isinstance(value, Schedule):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _schedules(getattr(value, name), path + (name,))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _schedules(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _schedules(v, path + (i,))


@inert_check("schedule_acts")
def schedule_acts(spec, seg) -> Iterable[Finding]:
    """A schedule governs the steps of its segment, global steps seg.start..seg.end-1."""
    a, b = seg.start, seg.end
    for path, s in _schedules(spec, ()):
        if path[:1] in (("phases",), ("stages",)):
            continue
        moves = _changes(s, a, b)
        v = s.at(a)
        if b - a <= 1:
            why = f"the segment has one step ({a}), at which it is {v:g}"
        elif s.start == s.end:
            why = f"it goes from {s.start:g} to {s.end:g}: it is one number"
        elif s.begin >= b - 1:
            why = f"its begin ({s.begin}) lies at or after the last step ({b - 1}), so it holds its start {v:g}"
        else:
            why = f"it is {v:g} at every one of steps {a}-{b - 1}"
        zero_weight = path[:1] == ("terms",) and path[2:] == ("weight",) and not moves and v == 0
        msg = f"the schedule {s.describe()} never changes over steps {a}-{b - 1}: {why}" if b - a > 1 else \
            f"the schedule {s.describe()} cannot change: {why}"
        if zero_weight:
            msg += "; as this term's weight it is 0 throughout, so the term never trains"
        yield Finding(path, not moves, msg, f"write the number itself ({v:g}), or move begin/steps inside "
                      f"steps {a}-{b - 1}" + ("; remove the term if it should not train" if zero_weight else ""),
                      scheduled=True)


# ---------------------------------------------------------------------------------------------- rollout

VLLM_ONLY = ("gpu_memory_utilization", "tensor_parallel_size")
SAMPLING = ("temperature", "top_p", "top_k")


def _samples_nothing(spec) -> bool:
    """No rollout is ever sampled for training: every term's signal builds its own batch (SFT on references)
    and none builds its targets from rollouts ahead of the steps (InT's offline targets)."""
    from composer.checks.terms import rolls_out, terms

    return not rolls_out(spec) and not any(getattr(sig, "builds_ahead", False) for _n, sig, _o, _w in terms(spec))


def _rollout_inert(spec, field: str) -> tuple[str, str] | None:
    """(why, fix) when rollout.<field> cannot act in this segment, else None."""
    r, t = spec.rollout, spec.train
    if field in VLLM_ONLY and r.engine == "hf" and t.backend == "lightning":
        return (f"rollout.{field} is a vLLM setting, but rollout.engine: hf samples with transformers' generate",
                f"remove {field}, or set rollout.engine: vllm (or auto) to sample with vLLM")
    if _samples_nothing(spec) and not (field in SAMPLING and t.eval_k > 1) and field != "max_new_tokens":
        acts = ("evaluation reads only max_new_tokens (and the sampling settings with train.eval_k > 1), always "
                "with transformers' generate")
        why = f"rollout.{field}: this spec samples no rollouts (its signal trains on demonstrations it builds itself)"
        fix = f"remove rollout.{field}" + (" (or set train.eval_k > 1 to sample at it in evaluation)"
                                           if field in SAMPLING else "")
        return f"{why}; {acts}", fix
    return None


@inert_check("rollout_settings")
def rollout_settings(spec, seg) -> Iterable[Finding]:
    r = spec.rollout
    written = [f for f in sorted(r.model_fields_set) if f not in ("guide", "filter", "environment")]
    written += [f"filter.{f}" for f in sorted(r.filter.model_fields_set)] if _samples_nothing(spec) else []
    for field in written:
        why = _rollout_inert(spec, field)
        yield Finding(("rollout", *field.split(".")), why is not None, *(why or ("", "")))


# ------------------------------------------------------------------------------------------------ train

def _reads_reference(spec) -> bool:
    """Something reads the frozen reference weights: a KL term or A*PO's anchor, a `weights: initial` teacher
    or judge, a guide's calls on the initial policy (POPE's search)."""
    from composer.checks.terms import terms

    guide = spec.rollout.guide
    return (any(obj is not None and obj.wants_initial for _n, _s, obj, _w in terms(spec))
            or any(s.wants_initial for s in spec.sources.values())
            or "initial" in guide.reads().values() or any(c.weights == "initial" for c in guide.model_calls(spec)))


def _stage_index(seg) -> int | None:
    return seg.origin[1] if seg.origin[:1] == ("stages",) else None


@inert_check("train_settings")
def train_settings(spec, seg) -> Iterable[Finding]:
    """Settings of stages on a spec without them (or on its first stage), and periodic resets that never
    happen or reset nothing."""
    from composer.checks.terms import terms

    t, k = spec.train, _stage_index(seg)
    stage_only = {"optimizer_at_stage": "the optimizer state at the start of a stage", "reference": "which weights "
                  "the frozen reference holds in a later stage", "critic_at_stage": "a learned critic at the start "
                  "of a stage"}
    for field, what in stage_only.items():
        if field not in t.model_fields_set:
            continue
        if k is None:
            why = f"train.{field} sets {what}, and this spec has no stages: the run starts once, from its first weights"
        elif field == "critic_at_stage" and not any(o is not None and o.value_model() is not None
                                                    for _n, _s, o, _w in terms(spec)):
            why = "train.critic_at_stage says what becomes of a learned critic, and no term of this stage has one"
        elif field == "reference" and not _reads_reference(spec):
            why = ("train.reference chooses the frozen reference weights, and nothing here reads them (no KL term, "
                   "no anchor, no `weights: initial` teacher, judge or guide)")
        elif k == 0:
            why = f"train.{field} sets {what}, and the first stage is the start of the run: it has no earlier stage"
        else:
            yield Finding(("train", field), False)
            continue
        yield Finding(("train", field), True, why, f"remove train.{field} (it acts in a stage after the first"
                      + (" of a spec that reads the reference)" if field == "reference" else ")"))
    length = seg.end - seg.start
    if t.reset_every and "reset_every" in t.model_fields_set:
        yield Finding(("train", "reset_every"), t.reset_every >= length,
                      f"train.reset_every {t.reset_every}: steps {seg.start}-{seg.end - 1} ({length} step(s)) end "
                      f"before the first reset, which falls {t.reset_every} steps after the start: no reset happens",
                      f"set reset_every below {length}, or remove it", scheduled=True)
    if "reset_what" in t.model_fields_set:
        if not t.reset_every:
            yield Finding(("train", "reset_what"), True, "train.reset_what chooses what a periodic reset resets, "
                          "and train.reset_every is 0: there is no periodic reset",
                          "remove reset_what, or set train.reset_every (e.g. 100)")
        elif "reference" in t.reset_what:
            yield Finding(("train", "reset_what"), not _reads_reference(spec),
                          "train.reset_what resets the frozen reference, and nothing here reads it (no KL term, no "
                          "anchor, no `weights: initial` teacher, judge or guide): that reset does nothing",
                          "reset_what: [optimizer], or add what reads the reference (e.g. objective.kl_coef > 0)")


# ------------------------------------------------------------------------------------------------- data

TOY_ONLY = ("tiers", "train_tiers", "toy_task")
FILE_ONLY = ("prompt_field", "answer_field", "solution_field", "on_bad_row", "prompt_format")


@inert_check("data_settings")
def data_settings(spec, seg) -> Iterable[Finding]:
    """The toy testbed's settings with a data file, a data file's settings on the toy testbed (those that change
    its prompts are refused by the Data model itself), chat-template variables with plain prompts."""
    d = spec.data
    for field in sorted(d.model_fields_set):
        if field in TOY_ONLY:
            yield Finding(("data", field), d.train is not None,
                          f"data.{field} sets the toy testbed's {'task' if field == 'toy_task' else 'chain lengths'}, and "
                          "data.train names a data file: "
                          "the prompts come from the file", f"remove data.{field} (it applies without data.train)")
        elif field in FILE_ONLY:
            yield Finding(("data", field), d.train is None,
                          f"data.{field} applies to a data file's rows, and there is no data.train: the toy testbed "
                          "builds its own prompts and answers", f"remove data.{field}, or give data.train (e.g. "
                          "from `composer toy-data --out DIR`)")
        elif field == "chat_template_kwargs" and d.chat_template_kwargs:
            yield Finding(("data", field), d.prompt_format == "plain",
                          "data.chat_template_kwargs are variables of the chat template, and prompt_format: plain "
                          "renders no template", "remove chat_template_kwargs, or use prompt_format: chat (or auto)")


# ------------------------------------------------------------------------------------ phase overrides

_MISSING = object()


def _at(value, path: tuple):
    """The value at `path` of a resolved spec (models, mappings, lists), as plain data; _MISSING if none."""
    for p in path:
        if isinstance(value, BaseModel) and isinstance(p, str) and p in type(value).model_fields:
            value = getattr(value, p)
        elif (isinstance(value, dict) and p in value) or (isinstance(value, list) and isinstance(p, int)
                                                         and 0 <= p < len(value)):
            value = value[p]
        else:
            return _MISSING
    return value.model_dump() if isinstance(value, BaseModel) else value


def _unchanged(raw, seg_spec, base_spec, path: tuple):
    """The paths a phase's or stage's mapping `raw` writes (at `path`) whose resolved value is the base spec's.
    A component whose `kind` the override changes is replaced whole, so nothing under it repeats the base."""
    if isinstance(raw, dict) and raw and isinstance(_at(seg_spec, path), dict):
        if "kind" in raw and _at(base_spec, path + ("kind",)) != _at(seg_spec, path + ("kind",)):
            return
        for k, v in raw.items():
            yield from _unchanged(v, seg_spec, base_spec, path + (k,))
    elif _at(seg_spec, path) is not _MISSING and _at(seg_spec, path) == _at(base_spec, path):
        yield path


def redundant_overrides(loaded, segments, base_spec) -> list[Diagnostic]:
    """A phase that sets a value the base spec already has: the override changes nothing (each phase is merged
    over the base spec, never over the phase before it). Stages are left out: each is a run of its own, and a
    stage that restates a setting of the base (its lr) says what that run uses."""
    from composer.errors import dotted

    out = []
    for seg in segments:
        if seg.origin[:1] != ("phases",):
            continue
        label = f"phase {seg.origin[1]}"
        for key, value in loaded.data["phases"][seg.origin[1]].items():
            for path in () if key == "until" else _unchanged(value, seg.spec, base_spec, (key,)):
                where, v = seg.origin + path, _at(seg.spec, path)
                shown = f"{_val(v)}, the base spec's value too" if not isinstance(v, (dict, list)) else \
                    "the base spec's value"
                out.append(Diagnostic("semantics", f"{label} sets {dotted(path)} to {shown}: the override changes "
                                      "nothing (every phase is merged over the base spec)", where,
                                      loaded.locate(where) or Location(loaded.file, 1, 1),
                                      f"remove {dotted(path)} from the phase (a phase names only what changes), or "
                                      "give the value it should change to", "error", "phase_changes"))
    return out


# ------------------------------------------------------------------------------------------------ check

def _writer(loaded, seg, path: tuple) -> tuple:
    """The path, in the file's coordinates, of whatever wrote `path` of the segment's resolved spec: the phase or
    stage when it wrote it (a `terms` list it patches by name maps to the base term it patches), else the base."""
    from composer.checks.validate import _exists

    if not seg.origin:
        return path
    part = loaded.data
    for p in seg.origin:
        part = part[p]
    if not isinstance(part, dict):
        return path
    if path[:1] == ("terms",) and isinstance(part.get("terms"), list) and len(path) > 1:
        base_terms = loaded.data.get("terms") or []
        names = [t.get("name") if isinstance(t, dict) else None for t in base_terms]
        over = part["terms"]
        patch = over and all(isinstance(t, dict) and t.get("name") is not None and t.get("name") in names
                             for t in over)
        if not patch:
            return seg.origin + path  # the phase's list replaces the base's whole
        i = path[1]
        name = names[i] if isinstance(i, int) and i < len(names) else None
        k = next((j for j, t in enumerate(over) if t.get("name") == name), None)
        if k is not None and _exists(over[k], path[2:]):
            return seg.origin + ("terms", k) + path[2:]
        return path
    return seg.origin + path if _exists(part, path) else path


def _quick(loaded) -> bool:
    """train.steps (a stage's too) came from a command-line override: a short trial run of a longer spec."""
    return any(p[-2:] == ("train", "steps") and loc.file.startswith("<override") for p, loc in loaded.positions.items())


def _base_spec(loaded):
    """The base spec (phases left out) as the spec model reads it: what each phase is merged over."""
    from pydantic import ValidationError

    from composer.lang.spec import spec_model

    try:
        return spec_model().model_validate({k: v for k, v in loaded.data.items() if k not in ("phases", "stages")})
    except ValidationError:  # the base alone is incomplete (a phase brings what it lacks): nothing to compare
        return None


def check(loaded, segments) -> list[Diagnostic]:
    """Every setting the checks found inert in each segment it governs, as located diagnostics, and what a phase
    writes that the base spec already has."""
    groups: dict[tuple, list] = {}
    for seg in segments:
        for name, fn in CHECKS.items():
            for f in fn(seg.spec, seg):
                groups.setdefault((name, _writer(loaded, seg, f.path)), []).append((f, seg))
    quick = _quick(loaded)
    out = []
    for (name, where), found in groups.items():
        if not all(f.inert for f, _seg in found):
            continue
        f, seg = found[0]
        msg = f.message
        if len(found) == 1 and seg.origin:
            label = (f"phase {seg.origin[1]} (steps {seg.start}-{seg.end})" if seg.origin[0] == "phases"
                     else f"stage '{seg.name}'")
            msg = f"in {label}: {msg}"
        elif len(found) > 1:
            msg += f" (so in each of the {len(found)} segments it governs)"
        severity = "warning" if f.scheduled and quick else f.severity
        out.append(Diagnostic("semantics", msg, where, loaded.locate(where) or Location(loaded.file, 1, 1), f.hint,
                              severity, name))
    base = _base_spec(loaded) if any(seg.origin[:1] == ("phases",) for seg in segments) else None
    return out + (redundant_overrides(loaded, segments, base) if base is not None else [])
