"""Reference-prefix guide (POPE)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("guide")
class PrefixGuide(Component):
    """Start guided rollouts from a prefix of the reference solution (Qu et al. 2026, POPE, arXiv 2601.18779)."""

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
