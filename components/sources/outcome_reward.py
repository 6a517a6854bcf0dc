"""Outcome reward: a verifier scores each finished rollout (posterior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from composer.contract import Source
from composer.registry import register


@register("sources")
class OutcomeReward(Source):
    """A verifier's sequence-level reward for each rollout (1 correct, 0 wrong)."""

    kind: Literal["outcome_reward"] = Field("outcome_reward", description="Component kind.")
    verifier: str = Field("auto", description="Verifier name: exact, math, code, toy, a registered name, or auto (the task's own: toy on the toy testbed, math otherwise).")
    success_threshold: float = Field(0.5, description="A rollout counts as a success when its reward is at least this (SDPO's success_reward_threshold).")

    provides: ClassVar = ("sequence_reward",)
    pi: ClassVar[str] = "posterior"
    decides_success: ClassVar[bool] = True

    @field_validator("verifier")
    @classmethod
    def _registered(cls, value: str) -> str:
        """An unknown name would only fail when the first reward is computed (or inside a cluster bundle)."""
        from composer.errors import did_you_mean
        from composer.registry import VERIFIERS

        if value != "auto" and value not in VERIFIERS:
            raise PydanticCustomError("unknown_verifier", "unknown verifier {name} ({hint})",
                                      {"name": ascii(value), "hint": did_you_mean(value, ["auto", *VERIFIERS])})
        return value

    def build(self, ctx, name: str):
        return RewardScorer(self, ctx.verifier(self.verifier))

    def reference_verdicts(self, texts: list[str], examples: list, task_verifier: str) -> list[tuple[float, bool]]:
        """The referee's verdicts (DESIGN.md section 10): the declared verifier (`verifier`; `auto` is the task's own,
        `task_verifier`) run again on each response's text as the referee decoded it, looked up in the registry by
        name (never the run's scorer): [(reward r_i, parsed_i)] per row, r_i = verifier(text_i, example_i).reward."""
        from composer.registry import VERIFIERS

        fn = VERIFIERS[task_verifier if self.verifier == "auto" else self.verifier].load()
        out = []
        for text, example in zip(texts, examples):
            verdict = fn(text, example)
            out.append((float(verdict.reward), bool(verdict.parsed)))
        return out


class RewardScorer:
    """Scores finished rollouts with the verifier; unreadable answers are counted, never silent."""

    def __init__(self, cfg: OutcomeReward, verify):
        self.cfg, self.verify = cfg, verify

    def verdicts(self, ctx, batch):
        """Per-row Verdicts, computed once per batch and kept in batch.info."""
        if "verdicts" not in batch.info:
            from composer.trajectory import response_texts

            texts = response_texts(batch, ctx.tokenizer)
            batch.info["texts"] = texts
            batch.info["verdicts"] = [self.verify(t, ex) for t, ex in zip(texts, batch.examples)]
        return batch.info["verdicts"]

    def rewards(self, ctx, batch):
        from composer.lazy import torch

        verdicts = self.verdicts(ctx, batch)
        ctx.log(unparsed_frac=sum(not v.parsed for v in verdicts) / max(len(verdicts), 1))
        return torch.tensor([v.reward for v in verdicts], dtype=torch.float32)

    def success(self, ctx, batch) -> list[bool]:
        return [v.reward >= self.cfg.success_threshold for v in self.verdicts(ctx, batch)]
