"""Reference-prefix guide (POPE)."""

from __future__ import annotations

import hashlib
import math
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from composer.contract import Guide, ModelCall
from composer.registry import register
from composer.protocol import INITIAL, Sample, Trace


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
    reference: str = Field(..., description="Where prefixes come from: a reference_solution source (a data field: the reference, or a column of off-policy traces via its `field`), or a policy_model source whose generations are the traces (rejection-sampled: the first of `trace_samples` that the verifier accepts, generated once per problem and cached).")
    placement: Literal["prompt", "response"] = Field("prompt", description="`prompt`: after an instruction to continue from it (POPE); `response`: as the start of the response, origin guide_prefix, no loss.")
    max_fraction: float = Field(0.25, gt=0, le=1, description="Longest prefix, as a fraction of the reference's steps (floor; never exceeded).")
    search: Literal["minimal", "fixed", "random"] = Field("minimal", description="`minimal`: per problem, the shortest step prefix the initial policy can finish (searched once, cached); `fixed`: always max_fraction; `random`: per problem and step, a length drawn uniformly between min_fraction and max_fraction of the reference (PrefixRL), the same for every rollout of the prompt.")
    min_fraction: float = Field(0.0, ge=0, lt=1, description="With search: random, the shortest prefix as a fraction of the reference (ceil).")
    unit: Literal["steps", "tokens"] = Field("steps", description="What fractions count: reference steps (split on the task's step separator) or tokens; `tokens` needs placement: response.")
    trace_samples: int = Field(8, ge=1, description="With a policy_model reference: generations per problem to find one the verifier accepts.")
    search_samples: int = Field(8, ge=1, description="Samples per candidate prefix in the minimal search (solved if at least one succeeds).")
    guided_fraction: float = Field(0.5, ge=0, le=1, description="Fraction of prompts that are guided; guided and unguided rollouts form separate advantage groups.")
    instruction: str = Field("Continue from this partial solution:\n", description="Text placed before the prefix with placement `prompt`.")

    refs: ClassVar = {"reference": ("reference_solution", "policy_model")}

    @model_validator(mode="after")
    def _settings_apply(self):
        if self.unit == "tokens" and self.placement != "response":
            raise ValueError("unit: tokens cuts the reference mid-step, which only placement: response can show "
                             "(as guide_prefix tokens)")
        if self.search != "random" and "min_fraction" in self.model_fields_set:
            raise ValueError("min_fraction applies to search: random")
        if self.min_fraction > self.max_fraction:
            raise ValueError(f"min_fraction {self.min_fraction:g} is above max_fraction {self.max_fraction:g}")
        return self
    provides: ClassVar = ("guided_tokens",)
    writes: ClassVar = ("guide_prefix",)

    def writes_now(self) -> tuple[str, ...]:
        return ("guide_prefix",) if self.placement == "response" else ()

    def model_calls(self, spec) -> list[ModelCall]:
        """A policy_model reference writes the traces: one generation of up to rollout.max_new_tokens each."""
        src = spec.sources.get(self.reference)
        if src is None or src.kind_name() != "policy_model":
            return []
        return [ModelCall(self.reference, spec.rollout.max_new_tokens, "\n", src.weights, sampled=True)]

    def extra_tokens(self, spec, max_solution_tokens: int) -> int:
        return max_solution_tokens + len(self.instruction) + 8  # the prefix (never the whole reference) in the prompt

    def reads(self) -> dict[str, str]:
        return {"guide:prefix-search": "initial"} if self.search == "minimal" else {}

    def describe(self, spec) -> str:
        k = {"minimal": "the shortest prefix the initial policy can finish", "fixed": "a fixed prefix",
             "random": f"a prefix whose length is drawn per problem uniformly from {self.min_fraction:g} to "
                       f"{self.max_fraction:g} of the {self.unit} of"}[self.search]
        where = "in the prompt" if self.placement == "prompt" else "as guide_prefix tokens at the start of the response"
        return (f"{self.guided_fraction:.0%} of prompts carry {k} of '{self.reference}' (at most "
                f"{self.max_fraction:g} of its steps) {where}")

    # ---- the referee's formulas (DESIGN.md section 10): written again, sharing nothing with the protocol below ----
    def reference_prefix_steps(self, spec, example, step: int, n_ref: int) -> tuple[int, int]:
        """The prefix this guide must show `example` at `step`, from the spec alone: (k_min, k_max) of the reference's
        n_ref units. Not chosen (sha256(prompt|step|seed) / 16^8 >= guided_fraction): (0, 0). Chosen: at most
        floor(max_fraction n), never the whole reference; `fixed` exactly that; `random` the hashed draw between
        ceil(min_fraction n) and it; `minimal` any k from 0 (the initial policy needs none) to it."""
        seed = spec.train.seed
        u = int(hashlib.sha256(f"{example.prompt}|{step}|{seed}".encode()).hexdigest()[:8], 16) / 16 ** 8
        if u >= self.guided_fraction:
            return 0, 0
        kmax = max(0, min(math.floor(self.max_fraction * n_ref), n_ref - 1))
        if self.search == "fixed":
            return kmax, kmax
        if self.search == "random":
            kmin = min(math.ceil(self.min_fraction * n_ref), kmax)
            v = int(hashlib.sha256(f"{example.prompt}|{step}|{seed}|k".encode()).hexdigest()[:8], 16) / 16 ** 8
            k = kmin + min(int(v * (kmax - kmin + 1)), kmax - kmin)
            return k, k
        return 0, kmax

    def reference_control(self, spec, batch, tokenizer=None):
        """Rows that show no prefix: placed in the response, no guide_prefix token; placed in the prompt (POPE), the
        decoded prompt shows no step of the row's reference solution (needs the tokenizer; None without one)."""
        from composer.origins import CODE

        if self.placement == "response":
            return [not bool((batch.origin[i] == CODE["guide_prefix"]).any()) for i in range(batch.size)]
        if tokenizer is None:
            return None
        out = []
        for i in range(batch.size):
            ex = batch.examples[i] if len(batch.examples) == batch.size else batch.examples[int(batch.prompt_index[i])]
            first = next((s for s in (ex.solution or "").split("\n") if s.strip()), None)
            shown = (batch.origin[i] == CODE["prompt"]) & batch.attention_mask[i].bool()
            text = tokenizer.decode(batch.tokens[i][shown].tolist(), skip_special_tokens=True)
            out.append(first is None or first not in text.replace(ex.problem or "\0", ""))
        return out

    # ---- the protocol ----
    def prepare(self, ctx, examples):
        """The minimal search for every guided problem not searched before (one program per problem)."""
        traces = self.trace_programs(ctx, examples)
        if self.search != "minimal":
            return traces
        cache = self.cache(ctx)
        todo = {ex.prompt: ex for ex in examples if self.chosen(ctx, ex) and ex.prompt not in cache}
        return traces + [self.search_program(ctx, ex) for ex in todo.values()]

    def row(self, ctx, example, index: int, n: int):
        """One rollout: k = 0 for an unguided prompt, else the cached (or largest) k; the policy writes the rest."""
        chosen = self.chosen(ctx, example)
        k = self.steps_for(ctx, example) if chosen else 0
        prompt, prefix = self.conditioned(ctx, example, k)
        trace = Trace(prompt, control=k == 0, guided=k > 0, tag="guided" if k > 0 else "")
        trace.add(prefix, "guide_prefix")
        trace.notes.update(prefix_steps=k, chosen=chosen, ref_steps=len(self.ref_units(ctx, example)))
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

    def ref_text(self, ctx, ex) -> str:
        """The reference of a problem: the reference_solution's text, or the cached accepted trace of a
        policy_model reference ('' when none was accepted: the prompt stays unguided)."""
        if ctx.spec.sources[self.reference].kind_name() == "policy_model":
            return self.traces(ctx).get(ex.prompt) or ""
        return ctx.source(self.reference).example_text(ex) or ""

    def traces(self, ctx) -> dict:
        """prompt -> accepted trace text of a policy_model reference (kept in checkpoints with the searches)."""
        return ctx.memo.prefix_traces.setdefault(self.model_dump_json(), {})

    def trace_programs(self, ctx, examples) -> list:
        """For a policy_model reference: per problem without a trace yet, `trace_samples` generations of that
        model from the policy's prompt; the first the verifier accepts is the trace (none: '')."""
        if ctx.spec.sources[self.reference].kind_name() != "policy_model":
            return []
        done = self.traces(ctx)
        todo = {ex.prompt: ex for ex in examples if ex.prompt not in done}
        return [self.trace_program(ctx, ex) for ex in todo.values()]

    def trace_program(self, ctx, ex):
        from components.guides.intervention import successes

        gens = yield Sample(ctx.prompt_ids(ex), ctx.max_new_tokens, n=self.trace_samples, model=self.reference,
                            purpose="teacher")
        texts = [ctx.decode([t for t in g.tokens if t != ctx.eos_id]) for g in gens]
        ok = successes(ctx, [ex] * len(texts), texts)
        self.traces(ctx)[ex.prompt] = next((t for t, good in zip(texts, ok) if good), "")
        return ok

    def ref_units(self, ctx, ex) -> list:
        """The reference in the units prefixes count: steps (strings) or token ids."""
        if self.unit == "tokens":
            return ctx.encode(self.ref_text(ctx, ex))
        return self.ref_steps(ctx, ex)

    def ref_steps(self, ctx, ex) -> list[str]:
        """The reference solution split into steps on the task's step separator."""
        steps = self.ref_text(ctx, ex).split(ctx.task.step_split)
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
        if self.unit == "tokens":  # placement response (validated): the reference's first k tokens
            return ctx.prompt_ids(ex), self.ref_units(ctx, ex)[:k]
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
        return ctx.memo.prefixes.setdefault(self.model_dump_json(), {})

    def steps_for(self, ctx, example) -> int:
        n = len(self.ref_units(ctx, example))
        kmax = self.max_steps(n)
        if self.search == "fixed":
            return kmax
        if self.search == "random":  # uniform over [ceil(min_fraction n), kmax], by hash: every rollout agrees
            kmin = min(math.ceil(self.min_fraction * n), kmax)
            key = f"{example.prompt}|{ctx.step}|{ctx.spec.train.seed}|k".encode()
            u = int(hashlib.sha256(key).hexdigest()[:8], 16) / 16 ** 8
            return kmin + min(int(u * (kmax - kmin + 1)), kmax - kmin)
        return self.cache(ctx).get(example.prompt, kmax)

    def search_program(self, ctx, ex):
        """Every k in 0..k_max with `search_samples` samples of the initial policy at once; k* = the smallest
        k with a success under the verifier, k_max if none succeeds. Cached for the run."""
        from components.guides.intervention import successes

        kmax = self.max_steps(len(self.ref_units(ctx, ex)))
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
