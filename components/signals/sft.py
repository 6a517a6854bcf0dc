"""SFT signal: teacher-forced targets, from a reference solution or from guided rollouts (InT)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.registry import Component, register


@register("signal")
class SftSignal(Component):
    """Demonstrations as training targets: a reference solution, or `guided` (policy prefix + intervention, InT)."""

    kind: Literal["sft"] = Field("sft", description="Component kind.")
    target: str = Field(..., description="A reference_solution source, or `guided`: the policy prefix plus the intervention of guided rollouts, truncated after it.")
    filter_samples: int = Field(8, ge=0, description="With `guided`: keep a target only if at least one of this many continuations from it succeeds (InT used 32); 0 keeps all.")

    refs: ClassVar = {"target": ("reference_solution",)}
    provides: ClassVar = ("sft_target",)
    usage: ClassVar[str] = "target"

    def ref_names(self) -> dict[str, list[str]]:
        return {} if self.target == "guided" else {"target": [self.target]}

    @property
    def makes_batch(self) -> bool:
        """A reference target needs no rollout: the batch is the demonstrations themselves."""
        return self.target != "guided"

    def make_batch(self, ctx, examples):
        from composer.runtime.trajectory import Row, assemble

        ref = ctx.source(self.target)
        rows = []
        for i, ex in enumerate(examples):
            target = ctx.encode(ref.text(ex)) + [ctx.eos_id]
            rows.append(Row(ex, ctx.encode(ex.prompt), [(target, "demonstration")], group=i, prompt_index=i))
        batch = assemble(rows, ctx.pad_id)
        batch.info["temperature"] = 1.0
        return batch

    def apply(self, ctx, batch):
        if self.target == "guided":
            return guided_targets(ctx, batch, self.filter_samples)
        return batch


def guided_targets(ctx, batch, filter_samples: int):
    """InT's SFT targets from guided rollouts: implemented with the guides (components/guides)."""
    from components.guides.intervention import sft_targets_from_guided

    return sft_targets_from_guided(ctx, batch, filter_samples)
