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
    detail: Literal["answer", "step", "environment"] = Field("step", description="How much it says: `answer` (the final answer is wrong), `step` (also the first wrong step), or `environment` (what the rollout's environment said in the episode: its environment turns' text, one per line, under rollout.environment; None for a row it never answered).")

    provides: ClassVar = ("feedback_text",)
    needs: ClassVar = ("sequence_reward",)
    refs: ClassVar = {"from_": ("outcome_reward",)}
    pi: ClassVar[str] = "posterior"


    def text(self, ctx, batch, i: int):
        """Feedback on row i if it failed (per the `from` source), else None. `detail: environment`: the environment's
        messages in its episode; toy: the step checker's text ('the final answer is wrong; step k is wrong'); other
        tasks: the verifier's Verdict.detail."""
        scorer = ctx.source(self.from_)
        if scorer.success(ctx, batch)[i]:
            return None
        if self.detail == "environment":  # the environment's messages in the row's episode (origin environment)
            return environment_text(ctx, batch, i)
        checker = getattr(ctx.task, "step_checker", None)
        if hasattr(checker, "feedback_text"):
            return checker.feedback_text(batch.examples[i], batch.info["texts"][i], self.detail)
        return scorer.verdicts(ctx, batch)[i].detail or None


def environment_text(ctx, batch, i: int) -> str | None:
    """The text of row i's environment turns (each run of `environment` tokens decoded, stripped, one per line), or
    None when the environment never answered in it: what an SDPO / OPSD teacher is shown as the environment's
    feedback (rollout.environment; DESIGN.md section 11, "Environments")."""
    from composer.origins import CODE

    env = (batch.origin[i] == CODE["environment"]).tolist()
    ids = batch.tokens[i].tolist()
    runs, cur = [], []
    for t, e in zip(ids, env + [False]):
        if e:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    texts = [ctx.decode(r).strip() for r in runs]
    return "\n".join(t for t in texts if t) or None
