"""Token-level cross-entropy on demonstrations (SFT)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from components.objectives.base import Aggregation, Objective, Reduction, aggregate
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

    def capabilities(self) -> Capabilities:
        """Not on-policy only: maximum likelihood of fixed targets holds whatever weights sampled them."""
        return Capabilities(on_policy_only=False)

    def anchors(self) -> dict[str, str]:
        return {o: "target token (teacher-forced)" for o in self.loss_tokens}

    def reduction(self) -> Reduction:
        return Reduction(self.aggregation)

    def reference_loss(self, batch, mask, cur) -> dict:
        """L = sum_t w_t (-log pi(y*_t)), w_t the aggregation's weight of target token t (ALGORITHMS.md sections 0
        and 1), written again with a loop over rows: token-mean 1 / (all target tokens); seq-mean-token-mean
        1 / (n_i x rows with a target); seq-mean-token-sum 1 / rows; seq-mean-token-sum-norm 1 / T (the batch's
        padded length); token-sum 1. Its gradient d L / d log pi = -w."""
        import torch

        m = mask.double()  # [B, T]
        rows = [i for i in range(m.shape[0]) if float(m[i].sum()) > 0]
        w = torch.zeros_like(m)
        for i in rows:
            n_i = float(m[i].sum())
            w[i] = m[i] * {"token-mean": 1.0 / float(m.sum()), "seq-mean-token-mean": 1.0 / (n_i * len(rows)),
                           "seq-mean-token-sum": 1.0 / len(rows), "seq-mean-token-sum-norm": 1.0 / m.shape[1],
                           "token-sum": 1.0}[self.aggregation]
        nll = torch.where(w != 0, -cur.double(), torch.zeros_like(w))  # padding may hold -inf
        return {"value": float((nll * w).sum()), "grad": -w}

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv=None) -> tuple[Tensor, dict[str, float]]:
        mask = self.loss_mask(batch)  # [B, T]
        loss = cross_entropy_loss(cur.logprobs, mask, self.aggregation)
        return loss, {"loss": float(loss.detach()), "tokens": float(mask.sum())}
