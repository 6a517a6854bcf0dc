"""Compile a validated spec into the Plan: the one intermediate form both backends read (DESIGN.md section 4).

The Plan is plain JSON-able data: which models load, the per-step dataflow, the segments (phases and
stages resolved to step ranges), and for every token origin whether it gets loss and against which
anchor. `composer explain` prints it; `composer run` writes it as plan.json.
"""

from __future__ import annotations

from composer import graph
from composer.origins import ORIGINS
from composer.runtime.vllm_engine import engine_note
from composer.validate import Segment, Validated

PI_TYPE = {
    "reference_solution": ("optimal trajectory", "prior"),
    "policy_model": ("stronger policy", "prior"),
    "oracle": ("step oracle", "prior"),
    "outcome_reward": ("outcome reward", "posterior"),
    "feedback": ("environment feedback", "posterior"),
    "sibling_success": ("own successful rollout", "posterior"),
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


def _models(spec, data_is_toy: bool) -> list[dict]:
    policy = spec.policy.model or "toy:student"
    models = [{"role": "policy", "model": policy, "trainable": True, "placement": "trainer"},
              {"role": "rollout", "model": policy, "trainable": False, "placement": "rollout engine",
               "note": f"copy of the policy, refreshed every {spec.sync.every} step(s)"}]
    needs_initial = False
    for _, obj in graph.signal_objective_pairs(spec):
        if obj is None:
            continue
        if getattr(obj, "wants_initial", False):
            needs_initial = True
    for name, src in spec.sources.items():
        if src.kind_name() != "policy_model":
            continue
        if src.is_self:
            weights = {"current": "shares the policy's live weights", "initial": "frozen copy of the initial weights",
                       "ema": f"EMA of the policy weights, rate {src.ema_rate}"}[src.weights]
            models.append({"role": f"source:{name}", "model": "self", "trainable": False, "placement": "trainer",
                           "note": weights + (f"; context: {', '.join(src.context)}" if src.context else "")})
        else:
            models.append({"role": f"source:{name}", "model": src.model, "trainable": False,
                           "placement": "own device when several", "note": "frozen"})
    if needs_initial:
        models.append({"role": "initial", "model": policy, "trainable": False, "placement": "trainer",
                       "note": "frozen initial policy (KL / reference anchor)"})
    return models


def _origins(spec) -> list[dict]:
    """Per signal/objective pair: which token origins get loss, and against which anchor."""
    out = []
    for i, (sig, obj) in enumerate(graph.signal_objective_pairs(spec)):
        if obj is None:
            continue
        table = {}
        for origin in ORIGINS[1:]:
            loss = origin in obj.loss_tokens
            anchor = None
            if loss and obj.kind_name() == "advantage_regression":
                if origin == "policy":
                    anchor = "initial policy log-prob" if obj.reference == "initial" else "behaviour log-prob"
                else:
                    a = obj.anchor_for(origin)
                    anchor = f"constant kappa={a} per token" if isinstance(a, float) else "policy log-prob at rollout time (Proxy)"
            elif loss and type(obj).policy_gradient:
                anchor = "importance ratio to behaviour log-prob"
            table[origin] = {"loss": loss, "anchor": anchor}
        weight = spec.terms[i].weight if spec.terms else 1.0
        out.append({"term": (spec.terms[i].name if spec.terms and spec.terms[i].name else f"term{i}"),
                    "signal": sig.kind_name() if sig else None, "objective": obj.kind_name(),
                    "weight": weight, "origins": table})
    return out


def _dataflow(spec) -> list[str]:
    guide = spec.rollout.guide
    flow = [f"sample {spec.train.prompts_per_step} prompts"]
    g = guide.kind_name()
    flow.append(f"rollout: {spec.rollout.samples_per_prompt} samples per prompt" +
                ("" if g == "none" else f", guide {g}"))
    for sig, obj in graph.signal_objective_pairs(spec):
        if sig is None:
            continue
        k = sig.kind_name()
        if k == "reward":
            flow.append(f"score with '{sig.source}' ({spec.sources[sig.source].verifier} verifier)")
        elif k == "distillation":
            flow.append(f"teacher log-probs from '{sig.teacher}' (one forward pass, no generation)")
        elif k == "sft":
            flow.append("build SFT targets from " + ("guided rollouts" if sig.target == "guided" else f"'{sig.target}'"))
        flow.append(f"{obj.kind_name()} loss")
    flow.append("optimizer step")
    flow.append(f"sync rollout weights every {spec.sync.every} step(s)" +
                (", clearing the buffer" if spec.sync.clear_buffer and spec.sync.every > 1 else ""))
    return flow


def _component(c) -> dict:
    return {"kind": c.kind_name(), **c.model_dump(mode="json", by_alias=True, exclude={"kind"})}


def _segment(seg: Segment) -> dict:
    spec = seg.spec
    return {
        "name": seg.name, "start": seg.start, "end": seg.end,
        "guide": _component(spec.rollout.guide),
        "terms": [{"signal": _component(s) if s else None, "objective": _component(o) if o else None}
                  for s, o in graph.signal_objective_pairs(spec)],
        "sync": spec.sync.model_dump(mode="json"),
        "dataflow": _dataflow(spec),
        "token_origins": _origins(spec),
        "models": _models(spec, spec.data.train is None),
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
    g, _ = graph.build(spec)
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
        "edges": [{"from": a, "to": b, "field": d.get("field")} for a, b, d in g.edges(data=True)],
        "train": spec.train.model_dump(mode="json"),
        "rollout": {k: v for k, v in spec.rollout.model_dump(mode="json").items() if k != "guide"},
        "rollout_engine": engine_note(spec.rollout),
        "data": spec.data.model_dump(mode="json"),
        "policy_config": spec.policy.model_dump(mode="json"),
        "source_configs": {n: _component(s) for n, s in spec.sources.items()},
    }
