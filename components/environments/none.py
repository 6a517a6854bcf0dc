"""No environment: a rollout is one policy turn."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Environment
from composer.registry import register


@register("environment")
class NoEnvironment(Environment):
    """No environment: the policy writes the whole response in one turn (the default)."""

    kind: Literal["none"] = Field("none", description="Component kind.")

    acts: ClassVar[bool] = False  # a setting that does nothing (composer check --coverage)

    def describe(self, spec) -> str:
        return ""
