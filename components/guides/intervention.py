"""Judge interventions inside rollouts (MInTRL chunk reviews, InT end-of-rollout rewrites)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("guide")
class InterventionGuide(Component):
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

    refs: ClassVar = {"judge": ("policy_model", "oracle")}
    provides: ClassVar = ("guided_tokens",)
