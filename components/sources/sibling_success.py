"""A successful rollout of the same group, shown to a self-teacher (SDPO)."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from composer.contract import Source
from composer.registry import register


@register("sources")
class SiblingSuccess(Source):
    """A successful sibling rollout of the same prompt, never the rollout itself (Hübotter et al. 2026, SDPO)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["sibling_success"] = Field("sibling_success", description="Component kind.")
    from_: str = Field(..., alias="from", description="The outcome_reward source that decides which rollouts succeeded.")

    provides: ClassVar = ("sibling_text",)
    needs: ClassVar = ("sequence_reward",)
    refs: ClassVar = {"from_": ("outcome_reward",)}
    pi: ClassVar[str] = "posterior"


    def text(self, ctx, batch, i: int):
        """The response text of the first successful rollout j != i with batch.group[j] == batch.group[i]
        (SDPO dont_reprompt_on_self_success), `<think>...</think>` stripped; None if there is none."""
        success = ctx.source(self.from_).success(ctx, batch)  # also fills batch.info["texts"]
        group = batch.group.tolist()
        for j in range(batch.size):
            if j != i and group[j] == group[i] and success[j]:
                text = batch.info["texts"][j]
                return THINK.sub("", text).lstrip() if "<think>" in text else text
        return None


THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
