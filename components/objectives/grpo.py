"""GRPO: clipped policy gradient with group-normalised advantages."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from components.objectives.base import (
    Aggregation,
    Objective,
    aggregate,
    Reduction,
    group_advantages,
    masked_mean,
)
from composer.lazy import torch
from composer.registry import register

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch


def kl_estimate(delta: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimator of delta = log pi_theta - log pi_ref (ALGORITHMS.md section 0; Schulman 2020).

    k1 = delta; k2 = 0.5 delta^2 (verl "mse"); k3 = exp(-delta) + delta - 1 (verl "low_var_kl",
    delta clamped to +-20 and the output to +-10). Any shape -> same shape.
    """
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta ** 2
    if estimator == "k3":
        d = delta.clamp(-20.0, 20.0)
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def clipped_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float,
                      clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO/GRPO clipped surrogate (Shao et al. 2024, arXiv 2402.03300; DAPO clip-higher, arXiv 2503.14476).

    logp, old_logp [B, T]; adv [B, T] (or broadcastable, e.g. [B, 1]) ->
      surrogate [B, T] = min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A), rho = exp(logp - old_logp)
      clipped [B, T] bool: the clipped branch is the strictly smaller one (verl pg_clipfrac)
      ratio [B, T]
    The log-ratio is clamped to +-20 before exp (verl), which only matters for absurd ratios.
    """
    ratio = torch.exp((logp - old_logp.detach()).clamp(-20.0, 20.0))  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [B, T]
    surrogate = torch.minimum(unclipped, clipped_obj)
    return surrogate, (clipped_obj < unclipped), ratio


@register("objective")
class Grpo(Objective):
    """Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300)."""

    kind: Literal["grpo"] = Field("grpo", description="Component kind.")
    clip: float = Field(0.2, ge=0, description="Symmetric ratio clip epsilon.")
    clip_low: float | None = Field(None, ge=0, description="Lower clip epsilon (DAPO clip-higher); overrides `clip` below 1.")
    clip_high: float | None = Field(None, ge=0, description="Upper clip epsilon (DAPO: 0.28); overrides `clip` above 1.")
    std_norm: bool = Field(True, description="Divide group-centred rewards by the group std (False: Dr. GRPO).")
    loss_agg: Aggregation = Field("token-mean", description="Loss aggregation (verl default token-mean; the paper's form is seq-mean-token-mean; Dr. GRPO seq-mean-token-sum-norm).")
    norm_const: float | None = Field(None, gt=0, description="C of seq-mean-token-sum-norm (Dr. GRPO: the maximum generation length); default: the batch's padded length T.")
    kl_coef: float = Field(0.001, ge=0, description="Coefficient of the KL loss against the initial policy (0 disables; verl 0.001, DeepSeekMath 0.04).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator of the KL loss.")
    std_eps: float = Field(1e-6, gt=0, description="Added to the group std.")

    needs: ClassVar = ("reward",)
    on_policy_only: ClassVar = True
    policy_gradient: ClassVar = True
    uses_group_baseline: ClassVar = True

    @property
    def wants_initial(self) -> bool:
        """The KL loss reads the frozen initial policy's log-probs."""
        return self.kl_coef > 0

    def advantages(self, batch: TrajectoryBatch) -> Tensor:
        """A_i = (r_i - mean_g r) / (std_g r + eps) over each whole group (Dr. GRPO: no std)."""
        if batch.rewards is None:
            raise ValueError("grpo: the batch has no rewards (a reward signal must fill batch.rewards)")
        return group_advantages(batch.rewards, batch.group, self.std_norm, self.std_eps)  # [B]

    def reduction(self) -> Reduction:
        return Reduction(self.loss_agg, self.norm_const)

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv: Tensor) -> tuple[Tensor, dict[str, float]]:
        """-agg(min(rho A, clip(rho) A)) + kl_coef * agg(k(log pi_theta - log pi_init)) over the loss tokens."""
        mask = self.loss_mask(batch)  # [B, T]
        adv = adv.to(cur.logprobs.device, cur.logprobs.dtype)  # [B]
        lo = self.clip if self.clip_low is None else self.clip_low
        hi = self.clip if self.clip_high is None else self.clip_high
        surr, clipped, _ = clipped_surrogate(cur.logprobs, batch.behavior_logprobs, adv[:, None], lo, hi)
        pg_loss = aggregate(-surr, mask, self.loss_agg, self.norm_const)
        total = pg_loss
        kl_val = 0.0
        if self.kl_coef > 0:
            if batch.initial_logprobs is None:
                raise ValueError("grpo: kl_coef > 0 needs batch.initial_logprobs (the frozen initial policy's "
                                 "log-probs); set kl_coef: 0 or provide the initial policy")
            k = kl_estimate(cur.logprobs - batch.initial_logprobs.detach(), self.kl_estimator)  # [B, T]
            kl = aggregate(k, mask, self.loss_agg, self.norm_const)
            total = total + self.kl_coef * kl
            kl_val = float(kl.detach())
        metrics = {
            "pg_loss": float(pg_loss.detach()),
            "kl": kl_val,
            "clip_frac": float(masked_mean(clipped.float(), mask)),
            "adv_mean": float(adv.mean()),
        }
        return total, metrics
