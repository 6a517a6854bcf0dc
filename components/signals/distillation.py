"""Distillation signal: a teacher's log-probs on the student's own response tokens."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Signal
from composer.lazy import torch
from composer.registry import register


@register("signal")
class DistillationSignal(Signal):
    """Teacher log-probs aligned to the student's response tokens (OPD, OPSD, SDPO); the teacher never generates."""

    kind: Literal["distillation"] = Field("distillation", description="Component kind.")
    teacher: str = Field(..., description="The policy_model source that scores the rollouts.")

    refs: ClassVar = {"teacher": ("policy_model",)}
    needs: ClassVar = ("teacher_logprobs",)
    provides: ClassVar = ("teacher_logprobs",)
    usage: ClassVar[str] = "teacher"

    @property
    def teacher_source(self) -> str | None:
        return self.teacher

    def describe(self, spec) -> str:
        return f"teacher log-probs from '{self.teacher}' (one forward pass, no generation)"

    def preflight(self, ctx) -> None:
        """Before training: the teacher prompt places every declared context."""
        from composer.data import Example
        from composer.runtime.prompts import check_placement

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
        from composer.terms import terms

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
