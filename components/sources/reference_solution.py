"""A step-by-step reference solution from the data (prior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("sources")
class ReferenceSolution(Component):
    """The dataset's reference solution for each prompt (POPE prefixes, OPSD/InT teacher context, SFT targets)."""

    kind: Literal["reference_solution"] = Field("reference_solution", description="Component kind.")
    field: str | None = Field(None, description="Data field holding the solution; default `data.solution_field`.")

    provides: ClassVar = ("reference_text",)
    pi: ClassVar[str] = "prior"

    def text(self, example_or_ctx, batch=None, i: int | None = None) -> str | None:
        """The solution of an example: `text(example)`, or `text(ctx, batch, i)` for row i of a batch."""
        ex = example_or_ctx if batch is None else batch.examples[i]
        if self.field and self.field in ex.meta and ex.meta[self.field] is not None:
            return str(ex.meta[self.field])
        return ex.solution

    def build(self, ctx, name: str):
        return self
