"""Distillation signal: a teacher's log-probs on the student's own response tokens."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("signal")
class DistillationSignal(Component):
    """Teacher log-probs aligned to the student's response tokens (OPD, OPSD, SDPO); the teacher never generates."""

    kind: Literal["distillation"] = Field("distillation", description="Component kind.")
    teacher: str = Field(..., description="The policy_model source that scores the rollouts.")

    refs: ClassVar = {"teacher": ("policy_model",)}
    needs: ClassVar = ("teacher_logprobs",)
    provides: ClassVar = ("teacher_logprobs",)
    usage: ClassVar[str] = "teacher"
