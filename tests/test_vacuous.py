"""A run that trains on nothing is said, with counts, at each segment's end; `--strict` makes it an error
(composer/runtime/vacuous.py, issue 40 part 2).

The counting is checked on metric rows written here by hand; the run on a tiny random policy of the toy testbed
(its answers are never right, so a gate on success never selects a row and its zero loss moves no weight).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from composer.checks.validate import validate_file
from composer.runtime.vacuous import Tally, findings_from_rows

REPO = Path(__file__).resolve().parent.parent
HEAD = "name: t\nsources:\n  verifier: {kind: outcome_reward}\nrollout: {samples_per_prompt: 4}\n"
TWO_GATED = HEAD + "terms:\n  - {name: win, signal: {kind: reward, source: verifier}, objective: {kind: grpo}, " \
    "gate: {outcome: success}}\n  - {name: lose, signal: {kind: reward, source: verifier}, objective: {kind: grpo}, " \
    "gate: {outcome: failure}}\ntrain: {steps: 3}\n"


def _spec(tmp_path, text, *overrides):
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    return validate_file(p, list(overrides)).spec


def test_a_gate_that_selected_no_row_in_every_step_is_counted(tmp_path):
    spec = _spec(tmp_path, TWO_GATED)
    rows = [{"win/gate_frac": 0.0, "lose/gate_frac": 1.0, "unparsed_frac": 0.0}] * 3
    found = findings_from_rows(spec, rows)
    assert found == ["term 'win': its gate selected no row in 3 of 3 steps (gate_frac 0): the term never trained"]


def test_one_step_with_a_row_is_enough(tmp_path):
    spec = _spec(tmp_path, TWO_GATED)
    rows = [{"win/gate_frac": 0.0, "lose/gate_frac": 1.0}, {"win/gate_frac": 0.125, "lose/gate_frac": 0.875},
            {"win/gate_frac": "", "lose/gate_frac": 1.0}]  # a csv cell left empty is not a zero
    assert findings_from_rows(spec, rows) == []
    assert findings_from_rows(spec, rows[:1] + rows[:1]) != []


def test_filters_verifier_and_weights_are_counted(tmp_path):
    spec = _spec(tmp_path, HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n",
                 "rollout.filter.equal_groups=drop", "rollout.filter.truncated=mask")
    rows = [{"filter/kept_frac": 0.0, "filter/truncated_frac": 1.0, "unparsed_frac": 1.0}] * 2
    found = findings_from_rows(spec, rows, moved=False)
    assert len(found) == 4
    assert any("kept no prompt in 2 of 2 steps" in f for f in found)
    assert any("every response was cut at max_new_tokens in 2 of 2 steps" in f for f in found)
    assert any("parsed no response in 2 of 2 steps" in f for f in found)
    assert any("did not move" in f for f in found)
    rows[1] = {"filter/kept_frac": 0.5, "filter/truncated_frac": 0.5, "unparsed_frac": 0.75}
    assert findings_from_rows(spec, rows, moved=True) == []


def test_a_filter_that_is_not_declared_is_not_counted(tmp_path):
    spec = _spec(tmp_path, HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    assert findings_from_rows(spec, [{"filter/truncated_frac": 1.0}] * 2) == []  # truncated: keep trains on them


def test_the_tally_survives_a_checkpoint(tmp_path):
    spec = _spec(tmp_path, TWO_GATED)
    t = Tally("main", 0, 3)
    t.add(spec, {"win/gate_frac": 0.0, "lose/gate_frac": 1.0})
    back = Tally.from_state(t.state())
    back.add(spec, {"win/gate_frac": 0.0})
    back.add(spec, {"win/gate_frac": 0.0})
    assert "in 3 of 3 steps" in back.findings()[0]
    assert back.report().startswith("the run (steps 0-2) trained on nothing in 1 way(s):")


# ------------------------------------------------------------------------------------------- real runs

FAST = ["rollout.max_new_tokens=8", "train.eval_every=0", "train.eval_samples=2", "train.checkpoint_every=1000",
        "train.samples_every=0", "train.prompts_per_step=2", "train.steps=2", "train.loggers=[csv]"]
GATED = HEAD + "terms:\n  - {name: rl, signal: {kind: reward, source: verifier}, objective: {kind: grpo, kl_coef: 0}, " \
    "gate: {outcome: success}}\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def test_a_run_that_trains_on_nothing_warns_with_the_counts(cli, tiny, tmp_path):
    spec = tmp_path / "gated.yaml"
    spec.write_text(GATED)
    r = cli("run", spec, "--out", tmp_path / "run", "--no-progress", f"policy.model={tiny}", *FAST)
    assert r.exit_code == 0, r.stderr
    assert "WARNING: the run (steps 0-1) trained on nothing" in r.stderr, r.stderr
    assert "term 'rl': its gate selected no row in 2 of 2 steps" in r.stderr
    assert "did not move" in r.stderr and "--strict" in r.stderr
    assert (tmp_path / "run" / "model").is_dir()  # a warning: the run finished


@pytest.mark.slow
def test_strict_makes_it_an_error_and_keeps_the_checkpoint(cli, tiny, tmp_path):
    spec = tmp_path / "gated.yaml"
    spec.write_text(GATED)
    r = cli("run", spec, "--strict", "--out", tmp_path / "run", "--no-progress", f"policy.model={tiny}", *FAST)
    assert r.exit_code == 2, r.stderr
    assert "error: the run (steps 0-1) trained on nothing" in r.stderr and "Traceback" not in r.stderr
    assert "term 'rl': its gate selected no row in 2 of 2 steps" in r.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file() and "checkpoint is kept" in r.stderr


@pytest.mark.slow
def test_a_run_that_trains_says_nothing(cli, tiny, tmp_path):
    r = cli("run", REPO / "specs/sft.yaml", "--strict", "--out", tmp_path / "run", "--no-progress",
            f"policy.model={tiny}", *FAST, "train.lr=1.0e-3")
    assert r.exit_code == 0, r.stderr
    assert "trained on nothing" not in r.stderr
