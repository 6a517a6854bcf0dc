"""A step-by-step reference solution from the data (prior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Source
from composer.registry import register


@register("sources")
class ReferenceSolution(Source):
    """The dataset's reference solution for each prompt (POPE prefixes, OPSD/InT teacher context, SFT targets)."""

    kind: Literal["reference_solution"] = Field("reference_solution", description="Component kind.")
    field: str | None = Field(None, description="Data field holding the solution; default `data.solution_field`.")

    provides: ClassVar = ("reference_text",)
    pi: ClassVar[str] = "prior"

    def example_text(self, example) -> str | None:
        """The solution of a problem: the `field` of its data row when set, else its solution."""
        if self.field and self.field in example.meta and example.meta[self.field] is not None:
            return str(example.meta[self.field])
        return example.solution

    def text(self, ctx, batch, i: int) -> str | None:
        return self.example_text(batch.examples[i])
