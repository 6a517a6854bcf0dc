"""The run's schedule as typed data: computed once by `compile_plan`, executed by both backends and the benches.

The Plan's `schedule` holds one `Range` per segment (phase or stage): its step range, the sync rule's
numbers, the learning-rate program, which weights each model call reads, and each term's advantage
groups and normaliser. `Schedule(plan)` answers every per-step question from that data alone:

  seg = sched.at(step)            the Range in force at global step `step` (0-based)
  sched.sync_after(done)          whether the sampler's weights are refreshed after `done` optimiser steps
  sched.sampler_version(step)     the weights the sampler holds while step `step` samples (steps done)
  sched.initial_version(step)     the frozen initial weights at `step` (0, or its stage's start)
  sched.lr(step)                  the learning rate of step `step`
  sched.weights(step)             {"policy", "sampler", "initial"}: the version each model reads

The one sync rule (README "Sync schedule"): the sampler is refreshed after `done` steps when
`(done - start) % sync.every == 0`, where `start` is the first step of the segment (phase or stage)
that step `done - 1` belongs to, and after the last step of every stage (the next stage starts from
those weights, as a new run would). Lightning and OpenRLHF both read it here; neither counts by itself.

A version is "the policy after that many optimiser steps" (0: the run's initial weights). Per-step
numbers another component schedules (an entropy weight, a clip range) belong next to `lr`: a field of
the Range holding the compiled program and a method of `Schedule` resolving it at a step.
Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

RULE = ("sync after `done` steps when (done - segment start) % sync.every == 0, counted from the start of "
        "the phase or stage the step belongs to, and after every stage's last step")


@dataclass(frozen=True)
class LR:
    """The learning-rate program of one segment: linear warm-up over `warmup_steps` from the segment's start,
    then constant or cosine decay to 0 over the rest of the segment."""

    base: float
    warmup_steps: int
    decay: str  # "constant" | "cosine"

    def at(self, local: int, length: int) -> float:
        """LR of the segment's `local`-th step (0-based) in a segment of `length` steps."""
        factor = min(1.0, (local + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        if self.decay == "cosine":
            span = max(length - self.warmup_steps, 1)
            frac = min(max(local - self.warmup_steps, 0) / span, 1.0)
            factor *= 0.5 * (1 + math.cos(math.pi * frac))
        return self.base * factor


@dataclass(frozen=True)
class Call:
    """One model call of a segment and the weights it reads: `policy` (the trained weights of this step),
    `sampler` (the rollout copy, as of its last sync), `initial` (the frozen initial weights), `ema`, or
    `frozen` (an external model), `critic before the step's update` (a value model)."""

    call: str
    weights: str


@dataclass(frozen=True)
class TermPlan:
    """How one term's loss is grouped and normalised."""

    name: str
    groups: str  # "prompt" or "prompt x guide tag": the rows one advantage group holds
    normaliser: str  # the aggregation its step-wide normaliser follows (micro-batches and ranks add up to it)


@dataclass(frozen=True)
class Range:
    index: int  # the segment's index in plan["segments"]
    name: str
    stage: str | None
    start: int
    end: int  # exclusive
    sync_every: int
    sync_at_end: bool  # the last step of a stage: the next stage starts from these weights
    initial_from: int  # the version the frozen initial weights are (0 or the stage's start)
    lr: LR
    calls: tuple[Call, ...] = ()
    terms: tuple[TermPlan, ...] = field(default_factory=tuple)
    optimizer_resets: tuple[int, ...] = ()  # global steps before which the optimizer state starts fresh
    reference_resets: tuple[int, ...] = ()  # global steps before which the frozen reference becomes the policy
    critics: tuple[str, ...] = ()  # the terms with a learned critic (ppo)
    critic_resets: tuple[int, ...] = ()  # global steps before which every critic starts fresh (critic_at_stage: reset)
    policy_frozen: bool = False  # train.freeze_policy: no policy update in this range (only critics learn)

    def syncs(self) -> list[int]:
        """Every `done` count inside this range after which the sampler is refreshed."""
        out = list(range(self.start + self.sync_every, self.end + 1, self.sync_every))
        if self.sync_at_end and (not out or out[-1] != self.end):
            out.append(self.end)
        return out


class Schedule:
    """The typed reader of plan["schedule"]: every backend's per-step decisions come from here."""

    def __init__(self, plan_or_data):
        data = plan_or_data.get("schedule", plan_or_data)
        self.rule = data["rule"]
        self.ranges = [Range(r["index"], r["name"], r.get("stage"), r["start"], r["end"], r["sync_every"],
                             r["sync_at_end"], r["initial_from"], LR(**r["lr"]),
                             tuple(Call(**c) for c in r.get("calls", ())),
                             tuple(TermPlan(**t) for t in r.get("terms", ())),
                             tuple(r.get("optimizer_resets", ())), tuple(r.get("reference_resets", ())),
                             tuple(r.get("critics", ())), tuple(r.get("critic_resets", ())),
                             bool(r.get("policy_frozen", False)))
                       for r in data["ranges"]]
        self.total_steps = self.ranges[-1].end if self.ranges else 0

    def at(self, step: int) -> Range:
        """The range in force at global `step` (the last one past the end, the first one before 0)."""
        for r in self.ranges:
            if r.start <= step < r.end:
                return r
        return self.ranges[-1] if step >= 0 else self.ranges[0]

    def sync_after(self, done: int) -> bool:
        if done < 1 or done > self.total_steps:
            return False
        r = self.at(done - 1)
        return (done - r.start) % r.sync_every == 0 or (r.sync_at_end and done == r.end)

    def syncs(self) -> list[int]:
        """Every `done` count after which the sampler is refreshed, in order."""
        return sorted({d for r in self.ranges for d in r.syncs()})

    def sampler_version(self, step: int) -> int:
        """The version the sampler holds while step `step` samples: the last sync at or before `step` done
        steps (0 before the first)."""
        last = 0
        for r in self.ranges:
            if r.start >= step:
                break
            k = (min(r.end, step) - r.start) // r.sync_every  # syncs of this range at or before `step`
            if k >= 1:
                last = max(last, r.start + k * r.sync_every)
            if r.sync_at_end and r.end <= step:
                last = max(last, r.end)
        return last

    def initial_version(self, step: int) -> int:
        """The frozen reference at `step`: its range's `initial_from`, or the last periodic reference reset of
        the range at or before `step` (the policy after that many steps)."""
        r = self.at(step)
        return max([r.initial_from] + [s for s in r.reference_resets if s <= step])

    def optimizer_reset(self, step: int) -> bool:
        """Whether the optimizer state starts fresh before step `step` (a stage's start with
        train.optimizer_at_stage: reset, or a periodic reset of train.reset_every)."""
        return step in self.at(step).optimizer_resets

    def critic_reset(self, step: int) -> bool:
        """Whether every critic starts fresh before step `step` (a stage's start with train.critic_at_stage: reset)."""
        return step in self.at(step).critic_resets

    def policy_frozen(self, step: int) -> bool:
        """Whether the policy is frozen at step `step` (train.freeze_policy: only critics learn)."""
        return self.at(step).policy_frozen

    def optimizer_resets(self) -> list[int]:
        """Every step before which the optimizer state starts fresh, in order."""
        return sorted({s for r in self.ranges for s in r.optimizer_resets})

    def lr(self, step: int) -> float:
        r = self.at(step)
        return r.lr.at(step - r.start, r.end - r.start)

    def weights(self, step: int) -> dict[str, int]:
        return {"policy": step, "sampler": self.sampler_version(step), "initial": self.initial_version(step)}

    def sampler_is_initial(self, step: int) -> bool:
        """Whether the sampler's weights at `step` are the frozen initial ones (a backend may then serve
        "initial" calls from the sampler, as OpenRLHF's agent does)."""
        return self.sampler_version(step) == self.initial_version(step)


# ------------------------------------------------------------------------------------- compiling

def _calls(seg, models: list[dict]) -> list[Call]:
    out = []
    for m in models:
        role = m["role"]
        if role == "policy":
            out.append(Call("policy", "policy"))
        elif role == "rollout":
            out.append(Call("rollout", "sampler"))
        elif role == "initial":
            out.append(Call("initial", "initial"))
        elif role.startswith("critic:"):  # a value model: its own weights before the step's update
            out.append(Call(role, "critic before the step's update"))
        elif role.startswith("source:"):
            src = seg.spec.sources[role[7:]]
            w = getattr(src, "weights", "current") if m["model"] == "self" else "frozen"
            out.append(Call(role, {"current": "policy"}.get(w, w)))
    for call, weights in seg.spec.rollout.guide.reads().items():
        out.append(Call(call, weights))
    for mc in seg.spec.rollout.guide.model_calls(seg.spec):  # a judge: the policy's own (sampler) or a model's
        src = seg.spec.sources.get(mc.source)
        own = getattr(src, "is_self", False)
        out.append(Call(f"guide:{mc.source}", {"current": "sampler"}.get(mc.weights, mc.weights) if own else "frozen"))
    return out


def _terms(seg) -> list[TermPlan]:
    from composer.checks.terms import terms

    guide = seg.spec.rollout.guide
    out = []
    for name, sig, obj, _w in terms(seg.spec):
        if obj is None:
            continue
        groups = "prompt" if (type(guide).plain or (sig is not None and sig.makes_batch)) else "prompt x guide tag"
        r = obj.reduction()
        norm = (obj.normaliser_words() or "its own normalizer()") if r is None else \
            r.mode + (" (sequence-weighted)" if r.weighted else "")
        out.append(TermPlan(name, groups, norm))
    return out


def compile_schedule(segments, models_of) -> dict:
    """plan["schedule"] for the validated segments; `models_of(spec)` is the Plan's model list of a segment."""
    from composer.checks.terms import terms

    ranges = []
    for i, seg in enumerate(segments):
        nxt = segments[i + 1] if i + 1 < len(segments) else None
        stage_end = seg.stage is not None and nxt is not None and nxt.stage != seg.stage
        t = seg.spec.train
        stage_start = next(s.start for s in segments if s.stage == seg.stage) if seg.stage else 0
        initial = stage_start if seg.stage is not None and t.reference == "stage_start" else 0
        periodic = list(range(seg.start + t.reset_every, seg.end, t.reset_every)) if t.reset_every else []
        opt = ([seg.start] if seg.stage is not None and seg.start == stage_start and seg.start > 0
               and t.optimizer_at_stage == "reset" else []) + (periodic if "optimizer" in t.reset_what else [])
        ref = periodic if "reference" in t.reset_what else []
        critics = tuple(n for n, _s, o, _w in terms(seg.spec) if o is not None and o.value_model() is not None)
        critic_reset = ([seg.start] if seg.stage is not None and seg.start == stage_start and seg.start > 0
                        and t.critic_at_stage == "reset" and critics else [])
        ranges.append(asdict(Range(i, seg.name, seg.stage, seg.start, seg.end, seg.spec.sync.every, stage_end,
                                   initial, LR(t.lr, t.warmup_steps, t.lr_schedule),
                                   tuple(_calls(seg, models_of(seg.spec))), tuple(_terms(seg)),
                                   tuple(opt), tuple(ref), critics, tuple(critic_reset), bool(t.freeze_policy))))
    return {"rule": RULE, "ranges": ranges}


def lines(plan: dict) -> list[str]:
    """The schedule in words (explain): per range its syncs, LR, weights per call, groups and normalisers."""
    sched = Schedule(plan)
    out = ["", f"schedule ({sched.rule}):"]
    for r in sched.ranges:
        syncs = r.syncs()
        shown = ", ".join(map(str, syncs[:8])) + (f", ... ({len(syncs)} in all)" if len(syncs) > 8 else "")
        lr = f"lr {r.lr.base:g}" + (f", warm-up {r.lr.warmup_steps}" if r.lr.warmup_steps else "") + \
             (", cosine" if r.lr.decay == "cosine" else "")
        out.append(f"  steps {r.start}-{r.end - 1} ({r.name}): sync after {shown or 'none'} step(s) done; {lr}; "
                   f"initial weights = policy after {r.initial_from} step(s)")
        prev = sched.ranges[r.index - 1] if r.index else None
        out.append("    optimizer: " + _optimizer_words(r, prev))
        if r.policy_frozen:
            out.append("    policy: frozen (train.freeze_policy): no policy loss and no policy update; the critic"
                       + ("s" if len(r.critics) > 1 else "") + " alone learn" + ("" if len(r.critics) > 1 else "s")
                       + " on the frozen policy's rollouts (value pre-training)")
        if r.critics:
            out.append("    critic: " + _critic_words(r, prev))
        if r.reference_resets:
            out.append("    reference reset (initial weights <- the policy) before step(s) " + _steps(r.reference_resets))
        out.append("    calls: " + ", ".join(f"{c.call} reads {c.weights}" for c in r.calls))
        for t in r.terms:
            out.append(f"    {t.name}: advantage groups by {t.groups}; normaliser {t.normaliser}")
    return out


def _steps(xs) -> str:
    xs = list(xs)
    return ", ".join(map(str, xs[:8])) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")


def _critic_words(r: Range, prev: Range | None) -> str:
    """Where each critic of a range comes from (explain): fresh, carried on, or reset at a stage's start."""
    names = ", ".join(r.critics)
    if r.start in r.critic_resets:
        return (f"{names}: a fresh critic at this stage's start (train.critic_at_stage: reset: new weights, AdamW "
                "state and update count)")
    if prev is None:
        return f"{names}: a fresh critic at the run's start"
    carried = [n for n in r.critics if n in prev.critics]
    fresh = [n for n in r.critics if n not in prev.critics]
    what = "stage" if r.stage is not None and r.stage != prev.stage else "phase"
    out = []
    if carried:
        out.append(f"{', '.join(carried)}: carried on from the previous {what} (weights, AdamW state, update count"
                   + ("; train.critic_at_stage: keep)" if what == "stage" else ")"))
    if fresh:
        out.append(f"{', '.join(fresh)}: a fresh critic (the previous {what} has no critic for this term)")
    return "; ".join(out)


def _optimizer_words(r: Range, prev: Range | None) -> str:
    """How the optimizer state of a range begins and whether it restarts inside it (explain)."""
    inside = [s for s in r.optimizer_resets if s != r.start]
    if prev is None:
        head = "AdamW state fresh at the run's start"
    elif r.start in r.optimizer_resets:
        head = "AdamW state reset at this stage's start (train.optimizer_at_stage: reset)"
    elif r.stage is not None and r.stage != prev.stage:
        head = "AdamW state kept from the previous stage (train.optimizer_at_stage: keep)"
    else:
        head = "AdamW state carried on from the previous phase"
    return head + (f"; reset before step(s) {_steps(inside)} (train.reset_every)" if inside else "")
