"""Deferred imports, so that the validation path never loads torch.

Component files hold config and implementation together; their tensor code refers to
``torch`` through this proxy, which imports the real module on first attribute access.
"""

from __future__ import annotations

import importlib


class LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
