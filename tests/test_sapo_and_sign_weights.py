"""SAPO's soft gate (`grpo.bound: sapo`) and baseline-free advantages with a weight per outcome (`estimator:
{kind: sign_weighted}`: NSR, PSR, W-REINFORCE), issue 54 items 3 and 4. Every expected number is worked out here
by hand from the papers' formulas (the literals were computed once with a calculator from the formulas in the
comments), not by the project's helpers. The peer parity of SAPO (TRL's own GRPOTrainer._compute_loss, loss_type
sapo) is in tests/test_trl_parity.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from components.objectives.estimators import SignWeighted
from components.objectives.grpo import Grpo, bounded_surrogate
from composer.batch import PolicyView, TrajectoryBatch
from composer.checks.validate import validate_file
from composer.errors import SpecError
from composer.origins import CODE

ROOT = Path(__file__).resolve().parent.parent


def _batch(logp_old: list[list[float]], lengths: list[int], group: list[int] | None = None,
           rewards: list[float] | None = None) -> TrajectoryBatch:
    """Rows of [one prompt token | response tokens | pad], response log-probs `logp_old` (the behaviour's)."""
    B, L = len(logp_old), max(len(r) for r in logp_old)
    origin = torch.full((B, 1 + L), CODE["pad"], dtype=torch.uint8)
    origin[:, 0] = CODE["prompt"]
    beh = torch.zeros(B, 1 + L, dtype=torch.float64)
    for i, (row, n) in enumerate(zip(logp_old, lengths)):
        origin[i, 1:1 + n] = CODE["policy"]
        beh[i, 1:1 + len(row)] = torch.tensor(row, dtype=torch.float64)
    return TrajectoryBatch(tokens=torch.ones(B, 1 + L, dtype=torch.long), origin=origin, behavior_logprobs=beh,
                           group=torch.tensor(group if group is not None else list(range(B))),
                           control=torch.ones(B, dtype=torch.bool),
                           rewards=None if rewards is None else torch.tensor(rewards, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ SAPO

# Three one-token rows, old log-prob -1 each; the current log-prob moves the ratio r = exp(log pi - log pi_old):
#   row 0: A = +1, r = 1.5, tau = tau_pos = 1:    s = sigmoid(0.5)          = 0.6224593312
#          l = -(4/1) s A = -2.4898373248;  weight 4 s (1 - s) = 0.9400148488;  d l / d log pi = -w A r = -1.4100222732
#   row 1: A = -2, r = 1.5, tau = tau_neg = 1.05: s = sigmoid(0.525)        = 0.6283161883
#          l = -(4/1.05) s A = 4.7871709584;  w = 0.9341398233;  d l / d log pi = -w A r = 2.8024194699
#   row 2: A = -2, r = 0.5, tau = 1.05:           s = sigmoid(-0.525)       = 0.3716838117
#          l = (8/1.05) x 0.3716838117 = 2.8318766606;  w = 0.9341398233 (the gate is symmetric in r - 1);
#          d l / d log pi = -w A r = 0.9341398233
# token-mean over the 3 tokens: (-2.4898373248 + 4.7871709584 + 2.8318766606) / 3 = 1.7097367647
SAPO_L = [-2.4898373248074184, 4.7871709584408855, 2.831876660606733]
SAPO_G = [-1.410022273209567, 2.8024194698561775, 0.9341398232853926]
RATIOS, ADVS = [1.5, 1.5, 0.5], [1.0, -2.0, -2.0]


def _sapo_case():
    b = _batch([[-1.0]] * 3, [1, 1, 1])
    cur = b.behavior_logprobs.clone()
    for i, r in enumerate(RATIOS):
        cur[i, 1] = -1.0 + math.log(r)
    return b, cur.requires_grad_(True), torch.tensor(ADVS, dtype=torch.float64)


def test_sapo_gate_per_token_by_hand():
    _, cur, adv = _sapo_case()
    log_r = (cur[:, 1:2] - (-1.0)).detach().requires_grad_(True)
    loss, bounded, ratio = bounded_surrogate(cur[:, 1:2], log_r, adv[:, None], "sapo", 0.2, 0.2)
    assert loss[:, 0].tolist() == pytest.approx(SAPO_L, abs=1e-12)
    assert ratio[:, 0].tolist() == pytest.approx(RATIOS, abs=1e-12)
    assert bounded[:, 0].tolist() == [True, True, True]  # every weight is more than 1e-3 away from 1
    (g,) = torch.autograd.grad(loss.sum(), log_r)  # d l / d log r = d l / d log pi
    assert g[:, 0].tolist() == pytest.approx(SAPO_G, abs=1e-12)


def test_sapo_loss_and_gradient_through_grpo_by_hand():
    b, cur, adv = _sapo_case()
    obj = Grpo(bound="sapo", loss_agg="token-mean", kl_coef=0.0)
    loss, m = obj.loss(b, PolicyView(cur), adv)
    assert float(loss.detach()) == pytest.approx(sum(SAPO_L) / 3, abs=1e-12) == pytest.approx(1.7097367646518786, abs=1e-10)
    (g,) = torch.autograd.grad(loss, cur)
    assert g[:, 1].tolist() == pytest.approx([x / 3 for x in SAPO_G], abs=1e-12)
    assert m["clip_frac"] == 1.0 and m["ratio_mean"] == pytest.approx(3.5 / 3)


def test_sapo_reference_by_hand():
    """The referee's float64 formula (grpo.reference_loss) gives the same numbers and counts the gate as acting on
    the 3 tokens (weights 0.940 and 0.934, more than 1e-3 from 1)."""
    b, cur, _ = _sapo_case()
    obj = Grpo(bound="sapo", loss_agg="token-mean", kl_coef=0.0)
    want = obj.reference_loss(b, obj.loss_mask(b), PolicyView(cur.detach()),
                              {"old": b.behavior_logprobs, "advantages": ADVS, "kl_coef": 0.0})
    assert want["value"] == pytest.approx(sum(SAPO_L) / 3, abs=1e-12)
    assert want["grad"][:, 1].tolist() == pytest.approx([x / 3 for x in SAPO_G], abs=1e-12)
    assert want["acted"]["bound"] == 3


def test_sapo_at_ratio_one_has_grpos_gradient_and_does_not_act():
    """At r = 1, s = 1/2: l = -(4/tau)(1/2) A = -2A/tau (a constant), weight 4 (1/2)(1/2) = 1, so the gradient is
    the plain policy gradient -A (the clip's at r = 1), and the gate is not counted as acting."""
    b = _batch([[-1.0]] * 3, [1, 1, 1])
    adv = torch.tensor(ADVS, dtype=torch.float64)
    cur = b.behavior_logprobs.clone().requires_grad_(True)
    sapo, clip = Grpo(bound="sapo", kl_coef=0.0), Grpo(kl_coef=0.0)
    ls, m = sapo.loss(b, PolicyView(cur), adv)
    # (-2 x 1 / 1 - 2 x (-2) / 1.05 - 2 x (-2) / 1.05) / 3 = (-2 + 3.8095238095 + 3.8095238095) / 3
    assert float(ls.detach()) == pytest.approx((-2.0 + 8.0 / 1.05) / 3, abs=1e-12)
    (gs,) = torch.autograd.grad(ls, cur)
    lc, _ = clip.loss(b, PolicyView(cur), adv)
    (gc,) = torch.autograd.grad(lc, cur)
    assert gs[:, 1].tolist() == pytest.approx([-1 / 3, 2 / 3, 2 / 3], abs=1e-12) == gc[:, 1].tolist()
    assert m["clip_frac"] == 0.0
    ref = sapo.reference_loss(b, sapo.loss_mask(b), PolicyView(cur.detach()),
                              {"old": b.behavior_logprobs, "advantages": ADVS, "kl_coef": 0.0})
    assert ref["acted"]["bound"] == 0


def test_sapo_temperatures_follow_the_sign_of_the_advantage():
    """tau_pos for A > 0 only (A = 0 takes tau_neg, as TRL and the paper; its loss is 0 either way)."""
    _, cur, _ = _sapo_case()
    log_r = torch.full((3, 1), math.log(1.5), dtype=torch.float64)
    adv = torch.tensor([[1.0], [0.0], [-1.0]], dtype=torch.float64)
    loss, _, _ = bounded_surrogate(cur[:, 1:2], log_r, adv, "sapo", 0.2, 0.2, sapo_tau=(2.0, 0.5))
    # A = 1, tau 2: -(4/2) sigmoid(1) = -1.4621171573;  A = 0: 0;  A = -1, tau 0.5: (4/0.5) sigmoid(0.25) = 4.4974120071
    assert loss[:, 0].tolist() == pytest.approx([-1.4621171572600098, 0.0, 4.497412007086385], abs=1e-12)


def test_sapo_validation():
    spec = ROOT / "specs" / "methods" / "sapo.yaml"
    v = validate_file(spec, [])
    assert not [d for d in v.warnings if "cannot act" in d.message]  # 2 mini-batches: the ratio leaves 1
    warned = [d.message for d in validate_file(spec, ["train.mini_batches=1"]).warnings if "cannot act" in d.message]
    assert warned and "SAPO's soft gate" in warned[0]  # one update per step, hf engine fp32: the ratio is 1
    assert not [d for d in validate_file(spec, ["train.mini_batches=1", "rollout.precision=bf16"]).warnings
                if "cannot act" in d.message]  # bf16 rollout weights: the ratio is the mismatch, the gate acts on it
    with pytest.raises(SpecError) as e:  # SAPO reads no clip
        validate_file(spec, ["objective.clip_high=0.28"])
    assert any("never used" in d.message and d.rule == "objective_settings" for d in e.value.diagnostics)
    with pytest.raises(SpecError) as e:  # a temperature with another bound is never read
        validate_file(ROOT / "specs" / "grpo.yaml", ["objective.sapo_tau_neg=2.0"])
    assert any("never read" in d.message for d in e.value.diagnostics)
    with pytest.raises(SpecError):
        validate_file(spec, ["objective.sapo_tau_pos=0"])  # a temperature is > 0


def test_sapo_takes_the_composers_loss_on_openrlhf():
    why = Grpo(bound="sapo").openrlhf_native()
    assert why == ["bound: no OpenRLHF flag"]
    assert "sapo_tau_pos: no OpenRLHF flag" in Grpo(bound="sapo", sapo_tau_pos=2.0).openrlhf_native()
    assert not Grpo().openrlhf_native()  # the default is untouched: native


# ------------------------------------------------------------------------------------------------ NSR, PSR, W-REINFORCE

# Two groups of 4 (toy verifier rewards 0/1); the second is all-correct, which a group baseline would zero.
R = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
G = [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("pos,neg,want", [
    (1.0, 0.0, [1, 0, 0, 1, 1, 1, 1, 1]),                        # PSR: +1 on correct rows only
    (0.0, 1.0, [0, -1, -1, 0, 0, 0, 0, 0]),                      # NSR: -1 on incorrect rows only
    (0.1, 1.0, [0.1, -1, -1, 0.1, 0.1, 0.1, 0.1, 0.1]),          # W-REINFORCE, lambda 0.1
    (1.0, 1.0, [1, -1, -1, 1, 1, 1, 1, 1]),                      # plain REINFORCE on +-1 rewards
])
def test_sign_weighted_advantages_by_hand(pos, neg, want):
    est = SignWeighted(positive_weight=pos, negative_weight=neg)
    got = est.estimate(torch.tensor(R, dtype=torch.float64), torch.tensor(G)).tolist()
    assert got == pytest.approx(want, abs=1e-12)
    assert est.reference(R, G, [True] * 8) == pytest.approx(want, abs=1e-12)


def test_sign_weighted_maps_a_reward_to_plus_or_minus_one_by_the_threshold():
    """+-1 rewards and graded ones: success when the reward is at least success_threshold (0.5 by default)."""
    est = SignWeighted(positive_weight=0.1)
    assert est.estimate(torch.tensor([1.0, -1.0, 0.5, 0.49, 0.9], dtype=torch.float64), torch.zeros(5)).tolist() == \
        pytest.approx([0.1, -1.0, 0.1, -1.0, 0.1])
    assert SignWeighted(success_threshold=1.0).reference([0.9, 1.0], [0, 0], [True, True]) == [-1.0, 1.0]
    with pytest.raises(ValueError, match="nothing trains"):
        SignWeighted(positive_weight=0.0, negative_weight=0.0)


def test_the_authors_advantage_rule_on_0_1_scores():
    """Zhu et al.'s released code (verl, adv_estimator psr_nsr) turns a 0/1 score r into A = r (`positive`), r - 1
    (`negative`), lambda for r = 1 and -1 for r = 0 (`weighted`): the same numbers (written from the rule, not
    their code)."""
    rule = {"positive": (lambda r: r, SignWeighted(positive_weight=1.0, negative_weight=0.0)),
            "negative": (lambda r: r - 1.0, SignWeighted(positive_weight=0.0, negative_weight=1.0)),
            "weighted": (lambda r: 0.1 if r == 1 else -1.0, SignWeighted(positive_weight=0.1, negative_weight=1.0))}
    for name, (theirs, est) in rule.items():
        assert est.reference(R, G, [True] * 8) == pytest.approx([theirs(r) for r in R], abs=1e-12), name


def test_w_reinforce_loss_is_lambda_psr_plus_nsr_by_hand():
    """With bound none and token sums: L = -sum_i A_i sum_t log pi(y_it). Rows (rewards 1, 0, 0, 1) with response
    log-probs row0 [-0.5, -1.0], row1 [-2.0], row2 [-0.25, -0.75, -1.0], row3 [-3.0]:
      PSR = -sum over correct rows of log pi = -(-1.5 - 3.0) = 4.5
      NSR = +sum over incorrect rows of log pi = -2.0 - 2.0 = -4.0
      W-REINFORCE = 0.1 x 4.5 + (-4.0) = -3.55;  d L / d log pi = -A: -0.1 on correct tokens, +1 on incorrect."""
    lp = [[-0.5, -1.0], [-2.0], [-0.25, -0.75, -1.0], [-3.0]]
    b = _batch(lp, [2, 1, 3, 1], group=[0, 0, 0, 0], rewards=[1.0, 0.0, 0.0, 1.0])
    for (pos, neg), want in (((1.0, 0.0), 4.5), ((0.0, 1.0), -4.0), ((0.1, 1.0), -3.55)):
        obj = Grpo(estimator={"kind": "sign_weighted", "positive_weight": pos, "negative_weight": neg},
                   bound="none", loss_agg="token-sum", kl_coef=0.0)
        adv = obj.advantages(b)
        cur = b.behavior_logprobs.clone().requires_grad_(True)
        loss, _ = obj.loss(b, PolicyView(cur), adv)
        assert float(loss.detach()) == pytest.approx(want, abs=1e-12), (pos, neg)
        (g,) = torch.autograd.grad(loss, cur)
        sign = [pos, -neg, -neg, pos]
        want_g = [-sign[i] if t < len(lp[i]) else 0.0 for i in range(4) for t in range(3)]
        assert g[:, 1:].flatten().tolist() == pytest.approx(want_g, abs=1e-12)


def test_w_reinforce_token_mean_by_hand():
    """The specs' aggregation (token-mean, as verl's loss): the same sum over the batch's 7 loss tokens:
    L = -(0.1 x (-0.5 - 1.0 - 3.0) - 1 x (-2.0 - 0.25 - 0.75 - 1.0)) / 7 = -(-0.45 + 4.0) / 7 = -0.5071428571."""
    b = _batch([[-0.5, -1.0], [-2.0], [-0.25, -0.75, -1.0], [-3.0]], [2, 1, 3, 1], group=[0, 0, 0, 0],
               rewards=[1.0, 0.0, 0.0, 1.0])
    obj = Grpo(estimator={"kind": "sign_weighted", "positive_weight": 0.1}, bound="none", loss_agg="token-mean",
               kl_coef=0.0)
    loss, _ = obj.loss(b, PolicyView(b.behavior_logprobs), obj.advantages(b))
    assert float(loss) == pytest.approx(-3.55 / 7, abs=1e-12)


def test_a_baseline_free_estimator_needs_no_group():
    """No group baseline: an all-equal group still trains, one rollout per prompt is allowed, and the referee asks
    for rows of both outcomes instead of mixed groups (a concept of the estimator, not a kind name)."""
    assert not Grpo(estimator={"kind": "sign_weighted"}).group_baseline()
    assert Grpo().group_baseline() and Grpo(estimator={"kind": "leave_one_out"}).group_baseline()
    v = validate_file(ROOT / "specs" / "methods" / "nsr.yaml", ["rollout.samples_per_prompt=1"])
    assert v.spec.rollout.samples_per_prompt == 1
    with pytest.raises(SpecError) as e:
        validate_file(ROOT / "specs" / "grpo.yaml", ["rollout.samples_per_prompt=1"])
    assert any(d.rule == "group_baseline_needs_groups" for d in e.value.diagnostics)
    src = (ROOT / "composer" / "referee" / "__init__.py").read_text()
    assert "sign_weighted" not in src and "group_baseline()" in src


def test_explain_names_each_method():
    from composer.plan.compile import compile_plan
    from composer.plan.explain import text

    for name, line in (("nsr", "sign-weighted, no baseline (NSR): A = 0 for a success (reward >= 0.5), -1 for a failure"),
                       ("psr", "sign-weighted, no baseline (PSR): A = +1 for a success (reward >= 0.5), 0 for a failure"),
                       ("w-reinforce", "sign-weighted, no baseline (W-REINFORCE, lambda 0.1): A = +0.1 for a success"),
                       ("sapo", ("bound: SAPO soft gate -(4/tau) sigmoid(tau (rho - 1)) A, tau 1 for A > 0 and 1.05 "
                                 "otherwise"))):
        out = text(compile_plan(validate_file(ROOT / "specs" / "methods" / f"{name}.yaml")))
        assert line in out, out


def test_the_estimator_goes_through_the_plugin_on_openrlhf():
    why = "; ".join(Grpo(estimator={"kind": "sign_weighted"}).openrlhf_native())
    assert "estimator sign_weighted" in why and "no --algo.advantage.estimator computes it" in why
    assert SignWeighted().native_flag() is None


# ------------------------------------------------------------------------------------------------ the references catch bugs

def test_the_reference_catches_a_swapped_temperature(monkeypatch):
    """A one-line bug in the gate (the temperatures swapped by the sign of A) fails the comparison with grpo's
    reference loss (the referee's), on a batch where the ratio leaves 1."""
    import components.objectives.grpo as g
    from composer.testing import check_reference_loss, synthetic_batch

    obj = Grpo(bound="sapo", sapo_tau_pos=1.0, sapo_tau_neg=3.0, kl_coef=0.0)
    batch, logits = synthetic_batch(seed=0)
    check_reference_loss(obj, batch, logits)  # as built: equal
    real = g.bounded_surrogate

    def swapped(*a, **k):  # grpo.loss passes (tau_pos, tau_neg) as the 8th argument
        return real(*a[:7], a[7][::-1], **k)

    monkeypatch.setattr(g, "bounded_surrogate", swapped)
    with pytest.raises(AssertionError):
        check_reference_loss(obj, batch, logits)


def test_the_reference_catches_a_strict_threshold(monkeypatch):
    """A reward exactly at success_threshold is a success: an implementation that used > would give it -1, and the
    estimator's reference (the referee's advantages) tells it apart."""
    est = SignWeighted(positive_weight=0.1)
    rewards = [0.5, 0.0, 1.0]
    monkeypatch.setattr(SignWeighted, "estimate", lambda self, r, g, c=None: torch.where(
        r > self.success_threshold, torch.full_like(r, self.positive_weight), torch.full_like(r, -self.negative_weight)))
    got = est.estimate(torch.tensor(rewards, dtype=torch.float64), torch.zeros(3)).tolist()
    assert got != pytest.approx(est.reference(rewards, [0, 0, 0], [True] * 3))
