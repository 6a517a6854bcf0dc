"""The segments a run executes, read back from the compiled Plan: both backends run exactly what plan.json says.

A segment is a step range with one resolved spec: the whole run (`main`), a phase (`phase<i>`), or a
stage (its name). Steps are global and 0-based; a stage's steps follow the previous stage's. What happens
at which step (syncs, LR, weights) is the Plan's schedule: composer/plan/schedule.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RunSegment:
    name: str
    start: int
    end: int  # exclusive
    spec: Any  # the resolved spec model of this segment
    stage: str | None  # the stage this segment belongs to (None without stages)


def segments_of(plan: dict, indices: list[int] | None = None) -> list[RunSegment]:
    """The plan's segments (or those at `indices`) with their specs validated again from plan.json's data."""
    from composer import registry
    from composer.lang.spec import spec_model

    registry.load_all()
    segs = plan["segments"] if indices is None else [plan["segments"][i] for i in indices]
    for module in (segs[0]["spec"].get("plugins") or []) if segs else []:
        __import__(module)  # named by a spec that was validated (and its plugins allowed) when compiled
    model = spec_model()
    return [RunSegment(s["name"], s["start"], s["end"], model.model_validate(s["spec"]), s.get("stage"))
            for s in segs]


def segment_at(segments: list[RunSegment], step: int) -> RunSegment:
    """The segment in force at global `step` (the last one past the end)."""
    for seg in segments:
        if seg.start <= step < seg.end:
            return seg
    return segments[-1]
