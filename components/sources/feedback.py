"""Environment feedback: text a verifier writes about a failed rollout (posterior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field

from composer.contract import Source
from composer.registry import register


@register("sources")
class Feedback(Source):
    """Text about a failed rollout, as an environment would give it (SDPO's feedback context)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: Literal["feedback"] = Field("feedback", description="Component kind.")
    from_: str = Field(..., alias="from", description="The outcome_reward source whose verifier writes the feedback.")
    detail: Literal["answer", "step"] = Field("step", description="How much it says: `answer` (the final answer is wrong) or `step` (also the first wrong step).")

    provides: ClassVar = ("feedback_text",)
    needs: ClassVar = ("sequence_reward",)
    refs: ClassVar = {"from_": ("outcome_reward",)}
    pi: ClassVar[str] = "posterior"


    def text(self, ctx, batch, i: int):
        """Feedback on row i if it failed (per the `from` source), else None. Toy: the step checker's
        text ('the final answer is wrong; step k is wrong'); other tasks: the verifier's Verdict.detail."""
        scorer = ctx.source(self.from_)
        if scorer.success(ctx, batch)[i]:
            return None
        checker = getattr(ctx.task, "step_checker", None)
        if hasattr(checker, "feedback_text"):
            return checker.feedback_text(batch.examples[i], batch.info["texts"][i], self.detail)
        return scorer.verdicts(ctx, batch)[i].detail or None
