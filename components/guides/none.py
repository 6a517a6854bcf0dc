"""No guide: every response token is the policy's own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from composer.registry import Component, register


@register("guide")
class NoGuide(Component):
    """Plain sampling: the policy writes every response token; every rollout is a control rollout."""

    kind: Literal["none"] = Field("none", description="Component kind.")

    def rollout(self, ctx, examples, n: int):
        """Sample n responses per prompt; every token is the policy's and every rollout a control."""
        return sample_plain(ctx, examples, n)


def sample_plain(ctx, examples, n: int, group_offset: int = 0, control: bool = True):
    """n plain samples per example as one batch: groups by prompt, behaviour log-probs from the engine."""
    from composer.runtime.trajectory import Row, assemble

    rows = []
    for i, ex in enumerate(examples):
        prompt = ctx.encode(ex.prompt)
        rows += [Row(ex, prompt, group=group_offset + i, prompt_index=i, control=control) for _ in range(n)]
    gens = ctx.engine.generate([r.prompt for r in rows], ctx.max_new_tokens, ctx.sampling)
    for r, g in zip(rows, gens):
        r.pieces = [(g.tokens, "policy")]
    ctx.costs["policy_tokens"] += sum(len(g.tokens) for g in gens)
    logprobs = ctx.engine.score([r.tokens for r in rows], ctx.sampling.temperature)
    return assemble(rows, ctx.pad_id, logprobs)
