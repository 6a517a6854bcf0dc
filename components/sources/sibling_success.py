"""A successful rollout of the same group, shown to a self-teacher (SDPO)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from composer.registry import Component, register


@register("sources")
class SiblingSuccess(Component):
    """A successful sibling rollout of the same prompt, never the rollout itself (Hübotter et al. 2026, SDPO)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["sibling_success"] = Field("sibling_success", description="Component kind.")
    from_: str = Field(..., alias="from", description="The outcome_reward source that decides which rollouts succeeded.")

    provides: ClassVar = ("sibling_text",)
    needs: ClassVar = ("sequence_reward",)
    refs: ClassVar = {"from_": ("outcome_reward",)}
    pi: ClassVar[str] = "posterior"
