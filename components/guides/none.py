"""No guide: every response token is the policy's own."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Guide
from composer.protocol import plain_row
from composer.registry import register


@register("guide")
class NoGuide(Guide):
    """Plain sampling: the policy writes every response token; every rollout is a control rollout."""

    kind: Literal["none"] = Field("none", description="Component kind.")

    plain: ClassVar[bool] = True

    def describe(self, spec) -> str:
        return ""

    def reference_control(self, spec, batch, tokenizer=None):
        return [True] * batch.size  # every rollout is the policy's alone

    def row(self, ctx, example, index: int, n: int):
        """One sample of the policy to the end of its budget."""
        return plain_row(ctx, example)
