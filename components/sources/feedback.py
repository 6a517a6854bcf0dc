"""Environment feedback: text a verifier writes about a failed rollout (posterior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from composer.registry import Component, register


@register("sources")
class Feedback(Component):
    """Text about a failed rollout, as an environment would give it (SDPO's feedback context)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["feedback"] = Field("feedback", description="Component kind.")
    from_: str = Field(..., alias="from", description="The outcome_reward source whose verifier writes the feedback.")
    detail: Literal["answer", "step"] = Field("step", description="How much it says: `answer` (the final answer is wrong) or `step` (also the first wrong step).")

    provides: ClassVar = ("feedback_text",)
    needs: ClassVar = ("sequence_reward",)
    refs: ClassVar = {"from_": ("outcome_reward",)}
    pi: ClassVar[str] = "posterior"
