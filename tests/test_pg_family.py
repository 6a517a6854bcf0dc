"""The policy-gradient family's parts (issue 23): estimators, ratio levels and bounds, schedules, phases that
patch one term, validation rules. Every expected number is worked out here from the formula, not by the
project's helpers."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from components.objectives.estimators import (ControlMean, GroupMean, LeaveOneOut, ReinforcePPBaseline,
                                              SoftValue)
from components.objectives.grpo import Grpo
from composer.batch import PolicyView, TrajectoryBatch
from composer.errors import SpecError
from composer.origins import CODE
from composer.lang.curves import Schedule, resolve, value_at
from composer.checks.validate import validate_file

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0])  # two groups of 4, not all equal
G = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def _std(xs):  # unbiased
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ---------------------------------------------------------------------------------------------- estimators

def test_group_mean_std_group_batch_none():
    g0, g1 = [1, 0, 0, 1], [1, 0, 0.5, 0]
    m0, m1 = 0.5, 0.375
    s0, s1 = _std(g0), _std(g1)
    sb = _std(g0 + g1)
    want_group = [(r - m0) / (s0 + 1e-6) for r in g0] + [(r - m1) / (s1 + 1e-6) for r in g1]
    want_batch = [(r - m0) / (sb + 1e-6) for r in g0] + [(r - m1) / (sb + 1e-6) for r in g1]
    want_none = [r - m0 for r in g0] + [r - m1 for r in g1]
    for std, want in (("group", want_group), ("batch", want_batch), ("none", want_none)):
        got = GroupMean(std=std).estimate(R, G)
        assert torch.allclose(got, torch.tensor(want), atol=1e-6), std


def test_leave_one_out():
    g0, g1 = [1, 0, 0, 1], [1, 0, 0.5, 0]
    want = [r - (sum(g) - r) / 3 for g in (g0, g1) for r in g]
    assert torch.allclose(LeaveOneOut().estimate(R, G), torch.tensor(want), atol=1e-6)
    # a group whose rewards are all equal, and a group of one, get 0
    assert LeaveOneOut().estimate(torch.tensor([1.0, 1.0, 0.3]), torch.tensor([0, 0, 1])).abs().max() == 0


def test_reinforce_pp_baseline():
    g0, g1 = [1, 0, 0, 1], [1, 0, 0.5, 0]
    c = [r - 0.5 for r in g0] + [r - 0.375 for r in g1]
    m, s = sum(c) / 8, _std(c)
    want = [(x - m) / (s + 1e-6) for x in c]
    assert torch.allclose(ReinforcePPBaseline().estimate(R, G), torch.tensor(want), atol=1e-6)


def test_soft_value_and_control_mean():
    beta = 0.5
    g0, g1 = [1, 0, 0, 1], [1, 0, 0.5, 0]
    v = [beta * math.log(sum(math.exp(r / beta) for r in g) / 4) for g in (g0, g1)]
    want = [r - v[0] for r in g0] + [r - v[1] for r in g1]
    assert torch.allclose(SoftValue(beta1=beta).estimate(R, G), torch.tensor(want), atol=1e-6)
    control = torch.tensor([True, True, False, False, False, True, True, False])
    cm = [(1 + 0) / 2, (0 + 0.5) / 2]
    want = [r - cm[0] for r in g0] + [r - cm[1] for r in g1]
    assert torch.allclose(ControlMean().estimate(R, G, control), torch.tensor(want), atol=1e-6)


def test_grpo_default_estimator_is_unchanged():
    """Today's grpo (std_norm true / false) gives the same advantages through the estimator."""
    b = TrajectoryBatch(tokens=torch.zeros(8, 2, dtype=torch.long), origin=torch.ones(8, 2, dtype=torch.uint8),
                        behavior_logprobs=torch.zeros(8, 2), group=G, control=torch.ones(8, dtype=torch.bool), rewards=R)
    g0, g1 = [1, 0, 0, 1], [1, 0, 0.5, 0]
    want = [(r - 0.5) / (_std(g0) + 1e-6) for r in g0] + [(r - 0.375) / (_std(g1) + 1e-6) for r in g1]
    assert torch.allclose(Grpo().advantages(b), torch.tensor(want), atol=1e-6)
    assert torch.allclose(Grpo(std_norm=False).advantages(b), torch.tensor([r - 0.5 for r in g0] + [r - 0.375 for r in g1]))


def _ddp_worker(rank, world, path, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    rows = slice(0, 4) if rank == 0 else slice(4, 8)  # each rank holds one whole group
    for name, est in (("rpp", ReinforcePPBaseline()), ("batch", GroupMean(std="batch"))):
        out[f"{name}{rank}"] = est.estimate(R[rows], G[rows]).tolist()
    dist.destroy_process_group()


def test_global_batch_statistics_are_exact_under_ddp(tmp_path):
    """REINFORCE++-baseline and std-by-batch over two ranks (gloo, one group each) equal one process over both."""
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    for name, est in (("rpp", ReinforcePPBaseline()), ("batch", GroupMean(std="batch"))):
        whole = est.estimate(R, G)
        assert torch.allclose(torch.tensor(out[f"{name}0"] + out[f"{name}1"]), whole, atol=1e-6), name


# ------------------------------------------------------------------------------------ ratio and bounds

def _batch(old, cur_len=4):
    B = old.shape[0]
    origin = torch.full((B, cur_len + 1), CODE["policy"], dtype=torch.uint8)
    origin[:, 0] = CODE["prompt"]
    origin[1, -1] = CODE["pad"]  # row 1 is one token shorter
    return TrajectoryBatch(tokens=torch.zeros(B, cur_len + 1, dtype=torch.long), origin=origin,
                           behavior_logprobs=old, group=torch.tensor([0, 0]), control=torch.ones(B, dtype=torch.bool))


OLD = torch.tensor([[0.0, -1.0, -1.2, -0.4, -2.0], [0.0, -0.5, -0.9, -1.5, 0.0]])
CUR = torch.tensor([[0.0, -0.6, -1.5, -0.3, -1.0], [0.0, -0.9, -0.8, -1.2, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def _loss(obj, cur=CUR):
    cur = cur.clone().requires_grad_(True)
    loss, m = obj.loss(_batch(OLD), PolicyView(cur), ADV)
    loss.backward()
    return float(loss.detach()), cur.grad, m


def test_gspo_sequence_ratio_by_hand():
    lo, hi = 3e-4, 4e-4
    d0 = [(-0.6 + 1.0), (-1.5 + 1.2), (-0.3 + 0.4), (-1.0 + 2.0)]
    d1 = [(-0.9 + 0.5), (-0.8 + 0.9), (-1.2 + 1.5)]
    s = [math.exp(sum(d0) / 4), math.exp(sum(d1) / 3)]
    per = [-min(si * a, min(max(si, 1 - lo), 1 + hi) * a) for si, a in zip(s, [1.0, -2.0])]
    want = sum(per) / 2  # seq-mean-token-mean of a per-row constant
    got, grad, m = _loss(Grpo(ratio="sequence", clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-mean", kl_coef=0.0))
    assert got == pytest.approx(want, abs=1e-6)
    assert s[0] > 1 + hi and abs(s[1] - 1) < 1e-9  # row 0 leaves the range (A > 0), row 1 stays in it
    assert m["clip_frac"] == pytest.approx(4 / 7)  # row 0's 4 tokens out of 7
    assert grad[0].abs().sum() == 0 and grad[1, 1:4].abs().min() > 0  # the clipped row gets no gradient


def test_gspo_token_has_sequence_value_and_token_gradients():
    """GSPO-token: same value as GSPO; with one token per row moved its gradient goes to that token only."""
    obj_seq = Grpo(ratio="sequence", clip=10.0, loss_agg="seq-mean-token-mean", kl_coef=0.0)
    obj_tok = Grpo(ratio="sequence-token", clip=10.0, loss_agg="seq-mean-token-mean", kl_coef=0.0)
    v_seq, g_seq, _ = _loss(obj_seq)
    v_tok, g_tok, _ = _loss(obj_tok)
    assert v_seq == pytest.approx(v_tok, abs=1e-6)
    d0 = sum([0.4, -0.3, 0.1, 1.0]) / 4
    s0 = math.exp(d0)
    # GSPO: d/dlogp_t of -(s0 A)/1 row-mean over 2 rows = -(A s0 / |y|) / 2 for every token of row 0
    assert g_seq[0, 1:].tolist() == pytest.approx([-(1.0 * s0 / 4) / 2] * 4, abs=1e-6)
    # GSPO-token: -(1/2)(1/|y|) sum_t s0 A grad log pi_t -> the same per-token value here (one sequence value)
    assert g_tok[0, 1:].tolist() == pytest.approx([-(s0 * 1.0) / 4 / 2] * 4, abs=1e-6)


def test_mask_and_dual_clip_and_cispo_by_hand():
    r = (CUR - OLD).exp()
    keep = [(0, t) for t in range(1, 5)] + [(1, t) for t in range(1, 4)]
    # mask: tokens whose ratio leaves [0.8, 1.2] have no loss and no gradient; token-mean over all 7 tokens
    want = sum(-(float(r[i, t]) * float(ADV[i])) for i, t in keep if 0.8 <= float(r[i, t]) <= 1.2) / 7
    got, grad, m = _loss(Grpo(bound="mask", kl_coef=0.0))
    assert got == pytest.approx(want, abs=1e-6)
    outside = [(i, t) for i, t in keep if not 0.8 <= float(r[i, t]) <= 1.2]
    assert outside and all(float(grad[i, t]) == 0 for i, t in outside)
    # dual clip c = 1.3: row 1 (A = -2) loss per token at most -c A = 2.6
    c = 1.3

    def dual(i, t):
        a = float(ADV[i])
        s = min(float(r[i, t]) * a, min(max(float(r[i, t]), 0.8), 1.2) * a)
        return -(max(s, c * a) if a < 0 else s)
    got, _, _ = _loss(Grpo(dual_clip=c, kl_coef=0.0))
    assert got == pytest.approx(sum(dual(i, t) for i, t in keep) / 7, abs=1e-6)
    assert got != pytest.approx(_loss(Grpo(kl_coef=0.0))[0], abs=1e-6)  # the dual clip acted
    # CISPO: -sg(clip(r, 1 - 1, 1 + 0.1)) A log pi, token mean; gradient -w A on every token
    w = r.clamp(0.0, 1.1)
    want = sum(-float(w[i, t]) * float(ADV[i]) * float(CUR[i, t]) for i, t in keep) / 7
    got, grad, _ = _loss(Grpo(bound="cispo", clip_low=1.0, clip_high=0.1, kl_coef=0.0))
    assert got == pytest.approx(want, abs=1e-6)
    assert all(float(grad[i, t]) == pytest.approx(-float(w[i, t]) * float(ADV[i]) / 7, abs=1e-6) for i, t in keep)


def test_old_logprobs_are_the_ratio_denominator_when_set():
    b = _batch(OLD)
    b.old_logprobs = CUR.clone()  # the policy now: ratio 1 everywhere
    loss, m = Grpo(kl_coef=0.0).loss(b, PolicyView(CUR.clone()), ADV)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    assert float(loss) == pytest.approx(-(4 * 1.0 + 3 * -2.0) / 7, abs=1e-6)


# -------------------------------------------------------------------------------------------- schedules

def test_schedules_by_hand():
    lin = Schedule(kind="linear", start=1.0, end=0.0, steps=10, begin=2)
    assert [lin.at(s) for s in (0, 2, 7, 12, 50)] == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])
    cos = Schedule(kind="cosine", start=1.0, end=0.0, steps=4)
    assert [cos.at(s) for s in (0, 1, 2, 4)] == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, 0.0])
    st = Schedule(kind="step", start=5.0, end=1.0, steps=3)
    assert [st.at(s) for s in (0, 2, 3, 9)] == [5.0, 5.0, 1.0, 1.0]
    assert value_at(0.3, 99) == 0.3
    g = Grpo(kl_coef={"kind": "linear", "start": 0.1, "end": 0.0, "steps": 10})
    assert resolve(g, 5).kl_coef == pytest.approx(0.05)
    plain = Grpo()
    assert resolve(plain, 5) is plain  # no schedule: the very same object


def _write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


BASE = """\
name: t
sources:
  verifier: {kind: outcome_reward}
  teacher: {kind: policy_model, model: "toy:teacher"}
terms:
  - {name: rl, signal: {kind: reward, source: verifier}, objective: {kind: grpo, kl_coef: 0.0}}
  - {name: kd, signal: {kind: distillation, teacher: teacher}, objective: {kind: divergence, estimator: sampled}, weight: 0.5}
train: {steps: 10}
"""


def test_a_phase_patches_one_term_by_name(tmp_path):
    v = validate_file(_write(tmp_path, BASE + "phases:\n  - {until: 5}\n  - {until: 10, terms: [{name: kd, weight: 0.1}]}\n"))
    late = v.segments[1].spec
    assert [t.name for t in late.terms] == ["rl", "kd"]
    assert late.terms[1].weight == 0.1 and late.terms[1].objective.kind == "divergence"
    assert late.terms[0] == v.segments[0].spec.terms[0]


def test_scheduled_weight_and_explain_text(tmp_path, cli):
    p = _write(tmp_path, BASE.replace("weight: 0.5", "weight: {kind: cosine, start: 1.0, end: 0.0, steps: 10}"))
    v = validate_file(p)
    assert isinstance(v.spec.terms[1].weight, Schedule)
    r = cli("explain", p)
    assert r.exit_code == 0, r.stdout
    assert "cosine 1 -> 0 over steps 0-10" in r.stdout


@pytest.mark.parametrize("body,path,needle", [
    ("objective: {kind: grpo, ratio: sequence}", "objective.clip_low", "clip range of token-level PPO"),
    ("objective: {kind: grpo, bound: cispo, dual_clip: 3.0}", "objective.dual_clip", "dual_clip applies"),
    ("objective: {kind: grpo, estimator: {kind: leave_one_out}, std_norm: false}", "objective.std_norm", "an estimator is given"),
    ("objective: {kind: grpo}\ntrain: {epochs: 2, precision: 16-mixed}", "train.precision", "loss scaler"),
    ("objective: {kind: grpo}\ntrain: {mini_batches: 9, prompts_per_step: 8}", "train.mini_batches", "whole groups"),
    ("objective: {kind: grpo, kl_coef: {kind: linear, start: 0.1, end: -1, steps: 3}}", "objective.kl_coef", ">= 0"),
])
def test_wrong_combinations_are_refused_with_a_fix(tmp_path, body, path, needle):
    text = "name: t\nsources:\n  verifier: {kind: outcome_reward}\nsignal: {kind: reward, source: verifier}\n" + body + "\n"
    with pytest.raises(SpecError) as e:
        validate_file(_write(tmp_path, text))
    d = next(d for d in e.value.diagnostics if needle in d.message)
    assert ".".join(str(x) for x in d.path) == path
    assert d.hint or d.rule is None


def test_epochs_without_a_ratio_are_refused(tmp_path):
    text = ("name: t\nsources:\n  teacher: {kind: policy_model, model: 'toy:teacher'}\n"
            "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence, estimator: sampled}\n"
            "train: {epochs: 2}\n")
    with pytest.raises(SpecError) as e:
        validate_file(_write(tmp_path, text))
    d = next(d for d in e.value.diagnostics if d.rule == "several_updates_need_a_ratio")
    assert d.path == ("train", "epochs") and "off_policy_ok" in d.hint
    validate_file(_write(tmp_path, text + "sync: {off_policy_ok: true}\n"))  # on purpose: allowed


def test_default_grpo_loss_is_bit_identical_to_the_token_clip():
    """Today's grpo numbers: the loss equals the token-level clipped surrogate (clipped_surrogate) bit for bit."""
    from components.objectives.base import aggregate
    from components.objectives.grpo import clipped_surrogate

    g = torch.Generator().manual_seed(3)
    old = -torch.rand(2, 5, generator=g)
    cur = old + (torch.rand(2, 5, generator=g) - 0.5)
    b = _batch(old)
    ours, _ = Grpo(kl_coef=0.0).loss(b, PolicyView(cur), ADV)
    surr, _, _ = clipped_surrogate(cur, old, ADV[:, None], 0.2, 0.2)
    mask = b.mask(["policy"]) & b.attention_mask
    assert torch.equal(ours, aggregate(-surr, mask, "token-mean"))


def test_explain_tells_every_method_apart(cli):
    """Without its first line (name and summary), each specs/methods spec's explain text differs from plain GRPO's
    and from every other's: estimator, ratio, bound, aggregation, updates and schedules are all printed."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    paths = [root / "specs" / "grpo.yaml"] + sorted((root / "specs" / "methods").glob("*.yaml"))
    texts = {}
    for p in paths:
        r = cli("explain", p)
        assert r.exit_code == 0, r.stdout
        texts[p.stem] = "\n".join(r.stdout.splitlines()[1:])
    assert len(set(texts.values())) == len(texts)
    assert "ratio: per sequence" in texts["gspo"] and "CISPO weight" in texts["cispo"]
    assert "leave-one-out" in texts["rloo"] and "global batch" in texts["reinforce-pp-baseline"]
    assert "linear 0.005 -> 0.001" in texts["kdrl"] and "no std" in texts["dr-grpo"]
    assert "2 mini-batch(es)" in texts["dapo"] and "[1-0.2, 1+0.28]" in texts["dapo"]
