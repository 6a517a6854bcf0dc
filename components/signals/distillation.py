"""Distillation signal: a teacher's log-probs on the student's own response tokens."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import ConfigDict, Field, model_validator

from composer.capabilities import Capabilities, Need
from composer.contract import Signal
from composer.lazy import torch
from composer.registry import register


@register("signal")
class DistillationSignal(Signal):
    """Teacher log-probs aligned to the student's response tokens (OPD, OPSD, SDPO); the teacher never generates."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["distillation"] = Field("distillation", description="Component kind.")
    teacher: str = Field(..., description="The policy_model source that scores the rollouts.")
    off_policy: Literal["none", "reference", "teacher"] = Field("none", description="Sequences the policy did not write, scored by the teacher too (GKD): `reference` (a dataset's reference solutions, the `reference` source) or `teacher` (sequences the `writer` source generates); they are `demonstration` tokens, so the objective's loss_tokens must name them and only exact divergences (estimator full or top_k) train on them.")
    on_policy_fraction: float = Field(1.0, ge=0, le=1, alias="lambda", description="GKD's lambda: the fraction of prompts (mix: per_prompt) or of steps (mix: per_step) trained on the policy's own rollouts; the others on off_policy sequences, one per prompt. 0: never the policy's (no rollout).")
    mix: Literal["per_prompt", "per_step"] = Field("per_prompt", description="Draw on- or off-policy once per prompt or once per step (GKD draws per batch).")
    reference: Optional[str] = Field(None, description="With off_policy: reference, the reference_solution source whose text is the sequence.")
    writer: Optional[str] = Field(None, description="With off_policy: teacher, the policy_model source that writes the sequences (default: the teacher), sampled at its own temperature.")

    refs: ClassVar = {"teacher": ("policy_model",), "reference": ("reference_solution",), "writer": ("policy_model",)}
    needs: ClassVar = ("teacher_logprobs",)
    provides: ClassVar = ("teacher_logprobs",)
    usage: ClassVar[str] = "teacher"

    @model_validator(mode="after")
    def _off_policy_settings(self):
        if self.off_policy == "none" and self.on_policy_fraction != 1:
            raise ValueError("lambda < 1 trains some prompts on sequences the policy did not write: say which with "
                             "off_policy: reference or off_policy: teacher")
        if self.off_policy == "reference" and self.reference is None:
            raise ValueError("off_policy: reference needs `reference:`, a reference_solution source")
        if self.off_policy != "reference" and self.reference is not None:
            raise ValueError("`reference` applies to off_policy: reference")
        if self.off_policy != "teacher" and self.writer is not None:
            raise ValueError("`writer` applies to off_policy: teacher")
        return self

    @property
    def teacher_source(self) -> str | None:
        return self.teacher

    def capabilities(self) -> Capabilities:
        """Sequences the policy did not write (off_policy: GKD's dataset or teacher branch) need a backend that
        trains on sequences other than its sampler's."""
        return Capabilities(needs=(Need("sequences_not_sampled", ("off_policy",)),) if self.off_policy != "none" else ())

    @property
    def makes_batch(self) -> bool:
        """lambda = 0: every sequence comes from the dataset or the writer, no rollout is sampled."""
        return self.off_policy != "none" and self.on_policy_fraction == 0

    def origins(self, guide) -> set[str]:
        own = set() if self.makes_batch else {"policy", *guide.writes_now()}
        return {"prompt", *own, *({"demonstration"} if self.off_policy != "none" else set())}

    def describe(self, spec) -> str:
        out = f"teacher log-probs from '{self.teacher}' (one forward pass, no generation)"
        if self.off_policy != "none":
            what = (f"reference solutions from '{self.reference}'" if self.off_policy == "reference"
                    else f"sequences '{self.writer or self.teacher}' writes")
            lam = self.on_policy_fraction
            out += (f" on {what} only (lambda 0)" if lam == 0 else
                    f"; {what} instead of the rollouts for a fraction {1 - lam:g} of {'prompts' if self.mix == 'per_prompt' else 'steps'} (GKD lambda {lam:g})")
        return out

    def make_batch(self, ctx, examples):
        return off_policy_batch(ctx, self, examples, list(range(len(examples))))

    def preflight(self, ctx) -> None:
        """Before training: the teacher prompt places every declared context."""
        from composer.data import Example
        from composer.prompts import check_placement

        teacher = ctx.source(self.teacher)
        if teacher.cfg.context:
            ex = ctx.task.train[0] if ctx.task.train else Example(prompt="?", answer="?")
            check_placement(self.teacher, "teacher", teacher.render(ctx, ex))

    def apply(self, ctx, batch):
        """Fill batch.teacher_logprobs [B, T], batch.teacher_logits [B, T, V] (only when an objective of
        this signal wants full logits) and batch.seq_weight [B] from the teacher source; log
        teacher_kl_estimate = mean_t (log pi_beh - log pi_T) on weighted policy tokens (a single-sample
        reverse-KL estimate, which can be negative), teacher_student_gap = mean_t |log pi_beh - log pi_T|
        (also per difficulty tier of the rollouts' problems, teacher_student_gap/tierN), no_signal_frac, and
        for an EMA teacher ema_param_distance = ||theta_T - theta||_2."""
        from composer.checks.terms import terms

        if self.off_policy != "none" and not self.makes_batch:
            batch = mixed_batch(ctx, self, batch)
        teacher = ctx.source(self.teacher)
        want = any(obj.wants_logits for _n, sig, obj, _w in terms(ctx.spec) if sig is self or sig == self)
        lp, logits, w = teacher.score(ctx, batch, want)
        batch.teacher_logprobs, batch.teacher_logits = lp, logits
        batch.seq_weight = w if batch.seq_weight is None else batch.seq_weight * w
        m = (batch.policy_mask & (w > 0)[:, None]).float()  # [B, T]
        gap = (batch.behavior_logprobs - lp) * m  # [B, T]
        n = m.sum().clamp(min=1)
        ctx.log(teacher_kl_estimate=gap.sum() / n, teacher_student_gap=gap.abs().sum() / n,
                no_signal_frac=(w == 0).float().mean())
        tiers = [e.tier for e in batch.examples]
        for tier in sorted({t for t in tiers if t is not None}):
            rows = torch.tensor([t == tier for t in tiers], device=gap.device)  # [B]
            if m[rows].sum() > 0:
                ctx.log(**{f"teacher_student_gap/tier{tier}": gap[rows].abs().sum() / m[rows].sum()})
        dist = teacher.param_distance(ctx)
        if dist is not None:
            ctx.log(ema_param_distance=dist)
        return batch


def off_policy_batch(ctx, sig: DistillationSignal, examples: list, prompt_index: list[int]):
    """One sequence the policy did not write per example, its tokens of origin `demonstration`: the reference
    solution + EOS, or what the writer source generates from the policy's prompt (counted as teacher tokens)."""
    from composer.protocol import Sample, Trace
    from composer.trajectory import assemble

    prompts = [ctx.prompt_ids(ex) for ex in examples]
    if sig.off_policy == "reference":
        ref = ctx.source(sig.reference)
        texts = [ctx.encode(ref.example_text(ex)) + [ctx.eos_id] for ex in examples]
    else:
        def write(ids):
            return (yield Sample(list(ids), ctx.max_new_tokens, model=sig.writer or sig.teacher, purpose="teacher"))

        texts = [gens[0].tokens for gens in ctx.run([write(p) for p in prompts])]
    traces = []
    for ids, toks in zip(prompts, texts):
        trace = Trace(list(ids))
        trace.add(list(toks), "demonstration")
        traces.append(trace)
    batch = assemble(traces, list(examples), prompt_index, ctx.pad_id)
    batch.info["temperature"] = ctx.spec.rollout.temperature
    return batch


def mixed_batch(ctx, sig: DistillationSignal, batch):
    """GKD's mixture: each prompt (or the whole step) keeps the policy's rollouts with probability lambda, else
    its rows are replaced by one off-policy sequence. Draws from the run's rng (resumable). -> a new batch."""
    from composer.batch import concat

    prompts = sorted(set(batch.prompt_index.tolist()))
    if sig.mix == "per_step":
        own = ctx.data.rng.random() < sig.on_policy_fraction
        keep = {p: own for p in prompts}
    else:
        keep = {p: ctx.data.rng.random() < sig.on_policy_fraction for p in prompts}
    ctx.log(on_policy_frac=sum(keep.values()) / max(len(prompts), 1))
    rows = [i for i, p in enumerate(batch.prompt_index.tolist()) if keep[p]]
    off = [p for p in prompts if not keep[p]]
    if not off:
        return batch
    first = {p: batch.prompt_index.tolist().index(p) for p in off}
    built = off_policy_batch(ctx, sig, [batch.examples[first[p]] for p in off], off)
    if not rows:
        return built
    own = batch.select(rows)
    own.info = {k: v for k, v in own.info.items() if not isinstance(v, list)}
    out = concat([own, built], ctx.pad_id)
    out.info = {"temperature": batch.info.get("temperature", 1.0)}
    return out
