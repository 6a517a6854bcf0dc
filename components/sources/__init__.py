"""Privileged-information sources: named nodes of the spec graph."""

from components.sources import (  # noqa: F401
    feedback, oracle, outcome_reward, policy_model, reference_solution, reward_model, shaping, sibling_success,
)
