"""Reference-prefix guide (POPE)."""

from __future__ import annotations

import hashlib
import math
from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Guide
from composer.registry import register
from composer.runtime.protocol import INITIAL, Sample, Trace


@register("guide")
class PrefixGuide(Guide):
    """Start guided rollouts from a prefix of the reference solution (Qu et al. 2026, POPE, arXiv 2601.18779).

    A prompt is guided with probability `guided_fraction`, decided by a hash of (prompt, step, seed) so
    that every rollout of the prompt, on every backend, agrees. Its rollouts see the first k reference
    steps z_1..z_k, either in the prompt (the task's 'prefix' template, else x + instruction + z_{1:k})
    or as the start of the response (origin guide_prefix, no loss); the policy writes the rest.
    k <= floor(max_fraction * steps), never the whole reference; a reference too short for any prefix
    within max_fraction leaves the prompt unguided (counted). `search: minimal` takes the smallest k from
    which the *initial* policy solves the problem in at least one of `search_samples` samples, searched
    once per problem and cached (the paper fixes prefixes once, from the base policy, before RL; the
    largest k if none does); `fixed` always the largest. Guided and unguided rollouts are separate
    advantage groups.
    """

    kind: Literal["prefix"] = Field("prefix", description="Component kind.")
    reference: str = Field(..., description="The reference_solution source the prefix is taken from.")
    placement: Literal["prompt", "response"] = Field("prompt", description="`prompt`: after an instruction to continue from it (POPE); `response`: as the start of the response, origin guide_prefix, no loss.")
    max_fraction: float = Field(0.25, gt=0, le=1, description="Longest prefix, as a fraction of the reference's steps (floor; never exceeded).")
    search: Literal["minimal", "fixed"] = Field("minimal", description="`minimal`: per problem, the shortest step prefix the initial policy can finish (searched once, cached); `fixed`: always max_fraction.")
    search_samples: int = Field(8, ge=1, description="Samples per candidate prefix in the minimal search (solved if at least one succeeds).")
    guided_fraction: float = Field(0.5, ge=0, le=1, description="Fraction of prompts that are guided; guided and unguided rollouts form separate advantage groups.")
    instruction: str = Field("Continue from this partial solution:\n", description="Text placed before the prefix with placement `prompt`.")

    refs: ClassVar = {"reference": ("reference_solution",)}
    provides: ClassVar = ("guided_tokens",)
    writes: ClassVar = ("guide_prefix",)

    def writes_now(self) -> tuple[str, ...]:
        return ("guide_prefix",) if self.placement == "response" else ()

    def extra_tokens(self, spec, max_solution_tokens: int) -> int:
        return max_solution_tokens + len(self.instruction) + 8  # the prefix (never the whole reference) in the prompt

    def reads(self) -> dict[str, str]:
        return {"guide:prefix-search": "initial"} if self.search == "minimal" else {}

    def describe(self, spec) -> str:
        k = "the shortest prefix the initial policy can finish" if self.search == "minimal" else "a fixed prefix"
        where = "in the prompt" if self.placement == "prompt" else "as guide_prefix tokens at the start of the response"
        return (f"{self.guided_fraction:.0%} of prompts carry {k} of '{self.reference}' (at most "
                f"{self.max_fraction:g} of its steps) {where}")

    # ---- the protocol ----
    def prepare(self, ctx, examples):
        """The minimal search for every guided problem not searched before (one program per problem)."""
        if self.search != "minimal":
            return []
        cache = self.cache(ctx)
        todo = {ex.prompt: ex for ex in examples if self.chosen(ctx, ex) and ex.prompt not in cache}
        return [self.search_program(ctx, ex) for ex in todo.values()]

    def row(self, ctx, example, index: int, n: int):
        """One rollout: k = 0 for an unguided prompt, else the cached (or largest) k; the policy writes the rest."""
        chosen = self.chosen(ctx, example)
        k = self.steps_for(ctx, example) if chosen else 0
        prompt, prefix = self.conditioned(ctx, example, k)
        trace = Trace(prompt, control=k == 0, guided=k > 0, tag="guided" if k > 0 else "")
        trace.add(prefix, "guide_prefix")
        trace.notes.update(prefix_steps=k, chosen=chosen, ref_steps=len(self.ref_steps(ctx, example)))
        [gen] = yield Sample(trace.tokens, ctx.max_new_tokens - len(prefix))
        trace.add(gen.tokens, "policy", gen.logprobs)
        return trace

    def metrics(self, traces) -> dict[str, float]:
        """guided_frac: rollouts that saw a prefix; chosen_frac: of prompts drawn for guidance (the minimal
        search may find that none is needed: k = 0); the prefix-length distribution as k and k / steps."""
        chosen = [t for t in traces if t.notes.get("chosen")]
        guided = [t.notes for t in traces if t.guided]
        out = {"guided_frac": len(guided) / max(len(traces), 1), "chosen_frac": len(chosen) / max(len(traces), 1),
               "prefix_steps": sum(g["prefix_steps"] for g in guided) / max(len(guided), 1),
               "prefix_fraction_max": max((g["prefix_steps"] / g["ref_steps"] for g in guided), default=0.0)}
        for k in sorted({g["prefix_steps"] for g in guided}):
            out[f"prefix_k{k}_frac"] = sum(g["prefix_steps"] == k for g in guided) / len(guided)
        return out

    # ---- prefixes ----
    def chosen(self, ctx, example) -> bool:
        """Whether this prompt is guided at this step: a hash of (prompt, step, seed) below guided_fraction."""
        key = f"{example.prompt}|{ctx.step}|{ctx.spec.train.seed}".encode()
        return int(hashlib.sha256(key).hexdigest()[:8], 16) / 16 ** 8 < self.guided_fraction

    def ref_steps(self, ctx, ex) -> list[str]:
        """The reference solution split into steps on the task's step separator."""
        steps = (ctx.source(self.reference).example_text(ex) or "").split(ctx.task.step_split)
        while steps and not steps[-1].strip():
            steps.pop()
        return steps

    def max_steps(self, n_steps: int) -> int:
        """floor(max_fraction * steps), never the whole reference (0: no prefix fits)."""
        return max(0, min(math.floor(self.max_fraction * n_steps), n_steps - 1))

    def conditioned(self, ctx, ex, k: int) -> tuple[list[int], list[int]]:
        """(prompt tokens, response-prefix tokens) showing the first k reference steps; k = 0: the plain prompt."""
        if k == 0:
            return ctx.prompt_ids(ex), []
        sep = ctx.task.step_split
        prefix = sep.join(self.ref_steps(ctx, ex)[:k])
        if self.placement == "response":
            return ctx.prompt_ids(ex), ctx.encode(prefix + sep)
        template = ctx.task.templates.get("prefix")
        if template:
            return ctx.encode(template.format(problem=ex.problem, prefix=prefix)), []
        fmt = ctx.prompt_format()  # the prefix goes into the user's message, before any chat generation prompt
        text = fmt.wrap(fmt.user(ex) + self.instruction + prefix + sep) if fmt.mode != "task" else \
            ex.prompt + self.instruction + prefix + sep
        return ctx.encode(text), []

    def cache(self, ctx) -> dict:
        """prompt -> k found by the minimal search (kept in checkpoints with the run's caches)."""
        return ctx.cache.setdefault(("guide", "prefix-search", self.model_dump_json()), {})

    def steps_for(self, ctx, example) -> int:
        kmax = self.max_steps(len(self.ref_steps(ctx, example)))
        if self.search == "fixed":
            return kmax
        return self.cache(ctx).get(example.prompt, kmax)

    def search_program(self, ctx, ex):
        """Every k in 0..k_max with `search_samples` samples of the initial policy at once; k* = the smallest
        k with a success under the verifier, k_max if none succeeds. Cached for the run."""
        from components.guides.intervention import successes

        kmax = self.max_steps(len(self.ref_steps(ctx, ex)))
        cands = [self.conditioned(ctx, ex, k) for k in range(kmax + 1)]
        answers = yield [Sample(p + q, ctx.max_new_tokens - len(q), n=self.search_samples, model=INITIAL,
                                purpose="search") for p, q in cands]
        found = kmax
        for k, ((_p, q), gens) in enumerate(zip(cands, answers)):
            if any(successes(ctx, [ex] * len(gens), [ctx.decode(q + g.tokens) for g in gens])):
                found = k
                break
        self.cache(ctx)[ex.prompt] = found
        return found
