"""A plugin guide for tests/test_openrlhf_real.py: `first_step_hint`, shipped in a bundle like any plugin.

Even-numbered rollouts of a prompt start from the reference solution's first line, written as response
tokens of origin `guide_prefix` (no loss, not the policy's); odd-numbered ones are plain control rollouts.
Guided and plain rollouts form separate advantage groups (tag "hint").
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Guide
from composer.registry import register


@register("guide")
class FirstStepHint(Guide):
    """Even rollouts start from the first line of the example's reference solution (guide_prefix tokens)."""

    kind: Literal["first_step_hint"] = Field("first_step_hint", description="Component kind.")
    separator: str = Field("\n", description="What ends the first line of the reference solution.")

    writes: ClassVar = ("guide_prefix",)

    def extra_tokens(self, spec, max_solution_tokens: int) -> int:
        return 0  # the hint is part of the response budget

    def describe(self, spec) -> str:
        return "even rollouts start from the reference solution's first line (guide_prefix, no loss)"

    def row(self, ctx, example, index: int, n: int):
        from composer.protocol import Sample, Trace

        hinted = index % 2 == 0 and bool(example.solution)
        trace = Trace(ctx.prompt_ids(example), control=not hinted, guided=hinted, tag="hint" if hinted else "")
        if hinted:
            trace.add(ctx.encode(example.solution.split(self.separator)[0] + self.separator), "guide_prefix")
        [gen] = yield Sample(trace.tokens, ctx.max_new_tokens - (len(trace.tokens) - len(trace.prompt)))
        trace.add(gen.tokens, "policy", gen.logprobs)
        return trace
