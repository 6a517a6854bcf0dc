"""The cookbook of hybrids (docs/cookbook.md, linked from the README): each spec validates, explains, runs a few
steps, and is shown as it is."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from composer.cli.main import main
from composer.checks.validate import validate_file

REPO = Path(__file__).resolve().parent.parent
COOKBOOK_PAGE = (REPO / "docs" / "cookbook.md").read_text()
FAST = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "train.eval_every=0", "train.eval_samples=2", "train.checkpoint_every=1000"]


def _nonempty(row: dict, key: str) -> bool:
    return row.get(key, "") != ""


# spec -> (overrides for a run of a few steps, what each training step's metrics row must show)
COOKBOOK = {
    "opd-plus-reward.yaml": (["train.steps=2"],
                             lambda rows: all(_nonempty(r, "distill/loss") and _nonempty(r, "reward/loss")
                                              for r in rows)),
    "oapl-pope.yaml": (["train.steps=3", "sync.every=2"],
                       # prompts drawn for guidance (a hash of prompt and step) get the searched prefix, never
                       # longer than max_fraction (1/4) of the reference
                       lambda rows: any(float(r["guide/guided_frac"]) > 0 for r in rows)
                       and all(float(r["guide/prefix_fraction_max"]) <= 0.25 for r in rows)),
    "judge-proxy-half.yaml": (["train.steps=2", "phases.0.until=1", "phases.1.until=2",
                               "rollout.guide.control_samples=1"],
                              # the judge reviews in the first phase only
                              lambda rows: float(rows[0]["guide/reviews_per_traj"]) > 0
                              and float(rows[0]["cost/judge_tokens"]) > 0
                              and not _nonempty(rows[1], "guide/reviews_per_traj")
                              and float(rows[1]["offpolicy_token_frac"]) == 0),
    "sft-opd-grpo.yaml": (["stages.0.train.steps=1", "stages.1.train.steps=1", "stages.2.train.steps=1",
                           "stages.2.rollout.samples_per_prompt=2"],
                          # one step of each stage, in order: SFT targets, teacher scores, verifier reward
                          lambda rows: _nonempty(rows[0], "tokens") and not _nonempty(rows[0], "teacher_kl_estimate")
                          and _nonempty(rows[1], "teacher_kl_estimate") and not _nonempty(rows[1], "reward_mean")
                          and _nonempty(rows[2], "reward_mean") and not _nonempty(rows[2], "teacher_kl_estimate")),
    "pope-sft.yaml": (["stages.0.train.steps=1", "stages.1.train.steps=2",
                       "stages.1.rollout.guide.guided_fraction=1.0"],
                      # one SFT step (targets, no reward), then POPE steps whose prompts all carry a searched prefix
                      # no longer than max_fraction (1/4) of the reference
                      lambda rows: _nonempty(rows[0], "tokens") and not _nonempty(rows[0], "reward_mean")
                      and all(_nonempty(r, "reward_mean") for r in rows[1:])
                      and all(float(r["guide/guided_frac"]) > 0 for r in rows[1:])
                      and all(float(r["guide/prefix_fraction_max"]) <= 0.25 for r in rows[1:])),
    "fkl-plus-sft.yaml": (["train.steps=2"],
                          lambda rows: all(_nonempty(r, "distill/loss") and _nonempty(r, "sft/loss") for r in rows)),
}
SPECS = [REPO / "specs" / "hybrids" / name for name in COOKBOOK]


def invoke(*args):
    return CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_cookbook_spec_validates_and_explains(path):
    v = validate_file(path)
    assert not v.warnings, [w.format() for w in v.warnings]
    r = invoke("explain", path)
    assert r.exit_code == 0, r.stderr
    data = yaml.safe_load(path.read_text())
    assert data["summary"] in r.stdout


def _readme_cookbook() -> str:
    start = COOKBOOK_PAGE.index("# Cookbook: hybrids")
    end = COOKBOOK_PAGE.find("\n# ", start + 1)
    return COOKBOOK_PAGE[start:end if end >= 0 else None]


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)


def _without_comments(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_readme_shows_the_spec_as_it_is_with_its_summary(path):
    section = _readme_cookbook()
    body = _without_comments(path.read_text())
    assert body in _yaml_blocks(section), f"docs/cookbook.md does not show {path.name} as it is (comments aside)"
    data = yaml.safe_load(path.read_text())
    assert f"specs/hybrids/{path.name}" in section
    assert f"{data['name']}: {data['summary']}" in section  # the first line `composer explain` prints


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_cookbook_spec_runs_a_few_steps(path, tmp_path):
    overrides, check = COOKBOOK[path.name]
    r = invoke("run", path, *FAST, *overrides, "--out", tmp_path / "run", "--no-progress")
    assert r.exit_code == 0, r.output
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = validate_file(path, FAST + overrides).total_steps
    train_rows = rows[:steps]
    assert [int(r["step"]) for r in train_rows] == list(range(steps))
    assert all(_nonempty(r, "loss") for r in train_rows)
    assert check(train_rows), train_rows


def test_stages_bring_their_own_signal_and_objective_but_each_needs_both(tmp_path):
    """No base signal/objective is fine when every stage has them (the curriculum); a stage without is not."""
    spec = tmp_path / "curriculum.yaml"
    text = (REPO / "specs" / "hybrids" / "sft-opd-grpo.yaml").read_text()
    spec.write_text(text.replace("    objective: {kind: grpo}\n", ""))
    r = invoke("validate", spec)
    assert r.exit_code == 2
    assert "in stage 'grpo': no `objective`: a method needs a signal and an objective" in r.stderr
    assert r.stderr.count("a method needs a signal and an objective") == 1  # not for the base spec, nor sft/opd
