"""An example third-party component: `length_penalized_grpo`, GRPO on a length-penalised reward.

Importing this module registers the kind; the composer imports it through the `composer.components`
entry point (pyproject.toml) once the package is installed, or because a spec lists it under
`plugins: [length_penalty]`. Like every component it is a pydantic config (`kind` Literal, unknown
keys forbidden, every field described) plus its implementation. Nothing here imports torch at import
time: validating a spec that uses it stays instant.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from components.objectives.grpo import Grpo
from composer.registry import register

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch

__all__ = ["LengthPenalizedGrpo", "shaped_rewards"]


def shaped_rewards(rewards: "Tensor", n_tokens: "Tensor", penalty: float, free_tokens: int) -> "Tensor":
    """r_i - penalty * max(0, n_i - free_tokens). rewards [B] float, n_tokens [B] -> [B]."""
    over = (n_tokens.to(rewards.dtype) - float(free_tokens)).clamp(min=0.0)  # [B]
    return rewards - penalty * over


@register("objective", plugin="composer-length-penalty")
class LengthPenalizedGrpo(Grpo):
    """GRPO on a length-penalised outcome reward: r - penalty * max(0, policy tokens - free_tokens)."""

    kind: Literal["length_penalized_grpo"] = Field("length_penalized_grpo", description="Component kind.")
    penalty: float = Field(0.001, ge=0, description="Reward subtracted per policy token beyond free_tokens.")
    free_tokens: int = Field(0, ge=0, description="Policy tokens per response that cost nothing.")

    def advantages(self, batch: "TrajectoryBatch") -> "Tensor":
        """GRPO's group advantages of the shaped rewards, over whole groups (both backends call this once
        per rollout batch, before it is split into micro-batches)."""
        if batch.rewards is None:
            raise ValueError("length_penalized_grpo: the batch has no rewards (a reward signal must fill batch.rewards)")
        n = batch.policy_mask.sum(-1)  # [B] policy tokens per trajectory
        return super().advantages(replace(batch, rewards=shaped_rewards(batch.rewards, n, self.penalty,
                                                                         self.free_tokens)))

    def reference_advantages(self, rewards, group, control, policy_tokens):
        """The referee's advantages (DESIGN.md section 10): GRPO's reference on the shaped rewards, written from the
        formula r - penalty * max(0, n - free_tokens) again (not through `shaped_rewards`)."""
        shaped = [r - self.penalty * max(0.0, float(n) - self.free_tokens) for r, n in zip(rewards, policy_tokens)]
        return super().reference_advantages(shaped, group, control, policy_tokens)

    def loss(self, batch: "TrajectoryBatch", cur: "PolicyView", adv: "Tensor"):
        """The GRPO loss (clip, KL) of the parent kind, with the advantages of the shaped rewards."""
        loss, metrics = super().loss(batch, cur, adv)
        return loss, {**metrics, "length_penalty/policy_tokens": float(batch.policy_mask.sum(-1).float().mean())}


from length_penalty import retry_env  # noqa: E402,F401 - registers the example environment kind `retry`
