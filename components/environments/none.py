"""No environment: a rollout is one policy turn."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from composer.contract import Environment
from composer.registry import register


@register("environment")
class NoEnvironment(Environment):
    """No environment: the policy writes the whole response in one turn (the default)."""

    kind: Literal["none"] = Field("none", description="Component kind.")

    def describe(self, spec) -> str:
        return ""
