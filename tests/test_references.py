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
from components.objectives.estimators import (ControlMean, GroupMean, LeaveOneOut, ReinforcePPBaseline, SignWeighted,
                                              SoftValue, soft_value_reference)
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
              SoftValue(beta1=math.inf), SoftValue(beta1=0.3), ControlMean(),
              SignWeighted(), SignWeighted(positive_weight=0.1), SignWeighted(positive_weight=0.0),
              SignWeighted(negative_weight=0.0, success_threshold=0.25)]


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
                                 Grpo(estimator={"kind": "sign_weighted", "positive_weight": 0.1}),
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
      for bd in ("clip", "mask", "cispo", "topr", "none", "sapo")
      for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
      if not (r == "trajectory" and agg != "token-mean")],
    {"kind": "grpo", "ratio": "sequence", "bound": "log_clip", "clip_low": 0.05, "clip_high": 0.1},
    {"kind": "grpo", "ratio": "sequence", "bound": "log_clip", "loss_agg": "seq-mean-token-mean"},
    {"kind": "grpo", "dual_clip": 3.0, "clip": 0.05},
    {"kind": "grpo", "bound": "sapo", "sapo_tau_pos": 4.0, "sapo_tau_neg": 0.3},
    {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k1"}, {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k2"},
    {"kind": "grpo", "kl_coef": 0.1, "kl_estimator": "k3", "clip_low": 0.1, "clip_high": 0.3},
    {"kind": "grpo", "loss_agg": "seq-mean-token-sum-norm", "norm_const": 7.0},
    {"kind": "grpo", "valid_rows_scale": True, "std_norm": False},
    {"kind": "grpo", "token_selection": {"kind": "kl_cov", "k": 0.3, "beta": 0.7}},
    {"kind": "grpo", "token_selection": {"kind": "clip_cov", "r": 0.3, "omega_low": -1.0, "omega_high": 1.0}},
    *[{"kind": "grpo", "loss_tokens": ["policy", "guide_prefix", "demonstration"], "off_policy_weight": w, "kl_coef": kl}
      for w, kl in (({"kind": "shaped", "gamma": 0.1}, 0.0), ({"kind": "prob"}, 0.1), ({"kind": "pow", "alpha": 0.3}, 0.0),
                    ({"kind": "log"}, 0.0))],
    {"kind": "grpo", "ratio": "sequence", "loss_tokens": ["policy", "guide_prefix"], "off_policy_weight": {"kind": "shaped"}},
    {"kind": "advantage_regression"},
    {"kind": "advantage_regression", "reference": "initial", "beta2": 0.5, "beta1": 0.0},
    {"kind": "advantage_regression", "loss_tokens": ["policy", "guide_intervention"], "anchor": {"guide_intervention": -2.0},
     "beta2": 0.2},
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
    if obj.token_selection.acts if hasattr(obj, "token_selection") else False:
        obj.advantages(batch)  # the step's selection, on the batch
        inputs["token_select"] = batch.token_select
        assert batch.token_select is not None and batch.token_select.any()
    assert obj.reference_loss(batch, obj.loss_mask(batch), _view(batch, logits), inputs) is not None
    check_reference_loss(obj, batch, logits)


def test_off_policy_weight_references_by_hand():
    """w and d w / d log pi at pi = 0.25 (log pi = -1.386294): shaped (gamma 0.1) 0.25/0.35 = 0.714286 and
    0.1 x 0.25 / 0.35^2 = 0.204082; prob 0.25, 0.25; pow (alpha 0.5) 0.5, 0.25; log -1.386294, 1."""
    from components.objectives.off_policy_weight import Log, Pow, Prob, Shaped

    lp = math.log(0.25)
    assert Shaped(gamma=0.1).reference(lp) == pytest.approx((0.714286, 0.204082), abs=1e-6)
    assert Prob().reference(lp) == pytest.approx((0.25, 0.25))
    assert Pow(alpha=0.5).reference(lp) == pytest.approx((0.5, 0.25))
    assert Log().reference(lp) == pytest.approx((-1.386294, 1.0), abs=1e-6)


def test_token_selection_references_by_hand():
    """Cov_t over 10 tokens = [5, 4, 4, 3, 2, 1, 0, -1, 1.5, 2.5]: KL-Cov k 0.2 keeps max(1, floor(2)) = 2, the 5
    and one of the tied 4s (a tie may go either way); Clip-Cov r 0.2, band (1, 3): {3: no, 2, 1.5, 2.5} -> 3 in the
    band, count min(2, 3) = 2, each inside it. Selected tokens: KL-Cov -A rho + beta |d| and its gradient
    -A rho + beta sign(d) at A 0.5, d -0.1 (rho 0.904837), beta 0.2: -0.452419 + 0.02 = -0.432419 and
    -0.452419 - 0.2 = -0.652419; Clip-Cov 0, 0."""
    from components.objectives.token_selection import ClipCov, KlCov

    cov = [5.0, 4.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, 1.5, 2.5]
    pick = lambda *idx: [i in idx for i in range(10)]  # noqa: E731
    kl = KlCov(k=0.2, beta=0.2)
    assert kl.reference_problem(cov, pick(0, 1)) is None and kl.reference_problem(cov, pick(0, 2)) is None
    assert "differ" in kl.reference_problem(cov, pick(0, 3)) and "selected 3" in kl.reference_problem(cov, pick(0, 1, 2))
    assert kl.reference_token(0.5, -0.1) == pytest.approx((-0.432419, -0.652419), abs=1e-6)
    cc = ClipCov(r=0.2, omega_low=1.0, omega_high=3.0)
    assert cc.reference_problem(cov, pick(4, 9)) is None and cc.reference_problem(cov, pick(8, 4)) is None
    assert "outside the band" in cc.reference_problem(cov, pick(4, 3)) and cc.reference_problem(cov, pick(4)) is not None
    assert cc.reference_token(0.5, -0.1) == (0.0, 0.0)


def test_length_reward_references_by_hand():
    """DAPO's overlong penalty at L_max 10, L_cache 4 (start 6): lengths 5, 6, 7, 8, 10, 12 -> 0, 0, -0.25, -0.5, -1,
    -1; with no max_tokens the run's cap is L_max. A length penalty of 0.5: -0.5 |o|."""
    from components.sources.shaping import LengthPenalty, OverlongPenalty

    assert OverlongPenalty(buffer=4, max_tokens=10).reference_rewards([5, 6, 7, 8, 10, 12], 99) == \
        pytest.approx([0, 0, -0.25, -0.5, -1, -1])
    assert OverlongPenalty(buffer=4, factor=2.0).reference_rewards([7, 8], 10) == pytest.approx([-0.5, -1.0])
    assert LengthPenalty(coef=0.5).reference_rewards([2, 0], 10) == [-1.0, -0.0]


def test_the_referee_names_no_loss_kind():
    """The losses too come from the parts' files: no GRADIENTS table keyed by objective kind (issue 52)."""
    src = "".join(p.read_text() for p in (ROOT / "composer" / "referee").glob("*.py"))
    assert "GRADIENTS" not in src and "@gradient(" not in src and "kind_name() ==" not in src
    assert "reference_loss" in src and "reference_problem" in src and "reference_rewards" in src
    assert "reference_control" in src and "reference_prefix_steps" in src and "reference_trace" in src
    load_builtins()
    from composer.registry import SECTIONS

    # no registered kind as a string literal ("none" is also a value of settings, "reward" a signal's usage,
    # "sibling_success" a gate's field)
    named = [(sec, k) for sec in SECTIONS for k in kinds(sec) if k not in ("none", "reward", "sibling_success")
             for q in (f'"{k}"', f"'{k}'") if q in src]
    assert not named, f"the referee names these kinds: {named}"


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


# ------------------------------------------------------------------------------------------------ coverage


def test_declared_parts_and_their_references():
    """`composer check --coverage` lists every component a spec declares and the references its kind defines (a
    base class's default is none; a registered subclass inherits its parent's)."""
    from components.sources.outcome_reward import OutcomeReward
    from composer.checks.validate import validate_file
    from composer.referee.coverage import declared_parts, references

    spec = validate_file(ROOT / "specs" / "methods" / "luffy.yaml").segments[0].spec
    parts = dict(declared_parts(spec))
    assert parts["objective"].kind_name() == "grpo" and parts["rollout.guide"].kind_name() == "traces"
    assert parts["objective.off_policy_weight"].kind_name() == "shaped"
    assert references(parts["objective"]) == ["reference_advantages", "reference_loss"]
    assert references(parts["objective.off_policy_weight"]) == ["reference"]
    assert set(references(parts["rollout.guide"])) == {"reference_control", "reference_trace"}
    assert references(OutcomeReward(verifier="math")) == ["reference_verdicts"]  # the verifier run again on the text


def test_check_coverage_names_an_idle_part_and_what_makes_it_act(tmp_path):
    """The short run of GRPO makes two passes per step, so its clip binds and is exercised. DAPO told to make one
    pass (its two mini-batches at lr 1e-4 never take the ratio past the clip) leaves its bound idle: "not exercised"
    with what would make it act, and `composer check` fails (exit 1), never a pass. GRPO told to make one pass
    cannot move the ratio at all: its bound "cannot act in this run", which is said and is no failure."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "composer", "check", "--coverage", "--out"]
    r = subprocess.run(cmd + [str(tmp_path / "a"), str(ROOT / "specs" / "grpo.yaml")], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "objective.bound" in r.stdout and "acted:" in r.stdout.split("objective.bound")[-1].splitlines()[0]
    r = subprocess.run(cmd + [str(tmp_path / "b"), str(ROOT / "specs" / "methods" / "dapo.yaml"), "train.epochs=1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("objective.bound"))
    assert "not exercised" in line and "train.epochs=2" in line, r.stdout[-3000:]
    assert r.returncode == 1 and "parts exercised" in r.stdout and "objective.bound (clip)" in r.stdout, r.stdout[-3000:]
    r = subprocess.run(cmd + [str(tmp_path / "c"), str(ROOT / "specs" / "grpo.yaml"), "train.epochs=1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("objective.bound"))
    assert "cannot act in this run" in line and r.returncode == 0, r.stdout[-3000:]


def test_an_objective_without_a_reference_loss_fails_as_not_covered(tmp_path, monkeypatch):
    """A part nothing checks is "not covered", never a pass: SFT's cross-entropy with its reference_loss taken away
    (as a plugin that declares none) fails `composer check` naming it."""
    from components.objectives.base import Objective
    from components.objectives.cross_entropy import CrossEntropy
    from composer.referee import referee

    monkeypatch.setattr(CrossEntropy, "reference_loss", Objective.reference_loss)
    rep = referee(ROOT / "specs" / "sft.yaml", tmp_path)
    assert not rep.ok and any(f.startswith("loss covered:") and "declares no reference_loss" in f
                              for f in rep.failures()), rep.table()


def test_outcome_reward_reference_verdicts_by_hand():
    """The verifier source's reference runs the declared verifier on the texts it is given (the registry's, by name;
    `auto` is the task's): the toy verifier's '#<answer>' last line, an exact verifier's equality, by hand."""
    from components.sources.outcome_reward import OutcomeReward
    from composer.data import Example

    ex = Example(prompt="p", answer="7")
    src = OutcomeReward()  # auto: the task's verifier
    assert src.reference_verdicts(["3+4=7\n#7", "3+4=8\n#8", "no answer line"], [ex] * 3, "toy") == [
        (1.0, True), (0.0, True), (0.0, False)]
    assert OutcomeReward(verifier="exact").reference_verdicts(["7", "8"], [ex, ex], "toy") == [(1.0, True), (0.0, True)]


def test_a_verdict_scored_against_another_row_fails_re_verification(tmp_path):
    """The referee decodes each scored row again and runs the declared verifier on it: a scorer that pairs each
    response with the next row's example (tests/mutations.py verdict_shifted) fails `verdicts re-verified`, the one
    check that reads the responses' text (the rewards, gates and advantages read the verdicts as the run returned
    them; `rewards recomputed` may fail beside it only where two rows hold the same tokens and got different
    verdicts)."""
    import mutations
    from composer.referee import referee

    with mutations.mutated("verdict_shifted"):
        rep = referee(ROOT / "specs" / "grpo.yaml", tmp_path)
    failed = [f.partition(":")[0] for f in rep.failures()]
    assert "verdicts re-verified" in failed and set(failed) <= {"verdicts re-verified", "rewards recomputed"}, \
        rep.table()
