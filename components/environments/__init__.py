"""Rollout environments (`rollout.environment`): who answers the policy between its turns (issue 55)."""

from components.environments import none, tools  # noqa: F401
