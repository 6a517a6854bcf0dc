"""Tasks: verifiers and the toy testbed."""

from components.tasks import verifiers  # noqa: F401
