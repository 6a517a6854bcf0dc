"""A step-by-step reference solution from the data (prior privileged information)."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from composer.registry import Component, register


@register("sources")
class ReferenceSolution(Component):
    """The dataset's reference solution for each prompt (POPE prefixes, OPSD/InT teacher context, SFT targets)."""

    kind: Literal["reference_solution"] = Field("reference_solution", description="Component kind.")
    field: Optional[str] = Field(None, description="Data field holding the solution; default `data.solution_field`.")

    provides: ClassVar = ("reference_text",)
    pi: ClassVar[str] = "prior"

    def text(self, example) -> str:
        return example.solution

    def build(self, ctx, name: str):
        return self
