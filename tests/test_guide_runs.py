"""End to end on the toy testbed: the guided specs train for a couple of steps on the Lightning backend."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
import yaml

from composer.backends.lightning.run import train
from composer.checks.validate import validate_file

SPECS = Path(__file__).resolve().parents[1] / "specs"
SMALL = ["train.steps=2", "train.prompts_per_step=2", "train.eval_samples=4", "train.eval_every=0",
         "data.tiers=[1,4]", "data.train_tiers=[4]"]  # short chains: responses of at most 35 tokens


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """train() takes min(cpu_count, 8) torch threads; on a shared 2-core box two threads that spin-wait
    on each other's barriers make these tiny runs 10-20x slower. One thread is as fast when idle."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)


def last_metrics(out: Path) -> dict[str, float]:
    """Every metric's last logged value in metrics.csv."""
    out_m: dict[str, float] = {}
    with open(out / "metrics.csv") as f:
        for row in csv.DictReader(f):
            out_m.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return out_m


def run(path: Path, tmp_path: Path, overrides=SMALL) -> dict[str, float]:
    v = validate_file(path, list(overrides))
    final = train(v, tmp_path / "run", progress=False)
    assert final and all(0 <= x <= 1 for x in final.values())
    with open(tmp_path / "run" / "metrics.csv") as f:
        steps = [r for r in csv.DictReader(f) if r.get("loss")]
    assert len(steps) == v.total_steps
    m = last_metrics(tmp_path / "run")
    assert math.isfinite(m["loss"])
    return m


def test_pope_runs(tmp_path):
    m = run(SPECS / "pope.yaml", tmp_path)
    assert "guide/guided_frac" in m and m["offpolicy_token_frac"] == 0  # the prefix sits in the prompt


def test_oapl_pope_runs(tmp_path):
    m = run(SPECS / "hybrids" / "oapl-pope.yaml", tmp_path)
    assert "guide/guided_frac" in m


def test_mintrl_runs(tmp_path):
    m = run(SPECS / "mintrl.yaml", tmp_path)
    assert m["guide/reviews_per_traj"] > 0 and 0 <= m["offpolicy_token_frac"] < 0.5


def test_mintrl_self_proxy_runs(tmp_path):
    m = run(SPECS / "hybrids" / "mintrl-self-proxy.yaml", tmp_path)
    assert "guide/malformed" in m and m["guide/reviews_per_traj"] > 0


def test_int_runs(tmp_path):
    """Both stages, shortened: stages are a list, so the test writes a small copy of int.yaml."""
    data = yaml.safe_load((SPECS / "int.yaml").read_text())
    data["stages"][0]["train"]["steps"] = 2
    data["stages"][0]["signal"]["filter_samples"] = 2
    data["stages"][1]["train"]["steps"] = 1
    data["stages"][1]["rollout"]["samples_per_prompt"] = 4
    path = tmp_path / "int-small.yaml"
    path.write_text(yaml.safe_dump(data))
    m = run(path, tmp_path, [o for o in SMALL if not o.startswith("train.steps")])
    assert "sft_kept" in m

