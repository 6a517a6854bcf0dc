"""Rollout correction (`grpo.correction`): importance weights for the training-inference mismatch.

The tokens of a rollout were drawn from the sampler mu (vLLM, a bf16 copy of the weights, a lagged engine), and the
policy-gradient loss is written for the trainer's policy at the step's start, pi_old. Where the two differ, every
token's loss is reweighted by the trainer-over-sampler ratio, apart from the policy ratio pi_theta / pi_old and its
bound (which still act with several updates per step):

    rho_t = pi_old(y_t) / mu(y_t) = exp(log pi_old(y_t) - log mu(y_t))      (token level)
    rho_i = exp(sum_t d_t)  (sequence: the product),  exp(mean_t d_t)  (geometric: the per-token mean)
    l_t  <-  w_t * l_t,   w_t = sg(f(rho)),  over the policy's own tokens

(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training", fengyao.notion.site/
off-policy-rl; Liu, Li et al. 2025, "When speed kills stability", verl's rollout correction; IcePop, Ant Group's Ling
Team 2025, the Ring-1T report). The forms:

  none:    w = 1 (the default)
  tis:     w = min(rho, C)                   truncated importance sampling (C = 2; verl rollout_is; OpenRLHF
                                             is_correction_mode clip)
  mis:     w = rho (or 1) inside [lo, hi], the unit rejected outside: masked importance sampling (slime's MIS,
           verl's rejection sampling rollout_rs at token / sequence / geometric level); a rejected token's loss is 0
           and it counts in the normaliser (`rejected: zero`, OpenRLHF's mask mode) or leaves the loss (`drop`, verl)
  icepop:  w = rho inside [0.5, 5], 0 outside, per token (IcePop; OpenRLHF is_correction_mode mask)

Every form is a function of (log pi_old - log mu) alone, computed once per step (the old log-probs are the trainer's
forward before the step's first update), detached: it changes the measure, never the gradient's direction. Tokens
whose behaviour log-prob is unknown (a guide's, a teacher's trace) get w = 1.

Intended difference from verl: verl's sequence-level IS weight is clamped at exp(+-20) before truncation; here the
log-ratio is clamped at +-20 too (the same), and a `drop`ped unit leaves the KL term's normaliser as well (verl's
modified response mask is the actor's mask for every term).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Optional, Union

from pydantic import Field, model_validator

from composer.lazy import torch
from composer.registry import Component, register

if TYPE_CHECKING:
    from torch import Tensor

SAFETY = 20.0  # |log rho| is clamped here before exp (verl's SAFETY_BOUND)


def unit_log_ratio(d: Tensor, mask: Tensor, level: str) -> Tensor:
    """d = log pi_old - log mu [B, T], mask [B, T] bool -> the unit's log-ratio broadcast to [B, T]: the token's own
    (token), the row's sum (sequence) or mean (geometric) over its masked tokens; clamped to +-SAFETY."""
    d = torch.where(mask, d, torch.zeros_like(d))  # [B, T]
    if level == "token":
        x = d
    else:
        s = d.sum(-1, keepdim=True)  # [B, 1]
        x = s if level == "sequence" else s / mask.sum(-1, keepdim=True).clamp(min=1).to(d.dtype)
        x = x.expand_as(d)
    return x.clamp(-SAFETY, SAFETY)


class RolloutCorrection(Component):
    """Base of every form: `weights(old, behaviour, mask) -> (w [B, T], kept [B, T] bool)`, w detached, 1 off the
    mask; kept False where a unit leaves the loss (mis with `rejected: drop`)."""

    acts: ClassVar[bool] = True

    def weights(self, old: Tensor, behaviour: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def reference(self, d: list[float]) -> list[tuple[float, bool]]:
        """The referee's form (DESIGN.md section 10), in plain float64 arithmetic sharing nothing with `weights`: for
        one row's corrected tokens, d_t = log pi_old - log mu in order -> [(w_t, kept_t)]."""
        raise NotImplementedError

    def describe(self) -> str:
        """The form in words, for `explain`."""
        raise NotImplementedError

    def openrlhf_flags(self) -> list[tuple] | None:
        """The engine mapping: OpenRLHF 0.11.2's flags for this form, (flag without "--", *values) each
        (`--algo.advantage.is_correction_*`, which its PolicyLoss applies to the PPO loss), or None when no flag
        setting computes it (the composer's own step then runs it: the plugin route)."""
        return None


@register("correction")
class NoCorrection(RolloutCorrection):
    """No correction: every token's loss keeps weight 1 (the sampler is taken to be the trainer)."""

    kind: Literal["none"] = Field("none", description="Component kind.")
    acts: ClassVar[bool] = False

    def weights(self, old, behaviour, mask):
        return torch.ones_like(old), torch.ones_like(mask)

    def reference(self, d):
        return [(1.0, True) for _ in d]

    def describe(self) -> str:
        return "none (the sampler's log-probs taken as the trainer's)"

    def openrlhf_flags(self):
        return []


@register("correction")
class Tis(RolloutCorrection):
    """Truncated importance sampling (Yao et al. 2025; verl `rollout_is`, threshold 2): w = sg(min(rho, C)) on every
    token, rho per token or per sequence (the product of the row's token ratios)."""

    kind: Literal["tis"] = Field("tis", description="Component kind.")
    level: Literal["token", "sequence"] = Field("token", description="The ratio's unit: each token's pi_old / mu, or the sequence's product of them (verl rollout_is: token | sequence).")
    threshold: float = Field(2.0, gt=0, description="C of w = min(rho, C) (Yao et al. 2025 and verl: 2).")

    def weights(self, old, behaviour, mask):
        x = unit_log_ratio(old.detach() - behaviour.detach(), mask, self.level)  # [B, T]
        w = torch.exp(x).clamp(max=self.threshold)
        return torch.where(mask, w, torch.ones_like(w)), torch.ones_like(mask)

    def reference(self, d):
        x = d if self.level == "token" else [sum(d)] * len(d)
        return [(min(math.exp(min(max(v, -SAFETY), SAFETY)), self.threshold), True) for v in x]

    def describe(self) -> str:
        unit = "token" if self.level == "token" else "sequence (product of the token ratios)"
        return f"TIS: each token's loss x sg(min(rho, {self.threshold:g})), rho = pi_old / mu per {unit}"

    def openrlhf_flags(self):
        if self.level != "token":
            return None  # OpenRLHF's clip mode is per token only
        # a single threshold is OpenRLHF's [0, C]: clamp(rho, 0, C) = min(rho, C)
        return [("algo.advantage.is_correction_level", "token"), ("algo.advantage.is_correction_mode", "clip"),
                ("algo.advantage.is_correction_threshold", self.threshold)]


@register("correction")
class Mis(RolloutCorrection):
    """Masked importance sampling (slime's MIS; verl's rejection sampling `rollout_rs`): a unit (token, or a whole
    sequence by the product or the geometric mean of its token ratios) whose rho leaves [low, high] is rejected;
    a kept token's loss is weighted by its own rho_t (`weigh`) or left as it is."""

    kind: Literal["mis"] = Field("mis", description="Component kind.")
    level: Literal["token", "sequence", "geometric"] = Field("token", description="The unit rejected: a token by its own ratio, or a whole sequence by the product (sequence) or the geometric mean (geometric) of its token ratios (verl rollout_rs).")
    high: float = Field(2.0, gt=0, description="Upper end of the kept band [low, high] of rho (verl: 2).")
    low: Optional[float] = Field(None, ge=0, description="Lower end of the kept band; default 1 / high (verl).")
    weigh: bool = Field(True, description="Kept tokens take their own ratio rho_t as a weight (masked importance sampling, OpenRLHF's mask mode); false: rejection only, kept tokens keep weight 1 (verl rollout_rs without rollout_is).")
    rejected: Literal["zero", "drop"] = Field("zero", description="A rejected token: its loss is 0 and it still counts in the aggregation's normaliser (zero: OpenRLHF, IcePop), or it leaves the loss mask (drop: verl's modified response mask).")

    @model_validator(mode="after")
    def _band(self):
        if self.band()[0] > self.high:
            raise ValueError(f"low {self.band()[0]:g} is above high {self.high:g}: the band [low, high] of kept ratios "
                             "is empty, so every token would be rejected; set low below high (default 1 / high)")
        return self

    def band(self) -> tuple[float, float]:
        return (1.0 / self.high if self.low is None else self.low), self.high

    def weights(self, old, behaviour, mask):
        d = old.detach() - behaviour.detach()  # [B, T]
        x = unit_log_ratio(d, mask, self.level)  # [B, T]
        lo, hi = self.band()
        rho = torch.exp(x)
        keep = (rho >= lo) & (rho <= hi)  # [B, T]: the unit is inside the band
        w = torch.exp(unit_log_ratio(d, mask, "token")) if self.weigh else torch.ones_like(d)
        w = torch.where(keep, w, torch.zeros_like(w))
        w = torch.where(mask, w, torch.ones_like(w))
        kept = (keep | ~mask) if self.rejected == "drop" else torch.ones_like(mask)
        return w, kept

    def reference(self, d):
        lo, hi = self.band()
        clamp = lambda v: min(max(v, -SAFETY), SAFETY)  # noqa: E731
        unit = {"token": None, "sequence": sum(d), "geometric": sum(d) / len(d) if d else 0.0}[self.level]
        out = []
        for v in d:
            r = math.exp(clamp(v if unit is None else unit))
            inside = lo <= r <= hi
            w = (math.exp(clamp(v)) if self.weigh else 1.0) if inside else 0.0
            out.append((w, inside or self.rejected == "zero"))
        return out

    def describe(self) -> str:
        lo, hi = self.band()
        unit = {"token": "per token", "sequence": "per sequence (product of the token ratios)",
                "geometric": "per sequence (geometric mean of the token ratios)"}[self.level]
        kept = "weighted by their own rho_t" if self.weigh else "weight 1"
        gone = "loss 0, still in the normaliser" if self.rejected == "zero" else "out of the loss"
        return f"{self.kind.upper()}: units with rho = pi_old / mu outside [{lo:g}, {hi:g}] {unit} rejected ({gone}); kept tokens {kept}"

    def openrlhf_flags(self):
        # OpenRLHF's mask mode: token or geometric-mean sequence units, survivors weighted by rho_t, loss 0 in the
        # normaliser
        if not self.weigh or self.rejected != "zero" or self.level == "sequence":
            return None
        lo, hi = self.band()
        return [("algo.advantage.is_correction_level", "token" if self.level == "token" else "seq"),
                ("algo.advantage.is_correction_mode", "mask"), ("algo.advantage.is_correction_threshold", lo, hi)]


@register("correction")
class IcePop(Mis):
    """IcePop (Ant Group's Ling Team 2025, the Ring-1T report): tokens whose trainer-over-sampler ratio leaves
    [0.5, 5] get no gradient; the others are weighted by it (M(rho) = rho on the band, 0 outside)."""

    kind: Literal["icepop"] = Field("icepop", description="Component kind.")
    level: Literal["token"] = Field("token", description="Per token (IcePop masks tokens).")
    high: float = Field(5.0, gt=0, description="Upper end of the kept band (IcePop: 5).")
    low: Optional[float] = Field(0.5, ge=0, description="Lower end of the kept band (IcePop: 0.5).")


AnyCorrection = Annotated[Union[NoCorrection, Tis, Mis, IcePop], Field(discriminator="kind")]
