"""The compiled Plan as both backends read it: `Plan(plan_json).at(step)` is everything a step needs.

    plan = Plan(data)            the plan.json dict (a bundle's run: Plan(data, run["segments"]))
    at = plan.at(step)           the Plan at global optimizer step `step` (0-based):
      at.segment                   the segment in force (name, start, end, stage, its resolved spec)
      at.spec                      that spec
      at.terms                     its terms, each with every scheduled number resolved at `step`:
                                   Term(index, name, signal, objective, weight, gate, declared, scheduled)
      at.entropy_coef              train.entropy_coef at `step`
      at.lr, at.initial_version, at.reference_moved, at.optimizer_reset, at.sampler_version, at.sampler_is_initial
    plan.sync_after(done)        whether the sampler's weights are refreshed after `done` optimizer steps

A backend reads scheduled numbers only here (a term's weight, an objective's coefficient, the entropy bonus): the
schedules of the spec are resolved once, by the Plan, with composer.lang.curves. The segments are the validated
ones (composer/checks/validate.py `Segment`: one shape from validation to the backends), rebuilt from plan.json.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer.checks.terms import gates, terms
from composer.checks.validate import Segment
from composer.lang.curves import is_scheduled, resolve, value_at
from composer.plan.schedule import Schedule


@dataclass(frozen=True)
class Term:
    """One term of the step: its signal, its objective with every scheduled field at the step's value, its weight
    at the step, its gate (composer/gates.py) or None. `declared` is the objective as the spec declares it (its
    schedules whole: what it reads over the whole segment, e.g. `wants_initial`); `scheduled`: the weight is a
    schedule (its value is logged every step)."""

    index: int
    name: str
    signal: Any
    objective: Any
    weight: float
    gate: Any = None
    declared: Any = None
    scheduled: bool = False


@dataclass(frozen=True)
class StepPlan:
    """The Plan at one global optimizer step: the segment in force and every number resolved at that step."""

    step: int
    segment: Segment
    terms: tuple[Term, ...]
    entropy_coef: float
    entropy_scheduled: bool
    schedule: Schedule | None = None

    @property
    def spec(self):
        return self.segment.spec

    @property
    def many(self) -> bool:
        """Several terms: their metrics are logged under the term's name."""
        return len(self.terms) > 1

    @property
    def lr(self) -> float:
        return self.schedule.lr(self.step)

    @property
    def initial_version(self) -> int:
        """The version the frozen initial weights are at this step (0, a stage's start, or a periodic reset)."""
        return self.schedule.initial_version(self.step)

    @property
    def reference_moved(self) -> bool:
        """The frozen initial weights become the policy's before this step (a stage's start with
        train.reference: stage_start, a periodic reset)."""
        return self.step > 0 and self.initial_version != self.schedule.initial_version(self.step - 1)

    @property
    def optimizer_reset(self) -> bool:
        """The optimizer state starts fresh before this step (train.optimizer_at_stage: reset, train.reset_every)."""
        return self.schedule.optimizer_reset(self.step)

    @property
    def critic_reset(self) -> bool:
        """Every critic starts afresh before this step (a stage's start with train.critic_at_stage: reset)."""
        return self.schedule.critic_reset(self.step)

    @property
    def policy_frozen(self) -> bool:
        """The policy is frozen at this step (train.freeze_policy): no policy loss or update; critics learn."""
        return self.schedule.policy_frozen(self.step)

    @property
    def sampler_version(self) -> int:
        """The weights the sampler holds while this step samples (optimizer steps done at its last sync)."""
        return self.schedule.sampler_version(self.step)

    @property
    def sampler_is_initial(self) -> bool:
        """The sampler holds the frozen initial weights (it may then serve "initial" calls, as OpenRLHF's agent does)."""
        return self.schedule.sampler_is_initial(self.step)


def step_terms(spec, step: int) -> tuple[Term, ...]:
    """The terms of `spec` at global step `step`: weights and objectives' scheduled fields resolved."""
    return tuple(Term(i, name, sig, None if obj is None else resolve(obj, step), value_at(w, step), gate, obj,
                      is_scheduled(w))
                 for i, ((name, sig, obj, w), gate) in enumerate(zip(terms(spec), gates(spec))))


def spec_at(spec, step: int = 0) -> StepPlan:
    """The Plan at `step` of a run of one resolved spec and no plan.json (one segment `main`: tests, tools)."""
    seg = Segment("main", 0, spec.train.steps, spec, {})
    coef = spec.train.entropy_coef
    return StepPlan(step, seg, step_terms(spec, step), value_at(coef, step), is_scheduled(coef))


def segments_of(plan: dict, indices: list[int] | None = None) -> list[Segment]:
    """The plan's segments (or those at `indices`) with their specs validated again from plan.json's data."""
    from composer import registry
    from composer.lang.spec import spec_model

    registry.load_all()
    segs = plan["segments"] if indices is None else [plan["segments"][i] for i in indices]
    for module in (segs[0]["spec"].get("plugins") or []) if segs else []:
        __import__(module)  # named by a spec that was validated (and its plugins allowed) when compiled
    model = spec_model()
    return [Segment(s["name"], s["start"], s["end"], model.model_validate(s["spec"]), s["spec"],
                    tuple(s.get("origin") or (("stages", k) if s.get("stage") else ())))
            for k, s in enumerate(segs)]


class Plan:
    """The typed reader of plan.json: its segments and its schedule, answering every per-step question."""

    def __init__(self, data: dict, indices: list[int] | None = None):
        self.data = data
        self.segments = segments_of(data, indices)
        self.schedule = Schedule(data) if "schedule" in data else None
        self.offset = self.segments[0].start  # a bundle's run counts its steps from its first segment's start

    def segment_at(self, step: int) -> Segment:
        """The segment in force at global `step` (the last one past the end)."""
        for seg in self.segments:
            if seg.start <= step < seg.end:
                return seg
        return self.segments[-1]

    def at(self, step: int) -> StepPlan:
        seg = self.segment_at(step)
        coef = seg.spec.train.entropy_coef
        return StepPlan(step, seg, step_terms(seg.spec, step), value_at(coef, step), is_scheduled(coef), self.schedule)

    def sync_after(self, done: int) -> bool:
        """Whether the sampler's weights are refreshed after `done` optimizer steps (the Plan's one sync rule)."""
        return self.schedule.sync_after(done)
