"""Outcome reward: a verifier scores each finished rollout (posterior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("sources")
class OutcomeReward(Component):
    """A verifier's sequence-level reward for each rollout (1 correct, 0 wrong)."""

    kind: Literal["outcome_reward"] = Field("outcome_reward", description="Component kind.")
    verifier: str = Field("auto", description="Verifier name: exact, math, code, toy, a registered name, or auto (the task's own: toy on the toy testbed, math otherwise).")
    success_threshold: float = Field(0.5, description="A rollout counts as a success when its reward is at least this (SDPO's success_reward_threshold).")

    provides: ClassVar = ("sequence_reward",)
    pi: ClassVar[str] = "posterior"
