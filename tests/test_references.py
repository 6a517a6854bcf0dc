"""Each part's reference lives in its own file (DESIGN.md section 10; issue 52): the referee calls it, names no kind.

The references of the advantage estimators and the objectives' advantages are checked twice: against numbers worked
out by hand here, and against the implementations on random batches (every registered estimator, every setting
that changes the formula), so a reference that drifts from its formula, or an implementation from its reference,
fails. Schedules: `Schedule.reference` against hand values and against `Schedule.at`.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from components.objectives.advantage_regression import AdvantageRegression
from components.objectives.estimators import (ControlMean, GroupMean, LeaveOneOut, ReinforcePPBaseline, SoftValue,
                                              soft_value_reference)
from components.objectives.grpo import Grpo
from composer.lang.curves import Schedule, reference_value
from composer.registry import kinds, load_builtins

ROOT = Path(__file__).resolve().parent.parent
R = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5]
G = [0, 0, 0, 0, 1, 1, 2, 2]
C = [True, True, False, False, True, False, True, True]


def test_group_mean_by_hand():
    # group 0: mean 0.5, std (n-1) sqrt(1/3); group 1 all equal -> 0; group 2: mean 0.25, std sqrt(0.125)
    s0, s2 = math.sqrt(1 / 3), math.sqrt(0.125)
    want = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 0.0, 0.0, -0.25 / s2, 0.25 / s2]
    got = GroupMean(eps=1e-12).reference(R, G, C)
    assert got == pytest.approx(want, rel=1e-9)
    assert GroupMean(std="none").reference(R, G, C) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, -0.25, 0.25])


def test_leave_one_out_by_hand():
    got = LeaveOneOut().reference(R, G, C)  # r_i - mean of the other rows of its group
    assert got == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0.0, 0.0, -0.5, 0.5])


def test_soft_value_limits_by_hand():
    """beta1 = 0 is the max (the run computes r - max, as documented; the referee used to expect r - mean)."""
    assert SoftValue(beta1=0).reference(R, G, C) == pytest.approx([0, -1, -1, 0, 0, 0, -0.5, 0])
    assert SoftValue(beta1=math.inf).reference(R, G, C) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, -0.25, 0.25])
    v = math.log((math.exp(1) * 2 + 2) / 4)  # beta1 = 1 over group 0
    assert SoftValue(beta1=1.0).reference(R, G, C)[:4] == pytest.approx([1 - v, -v, -v, 1 - v])


def test_control_mean_by_hand():
    # group 0's control rows hold 1 and 0 (mean 0.5); group 1's one control row 1; group 2 both control: 0.25
    assert ControlMean().reference(R, G, C) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, -0.25, 0.25])
    assert soft_value_reference(R, G, math.inf, [False] * 8)[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])  # fallback


def test_valid_rows_scale_by_hand():
    """GPG: alpha = B / B_valid, rows over rows whose advantage is not 0 (here 6 of 8)."""
    base = Grpo(std_norm=False).reference_advantages(R, G, C, [1] * 8)
    got = Grpo(std_norm=False, valid_rows_scale=True).reference_advantages(R, G, C, [1] * 8)
    assert got == pytest.approx([x * 8 / 6 for x in base])


def _random_batch(seed: int):
    rng = random.Random(seed)
    n_groups, size = rng.randint(1, 4), rng.randint(2, 6)
    group = [g for g in range(n_groups) for _ in range(size)]
    rewards = [rng.choice([0.0, 1.0, 0.25, rng.uniform(-2, 2)]) for _ in group]
    if seed % 3 == 0:  # an all-equal group
        rewards[:size] = [1.0] * size
    control = [rng.random() < 0.5 for _ in group]
    return rewards, group, control


ESTIMATORS = [GroupMean(), GroupMean(std="batch"), GroupMean(std="none"), GroupMean(eps=0.1), LeaveOneOut(),
              ReinforcePPBaseline(), ReinforcePPBaseline(eps=0.01), SoftValue(), SoftValue(beta1=0),
              SoftValue(beta1=math.inf), SoftValue(beta1=0.3), ControlMean()]


def test_every_registered_estimator_has_a_reference_in_this_test():
    load_builtins()
    assert {e.kind for e in ESTIMATORS} == set(kinds("estimator"))


@pytest.mark.parametrize("est", ESTIMATORS, ids=lambda e: f"{e.kind}:{e.describe()[:40]}")
@pytest.mark.parametrize("seed", range(6))
def test_estimator_reference_equals_its_implementation(est, seed):
    rewards, group, control = _random_batch(seed)
    got = est.estimate(torch.tensor(rewards, dtype=torch.float64), torch.tensor(group),
                       torch.tensor(control)).tolist()
    want = est.reference(rewards, group, control)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("obj", [Grpo(), Grpo(valid_rows_scale=True, std_norm=False),
                                 Grpo(estimator={"kind": "soft_value", "beta1": 0}),
                                 AdvantageRegression(), AdvantageRegression(beta1=1.0),
                                 AdvantageRegression(baseline="control")], ids=repr)
@pytest.mark.parametrize("seed", range(4))
def test_objective_reference_advantages_equal_its_advantages(obj, seed):
    from composer.testing import synthetic_batch

    batch, _ = synthetic_batch(seed=seed)
    rewards, group, control = _random_batch(seed)
    import dataclasses

    n = min(len(rewards), batch.size)
    batch = dataclasses.replace(batch, rewards=torch.tensor(rewards[:n] + [0.0] * (batch.size - n)))
    got = obj.advantages(batch).double().tolist()
    want = obj.reference_advantages(batch.rewards.double().tolist(), batch.group.tolist(), batch.control.tolist(),
                                    batch.mask(("policy",)).sum(-1).tolist())
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------------ schedules

@pytest.mark.parametrize("kind,step,want", [
    ("linear", 0, 1.0), ("linear", 5, 1.0), ("linear", 6, 0.75), ("linear", 7, 0.5), ("linear", 8, 0.25),
    ("linear", 9, 0.0), ("linear", 50, 0.0),
    ("cosine", 5, 1.0), ("cosine", 6, 0.5 + 0.5 * math.cos(math.pi / 4)), ("cosine", 7, 0.5),
    ("cosine", 8, 0.5 + 0.5 * math.cos(3 * math.pi / 4)), ("cosine", 9, 0.0),
    ("step", 5, 1.0), ("step", 8, 1.0), ("step", 9, 0.0), ("step", 10, 0.0)])
def test_schedule_reference_by_hand(kind, step, want):
    """start 1, end 0, 4 steps from step 5 (the values worked out from the formulas in composer/lang/curves.py)."""
    s = Schedule(kind=kind, start=1.0, end=0.0, steps=4, begin=5)
    assert s.reference(step) == pytest.approx(want, abs=1e-12)
    assert s.at(step) == pytest.approx(want, abs=1e-12)  # the Plan's evaluation agrees


def test_reference_value_of_a_plain_number_is_the_number():
    assert reference_value(0.25, 7) == 0.25


def test_the_referee_names_no_advantage_kind():
    """The referee is a generic driver: no table of formulas keyed by kind (issue 52)."""
    src = "".join(p.read_text() for p in (ROOT / "composer" / "referee").glob("*.py"))
    assert "ADVANTAGES" not in src and '@estimator(' not in src
    assert "reference_advantages" in src and "reference_value" in src


# ------------------------------------------------------------------------------------------------ losses

LOSSES = [{"kind": "cross_entropy", "aggregation": a} for a in
          ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")] + [
    {"kind": "divergence", "estimator": "sampled", "kl_coef": 0.7},
    {"kind": "divergence", "estimator": "sampled", "aggregation": "seq-mean-token-mean"},
    *[{"kind": "grpo", "ratio": r, "bound": bd, "loss_agg": agg, "clip": 0.1}
      for r in ("token", "sequence", "sequence-token", "trajectory")
      for bd in ("clip", "mask", "cispo", "topr", "none")
      for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
      if not (r == "trajectory" and agg != "token-mean")],
    {"kind": "grpo", "ratio": "sequence", "bound": "log_clip", "clip_low": 0.05, "clip_high": 0.1},
    {"kind": "grpo", "ratio": "sequence", "bound": "log_clip", "loss_agg": "seq-mean-token-mean"},
    {"kind": "grpo", "dual_clip": 3.0, "clip": 0.05},
    {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k1"}, {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k2"},
    {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k3", "clip_low": 0.1, "clip_high": 0.3},
    {"kind": "grpo", "loss_agg": "seq-mean-token-sum-norm", "norm_const": 7.0},
    {"kind": "grpo", "valid_rows_scale": True, "std_norm": False},
    *[{"kind": "divergence", "estimator": est, "measure": m, "beta": b, "k": 4}
      for est in ("full", "top_k") for m, b in (("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.5),
                                                ("jsd", 0.2), ("jsd", 1.0), ("jsd", 0.0))],
]


@pytest.mark.parametrize("cfg", LOSSES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("seed", range(2))
def test_reference_loss_equals_the_loss_and_its_gradient(cfg, seed):
    from composer.registry import lookup
    from composer.testing import check_reference_loss, synthetic_batch

    obj = lookup("objective", cfg["kind"])(**{k: v for k, v in cfg.items() if k != "kind"})
    batch, logits = synthetic_batch(seed=seed)
    inputs = {"old": batch.behavior_logprobs, "initial": batch.initial_logprobs, "kl_coef": 0.0,
              "advantages": [0.5] * batch.size}
    assert obj.reference_loss(batch, obj.loss_mask(batch), _view(batch, logits), inputs) is not None
    check_reference_loss(obj, batch, logits)


def _view(batch, logits):
    from composer.testing import view_of

    return view_of(batch, logits)


def test_a_scaled_loss_differs_from_its_reference():
    """The check can fail: a cross-entropy 1.5 times too large is caught on the synthetic batch."""
    from components.objectives.cross_entropy import CrossEntropy
    from composer.testing import check_reference_loss, synthetic_batch

    class Scaled(CrossEntropy):
        def loss(self, batch, cur, adv=None):
            loss, m = super().loss(batch, cur, adv)
            return 1.5 * loss, m

    batch, logits = synthetic_batch(seed=0)
    with pytest.raises(AssertionError, match="reference_loss"):
        check_reference_loss(Scaled(), batch, logits)
