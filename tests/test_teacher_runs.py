"""End-to-end CPU runs of the teacher methods (OPD, OPSD, SDPO, OPD + reward) on the toy testbed."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["train.steps=2", "train.prompts_per_step=4", "train.eval_samples=2", "train.eval_every=0",
         "rollout.max_new_tokens=32"]


def rows(path: Path) -> list[dict]:
    with open(path / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run(spec: str, out: Path, overrides: list[str]) -> dict:
    from composer.backends.lightning.run import train

    return train(validate_file(ROOT / spec, overrides), out, progress=False)


@pytest.mark.parametrize("spec,extra", [
    ("specs/opd.yaml", []),
    ("specs/opsd.yaml", []),
    ("specs/sdpo.yaml", ["rollout.samples_per_prompt=4"]),
    ("specs/hybrids/opd-plus-reward.yaml", ["rollout.samples_per_prompt=4"]),
])
def test_teacher_method_runs_end_to_end(spec, extra, tmp_path):
    final = run(spec, tmp_path, SMALL + extra)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == ["0", "1", "2"]  # two updates, then the final evaluation row
    steps = got[:-1]
    for column in ("loss", "teacher_kl_estimate", "teacher_student_gap", "no_signal_frac"):
        assert steps[-1][column] != "", column
    assert all(float(r["loss"]) == float(r["loss"]) for r in steps)  # finite, not NaN
    assert set(final) == {f"pass@1/tier{t}" for t in (1, 2, 4, 6, 8)}
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    if spec.endswith("sdpo.yaml"):
        assert float(got[0]["ema_param_distance"]) == 0.0  # the EMA teacher starts at the initial weights
        assert float(got[1]["ema_param_distance"]) > 0.0  # and lags the policy after one update


@pytest.mark.slow
def test_opd_as_specified_closes_the_log_prob_gap_on_the_middle_tier(tmp_path):
    """specs/opd.yaml as written (60 steps, about a minute): the per-token teacher-student gap on the
    6-step tier's rollouts falls by 40% or more (measured 0.68 -> 0.25). Its greedy pass@1 does not
    move (docs/results.md, "Measured so far": the student gives the teacher's token p ~ 1e-4 where it goes wrong)."""
    run("specs/opd.yaml", tmp_path, ["train.eval_every=0", "train.eval_samples=8"])
    got = [r for r in rows(tmp_path) if r.get("teacher_student_gap/tier6")]

    def mean_gap(lo, hi):
        vals = [float(r["teacher_student_gap/tier6"]) for r in got if lo <= int(r["step"]) < hi]
        return sum(vals) / len(vals)

    assert mean_gap(50, 60) < 0.6 * mean_gap(0, 10)


@pytest.mark.slow
def test_opd_sampling_hotter_closes_the_answer_gap(tmp_path):
    """With rollout.temperature 2.0 and lr 3e-4 (found after the run above), the student's greedy
    pass@1 on tier 6 moves toward the teacher's: the gap shrinks by 40% or more (measured 0.078 -> 0.69,
    teacher 0.94)."""
    from components.tasks.bootstrap import ensure_checkpoints, evaluate_greedy

    paths = ensure_checkpoints()
    before = evaluate_greedy(paths["student"], 6, 64)
    teacher = evaluate_greedy(paths["teacher"], 6, 64)
    final = run("specs/opd.yaml", tmp_path, ["rollout.temperature=2.0", "train.lr=3e-4",
                                             "train.eval_samples=64", "train.eval_every=0"])
    assert teacher - final["pass@1/tier6"] < 0.6 * (teacher - before), (before, final, teacher)
