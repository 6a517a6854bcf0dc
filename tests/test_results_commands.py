"""Every command docs/results.md names can be run as written (issue 56, item 5): no placeholder (`<...>`, `...`, an
`a|b` alternation), and each one parses and starts, without running the study it starts:

  composer SUB ...      click parses it (options, arguments, choices, paths that must exist); the overrides of
                        `run` / `check` and `bench --sweep`'s values validate against their spec
  python -m composer.bench.throughput ...   its argparse parser accepts it
  python examples/bench/fuzz_validate.py ...            the same
  .venv/bin/python tests/mutations.py [--before F] N...  every name is one of its mutations
  composer.bench.methods.F(...)                         F exists; extend_seeds's arms are arms of the claims study
  git show REV:PATH, git worktree add DIR REV           the revision (and the path in it) exist in this repository

tests/test_docs_links.py checks every page's `composer` subcommands and option names; this reads results.md's
commands whole.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_links import _code

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.md"
COMMAND = re.compile(r"^(?:\w+=\S+\s+)*(?:nice -n \d+ )?(?:composer\s|composer$|python\s|\.venv/bin/\S+\s|git\s|"
                     r"composer\.bench\.\w+\.\w+\()")


def commands() -> list[str]:
    """Every command in the page's code (inline spans and blocks), a chain split at `&&` / `;`, a pipeline at `|`
    with spaces (what follows a pipe is checked to be a plain command)."""
    out: list[str] = []
    for piece in _code(PAGE.read_text()):
        for part in re.split(r"\s*(?:&&|;)\s*", piece):
            part = re.sub(r"\s+", " ", part).strip()
            if COMMAND.match(part) and part not in out:
                out.append(part)
    return out


def test_the_page_names_commands():
    found = commands()
    assert len(found) >= 25, found  # the pattern finds them
    assert any(c.startswith("composer.bench.methods.extend_seeds(") for c in found)


@pytest.mark.parametrize("command", commands())
def test_the_command_has_no_placeholder(command):
    code = command if command.startswith("composer.bench.") else " ".join(shlex.split(command.split(" | ")[0]))
    assert not re.search(r"<[^>]*>|\.\.\.|(?<=\w)\|(?=\w)", code), f"a placeholder: {command}"


def _argv(command: str) -> list[str]:
    """The command's words, without environment assignments, `nice -n N`, a pipe into `tee FILE` or a redirect."""
    first, _, rest = command.partition(" | ")
    assert not rest or re.fullmatch(r"tee \S+", rest), f"a pipe into something other than tee: {command}"
    words = shlex.split(first)
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words.pop(0)
    if words[:2] == ["nice", "-n"]:
        words = words[3:]
    if ">" in words:
        words = words[: words.index(">")]
    return words


def _composer(words: list[str]) -> None:
    from composer.checks.validate import validate_file
    from composer.cli.main import main

    name, args = (words[1], words[2:]) if len(words) > 1 else ("run", [])
    cmd = main.commands[name]
    if name == "bench" and "--throughput" in args:  # the rest goes to the throughput parser
        from composer.bench import throughput

        rest = [a for a in args if a != "--throughput"]
        throughput.parse_args(rest)
        args = ["--throughput"]
    cmd.make_context(name, list(args))  # options, arguments, choices, paths: click's UsageError on any
    specs = [a for a in args if a.endswith(".yaml")]
    if name in ("run", "check") and specs:
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        validate_file(ROOT / specs[0], overrides)
    if name == "bench" and "--sweep" in args:
        field, _, values = args[args.index("--sweep") + 1].partition("=")
        for spec in specs:
            for value in values.split(","):
                validate_file(ROOT / spec, [f"{field}={value}"])


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"results_cmd_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _python(words: list[str]) -> None:
    if words[1:3] == ["-m", "composer.bench.throughput"]:
        from composer.bench import throughput

        throughput.parse_args(words[3:])
    elif words[1] == "examples/bench/fuzz_validate.py":
        _module(ROOT / words[1]).parse_args(words[2:])
    elif words[1] == "tests/mutations.py":
        args = words[2:]
        if "--before" in args:
            i = args.index("--before")
            args = args[:i] + args[i + 2:]
        known = _module(ROOT / "tests" / "mutations.py").MUTATIONS
        assert set(args) <= set(known), f"not mutations of tests/mutations.py: {sorted(set(args) - set(known))}"
    else:
        raise AssertionError(f"no check for this command: {' '.join(words)}")


def _git(words: list[str]) -> None:
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone: the revisions the page names may be missing")
    if words[1] == "show":
        what = words[2]
    elif words[1:3] == ["worktree", "add"]:
        what = words[-1] + "^{commit}"
    else:
        raise AssertionError(f"no check for this command: {' '.join(words)}")
    r = subprocess.run(["git", "cat-file", "-e", what], cwd=ROOT, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"git {' '.join(words[1:])}: {what} is not in this repository ({r.stderr.strip()})"


def _call(command: str, monkeypatch) -> None:
    """`composer.bench.methods.F(args)`: F exists; extend_seeds is called with `bench` stubbed (nothing runs), so
    its own check of the arms' labels runs."""
    from composer.bench import methods

    call = ast.parse(command, mode="eval").body
    assert isinstance(call, ast.Call), command
    name = call.func.attr
    assert callable(getattr(methods, name, None)), f"composer.bench.methods has no {name}"
    if name == "extend_seeds":
        ran = []
        monkeypatch.setattr(methods, "bench", lambda variants, out, cfg, command, log=print: ran.append(variants))
        methods.extend_seeds(*[ast.literal_eval(a) for a in call.args])
        assert ran and len(ran[0]) == len(ast.literal_eval(call.args[1]))


@pytest.mark.parametrize("command", commands())
def test_the_command_parses_and_starts(command, monkeypatch):
    if command.startswith("composer.bench."):
        return _call(command, monkeypatch)
    words = _argv(command)
    if words[0] == "composer":
        _composer(words)
    elif words[0].endswith("python"):
        _python(words)
    elif words[0] == "git":
        _git(words)
    else:
        raise AssertionError(f"no check for this command: {command}")
    return None
