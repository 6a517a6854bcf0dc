"""Reward signal: a source's sequence reward for every rollout."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Signal
from composer.registry import register


@register("signal")
class RewardSignal(Signal):
    """The outcome reward of every rollout, from an outcome_reward source."""

    kind: Literal["reward"] = Field("reward", description="Component kind.")
    source: str = Field(..., description="The outcome_reward source.")

    refs: ClassVar = {"source": ("outcome_reward",)}
    needs: ClassVar = ("sequence_reward",)
    provides: ClassVar = ("reward",)
    usage: ClassVar[str] = "reward"

    def describe(self, spec) -> str:
        return f"score with '{self.source}' ({spec.sources[self.source].verifier} verifier)"

    def apply(self, ctx, batch):
        """Fill batch.rewards from the outcome_reward source."""
        batch.rewards = ctx.source(self.source).rewards(ctx, batch)
        return batch
