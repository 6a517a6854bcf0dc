"""An oracle judge for tasks with a step checker: interventions correct by construction."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Source
from composer.registry import register


@register("sources")
class Oracle(Source):
    """The task's programmatic step checker acting as a judge (toy testbed): finds the first wrong step and writes the right one."""

    kind: Literal["oracle"] = Field("oracle", description="Component kind.")

    provides: ClassVar = ("judge",)
    pi: ClassVar[str] = "prior"

    @property
    def needs_step_checker(self) -> bool:
        return True
