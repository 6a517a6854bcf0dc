"""OpenRLHF's own argument parser, rebuilt from the installed wheel without importing it.

`openrlhf.cli.train_ppo_ray` / `train_sft` import ray, vLLM and DeepSpeed at the top, so they cannot be
imported on a machine without a GPU stack. Their parsers are plain argparse code inside
`if __name__ == "__main__":`; we ast-parse the file and execute only that body, with argparse,
datetime and os in scope: the statements up to `parse_args()` build the real parser (types, choices,
nargs), the statements after it are OpenRLHF's own post-parse checks and asserts, run on the parsed
arguments (with `train(args)` and the ModelScope hub patch left out).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import os
from datetime import datetime
from types import SimpleNamespace

MODULES = {"ppo": "openrlhf.cli.train_ppo_ray", "sft": "openrlhf.cli.train_sft"}


class ArgsError(Exception):
    """An argument list OpenRLHF's parser or its post-parse checks reject."""


def hierarchize(args):
    """`openrlhf.utils.config.hierarchize`: dotted dests -> nested namespaces (copied: the original's
    package __init__ imports torch and transformers)."""
    root: dict = {}
    for k, v in vars(args).items():
        *parents, leaf = k.split(".")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v

    def build(x):
        return SimpleNamespace(**{k: build(v) for k, v in x.items()}) if isinstance(x, dict) else x

    return build(root)


MISSING = ("OpenRLHF {version} is not installed here: `compile` checks every command line against its argument "
           "parser\n    hint: pip install --no-deps openrlhf=={version}   (--no-deps is enough for compiling; "
           "the cluster needs OpenRLHF with its GPU stack)")


def require() -> None:
    """ImportError with what to install when OpenRLHF's CLI modules are not importable (checked before any
    file is written). find_spec of a dotted name raises when the parent package is missing, hence `openrlhf` first."""
    from composer.backends.openrlhf import OPENRLHF_VERSION

    try:
        ok = importlib.util.find_spec("openrlhf") is not None and all(
            importlib.util.find_spec(m) is not None for m in MODULES.values())
    except (ImportError, ValueError):
        ok = False
    if not ok:
        raise ImportError(MISSING.format(version=OPENRLHF_VERSION))


def source_path(kind: str) -> str:
    """Path of the installed OpenRLHF CLI module ('ppo' or 'sft'); ImportError when OpenRLHF is missing."""
    require()
    spec = importlib.util.find_spec(MODULES[kind])
    return spec.origin


def _main_body(tree: ast.Module) -> list[ast.stmt]:
    for node in tree.body:
        t = node.test if isinstance(node, ast.If) else None
        if (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators)):
            return node.body
    raise ArgsError("no `if __name__ == '__main__':` block found")


def _is_parse_args(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "parse_args")


def _keep_after_parse(stmt: ast.stmt) -> bool:
    """Post-parse statements worth running: not imports, not `train(args)`, not the `use_ms` hub patch."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return False
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", "") == "train":
        return False
    if isinstance(stmt, ast.If) and "use_ms" in ast.unparse(stmt.test):
        return False
    return True


_CACHE: dict = {}


def _compiled(kind: str):
    path = source_path(kind)
    if path not in _CACHE:
        body = _main_body(ast.parse(open(path).read(), path))
        cut = next(i for i, s in enumerate(body) if _is_parse_args(s))
        build = ast.Module(body=body[:cut], type_ignores=[])
        post = ast.Module(body=[s for s in body[cut + 1:] if _keep_after_parse(s)], type_ignores=[])
        _CACHE[path] = (compile(build, path, "exec"), compile(post, path, "exec"))
    return _CACHE[path]


def real_parser(kind: str) -> argparse.ArgumentParser:
    """OpenRLHF's parser for `kind` ('ppo' or 'sft'), with abbreviations off (a prefix is never a flag)."""
    build, _ = _compiled(kind)
    scope = {"argparse": argparse, "datetime": datetime, "os": os, "__name__": "__main__"}
    exec(build, scope)
    parser = scope["parser"]
    parser.allow_abbrev = False
    parser.prog = MODULES[kind]
    return parser


def check(kind: str, argv: list[str]):
    """Parse `argv` with OpenRLHF's real parser and run its post-parse checks.

    Returns (hierarchical args after the checks, the warnings OpenRLHF printed). Raises ArgsError.
    """
    parser = real_parser(kind)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            flat = parser.parse_args(argv)
    except SystemExit:
        raise ArgsError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "rejected") from None
    _, post = _compiled(kind)
    scope = {"argparse": argparse, "datetime": datetime, "os": os, "args": hierarchize(flat),
             "hierarchize": hierarchize, "parser": parser}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(post, scope)
    except AssertionError as e:
        raise ArgsError(f"OpenRLHF's post-parse check failed: {e or 'assertion'}") from None
    except Exception as e:  # noqa: BLE001 - any error in OpenRLHF's own checks rejects the command
        raise ArgsError(f"OpenRLHF's post-parse checks raised {type(e).__name__}: {e}") from None
    return scope["args"], [ln for ln in out.getvalue().splitlines() if ln.strip()]
