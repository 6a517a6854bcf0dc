"""Signals: where the learning signal comes from."""

from components.signals import distillation, reward, sft  # noqa: F401
