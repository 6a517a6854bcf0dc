"""Reference-prefix guide (POPE)."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("guide")
class PrefixGuide(Component):
    """Start guided rollouts from a prefix of the reference solution (Qu et al. 2026, POPE, arXiv 2601.18779).

    A prompt is guided with probability `guided_fraction` (ctx.rng). Its rollouts see the first k
    reference steps z_1..z_k, either in the prompt (x + instruction + z_{1:k}, the task's 'prefix'
    template when it has one) or as the start of the response (origin guide_prefix, no loss); the
    policy writes the rest. k <= max(1, floor(max_fraction * steps)); `search: minimal` takes the
    smallest k from which the current policy solves the problem in at least one of `search_samples`
    samples (searched the first time a problem is seen, cached by prompt; the largest k if none does);
    `fixed` always the largest. Guided and unguided rollouts are separate advantage groups.
    """

    kind: Literal["prefix"] = Field("prefix", description="Component kind.")
    reference: str = Field(..., description="The reference_solution source the prefix is taken from.")
    placement: Literal["prompt", "response"] = Field("prompt", description="`prompt`: after an instruction to continue from it (POPE); `response`: as the start of the response, origin guide_prefix, no loss.")
    max_fraction: float = Field(0.25, gt=0, le=1, description="Longest prefix, as a fraction of the reference's steps.")
    search: Literal["minimal", "fixed"] = Field("minimal", description="`minimal`: per problem, the shortest step prefix the policy can finish (searched before training, cached); `fixed`: always max_fraction.")
    search_samples: int = Field(8, ge=1, description="Samples per candidate prefix in the minimal search (solved if at least one succeeds).")
    guided_fraction: float = Field(0.5, ge=0, le=1, description="Fraction of prompts that are guided; guided and unguided rollouts form separate advantage groups.")
    instruction: str = Field("Continue from this partial solution:\n", description="Text placed before the prefix with placement `prompt`.")

    refs: ClassVar = {"reference": ("reference_solution",)}
    provides: ClassVar = ("guided_tokens",)

    def rollout(self, ctx, examples, n: int):
        """n rollouts per prompt; group 2i (unguided prompt i) or 2i + 1 (guided prompt i)."""
        from components.guides.intervention import successes
        from composer.runtime.trajectory import Row, assemble

        guided = [ctx.rng.random() < self.guided_fraction for _ in examples]
        ks = self.prefix_steps(ctx, [ex for ex, g in zip(examples, guided) if g])
        rows, cap = [], ctx.max_new_tokens
        for i, ex in enumerate(examples):
            k = ks.pop(0) if guided[i] else 0
            prompt, prefix = self.conditioned(ctx, ex, k)
            for _ in range(n):
                rows.append(Row(ex, prompt, [(prefix, "guide_prefix")], group=2 * i + guided[i], prompt_index=i,
                                control=not guided[i], guided=k > 0))
        gens = ctx.engine.generate([r.tokens for r in rows], cap, ctx.sampling)
        for r, g in zip(rows, gens):
            r.pieces = [p for p in r.pieces if p[0]] + [(g.tokens[: cap - len(r.response)], "policy")]
        ctx.costs["policy_tokens"] += sum(len(g.tokens) for g in gens)
        logprobs = ctx.engine.score([r.tokens for r in rows], ctx.sampling.temperature)
        steps = [len(self.prefix_text(ctx, ex, 10**9)[1]) and 0 for ex in ()]  # noqa: F841 (kept simple)
        del steps, successes
        return assemble(rows, ctx.pad_id, logprobs)
