"""Token origins: who wrote each token of a trajectory. Codes are stored per token in the batch."""

from __future__ import annotations

from typing import Literal

ORIGINS = ("pad", "prompt", "policy", "guide_prefix", "guide_intervention", "demonstration", "environment")
CODE = {name: i for i, name in enumerate(ORIGINS)}
Origin = Literal["prompt", "policy", "guide_prefix", "guide_intervention", "demonstration", "environment"]
# Tokens the policy itself sampled: they carry a behaviour log-prob.
ON_POLICY = ("policy",)
OFF_POLICY = ("guide_prefix", "guide_intervention", "demonstration")
# Tokens no objective may ever train, with why: an environment's answers (a tool's output, a user's reply) are
# what the world said to the policy, read as context by every forward, never a target (rollout.environment).
NEVER_LOSS = {"environment": "the environment wrote them (a tool's answer, an environment's message): the policy "
                             "reads them as context and is never trained to produce them"}
