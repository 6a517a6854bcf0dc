"""Evaluation that says what it shows (issue 43): the progress line's pass@1 is the greedy pass@1, never a pass@k
(before, with train.eval_k: 4 it showed pass@2: the middle of every sorted key), and report.md names each row's
metric (before: every row labelled with its tier, `eval`, under a pass@1 header)."""

from __future__ import annotations

from composer.backends.lightning.module import shown_pass_at_1
from composer.backends.lightning.run import report_rows

WITH_K = {"pass@1/eval": 0.25, "pass@1_sampled/eval": 0.5, "pass@2/eval": 0.625, "pass@4/eval": 0.75}


def test_the_progress_pass_at_1_is_the_greedy_one_with_eval_k():
    assert shown_pass_at_1(WITH_K) == 0.25  # before: 0.625 (pass@2)
    tiers = {"pass@1/tier2": 0.1, "pass@1/tier4": 0.2, "pass@1/tier6": 0.3, "pass@2/tier4": 0.9, "pass@4/tier4": 1.0}
    assert shown_pass_at_1(tiers) == 0.2  # the middle tier, greedy
    assert shown_pass_at_1({}) is None and shown_pass_at_1({"pass@2/eval": 1.0}) is None


def test_report_rows_name_the_metric():
    rows = report_rows(WITH_K)
    assert rows == ["| pass@1 | eval | 0.250 |", "| pass@1_sampled | eval | 0.500 |", "| pass@2 | eval | 0.625 |",
                    "| pass@4 | eval | 0.750 |"]
