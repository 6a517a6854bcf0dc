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



def test_a_guided_rollout_prefills_its_later_rounds_from_the_earlier_rounds_cache(monkeypatch):
    """MInTRL's review rounds through the rollout driver: after the first round, the engine's generate calls
    prefill from the previous call's keys and values (composer/runtime/fast_sampler.py: PrefixCache), so each
    later round runs fewer prompt tokens than its longest prompt; the reuse ends with the rollout."""
    import random

    import torch

    import composer.runtime.fast_sampler as fs
    from composer.runtime.binding import bind_task
    from composer.runtime.context import RunContext
    from composer.runtime.engine import HFEngine
    from composer.runtime.models import load_model, load_tokenizer

    sp = validate_file("specs/mintrl.yaml", []).segments[0].spec
    tok, policy = load_tokenizer("toy:student"), load_model("toy:student")
    ctx = RunContext(task=bind_task(sp), tokenizer=tok, policy=policy, engine=HFEngine(policy, tok), spec=sp,
                     rng=random.Random(0))
    widths = []  # (prefill width T, longest prompt P) of every generate call
    real = fs._from_cache

    def from_cache(prefixes, weights, prompts, P, pre_k, pre_v):
        T = real(prefixes, weights, prompts, P, pre_k, pre_v)
        widths.append((T, P))
        return T

    monkeypatch.setattr(fs, "_from_cache", from_cache)
    torch.manual_seed(0)
    for _ in range(3):
        sp.rollout.guide.rollout(ctx, ctx.next_prompts(4), sp.rollout.samples_per_prompt)
    assert len(widths) > 3, widths  # some rollout had review rounds after its first
    assert any(T < P for T, P in widths), widths
    assert not ctx.engine.reuses_prefixes
