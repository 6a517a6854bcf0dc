"""A policy model as a source: an external teacher or judge, or the policy itself with privileged context."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from composer.registry import Component, register

TEXT_SOURCES = ("reference_solution", "feedback", "sibling_success")


@register("sources")
class PolicyModel(Component):
    """A language model that scores (teacher) or reviews (judge) the policy's rollouts; never generates rollouts itself."""

    kind: Literal["policy_model"] = Field("policy_model", description="Component kind.")
    model: str = Field(..., description="Model id or directory, `self` (the trained policy's network), or `toy:teacher` / `toy:student` (the toy testbed's checkpoints).")
    weights: Literal["current", "initial", "ema"] = Field("current", description="With `model: self`: the live weights, a frozen copy of the initial weights, or an exponential moving average.")
    ema_rate: float = Field(0.05, gt=0, le=1, description="EMA update rate: theta_T <- (1 - rate) theta_T + rate theta after every optimiser step (SDPO: 0.05).")
    context: list[str] = Field(default_factory=list, description="Textual sources shown to this model in its prompt (reference_solution, feedback, sibling_success).")
    template: Optional[str] = Field(None, description="Prompt template with {problem} and one {<source name>} per context source; default: the OPSD/SDPO templates.")
    shares_tokenizer: bool = Field(True, description="Declares that this model uses the policy's tokenizer (distillation needs it; checked for real when models load).")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by this before scoring (OPSD: the sampling temperature).")

    provides: ClassVar = ("teacher_logprobs", "judge")
    refs: ClassVar = {"context": TEXT_SOURCES}
    pi: ClassVar[str] = "prior"

    @property
    def is_self(self) -> bool:
        return self.model == "self"
