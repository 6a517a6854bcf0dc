"""Loss functions against numbers worked out by hand from ALGORITHMS.md (sections 0-5, 8-10).

Every expected value is written as explicit arithmetic in the test (math.log etc.), never obtained by
calling the implementation a second time.
"""

from __future__ import annotations

import math

import pytest
import torch

from components.objectives.advantage_regression import AdvantageRegression, soft_value
from components.objectives.base import whole_batch_loss, aggregate, group_advantages, group_stats, zero_advantage_fraction
from components.objectives.cross_entropy import CrossEntropy
from components.objectives.divergence import Divergence, add_tail, token_divergence
from components.objectives.grpo import Grpo, kl_estimate
from composer.batch import PolicyView, TrajectoryBatch
from composer.origins import CODE

PAD, PR, POL, GP, GI, DEM = (CODE[n] for n in ("pad", "prompt", "policy", "guide_prefix", "guide_intervention", "demonstration"))
L2 = math.log(2.0)


def make_batch(origin, beh, group=None, control=None, rewards=None, **kw) -> TrajectoryBatch:
    origin = torch.tensor(origin, dtype=torch.uint8)
    B, T = origin.shape
    return TrajectoryBatch(
        tokens=kw.pop("tokens", torch.zeros(B, T, dtype=torch.long)),
        origin=origin,
        behavior_logprobs=torch.as_tensor(beh, dtype=torch.float32),
        group=torch.tensor(group if group is not None else list(range(B)), dtype=torch.long),
        control=torch.tensor(control if control is not None else [True] * B, dtype=torch.bool),
        rewards=None if rewards is None else torch.tensor(rewards, dtype=torch.float32),
        **kw,
    )


def approx(x, y, tol=1e-5):
    x = x.detach() if isinstance(x, torch.Tensor) else x
    return abs(float(x) - float(y)) <= tol


# ------------------------------------------------------------------------------------------------
# Aggregation (section 0)
# ------------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode,norm,expected", [
    ("token-mean", None, (1 + 2 + 3 + 4) / 4),               # 10 / 4 = 2.5
    ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # (2 + 4) / 2 = 3
    ("seq-mean-token-sum", None, ((1 + 2 + 3) + 4) / 2),     # (6 + 4) / 2 = 5
    ("seq-mean-token-sum-norm", None, 10 / 3),               # C = T = 3
    ("seq-mean-token-sum-norm", 5.0, 10 / 5),                # C = 5
    ("token-sum", None, 1 + 2 + 3 + 4),                      # Tinker: no normaliser
])
def test_aggregate_modes(mode, norm, expected):
    assert approx(aggregate(LOSS, MASK, mode, norm_const=norm), expected)


@pytest.mark.parametrize("mode,expected", [
    # s = [2, 1]: token-mean = (2*6 + 1*4) / (2*3 + 1*1) = 16/7 (SDPO: sum m s l / sum m s)
    ("token-mean", 16 / 7),
    # seq-means are s-weighted means of the per-row values: (2*2 + 1*4) / 3, (2*6 + 1*4) / 3
    ("seq-mean-token-mean", (2 * 2 + 4) / 3),
    ("seq-mean-token-sum", (2 * 6 + 4) / 3),
    ("seq-mean-token-sum-norm", (2 * 6 + 4) / 3),  # C = T = 3
    ("token-sum", 2 * 6 + 4),
])
def test_aggregate_seq_weight(mode, expected):
    assert approx(aggregate(LOSS, MASK, mode, seq_weight=torch.tensor([2.0, 1.0])), expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                  "token-sum"])
def test_aggregate_empty_rows_no_nan(mode):
    loss = torch.tensor([[1.0, 2.0, 3.0], [float("nan"), float("inf"), 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    # the empty row neither counts as a sequence nor leaks its NaN/inf
    expected = {"token-mean": 1.5, "seq-mean-token-mean": 1.5, "seq-mean-token-sum": 3.0,
                "seq-mean-token-sum-norm": 1.0, "token-sum": 3.0}[mode]
    out = aggregate(loss, mask, mode)
    assert approx(out, expected)
    (g,) = torch.autograd.grad(out, loss)
    assert torch.isfinite(g).all() and (g[1] == 0).all()
    # an all-empty mask gives 0 with a finite (zero) gradient
    out0 = aggregate(loss, torch.zeros_like(mask), mode)
    assert float(out0.detach()) == 0.0
    (g0,) = torch.autograd.grad(out0, loss)
    assert torch.equal(g0, torch.zeros_like(g0))


# ------------------------------------------------------------------------------------------------
# Group helpers and GRPO (section 2)
# ------------------------------------------------------------------------------------------------

def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 2.0, 5.0])
    group = torch.tensor([7, 7, 2, 2, 2, 9])
    # group 7: [1, 0], mean 0.5, unbiased std sqrt((0.25 + 0.25)/1) = sqrt(0.5)
    # group 2: [3, 1, 2], mean 2, unbiased std sqrt((1 + 1 + 0)/2) = 1
    # group 9: one row -> 0
    eps = 1e-6
    s7 = math.sqrt(0.5)
    expected = [0.5 / (s7 + eps), -0.5 / (s7 + eps), 1 / (1 + eps), -1 / (1 + eps), 0.0, 0.0]
    adv = group_advantages(rewards, group, std_norm=True, eps=eps)
    assert all(approx(a, e) for a, e in zip(adv.tolist(), expected))
    # Dr. GRPO: no std
    adv = group_advantages(rewards, group, std_norm=False)
    assert adv.tolist() == [0.5, -0.5, 1.0, -1.0, 0.0, 0.0]
    mean, std, n, const = group_stats(rewards, group)
    assert mean.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0, 5.0]
    assert approx(std[0], s7) and std[2] == 1.0 and std[5] == 0.0
    assert n.tolist() == [2, 2, 3, 3, 3, 1]
    assert const.tolist() == [False] * 5 + [True]


def test_zero_advantage_fraction():
    # groups: 0 -> [1, 1] (all equal), 1 -> [0, 1], 2 -> [7] (one row: trivially equal): (2 + 1) / 5
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 7.0])
    g = torch.tensor([0, 0, 1, 1, 2])
    assert approx(zero_advantage_fraction(r, g), 3 / 5)


def test_kl_estimators_by_hand():
    d = torch.tensor([L2, -L2, 0.0, -30.0, 30.0])
    assert torch.allclose(kl_estimate(d, "k1"), d)
    assert torch.allclose(kl_estimate(d, "k2"), torch.tensor([0.5 * L2 ** 2, 0.5 * L2 ** 2, 0.0, 450.0, 450.0]))
    k3 = kl_estimate(d, "k3")
    # exp(-ln2) + ln2 - 1 = 0.5 + 0.693147 - 1; exp(ln2) - ln2 - 1 = 2 - 0.693147 - 1
    # d = -30 -> clamped to -20 -> e^20 - 21 ~ 4.85e8 -> clamped to 10; d = 30 -> e^-20 + 19 -> 10
    expected = [0.5 + L2 - 1, 2 - L2 - 1, 0.0, 10.0, 10.0]
    assert all(approx(a, e) for a, e in zip(k3.tolist(), expected))
    with pytest.raises(ValueError):
        kl_estimate(d, "k4")


def grpo_batch(**kw):
    # 2 groups x 2 rows x 3 tokens [prompt, policy, policy]; behaviour log(0.5) on response tokens
    lh = math.log(0.5)
    return make_batch([[PR, POL, POL]] * 4, [[0.0, lh, lh]] * 4, group=[0, 0, 1, 1], rewards=[1.0, 0.0, 0.0, 0.0], **kw)


def grpo_logp():
    # current log-probs: log(0.75), log(0.25) -> ratios 1.5 and 0.5 against 0.5
    return torch.tensor([[0.0, math.log(0.75), math.log(0.25)]] * 4, requires_grad=True)


# a = |A| in group 0: rewards [1, 0] -> 0.5 / (sqrt(0.5) + 1e-6); group 1 [0, 0] -> A = 0
A_G0 = 0.5 / (math.sqrt(0.5) + 1e-6)


def test_grpo_clipped_loss_by_hand():
    b, lp = grpo_batch(), grpo_logp()
    loss, m = whole_batch_loss(Grpo(kl_coef=0), b, PolicyView(logprobs=lp))
    a = A_G0
    # row 0 (A = +a): min(1.5a, 1.2a) = 1.2a (clipped); min(0.5a, 0.8a) = 0.5a
    # row 1 (A = -a): min(-1.5a, -1.2a) = -1.5a;        min(-0.5a, -0.8a) = -0.8a (clipped)
    # rows 2, 3: A = 0 -> 0. token-mean over 8 tokens of -surrogate: -(1.2 + 0.5 - 1.5 - 0.8) a / 8 = 0.6a / 8
    assert approx(loss, 0.6 * a / 8)
    assert approx(m["pg_loss"], 0.6 * a / 8)
    assert approx(m["clip_frac"], 2 / 8) and m["kl"] == 0.0
    assert approx(m["adv_mean"], 0.0) and approx(m["zero_advantage_frac"], 0.5)
    # seq-mean-token-sum: row sums of -surrogate: -1.7a, 2.3a, 0, 0 -> 0.6a / 4
    loss, _ = whole_batch_loss(Grpo(kl_coef=0, loss_agg="seq-mean-token-sum"), b, PolicyView(logprobs=lp))
    assert approx(loss, 0.6 * a / 4)
    # Dr. GRPO: seq-mean-token-sum-norm with C = 3 (= T) and std_norm off -> A = +-0.5
    loss, _ = whole_batch_loss(Grpo(kl_coef=0, loss_agg="seq-mean-token-sum-norm", std_norm=False), b, PolicyView(logprobs=lp))
    assert approx(loss, 0.6 * 0.5 / 3)
    # clip-higher 0.6: 1.5 is inside [0.8, 1.6] -> row 0 token 1 gives 1.5a: -(1.5 + 0.5 - 1.5 - 0.8) a / 8
    loss, m = whole_batch_loss(Grpo(kl_coef=0, clip_high=0.6), b, PolicyView(logprobs=lp))
    assert approx(loss, 0.3 * a / 8) and approx(m["clip_frac"], 1 / 8)


def test_grpo_kl_term_by_hand():
    lh = math.log(0.5)
    b = grpo_batch(initial_logprobs=torch.tensor([[0.0, lh, lh]] * 4))
    # delta = log pi_theta - log pi_init = [ln 1.5, ln 0.5] on every row
    k1 = (math.log(1.5) + math.log(0.5)) / 2          # token-mean of k1
    k3 = ((1 / 1.5 + math.log(1.5) - 1) + (2 + math.log(0.5) - 1)) / 2  # (0.0721318 + 0.3068528) / 2
    for est, kl in (("k1", k1), ("k3", k3)):
        loss, m = whole_batch_loss(Grpo(kl_coef=0.1, kl_estimator=est), b, PolicyView(logprobs=grpo_logp()))
        assert approx(m["kl"], kl)
        assert approx(loss, 0.6 * A_G0 / 8 + 0.1 * kl)
    with pytest.raises(ValueError, match="initial_logprobs"):
        whole_batch_loss(Grpo(kl_coef=0.1), grpo_batch(), PolicyView(logprobs=grpo_logp()))


@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_grpo_zero_gradient_when_group_rewards_equal(std_norm, agg):
    torch.manual_seed(0)
    B, T = 7, 5
    origin = [[PR, PR, POL, POL, POL]] * 6 + [[PR, POL, POL, PAD, PAD]]
    b = make_batch(origin, torch.randn(B, T) - 2, group=[0, 0, 1, 1, 2, 2, 2],
                   rewards=[1.0, 1.0, 0.0, 0.0, 0.1, 0.1, 0.1])  # 0.1 is not exact in binary
    lp = (torch.randn(B, T) - 2).requires_grad_()  # ratios far from 1, some clipped
    loss, m = whole_batch_loss(Grpo(kl_coef=0, std_norm=std_norm, loss_agg=agg), b, PolicyView(logprobs=lp))
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.equal(g, torch.zeros_like(g)) and float(loss.detach()) == 0.0
    assert m["zero_advantage_frac"] == 1.0


# ------------------------------------------------------------------------------------------------
# V_hat and advantage regression (sections 8-10)
# ------------------------------------------------------------------------------------------------

def test_v_hat_limits_and_hand_value():
    r, g = torch.tensor([0.0, 1.0]), torch.tensor([0, 0])
    v = lambda beta1: soft_value(r, g, beta1)[0]
    assert v(0.0).tolist() == [1.0, 1.0]                    # beta1 = 0: max
    assert v(math.inf).tolist() == [0.5, 0.5]               # beta1 = inf: mean
    assert approx(v(1.0)[0], math.log((1 + math.e) / 2))   # ln((e^0 + e^1)/2) = 0.620115
    assert approx(v(0.5)[0], 0.5 * math.log((1 + math.e ** 2) / 2))
    small, large = v(1e-8), v(1e8)
    assert torch.isfinite(small).all() and torch.isfinite(large).all()
    assert approx(small[0], 1.0, 1e-6) and approx(large[0], 0.5, 1e-6)
    # V_hat between mean and max, increasing as beta1 falls
    vals = [float(v(b)[0]) for b in (1e8, 10.0, 1.0, 0.1, 1e-8)]
    assert all(vals[i] <= vals[i + 1] + 1e-12 for i in range(len(vals) - 1))
    # stable for large rewards: ln((e^1000 + e^0)/2) = 1000 - ln 2 (+ e^-1000)
    assert approx(soft_value(torch.tensor([1000.0, 0.0]), g, 1.0)[0][0], 1000 - L2, 1e-3)


def test_v_hat_control_baseline_and_fallback():
    # group 0: control row r = 0 -> V = 0; group 1 has no control rows -> all rows: mean(1, 0) = 0.5
    r = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    c = torch.tensor([True, False, False, False, False])
    v, n_fb = soft_value(r, g, math.inf, c)
    assert v.tolist() == [0.0, 0.0, 0.0, 0.5, 0.5] and n_fb == 1
    v, _ = soft_value(r, g, 0.0, c)
    assert v.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def mintrl_batch(**kw):
    """4 rows x 4 tokens. logp = log 0.5 on every real token, behaviour log 0.25.
    row 0: group 0, control, r = 0: [prompt, policy, policy, policy]
    row 1: group 0, guided,  r = 1: [prompt, policy, guide_intervention, policy]
    row 2: group 1, guided,  r = 1: [prompt, policy, guide_intervention, policy]
    row 3: group 1, guided,  r = 0: [prompt, policy, policy, pad]
    """
    origin = [[PR, POL, POL, POL], [PR, POL, GI, POL], [PR, POL, GI, POL], [PR, POL, POL, PAD]]
    q = math.log(0.25)
    beh = [[0.0, q, q, q]] * 3 + [[0.0, q, q, 0.0]]
    return make_batch(origin, beh, group=[0, 0, 1, 1], control=[True, False, False, False],
                      rewards=[0.0, 1.0, 1.0, 0.0], **kw)


def mintrl_logp():
    h = math.log(0.5)
    return torch.tensor([[0.0, h, h, h]] * 3 + [[0.0, h, h, 0.0]], requires_grad=True)


# control baseline, beta1 = inf: V = [0, 0, 0.5, 0.5] (group 1 falls back to all rows) -> A = [0, 1, 0.5, -0.5]
ADV = [0.0, 1.0, 0.5, -0.5]


def test_advantage_regression_const_anchor_by_hand():
    obj = AdvantageRegression(beta1=math.inf, beta2=0.1, baseline="control",
                              loss_tokens=["policy", "guide_intervention"], anchor={"guide_intervention": -0.2})
    loss, m = whole_batch_loss(obj, mintrl_batch(), PolicyView(logprobs=mintrl_logp()))
    # policy token: ln 0.5 - ln 0.25 = ln 2; intervention token: ln 0.5 - (-0.2) = -ln 2 + 0.2
    lr = [3 * L2, 2 * L2 + (-L2 + 0.2), 2 * L2 + (-L2 + 0.2), 2 * L2]  # [2.0794, 0.8931, 0.8931, 1.3863]
    expected = sum((0.1 * x - a) ** 2 for x, a in zip(lr, ADV)) / 4  # (0.04324 + 0.82935 + 0.16866 + 0.40785)/4
    assert approx(loss, expected) and approx(expected, 0.362275, 1e-5)
    assert approx(m["v_hat_mean"], 0.25) and approx(m["adv_mean"], 0.25)
    assert approx(m["logratio_mean"], sum(lr) / 4) and m["baseline_fallback_groups"] == 1.0
    assert approx(m["zero_advantage_frac"], 0.0)


def test_advantage_regression_proxy_anchor_by_hand():
    obj = AdvantageRegression(beta1=math.inf, beta2=0.1, baseline="control",
                              loss_tokens=["policy", "guide_intervention"], anchor={"guide_intervention": "policy"})
    loss, _ = whole_batch_loss(obj, mintrl_batch(), PolicyView(logprobs=mintrl_logp()))
    # Proxy: intervention token anchored at the rollout weights' log-prob 0.25 -> ln 2 like policy tokens
    lr = [3 * L2, 3 * L2, 3 * L2, 2 * L2]
    assert approx(loss, sum((0.1 * x - a) ** 2 for x, a in zip(lr, ADV)) / 4)
    # seq weights [1, 1, 2, 0]: sum w (.)^2 / sum w
    b = mintrl_batch(seq_weight=torch.tensor([1.0, 1.0, 2.0, 0.0]))
    loss, _ = whole_batch_loss(obj, b, PolicyView(logprobs=mintrl_logp()))
    w = [1, 1, 2, 0]
    assert approx(loss, sum(wi * (0.1 * x - a) ** 2 for wi, x, a in zip(w, lr, ADV)) / 4)
    # intervention tokens out of loss_tokens: row 1/2 log-ratio is 2 ln 2
    obj = AdvantageRegression(beta1=math.inf, beta2=0.1, baseline="control")
    loss, _ = whole_batch_loss(obj, mintrl_batch(), PolicyView(logprobs=mintrl_logp()))
    lr = [3 * L2, 2 * L2, 2 * L2, 2 * L2]
    assert approx(loss, sum((0.1 * x - a) ** 2 for x, a in zip(lr, ADV)) / 4)


def test_advantage_regression_softmax_baseline_and_initial_reference():
    # A*PO: beta1 = 1, baseline over all rows, policy tokens anchored at the initial policy (log 0.125)
    e = math.log(0.125)
    init = torch.tensor([[0.0, e, e, e]] * 3 + [[0.0, e, e, 0.0]])
    b = mintrl_batch(initial_logprobs=init)
    obj = AdvantageRegression(beta1=1.0, beta2=0.1, reference="initial", anchor={"guide_intervention": -0.2},
                              loss_tokens=["policy", "guide_intervention"])
    loss, m = whole_batch_loss(obj, b, PolicyView(logprobs=mintrl_logp()))
    v = math.log((1 + math.e) / 2)  # both groups have rewards {0, 1}
    adv = [0 - v, 1 - v, 1 - v, 0 - v]
    # policy token: ln 0.5 - ln 0.125 = 2 ln 2; intervention: -ln 2 + 0.2 (kappa, not the initial policy)
    lr = [6 * L2, 4 * L2 - L2 + 0.2, 4 * L2 - L2 + 0.2, 4 * L2]
    assert approx(loss, sum((0.1 * x - a) ** 2 for x, a in zip(lr, adv)) / 4)
    assert approx(m["v_hat_mean"], v)
    with pytest.raises(ValueError, match="initial_logprobs"):
        whole_batch_loss(obj, mintrl_batch(), PolicyView(logprobs=mintrl_logp()))


# ------------------------------------------------------------------------------------------------
# Cross-entropy (section 1)
# ------------------------------------------------------------------------------------------------

def test_cross_entropy_by_hand():
    b = make_batch([[PR, DEM, DEM, PAD], [PR, POL, GI, GP]], torch.zeros(2, 4))
    lp = torch.tensor([[0.0, math.log(0.5), math.log(0.25), float("nan")],
                       [0.0, math.log(0.5), math.log(0.5), math.log(0.1)]], requires_grad=True)
    # default loss tokens: demonstration, policy, guide_intervention -> -[ln .5, ln .25, ln .5, ln .5]
    loss, m = whole_batch_loss(CrossEntropy(), b, PolicyView(logprobs=lp))
    assert approx(loss, (L2 + 2 * L2 + L2 + L2) / 4) and m["tokens"] == 4.0  # 5 ln2 / 4 = 0.866434
    # seq-mean-token-sum: (3 ln2 + 2 ln2) / 2
    loss, _ = whole_batch_loss(CrossEntropy(aggregation="seq-mean-token-sum"), b, PolicyView(logprobs=lp))
    assert approx(loss, 2.5 * L2)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(g).all()
    assert g.tolist() == [[0.0, -0.5, -0.5, 0.0], [0.0, -0.5, -0.5, 0.0]]


# ------------------------------------------------------------------------------------------------
# Divergences (sections 3-5)
# ------------------------------------------------------------------------------------------------

S = [0.5, 0.2, 0.1, 0.1, 0.1]           # student probabilities, vocab 5
T = [0.25, 0.25, 0.25, 0.125, 0.125]    # teacher probabilities
# KL(S||T) = .5 ln(.5/.25) + .2 ln(.2/.25) + .1 ln(.1/.25) + 2 * .1 ln(.1/.125) = 0.165687
REV = 0.5 * math.log(2) + 0.2 * math.log(0.8) + 0.1 * math.log(0.4) + 0.2 * math.log(0.8)
# KL(T||S) = .25 ln(.25/.5) + .25 ln(.25/.2) + .25 ln(.25/.1) + 2 * .125 ln(.125/.1) = 0.167358
FWD = 0.25 * math.log(0.5) + 0.25 * math.log(1.25) + 0.25 * math.log(2.5) + 0.25 * math.log(1.25)


def jsd_by_hand(beta):
    Mx = [beta * t + (1 - beta) * s for s, t in zip(S, T)]  # beta = .5: [.375, .225, .175, .1125, .1125]
    kl_tm = sum(t * math.log(t / mm) for t, mm in zip(T, Mx))
    kl_sm = sum(s * math.log(s / mm) for s, mm in zip(S, Mx))
    return beta * kl_tm + (1 - beta) * kl_sm


JSD_HALF = (0.5 * (0.25 * math.log(0.25 / 0.375) + 0.25 * math.log(0.25 / 0.225) + 0.25 * math.log(0.25 / 0.175)
                   + 0.25 * math.log(0.125 / 0.1125))
            + 0.5 * (0.5 * math.log(0.5 / 0.375) + 0.2 * math.log(0.2 / 0.225) + 0.1 * math.log(0.1 / 0.175)
                     + 0.2 * math.log(0.1 / 0.1125)))
# beta = 0.2: M = 0.2 T + 0.8 S = [.45, .21, .13, .105, .105]
JSD_02 = (0.2 * (0.25 * math.log(0.25 / 0.45) + 0.25 * math.log(0.25 / 0.21) + 0.25 * math.log(0.25 / 0.13)
                 + 0.25 * math.log(0.125 / 0.105))
          + 0.8 * (0.5 * math.log(0.5 / 0.45) + 0.2 * math.log(0.2 / 0.21) + 0.1 * math.log(0.1 / 0.13)
                   + 0.2 * math.log(0.1 / 0.105)))


def test_token_divergence_by_hand():
    s, t = torch.tensor(S).log(), torch.tensor(T).log()
    assert approx(token_divergence(s, t, "reverse_kl"), REV) and approx(REV, 0.165687, 1e-6)
    assert approx(token_divergence(s, t, "forward_kl"), FWD) and approx(FWD, 0.167358, 1e-6)
    assert approx(token_divergence(s, t, "jsd", 0.5), JSD_HALF) and approx(JSD_HALF, jsd_by_hand(0.5), 1e-12)
    assert approx(token_divergence(s, t, "jsd", 0.2), JSD_02) and approx(JSD_02, jsd_by_hand(0.2), 1e-12)
    assert approx(token_divergence(s, t, "jsd", 0.0), FWD)  # TRL: beta = 0 is forward KL(T||S)
    assert approx(token_divergence(s, t, "jsd", 1.0), REV)  # beta = 1 is reverse KL(S||T)
    # zero-probability entries: 0 log 0 = 0, no NaN
    z = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]).log()
    assert approx(token_divergence(z, torch.full((5,), 0.2).log(), "reverse_kl"), math.log(0.5 / 0.2))


def div_batch(**kw):
    # one row [prompt, policy, policy]; behaviour log-probs log 0.5 at the response tokens
    h = math.log(0.5)
    return make_batch([[PR, POL, POL]], [[0.0, h, h]], **kw)


def logits_for(*dists):
    """[1, len, 5] logits = log p (log_softmax(log p) = log p); position 0 is uniform."""
    rows = [[0.2] * 5] + [list(d) for d in dists]
    return torch.tensor([rows]).log()


@pytest.mark.parametrize("measure,beta,value", [
    ("reverse_kl", 0.5, REV), ("forward_kl", 0.5, FWD), ("jsd", 0.5, JSD_HALF), ("jsd", 0.2, JSD_02),
    ("jsd", 0.0, FWD), ("jsd", 1.0, REV),
])
def test_divergence_full_by_hand(measure, beta, value):
    # position 1: S vs T; position 2: identical distributions -> 0. token-mean over 2 tokens, w = 1
    b = div_batch(teacher_logits=logits_for(T, T))
    cur_logits = logits_for(S, T).requires_grad_()
    h = math.log(0.5)
    lp = torch.tensor([[0.0, h, h]])
    loss, m = whole_batch_loss(Divergence(estimator="full", measure=measure, beta=beta), b, PolicyView(logprobs=lp, logits=cur_logits))
    assert approx(loss, value / 2) and approx(m["divergence"], value / 2)


def test_divergence_is_weight_clip():
    # position 1: KL(S||T) with w = min(3, 2) = 2; position 2: KL(T||S) (swapped) with w = 0.5
    b = div_batch(teacher_logits=logits_for(T, S))
    h = math.log(0.5)
    lp = torch.tensor([[0.0, h + math.log(3.0), h + math.log(0.5)]])
    loss, _ = whole_batch_loss(Divergence(estimator="full"), b, PolicyView(logprobs=lp, logits=logits_for(S, T)))
    assert approx(loss, (2 * REV + 0.5 * FWD) / 2)


# top-k: student [.1, .4, .1, .3, .1] (top-2 = indices 1, 3), teacher [.2, .2, .05, .5, .05]
SK = [0.1, 0.4, 0.1, 0.3, 0.1]
TK = [0.2, 0.2, 0.05, 0.5, 0.05]


def test_add_tail_by_hand():
    out = add_tail(torch.tensor([0.4, 0.3]).log())
    assert torch.allclose(out.exp(), torch.tensor([0.4, 0.3, 0.3]))
    # the whole mass: log_s clamped to -1e-7 -> tail log(1 - e^-1e-7) ~ log(1e-7), finite
    full = add_tail(torch.tensor([0.5, 0.5]).log())
    assert torch.isfinite(full).all() and approx(full[2], math.log(1e-7), 1e-3)


@pytest.mark.parametrize("measure,value", [
    # restricted: S' = [.4, .3, tail .3], T' = [.2, .5, tail .3]
    ("reverse_kl", 0.4 * math.log(0.4 / 0.2) + 0.3 * math.log(0.3 / 0.5) + 0.3 * math.log(0.3 / 0.3)),  # 0.124011
    ("forward_kl", 0.2 * math.log(0.2 / 0.4) + 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.3)),  # 0.116783
    ("jsd", 0.5 * (0.2 * math.log(0.2 / 0.3) + 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(1.0))
     + 0.5 * (0.4 * math.log(0.4 / 0.3) + 0.3 * math.log(0.3 / 0.4) + 0.3 * math.log(1.0))),  # M = [.3, .4, .3]
])
def test_divergence_top_k_with_tail_by_hand(measure, value):
    b = div_batch(teacher_logits=logits_for(TK, TK))
    h = math.log(0.5)
    lp = torch.tensor([[0.0, h, h]])
    loss, _ = whole_batch_loss(Divergence(estimator="top_k", k=2, measure=measure), b, PolicyView(logprobs=lp, logits=logits_for(SK, TK)))
    assert approx(loss, value / 2)
    if measure == "reverse_kl":
        # the full-vocabulary reverse KL differs: it also counts .1 ln(.1/.05) twice and .1 ln(.1/.2)
        full_rev = 0.4 * L2 + 0.3 * math.log(0.6) + 0.1 * math.log(0.5) + 0.2 * L2  # 0.193325
        loss_full, _ = whole_batch_loss(Divergence(estimator="full"), b, PolicyView(logprobs=lp, logits=logits_for(SK, TK)))
        assert approx(loss_full, full_rev / 2) and not approx(value, full_rev, 1e-2)


@pytest.mark.parametrize("estimator", ["full", "top_k"])
@pytest.mark.parametrize("measure", ["reverse_kl", "forward_kl", "jsd"])
def test_teacher_logits_get_no_gradient(estimator, measure):
    t_logits = logits_for(T, TK).requires_grad_()
    s_logits = logits_for(S, SK).requires_grad_()
    b = div_batch(teacher_logits=t_logits)
    h = math.log(0.5)
    loss, _ = whole_batch_loss(Divergence(estimator=estimator, measure=measure, k=3), 
        b, PolicyView(logprobs=torch.tensor([[0.0, h, h]]), logits=s_logits))
    loss.backward()
    assert t_logits.grad is None
    assert s_logits.grad is not None and s_logits.grad.abs().sum() > 0


@pytest.mark.parametrize("estimator", ["sampled", "full", "top_k"])
def test_seq_weight_zero_rows_contribute_nothing(estimator):
    # SDPO: row 1 got no re-prompt (s = 0); its teacher is arbitrary. Loss = row 0 alone.
    h = math.log(0.5)
    origin = [[PR, POL, POL], [PR, POL, POL]]
    t_logits = torch.cat([logits_for(T, S), torch.tensor([[[0.0] * 5, [50.0, -50, 0, 0, 0], [9.0, 0, 0, 0, -9]]])])
    s_logits = torch.cat([logits_for(S, T), logits_for(S, T)]).requires_grad_()
    t_lp = torch.tensor([[0.0, math.log(0.25), math.log(0.125)], [0.0, -80.0, -30.0]])
    lp = torch.tensor([[0.0, h, h], [0.0, h, h]], requires_grad=True)
    b = make_batch(origin, [[0.0, h, h]] * 2, teacher_logits=t_logits, teacher_logprobs=t_lp,
                   seq_weight=torch.tensor([1.0, 0.0]))
    obj = Divergence(estimator=estimator, k=2)
    loss, m = whole_batch_loss(obj, b, PolicyView(logprobs=lp, logits=s_logits))
    if estimator == "full":
        assert approx(loss, (REV + FWD) / 2)
    elif estimator == "sampled":
        # A_t = -(ln .5 - ln .25) = -ln 2, -(ln .5 - ln .125) = -2 ln 2; ratio 1 -> loss (ln2 + 2ln2)/2
        assert approx(loss, 1.5 * L2)
    loss.backward()
    grads = [g for g in (s_logits.grad, lp.grad) if g is not None]
    assert grads and all((g[1] == 0).all() and (g[0] != 0).any() for g in grads)
    assert m["no_signal_frac"] == 0.5
    # a group where nobody has signal: zero loss, no NaN
    b.seq_weight = torch.zeros(2)
    loss0, m0 = whole_batch_loss(obj, b, PolicyView(logprobs=lp, logits=s_logits))
    assert float(loss0.detach()) == 0.0 and m0["no_signal_frac"] == 1.0


def test_sampled_reverse_kl_by_hand():
    # behaviour [ln .5, ln .25], teacher [ln .25, ln .5], current [ln .75, ln .25] -> ratios 1.5, 1; c = 2
    b = div_batch(teacher_logprobs=torch.tensor([[0.0, math.log(0.25), math.log(0.5)]]))
    b.behavior_logprobs = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]])
    lp = torch.tensor([[0.0, math.log(0.75), math.log(0.25)]], requires_grad=True)
    loss, m = whole_batch_loss(Divergence(kl_coef=2.0), b, PolicyView(logprobs=lp))
    # A_1 = -2 (ln .5 - ln .25) = -2 ln2; A_2 = -2 (ln .25 - ln .5) = 2 ln2
    # l = -rho A: [1.5 * 2 ln2, -2 ln2] -> token-mean (3 ln2 - 2 ln2) / 2 = 0.5 ln2
    assert approx(loss, 0.5 * L2)
    (g,) = torch.autograd.grad(loss, lp)  # d/dlogp (-rho A)/2 = -rho A / 2: [1.5 ln2, -ln2]
    assert torch.allclose(g, torch.tensor([[0.0, 1.5 * L2, -L2]]))
    # per-token estimate log pi_beh - log pi_T = [ln2, -ln2] -> mean 0
    assert approx(m["reverse_kl_to_teacher"], 0.0) and approx(m["divergence"], 0.0)
    with pytest.raises(ValueError, match="reverse KL only"):
        whole_batch_loss(Divergence(measure="jsd"), b, PolicyView(logprobs=lp))
    with pytest.raises(ValueError, match="logits"):
        whole_batch_loss(Divergence(estimator="full"), b, PolicyView(logprobs=lp))


def test_sampled_gradient_matches_exact_reverse_kl_gradient():
    """Monte Carlo: with pi_beh = pi_theta, E_y[grad l_sampled] = grad KL(pi_theta || pi_T)."""
    gen = torch.Generator().manual_seed(1234)
    theta = torch.tensor([0.5, -0.3, 1.0, 0.0, -1.2], dtype=torch.float64, requires_grad=True)
    log_t = torch.log(torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64))
    # exact gradient of sum_v p_v (log p_v - log q_v)
    logp_all = torch.log_softmax(theta, -1)
    (exact,) = torch.autograd.grad((logp_all.exp() * (logp_all - log_t)).sum(), theta)
    N = 40000
    logp_all = torch.log_softmax(theta, -1)
    y = torch.multinomial(logp_all.detach().exp(), N, replacement=True, generator=gen)  # [N]
    lp = torch.stack([torch.zeros(N, dtype=torch.float64), logp_all[y]], 1)  # [N, 2]: prompt, sampled token
    b = make_batch([[PR, POL]] * N, lp.detach(), teacher_logprobs=torch.stack([torch.zeros(N, dtype=torch.float64), log_t[y]], 1))
    loss, _ = whole_batch_loss(Divergence(), b, PolicyView(logprobs=lp))  # token-mean = average over the N samples
    (mc,) = torch.autograd.grad(loss, theta)
    assert exact.abs().max() > 0.1  # a non-trivial target
    assert torch.allclose(mc, exact, atol=0.01), (mc, exact)


# ------------------------------------------------------------------------------------------------
# Tokens outside loss_tokens get no gradient
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("obj", [
    Grpo(kl_coef=0.0), CrossEntropy(loss_tokens=["policy"]),
    AdvantageRegression(beta2=0.5), Divergence(), Divergence(estimator="full"), Divergence(estimator="top_k", k=2),
], ids=["grpo", "ce", "advreg", "sampled", "full", "top_k"])
def test_tokens_outside_loss_tokens_get_no_gradient(obj):
    torch.manual_seed(3)
    origin = [[PR, PR, GP, POL, GI, POL, PAD], [PR, POL, POL, DEM, POL, PAD, PAD]]
    B, T, V = 2, 7, 5
    loss_pos = torch.tensor(origin) == POL
    b = make_batch(origin, torch.randn(B, T) - 1, group=[0, 0], rewards=[1.0, 0.0],
                   teacher_logprobs=torch.randn(B, T) - 1, teacher_logits=torch.randn(B, T, V))
    lp = (torch.randn(B, T) - 1).requires_grad_()
    logits = torch.randn(B, T, V, requires_grad=True)
    loss, _ = whole_batch_loss(obj, b, PolicyView(logprobs=lp, logits=logits))
    loss.backward()
    for g in (lp.grad, None if logits.grad is None else logits.grad.abs().sum(-1)):
        if g is None:
            continue
        assert (g[~loss_pos] == 0).all()
    used = lp.grad if obj.kind != "divergence" or obj.estimator == "sampled" else logits.grad.abs().sum(-1)
    assert (used[loss_pos] != 0).any()
