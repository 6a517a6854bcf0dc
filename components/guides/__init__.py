"""Rollout guides: who else writes tokens into the policy's rollouts."""

from components.guides import intervention, none, prefix, traces  # noqa: F401
