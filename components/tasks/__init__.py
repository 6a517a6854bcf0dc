"""Tasks: verifiers and the toy testbed."""

from components.tasks import code_verifier, verifiers  # noqa: F401
