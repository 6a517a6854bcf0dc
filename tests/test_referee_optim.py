"""The referee's optimiser step (composer/referee/optim.py): its formulas against numbers worked out by hand and
against torch's own AdamW, and the LR schedule of a run with several updates a step (which Lightning left frozen:
it steps schedulers only under automatic optimization)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from composer.checks.validate import validate_file
from composer.referee.optim import adamw, clip, fresh_moments, lr_at

ROOT = Path(__file__).resolve().parent.parent


def test_adamw_first_step_by_hand():
    """p = 1, g = 0.5, lr 0.1, betas (0.9, 0.999), no decay: m = 0.05, v = 0.00025, m_hat = 0.5, v_hat = 0.25,
    so p <- 1 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.9 (to 1e-8); with weight decay 0.1 first p <- p (1 - 0.01)."""
    state: dict = {}
    out = adamw(state, {"p": torch.tensor([1.0])}, {"p": torch.tensor([0.5])}, 0.1, (0.9, 0.999), 0.0)
    assert float(out["p"]) == pytest.approx(0.9, abs=1e-8)
    t, m, v = state["p"]
    assert t == 1 and float(m) == pytest.approx(0.05) and float(v) == pytest.approx(0.00025)
    out = adamw({}, {"p": torch.tensor([1.0])}, {"p": torch.tensor([0.5])}, 0.1, (0.9, 0.999), 0.1)
    assert float(out["p"]) == pytest.approx(0.99 - 0.1, abs=1e-8)


def test_adamw_equals_torch_adamw_over_steps():
    """Three steps on random tensors with decay: the referee's float64 AdamW against torch.optim.AdamW (the peer)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    grads = [torch.randn(5, 3, generator=g) for _ in range(3)]
    p = torch.nn.Parameter(w.clone().double())
    opt = torch.optim.AdamW([p], lr=0.01, betas=(0.8, 0.99), weight_decay=0.05)
    state: dict = {}
    mine = {"p": w.double()}
    for gr in grads:
        p.grad = gr.double()
        opt.step()
        mine = adamw(state, mine, {"p": gr}, 0.01, (0.8, 0.99), 0.05)
    assert torch.allclose(mine["p"], p.detach(), atol=1e-12)


def test_clip_is_clip_grad_norm():
    """||(3, 4)|| = 5: clipped to 1 it is (0.6, 0.8) (up to the 1e-6 torch adds); a norm under the bound stays."""
    out = clip({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 1.0)
    assert float(out["a"]) == pytest.approx(0.6, rel=1e-6) and float(out["b"]) == pytest.approx(0.8, rel=1e-6)
    assert float(clip({"a": torch.tensor([0.3])}, 1.0)["a"]) == pytest.approx(0.3)
    assert float(clip({"a": torch.tensor([30.0])}, 0.0)["a"]) == 30.0  # 0 disables
    ps = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    ps[0].grad, ps[1].grad = torch.tensor([3.0]), torch.tensor([4.0])
    torch.nn.utils.clip_grad_norm_(ps, 1.0)
    assert [float(p.grad) for p in ps] == pytest.approx([float(out["a"]), float(out["b"])], rel=1e-6)


def test_lr_and_fresh_moments_from_the_spec():
    """Warm-up 3 of a 6-step run at lr 1e-4: 1/3, 2/3, 1, then cosine to 0 over the remaining 3 steps
    (frac 0, 1/3, 2/3 -> 1, 0.75, 0.25); a stage's first step resets the moments unless optimizer_at_stage: keep;
    reset_every 2 resets before steps 2 and 4 of a segment."""
    v = validate_file(ROOT / "specs/grpo.yaml", ["train.steps=6", "train.warmup_steps=3", "train.lr_schedule=cosine",
                                                 "train.lr=1e-4"])
    want = [1 / 3, 2 / 3, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 3)), 0.5 * (1 + math.cos(2 * math.pi / 3))]
    assert [lr_at(v, s) for s in range(6)] == pytest.approx([1e-4 * f for f in want])
    v = validate_file(ROOT / "specs/int.yaml", ["stages.0.train.steps=3", "stages.1.train.steps=4"])
    assert [fresh_moments(v, s) for s in range(7)] == [s == 3 for s in range(7)]
    v = validate_file(ROOT / "specs/int.yaml", ["stages.0.train.steps=3", "stages.1.train.steps=4",
                                                "stages.1.train.optimizer_at_stage=keep"])
    assert not any(fresh_moments(v, s) for s in range(7))
    v = validate_file(ROOT / "specs/methods/prorl.yaml", ["train.steps=5", "train.reset_every=2"])
    assert [fresh_moments(v, s) for s in range(5)] == [False, False, True, False, True]


def test_several_updates_a_step_follow_the_lr_schedule(tmp_path):
    """Two mini-batches a step (manual optimization) and a 3-step warm-up: the LR each step logs (and trains
    with) is 1/3, 2/3, 1 of the peak, as with one update a step (it stayed at 1/3 before the fix)."""
    from composer.backends.lightning.run import train

    v = validate_file(ROOT / "specs/grpo.yaml", ["train.steps=3", "train.warmup_steps=3", "train.mini_batches=2",
                                                 "train.prompts_per_step=2", "rollout.samples_per_prompt=4",
                                                 "train.eval_every=0", "rollout.max_new_tokens=16", "train.lr=3e-4"])
    train(v, tmp_path / "run", progress=False)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f) if r.get("lr")]
    assert lrs == pytest.approx([1e-4, 2e-4, 3e-4])


def _watched_step(lr_factor: float = 1.0, scale: float = 1e-12):
    """One AdamW update of a float32 layer under the referee's UpdateWatch, at OAPL's spec (lr 1e-4, betas 0.9/0.95),
    on a gradient of size `scale` (OAPL on an all-zero-reward batch: r - V_hat = 0 and pi = pi_behaviour at a sync,
    so its gradient is float32 noise, ~1e-12); the run's LR is `lr_factor` times the spec's -> the Report."""
    from composer.referee.checks import Report
    from composer.referee.optim import UpdateWatch, check_updates

    v = validate_file(ROOT / "specs/oapl.yaml", ["train.steps=3"])
    torch.manual_seed(0)
    policy = torch.nn.Linear(64, 64)
    t = v.segments[0].spec.train
    opt = torch.optim.AdamW(policy.parameters(), lr=t.lr * lr_factor, betas=tuple(t.betas), weight_decay=t.weight_decay)
    watch = UpdateWatch(v, opt, policy, [])
    x = torch.randn(8, 64)
    (policy(x).sum() * scale).backward()
    opt.step()
    rep = Report()
    check_updates(rep, watch)
    return rep, watch


def test_optimizer_step_on_a_near_zero_gradient():
    """Issue 52: a correct AdamW step on a ~1e-12 gradient moves each weight by ~lr g / eps ~ 1e-8, about one float32
    unit in the last place of a weight of 0.05; a relative tolerance on that update (0.1-1.8 of it is rounding)
    failed it. Compared beyond each weight's rounding, it passes, and it is exercised (some weights move beyond it);
    the same step at twice the LR, or 10% more, still fails; a normal-sized gradient still fails at twice the LR."""
    rep, watch = _watched_step()
    assert rep.ok, rep.table()
    assert watch.results[0]["resolved"] and watch.results[0]["step_err"] == 0.0
    for factor in (2.0, 1.1):
        rep, watch = _watched_step(lr_factor=factor)
        assert not rep.ok and "optimizer step recomputed" in rep.failures()[0], (factor, rep.table())
    rep, _w = _watched_step(lr_factor=2.0, scale=1e-3)
    assert not rep.ok, rep.table()
    assert _watched_step(scale=1e-3)[0].ok


def test_optimizer_step_below_rounding_is_not_exercised():
    """A gradient so small that no weight's update reaches its float32 rounding (1e-20: AdamW moves by lr g / eps
    ~ 1e-16) cannot tell any LR apart: the check says "not exercised" rather than pass."""
    rep, watch = _watched_step(scale=1e-20)
    assert not watch.results[0]["resolved"]
    assert any("not exercised" in f for f in rep.failures()), rep.table()
