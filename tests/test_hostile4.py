"""A researcher's own files, second round (issue 43): no file overwritten that the tool did not write, a
finished run's --resume changes nothing, a checkpoint whose counters disagree with its run folder is refused,
and damaged run folders and model folders give messages, never tracebacks."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_hostile3 import cli, finished_run, tiny  # noqa: F401 (fixtures)


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its content hash (nothing written, nothing deleted)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def test_eval_out_never_overwrites_a_run_folder(run_copy):
    """Before: `composer eval RUN --out RUN` overwrote the run's own eval_samples.jsonl (appended to it) and
    wrote eval.json among the run's files."""
    before = snapshot(run_copy)
    r = cli("eval", run_copy, "--out", run_copy)
    assert r.exit_code == 2, r.output
    assert "files `composer eval` did not write" in r.stderr and "nothing is overwritten" in r.stderr
    assert snapshot(run_copy) == before


def test_eval_out_replaces_only_its_own_earlier_output(run_copy, tmp_path):
    ev = tmp_path / "ev"
    assert cli("eval", run_copy, "--out", ev).exit_code == 0
    first = (ev / "eval_samples.jsonl").read_text()
    assert cli("eval", run_copy, "--out", ev).exit_code == 0  # its own folder: replaced, not appended
    assert (ev / "eval_samples.jsonl").read_text() == first
    (ev / "notes.txt").write_text("mine")
    r = cli("eval", run_copy, "--out", ev)
    assert r.exit_code == 2 and "notes.txt" in r.stderr and (ev / "notes.txt").read_text() == "mine"


def test_resume_of_a_finished_run_says_so_and_changes_nothing(run_copy):
    """Before: --resume of a finished run printed nothing to say so and reran the final evaluation."""
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "the run already finished (step 1/1" in r.output and "changed nothing" in r.output
    assert snapshot(run_copy) == before
