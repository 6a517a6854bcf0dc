"""Schedules for numbers: a numeric setting that changes with the step (DESIGN.md section 9).

A field typed `Scheduled` takes a plain number or a schedule; `value_at(x, step)` resolves it at a global
optimizer step (0-based, counted from the run's start like `phases[].until`). Pure Python, no torch: the
Plan, validation, `explain` and both backends read the same function of the step.

  linear:  v(s) = start + (end - start) * min(s - begin, steps) / steps            (s >= begin)
  cosine:  v(s) = end + (start - end) * (1 + cos(pi * min(s - begin, steps) / steps)) / 2
  step:    v(s) = start while s - begin < steps, then end
Before `begin` every kind holds `start`; after `begin + steps` every kind holds `end`.
KDRL's annealed KD coefficient (Xu et al. 2025, arXiv 2506.02208) is `{kind: linear, start: 1, end: 0.1, steps: 100}`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from composer.registry import NumbersNotBooleans


class Schedule(NumbersNotBooleans, BaseModel):
    """A number that moves from `start` to `end` over `steps` optimizer steps from step `begin`."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["linear", "cosine", "step"] = Field(..., description="Shape: linear ramp, half-cosine, or one jump at begin + steps.")
    start: float = Field(..., allow_inf_nan=False, description="Value up to step `begin`.")
    end: float = Field(..., allow_inf_nan=False, description="Value from step `begin + steps` on.")
    steps: int = Field(..., ge=1, le=10**9, description="Steps the change takes (linear, cosine) or waits (step).")
    begin: int = Field(0, ge=0, le=10**9, description="Global step at which the change starts (0: the run's start).")

    def at(self, step: int) -> float:
        frac = min(max(step - self.begin, 0), self.steps) / self.steps
        if self.kind == "linear":
            return self.start + (self.end - self.start) * frac
        if self.kind == "cosine":
            return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.start if step - self.begin < self.steps else self.end

    def reference(self, step: int) -> float:
        """The referee's value at `step` (DESIGN.md section 10): the module docstring's formulas written again, one
        case per region of the step axis, sharing nothing with `at` (a bug there must not hide here)."""
        done = step - self.begin  # steps of the change already made
        if done <= 0:
            return float(self.start)
        if done >= self.steps:
            return float(self.end)
        if self.kind == "step":
            return float(self.start)
        x = done / self.steps
        if self.kind == "linear":
            return (1.0 - x) * self.start + x * self.end
        w = 0.5 + 0.5 * math.cos(math.pi * x)  # cosine: the weight of start, 1 at x = 0, 0 at x = 1
        return w * self.start + (1.0 - w) * self.end

    def describe(self) -> str:
        return (f"{self.kind} {self.start:g} -> {self.end:g} over steps {self.begin}-{self.begin + self.steps}")


def scheduled(description: str, **number) -> Any:
    """The annotation of a field that takes a number or a schedule (`number`: pydantic bounds of the number)."""
    return Union[Annotated[float, Field(allow_inf_nan=False, **number)], Schedule]


def value_at(x, step: int) -> float:
    """A Scheduled field's value at global optimizer step `step`."""
    return x.at(step) if isinstance(x, Schedule) else x


def reference_value(x, step: int) -> float:
    """The referee's evaluation of a Scheduled field at `step` (`Schedule.reference`, never `Schedule.at`)."""
    return x.reference(step) if isinstance(x, Schedule) else x


def resolved_number(x, what: str) -> float:
    """A field's number inside a loss: a schedule must have been resolved for the step (`resolve`) before."""
    if isinstance(x, Schedule):
        raise ValueError(f"{what} is a schedule that was not resolved for the step (composer.lang.curves.resolve)")
    return x


def values(x) -> tuple[float, float]:
    """(smallest, largest) value the field ever takes."""
    if isinstance(x, Schedule):
        return min(x.start, x.end), max(x.start, x.end)
    return x, x


def ever_nonzero(x) -> bool:
    lo, hi = values(x)
    return lo != 0 or hi != 0


def describe(x) -> str:
    """Text for `explain` and plan.json: the number, or the schedule in words."""
    return x.describe() if isinstance(x, Schedule) else f"{x:g}"


def is_scheduled(x) -> bool:
    return isinstance(x, Schedule)


def resolve(component, step: int):
    """`component` with every Schedule field replaced by its value at `step` (a shallow copy), or the component
    itself when it has none: a spec without schedules runs on exactly the objects it always did."""
    update = {n: value_at(v, step) for n, v in component if isinstance(v, Schedule)}
    return component.model_copy(update=update) if update else component


def schedule_json(x) -> Union[float, dict]:
    return x.model_dump() if isinstance(x, Schedule) else x


ScheduledNumber = Union[Annotated[float, Field(allow_inf_nan=False)], Schedule]
