"""No guide: every response token is the policy's own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from composer.registry import Component, register


@register("guide")
class NoGuide(Component):
    """Plain sampling: the policy writes every response token; every rollout is a control rollout."""

    kind: Literal["none"] = Field("none", description="Component kind.")
