"""Advantage estimators: rewards and groups -> one advantage per row (DESIGN.md section 9).

Kept apart from the losses, as TorchRL keeps value estimators apart from its losses: a policy-gradient
objective (`grpo`) takes one as its `estimator` field. Each runs over whole groups where the rollouts are
gathered (the objective's `advantages`), the same code on both backends.

Statistics over the *global* batch (std by batch, REINFORCE++'s normalisation) are exact under DDP: each
rank holds whole groups of its own slice, so the estimator sums (rows, sum, sum of squares) over the ranks
with one all_reduce and every rank divides by the same global numbers (`_global_moments`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from components.objectives.base import group_stats
from composer.lazy import torch
from composer.registry import Component, register

if TYPE_CHECKING:
    from torch import Tensor


class Estimator(Component):
    """Base of every advantage estimator: `estimate(rewards [B], group [B], control [B] | None) -> A [B]`."""

    # The advantage subtracts a baseline taken from the group's rows: a group whose rewards are all equal trains
    # nothing, one rollout per prompt zeroes every advantage, and the referee must see groups of mixed rewards.
    group_baseline: ClassVar[bool] = True

    def estimate(self, rewards: Tensor, group: Tensor, control: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        """The estimator in words, for `explain`."""
        raise NotImplementedError

    def reference(self, rewards: list[float], group: list, control: list[bool]) -> list[float] | None:
        """The referee's advantages (DESIGN.md section 10): the docstring's formula written again plainly, in
        Python floats (float64), a loop over each group's rows, calling nothing of `estimate`. None: this
        estimator has no reference, and the referee reports it "not covered"."""
        return None

    def native_flag(self) -> str | None:
        """OpenRLHF's `--algo.advantage.estimator` value that computes the same advantages, or None (the
        composer's own estimate then runs in the bundle's plugin)."""
        return None


def _by_group(group: list) -> list[list[int]]:
    """Row indices of each group, in first-seen order (the referee's own grouping)."""
    out: dict = {}
    for i, g in enumerate(group):
        out.setdefault(g, []).append(i)
    return list(out.values())


def _sample_std(xs: list[float]) -> float:
    """sqrt(sum (x - mean)^2 / (n - 1)), 0 for fewer than two values (torch.std's unbiased form)."""
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _global_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, unbiased std) of x [B] over every rank's rows (one all_reduce of n, sum, sum of squares when
    torch.distributed is initialised with more than one process; the local rows otherwise). float64."""
    x = x.detach().to(torch.float64)
    s = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum(), (x * x).sum()])
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(s)
    n, total, sq = s[0], s[1], s[2]
    mean = total / n.clamp(min=1)
    var = ((sq - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    return mean, var.sqrt()


@register("estimator")
class GroupMean(Estimator):
    """Group-mean baseline, optionally divided by a std: GRPO (Shao et al. 2024, arXiv 2402.03300), Dr. GRPO
    (Liu et al. 2025, arXiv 2503.20783: no std), and std over the batch (Hu et al. 2025, TRL `scale_rewards`).

      A_i = (r_i - mean_g r) / (sigma + eps),  sigma = std_g r (group) | std_B r (batch, the raw rewards of the
      global batch, unbiased, as TRL) | 1 without eps (none).
    A group whose rewards are all equal gets exactly 0 (also with `batch`).
    """

    kind: Literal["group_mean"] = Field("group_mean", description="Component kind.")
    std: Literal["group", "batch", "none"] = Field("group", description="Divide by the std of the group's rewards (GRPO), of the global batch's rewards (TRL scale_rewards=batch), or not at all (Dr. GRPO).")
    eps: float = Field(1e-6, gt=0, description="Added to the std (verl 1e-6; TRL 1e-4).")

    def estimate(self, rewards, group, control=None):
        mean, std, _, const = group_stats(rewards, group)  # [B] each
        adv = rewards.detach() - mean  # [B]
        if self.std == "group":
            adv = adv / (std + self.eps)
        elif self.std == "batch":
            _, s = _global_moments(rewards)
            adv = adv / (s.to(adv.dtype) + self.eps)
        return torch.where(const, torch.zeros_like(adv), adv)

    def describe(self) -> str:
        if self.std == "none":
            return "group mean: A = r - mean_group(r) (no std: Dr. GRPO)"
        how = {"group": f"(group std + {self.eps:g})", "batch": f"(global-batch reward std + {self.eps:g})"}[self.std]
        return f"group mean: A = (r - mean_group(r)) / {how}"

    def native_flag(self) -> str | None:
        return {"group": "group_norm", "none": "dr_grpo"}.get(self.std)  # a batch std has no OpenRLHF flag

    def reference(self, rewards, group, control):
        out = [0.0] * len(rewards)
        batch_std = _sample_std(list(rewards))
        for rows in _by_group(group):
            rs = [rewards[i] for i in rows]
            if max(rs) == min(rs):
                continue  # an all-equal group: exactly 0
            mean = sum(rs) / len(rs)
            sigma = {"group": _sample_std(rs) + self.eps, "batch": batch_std + self.eps, "none": 1.0}[self.std]
            for i in rows:
                out[i] = (rewards[i] - mean) / sigma
        return out


@register("estimator")
class LeaveOneOut(Estimator):
    """Leave-one-out baseline: RLOO (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019).

      A_i = r_i - (1 / (n_g - 1)) sum_{j in g, j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g r)
    A group of one (or with all rewards equal) gets 0.
    """

    kind: Literal["leave_one_out"] = Field("leave_one_out", description="Component kind.")

    def estimate(self, rewards, group, control=None):
        mean, _, n, const = group_stats(rewards, group)  # [B] each
        adv = (rewards.detach() - mean) * n / (n - 1).clamp(min=1)  # [B]
        return torch.where(const | (n < 2), torch.zeros_like(adv), adv)

    def describe(self) -> str:
        return "leave-one-out (RLOO): A = r - mean of the other rows of the group"

    def native_flag(self) -> str | None:
        return "rloo"

    def reference(self, rewards, group, control):
        out = [0.0] * len(rewards)
        for rows in _by_group(group):
            rs = [rewards[i] for i in rows]
            if len(rs) < 2 or max(rs) == min(rs):
                continue
            for i in rows:
                out[i] = rewards[i] - (sum(rs) - rewards[i]) / (len(rs) - 1)
        return out


@register("estimator")
class ReinforcePPBaseline(Estimator):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262; OpenRLHF `reinforce_baseline`).

      A'_i = r_i - mean_g r;   A_i = (A'_i - mean_B A') / (std_B A' + eps)
    over the rows of the global batch (DDP: summed over every rank, see the module docstring). Departure:
    the paper and OpenRLHF normalise over tokens (each row's advantage counted once per response token);
    with an outcome reward the advantage is constant along a row, and we count every row once.
    """

    kind: Literal["reinforce_pp_baseline"] = Field("reinforce_pp_baseline", description="Component kind.")
    eps: float = Field(1e-6, gt=0, description="Added to the global-batch std.")

    def estimate(self, rewards, group, control=None):
        mean, _, _, _ = group_stats(rewards, group)
        centred = rewards.detach() - mean  # [B]
        m, s = _global_moments(centred)
        return ((centred.to(torch.float64) - m) / (s + self.eps)).to(rewards.dtype)

    def describe(self) -> str:
        return f"REINFORCE++-baseline: r - mean_group(r), then (x - mean) / (std + {self.eps:g}) over the global batch's rows"

    def reference(self, rewards, group, control):
        centred = [0.0] * len(rewards)
        for rows in _by_group(group):
            mean = sum(rewards[i] for i in rows) / len(rows)
            for i in rows:
                centred[i] = rewards[i] - mean
        m, sd = sum(centred) / len(centred), _sample_std(centred)
        return [(x - m) / (sd + self.eps) for x in centred]


@register("estimator")
class SoftValue(Estimator):
    """OAPL's / A*PO's soft value baseline (Ritter et al. 2026, arXiv 2602.19362; Brantley et al. 2025, arXiv
    2505.20686), the function `advantage_regression` uses (`soft_value`):

      A_i = r_i - V_hat(x),  V_hat(x) = beta1 ln mean_{j in g} exp(r_j / beta1)   (.inf: mean, 0: max)
    """

    kind: Literal["soft_value"] = Field("soft_value", description="Component kind.")
    beta1: float = Field(1.0, ge=0, allow_inf_nan=True, description="Temperature of the soft-max baseline (.inf: mean, 0: max).")

    def estimate(self, rewards, group, control=None):
        from components.objectives.advantage_regression import soft_value

        v, _ = soft_value(rewards, group, self.beta1)
        return rewards.detach() - v

    def describe(self) -> str:
        b = "inf" if math.isinf(self.beta1) else f"{self.beta1:g}"
        return f"soft value (OAPL): A = r - beta1 ln mean_group exp(r / beta1), beta1 = {b}"

    def reference(self, rewards, group, control):
        return soft_value_reference(rewards, group, self.beta1, None)


def soft_value_reference(rewards: list[float], group: list, beta1: float, base: list[bool] | None) -> list[float]:
    """The referee's r_i - V_hat(x_i), V_hat = beta1 ln((1/n) sum_j exp(r_j / beta1)) over the group's baseline
    rows `base` (None: all rows; a group with none falls back to all its rows); beta1 = inf: the mean, 0: the max
    (its limits). Written with the group max m factored out, m + beta1 ln mean exp((r - m) / beta1), in floats."""
    out = [0.0] * len(rewards)
    for rows in _by_group(group):
        chosen = [i for i in rows if base is None or base[i]] or rows
        rs = [rewards[i] for i in chosen]
        if math.isinf(beta1):
            v = sum(rs) / len(rs)
        elif beta1 == 0:
            v = max(rs)
        else:
            m = max(rs)
            v = m + beta1 * math.log(sum(math.exp((x - m) / beta1) for x in rs) / len(rs))
        for i in rows:
            out[i] = rewards[i] - v
    return out


@register("estimator")
class ControlMean(Estimator):
    """MInTRL's control baseline (Chen et al. 2026): the mean reward of the group's control rollouts (those the
    guide may not touch); a group without control rows falls back to all of its rows.

      A_i = r_i - mean_{j in g, control_j} r_j
    """

    kind: Literal["control_mean"] = Field("control_mean", description="Component kind.")

    def estimate(self, rewards, group, control=None):
        from components.objectives.advantage_regression import soft_value

        v, _ = soft_value(rewards, group, math.inf, control)
        return rewards.detach() - v

    def describe(self) -> str:
        return "control mean (MInTRL): A = r - mean reward of the group's control rollouts"

    def reference(self, rewards, group, control):
        return soft_value_reference(rewards, group, math.inf, list(control) if control is not None else None)


@register("estimator")
class SignWeighted(Estimator):
    """Baseline-free advantages with a weight per outcome: NSR, PSR and W-REINFORCE (Zhu et al. 2025, "The
    Surprising Effectiveness of Negative Reinforcement in LLM Reasoning", arXiv 2506.01347).

    Each row's reward becomes r_i = +1 (a success: reward >= success_threshold) or -1 (a failure), and
      A_i = w(r_i) r_i,  w(+1) = positive_weight,  w(-1) = negative_weight
    with no baseline and no normalisation: A_i is +positive_weight or -negative_weight, whatever the rest of the
    group did. With the grpo loss at one update per step (ratio 1) the gradient is -sum_i A_i grad log pi(y_i):
      PSR          positive_weight 1, negative_weight 0:  -sum over correct rows of log pi
      NSR          positive_weight 0, negative_weight 1:  +sum over incorrect rows of log pi
      W-REINFORCE  positive_weight lambda (0.1), negative_weight 1:  lambda PSR + NSR
    The authors' code (verl, `algorithm.adv_estimator=psr_nsr` with `advantage: positive | negative | weighted`,
    `positive_advantage_weight`) makes the same numbers from 0/1 scores: r, r - 1, and lambda r for correct / -1
    for incorrect rows. A row whose weight is 0 has advantage 0 and trains nothing (it still counts in a token-mean's
    normaliser, as in their loss).
    """

    kind: Literal["sign_weighted"] = Field("sign_weighted", description="Component kind.")
    positive_weight: float = Field(1.0, ge=0, description="w(+1): the advantage of a successful row (PSR 1, NSR 0, W-REINFORCE's lambda 0.1).")
    negative_weight: float = Field(1.0, ge=0, description="w(-1): the advantage of a failed row is -negative_weight (NSR and W-REINFORCE 1, PSR 0).")
    success_threshold: float = Field(0.5, description="A row is a success (reward +1) when its reward is at least this, else a failure (-1): a verifier's 0/1 (or +-1) reward maps to +-1 (the outcome_reward source's default threshold).")

    group_baseline: ClassVar[bool] = False  # no baseline: a group whose rewards are all equal still trains

    @model_validator(mode="after")
    def _some_row_trains(self):
        if self.positive_weight == 0 and self.negative_weight == 0:
            raise ValueError("sign_weighted with positive_weight 0 and negative_weight 0 gives every row advantage 0: "
                             "nothing trains (PSR: positive_weight 1, negative_weight 0; NSR: 0 and 1)")
        return self

    def estimate(self, rewards, group, control=None):
        r = rewards.detach()
        pos = torch.full_like(r, self.positive_weight)
        neg = torch.full_like(r, -self.negative_weight)
        return torch.where(r >= self.success_threshold, pos, neg)  # [B]

    def describe(self) -> str:
        name = {(1.0, 0.0): " (PSR)", (0.0, 1.0): " (NSR)"}.get((self.positive_weight, self.negative_weight), "")
        if not name and self.negative_weight == 1.0 and 0 < self.positive_weight < 1:
            name = f" (W-REINFORCE, lambda {self.positive_weight:g})"
        pos = f"+{self.positive_weight:g}" if self.positive_weight else "0"
        neg = f"-{self.negative_weight:g}" if self.negative_weight else "0"
        return (f"sign-weighted, no baseline{name}: A = {pos} for a success (reward >= {self.success_threshold:g}), "
                f"{neg} for a failure")

    def reference(self, rewards, group, control):
        out = []
        for x in rewards:  # each row alone: r = +1 or -1, A = w(r) r
            r = 1.0 if float(x) >= self.success_threshold else -1.0
            out.append((self.positive_weight if r > 0 else self.negative_weight) * r)
        return out


AnyEstimator = Annotated[Union[GroupMean, LeaveOneOut, ReinforcePPBaseline, SoftValue, ControlMean, SignWeighted],
                         Field(discriminator="kind")]
