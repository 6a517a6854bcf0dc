"""Reward shaping sources: rewards computed from a rollout's form, not its correctness (DAPO's soft overlong
punishment, a length penalty). A reward signal adds them to its outcome reward with weights (`plus`), and
logs each as reward/<name>. Both read only the response's token count, so they need no model."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from composer.contract import Source
from composer.lazy import torch
from composer.registry import register


def response_lengths(batch):
    """[B] float: tokens after the prompt in each row (every response origin, pad excluded)."""
    return batch.response_mask.sum(-1).float()


def overlong_penalty(length, max_tokens: int, buffer: int, factor: float = 1.0):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13; OpenRLHF
    `apply_overlong_penalty`): with L_max = max_tokens and L_cache = buffer,
      R(|o|) = 0                                    if |o| <= L_max - L_cache
             = ((L_max - L_cache) - |o|) / L_cache  if L_max - L_cache < |o| <= L_max
             = -1                                   beyond L_max,
    times `factor`. length [B] -> [B]."""
    start = max_tokens - buffer
    over = (length - start).clamp(min=0, max=buffer)  # [B]
    return -factor * over / buffer


@register("sources")
class OverlongPenalty(Source):
    """DAPO's soft overlong punishment: 0 up to L_max - L_cache tokens, linear down to -factor at L_max."""

    kind: Literal["overlong_penalty"] = Field("overlong_penalty", description="Component kind.")
    buffer: int = Field(4096, ge=1, description="L_cache: the buffer zone before the length cap where the penalty grows linearly (DAPO: 4096).")
    max_tokens: Optional[int] = Field(None, ge=1, description="L_max, the length cap (default: the run's response cap, rollout.max_new_tokens or the toy testbed's lower cap; DAPO: 20480).")
    factor: float = Field(1.0, gt=0, description="The penalty at L_max and beyond (OpenRLHF overlong_penalty_factor).")

    provides: ClassVar = ("sequence_reward",)
    pi: ClassVar[str] = "posterior"

    def openrlhf_reward_part(self, weight: float, response_cap: int) -> dict | None:
        """OpenRLHF's DAPO overlong penalty (--reward.overlong_buffer_len / overlong_penalty_factor): the same
        formula, capped at the run's response length, applied to every sample's reward before the advantage step
        (this class only: a plugin subclass may change the formula)."""
        if type(self) is not OverlongPenalty:
            return None
        if self.max_tokens not in (None, response_cap):
            return {"refused": f"OpenRLHF's overlong penalty caps at the run's max_new_tokens ({response_cap}), and "
                               f"this source caps at {self.max_tokens}", "hint": "leave its max_tokens unset"}
        return {"flags": [("reward.overlong_buffer_len", min(self.buffer, response_cap)),
                          ("reward.overlong_penalty_factor", weight * self.factor)],
                "note": f"OpenRLHF's DAPO overlong penalty (buffer {self.buffer}, factor {weight * self.factor:g})"}

    def rewards(self, ctx, batch):
        cap = self.max_tokens or ctx.max_new_tokens  # the cap generation actually ran under
        return overlong_penalty(response_lengths(batch), cap, min(self.buffer, cap), self.factor)

    def short_run_overrides(self):
        """A cap the toy student's longest answers (4 steps and the answer line: 27 tokens with the stop token) pass
        into the buffer of the default size 4 and its 3-step answers (21) do not, so the penalty acts in a short run
        and tells rows apart."""
        return [] if self.max_tokens else ["rollout.max_new_tokens=30"]

    def reference_rewards(self, lengths, response_cap):
        """-factor * clip(|o| - (L_max - L_cache), 0, L_cache) / L_cache (DAPO eq. 13), L_max = max_tokens or the
        run's cap, L_cache = min(buffer, L_max)."""
        cap = self.max_tokens or response_cap
        buf = min(self.buffer, cap)
        return [-self.factor * min(max(n - (cap - buf), 0), buf) / buf for n in lengths]


@register("sources")
class LengthPenalty(Source):
    """A linear length penalty: -coef per response token (any length-controlled RL recipe's simplest form)."""

    kind: Literal["length_penalty"] = Field("length_penalty", description="Component kind.")
    coef: float = Field(0.001, gt=0, description="Reward -coef x the response's token count.")

    provides: ClassVar = ("sequence_reward",)
    pi: ClassVar[str] = "posterior"

    def rewards(self, ctx, batch):
        return -self.coef * response_lengths(batch)

    def reference_rewards(self, lengths, response_cap):
        return [-self.coef * n for n in lengths]  # -coef |o|
