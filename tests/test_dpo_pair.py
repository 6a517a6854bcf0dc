"""Terms over pairs of rows (issue 54, item 2): the online DPO pair objective (`dpo_pair`), the micro-batch rule
for a term whose loss couples the rows of a group (`Objective.couples_rows`), and the hybrid specs/methods/grpo-dpo.

Every expected number is worked out here by hand from DPO's formula (the literals were computed once with a
calculator from the formulas in the comments), not by the project's helpers:

  s_i = sum_t (log pi(y_it) - log pi_ref(y_it)) over row i's response tokens
  L   = (1/P) sum_{(w,l)} -log sigmoid(beta (s_w - s_l)),   d L / d s_w = -(beta/P) sigmoid(-beta (s_w - s_l)) = -d L / d s_l

The peer parity is TRL's own DPOTrainer._compute_loss (loss_type sigmoid) on the same sequence log-probs."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from components.objectives.dpo_pair import DpoPair
from composer import step
from composer.batch import PolicyView, TrajectoryBatch
from composer.checks.validate import validate_file
from composer.errors import SpecError
from composer.origins import CODE
from composer.plan.plan import StepPlan, Term

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "methods" / "grpo-dpo.yaml"


def _batch(cur: list[list[float]], ref: list[list[float]], group: list[int], rewards: list[float]):
    """Rows of [one prompt token | response tokens | pad]; the current log-probs `cur` (a leaf [B, 1 + L] with 0 at the
    prompt and padding) and the reference's `ref` (-inf at padding, as a forward may leave it)."""
    B, L = len(cur), max(len(r) for r in cur)
    origin = torch.full((B, 1 + L), CODE["pad"], dtype=torch.uint8)
    origin[:, 0] = CODE["prompt"]
    lp = torch.zeros(B, 1 + L, dtype=torch.float64)
    init = torch.full((B, 1 + L), -math.inf, dtype=torch.float64)
    init[:, 0] = -0.3
    for i, (c, r) in enumerate(zip(cur, ref)):
        origin[i, 1:1 + len(c)] = CODE["policy"]
        lp[i, 1:1 + len(c)] = torch.tensor(c, dtype=torch.float64)
        init[i, 1:1 + len(r)] = torch.tensor(r, dtype=torch.float64)
    b = TrajectoryBatch(tokens=torch.ones(B, 1 + L, dtype=torch.long), origin=origin, behavior_logprobs=lp.clone(),
                        group=torch.tensor(group), control=torch.ones(B, dtype=torch.bool),
                        rewards=torch.tensor(rewards, dtype=torch.float64), initial_logprobs=init)
    return b, lp.requires_grad_(True)


# Two groups of two rows (beta 0.1):
#   group 0: row 0 (reward 1): log pi -0.5, -0.5, -1.0 (sum -2), ref -1, -1, -1 (sum -3): s_0 = +1
#            row 1 (reward 0): log pi -1, -1, -1 (sum -3), ref -1, -0.5, -0.5 (sum -2): s_1 = -1
#            pair (0, 1): x = 0.1 (1 - (-1)) = 0.2, -log sigmoid(0.2) = log(1 + e^-0.2) = 0.5981388693815918
#   group 1: row 2 (reward 0): s_2 = (-0.7 - 0.8) - (-1.0 - 1.0) = 0.5;  row 3 (reward 1): s_3 = (-0.2) - (-0.7) = 0.5
#            pair (3, 2): x = 0, -log sigmoid(0) = log 2 = 0.6931471805599453
#   L = (0.5981388693815918 + 0.6931471805599453) / 2 = 0.6456430249707685
#   d L / d log pi on row 0's tokens: -(0.1 / 2) sigmoid(-0.2) = -0.05 x 0.4501660026875221 = -0.022508300134376105,
#   on row 1's +0.022508300134376105; row 3's -(0.1 / 2) x 0.5 = -0.025, row 2's +0.025; 0 on prompts and padding
HAND = {"cur": [[-0.5, -0.5, -1.0], [-1.0, -1.0, -1.0], [-0.7, -0.8], [-0.2]],
            "ref": [[-1.0, -1.0, -1.0], [-1.0, -0.5, -0.5], [-1.0, -1.0], [-0.7]],
            "group": [0, 0, 1, 1], "rewards": [1.0, 0.0, 0.0, 1.0]}
HAND_L = 0.6456430249707685
G0, G1 = 0.022508300134376105, 0.025


def test_two_groups_by_hand():
    b, lp = _batch(**HAND)
    loss, m = DpoPair().loss(b, PolicyView(lp), None)
    assert float(loss.detach()) == pytest.approx(HAND_L, abs=1e-12)
    assert m["pairs"] == 2 and m["margin_mean"] == pytest.approx(1.0, abs=1e-12)  # (2 + 0) / 2
    assert m["pair_accuracy"] == pytest.approx(0.5)  # one margin above 0, one at 0
    (g,) = torch.autograd.grad(loss, lp)
    want = torch.zeros_like(g)
    want[0, 1:4], want[1, 1:4], want[2, 1:3], want[3, 1] = -G0, G0, G1, -G1
    assert torch.allclose(g, want, atol=1e-15), g
    assert float(DpoPair().normalizer(b)) == 2.0


def test_reference_loss_equals_the_hand_numbers():
    b, lp = _batch(**HAND)
    obj = DpoPair()
    want = obj.reference_loss(b, obj.loss_mask(b), PolicyView(lp), {"initial": b.initial_logprobs})
    assert want["value"] == pytest.approx(HAND_L, abs=1e-12) and want["acted"] == {"pairs": 2}
    assert float(want["grad"][0, 1]) == pytest.approx(-G0, abs=1e-15) and float(want["grad"][2, 2]) == pytest.approx(G1)
    assert float(want["grad"][3, 2:].abs().sum()) == 0.0 and float(want["grad"][:, 0].abs().sum()) == 0.0


# One group of three rows, rewards 1, 0.5, 0 and s = 0.6, 0.0, -0.4 (beta 0.1):
#   best_worst: the one pair (0, 2): -log sigmoid(0.1) = 0.6443966600735709
#   all_distinct: (0, 1) -log sigmoid(0.06) = 0.6635971130761409, (0, 2) 0.6443966600735709,
#                 (1, 2) -log sigmoid(0.04) = 0.673347167228034; mean 0.6604469801259153
THREE = {"cur": [[-0.4], [-1.0], [-1.4]], "ref": [[-1.0], [-1.0], [-1.0]], "group": [5, 5, 5], "rewards": [1.0, 0.5, 0.0]}


@pytest.mark.parametrize("pairs,want,n", [("best_worst", 0.6443966600735709, 1), ("all_distinct", 0.6604469801259153, 3)])
def test_pair_selection_by_hand(pairs, want, n):
    b, lp = _batch(**THREE)
    loss, m = DpoPair(pairs=pairs).loss(b, PolicyView(lp), None)
    assert float(loss.detach()) == pytest.approx(want, abs=1e-12) and m["pairs"] == n


def test_ties_groups_without_a_pair_and_gated_rows():
    # ties at the top: the first row in batch order is the chosen one (rows 0 and 1 share reward 1: pair (0, 2))
    b, lp = _batch(cur=[[-0.4], [-3.0], [-1.4]], ref=[[-1.0]] * 3, group=[0, 0, 0], rewards=[1.0, 1.0, 0.0])
    loss, _ = DpoPair().loss(b, PolicyView(lp), None)
    assert float(loss.detach()) == pytest.approx(math.log1p(math.exp(-0.1 * (0.6 - (-0.4)))), abs=1e-12)
    # a group whose rewards are all equal gives no pair: loss 0, gradient 0, normaliser 0
    b, lp = _batch(cur=[[-0.4], [-3.0]], ref=[[-1.0]] * 2, group=[0, 0], rewards=[1.0, 1.0])
    loss, m = DpoPair(pairs="all_distinct").loss(b, PolicyView(lp), None)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(loss.detach()) == 0.0 and m["pairs"] == 0 and float(g.abs().sum()) == 0.0
    assert float(DpoPair().normalizer(b)) == 0.0
    # a gate's row mask takes a row out of every pair: group 0's only pair loses its chosen row
    b, lp = _batch(**HAND)
    b.row_mask = torch.tensor([False, True, True, True])
    loss, m = DpoPair().loss(b, PolicyView(lp), None)
    assert m["pairs"] == 1 and float(loss.detach()) == pytest.approx(math.log(2.0), abs=1e-12)


# ------------------------------------------------------------------------- the micro-batch rule (couples_rows)

def _random_step(seed: int = 0, groups: int = 4, n: int = 4):
    """`groups` groups of `n` rows, rewards in {0, 0.5, 1} (mixed in every group), ragged lengths, a leaf of per-token
    current log-probs."""
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    cur, ref = [], []
    for i in range(B):
        T = 1 + (i * 7) % 5
        cur.append((-torch.rand(T, generator=g, dtype=torch.float64) * 2).tolist())
        ref.append((-torch.rand(T, generator=g, dtype=torch.float64) * 2).tolist())
    rewards = [[1.0, 0.0, 0.5, 0.0][(i + i // n) % 4] for i in range(B)]
    return _batch(cur, ref, [i // n for i in range(B)], rewards)


def _at(obj):
    return StepPlan(0, None, (Term(0, "dpo", None, obj, 1.0, declared=obj),), 0.0, False)


def _parts_loss(obj, b, lp, parts_rows, world: int = 1):
    """The step's loss as the backends add it up: each part's `step.loss` scaled by its share of the step-wide
    normaliser (`step.shares`, x the number of parts a backend averages over), the parts' losses summed / world."""
    at = _at(obj)
    whole = step.normalisers(at, [b])
    total = 0.0
    for rows in parts_rows:
        idx = torch.tensor(rows)
        mb = b.select(idx)
        shares = step.shares(step.normalisers(at, [mb]), whole, parts=world)
        view = PolicyView(lp[idx])
        loss, _ = step.loss(at, [mb], lambda _b, _w, _r, v=view: v, shares, facts=False, entropy=False)
        total = total + loss / world
    return total


@pytest.mark.parametrize("pairs", ["best_worst", "all_distinct"])
def test_parts_of_whole_groups_add_up_to_the_step(pairs):
    """Loss and gradient at parts of one group each, of two groups, and of the whole step are equal (the normaliser is
    the step's pairs); DDP's ranks are parts averaged over (world 2)."""
    obj = DpoPair(pairs=pairs)
    b, lp = _random_step()
    whole = _parts_loss(obj, b, lp, [list(range(b.size))])
    (g_whole,) = torch.autograd.grad(whole, lp)
    assert float(whole.detach()) > 0
    for parts, world in (([[r for r in range(b.size) if r // 4 == k] for k in range(4)], 1),  # one group per part
                         ([[r for r in range(b.size) if r // 4 in (0, 3)], [r for r in range(b.size) if r // 4 in (1, 2)]], 2)):
        got = _parts_loss(obj, b, lp, parts, world)
        (g,) = torch.autograd.grad(got, lp)
        assert float(got.detach()) == pytest.approx(float(whole.detach()), abs=1e-12)
        assert float((g - g_whole).abs().max()) <= 1e-15


def test_a_split_through_a_group_would_not_add_up():
    """The rule matters: rows split across parts (OpenRLHF's shuffled micro-batches) lose pairs and change the loss."""
    obj = DpoPair()
    b, lp = _random_step()
    whole = float(_parts_loss(obj, b, lp, [list(range(b.size))]).detach())
    split = float(_parts_loss(obj, b, lp, [list(range(0, b.size, 2)), list(range(1, b.size, 2))]).detach())
    assert abs(split - whole) > 1e-3, (split, whole)


def test_mini_batches_keep_every_pair():
    """step.mini_batches (Lightning's train.mini_batches) splits whole groups: the parts' pairs are the step's."""
    obj = DpoPair(pairs="all_distinct")
    b, _ = _random_step()
    parts = step.mini_batches([b], 2)
    assert sum(float(obj.normalizer(p[0])) for p in parts) == float(obj.normalizer(b)) == 4 * 5
    # each group's rewards are 1, 0.5, 0, 0 in some order: 1 > 0.5, 1 > 0 twice, 0.5 > 0 twice


def test_the_contract_kit_splits_coupled_terms_by_groups():
    from composer.testing import check_objective

    for pairs in ("best_worst", "all_distinct"):
        check_objective(DpoPair(pairs=pairs), seeds=(0, 1, 2))


def _ddp_rank(rank: int, world: int, port: int, out: str) -> None:
    """One DDP rank (gloo): its whole groups, its loss scaled by the Lightning module's own `_shares` (the all-reduced
    normalisers), the gradients averaged over ranks as DDP does; rank 0 writes the result beside the whole step's."""
    import os

    import torch.distributed as dist

    from composer.backends.lightning.module import ComposerModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        obj = DpoPair(pairs="all_distinct")
        b, lp = _random_step(seed=3)
        at = _at(obj)
        whole = _parts_loss(obj, b, lp, [list(range(b.size))])
        (g_whole,) = torch.autograd.grad(whole, lp)
        rows = torch.tensor([r for r in range(b.size) if (r // 4) % world == rank])  # this rank's prompts: whole groups
        mb = b.select(rows)
        fake = SimpleNamespace(ctx=SimpleNamespace(data=SimpleNamespace(world=world)))
        shares = ComposerModule._shares(fake, at, [mb])
        view = PolicyView(lp[rows])
        loss, _ = step.loss(at, [mb], lambda _b, _w, _r, v=view: v, shares, facts=False, entropy=False)
        (g,) = torch.autograd.grad(loss, lp)
        dist.all_reduce(g)  # DDP: the mean of the ranks' gradients
        g = g / world
        value = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(value)
        if rank == 0:
            torch.save({"whole": float(whole.detach()), "ranks": float(value) / world,
                        "grad_err": float((g - g_whole).abs().max())}, out)
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_add_up_to_the_step(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.pt"
    mp.spawn(_ddp_rank, args=(2, port, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert got["ranks"] == pytest.approx(got["whole"], abs=1e-12) and got["whole"] > 0
    assert got["grad_err"] <= 1e-15


# ---------------------------------------------------------------------------------------- peer parity: TRL

class _Acc:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_dpo_loss(chosen_lp, rejected_lp, chosen_mask, rejected_mask, ref_chosen, ref_rejected, beta):
    """TRL's own DPOTrainer._compute_loss (loss_type sigmoid, standard reverse-KL DPO) on a stand-in trainer whose
    model returns the per-token log-probs given (completion positions; 0 elsewhere), with precomputed reference
    sequence log-probs."""
    from trl.trainer.dpo_trainer import DPOTrainer

    P, L = chosen_lp.shape
    per_token = torch.cat([chosen_lp * chosen_mask, rejected_lp * rejected_mask], 0)  # [2P, L]: chosen rows first
    completion = torch.cat([torch.zeros(2 * P, 1), torch.cat([chosen_mask, rejected_mask], 0)], 1).long()  # [2P, 1+L]

    def model(**kw):
        z = torch.zeros_like(per_token)
        return SimpleNamespace(log_probs=per_token, entropy=z, mean_logits=z, is_top1=z.bool())

    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Acc(), aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                           loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                           use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones(2 * P, 1 + L, dtype=torch.long), "attention_mask": torch.ones(2 * P, 1 + L),
              "completion_mask": completion, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    return DPOTrainer._compute_loss(fake, model, inputs, False)


@pytest.mark.parametrize("pairs", ["best_worst", "all_distinct"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_equals_trl_dpo_loss(pairs, beta):
    """The same sequence log-probs, pairs and reference: loss and gradient w.r.t. every token's log-prob equal TRL's."""
    pytest.importorskip("trl.trainer.dpo_trainer")
    obj = DpoPair(pairs=pairs, beta=beta)
    b, lp = _random_step(seed=1, groups=3)
    loss, m = obj.loss(b, PolicyView(lp), None)
    (g,) = torch.autograd.grad(loss, lp)
    win, lose = obj.pairs_of(b)
    mask = obj.loss_mask(b).double()  # [B, 1 + L]
    ref_seq = torch.where(mask.bool(), b.initial_logprobs, torch.zeros_like(b.initial_logprobs)).sum(-1)  # [B]
    lp2 = lp.detach().clone().requires_grad_(True)
    trl = trl_dpo_loss(lp2[win, 1:], lp2[lose, 1:], mask[win, 1:], mask[lose, 1:], ref_seq[win], ref_seq[lose], beta)
    (g_trl,) = torch.autograd.grad(trl, lp2)
    print(f"\nTRL parity ({pairs}, beta {beta}): {int(m['pairs'])} pairs, loss {float(loss.detach()):.12f} vs TRL "
          f"{float(trl.detach()):.12f}, |diff| {abs(float(loss.detach()) - float(trl.detach())):.2g}, grad |diff| {float((g - g_trl).abs().max()):.2g}")
    assert m["pairs"] == (3 if pairs == "best_worst" else 3 * 5)
    assert abs(float(loss.detach()) - float(trl.detach())) <= 1e-12
    assert float((g - g_trl).abs().max()) <= 1e-14


# ------------------------------------------------------------------------------------------------- the spec

def test_the_spec_validates_and_explains_the_pair_term():
    from composer.plan.compile import compile_plan
    from composer.plan.explain import text

    out = text(compile_plan(validate_file(SPEC)))
    assert "online DPO pairs: the highest- and the lowest-reward rollout of each group (rewards distinct)" in out
    assert "-log sigmoid(0.1 ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))))" in out
    assert "dpo: advantage groups by prompt; normaliser the step's pairs (whole groups in every part)" in out


def test_one_sample_per_prompt_is_refused():
    with pytest.raises(SpecError) as e:
        validate_file(SPEC, ["rollout.samples_per_prompt=1"])
    assert "no pair ever forms" in str(e.value)


def test_openrlhf_refuses_it_with_the_reason(tmp_path, cli):
    r = cli("compile", SPEC, "--backend", "openrlhf", "--out", tmp_path / "b")
    assert r.exit_code == 2, r.output
    assert "terms[1].objective" in r.stderr and "has no pairwise loss" in r.stderr
    assert "train it on the lightning backend" in r.stderr


def test_a_micro_batch_helper_never_splits_a_group():
    """A batch of 4 groups in 4 mini-batches: each holds one whole group."""
    b, _ = _random_step()
    parts = step.mini_batches([b], 4)
    assert [sorted(set(p[0].group.tolist())) for p in parts] == [[0], [1], [2], [3]]
    assert all(p[0].size == 4 for p in parts)


def test_the_cookbook_shows_the_spec_as_it_is():
    import re

    page = (ROOT / "docs" / "cookbook.md").read_text()
    body = "".join(line for line in SPEC.read_text().splitlines(keepends=True) if not line.lstrip().startswith("#"))
    assert body in re.findall(r"```yaml\n(.*?)```", page, flags=re.DOTALL)
    assert "grpo-dpo: GRPO plus online DPO on each group's best and worst rollouts" in page


def test_the_referee_sees_a_loss_call_that_cut_a_group():
    """The referee's generic check ('pair terms see whole groups', composer/referee/checks.py): a loss call of a term
    whose objective couples rows must hold every row of each group it touches; a term that couples nothing is not
    checked."""
    from components.objectives.grpo import Grpo
    from composer.referee.checks import Report, check_whole_groups

    b, _ = _random_step()
    b.tokens = torch.arange(b.size)[:, None].repeat(1, b.tokens.shape[1])  # rows told apart by their tokens
    events = [("rollout", {"step": 0, "batch": b})]

    def verdict(obj, rows):
        rep = Report()
        check_whole_groups(rep, events, [{"step": 0, "term": "t", "objective": obj, "batch": b.select(torch.tensor(rows))}])
        return rep.checks.get("pair terms see whole groups")

    whole = verdict(DpoPair(), [0, 1, 2, 3, 8, 9, 10, 11])
    assert whole.passed == 1 and whole.failed == 0
    cut = verdict(DpoPair(), [0, 1, 2, 8, 9, 10, 11])
    assert cut.failed == 1 and "{0: (3, 4)}" in cut.first
    assert verdict(Grpo(), [0, 1, 2]) is None
