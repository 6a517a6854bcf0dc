"""Token origins: who wrote each token of a trajectory. Codes are stored per token in the batch."""

from __future__ import annotations

from typing import Literal

ORIGINS = ("pad", "prompt", "policy", "guide_prefix", "guide_intervention", "demonstration")
CODE = {name: i for i, name in enumerate(ORIGINS)}
Origin = Literal["prompt", "policy", "guide_prefix", "guide_intervention", "demonstration"]
# Tokens the policy itself sampled: they carry a behaviour log-prob.
ON_POLICY = ("policy",)
OFF_POLICY = ("guide_prefix", "guide_intervention", "demonstration")
