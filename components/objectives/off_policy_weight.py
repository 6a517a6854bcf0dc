"""Importance-weight forms for loss tokens the policy did not write (`grpo.off_policy_weight`).

A token of a trace the policy did not write (a reference's or a teacher's trace inside a group, the `traces` guide;
a guide's prefix or intervention tokens) has no behaviour log-prob of the policy, so the PPO ratio
pi_theta / pi_old means nothing there. A weight form replaces it by a function of the current policy's probability
alone, the trace's own probability taken as 1 (LUFFY, Yan et al. 2025, arXiv 2504.14945; its code's off_ratio is
exp(log_prob) unless target probabilities are given); the token's loss is

    l_t = -A_i w(pi_theta(y_t)),   no clip, no ratio to a behaviour or old log-prob,

and its gradient -A_i w'(pi) pi grad log pi. The forms (LUFFY's `off_policy_reshape` options, ElliottYan/LUFFY
luffy/verl/verl/mix_src/mix_core_alg.py `compute_token_on_off_policy_loss`):

  none:    no form: validation refuses such tokens in a policy-gradient loss (the default)
  shaped:  w = pi / (pi + gamma)     LUFFY's policy shaping (`p_div_p_0.1`: gamma 0.1); w' pi = gamma pi / (pi + gamma)^2
           lifts the gradient of tokens the policy finds unlikely
  prob:    w = pi                    the ratio pi / 1 itself (LUFFY's `no_reshape`)
  pow:     w = pi^alpha              (`pow`, `square_root` with alpha 0.5)
  log:     w = log pi                (`logp`): -A log pi, the REINFORCE / advantage-weighted SFT term
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field

from composer.lazy import torch
from composer.registry import Component, register

if TYPE_CHECKING:
    from torch import Tensor


class OffPolicyWeight(Component):
    """Base of every weight form: `weight(logp [B, T]) -> w [B, T]`, differentiable in logp (the current log-probs)."""

    acts: ClassVar[bool] = True  # False: no form (tokens the policy did not write get no policy-gradient loss)

    def weight(self, logp: Tensor) -> Tensor:
        raise NotImplementedError

    def reference(self, lp: float) -> tuple[float, float]:
        """The referee's form (DESIGN.md section 10), written again in plain float64 arithmetic, sharing nothing with
        `weight`: (w, d w / d log pi) at one token's current log-prob lp."""
        raise NotImplementedError

    def describe(self) -> str:
        """The form in words, for `explain`."""
        raise NotImplementedError


@register("off_policy_weight")
class NoOffPolicyWeight(OffPolicyWeight):
    """No form: loss tokens the policy did not write are refused in a policy-gradient loss (validation says why)."""

    kind: Literal["none"] = Field("none", description="Component kind.")
    acts: ClassVar[bool] = False

    def weight(self, logp):
        raise TypeError("off_policy_weight none has no weight: no loss token may be one the policy did not write")

    def describe(self) -> str:
        return "none"


@register("off_policy_weight")
class Shaped(OffPolicyWeight):
    """LUFFY's policy shaping (Yan et al. 2025, arXiv 2504.14945): w = pi / (pi + gamma), the trace's own probability
    taken as 1; computed as sigmoid(log pi - log gamma). Its gradient weight gamma pi / (pi + gamma)^2 is largest at
    pi = gamma, so tokens the policy finds unlikely still learn (regularised importance sampling)."""

    kind: Literal["shaped"] = Field("shaped", description="Component kind.")
    gamma: float = Field(0.1, gt=0, description="gamma of f(pi) = pi / (pi + gamma) (LUFFY: 0.1).")

    def weight(self, logp):
        return torch.sigmoid(logp - math.log(self.gamma))  # [B, T] = pi / (pi + gamma)

    def reference(self, lp):
        pi = math.exp(lp)  # w = pi / (pi + gamma); d w / d log pi = gamma pi / (pi + gamma)^2
        return pi / (pi + self.gamma), self.gamma * pi / (pi + self.gamma) ** 2

    def describe(self) -> str:
        return f"pi / (pi + {self.gamma:g}) (LUFFY's policy shaping)"


@register("off_policy_weight")
class Prob(OffPolicyWeight):
    """The importance ratio with the trace's own probability taken as 1: w = pi (LUFFY's `no_reshape`)."""

    kind: Literal["prob"] = Field("prob", description="Component kind.")

    def weight(self, logp):
        return torch.exp(logp)

    def reference(self, lp):
        return math.exp(lp), math.exp(lp)  # w = pi; d pi / d log pi = pi

    def describe(self) -> str:
        return "pi (the ratio pi / 1)"


@register("off_policy_weight")
class Pow(OffPolicyWeight):
    """w = pi^alpha (LUFFY's `pow`; `square_root` is alpha 0.5): a flatter ratio."""

    kind: Literal["pow"] = Field("pow", description="Component kind.")
    alpha: float = Field(0.5, gt=0, description="The exponent alpha of pi^alpha (LUFFY's off_policy_reshape_pow_exp: 0.5).")

    def weight(self, logp):
        return torch.exp(self.alpha * logp)

    def reference(self, lp):
        pa = math.exp(lp) ** self.alpha  # w = pi^alpha; d w / d log pi = alpha pi^alpha
        return pa, self.alpha * pa

    def describe(self) -> str:
        return f"pi^{self.alpha:g}"


@register("off_policy_weight")
class Log(OffPolicyWeight):
    """w = log pi (LUFFY's `logp`): the loss -A log pi, an advantage-weighted likelihood term with no ratio."""

    kind: Literal["log"] = Field("log", description="Component kind.")

    def weight(self, logp):
        return logp

    def reference(self, lp):
        return lp, 1.0  # w = log pi

    def describe(self) -> str:
        return "log pi (no ratio: -A log pi)"


AnyOffPolicyWeight = Annotated[Union[NoOffPolicyWeight, Shaped, Prob, Pow, Log], Field(discriminator="kind")]
