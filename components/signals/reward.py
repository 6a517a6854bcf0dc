"""Reward signal: a source's sequence reward for every rollout."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Signal
from composer.registry import register


@register("signal")
class RewardSignal(Signal):
    """The sequence reward of every rollout, from an outcome_reward (a verifier) or a reward_model source."""

    kind: Literal["reward"] = Field("reward", description="Component kind.")
    source: str = Field(..., description="The reward source: an outcome_reward (a verifier) or a reward_model (a learned reward model).")
    plus: dict[str, float] = Field(default_factory=dict, description="Further reward sources added with weights, r = r_source + sum_k w_k r_k: another outcome_reward (a format verifier), overlong_penalty (DAPO), length_penalty, or a plugin's; each is logged as reward/<name>.")

    refs: ClassVar = {"source": ("outcome_reward", "reward_model")}
    needs: ClassVar = ("sequence_reward",)
    provides: ClassVar = ("reward",)
    usage: ClassVar[str] = "reward"

    def ref_names(self) -> dict[str, list[str]]:
        return {"source": [self.source], **({"plus": list(self.plus)} if self.plus else {})}

    def describe(self, spec) -> str:
        src = spec.sources[self.source]
        out = f"score with '{self.source}' " + (f"({src.verifier} verifier)" if hasattr(src, "verifier") else
                                                 f"({src.describe()})")
        if self.plus:
            out += " plus " + " + ".join(f"{w:g} x '{n}' ({spec.sources[n].kind_name()})" for n, w in self.plus.items())
        return out

    def openrlhf_trainer(self) -> str | None:
        """OpenRLHF's PPO trainer takes the reward as the bundle's reward function gives it (this class only)."""
        return "ppo" if type(self) is RewardSignal else None

    def reference_reward(self, base: list[float], parts: dict[str, list[float]]) -> list[float]:
        """The referee's reward (DESIGN.md section 10), in plain float arithmetic: r_i = base_i + sum_k w_k part_k(i),
        base the source's rewards of the rows, parts[name] each `plus` source's (recomputed by the referee)."""
        out = [float(r) for r in base]
        for name, w in self.plus.items():
            out = [r + w * float(p) for r, p in zip(out, parts[name])]
        return out

    def apply(self, ctx, batch):
        """Fill batch.rewards [B]: the source's reward plus each `plus` source's times its weight; with parts,
        each part's mean (unweighted) is logged as reward/<name>. Under an environment with a turn_reward_weight
        (rollout.environment), plus that weight times the sum of the rewards its turns returned (reward/environment)."""
        r = ctx.source(self.source).rewards(ctx, batch)  # [B]
        if self.plus:
            ctx.log(**{f"reward/{self.source}": float(r.float().mean())})
            for name, w in self.plus.items():
                part = ctx.source(name).rewards(ctx, batch).to(r.dtype)  # [B]
                ctx.log(**{f"reward/{name}": float(part.mean())})
                r = r + w * part
        env = ctx.spec.rollout.environment if ctx.spec is not None else None
        if env is not None and env.active and env.turn_reward_weight:  # the environment's per-turn rewards, summed
            from composer.lazy import torch

            turns = torch.tensor([sum(n.get("env", {}).get("rewards", [])) if isinstance(n, dict) else 0.0
                                  for n in batch.notes], dtype=r.dtype, device=r.device)  # [B]
            ctx.log(**{"reward/environment": float(turns.mean())})
            r = r + env.turn_reward_weight * turns
        batch.rewards = r
        return batch
