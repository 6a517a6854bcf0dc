"""Small helpers shared by test files that drive the CLI on hostile or careless input (not a test file).

The fixtures these tests share (`tiny`, `finished_run`) are in tests/conftest.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from composer.cli.main import main

REPO = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "train.eval_every=0", "train.eval_samples=2"]
HEAD = "name: x\nsources:\n  verifier: {kind: outcome_reward}\nsignal: {kind: reward, source: verifier}\n" \
       "objective: {kind: grpo}\n"
NO_TRUST = {"COMPOSER_TRUST_REMOTE_CODE": "", "COMPOSER_ALLOW_PLUGINS": ""}


def cli(*args, env=None):
    """The CLI in-process, with no trust opt-in from the environment (click Result: .exit_code, .stderr ...)."""
    return CliRunner(env={**NO_TRUST, **(env or {})}).invoke(main, [str(a) for a in args], catch_exceptions=False)


def composer(*args, cwd=REPO, env=None, timeout=300, input=None):
    """The CLI in a fresh process (`python -m composer`), with no trust opt-in from the environment."""
    full = {**os.environ, "PYTHONPATH": str(REPO), **NO_TRUST, **(env or {})}
    return subprocess.run([sys.executable, "-m", "composer", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=timeout, input=input)


def run_spec(spec, out: Path, overrides, resume=False):
    """A Lightning run in-process, without the CLI."""
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    return train(validate_file(spec, overrides), out, resume=resume, progress=False)


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its content hash (nothing written, nothing deleted)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def clean(r, codes=(0, 2)) -> None:
    """Exit 0 or 2, and no traceback or internal error anywhere in the output."""
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert r.exit_code in codes, text[-3000:]
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]


# ------------------------------------------------------------------------------ OpenRLHF's own code as a peer

def openrlhf_code(relpath: str, names: list[str], namespace: dict) -> dict:
    """Functions and classes `names` of the installed OpenRLHF file `relpath` (a method as `Class.method`, taken as a
    plain function of self), executed in `namespace`: OpenRLHF's own code, without its module's imports."""
    import ast
    import importlib.util

    root = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0])
    tree = ast.parse((root / relpath).read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef):
                        found[f"{node.name}.{sub.name}"] = sub
    ns = dict(namespace)
    for name in names:
        node = found[name]
        fn = ast.Module(body=[node], type_ignores=[])
        exec(compile(fn, f"openrlhf/{relpath}:{name}", "exec"), ns)
        ns[name] = ns[node.name]
    return ns


def openrlhf_env() -> dict:
    """The names OpenRLHF's loss and utility functions read (for `openrlhf_code`)."""
    import itertools
    import logging
    from typing import List, Optional, Tuple, Union

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    return {"torch": torch, "nn": nn, "F": F, "Optional": Optional, "Tuple": Tuple, "List": List, "Union": Union,
            "itertools": itertools, "logger": logging.getLogger("openrlhf")}
