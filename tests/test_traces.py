"""Traces the policy did not write inside a group (issue 46, LUFFY): the `traces` guide's rows, the mixed group's
advantages, grpo's `off_policy_weight` forms against numbers worked out by hand, and LUFFY's own loss on one batch.

Every expected value is explicit arithmetic here, never a second call of the implementation; the parity test
copies LUFFY's few lines (cited) and feeds both the same batch.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from components.objectives.base import whole_batch_loss
from components.objectives.grpo import Grpo
from composer.batch import PolicyView, TrajectoryBatch
from composer.origins import CODE

PAD, PR, POL, DEM = (CODE[n] for n in ("pad", "prompt", "policy", "demonstration"))
L2 = math.log(2.0)


def approx(x, y, tol=1e-6):
    x = x.detach() if isinstance(x, torch.Tensor) else x
    return abs(float(x) - float(y)) <= tol * max(1.0, abs(float(y)))


def luffy_batch(rewards, **kw) -> TrajectoryBatch:
    """One group of 4: row 0 a trace (2 demonstration tokens, no behaviour log-prob), rows 1-3 the policy's (2 tokens
    sampled at probability 0.5 each)."""
    lh = math.log(0.5)
    origin = torch.tensor([[PR, DEM, DEM]] + [[PR, POL, POL]] * 3, dtype=torch.uint8)
    return TrajectoryBatch(tokens=torch.zeros(4, 3, dtype=torch.long), origin=origin,
                           behavior_logprobs=torch.tensor([[0.0, 0.0, 0.0]] + [[0.0, lh, lh]] * 3),
                           behavior_known=torch.tensor([[True, False, False]] + [[True] * 3] * 3),
                           group=torch.zeros(4, dtype=torch.long), control=torch.tensor([False, True, True, True]),
                           rewards=torch.tensor(rewards), **kw)


def luffy_logp():
    """Current log-probs: the trace's tokens at 0.1 and 0.9, the policy's at their sampling 0.5 (ratio 1)."""
    lh = math.log(0.5)
    return torch.tensor([[0.0, math.log(0.1), math.log(0.9)]] + [[0.0, lh, lh]] * 3, requires_grad=True)


def luffy(**kw) -> Grpo:
    return Grpo(kl_coef=0.0, loss_tokens=["policy", "demonstration"], **kw)


# rewards [1 (the trace), 1, 0, 0]: mean 0.5, unbiased std sqrt(4 x 0.25 / 3) = sqrt(1/3)
A = 0.5 / (math.sqrt(1 / 3) + 1e-6)


def test_mixed_group_advantages_by_hand():
    """The trace's reward is in its group's statistics: A_i = (R_i - mean_j R_j) / (std_j R_j + eps) over all 4."""
    b = luffy_batch([1.0, 1.0, 0.0, 0.0])
    adv = luffy(off_policy_weight={"kind": "shaped"}).advantages(b)
    assert all(approx(x, y) for x, y in zip(adv.tolist(), [A, A, -A, -A]))
    # over the rollouts alone (the trace left out) the numbers differ: mean 1/3, std sqrt(1/3) -> +1.1547 / -0.5774
    on_only = [(r - 1 / 3) / (math.sqrt(1 / 3) + 1e-6) for r in (1.0, 0.0, 0.0)]
    assert not approx(adv[1], on_only[0])
    # control_mean takes its baseline from control rows: the trace is not one, so it is the rollouts' mean 1/3
    ctl = luffy(off_policy_weight={"kind": "shaped"}, estimator={"kind": "control_mean"}).advantages(b)
    assert all(approx(x, y) for x, y in zip(ctl.tolist(), [2 / 3, 2 / 3, -1 / 3, -1 / 3]))


def test_shaped_surrogate_value_and_gradient_by_hand():
    """LUFFY's shaping on the trace, f(pi) = pi / (pi + 0.1): f(0.1) = 0.5, f(0.9) = 0.9; df/dlog pi = 0.1 pi /
    (pi + 0.1)^2 = 0.25 at 0.1 and 0.09 at 0.9. Token-mean over the group's 8 tokens of
    trace -A (0.5 + 0.9), row 1 -2A, rows 2-3 +2A each (ratio 1): (-1.4 - 2 + 4) A / 8 = 0.075 A."""
    b, lp = luffy_batch([1.0, 1.0, 0.0, 0.0]), luffy_logp()
    loss, m = whole_batch_loss(luffy(off_policy_weight={"kind": "shaped", "gamma": 0.1}), b, PolicyView(logprobs=lp))
    assert approx(loss, 0.075 * A)
    (g,) = torch.autograd.grad(loss, lp)
    want = [[0.0, -A * 0.25 / 8, -A * 0.09 / 8], [0.0, -A / 8, -A / 8], [0.0, A / 8, A / 8], [0.0, A / 8, A / 8]]
    assert torch.allclose(g, torch.tensor(want), atol=1e-7)
    assert approx(m["off_policy_weight_mean"], (0.5 + 0.9) / 2) and approx(m["off_policy_prob_mean"], 0.5)
    assert approx(m["off_policy_token_frac"], 2 / 8) and approx(m["ratio_mean"], 1.0)  # ratio over policy tokens only
    # the shaping is LUFFY's only on trace tokens: gamma 0.5 changes the trace's terms only (f = 1/6, 9/14)
    loss5, _ = whole_batch_loss(luffy(off_policy_weight={"kind": "shaped", "gamma": 0.5}), b,
                                PolicyView(logprobs=luffy_logp()))
    assert approx(loss5, (-A * (1 / 6 + 9 / 14) - 2 * A + 4 * A) / 8)


def test_trace_tokens_are_not_clipped():
    """A trace with a negative advantage and f = pi (the ratio pi / 1): rewards [0, 1, 1, 1] give mean 0.75, std 0.5,
    A = -1.5 on the trace and +0.5 on the rollouts. Unclipped the trace's terms are 1.5 (0.1 + 0.9) = 1.5; PPO's
    clip to [0.8, 1.2] would make them 1.2 + 1.35 and leave the 0.1 token no gradient."""
    b, lp = luffy_batch([0.0, 1.0, 1.0, 1.0]), luffy_logp()
    a_t, a_p = -0.75 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6)
    loss, _ = whole_batch_loss(luffy(off_policy_weight={"kind": "prob"}), b, PolicyView(logprobs=lp))
    assert approx(loss, (-a_t * (0.1 + 0.9) - 6 * a_p) / 8)
    (g,) = torch.autograd.grad(loss, lp)
    assert approx(g[0, 1], -a_t * 0.1 / 8) and approx(g[0, 2], -a_t * 0.9 / 8)


@pytest.mark.parametrize("form,values,grads", [
    ({"kind": "log"}, (math.log(0.1), math.log(0.9)), (1.0, 1.0)),  # -A log pi: the gradient -A
    ({"kind": "pow", "alpha": 0.5}, (math.sqrt(0.1), math.sqrt(0.9)), (0.5 * math.sqrt(0.1), 0.5 * math.sqrt(0.9))),
])
def test_log_and_pow_forms_by_hand(form, values, grads):
    b, lp = luffy_batch([1.0, 1.0, 0.0, 0.0]), luffy_logp()
    loss, _ = whole_batch_loss(luffy(off_policy_weight=form), b, PolicyView(logprobs=lp))
    assert approx(loss, (-A * sum(values) - 2 * A + 4 * A) / 8)
    (g,) = torch.autograd.grad(loss, lp)
    assert approx(g[0, 1], -A * grads[0] / 8) and approx(g[0, 2], -A * grads[1] / 8)


def test_kl_is_estimated_on_policy_tokens_only():
    """k3 at delta = ln 0.5 - ln 0.25 = ln 2 on the 6 policy tokens: e^-ln2 + ln 2 - 1 each; the trace's 2 tokens
    (not samples of the policy) add nothing but count in the token-mean's 8."""
    init = torch.full((4, 3), math.log(0.25))
    b = luffy_batch([1.0, 1.0, 0.0, 0.0], initial_logprobs=init)
    k3 = 0.5 + L2 - 1
    loss, m = whole_batch_loss(Grpo(kl_coef=0.1, loss_tokens=["policy", "demonstration"],
                                    off_policy_weight={"kind": "shaped"}), b, PolicyView(logprobs=luffy_logp()))
    assert approx(m["kl"], 6 * k3 / 8) and approx(loss, 0.075 * A + 0.1 * 6 * k3 / 8)


def test_behaviour_log_probs_are_not_read_on_trace_tokens():
    """The weighted origins need no behaviour log-prob: the rollout weights never score them, and a garbage value
    there changes nothing."""
    obj = luffy(off_policy_weight={"kind": "shaped"})
    assert obj.weighted_origins() == {"demonstration"} and obj.behavior_origins() == {"policy"}
    assert luffy().weighted_origins() == set()  # no form: nothing weighted (validation refuses such loss tokens)
    b = luffy_batch([1.0, 1.0, 0.0, 0.0])
    b2 = luffy_batch([1.0, 1.0, 0.0, 0.0])
    b2.behavior_logprobs[0, 1:] = torch.tensor([-30.0, 5.0])
    l1, _ = whole_batch_loss(obj, b, PolicyView(logprobs=luffy_logp()))
    l2, _ = whole_batch_loss(obj, b2, PolicyView(logprobs=luffy_logp()))
    assert float(l1.detach()) == float(l2.detach())


# -------------------------------------------------------------------------------- LUFFY's own code on one batch
# Copied from github.com/ElliottYan/LUFFY (commit 01f4ae0): verl.utils.torch_functional.masked_mean,
# verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage (LUFFY's exp_scripts/train.sh runs
# algorithm.adv_estimator=grpo: the mixed group) and verl.mix_src.mix_core_alg.compute_token_on_off_policy_loss
# (the branches its script runs: on_policy_reshape no_reshape, off_policy_reshape p_div_p_0.1, no off_max_clip /
# off_min_clip / all_max_clip, no target_probs), trimmed of its logging.

def verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def luffy_grpo_outcome_advantage(token_level_rewards, eos_mask, index, epsilon=1e-6, use_std=True):
    response_length = token_level_rewards.shape[-1]
    non_zero_mask = (token_level_rewards != 0)
    scores = (token_level_rewards * non_zero_mask).sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                id2mean[idx] = torch.mean(torch.tensor(id2score[idx]))
                id2std[idx] = torch.std(torch.tensor([id2score[idx]]))
        for i in range(bsz):
            if use_std:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = (scores[i] - id2mean[index[i]])
        scores = scores.unsqueeze(-1).tile([1, response_length]) * eos_mask
    return scores, scores


def luffy_token_on_off_policy_loss(old_log_prob, log_prob, advantages, eos_mask, cliprange, clip_upper_bound,
                                   prefix_mask, loss_remove_token_mean=False, loss_remove_clip=False):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)  # on_policy_reshape == "no_reshape"
    on_pg_losses = -advantages * ratio
    upper_bound = max(clip_upper_bound, 1.0 + cliprange)
    if loss_remove_clip is False:
        on_pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, upper_bound)
        on_pg_losses = torch.max(on_pg_losses, on_pg_losses2)
    off_ratio = torch.exp(log_prob)
    off_ratio = off_ratio / (off_ratio + 0.1)  # off_policy_reshape == "p_div_p_0.1"
    off_pg_losses = -advantages * off_ratio
    prefix_mask = prefix_mask.float()
    pg_losses = off_pg_losses * prefix_mask + on_pg_losses * (1 - prefix_mask)
    if loss_remove_token_mean is True:
        pg_loss = (pg_losses * eos_mask).sum() / eos_mask.shape[-1]
    else:
        pg_loss = verl_masked_mean(pg_losses, eos_mask)
    return pg_loss


def parity_batch(seed=0, B=8, P=2, L=6):
    """Two prompts x 4 rows, row 0 of each a trace (every response token off-policy, LUFFY's prefix ratio 1.0);
    responses of varying length; current log-probs off the old ones (ratios outside the clip)."""
    g = torch.Generator().manual_seed(seed)
    lens = [L, L - 2, L - 1, 3, L - 3, L, 2, L - 1]
    origin = torch.full((B, P + L), PAD, dtype=torch.uint8)
    origin[:, :P] = PR
    for i, n in enumerate(lens):
        origin[i, P:P + n] = DEM if i % 4 == 0 else POL
    old = -torch.rand(B, P + L, generator=g, dtype=torch.float64) * 2 - 0.05
    cur = (old + torch.randn(B, P + L, generator=g, dtype=torch.float64) * 0.4).clamp(max=-1e-3)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    b = TrajectoryBatch(tokens=torch.zeros(B, P + L, dtype=torch.long), origin=origin,
                        behavior_logprobs=torch.where(origin == POL, old, torch.zeros_like(old)),
                        group=torch.tensor([0] * 4 + [1] * 4), control=torch.tensor([i % 4 != 0 for i in range(B)]),
                        rewards=rewards)
    return b, cur, old, P


@pytest.mark.parametrize("script", [False, True], ids=["paper", "released-script"])
def test_parity_with_luffy_code(script):
    """The paper's form (std, clip 0.2, token-mean) and the released script's (grpo_use_std False,
    loss_remove_token_mean: token sums over the response length, loss_remove_clip), against LUFFY's functions on the
    same batch: advantages, loss and gradient equal (float64). The script's no-clip is the composer's clip opened
    wide (clip_low 1, clip_high 1e9); its token sums divide by the micro-batch's response length, which is
    seq-mean-token-sum-norm with norm_const L on a step of one micro-batch (LUFFY divides again by its gradient
    accumulation steps, the composer's normaliser is the step's)."""
    b, cur, old, P = parity_batch()
    resp = b.response_mask[:, P:].double()  # [B, L]: LUFFY's eos_mask
    prefix = (b.origin[:, P:] == DEM)  # [B, L]: LUFFY's prefix_mask
    L = resp.shape[1]
    token_rewards = torch.zeros(resp.shape, dtype=torch.float64)
    last = resp.sum(-1).long() - 1
    token_rewards[torch.arange(b.size), last] = b.rewards
    want_adv, _ = luffy_grpo_outcome_advantage(token_rewards, resp, [0] * 4 + [1] * 4, use_std=not script)
    lp_theirs = cur[:, P:].clone().requires_grad_(True)
    want = luffy_token_on_off_policy_loss(old[:, P:], lp_theirs, want_adv, resp, 0.2, 1.0, prefix,
                                          loss_remove_token_mean=script, loss_remove_clip=script)
    (want_g,) = torch.autograd.grad(want, lp_theirs)

    extra = dict(estimator={"kind": "group_mean", "std": "none"}, loss_agg="seq-mean-token-sum-norm", norm_const=L,
                 clip_low=1.0, clip_high=1e9) if script else {}
    obj = luffy(off_policy_weight={"kind": "shaped", "gamma": 0.1}, **extra)
    adv = obj.advantages(b)
    assert torch.allclose(adv[:, None] * resp, want_adv, atol=1e-12)
    lp = cur.clone().requires_grad_(True)
    got, _ = obj.loss(b, PolicyView(logprobs=lp), adv)
    (got_g,) = torch.autograd.grad(got, lp)
    got, want = float(got.detach()), float(want.detach())
    assert abs(got - want) < 1e-12, (got, want)
    assert torch.allclose(got_g[:, P:], want_g, atol=1e-12) and float(got_g[:, :P].abs().max()) == 0.0
    clipped = ((cur - old).exp() - 1).abs() > 0.2
    assert bool((clipped & (b.origin == POL)).any())  # the clip binds somewhere: the paper's form is tested with it


# -------------------------------------------------------------------------------- the guide's rows

def _ctx(source_kind: str, max_new: int = 5):
    text = {"Q1": "ab\n#c"}
    src = types.SimpleNamespace(example_text=lambda ex: text.get(ex.prompt))
    spec = types.SimpleNamespace(sources={"ref": types.SimpleNamespace(kind_name=lambda: source_kind, weights="current")})
    return types.SimpleNamespace(spec=spec, max_new_tokens=max_new, eos_id=0, source=lambda name: src,
                                 prompt_ids=lambda ex: [ord(c) for c in ex.prompt],
                                 encode=lambda s: [ord(c) for c in s])


def _serve(key, requests):
    """Every Sample answered with tokens [7, 8] (a teacher: [5, 6]); the requests are kept for the test."""
    _serve.seen.append((key, requests))
    toks = [5, 6] if key[1] != "policy" else [7, 8]
    from composer.protocol import Generation

    return [[Generation(list(toks), True, [-0.5, -0.5]) for _ in range(r.n)] for r in requests]


@pytest.mark.parametrize("kind", ["reference_solution", "policy_model"])
def test_guide_rows_a_trace_then_rollouts(kind):
    """Row 0 of 3 is the trace (the reference + EOS cut at max_new_tokens, or the teacher's generation), not a control
    row, demonstration tokens with no log-prob; rows 1-2 are the policy's own rollouts; one group (no tag)."""
    from components.guides.traces import TracesGuide
    from composer.data import Example
    from composer.protocol import drive

    g = TracesGuide(source="ref", per_group=1)
    ctx, ex = _ctx(kind), Example(prompt="Q1", answer="c")
    _serve.seen = []
    rows = drive([g.row(ctx, ex, i, 3) for i in range(3)], _serve)
    trace = rows[0]
    want = [ord(c) for c in "ab\n#c"][:5] if kind == "reference_solution" else [5, 6]
    assert [p.origin for p in trace.pieces] == ["demonstration"] and trace.response == want
    assert trace.pieces[0].logprobs is None and not trace.control and trace.guided and trace.tag == ""
    assert trace.notes["trace_cut"] == (kind == "reference_solution")  # 'ab\n#c' + EOS is 6 tokens, the room 5
    for r in rows[1:]:
        assert [p.origin for p in r.pieces] == ["policy"] and r.response == [7, 8] and r.control and r.tag == ""
    models = sorted(k[1] for k, _ in _serve.seen)
    assert models == (["policy"] if kind == "reference_solution" else ["policy", "ref"])
    if kind == "policy_model":  # the teacher writes from the policy's prompt, counted as teacher tokens
        key, reqs = next((k, r) for k, r in _serve.seen if k[1] == "ref")
        assert key[3] == "teacher" and reqs[0].tokens == [ord("Q"), ord("1")]
    m = g.metrics(rows)
    assert approx(m["trace_frac"], 1 / 3) and m["trace_missing"] == 0.0


def test_a_problem_without_a_reference_text_gets_a_rollout():
    from components.guides.traces import TracesGuide
    from composer.data import Example
    from composer.protocol import drive

    _serve.seen = []
    [row] = drive([TracesGuide(source="ref").row(_ctx("reference_solution"), Example(prompt="Q2", answer="c"), 0, 4)],
                  _serve)
    assert [p.origin for p in row.pieces] == ["policy"] and row.notes["trace_missing"]
