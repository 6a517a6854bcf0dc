"""Issue 46 (part 2): step-wide token selection in grpo (`token_selection`: KL-Cov and Clip-Cov, Cui et al. 2025,
arXiv 2505.22617). The statistic Cov_t = (log pi - mean log pi)(A - mean A) is over the whole step's loss tokens,
computed with the advantages, so micro-batches (and DDP ranks) do not change it. Every expected number here is
worked out by hand on a 6-token batch (the arithmetic is written out in the comments)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from components.objectives.grpo import Grpo
from composer.batch import PolicyView, TrajectoryBatch
from composer.origins import CODE

ROOT = Path(__file__).resolve().parent.parent

# One group of 2 rows, 3 loss tokens each (position 0 is the prompt): N = 6.
# rewards [1, 0], no std (estimator group_mean std none): A = [0.5, -0.5]; mean A over the 6 tokens = 0.
OLD = torch.tensor([[0.0, -0.2, -1.0, -2.4], [0.0, -0.6, -3.0, -0.4]], dtype=torch.float64)  # behaviour
CUR = torch.tensor([[0.0, -0.1, -1.2, -2.4], [0.0, -0.7, -2.8, -0.4]], dtype=torch.float64)  # current
# mean log pi = (-0.2 - 1.0 - 2.4 - 0.6 - 3.0 - 0.4) / 6 = -7.6 / 6 = -1.266667
# Cov_t = (lp - mean) * A:
#   row 0 (A = +0.5):  1.066667 * 0.5 =  0.533333 | 0.266667 * 0.5 =  0.133333 | -1.133333 * 0.5 = -0.566667
#   row 1 (A = -0.5):  0.666667 * -.5 = -0.333333 | -1.733333 * -.5 = 0.866667 |  0.866667 * -.5 = -0.433333
COV = [[8 / 15, 2 / 15, -17 / 30], [-1 / 3, 13 / 15, -13 / 30]]
# log rho = CUR - OLD: row 0 [0.1, -0.2, 0], row 1 [-0.1, 0.2, 0]; clip 0.2 -> [0.8, 1.2]
# PPO l_t = -min(rho A, clip(rho) A): rho 1.105171, 0.818731, 1 | 0.904837, 1.221403, 1
#   row 0: -0.552585, -0.409365, -0.5;  row 1: 0.452419, 0.610701 (the unclipped branch is the min), 0.5
E = math.exp
PPO = [[-0.5 * E(0.1), -0.5 * E(-0.2), -0.5], [0.5 * E(-0.1), 0.5 * E(0.2), 0.5]]


def _batch(rows=2, old=OLD, rewards=(1.0, 0.0), group=(0, 0)):
    origin = torch.full((rows, old.shape[1]), CODE["policy"], dtype=torch.uint8)
    origin[:, 0] = CODE["prompt"]
    return TrajectoryBatch(tokens=torch.arange(rows * old.shape[1]).reshape(rows, -1) + 5, origin=origin,
                           behavior_logprobs=old.float(), group=torch.tensor(group),
                           control=torch.ones(rows, dtype=torch.bool), rewards=torch.tensor(rewards))


def _obj(**sel):
    return Grpo(estimator={"kind": "group_mean", "std": "none"}, kl_coef=0.0, token_selection=sel)


def _run(obj, batch, cur=CUR):
    adv = obj.advantages(batch)
    cur = cur.float().clone().requires_grad_(True)
    loss, m = obj.loss(batch, PolicyView(cur), adv)
    loss.backward()
    return float(loss.detach()), cur.grad.double(), m, adv


def test_kl_cov_by_hand():
    # k = 0.34: max(1, floor(0.34 * 6)) = floor(2.04) = 2 tokens, the two largest Cov_t: row 1 t2 (0.8667), row 0 t1
    # (0.5333). There l_t = -A rho + beta |log rho|: row 0 t1 -0.552585 + 0.1 = -0.452585; row 1 t2 0.610701 + 0.2
    # = 0.810701. Loss = token mean over 6 = (-0.452585 - 0.409365 - 0.5 + 0.452419 + 0.810701 + 0.5) / 6 = 0.066862
    from components.objectives.token_selection import covariance

    m = _batch().mask(("policy",))
    cov = covariance(OLD[m], torch.tensor([0.5, -0.5], dtype=torch.float64)[:, None].expand(2, 4)[m])
    assert torch.allclose(cov, torch.tensor(COV, dtype=torch.float64).flatten(), atol=1e-12)
    obj = _obj(kind="kl_cov", k=0.34, beta=1.0)
    batch = _batch()
    loss, grad, m, adv = _run(obj, batch)
    assert adv.tolist() == [0.5, -0.5]
    assert batch.token_select.tolist() == [[False, True, False, False], [False, False, True, False]]
    want = [[PPO[0][0] + 0.1, PPO[0][1], PPO[0][2]], [PPO[1][0], PPO[1][1] + 0.2, PPO[1][2]]]
    assert loss == pytest.approx(sum(map(sum, want)) / 6, abs=1e-6)
    assert loss == pytest.approx(0.066862, abs=1e-6)
    # d l / d lp: -A rho (+ beta sign(log rho) on the selected), / 6:
    #   row 0: (-0.552585 + 1) / 6 = 0.074569, -0.409365 / 6 = -0.068228, -0.5 / 6 = -0.083333
    #   row 1:  0.452419 / 6 = 0.075403, (0.610701 + 1) / 6 = 0.268450, 0.5 / 6 = 0.083333
    g = [[(PPO[0][0] + 1) / 6, PPO[0][1] / 6, PPO[0][2] / 6], [PPO[1][0] / 6, (PPO[1][1] + 1) / 6, PPO[1][2] / 6]]
    assert torch.allclose(grad[:, 1:], torch.tensor(g, dtype=torch.float64), atol=1e-6)
    assert grad[0, 1] == pytest.approx(0.074569, abs=1e-6) and grad[1, 2] == pytest.approx(0.268450, abs=1e-6)
    assert m["token_selection/selected"] == 2 and m["token_selection/tokens"] == 6
    # k small: k N < 1 still selects max(1, 0) = 1 token (verl), the largest Cov_t
    b = _batch()
    _obj(kind="kl_cov", k=1e-3).advantages(b)
    assert b.token_select.tolist() == [[False, False, False, False], [False, False, True, False]]


def test_clip_cov_by_hand():
    # band (0.1, 0.6): row 0 t1 (0.5333) and row 0 t2 (0.1333); r = 0.34 -> max(1, floor(2.04)) = 2 = the whole
    # band, so the draw is forced. There l_t = 0 (no loss, no gradient; still counted in the token mean):
    # loss = (-0.5 + 0.452419 + 0.610701 + 0.5) / 6 = 0.177187
    obj = _obj(kind="clip_cov", r=0.34, omega_low=0.1, omega_high=0.6)
    batch = _batch()
    loss, grad, m, _ = _run(obj, batch)
    assert batch.token_select.tolist() == [[False, True, True, False], [False, False, False, False]]
    assert loss == pytest.approx((PPO[0][2] + sum(PPO[1])) / 6, abs=1e-6)
    assert loss == pytest.approx(0.177187, abs=1e-6)
    assert grad[0, 1] == 0 and grad[0, 2] == 0
    assert torch.allclose(grad[1, 1:], torch.tensor(PPO[1], dtype=torch.float64) / 6, atol=1e-6)
    assert grad[0, 3] == pytest.approx(-0.5 / 6, abs=1e-7)
    assert m["token_selection/candidates"] == 2 and m["token_selection/selected"] == 2
    # r = 0.1: max(1, floor(0.6)) = 1 of the 2 band tokens, drawn by the private generator: always in the band,
    # the same draw for the same seed and tokens, and the global RNG untouched
    state = torch.get_rng_state()
    picks = []
    for seed in (0, 0, 1, 2, 3, 4, 5):
        b = _batch()
        _obj(kind="clip_cov", r=0.1, omega_low=0.1, omega_high=0.6, seed=seed).advantages(b)
        sel = b.token_select
        assert int(sel.sum()) == 1 and bool(sel[0, 1] | sel[0, 2])
        picks.append(tuple(sel.flatten().tolist()))
    assert picks[0] == picks[1] and len(set(picks)) == 2  # reproducible, and the seed changes the draw
    assert torch.equal(torch.get_rng_state(), state)


def test_refused_settings():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="band omega_low < Cov_t < omega_high is empty"):
        _obj(kind="clip_cov", omega_low=5.0, omega_high=1.0)
    with pytest.raises(ValidationError, match="use ratio: token and bound: clip"):
        Grpo(ratio="sequence", token_selection={"kind": "kl_cov"})
    with pytest.raises(ValidationError, match="use ratio: token and bound: clip"):
        Grpo(bound="cispo", token_selection={"kind": "clip_cov"})
    with pytest.raises(ValidationError):
        _obj(kind="kl_cov", k=0.0)
    with pytest.raises(ValueError, match="needs batch.token_select"):  # a loss without the step's selection
        obj = _obj(kind="kl_cov")
        obj.loss(_batch(), PolicyView(CUR.float()), torch.tensor([0.5, -0.5]))


def _step_batch():
    """Two groups of 2 rows (4 x 8 = 32 loss tokens) with log-probs far apart, so per-half statistics differ."""
    g = torch.Generator().manual_seed(3)
    old = torch.cat([torch.zeros(4, 1), -torch.rand(4, 8, generator=g, dtype=torch.float64) * 3], 1)
    old[2:, 1:] -= 2.0  # the second group is much less likely: its own mean differs from the step's
    cur = old + torch.cat([torch.zeros(4, 1), (torch.rand(4, 8, generator=g, dtype=torch.float64) - 0.5) * 0.6], 1)
    return _batch(4, old, (1.0, 0.0, 0.0, 1.0), (0, 0, 1, 1)), cur


@pytest.mark.parametrize("sel", [{"kind": "kl_cov", "k": 0.2}, {"kind": "clip_cov", "r": 0.2, "omega_low": 0.05}])
def test_two_micro_batches_give_the_gradient_of_one(sel):
    obj = _obj(**sel)
    batch, cur = _step_batch()
    loss, grad, _m, adv = _run(obj, batch, cur)
    n = int(batch.token_select.sum())  # max(1, floor(0.2 * 32)) = 6 (clip_cov: at most the band's size)
    assert n == 6 if sel["kind"] == "kl_cov" else 1 <= n <= 6
    # micro-batches of whole groups: each part's loss scaled by its share of the step's normaliser
    x = cur.float().clone().requires_grad_(True)
    total = 0.0
    norm = obj.normalizer(batch)
    for rows in ([0, 1], [2, 3]):
        part = batch.select(rows)  # carries its rows of batch.token_select
        value, _ = obj.loss(part, PolicyView(x[rows]), adv[rows])
        total = total + value * obj.normalizer(part) / norm
    total.backward()
    assert float(total.detach()) == pytest.approx(loss, abs=1e-6)
    assert torch.allclose(x.grad.double(), grad, atol=1e-7)
    # what the step-wide statistic prevents: the selection per micro-batch (verl's) is another one
    per_part = [batch.select(r) for r in ([0, 1], [2, 3])]
    for p in per_part:
        obj.advantages(p)
    assert not torch.equal(torch.cat([p.token_select for p in per_part]), batch.token_select)


def _ddp_worker(rank, world, path, sel, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        batch, _cur = _step_batch()
        mine = batch.select([2 * rank, 2 * rank + 1])  # each rank holds one whole group
        _obj(**sel).advantages(mine)
        torch.save({"sel": mine.token_select, "info": dict(mine.info)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sel", [{"kind": "kl_cov", "k": 0.2}, {"kind": "clip_cov", "r": 0.2, "omega_low": 0.05}])
def test_ddp_ranks_select_as_one_process(sel, tmp_path):
    import torch.multiprocessing as mp

    batch, _cur = _step_batch()
    _obj(**sel).advantages(batch)
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), sel, str(tmp_path / "out")), nprocs=2, join=True)
    got = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    assert torch.equal(torch.cat([g["sel"] for g in got]), batch.token_select)
    for g in got:
        assert g["info"]["token_selection/tokens"] == 32
        assert g["info"]["token_selection/selected"] == int(batch.token_select.sum())


def test_listed_explained_and_refused_on_openrlhf():
    from composer import registry
    from composer.backends.openrlhf.flags import Unsupported, build_runs
    from composer.checks.validate import validate_file
    from composer.plan.compile import compile_plan
    from composer.plan.explain import text

    assert {"none", "kl_cov", "clip_cov"} <= set(registry.kinds("token_selection"))
    out = text(compile_plan(validate_file(ROOT / "specs" / "methods" / "kl-cov.yaml")))
    assert "KL-Cov: the top max(1, floor(0.01 N))" in out
    out = text(compile_plan(validate_file(ROOT / "specs" / "methods" / "clip-cov.yaml")))
    assert "Clip-Cov: max(1, floor(0.01 N)) of the step's N loss tokens with 0.02 < Cov_t < 5" in out
    from composer.backends.openrlhf import flags

    with pytest.raises(Unsupported) as e:
        flags.check_capabilities(validate_file(ROOT / "specs" / "methods" / "kl-cov.yaml").segments[0].spec, ())
    assert e.value.path == ("objective", "token_selection") and "whole step" in e.value.reason
    assert build_runs  # the compile path that calls check_capabilities for every segment


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kl-cov.yaml", "clip-cov.yaml"])
def test_toy_run_selects_tokens_with_a_nonzero_loss(name, tmp_path):
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    v = validate_file(ROOT / "specs" / "methods" / name,
                      ["train.steps=3", "train.prompts_per_step=8", "train.eval_every=0", "train.eval_samples=2",
                       "train.checkpoint_every=1000", "train.samples_every=0"])
    train(v, tmp_path, progress=False)
    rows = [r for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("loss")]
    assert len(rows) == 3
    assert any(abs(float(r["loss"])) > 0 for r in rows)
    assert sum(float(r["token_selection/selected"]) for r in rows) > 0
    assert all(float(r["token_selection/tokens"]) > 500 for r in rows)


@pytest.mark.parametrize("sel", [{"kind": "kl_cov", "k": 0.34}, {"kind": "clip_cov", "r": 0.34, "omega_low": 0.1,
                                                                   "omega_high": 0.6}])
def test_referee_recomputes_the_selection_and_catches_a_wrong_one(sel):
    from composer.referee.checks import Report, check_token_selection

    obj = _obj(**sel)
    batch = _batch()
    loss, grad, _m, adv = _run(obj, batch)
    batch.advantages = adv
    mask = batch.mask(("policy",)) & batch.attention_mask
    want = obj.reference_loss(batch, mask, PolicyView(CUR.float()), {
        "old": OLD.float(), "initial": None, "advantages": [0.5, -0.5], "kl_coef": 0.0,
        "token_select": batch.token_select})  # grpo's own reference, the selection's reference_token inside
    assert want["value"] == pytest.approx(loss, abs=1e-6)
    assert torch.allclose(want["grad"], grad.double(), atol=1e-6)
    assert obj.reference_loss(batch, mask, PolicyView(CUR.float()), {
        "old": OLD.float(), "advantages": [0.5, -0.5], "token_select": None}) is None  # a mini-batch: not covered
    parts = {"pg_grad": want["grad"]}
    events = [{"batch": batch, "objective": obj, "step": 0, "term": "term0"}]
    rep = Report()
    check_token_selection(rep, events)
    assert rep.ok and rep.checks[f"token selection ({sel['kind']}) recomputed"].passed == 1
    # the run chose another token: row 1 t1 (Cov -0.3333: neither in the top 2 nor in the band)
    wrong = batch.token_select.clone()
    wrong[wrong.nonzero()[0][0], wrong.nonzero()[0][1]] = False
    wrong[1, 1] = True
    batch.token_select = wrong
    rep = Report()
    check_token_selection(rep, events)
    assert not rep.ok, rep.table()
    # a loss that ignored the selection (plain PPO): the referee's gradient differs by far more than its tolerance
    plain = Grpo(estimator={"kind": "group_mean", "std": "none"}, kl_coef=0.0)
    x = CUR.float().clone().requires_grad_(True)
    plain.loss(_batch(), PolicyView(x), adv)[0].backward()
    assert float((parts["pg_grad"] - x.grad.double()).abs().max()) * 6 > 0.1  # per unit of token weight (1/6)
