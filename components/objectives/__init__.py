"""Objectives: pure functions that turn a trajectory batch and current log-probs into a loss."""

from components.objectives import (advantage_regression, cross_entropy, divergence, dpo_pair, estimators,  # noqa: F401
                                   grpo, off_policy_weight, ppo, rollout_correction, token_selection)
