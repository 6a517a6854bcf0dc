"""Token-level cross-entropy on demonstrations (SFT)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from components.objectives.base import Aggregation, Objective, Reduction, aggregate, reference_token_weights
from composer.capabilities import Capabilities
from composer.origins import Origin
from composer.registry import register

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch


def cross_entropy_loss(logp: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """SFT negative log-likelihood (ALGORITHMS.md section 1): L = agg(-log pi_theta(y*_t | x, y*_<t)).

    logp [B, T] token-aligned log-probs of the targets, mask [B, T] -> scalar. With token-mean this is
    -(1/sum m) sum_{i,t} m log pi_theta, the HF/TRL default.
    """
    return aggregate(-logp, mask, mode)


@register("objective")
class CrossEntropy(Objective):
    """L = -(1/N) sum_i sum_t m_it log pi_theta(y*_it | x_i, y*_<t) (maximum likelihood on targets)."""

    kind: Literal["cross_entropy"] = Field("cross_entropy", description="Component kind.")
    loss_tokens: list[Origin] = Field(default_factory=lambda: ["demonstration", "policy", "guide_intervention"], description="Token origins that get loss (SFT targets are `demonstration` tokens, or policy prefix + intervention for InT).")
    aggregation: Aggregation = Field("token-mean", description="How per-token losses become one number (ALGORITHMS.md section 0).")

    needs: ClassVar = ("sft_target",)
    several_updates: ClassVar = "maximum likelihood of fixed targets (SFT epochs)"

    def openrlhf_sft(self) -> bool:
        """train_sft's loss is this class's (a plugin subclass may change it: no mapping)."""
        return type(self) is CrossEntropy

    def capabilities(self) -> Capabilities:
        """Not on-policy only: maximum likelihood of fixed targets holds whatever weights sampled them."""
        return Capabilities(on_policy_only=False)

    def anchors(self) -> dict[str, str]:
        return {o: "target token (teacher-forced)" for o in self.loss_tokens}

    def reduction(self) -> Reduction:
        return Reduction(self.aggregation)

    def reference_loss(self, batch, mask, view, inputs: dict) -> dict:
        """L = sum_t W_t (-log pi(y*_t)), W the aggregation's token weights (ALGORITHMS.md sections 0 and 1,
        `reference_token_weights`); d L / d log pi = -W."""
        import torch

        W = reference_token_weights(mask, self.aggregation)  # [B, T]
        nll = torch.where(W != 0, -view.logprobs.detach().double(), torch.zeros_like(W))  # padding may hold -inf
        return {"value": float((nll * W).sum()), "grad": -W}

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv=None) -> tuple[Tensor, dict[str, float]]:
        mask = self.loss_mask(batch)  # [B, T]
        loss = cross_entropy_loss(cur.logprobs, mask, self.aggregation)
        return loss, {"loss": float(loss.detach()), "tokens": float(mask.sum())}
