"""Issue 46 (b): TOPR's trajectory ratio with its truncation, GMPO's per-token log-space clip inside the
geometric-mean ratio, GPG's plain policy gradient with alpha = B / B_valid. Every expected number is worked out
here from the paper's formula in plain Python floats, never by the project's helpers."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from components.objectives.estimators import GroupMean
from components.objectives.grpo import Grpo
from composer.batch import PolicyView, TrajectoryBatch
from composer.errors import SpecError
from composer.origins import CODE
from composer.checks.validate import validate_file

# row 0: 4 policy tokens (positions 1-4); row 1: 3 (position 4 is padding)
OLD = torch.tensor([[0.0, -1.0, -1.2, -0.4, -2.0], [0.0, -0.5, -0.9, -1.5, 0.0]])
CUR = torch.tensor([[0.0, -0.5, -1.5, -0.3, -1.0], [0.0, -1.5, -0.8, -1.6, 0.0]])
ADV = torch.tensor([1.0, -2.0])
C0, C1 = [-0.5, -1.5, -0.3, -1.0], [-1.5, -0.8, -1.6]  # current log-probs of the loss tokens
D0 = [0.5, -0.3, 0.1, 1.0]  # log rho_t of row 0
D1 = [-1.0, 0.1, -0.1]  # log rho_t of row 1


def _batch(rewards=None, group=(0, 0)):
    origin = torch.full((2, 5), CODE["policy"], dtype=torch.uint8)
    origin[:, 0] = CODE["prompt"]
    origin[1, -1] = CODE["pad"]
    return TrajectoryBatch(tokens=torch.zeros(2, 5, dtype=torch.long), origin=origin, behavior_logprobs=OLD,
                           group=torch.tensor(group), control=torch.ones(2, dtype=torch.bool), rewards=rewards)


def _loss(obj, cur=CUR):
    cur = cur.clone().requires_grad_(True)
    loss, m = obj.loss(_batch(), PolicyView(cur), ADV)
    loss.backward()
    return float(loss.detach()), cur.grad, m


def test_topr_trajectory_ratio_truncated_on_negative_trajectories_only():
    w1 = min(max(math.exp(sum(D1)), 0.0), 1.0)  # pi(tau)/mu(tau) of row 1 (A < 0) = e^-1.0, inside [0, 1]
    row0 = -1.0 * sum(C0)  # A >= 0: weight 1 (SFT-like)
    row1 = -w1 * -2.0 * sum(C1)
    obj = Grpo(ratio="trajectory", bound="topr", loss_agg="seq-mean-token-sum", kl_coef=0.0)
    loss, grad, m = _loss(obj)
    assert loss == pytest.approx((row0 + row1) / 2, rel=1e-6)
    # the weight carries no gradient: d/d log pi_t = -w A / 2 on every loss token
    assert torch.allclose(grad[0, 1:], torch.full((4,), -0.5), atol=1e-6)
    assert torch.allclose(grad[1, 1:4], torch.full((3,), w1), atol=1e-6) and grad[1, 4] == 0
    assert grad[:, 0].abs().max() == 0
    # a negative trajectory more likely now than under mu: weight clipped at 1
    cur = CUR.clone()
    cur[1, 1] = -0.3  # log rho = 0.2 + 0.1 - 0.1 = 0.2 > 0
    loss, grad, _ = _loss(obj, cur)
    assert torch.allclose(grad[1, 1:4], torch.full((3,), 1.0), atol=1e-6)
    assert m["ratio_mean"] > 0


def test_cispo_bound_on_the_trajectory_ratio_is_the_symmetric_truncation():
    w = [min(max(math.exp(sum(d)), 0.5), 1.5) for d in (D0, D1)]  # e^1.3 -> 1.5, e^-1.0 -> 0.5
    obj = Grpo(ratio="trajectory", bound="cispo", clip_low=0.5, clip_high=0.5, loss_agg="token-mean", kl_coef=0.0)
    loss, grad, _ = _loss(obj)
    want = (-w[0] * 1.0 * sum(C0) - w[1] * -2.0 * sum(C1)) / 7
    assert loss == pytest.approx(want, rel=1e-6)


def test_gmpo_clips_each_token_log_ratio_before_the_geometric_mean():
    eps = 0.4
    k0 = [min(d, max(min(d, eps), -eps)) for d in D0]  # A > 0: capped above at eps -> [0.4, -0.3, 0.1, 0.4]
    k1 = [max(d, max(min(d, eps), -eps)) for d in D1]  # A < 0: floored at -eps -> [-0.4, 0.1, -0.1]
    s0, s1 = math.exp(sum(k0) / 4), math.exp(sum(k1) / 3)
    obj = Grpo(ratio="sequence", bound="log_clip", clip_low=eps, clip_high=eps, loss_agg="seq-mean-token-mean",
               kl_coef=0.0)
    loss, grad, m = _loss(obj)
    assert loss == pytest.approx((-1.0 * s0 + 2.0 * s1) / 2, rel=1e-6)
    # the gradient reaches only the tokens the clip left alone: d(-A s)/d l_t = -A s / |o|, halved by the mean
    want0 = [0.0, -s0 / 4 / 2, -s0 / 4 / 2, 0.0]
    want1 = [0.0, 2.0 * s1 / 3 / 2, 2.0 * s1 / 3 / 2]
    assert torch.allclose(grad[0, 1:], torch.tensor(want0), atol=1e-6)
    assert torch.allclose(grad[1, 1:4], torch.tensor(want1), atol=1e-6)
    assert m["clip_frac"] == pytest.approx(3 / 7)
    # not GSPO: clipping the sequence ratio exp(mean log rho) instead gives another number
    gs0 = math.exp(sum(D0) / 4)
    assert abs(s0 - min(gs0, math.exp(eps))) > 1e-3


def test_gpg_plain_policy_gradient_and_valid_rows_scale():
    # three groups of two, the middle one all equal: B = 6, B_valid = 4, alpha = 1.5
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    base = [0.5, -0.5, 0.0, 0.0, -0.25, 0.25]
    obj = Grpo(estimator=GroupMean(std="none"), bound="none", valid_rows_scale=True, loss_agg="token-mean",
               kl_coef=0.0)
    b = TrajectoryBatch(tokens=torch.zeros(6, 2, dtype=torch.long), origin=torch.ones(6, 2, dtype=torch.uint8),
                        behavior_logprobs=torch.zeros(6, 2), group=g, control=torch.ones(6, dtype=torch.bool),
                        rewards=r)
    assert torch.allclose(obj.advantages(b), torch.tensor([1.5 * a for a in base]), atol=1e-6)
    no_scale = Grpo(estimator=GroupMean(std="none"), bound="none", kl_coef=0.0)
    assert torch.allclose(no_scale.advantages(b), torch.tensor(base), atol=1e-6)
    # the loss: -(1 / sum |o|) sum_i A_i sum_t log pi, no ratio (the old log-probs are not read)
    loss, grad, m = _loss(obj)
    assert loss == pytest.approx(-(1.0 * sum(C0) - 2.0 * sum(C1)) / 7, rel=1e-6)
    assert torch.allclose(grad[0, 1:], torch.full((4,), -1.0 / 7), atol=1e-6)
    assert torch.allclose(grad[1, 1:4], torch.full((3,), 2.0 / 7), atol=1e-6)
    assert m["clip_frac"] == 0 and m["ratio_mean"] == 1


@pytest.mark.parametrize("objective,message", [
    ("{kind: grpo, bound: log_clip, clip: 0.4}", "set ratio: sequence"),
    ("{kind: grpo, bound: none, ratio: sequence}", "would not be used"),
])
def test_rules_refuse_unused_or_missing_ratio(tmp_path, objective, message):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(f"""\
        name: x
        sources: {{verifier: {{kind: outcome_reward}}}}
        signal: {{kind: reward, source: verifier}}
        objective: {objective}
        """))
    with pytest.raises(SpecError) as e:
        validate_file(p)
    assert message in str(e.value)
