"""The terms of a resolved spec and what they read: shared by validation, the plan and both backends (no torch)."""

from __future__ import annotations


def terms(spec) -> list[tuple[str, object, object, float]]:
    """(name, signal, objective, weight) of every term of a resolved spec."""
    if spec.terms:
        return [(t.name or f"term{i}", t.signal, t.objective, t.weight) for i, t in enumerate(spec.terms)]
    return [("term0", spec.signal, spec.objective, 1.0)]


def gates(spec) -> list:
    """The gate of every term (a composer.gates.Gate or None), aligned with `terms(spec)`."""
    if spec.terms:
        return [t.gate for t in spec.terms]
    return [None]


def own_loss_temperature(spec) -> float | None:
    """The temperature a step's policy forward scores at when a term's signal declares its own (SFT: 1,
    whatever the sampler's), else None (the sampler's). flags.py refuses terms that declare different ones."""
    temps = {sig.loss_temperature for _, sig, _, _ in terms(spec) if sig is not None} - {None}
    return temps.pop() if temps else None


def rolls_out(spec) -> bool:
    """Whether this spec samples rollouts (some term's signal does not build its own batch)."""
    return any(sig is not None and not sig.makes_batch for _n, sig, _o, _w in terms(spec))


def scored_origins(spec) -> set[str]:
    """Guide-written origins whose behaviour log-probs an objective reads: the rollout weights score them."""
    return {o for _n, _s, obj, _w in terms(spec) if obj is not None for o in obj.behavior_origins()} - {"policy"}


def present_origins(spec) -> set[str]:
    """Token origins that occur in the batches of this spec's terms."""
    return {o for _n, sig, _o, _w in terms(spec) if sig is not None for o in sig.origins(spec.rollout.guide)}
