"""Optimizer state at stage boundaries (train.optimizer_at_stage: reset | keep) and periodic resets
(train.reset_every, reset_what), issue 46: the Plan's schedule says where, both backends do the same or
OpenRLHF refuses at compile, `explain` shows it, and the Lightning run does it.

The run check uses Adam's first step: with fresh moments and step count 1, bias correction makes
m_hat / sqrt(v_hat) = g / |g| (eps 1e-8), so every weight whose gradient is not tiny moves by exactly lr (no
weight decay). A later Adam step moves most weights by less. So "the optimizer state was reset before step s"
is seen in the weights alone: |w_{s+1} - w_s| == lr for (nearly) every weight that moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer.checks.validate import validate_file
from composer.plan.compile import compile_plan
from composer.plan.schedule import Schedule

ROOT = Path(__file__).resolve().parent.parent


def plan_of(spec: str, overrides=()) -> dict:
    return json.loads(json.dumps(compile_plan(validate_file(ROOT / spec, list(overrides)))))


STAGED = ["stages.0.train.steps=3", "stages.1.train.steps=4"]


def test_stage_start_resets_the_optimizer_by_default_and_keep_keeps_it():
    s = Schedule(plan_of("specs/int.yaml", STAGED))
    assert s.optimizer_resets() == [3]  # the second stage's first step
    assert [s.optimizer_reset(t) for t in range(7)] == [t == 3 for t in range(7)]
    s = Schedule(plan_of("specs/int.yaml", STAGED + ["stages.1.train.optimizer_at_stage=keep"]))
    assert s.optimizer_resets() == []
    s = Schedule(plan_of("specs/grpo.yaml", ["train.steps=5"]))  # no stages: nothing to reset
    assert s.optimizer_resets() == []


def test_periodic_reset_counts_from_each_segment_start():
    # steps 0..9, reset every 3 from step 0: before steps 3, 6 and 9
    s = Schedule(plan_of("specs/grpo.yaml", ["train.steps=10", "train.reset_every=3"]))
    assert s.optimizer_resets() == [3, 6, 9]
    assert [s.initial_version(t) for t in range(10)] == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9]
    # only the reference: the optimizer keeps its state
    s = Schedule(plan_of("specs/grpo.yaml", ["train.steps=10", "train.reset_every=4", "train.reset_what=[reference]"]))
    assert s.optimizer_resets() == [] and [s.initial_version(t) for t in (3, 4, 7, 8, 9)] == [0, 4, 4, 8, 8]
    s = Schedule(plan_of("specs/grpo.yaml", ["train.steps=10", "train.reset_every=4", "train.reset_what=[optimizer]"]))
    assert s.optimizer_resets() == [4, 8] and {s.initial_version(t) for t in range(10)} == {0}
    # stages 0-2 and 3-6, reset every 2 in the second: its start (stage boundary) and 3 + 2 = 5
    s = Schedule(plan_of("specs/int.yaml", STAGED + ["stages.1.train.reset_every=2"]))
    assert s.optimizer_resets() == [3, 5]
    assert [s.initial_version(t) for t in range(7)] == [0, 0, 0, 3, 3, 5, 5]


def test_explain_shows_the_optimizer_state():
    from composer.plan.explain import text

    out = text(plan_of("specs/int.yaml", STAGED))
    assert "optimizer: AdamW state reset at this stage's start (train.optimizer_at_stage: reset)" in out
    out = text(plan_of("specs/int.yaml", STAGED + ["stages.1.train.optimizer_at_stage=keep"]))
    assert "optimizer: AdamW state kept from the previous stage (train.optimizer_at_stage: keep)" in out
    out = text(plan_of("specs/methods/prorl.yaml"))
    assert "reset before step(s) 20, 40 (train.reset_every)" in out
    assert "reference reset (initial weights <- the policy) before step(s) 20, 40" in out


def _compile_openrlhf(tmp_path, spec, overrides):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "composer", "compile", spec, "--backend", "openrlhf", "--out",
                           str(tmp_path / "b"), *overrides], cwd=ROOT, capture_output=True, text=True)


def test_openrlhf_refuses_keep_and_periodic_resets_with_the_reason(tmp_path):
    r = _compile_openrlhf(tmp_path, "specs/int.yaml", STAGED + ["stages.1.train.optimizer_at_stage=keep"])
    assert r.returncode == 2, r.stderr
    assert "stages[1].train.optimizer_at_stage" in r.stderr and "DeepSpeed optimizer state" in r.stderr
    r = _compile_openrlhf(tmp_path, "specs/methods/prorl.yaml", ["rollout.filter.max_rounds=null"])
    assert r.returncode == 2 and "train.reset_every" in r.stderr and "one stage per reset" in r.stderr, r.stderr


@pytest.mark.parametrize("data,message", [
    ("train: {reset_every: -1}", "reset_every"),
    ("train: {reset_what: [optimizer, optimizer]}", "listed twice"),
    ("train: {optimizer_at_stage: fresh}", "optimizer_at_stage"),
])
def test_reset_fields_are_checked(tmp_path, data, message):
    from composer.errors import SpecError

    p = tmp_path / "s.yaml"
    p.write_text(f"name: x\n{data}\n")
    with pytest.raises(SpecError) as e:
        validate_file(p)
    assert message in str(e.value)


# ------------------------------------------------------------------------------------------ Lightning

def _first_adam_step_fraction(before: dict, after: dict, lr: float) -> float:
    """Of the weights that moved by more than lr / 2, the fraction that moved by lr within 1%."""
    moved = exact = 0
    for k, w0 in before.items():
        d = (after[k].float() - w0.float()).abs().flatten()
        m = d > 0.5 * lr
        moved += int(m.sum())
        exact += int(((d - lr).abs() <= 0.01 * lr)[m].sum())
    assert moved > 0
    return exact / moved


def _run(tmp_path, overrides):
    """GRPO on the bootstrapped toy student (its gradients are far above Adam's eps, unlike a random tiny
    model's), with the weights before every step observed."""
    from composer.backends.lightning.run import train
    from test_plan_schedule import FAST, Observer

    v = validate_file(ROOT / "specs/grpo.yaml", FAST + ["train.entropy_coef=0.1", "train.steps=4", "train.lr=0.001",
                                                        "train.grad_clip=0", *overrides])
    obs = Observer()
    events = []
    train(v, tmp_path / "run", progress=False, recorder=lambda kind, **d: (events.append((kind, d.get("step"))),
                                                                          obs(kind, **d)))
    return json.loads((tmp_path / "run" / "plan.json").read_text()), obs, events


@pytest.mark.slow
def test_lightning_resets_the_optimizer_and_the_reference_where_the_plan_says(tmp_path):
    import csv

    from test_plan_schedule import check_lightning

    plan, obs, events = _run(tmp_path, ["train.reset_every=2"])
    assert Schedule(plan).optimizer_resets() == [2]
    assert [s for k, s in events if k == "optimizer_reset"] == [2]
    assert [s for k, s in events if k == "reference_reset"] == [2]
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}
    check_lightning(plan, obs, rows)  # the KL term's initial log-probs: the Plan's reference (reset at 2)
    assert 3 in obs.initial_err
    # reset before step 2: step 2's update is a fresh AdamW's first (|dw| = lr wherever |g| >> eps)
    after_reset = _first_adam_step_fraction(obs.policy[2], obs.policy[3], 1e-3)
    second = _first_adam_step_fraction(obs.policy[1], obs.policy[2], 1e-3)  # AdamW's second step: far less
    assert after_reset > 0.8 and second < 0.2, (after_reset, second)


@pytest.mark.slow
def test_lightning_without_reset_keeps_the_moments(tmp_path):
    plan, obs, events = _run(tmp_path, [])
    assert Schedule(plan).optimizer_resets() == [] and not [k for k, _ in events if k.endswith("_reset")]
    assert _first_adam_step_fraction(obs.policy[2], obs.policy[3], 1e-3) < 0.2
