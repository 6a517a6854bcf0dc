"""An example third-party environment: `retry`, which tells the policy when its answer is wrong and lets it try again.

A rollout environment is a kind of the `environment` section (docs/plugins.md, "An environment"): a pydantic config
built on `composer.contract.EpisodeEnvironment` (which brings max_turns, max_env_tokens and turn_reward_weight) whose
`session()` returns one episode's state with two methods, text in and text out:

    reset(example) -> str                      text shown before the policy's first turn ('' for none)
    step(turn_text) -> (text, reward, done)    the environment's answer to the policy's turn, a per-turn reward (or
                                               None), and whether the episode ends

Nothing here knows a backend: the composer's episode program (composer/episodes.py) runs it in the Lightning driver,
and OpenRLHF's agent function runs the same session. Its answers are `environment` tokens, never trained; the
verifier reads the policy's final answer (after the last environment turn); the per-turn rewards are added to the
row's reward times `turn_reward_weight`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from composer.contract import EpisodeEnvironment
from composer.registry import register

__all__ = ["RetryEnvironment"]


@register("environment")
class RetryEnvironment(EpisodeEnvironment):
    """Tells the policy which line of its answer is wrong (against the example's reference solution) and lets it answer
    again; each wrong attempt costs `cost`."""

    kind: Literal["retry"] = Field("retry", description="Component kind.")
    message: str = Field("\nF:line {line} is wrong, try again\nA:", description="What the environment says after a wrong answer (appended as environment tokens; the policy answers after it); {line} is the first line of the attempt that differs from the example's reference solution (1-based).")
    cost: float = Field(0.1, ge=0, description="The per-turn reward of a wrong attempt is -cost (added to the row's reward times turn_reward_weight).")

    def describe(self, spec) -> str:
        return (f"the retry environment answers a wrong '#N' with {self.message!r}, naming the first wrong line (up to {self.max_turns} attempts; "
                f"each wrong one scores -{self.cost:g} x turn_reward_weight {self.turn_reward_weight:g})")

    def session(self):
        return RetrySession(self.message, self.cost)


class RetrySession:
    """One episode: the example's answer, compared with the last '#N' line of each attempt."""

    def __init__(self, message: str, cost: float):
        self.message, self.cost, self.answer, self.solution = message, cost, None, []

    def reset(self, example) -> str:
        self.answer = str(example.answer).strip()
        self.solution = [ln.strip() for ln in (example.solution or "").splitlines() if ln.strip()]
        return ""

    def step(self, text: str) -> tuple[str, float | None, bool]:
        found = re.findall(r"^#\s*(\S+)\s*$", text, flags=re.M)
        if found and found[-1] == self.answer:
            return "", None, True  # right: the episode ends, nothing more to say
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        line = next((k + 1 for k, (a, b) in enumerate(zip(lines, self.solution)) if a != b), min(len(lines), len(self.solution)) + 1)
        return self.message.format(line=line), -self.cost, False
