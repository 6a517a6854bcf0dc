"""The grpo objective against TRL's GRPOTrainer loss on the same batch (issue 23).

TRL (the bench extra) computes its GRPO-family losses in `GRPOTrainer._compute_loss`. We call that method
itself on a minimal stand-in for the trainer (the attributes it reads), with the per-token log-probs the
"model" returns given directly, and feed the same completions, masks, advantages, old log-probs and reference
log-probs to the composer's `grpo` loss. Loss values and gradients w.r.t. the log-probs must agree to 1e-6 for
every loss_type TRL has that the composer expresses, both importance_sampling_level values, epsilon /
epsilon_high, delta (TRL's two-sided clip = the composer's dual_clip) and beta.

Intended differences (docs/spec-language.md, "The policy-gradient family: the parts", "Against TRL"):
  - dr_grpo: TRL divides by rows x max_completion_length; the composer's seq-mean-token-sum-norm by one
    constant C (norm_const): C = B x L gives TRL's number.
  - cispo: TRL caps the weight at `epsilon_high` itself; the composer clips it to [1 - clip_low, 1 + clip_high]
    (the paper's form): clip_high = epsilon_high - 1 and clip_low = 1 (no lower bound) give TRL's number.
  - sapo is `bound: sapo` (sapo_tau_pos / sapo_tau_neg = TRL's sapo_temperature_pos / _neg), seq-mean-token-mean
    (TRL's aggregation for it): equal, to 4e-8 at tau_neg 1.05: TRL's `torch.where(advantages > 0, tau_pos,
    tau_neg)` makes the temperatures a float32 tensor (1.05 -> 1.0499999523) whatever the log-probs' dtype, the
    composer keeps them in the log-probs' dtype (the same in a float32 run); temperatures exact in float32 (3, 0.5)
    agree to 4e-16. vespo (gamma weights) is not a composer bound. TRL's loss types `grpo` and
    `sapo` count an empty row as a sequence of loss 0, the composer's seq-means skip it (no empty rows here).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

from components.objectives.grpo import Grpo  # noqa: E402
from composer.batch import PolicyView, TrajectoryBatch  # noqa: E402
from composer.origins import CODE  # noqa: E402

B, P, L = 6, 3, 7  # rows, prompt tokens, completion tokens
TOL = 1e-6
REPORT: dict[str, float] = {}  # combination -> largest difference (printed by the last test)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 3, 6, 1, 4])  # ragged responses, none empty
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(torch.float64)  # [B, L]
    old = -torch.rand(B, L, generator=g, dtype=torch.float64) * 2 - 0.1  # [B, L]
    # current log-probs: old moved by up to +-0.6 so the ratio leaves every clip range, both directions
    cur = old + (torch.rand(B, L, generator=g, dtype=torch.float64) - 0.5) * 1.2
    ref = old + (torch.rand(B, L, generator=g, dtype=torch.float64) - 0.5) * 0.4
    adv = torch.tensor([1.3, -0.7, 0.4, -1.9, 0.9, -0.2], dtype=torch.float64)
    return mask, old, cur, ref, adv


class _Acc:
    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def trl_loss(loss_type, level, eps_low, eps_high, beta, delta, cur, old, ref, adv, mask, sapo_tau=(1.0, 1.05)):
    """TRL's own `_compute_loss`, on a stand-in trainer whose model returns `cur` as the completion log-probs."""
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (cur, torch.zeros_like(cur), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1,
                             sapo_temperature_pos=sapo_tau[0], sapo_temperature_neg=sapo_tau[1]),
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=L, accelerator=_Acc(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)))
    inputs = {"prompt_ids": torch.ones(B, P, dtype=torch.long), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.ones(B, L, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)


def composer_loss(obj: Grpo, cur, old, ref, adv, mask):
    """The composer's grpo loss on the same numbers, laid out as a TrajectoryBatch [prompt | response | pad]."""
    T = P + L
    origin = torch.full((B, T), CODE["pad"], dtype=torch.uint8)
    origin[:, :P] = CODE["prompt"]
    origin[:, P:] = torch.where(mask.bool(), torch.tensor(CODE["policy"], dtype=torch.uint8),
                                torch.tensor(CODE["pad"], dtype=torch.uint8))

    def full(x):  # [B, L] -> [B, T], zeros on the prompt
        return torch.cat([torch.zeros(B, P, dtype=x.dtype), x], dim=1)

    batch = TrajectoryBatch(tokens=torch.ones(B, T, dtype=torch.long), origin=origin, behavior_logprobs=full(old),
                            group=torch.arange(B) // 3, control=torch.ones(B, dtype=torch.bool),
                            initial_logprobs=full(ref))
    loss, _ = obj.loss(batch, PolicyView(full(cur)), adv)
    return loss


def composer_objective(loss_type, level, eps_low, eps_high, beta, delta) -> Grpo:
    agg = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "luspo": "seq-mean-token-sum",
           "dr_grpo": "seq-mean-token-sum-norm", "cispo": "token-mean", "sapo": "seq-mean-token-mean"}[loss_type]
    fields = dict(ratio=level, loss_agg=agg, kl_coef=beta, kl_estimator="k3")
    if loss_type == "dr_grpo":
        fields["norm_const"] = float(B * L)  # TRL: rows x max_completion_length
    if loss_type == "cispo":
        fields.update(bound="cispo", clip_low=1.0, clip_high=eps_high - 1.0)  # TRL's cap is epsilon_high itself
    elif loss_type == "sapo":  # eps_low / eps_high carry the temperatures here (TRL reads no epsilon for sapo)
        fields.update(bound="sapo", sapo_tau_pos=eps_low, sapo_tau_neg=eps_high)
    else:
        fields.update(clip_low=eps_low, clip_high=eps_high, dual_clip=delta)
    return Grpo(**fields)


CLIPPED = ["grpo", "bnpo", "dapo", "dr_grpo", "luspo"]
COMBOS = ([(lt, lvl, lo, hi, beta, delta) for lt, lvl, (lo, hi), beta, delta in itertools.product(
    CLIPPED, ["token", "sequence"], [(0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)], [0.0, 0.04], [None, 1.5])]
    + [("cispo", lvl, 0.2, hi, beta, None) for lvl, hi, beta in itertools.product(
        ["token", "sequence"], [1.2, 5.0], [0.0, 0.04])]
    # sapo: (tau_pos, tau_neg) in the epsilon slots: the paper's (1.0, 1.05) and a steep, reversed pair
    + [("sapo", lvl, tp, tn, beta, None) for lvl, (tp, tn), beta in itertools.product(
        ["token", "sequence"], [(1.0, 1.05), (3.0, 0.5)], [0.0, 0.04])])


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(x) for x in c))
def test_loss_and_gradient_equal_trl(combo):
    loss_type, level, lo, hi, beta, delta = combo
    mask, old, cur, ref, adv = _data()
    cur_trl = cur.clone().requires_grad_(True)
    cur_ours = cur.clone().requires_grad_(True)
    theirs = trl_loss(loss_type, level, lo, hi, beta, delta, cur_trl, old, ref, adv, mask, sapo_tau=(lo, hi))
    ours = composer_loss(composer_objective(*combo), cur_ours, old, ref, adv, mask)
    theirs.backward()
    ours.backward()
    diff = abs(float(theirs.detach()) - float(ours.detach()))
    gdiff = float((cur_trl.grad - cur_ours.grad).abs().max())
    REPORT["-".join(str(x) for x in combo)] = max(diff, gdiff)
    assert float(theirs.detach()) != 0.0
    assert diff <= TOL, (float(theirs.detach()), float(ours.detach()))
    assert gdiff <= TOL


def test_the_clip_acted_in_the_comparison():
    """The batch moves ratios past every clip range, so clip and delta change the number (not inert)."""
    mask, old, cur, ref, adv = _data()
    a = composer_loss(Grpo(clip_low=0.2, clip_high=0.2, kl_coef=0.0), cur, old, ref, adv, mask)
    b = composer_loss(Grpo(clip_low=0.2, clip_high=0.28, kl_coef=0.0), cur, old, ref, adv, mask)
    c = composer_loss(Grpo(clip=0.2, dual_clip=1.5, kl_coef=0.0), cur, old, ref, adv, mask)  # delta 1.5 above
    d = composer_loss(Grpo(clip=10.0, kl_coef=0.0), cur, old, ref, adv, mask)
    assert len({round(float(x), 9) for x in (a, b, c, d)}) == 4


def test_the_sapo_gate_acted_in_the_comparison():
    """The batch's ratios leave 1 far enough that SAPO's gate weight 4 s (1 - s) differs from 1 (by more than 1e-3)
    on most tokens, and the temperatures change the number: the comparison above tests the gate, not GRPO at r = 1."""
    mask, old, cur, ref, adv = _data()
    tau = torch.where(adv[:, None] > 0, 1.0, 1.05)
    s = torch.sigmoid(tau * (torch.exp(cur - old) - 1.0))
    weight = 4 * s * (1 - s)
    assert int((((weight - 1).abs() > 1e-3) & mask.bool()).sum()) > mask.sum() / 2
    a = composer_loss(Grpo(bound="sapo", kl_coef=0.0), cur, old, ref, adv, mask)
    b = composer_loss(Grpo(bound="sapo", sapo_tau_pos=3.0, sapo_tau_neg=0.5, kl_coef=0.0), cur, old, ref, adv, mask)
    c = composer_loss(Grpo(kl_coef=0.0), cur, old, ref, adv, mask)
    assert len({round(float(x), 9) for x in (a, b, c)}) == 3


def test_report_largest_differences(capsys):
    if not REPORT:
        pytest.skip("run with the comparisons above")
    worst = max(REPORT.values())
    with capsys.disabled():
        print(f"\nTRL parity: {len(REPORT)} combinations, largest difference (loss or gradient) {worst:.3g}")
        for k, v in sorted(REPORT.items()):
            print(f"  {k}: {v:.3g}")
    assert worst <= TOL
