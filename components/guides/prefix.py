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
        """n rollouts per prompt, one batched generate; group 2i (unguided prompt i) or 2i + 1 (guided)."""
        from composer.runtime.trajectory import Row, assemble

        chosen = [ctx.rng.random() < self.guided_fraction for _ in examples]
        ks = iter(self.prefix_steps(ctx, [ex for ex, c in zip(examples, chosen) if c]))
        rows, cap, used = [], ctx.max_new_tokens, []
        for i, ex in enumerate(examples):
            k = next(ks) if chosen[i] else 0
            used += [k] if chosen[i] else []
            prompt, prefix = self.conditioned(ctx, ex, k)
            rows += [Row(ex, prompt, [(prefix, "guide_prefix")] if prefix else [], group=2 * i + chosen[i],
                         prompt_index=i, control=k == 0, guided=k > 0) for _ in range(n)]
        gens = ctx.engine.generate([r.tokens for r in rows], cap, ctx.sampling)
        for r, g in zip(rows, gens):
            r.pieces.append((g.tokens[: cap - len(r.response)], "policy"))  # response cap holds
        ctx.costs["policy_tokens"] += sum(len(g.tokens) for g in gens)
        logprobs = ctx.engine.score([r.tokens for r in rows], ctx.sampling.temperature)
        ctx.log(**{"guide/guided_frac": sum(r.guided for r in rows) / len(rows),
                   "guide/prefix_steps": sum(used) / max(len(used), 1)})
        return assemble(rows, ctx.pad_id, logprobs)

    # ---- prefixes ----
    def ref_steps(self, ctx, ex) -> list[str]:
        """The reference solution split into steps on the task's step separator."""
        steps = ctx.source(self.reference).text(ex).split(ctx.task.step_split)
        while steps and not steps[-1].strip():
            steps.pop()
        return steps

    def max_steps(self, n_steps: int) -> int:
        """floor(max_fraction * steps), at least 1, never the whole reference."""
        return max(0, min(max(1, math.floor(self.max_fraction * n_steps)), n_steps - 1))

    def conditioned(self, ctx, ex, k: int) -> tuple[list[int], list[int]]:
        """(prompt tokens, response-prefix tokens) showing the first k reference steps; k = 0: the plain prompt."""
        if k == 0:
            return ctx.encode(ex.prompt), []
        sep = ctx.task.step_split
        prefix = sep.join(self.ref_steps(ctx, ex)[:k])
        if self.placement == "response":
            return ctx.encode(ex.prompt), ctx.encode(prefix + sep)
        template = ctx.task.templates.get("prefix")
        text = template.format(problem=ex.problem, prefix=prefix) if template else \
            ex.prompt + self.instruction + prefix + sep
        return ctx.encode(text), []

    def prefix_steps(self, ctx, examples) -> list[int]:
        """k per example: the largest (`fixed`) or the cached minimal one (`minimal`, searched on first sight).

        The search is one batched generate over every new problem x every k in 0..k_max x search_samples;
        k* = the smallest k with at least one success under the verifier, k_max if none succeeds.
        """
        from components.guides.intervention import successes

        kmax = [self.max_steps(len(self.ref_steps(ctx, ex))) for ex in examples]
        if self.search == "fixed":
            return kmax
        cache = ctx.runtimes.setdefault(("guide", "prefix-search", self.model_dump_json()), {})
        todo = {ex.prompt: (ex, m) for ex, m in zip(examples, kmax) if ex.prompt not in cache}
        if todo:
            cap, S = ctx.max_new_tokens, self.search_samples
            cands = [(ex, k) for ex, m in todo.values() for k in range(m + 1)]
            inputs = [self.conditioned(ctx, ex, k) for ex, k in cands for _ in range(S)]
            gens = ctx.engine.generate([p + q for p, q in inputs], cap, ctx.sampling)
            ctx.costs["policy_tokens"] += sum(len(g.tokens) for g in gens)
            texts = [ctx.decode(q + g.tokens[: cap - len(q)]) for (_p, q), g in zip(inputs, gens)]
            ok = successes(ctx, [ex for ex, _k in cands for _ in range(S)], texts)
            solved = {}
            for c, (ex, k) in enumerate(cands):
                if ex.prompt not in solved and any(ok[c * S: (c + 1) * S]):
                    solved[ex.prompt] = k  # candidates are in increasing k: the first is the shortest
            for prompt, (_ex, m) in todo.items():
                cache[prompt] = solved.get(prompt, m)
            ctx.log(**{"guide/search_solved": len(solved) / len(todo), "guide/searched": len(todo)})
        return [cache[ex.prompt] for ex in examples]
