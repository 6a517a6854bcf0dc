"""SFT signal: teacher-forced targets, from a reference solution or from guided rollouts (InT)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("signal")
class SftSignal(Component):
    """Demonstrations as training targets: a reference solution, or `guided` (policy prefix + intervention, InT)."""

    kind: Literal["sft"] = Field("sft", description="Component kind.")
    target: str = Field(..., description="A reference_solution source, or `guided`: the policy prefix plus the intervention of guided rollouts, truncated after it.")
    filter_samples: int = Field(8, ge=0, description="With `guided`: keep a target only if at least one of this many continuations from it succeeds (InT used 32); 0 keeps all.")

    refs: ClassVar = {"target": ("reference_solution",)}
    provides: ClassVar = ("sft_target",)
    usage: ClassVar[str] = "target"

    def ref_names(self) -> dict[str, list[str]]:
        return {} if self.target == "guided" else {"target": [self.target]}
