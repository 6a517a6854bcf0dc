"""Compile a validated spec into the Plan: the one intermediate form both backends read (DESIGN.md section 4).

The Plan is plain JSON-able data, a function of the spec alone: which models load, the per-step dataflow, the
segments (phases and stages resolved to step ranges), the schedule both backends execute
(composer/plan/schedule.py: syncs, LR, the weights each model call reads, each term's advantage groups and
normaliser), for every token origin whether it gets loss and against which anchor. What this machine adds to it
(one rendered example of the prompts with the real tokenizer, the rollout engine's log-prob note) comes from the
runtime (composer/runtime/example_prompts.py `machine_notes`), added by the commands that show or write the Plan.
`composer explain` prints it; `composer run` writes it as plan.json.
"""

from __future__ import annotations

from composer.checks import graph
from composer.origins import ORIGINS
from composer.gates import gate_source
from composer.plan.schedule import compile_schedule
from composer.lang.curves import describe, is_scheduled, schedule_json
from composer.checks.terms import gates, rolls_out, scored_origins, terms
from composer.checks.validate import Segment, Validated

PI_TYPE = {
    "reference_solution": ("optimal trajectory", "prior"),
    "policy_model": ("stronger policy", "prior"),
    "oracle": ("step oracle", "prior"),
    "outcome_reward": ("outcome reward", "posterior"),
    "feedback": ("environment feedback", "posterior"),
    "overlong_penalty": ("reward shaping by response length (no privileged information)", "posterior"),
    "length_penalty": ("reward shaping by response length (no privileged information)", "posterior"),
    "sibling_success": ("a successful sibling rollout of the same group (never the row itself)", "posterior"),
    "reward_model": ("a learned reward model's score of the response", "posterior"),
}


def _usage(spec) -> dict[str, set[str]]:
    """How each source's information is spent: target, teacher, guide, reward (seed 000's axis)."""
    g, _ = graph.build(spec)
    use: dict[str, set[str]] = {n: set() for n in spec.sources}

    def mark(name, how, seen=()):
        if name in use and name not in seen:
            use[name].add(how)
            src = spec.sources[name]
            for names in src.ref_names().values():  # context sources are spent the same way
                for n in names:
                    mark(n, how, seen + (name,))

    guide = spec.rollout.guide
    for names in guide.ref_names().values():
        for n in names:
            mark(n, "guide")
    for sig, _obj in graph.signal_objective_pairs(spec):
        if sig is None:
            continue
        how = type(sig).usage
        for names in sig.ref_names().values():
            for n in names:
                mark(n, how)
    return use


def _models(spec) -> list[dict]:
    """The models a segment loads: the policy, its rollout copy (only when the segment samples), every
    policy_model source the segment reads, and the frozen initial policy when something reads it."""
    policy = spec.policy.model or "toy:student"
    models = [{"role": "policy", "model": policy, "trainable": True, "placement": "trainer"}]
    if rolls_out(spec):
        models.append({"role": "rollout", "model": policy, "trainable": False, "placement": "rollout engine",
                       "note": f"copy of the policy, refreshed every {spec.sync.every} step(s)"
                               + (", its weights rounded to bf16 (rollout.precision)" if spec.rollout.precision == "bf16"
                                  else "")})
    elif any(sig is not None and sig.builds_ahead for _n, sig, _o, _w in terms(spec)):
        models.append({"role": "rollout", "model": policy, "trainable": False, "placement": "rollout engine",
                       "note": "the policy at the segment's start: samples the targets once, before its first step"})
    used = _usage(spec)
    needs_initial = any(obj is not None and obj.wants_initial for _n, _s, obj, _w in terms(spec))
    for name, src in spec.sources.items():
        if src.kind_name() != "policy_model" and src.model_path is not None and used.get(name):  # a reward model
            models.append({"role": f"source:{name}", "model": src.model_path, "trainable": False,
                           "placement": "trainer", "note": "frozen; read as " + " and ".join(sorted(used[name]))})
        if src.kind_name() != "policy_model" or not used.get(name):
            continue
        how = "read as " + " and ".join(sorted(used[name]))
        if src.is_self:
            weights = {"current": "shares the policy's live weights", "initial": "frozen copy of the initial weights",
                       "ema": f"EMA of the policy weights, rate {src.ema_rate}"}[src.weights]
            needs_initial |= src.weights == "initial"
            models.append({"role": f"source:{name}", "model": "self", "trainable": False, "placement": "trainer",
                           "note": f"{weights}; {how}" + (f"; context: {', '.join(src.context)}" if src.context else "")})
        else:
            models.append({"role": f"source:{name}", "model": src.model, "trainable": False,
                           "placement": "own device when several", "note": f"frozen; {how}"})
    for name, _sig, obj, _w in terms(spec):
        critic = obj.value_model() if obj is not None else None
        if critic is not None:
            shared = critic.network == "shared"
            models.append({"role": f"critic:{name}", "model": "self" if shared else critic.model or policy,
                           "trainable": True, "placement": "trainer",
                           "note": ("a scalar head on the policy's network" if shared else
                                    "own weights + scalar head" + (", from the policy's weights at first use"
                                                                    if critic.model is None else "")) +
                           "; trained on the value loss by its own AdamW"})
    if needs_initial:
        models.append({"role": "initial", "model": policy, "trainable": False, "placement": "trainer",
                       "note": "frozen policy weights of the run's (or stage's, train.reference) start"})
    return models


def _behaviour(origin: str, spec) -> str | None:
    """Where the behaviour log-probs of `origin` tokens come from, as the run computes them."""
    if origin == "prompt":
        return None
    if origin == "demonstration":
        return "none read: tokens the policy did not write (a reference's or a teacher's text), teacher-forced"
    if origin == "policy":
        return "exact: the sampling log-probs of the rollout weights that wrote them"
    if origin == "environment":
        return "none: the environment wrote them (never loss; the trainer's forward reads them as context)"
    if origin in scored_origins(spec):
        return "exact: scored by the rollout weights at rollout time (one forward pass per step)"
    return "not recorded: no objective of this segment reads them"


def _origins(spec) -> list[dict]:
    """Per term: the token origins its batch holds, which get loss and against which anchor, and where
    each origin's behaviour log-probs come from."""
    out = []
    guide = spec.rollout.guide
    for (name, sig, obj, weight), gate in zip(terms(spec), gates(spec)):
        if obj is None or sig is None:
            continue
        anchors = obj.anchors()
        present = set(sig.origins(guide))
        if spec.rollout.environment.active and not sig.makes_batch:  # episodes: the environment's turns
            present.add("environment")
        table = {o: {"present": o in present, "loss": o in obj.loss_tokens and o in present,
                     "anchor": anchors.get(o) if o in present else None,
                     "behaviour": _behaviour(o, spec) if o in present else None}
                 for o in ORIGINS[1:]}
        out.append({"term": name, "signal": sig.kind_name(), "objective": obj.kind_name(),
                    "weight": schedule_json(weight), "weight_text": describe(weight),
                    "settings": obj.describe() + [f"inert here: {x.field}: {x.reason}" for x in obj.inert(spec)],
                    "batch": "built by the signal" if sig.makes_batch else "rollout", "origins": table,
                    "gate": None if gate is None else gate.describe()})
    return out


def _dataflow(spec) -> list[str]:
    flow = [f"sample {spec.train.prompts_per_step} prompts"]
    if rolls_out(spec):
        g = spec.rollout.guide.kind_name()
        env = spec.rollout.environment
        flow.append(f"rollout: {spec.rollout.samples_per_prompt} samples per prompt" +
                    ("" if g == "none" else f", guide {g}") +
                    (f", episodes with the {env.kind_name()} environment (up to {env.max_turns} policy turns)"
                     if env.active else ""))
        if spec.rollout.filter.active:
            flow.append("filter: " + spec.rollout.filter.describe())
    for (name, sig, obj, _w), gate in zip(terms(spec), gates(spec)):
        if sig is None or obj is None:
            continue
        flow.append(sig.describe(spec))
        if gate is not None:
            flow.append(f"gate {name}: only rows where {gate.describe()}")
        flow.append(f"{obj.kind_name()} loss")
    t = spec.train
    if t.freeze_policy:
        flow.append(f"policy frozen (train.freeze_policy): no policy loss or update; the critic's {t.epochs} epoch(s) x "
                    f"{t.mini_batches} mini-batch(es) of value updates only")
    elif t.epochs * t.mini_batches > 1:
        flow.append(f"old log-probs of the policy, then {t.epochs} epoch(s) x {t.mini_batches} mini-batch(es) of "
                    f"whole groups: {t.epochs * t.mini_batches} optimizer steps")
    else:
        flow.append("optimizer step")
    if is_scheduled(t.entropy_coef) or t.entropy_coef:
        flow.append(f"entropy bonus {describe(t.entropy_coef)}")
    if rolls_out(spec):
        flow.append(f"sync rollout weights every {spec.sync.every} step(s)" +
                    (", clearing the buffer" if spec.sync.reuse and spec.sync.clear_buffer and spec.sync.every > 1 else ""))
    return flow


def _writers(spec) -> list[str]:
    """Who writes the tokens of this segment's batches, in words (explain's "what will happen")."""
    out = []
    for name, sig, _obj, _w in terms(spec):
        if sig is not None and sig.makes_batch:
            out.append(f"{name}: no rollout, {sig.describe(spec)}")
    if rolls_out(spec):
        lag = "synced every step" if spec.sync.every == 1 else f"a lagged sampler, synced every {spec.sync.every} steps"
        out.append(f"the policy's rollout copy ({lag}) samples {spec.rollout.samples_per_prompt} response(s) per "
                   f"prompt at temperature {spec.rollout.temperature:g}")
        guide = spec.rollout.guide.describe(spec)
        if guide:
            out.append(guide)
        env = spec.rollout.environment.describe(spec)
        if env:
            out.append(env + " (origin environment: never loss)")
    return out


def _component(c) -> dict:
    return {"kind": c.kind_name(), **c.model_dump(mode="json", by_alias=True, exclude={"kind"})}


def _edges(spec) -> list[dict]:
    g, _ = graph.build(spec)
    out = []
    for a, b, d in g.edges(data=True):
        e = {"from": a, "to": b, "field": d.get("field")}
        if e not in out:
            out.append(e)
    return out


def _segment(seg: Segment) -> dict:
    spec = seg.spec
    return {
        "name": seg.name, "start": seg.start, "end": seg.end, "stage": seg.stage, "origin": list(seg.origin),
        "guide": _component(spec.rollout.guide) if rolls_out(spec) else None,
        "environment": _component(spec.rollout.environment) if rolls_out(spec) else None,
        "terms": [{"name": n, "weight": schedule_json(w), "signal": _component(s) if s else None,
                   "objective": _component(o) if o else None,
                   "gate": None if g is None else {**g.model_dump(mode="json", exclude_none=True),
                                                   "rows": g.describe(), "success_source": gate_source(g, spec)}}
                  for (n, s, o, w), g in zip(terms(spec), gates(spec))],
        "reference": spec.train.reference,
        "sync": spec.sync.model_dump(mode="json"),
        "dataflow": _dataflow(spec),
        "writers": _writers(spec),
        "token_origins": _origins(spec),
        "models": _models(spec),
        "edges": _edges(spec),
        "spec": seg.data,
    }


def compile_plan(v: Validated, backend: str | None = None) -> dict:
    spec = v.spec
    use = _usage(spec)
    for seg in v.segments:
        for n, hows in _usage(seg.spec).items():
            use.setdefault(n, set()).update(hows)
    sources = {}
    for name, src in spec.sources.items():
        kind = src.kind_name()
        what, when = PI_TYPE.get(kind, (kind, getattr(src, "pi", "?")))
        if kind == "policy_model" and src.is_self:
            what = "the policy itself" + (" with privileged context" if src.context else "")
        sources[name] = {"kind": kind, "pi": what, "pi_time": when, "usage": sorted(use.get(name, ()))}
    edges = []
    for seg in v.segments:  # every segment's graph: a staged spec's sources are read by its stages
        edges += [e for e in _edges(seg.spec) if e not in edges]
    train = spec.train.model_dump(mode="json")
    train["steps"] = v.total_steps  # a staged run's steps are its stages' sum (each segment has its own)
    return {
        "name": spec.name,
        "summary": spec.summary,
        "file": v.loaded.file,
        "backend": backend or spec.train.backend,
        "total_steps": v.total_steps,
        "testbed": "toy" if spec.data.train is None else "data",
        "policy": spec.policy.model or "toy:student",
        "sources": sources,
        "segments": [_segment(s) for s in v.segments],
        "schedule": compile_schedule(v.segments, _models),
        "edges": edges,
        "train": train,
        "rollout": {k: v for k, v in spec.rollout.model_dump(mode="json").items() if k != "guide"},
        "data": spec.data.model_dump(mode="json"),
        "policy_config": spec.policy.model_dump(mode="json"),
        "source_configs": {n: _component(s) for n, s in spec.sources.items()},
    }
