"""What a run's evaluation and rollout files say (issue 56, smaller items): eval_samples.jsonl marks each row
greedy or sampled and whether the answer was cut at max_new_tokens; samples.jsonl marks cut rollouts and
metrics.csv has the step's `truncated_fraction`; report.md shows every evaluation of the run, not only the
last; an export's eval.json has the step of its weights, and `composer eval EXPORT` without --data names what
the export already keeps instead of asking for it."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from _helpers import clean, cli

from composer.batch import TrajectoryBatch
from composer.origins import CODE

ROOT = Path(__file__).resolve().parent.parent
EOS = 2


def batch(rows: list[list[tuple[int, str]]]) -> TrajectoryBatch:
    """A batch of rows given as (token, origin) pairs, right-padded."""
    T = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    origin = torch.zeros(len(rows), T, dtype=torch.uint8)
    for i, r in enumerate(rows):
        for j, (tok, org) in enumerate(r):
            tokens[i, j], origin[i, j] = tok, CODE[org]
    n = len(rows)
    return TrajectoryBatch(tokens=tokens, origin=origin, behavior_logprobs=torch.zeros(n, T),
                           group=torch.arange(n), control=torch.ones(n, dtype=torch.bool))


def test_mark_truncated_flags_cut_rollouts_and_counts_the_fraction():
    from composer.backends.lightning.module import mark_truncated

    b = batch([[(5, "prompt"), (7, "policy"), (EOS, "policy")],  # finished: ends in the stop token
               [(5, "prompt"), (7, "policy"), (8, "policy")],  # cut at the length cap
               [(5, "prompt"), (7, "policy"), (9, "policy")],
               [(5, "prompt"), (7, "demonstration"), (8, "demonstration")]])  # no policy token: not counted
    view = TrajectoryBatch(**{**b.__dict__, "info": b.info})  # a second term viewing the same rollout
    got = mark_truncated([b, view], (EOS,))
    assert got == {"truncated_fraction": pytest.approx(2 / 3)}
    assert b.info["truncated"] == [False, True, True, False]
    sft = batch([[(5, "prompt"), (7, "demonstration")]])
    assert mark_truncated([sft], (EOS,)) == {} and "truncated" not in sft.info  # nothing sampled, nothing said


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def evaluated_run(tiny, tmp_path_factory) -> Path:
    """Two GRPO steps on the tiny model, evaluated at every step with two sampled answers per problem."""
    from click.testing import CliRunner

    from composer.cli.main import main

    out = tmp_path_factory.mktemp("run") / "run"
    r = CliRunner().invoke(main, [
        "run", str(ROOT / "specs/grpo.yaml"), f"policy.model={tiny}", "train.steps=2", "train.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "train.eval_every=1", "train.eval_samples=2",
        "train.eval_k=2", "train.samples_every=1", "train.loggers=[csv]", "--no-progress", "--out", str(out)],
        catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_eval_samples_say_greedy_or_sampled_and_truncated(evaluated_run):
    rows = jsonl(evaluated_run / "eval_samples.jsonl")
    assert {r["step"] for r in rows} == {0, 1, 2}  # every evaluation, the final one at the step count
    for step in (0, 1, 2):
        mine = [r for r in rows if r["step"] == step]
        greedy = [r for r in mine if r["decoding"] == "greedy"]
        sampled = [r for r in mine if r["decoding"] == "sampled"]
        tiers = {r["tier"] for r in mine}
        assert len(greedy) == 2 * len(tiers) and len(sampled) == 2 * 2 * len(tiers)  # eval_samples x (1 | eval_k)
        assert all("sample" not in r for r in greedy) and {r["sample"] for r in sampled} == {0, 1}
    assert all(isinstance(r["truncated"], bool) for r in rows)
    # the tiny random model rarely writes its stop token within 6 tokens: most answers are cut
    assert any(r["truncated"] for r in rows)


def test_samples_mark_cut_rollouts_and_metrics_have_the_fraction(evaluated_run):
    samples = jsonl(evaluated_run / "samples.jsonl")
    with open(evaluated_run / "metrics.csv", newline="") as f:
        steps = [r for r in csv.DictReader(f) if r.get("loss")]
    assert [r["step"] for r in steps] == ["0", "1"]
    for r in steps:
        mine = [s["truncated"] for s in samples if s["step"] == int(r["step"])]
        assert len(mine) == 4 and all(isinstance(x, bool) for x in mine)
        assert float(r["truncated_fraction"]) == pytest.approx(sum(mine) / len(mine))


def test_report_shows_every_evaluation(evaluated_run):
    text = (evaluated_run / "report.md").read_text()
    assert "## Every evaluation" in text
    table = text.split("## Every evaluation", 1)[1].strip().splitlines()
    assert table[0].startswith("| step | pass@1") and "pass@2/" in table[0]
    assert [line.split("|")[1].strip() for line in table[2:5]] == ["0", "1", "2"]


def test_report_evaluation_table_of_a_run_that_never_evaluated(tmp_path):
    from composer.runtime.report import evaluation_table

    (tmp_path / "metrics.csv").write_text("step,loss\n0,1.0\n1,0.5\n")
    assert evaluation_table(tmp_path / "metrics.csv") == []
    (tmp_path / "metrics.csv").write_text("step,loss,pass_at_1/tier2\n0,1.0,0.5\n1,0.5,\n2,,oops\n")
    assert evaluation_table(tmp_path / "metrics.csv") == ["| step | pass@1/tier2 |", "| --- | --- |",
                                                          "| 0 | 0.500 |", "| 2 | - |"]


def test_an_exports_eval_json_has_the_step_of_its_weights(evaluated_run, cli, tmp_path):
    """Before: `"step": 0` for any exported model; the export now keeps its step (composer_export.json)."""
    keep = json.loads((evaluated_run / "model" / "composer_export.json").read_text())
    assert keep["run"]["step"] == 2
    r = cli("eval", evaluated_run / "model", "train.eval_k=0", "--out", tmp_path / "ev")
    assert r.exit_code == 0, r.output
    ev = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert ev["step"] == 2 and ev["weights"] == str(evaluated_run / "model")
    assert {r["step"] for r in jsonl(tmp_path / "ev" / "eval_samples.jsonl")} == {2}
    r = cli("export", evaluated_run / "checkpoints" / "last.ckpt", "--out", tmp_path / "exported")  # from a checkpoint
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "exported" / "composer_export.json").read_text())["run"]["step"] == 2


def test_eval_of_an_export_without_data_names_what_the_export_keeps(evaluated_run, tiny, cli, tmp_path):
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(evaluated_run / "model", moved)
    r = cli("eval", moved)
    assert r.exit_code == 2
    assert "needs --data FILE" in r.output and "composer_export.json" in r.output
    assert "data.prompt_field=problem" not in r.output  # before: asked for the fields the export keeps
    r = cli("eval", tiny)  # a model folder the composer did not write: its rows' fields are asked for
    assert r.exit_code == 2 and "data.prompt_field=problem" in r.output


# -------------------------------------------------------------------------- composer eval shows its progress (issue 43)


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def test_composer_eval_shows_progress(run_copy, tmp_path):
    r = cli("eval", run_copy, "--out", tmp_path / "ev")
    clean(r, codes=(0,))
    assert "loading the model" in r.stderr and "eval 1/5 tier1: 2 problem(s), greedy" in r.stderr, r.stderr
    assert "eval 5/5 tier8: pass@1 " in r.stderr and "Loading weights" not in r.stderr
