"""Backends: lightning (in-process, the embedded default) and openrlhf (a Ray cluster bundle)."""
