"""Issue 54 (item 1): token-level entropy statistics of the step (grpo `token_selection: entropy | archer`).

H_t is the entropy of the full next-token distribution at each response token under the OLD policy (the weights at
the step's start), computed once per step by a forward with the full logits (`batch.old_entropy`) and turned into a
step-wide selection where the advantages are (`batch.token_select`), so micro-batches and DDP ranks do not change it.
  entropy  the 80/20 update (Wang et al. 2025, arXiv 2506.01939): only the top max(1, ceil(rho N)) tokens by H_t keep
           the policy-gradient loss; the others 0, all in the normaliser;
  archer   Archer (Wang et al. 2025, arXiv 2507.15778): a token above the 0.8-quantile of its response's H_t takes the
           high-entropy clip (0.5) and KL coefficient (0), the others the term's clip and kl_coef; one normaliser.
Every expected number below is worked out by hand in the comments. Peer parity: both releases are verl forks
(Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR, wizard-III/ArcherCodeR) and verl does not install here (Ray, vLLM, FSDP),
so their loss formulas are written out below from their code (`get_global_entropy_top_mask` +
`compute_policy_loss_vanilla`; `dp_actor.update_policy`'s entropy masks + `compute_policy_loss`) and compared on one
micro-batch that is the whole step (their H_t from the current policy equals the old policy's at the first update).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from components.objectives.grpo import Grpo
from components.objectives.token_selection import Archer, Entropy
from composer.batch import PolicyView, TrajectoryBatch
from composer.origins import CODE

# Two rows of one group: a prompt token, then 5 response tokens each (N = 10 loss tokens).
# rewards [1, 0], no std (group_mean std none): A = [0.5, -0.5].
H = torch.tensor([[0.0, 0.1, 2.0, 0.3, 0.05, 0.9],
                  [0.0, 0.5, 0.2, 0.0, 0.35, 0.4]], dtype=torch.float64)  # the old policy's H_t
OLD = torch.tensor([[0.0, -0.5, -1.0, -0.7, -0.2, -1.3],
                    [0.0, -0.9, -0.4, -0.1, -0.6, -0.8]], dtype=torch.float64)  # behaviour = old log-probs


def _batch(old=OLD, h=H, rewards=(1.0, 0.0), group=(0, 0)):
    rows, T = old.shape
    origin = torch.full((rows, T), CODE["policy"], dtype=torch.uint8)
    origin[:, 0] = CODE["prompt"]
    return TrajectoryBatch(tokens=torch.arange(rows * T).reshape(rows, T) % 7 + 3, origin=origin,
                           behavior_logprobs=old.float(), group=torch.tensor(group),
                           control=torch.ones(rows, dtype=torch.bool), rewards=torch.tensor(rewards),
                           old_entropy=h.float())


def _obj(sel, **kw):
    return Grpo(estimator={"kind": "group_mean", "std": "none"}, token_selection=sel, **{"kl_coef": 0.0, **kw})


def _run(obj, batch, cur):
    adv = obj.advantages(batch)
    x = cur.float().clone().requires_grad_(True)
    loss, m = obj.loss(batch, PolicyView(x), adv)
    loss.backward()
    return float(loss.detach()), x.grad.double(), m, adv


# ------------------------------------------------------------------------------------------- the entropy itself

class FixedLM(torch.nn.Module):
    """A 'model' whose logits at position t are table[t] for every row (V = 3)."""

    def __init__(self, table):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.table = table

    def forward(self, input_ids, attention_mask=None, **_kw):
        B, T = input_ids.shape
        return SimpleNamespace(logits=self.table[:T].expand(B, T, -1) + 0 * self.w)


def test_entropy_of_a_known_distribution():
    """Logits [ln 2, 0, 0] give p = [1/2, 1/4, 1/4]: H = 1/2 ln 2 + 2 x 1/4 ln 4 = 1.5 ln 2 = 1.0397208; logits
    [0, 0, 0] give ln 3 = 1.0986123. At temperature 2, [ln 2, 0, 0] / 2 gives p proportional to [sqrt 2, 1, 1] =
    [0.4142136, 0.2928932, 0.2928932]: H = 1.0843917. The logits at t predict the token at t + 1 (H_0 = 0). The
    run's forward (`batch_entropy`, what the step calls) and the referee's (`fresh_entropy`) both give these."""
    from composer.referee.record import fresh_entropy
    from composer.runtime.models import batch_entropy

    table = torch.tensor([[math.log(2), 0, 0], [0.0, 0, 0], [math.log(2), 0, 0], [0.0, 0, 0]])
    model = FixedLM(table)
    b = _batch(OLD[:, :4], H[:, :4])
    b.tokens = b.tokens % 3  # ids of the 3-token vocabulary
    want = [0.0, 1.5 * math.log(2), math.log(3), 1.5 * math.log(2)]
    got = batch_entropy(model, b)
    assert got.shape == (2, 4) and torch.allclose(got.double(), torch.tensor([want, want], dtype=torch.float64),
                                                  atol=1e-6)
    assert torch.allclose(fresh_entropy(model, b.tokens, b.attention_mask, 1.0)[0], torch.tensor(want,
                                                                                                 dtype=torch.float64))
    b.info["temperature"] = 2.0
    assert float(batch_entropy(model, b)[0, 1]) == pytest.approx(1.0843917, abs=1e-6)
    assert float(fresh_entropy(model, b.tokens, b.attention_mask, 2.0)[0, 1]) == pytest.approx(1.0843917, abs=1e-7)


# ------------------------------------------------------------------------------------------- the 80/20 update

# log pi - log pi_old = 0 except row 0 t2 (+0.3): rho = e^0.3 = 1.349859 > 1 + 0.28, A = +0.5: the clip binds there
CUR = OLD.clone()
CUR[0, 2] += 0.3


def test_entropy_top_rho_by_hand():
    """rho 0.2 over the step: max(1, ceil(0.2 x 10)) = 2 tokens, the largest H: row 0 t2 (2.0) and row 0 t5 (0.9).
    Their l_t (DAPO clip 0.2 / 0.28): t2 -min(1.349859 x 0.5, 1.28 x 0.5) = -0.64 (clipped: no gradient), t5 -0.5;
    the 8 others 0. Token mean over all 10: (-0.64 - 0.5) / 10 = -0.114; d loss / d log pi = -A rho / 10 = -0.05 at
    t5, 0 elsewhere. rho 0.25: ceil(2.5) = 3 tokens, row 1 t1 (0.5) too: l = +0.5 -> (-0.64 - 0.5 + 0.5) / 10."""
    obj = _obj({"kind": "entropy", "rho": 0.2}, clip_low=0.2, clip_high=0.28)
    b = _batch()
    loss, grad, m, _adv = _run(obj, b, CUR)
    want_sel = torch.zeros(2, 6, dtype=torch.bool)
    want_sel[0, 2] = want_sel[0, 5] = True
    assert torch.equal(b.token_select, want_sel)
    assert loss == pytest.approx(-0.114, abs=1e-6)
    want_grad = torch.zeros(2, 6, dtype=torch.float64)
    want_grad[0, 5] = -0.05
    assert torch.allclose(grad, want_grad, atol=1e-7)
    assert m["token_selection/tokens"] == 10 and m["token_selection/selected"] == 2
    assert m["token_selection/entropy_mean"] == pytest.approx(4.8 / 10)  # (3.35 + 1.45) / 10
    assert m["token_selection/selected_entropy_mean"] == pytest.approx(1.45)  # (2.0 + 0.9) / 2
    assert m["clip_frac"] == pytest.approx(1 / 10)
    loss, _g, m, _a = _run(_obj({"kind": "entropy", "rho": 0.25}, clip_low=0.2, clip_high=0.28), _batch(), CUR)
    assert m["token_selection/selected"] == 3 and loss == pytest.approx((-0.64 - 0.5 + 0.5) / 10, abs=1e-6)


def test_entropy_per_response_by_hand():
    """scope: response, rho 0.2: each row's max(1, ceil(0.2 x 5)) = 1 token: row 0 t2 (2.0), row 1 t1 (0.5; the step's
    cut would keep row 0 t5 instead). l: -0.64 (clipped) and +0.5 (A = -0.5, rho 1): (-0.64 + 0.5) / 10 = -0.014;
    gradient +0.05 at row 1 t1 only."""
    obj = _obj({"kind": "entropy", "rho": 0.2, "scope": "response"}, clip_low=0.2, clip_high=0.28)
    b = _batch()
    loss, grad, _m, _a = _run(obj, b, CUR)
    assert b.token_select.nonzero().tolist() == [[0, 2], [1, 1]]
    assert loss == pytest.approx(-0.014, abs=1e-6)
    want_grad = torch.zeros(2, 6, dtype=torch.float64)
    want_grad[1, 1] = 0.05
    assert torch.allclose(grad, want_grad, atol=1e-7)


def test_entropy_reference_problem_by_hand():
    """The referee's own choice (plain Python): 10 entropies, rho 0.2 keeps 2: the 2.0 and the 0.9; a run that kept
    the 0.5 instead, or 3 tokens, is told apart; two tokens tied at the cut may go either way."""
    h = [0.1, 2.0, 0.3, 0.05, 0.9, 0.5, 0.2, 0.0, 0.35, 0.4]
    pick = lambda *idx: [i in idx for i in range(10)]
    e = Entropy(rho=0.2)
    assert e.reference_problem(h, pick(1, 4)) is None
    assert "differ from the run's at 1 tokens" in e.reference_problem(h, pick(1, 5))  # the 0.5 (the 0.9 sits at the cut)
    assert "kept 3 of 10" in e.reference_problem(h, pick(1, 4, 5))
    tied = [0.1, 2.0, 0.9, 0.05, 0.9 + 5e-5, 0.5]
    assert e.reference_problem(tied, [False, True, True, False, False, False]) is None  # within ENTROPY_TIE
    # per response: rows [0]*5 + [1]*5, each keeps ceil(1.0) = 1
    rows = [0] * 5 + [1] * 5
    assert Entropy(rho=0.2, scope="response").reference_problem(h, pick(1, 5), rows) is None
    assert Entropy(rho=0.2, scope="response").reference_problem(h, pick(1, 4), rows) is not None
    assert e.reference_token(0.5, 0.3) == (0.0, 0.0) and e.reference_replaces(False) and not e.reference_replaces(True)


# ------------------------------------------------------------------------------------------- Archer

# d = log pi - log pi_old: +0.4 at row 0 t2 and t5, -0.6 at row 1 t1, 0 elsewhere; log pi - log pi_init = 0.1 everywhere
CUR_A = OLD.clone()
CUR_A[0, 2] += 0.4
CUR_A[0, 5] += 0.4
CUR_A[1, 1] -= 0.6
INIT_A = CUR_A - 0.1


def test_archer_classes_clips_and_kl_by_hand():
    """Classes (quantile 0.8 per response, linear interpolation at 0.8 x (5 - 1) = 3.2):
      row 0 sorted [0.05, 0.1, 0.3, 0.9, 2.0]: tau = 0.9 + 0.2 x 1.1 = 1.12 -> high {t2 (2.0)}
      row 1 sorted [0.0, 0.2, 0.35, 0.4, 0.5]: tau = 0.4 + 0.2 x 0.1 = 0.42 -> high {t1 (0.5)}
    l_t (low: clip 0.2, KL 0.1; high: clip 0.5, KL 0):
      row 0 t2 high, rho e^0.4 = 1.491825 < 1.5: unclipped, l = -0.745912, d l / d log pi = -A rho = -0.745912
           (the low class's clip 1.2 would have bound: -0.6, no gradient)
      row 0 t5 low,  rho 1.491825 > 1.2: clipped, l = -0.6, no gradient
      row 1 t1 high, rho e^-0.6 = 0.548812 > 0.5: unclipped, l = +0.274406, gradient +0.274406
           (the low clip 0.8 would have bound: l = 0.4, no gradient)
      the others rho 1: row 0 -0.5 (x3), row 1 +0.5 (x4)
      pg = (-0.5 x 3 - 0.745912 - 0.6 + 0.274406 + 0.5 x 4) / 10 = -0.0571507
    KL (k3 at 0.1: e^-0.1 + 0.1 - 1 = 0.00483742, gradient 1 - e^-0.1 = 0.0951626) on the 8 low tokens only:
      0.1 x 8 x 0.00483742 / 10 = 0.000386993; each low token's gradient + 0.1 x 0.0951626 / 10 = 0.000951626
    loss = -0.0567637."""
    obj = _obj({"kind": "archer", "quantile": 0.8, "high_entropy_clip_low": 0.5, "high_entropy_clip_high": 0.5,
                "high_entropy_kl_coef": 0.0}, clip=0.2, kl_coef=0.1)
    assert obj.wants_initial and obj.wants_old_entropy
    b = _batch()
    b.initial_logprobs = INIT_A.float()
    loss, grad, m, _adv = _run(obj, b, CUR_A)
    assert b.token_select.nonzero().tolist() == [[0, 2], [1, 1]]
    assert loss == pytest.approx(-0.0567637, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(-0.0571507, abs=1e-6)
    kg = 0.1 * 0.0951626 / 10
    want = torch.tensor([[0.0, -0.05 + kg, -0.0745912, -0.05 + kg, -0.05 + kg, kg],
                         [0.0, 0.0274406, 0.05 + kg, 0.05 + kg, 0.05 + kg, 0.05 + kg]], dtype=torch.float64)
    assert torch.allclose(grad, want, atol=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 10)  # row 0 t5 only: the high class's wider clip lets t2 and r1 t1 go
    # the referee's formula (grpo.reference_loss with the part's reference_clip / reference_kl_coef) agrees
    mask = b.mask(("policy",)) & b.attention_mask
    ref = obj.reference_loss(b, mask, PolicyView(CUR_A.float()), {
        "old": OLD.float(), "initial": INIT_A.float(), "advantages": [0.5, -0.5], "kl_coef": 0.1,
        "token_select": b.token_select})
    assert ref["value"] == pytest.approx(loss, abs=1e-6) and torch.allclose(ref["grad"], grad, atol=1e-6)
    assert ref["kl_value"] == pytest.approx(8 * 0.00483742 / 10, abs=1e-7)  # per unit of kl_coef
    # where the classes changed the loss: the clip at row 0 t2 and row 1 t1 (2), and their KL coefficient 0 in place
    # of 0.1 where k3 = 0.00484 != 0 (the same 2 tokens)
    assert ref["acted"]["token_selection"] == 4


def test_archer_reference_problem_and_threshold_by_hand():
    """tau of [0.05, 0.1, 0.3, 0.9, 2.0] at 0.8: 1.12 (above); a run that put the 0.9 in the high class fails."""
    a = Archer()
    assert a.threshold([0.1, 2.0, 0.3, 0.05, 0.9]) == pytest.approx(1.12)
    h = [0.1, 2.0, 0.3, 0.05, 0.9, 0.5, 0.2, 0.0, 0.35, 0.4]
    rows = [0] * 5 + [1] * 5
    pick = lambda *idx: [i in idx for i in range(10)]
    assert a.reference_problem(h, pick(1, 5), rows) is None
    assert "other entropy class" in a.reference_problem(h, pick(1, 4, 5), rows)
    # scope: step: one cut over all 10 at 0.8 x 9 = 7.2: sorted[7] = 0.5, sorted[8] = 0.9 -> tau = 0.58 -> {2.0, 0.9}
    assert Archer(scope="step").reference_problem(h, pick(1, 4), rows) is None
    assert a.reference_clip(True, 0.2, 0.28) == (0.5, 0.5) and a.reference_clip(False, 0.2, 0.28) == (0.2, 0.28)
    assert a.reference_kl_coef(True, 0.001) == 0.0 and a.reference_kl_coef(False, 0.001) == 0.001


# ------------------------------------------------------------------------------------------- step-wide statistic

def _step_batch():
    """Two groups of 2 rows (4 x 8 = 32 loss tokens); the second group's entropies much higher than the first's,
    so a cut per half (per micro-batch) differs from the step's."""
    g = torch.Generator().manual_seed(5)
    old = torch.cat([torch.zeros(4, 1), -torch.rand(4, 8, generator=g, dtype=torch.float64) * 3], 1)
    cur = old + torch.cat([torch.zeros(4, 1), (torch.rand(4, 8, generator=g, dtype=torch.float64) - 0.5) * 0.8], 1)
    h = torch.cat([torch.zeros(4, 1), torch.rand(4, 8, generator=g, dtype=torch.float64)], 1)
    h[2:, 1:] += 1.5
    b = _batch(old, h, (1.0, 0.0, 0.0, 1.0), (0, 0, 1, 1))
    b.initial_logprobs = (cur - 0.05).float()
    return b, cur


SELECTIONS = [{"kind": "entropy", "rho": 0.2}, {"kind": "entropy", "rho": 0.3, "scope": "response"},
              {"kind": "archer", "high_entropy_clip_low": 0.05, "high_entropy_clip_high": 0.1,
               "high_entropy_kl_coef": 0.02},
              {"kind": "archer", "scope": "step", "quantile": 0.6}]


@pytest.mark.parametrize("sel", SELECTIONS, ids=lambda s: f"{s['kind']}-{s.get('scope', '')}")
def test_micro_batches_do_not_change_the_selection(sel):
    """The whole step's loss and gradient = the sum of its micro-batches' (each by its share of the normaliser),
    each micro-batch reading its rows of the step's selection; selecting per micro-batch (the releases' way) would
    choose other tokens for a step-wide cut."""
    obj = _obj(sel, clip=0.1, kl_coef=0.01)
    batch, cur = _step_batch()
    loss, grad, _m, adv = _run(obj, batch, cur)
    assert 0 < int(batch.token_select.sum()) < 32
    x = cur.float().clone().requires_grad_(True)
    total, norm = 0.0, obj.normalizer(batch)
    for rows in ([0, 1], [2, 3]):
        part = batch.select(rows)  # carries its rows of token_select and old_entropy
        value, _ = obj.loss(part, PolicyView(x[rows]), adv[rows])
        total = total + value * obj.normalizer(part) / norm
    total.backward()
    assert float(total.detach()) == pytest.approx(loss, abs=1e-6)
    assert torch.allclose(x.grad.double(), grad, atol=1e-7)
    per_part = [batch.select(r) for r in ([0, 1], [2, 3])]
    for p in per_part:
        obj.advantages(p)
    same = torch.equal(torch.cat([p.token_select for p in per_part]), batch.token_select)
    assert same == (sel.get("scope", "step" if sel["kind"] == "entropy" else "response") == "response")


def test_the_contract_kit_on_the_entropy_selections():
    """Micro-batches add up, the OpenRLHF loss path equals the Lightning step, the loss reads only read_mask, and
    grpo's reference_loss (with each part's reference hooks) equals the loss and its gradient, on random batches."""
    from composer.testing import check_objective

    for sel in SELECTIONS:
        for kl in (0.0, 0.1):
            check_objective(Grpo(token_selection=sel, kl_coef=kl, clip=0.02, dual_clip=3.0))


def _ddp_worker(rank, world, path, sel, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        batch, _cur = _step_batch()
        mine = batch.select([2 * rank, 2 * rank + 1])  # each rank holds one whole group
        _obj(sel).advantages(mine)
        torch.save({"sel": mine.token_select, "info": dict(mine.info)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sel", [{"kind": "entropy", "rho": 0.2}, {"kind": "archer", "scope": "step"}])
def test_ddp_ranks_select_as_one_process(sel, tmp_path):
    import torch.multiprocessing as mp

    batch, _cur = _step_batch()
    _obj(sel).advantages(batch)
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), sel, str(tmp_path / "out")), nprocs=2, join=True)
    got = [torch.load(f"{tmp_path / 'out'}.{r}") for r in range(2)]
    assert torch.equal(torch.cat([g["sel"] for g in got]), batch.token_select)
    for g in got:
        assert g["info"]["token_selection/tokens"] == 32
        assert g["info"]["token_selection/selected"] == int(batch.token_select.sum())


# ------------------------------------------------------------------------------------------- settings

def test_refused_and_inert_settings():
    from pydantic import ValidationError

    from composer.checks.validate import validate_file

    with pytest.raises(ValidationError, match="use ratio: token and bound: clip"):
        Grpo(ratio="sequence", token_selection={"kind": "entropy"})
    with pytest.raises(ValidationError, match="use ratio: token and bound: clip"):
        Grpo(bound="cispo", token_selection={"kind": "archer"})
    for bad in ({"kind": "entropy", "rho": 0.0}, {"kind": "archer", "quantile": 1.0},
                {"kind": "archer", "high_entropy_kl_coef": -1.0}, {"kind": "archer", "quantiel": 0.8}):
        with pytest.raises(ValidationError):
            Grpo(token_selection=bad)
    with pytest.raises(ValueError, match="needs batch.old_entropy"):
        b = _batch()
        b.old_entropy = None
        _obj({"kind": "entropy"}).advantages(b)
    # Archer's high-entropy clip cannot act at one on-policy update per step: a warning that says so
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    v = validate_file(root / "specs" / "methods" / "archer.yaml", ["train.epochs=1"])
    warned = [d.message for d in v.warnings if "archer's clip of the high-entropy tokens" in d.message]
    assert warned and "only the classes' KL coefficients differ" in warned[0], [d.message for d in v.warnings]


def test_listed_explained_and_refused_on_openrlhf():
    from pathlib import Path

    from composer import registry
    from composer.backends.openrlhf import flags
    from composer.backends.openrlhf.flags import Unsupported
    from composer.checks.validate import validate_file
    from composer.plan.compile import compile_plan
    from composer.plan.explain import text

    root = Path(__file__).resolve().parent.parent / "specs" / "methods"
    assert {"entropy", "archer"} <= set(registry.kinds("token_selection"))
    assert "80/20 high-entropy update: only the top max(1, ceil(0.2 N))" in text(
        compile_plan(validate_file(root / "entropy-8020.yaml")))
    assert "tokens whose old-policy entropy H_t is above the 0.8-quantile" in text(
        compile_plan(validate_file(root / "archer.yaml")))
    for name, extra in (("entropy-8020.yaml", ["rollout.filter.max_rounds=null"]), ("archer.yaml", [])):
        with pytest.raises(Unsupported) as e:  # (DAPO's capped refill is refused first: answered here)
            flags.check_capabilities(validate_file(root / name, extra).segments[0].spec, ())
        assert e.value.path == ("objective", "token_selection") and "entropy H_t" in e.value.reason


# ------------------------------------------------------------------------------------------- the releases' formulas

def release_8020_loss(old_log_prob, log_prob, advantages, response_mask, entropy, top_ratio=0.2, clip_low=0.2,
                      clip_high=0.28, clip_ratio_c=10.0):
    """The 80/20 release's policy loss (Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR, verl/trainer/ppo/core_algos.py:
    get_global_entropy_top_mask and compute_policy_loss_vanilla, token-mean), written out: the top
    max(1, int(n rho + 0.9999)) response tokens of the micro-batch by entropy (torch.topk), the dual-clip PPO
    per-token loss, and its masked mean over the response mask x the top mask (the kept tokens only)."""
    flat = entropy.flatten()
    where = response_mask.flatten().bool()
    k = max(1, int(int(where.sum()) * top_ratio + 0.9999))
    top = torch.zeros_like(flat)
    top[where.nonzero().squeeze(1)[torch.topk(flat[where], k=k).indices]] = 1
    top = top.view_as(entropy)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-advantages * clip_ratio_c, c1)
    losses = torch.where(advantages < 0, c2, c1)
    m = response_mask * top
    return (losses * m).sum() / m.sum(), top.bool()


def release_archer_loss(old_log_prob, log_prob, ref_log_prob, advantages, response_mask, entropy, q=0.8, kl_coef=0.001,
                        high_kl=0.0, low_eps=0.2, high_eps=0.5, clip_ratio_c=10.0):
    """Archer's release (wizard-III/ArcherCodeR: verl/workers/actor/dp_actor.py update_policy with
    use_token_entropy_separate, verl/trainer/ppo/core_algos.py compute_policy_loss), written out: per row the
    q-quantile of the response's entropies (torch.nanquantile, linear); tokens at or below it are the low class
    (clip low_eps), above it the high class (clip high_eps); dual clip c; pg = token-mean over the response mask;
    KL (low_var_kl = k3, clamped to +-10) as kl_coef x masked mean over the LOW tokens + high_kl x masked mean over the
    HIGH tokens. Returns (pg, the KL term, high mask, the low tokens' count)."""
    masked = torch.where(response_mask.bool(), entropy, torch.nan)
    tau = torch.nanquantile(masked, q=q, dim=-1, keepdim=True)
    low = (masked <= tau) & response_mask.bool()
    high = (masked > tau) & response_mask.bool()
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    l1 = -advantages * ratio
    clipped = torch.where(low, torch.clamp(ratio, 1 - low_eps, 1 + low_eps), torch.clamp(ratio, 1 - high_eps, 1 + high_eps))
    l2 = -advantages * clipped
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-advantages * clip_ratio_c, c1)
    losses = torch.where(advantages < 0, c2, c1)
    pg = (losses * response_mask).sum() / response_mask.sum()
    kl = ref_log_prob - log_prob
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    low_kl = (kld * low).sum() / low.sum()
    high_kl_term = (kld * high).sum() / high.sum().clamp(min=1)
    return pg, low_kl * kl_coef + high_kl_term * high_kl, high, int(low.sum())


def _peer_batch(seed=11):
    """8 rows in 2 groups of 4, 12 response tokens each; ratios up to e^+-0.7 so both clips and the dual clip act."""
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 13
    old = torch.cat([torch.zeros(B, 1), -torch.rand(B, T - 1, generator=g, dtype=torch.float64) * 2 - 0.05], 1)
    cur = old + torch.cat([torch.zeros(B, 1), (torch.rand(B, T - 1, generator=g, dtype=torch.float64) - 0.5) * 1.4], 1)
    h = torch.cat([torch.zeros(B, 1), torch.rand(B, T - 1, generator=g, dtype=torch.float64) * 3], 1)
    rewards = (1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0)
    b = _batch(old, h, rewards, (0, 0, 0, 0, 1, 1, 1, 1))
    b.initial_logprobs = (cur + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.4).float()
    return b, cur


def test_8020_parity_with_the_release():
    """One micro-batch that is the whole step: the same kept tokens; the release's loss = ours x N / N_kept (it
    divides by the kept tokens, ours by every response token as the paper's J), and so its gradient."""
    b, cur = _peer_batch()
    obj = _obj({"kind": "entropy", "rho": 0.2}, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    loss, grad, m, adv = _run(obj, b, cur)
    resp = (b.origin == CODE["policy"]).double()
    lp = cur.clone().requires_grad_(True)
    theirs, top = release_8020_loss(b.behavior_logprobs.double(), lp, adv.double()[:, None], resp,
                                    b.old_entropy.double())
    theirs.backward()
    n, kept = 8 * 12, int(top.sum())
    assert kept == math.ceil(0.2 * n) == m["token_selection/selected"]  # 19.2 -> 20
    assert torch.equal(top, b.token_select)
    assert float(theirs.detach()) == pytest.approx(loss * n / kept, abs=1e-5)
    assert torch.allclose(lp.grad, grad * n / kept, atol=1e-5)
    assert m["clip_frac"] > 0  # the clip acts on this batch


def test_archer_parity_with_the_release():
    """The same classes; the same policy-gradient loss and gradient (one token-mean, per-class clips, dual clip 10);
    the KL term: ours kl_coef x sum_low k / N, the release's kl_coef x sum_low k / N_low (the departure the spec
    names): equal after the factor N_low / N."""
    b, cur = _peer_batch(12)
    obj = _obj({"kind": "archer"}, clip=0.2, dual_clip=10.0, kl_coef=0.001)
    loss, grad, m, adv = _run(obj, b, cur)
    resp = (b.origin == CODE["policy"]).double()
    lp = cur.clone().requires_grad_(True)
    pg, kl_term, high, n_low = release_archer_loss(b.behavior_logprobs.double(), lp, b.initial_logprobs.double(),
                                                   adv.double()[:, None], resp, b.old_entropy.double())
    assert torch.equal(high, b.token_select)
    assert int(high.sum()) == 8 * 3  # per row: 12 tokens, the 0.8-quantile at rank 8.8 (between the 9th and 10th
    # smallest): the 10th, 11th and 12th are above it
    assert m["pg_loss"] == pytest.approx(float(pg.detach()), abs=1e-6)
    n = 8 * 12
    assert loss - m["pg_loss"] == pytest.approx(float(kl_term.detach()) * n_low / n, rel=1e-4, abs=1e-9)
    # the policy-gradient part's gradient: the release's pg alone against ours minus our KL gradient
    (pg + kl_term * n_low / n).backward()
    assert torch.allclose(lp.grad, grad, atol=1e-6)
    clipped_by_class = ((cur - b.behavior_logprobs.double()).exp() - 1).abs()
    assert bool(((clipped_by_class > 0.2) & (clipped_by_class < 0.5) & b.token_select).any())  # the classes differ here


# ------------------------------------------------------------------------------------------- the referee

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def test_referee_catches_a_wrong_quantile(tmp_path, monkeypatch):
    """A run whose Archer classes come from the 0.7-quantile (the spec says 0.8) fails the referee's recomputation
    of the choice, which is its own (Archer.reference_problem at a fresh forward's entropies)."""
    from composer.referee import referee

    real = Archer.choose_entropy
    monkeypatch.setattr(Archer, "choose_entropy", lambda self, h: real(self.model_copy(update={"quantile": 0.7}), h))
    rep = referee(ROOT / "specs" / "methods" / "archer.yaml", tmp_path)
    assert not rep.ok and rep.checks["token selection (archer) recomputed"].failed, rep.table()


def test_referee_catches_entropies_of_the_wrong_weights(tmp_path, monkeypatch):
    """A run that takes H_t from the frozen initial policy instead of the weights at the step's start (the same at
    step 0 only) fails "old-policy entropy recomputed": the referee's fresh forward of the recorded weights."""
    from composer.referee import referee
    from composer.runtime.context import RunContext
    from composer.runtime.models import batch_entropy

    monkeypatch.setattr(RunContext, "old_entropy",
                        lambda self, batch: batch_entropy(self.forward_model(self.initial_policy()), batch))
    rep = referee(ROOT / "specs" / "methods" / "entropy-8020.yaml", tmp_path)
    c = rep.checks["old-policy entropy recomputed"]
    assert not rep.ok and c.failed >= 1 and c.passed >= 1, rep.table()  # step 0 passes: the same weights there
