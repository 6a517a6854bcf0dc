"""Judge interventions inside rollouts (MInTRL chunk reviews, InT end-of-rollout rewrites).

A rollout is a protocol program (composer/protocol.py): the policy writes, the judge reviews,
and the trajectory is built as pieces with provenance: the policy's accepted steps (origin `policy`,
with the sampler's log-probs) and the judge's corrections (origin `guide_intervention`). Policy tokens
a REVISE discards never enter the stored sequence. The same program runs batched on the Lightning
backend and one row at a time inside the OpenRLHF agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from components.guides.judges import MALFORMED, REVISE, VERDICT_TOKENS, check_judge_placement, make_judge
from composer.contract import Guide, ModelCall
from composer.registry import register
from composer.protocol import Sample, Trace


@register("guide")
class InterventionGuide(Guide):
    """A judge reviews the policy's steps and replaces the first wrong one with a short correction.

    `review: chunk` is MInTRL's Algorithm 1 (Chen et al. 2026): review every `chunk_tokens` of new text.
    `review: end` is InT (Yang et al. 2026, arXiv 2601.14209): one review of a finished, failed rollout.
    """

    kind: Literal["intervention"] = Field("intervention", description="Component kind.")
    judge: str = Field(..., description="The source that reviews: a policy_model (external or `self`) or an oracle.")
    review: Literal["chunk", "end"] = Field("chunk", description="`chunk`: review every chunk (MInTRL); `end`: one review of a finished, failed rollout (InT).")
    chunk_tokens: int = Field(512, ge=1, description="Policy tokens generated between reviews.")
    step_split: str = Field("\n\n", min_length=1, description="Separator that splits new text into numbered steps.")
    max_reviews: int = Field(4, ge=0, description="Most reviews per trajectory.")
    max_correction_tokens: int = Field(64, ge=1, description="Longest correction the judge may write.")
    control_samples: int = Field(0, ge=0, description="Of samples_per_prompt, how many are never guided (control rollouts).")
    proposals: int = Field(4, ge=1, le=64, description="With `review: end` (InT): proposals sampled per failed attempt, each one answer with the verification, the first error and the intervention; the rollout continues from the first, and an SFT target keeps the first that survives its filters (InT: K = 4).")
    proposal_tokens: int = Field(256, ge=1, description="With `review: end`: the longest proposal answer (verification, 'REVISE k' and the intervention).")

    @model_validator(mode="after")
    def _end_only(self):
        """`proposals` and `proposal_tokens` act only on InT's end-of-rollout review."""
        set_ = {"proposals", "proposal_tokens"} & self.model_fields_set
        if self.review != "end" and set_:
            raise ValueError(f"{', '.join(sorted(set_))} apply to `review: end` (InT's proposals); a chunk review "
                             "asks its judge for one verdict and one correction")
        return self

    refs: ClassVar = {"judge": ("policy_model", "oracle")}
    provides: ClassVar = ("guided_tokens",)
    writes: ClassVar = ("guide_intervention",)

    def reference_control(self, spec, batch, tokenizer=None):
        """The first `control_samples` rollouts of each prompt are the policy's alone (no judge)."""
        n = spec.rollout.samples_per_prompt
        return [i % n < self.control_samples for i in range(batch.size)]

    def writes_now(self) -> tuple[str, ...]:
        return () if self.max_reviews == 0 else ("guide_intervention",)

    def extra_tokens(self, spec, max_solution_tokens: int) -> int:
        return (self.max_reviews or 1) * (self.max_correction_tokens + 2)  # each correction and its separator

    def model_calls(self, spec) -> list[ModelCall]:
        """A model judge's calls: a verdict, then a correction (components/guides/judges.py)."""
        src = spec.sources[self.judge]
        if src.needs_step_checker or self.max_reviews == 0:
            return []
        answer = self.proposal_tokens if self.review == "end" else max(VERDICT_TOKENS, self.max_correction_tokens)
        return [ModelCall(self.judge, answer, self.step_split, src.weights)]

    def describe(self, spec) -> str:
        src = spec.sources[self.judge]
        who = f"'{self.judge}' ({getattr(src, 'model', None) or src.kind_name()})"
        which = (f"{spec.rollout.samples_per_prompt - self.control_samples} of every "
                 f"{spec.rollout.samples_per_prompt} rollouts") if self.control_samples else "every rollout"
        when = (f"every {self.chunk_tokens} policy tokens" if self.review == "chunk" else "once, when a rollout "
                f"ends wrong ({self.proposals} sampled proposals)")
        if self.max_reviews == 0:
            return f"judge {who} never reviews (max_reviews 0)"
        return (f"judge {who} reviews {which} {when} (at most {self.max_reviews} review{'s' if self.max_reviews > 1 else ''}) and replaces the first "
                f"wrong step with up to {self.max_correction_tokens} guide_intervention tokens")

    def preflight(self, ctx) -> None:
        check_judge_placement(ctx, self.judge, self)

    def metrics(self, traces) -> dict[str, float]:
        return intervention_metrics(traces)

    def row(self, ctx, example, index: int, n: int):
        """Rollout `index` of n; the first `control_samples` of each prompt are controls (never reviewed).

        chunk (MInTRL Algorithm 1): accepted prefix p = empty; repeat: the policy writes `chunk_tokens`
        more; its new complete steps (split on `step_split`) go to the judge with (x, p); KEEP appends them
        to p; REVISE k keeps the steps before k and appends the judge's correction h (at most
        `max_correction_tokens`); at most `max_reviews` reviews; until EOS or max_new_tokens.
        end (InT): sample to the end; a failed rollout gets one review; after a REVISE the policy continues
        from the kept steps + correction, without the reference.
        """
        s = Live(Trace(ctx.prompt_ids(example), control=index < self.control_samples), ctx.max_new_tokens)
        judge = make_judge(ctx, self.judge, self)
        if self.review == "chunk":
            while not s.done:
                reviewable = not s.trace.control and s.reviews < self.max_reviews
                yield from s.extend(ctx, self.chunk_tokens if reviewable or s.trace.control else s.room)
                if reviewable:
                    yield from self.review_pending(ctx, judge, example, s)
        else:
            yield from s.extend(ctx, s.room)
            if not s.trace.control and self.max_reviews >= 1 and not success(ctx, example, ctx.decode(s.pending)):
                s.done = True  # the whole response is final: its last partial step is a step too
                yield from self.propose_pending(ctx, judge, example, s)
                if not s.done:
                    yield from s.extend(ctx, s.room)
        s.accept(len(s.pending), [])  # whatever is left unreviewed is the policy's
        s.trace.notes["reviews"] = s.reviews
        return s.trace

    def review_pending(self, ctx, judge, example, s: Live):
        """Review the complete new steps of `s`; apply KEEP / REVISE."""
        steps = split_steps(ctx, s.pending, self.step_split, final=s.done)
        if not steps:
            return
        texts = [t for t, _ in steps]
        if not any(t.strip() for t in texts):  # nothing to judge (e.g. a lone EOS)
            s.accept(steps[-1][1], texts)
            return
        d = yield from judge.decide(ctx, example, list(s.steps), texts, s.trace)
        s.reviews += 1
        s.trace.notes["malformed"] = s.trace.notes.get("malformed", 0) + (d.kind == MALFORMED)
        if d.kind != REVISE:  # KEEP, or an unreadable answer acted on as KEEP
            s.accept(steps[-1][1], texts)
            return
        self.revise(ctx, s, steps, texts, d)

    def propose_pending(self, ctx, judge, example, s: Live):
        """InT: `proposals` sampled proposals for the finished, failed attempt in `s` (all its steps). The
        attempt and every readable proposal are noted on the trace (`proposals`: where the kept steps end and
        the intervention), so an SFT target can take the first that survives its filters; the rollout goes
        on from the first one."""
        steps = split_steps(ctx, s.pending, self.step_split, final=True)
        texts = [t for t, _ in steps]
        if not steps or not any(t.strip() for t in texts):
            if steps:
                s.accept(steps[-1][1], texts)
            return
        ds = yield from judge.propose(ctx, example, texts, s.trace, self.proposals, self.proposal_tokens)
        s.reviews += 1
        s.trace.notes["malformed"] = s.trace.notes.get("malformed", 0) + sum(d.kind == MALFORMED for d in ds)
        revs = [d for d in ds if d.kind == REVISE]
        s.trace.notes["attempt"] = {"tokens": list(s.pending), "logprobs": list(s.pending_lp)}
        s.trace.notes["proposals"] = [{"keep": steps[d.index - 1][1] if d.index else 0, "correction": d.correction}
                                      for d in revs]
        if not revs:  # no error found, or nothing readable: the attempt stays as it is
            s.accept(steps[-1][1], texts)
            return
        self.revise(ctx, s, steps, texts, revs[0])

    def revise(self, ctx, s: Live, steps, texts: list[str], d) -> None:
        """Apply REVISE d: keep the steps before d.index, drop the rest, append the correction."""
        keep = steps[d.index - 1][1] if d.index else 0
        s.trace.notes["dropped_tokens"] = s.trace.notes.get("dropped_tokens", 0) + len(s.pending) - keep
        s.accept(keep, texts[: d.index])
        s.pending, s.pending_lp = [], []  # the wrong step and everything after it are dropped
        h = correction_tokens(ctx, self, s, d.correction)
        s.trace.add(h, "guide_intervention")
        s.trace.note("corrections", d.correction)
        s.steps.append(d.correction)
        s.trace.guided = True
        s.done = (bool(h) and h[-1] == ctx.eos_id) or s.length >= s.cap


# ------------------------------------------------------------------------------------ row state


@dataclass
class Live:
    """A row under construction: accepted pieces live in the trace; `pending` is unreviewed policy text."""

    trace: Trace
    cap: int  # max_new_tokens
    steps: list[str] = field(default_factory=list)  # accepted step texts (policy steps and corrections)
    pending: list[int] = field(default_factory=list)  # policy tokens generated since the last review
    pending_lp: list[float] = field(default_factory=list)  # their behaviour log-probs
    reviews: int = 0
    done: bool = False  # stopped: EOS generated, or the response is at max_new_tokens

    @property
    def length(self) -> int:
        return len(self.trace.response) + len(self.pending)

    @property
    def room(self) -> int:
        return self.cap - self.length

    def extend(self, ctx, budget: int):
        """The policy writes up to `budget` more tokens (never past the cap)."""
        [g] = yield Sample(self.trace.tokens + self.pending, min(budget, self.room))
        self.pending += g.tokens
        self.pending_lp += g.logprobs
        self.done = not g.tokens or g.finished or self.length >= self.cap

    def accept(self, end: int, texts: list[str]) -> None:
        """Move pending[:end] into the accepted prefix as policy tokens (with its step texts)."""
        self.trace.add(self.pending[:end], "policy", self.pending_lp[:end])
        self.pending, self.pending_lp = self.pending[end:], self.pending_lp[end:]
        self.steps += texts


def split_steps(ctx, ids: list[int], sep: str, final: bool) -> list[tuple[str, int]]:
    """The complete steps of `ids` as (text, end): end is the token index right after the step's separator.

    A step owns its separator; with a multi-character token across a separator the cut falls after
    that token (exact for the toy's character tokenizer). With `final` (EOS or cap) the rest after the
    last separator is a step too (an empty rest, e.g. a lone EOS, joins the step before it).
    """
    memo = ctx.memo.token_texts  # token id -> its text alone
    for t in set(ids) - memo.keys():
        memo[t] = ctx.decode([t])
    parts = [memo[t] for t in ids]
    text = "".join(parts)
    if text == ctx.decode(ids):
        ends = list(accumulate(len(p) for p in parts))  # char end of each token
    else:  # a tokenizer whose pieces do not concatenate: cumulative decode
        text = ctx.decode(ids)
        ends = [len(ctx.decode(ids[: i + 1])) for i in range(len(ids))]
    out, start = [], 0
    while (pos := text.find(sep, start)) >= 0:
        stop = pos + len(sep)
        out.append((text[start:pos], next(i + 1 for i, e in enumerate(ends) if e >= stop)))
        start = stop
    if final and len(ids) > (out[-1][1] if out else 0):
        rest = text[start:]
        if rest.strip() or not out:
            out.append((rest, len(ids)))
        else:
            out[-1] = (out[-1][0], len(ids))
    return out


def correction_tokens(ctx, guide: InterventionGuide, s: Live, text: str) -> list[int]:
    """The correction as tokens: text + separator, at most max_correction_tokens and within the cap.

    An empty correction (the oracle's "the response should have ended here") is EOS.
    """
    return correction_ids(ctx, guide, text, s.room)


def correction_ids(ctx, guide: InterventionGuide, text: str, room: int) -> list[int]:
    """`correction_tokens` for a response with `room` tokens left."""
    ids = ctx.encode(text + guide.step_split) if text else [ctx.eos_id]
    return ids[: min(guide.max_correction_tokens, room)]


def success(ctx, example, text: str) -> bool:
    """Whether `text` solves `example` under the spec's outcome_reward source (else the task's verifier)."""
    return successes(ctx, [example], [text])[0]


def successes(ctx, examples, texts: list[str]) -> list[bool]:
    """The task verifier's success per response: the spec's outcome_reward source, else the task's own."""
    verify, threshold = ctx.verifier("auto"), 0.5
    for cfg in ctx.spec.sources.values():
        if cfg.kind == "outcome_reward":
            verify, threshold = ctx.verifier(cfg.verifier), cfg.success_threshold
            break
    return [verify(t, ex).reward >= threshold for t, ex in zip(texts, examples)]


def intervention_metrics(traces: list[Trace]) -> dict[str, float]:
    """Per-step facts of the reviews: guided fraction, reviews per reviewable rollout, REVISE rate,
    mean correction length, malformed answers, policy tokens dropped by REVISEs per rollout."""
    eligible = sum(not t.control for t in traces)
    reviews = sum(t.notes.get("reviews", 0) for t in traces)
    revises = sum(len(t.notes.get("corrections", [])) for t in traces)
    written = sum(len(p.tokens) for t in traces for p in t.pieces if p.origin == "guide_intervention")
    return {
        "guided_frac": sum(t.guided for t in traces) / max(len(traces), 1),
        "reviews_per_traj": reviews / max(eligible, 1),
        "revise_rate": revises / max(reviews, 1),
        "correction_len": written / max(revises, 1),
        "malformed": float(sum(t.notes.get("malformed", 0) for t in traces)),
        "dropped_tokens": sum(t.notes.get("dropped_tokens", 0) for t in traces) / max(len(traces), 1),
    }
