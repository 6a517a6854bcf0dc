"""Peer parity of grpo's KL-Cov, Clip-Cov, GMPO, GPG and TOPR settings: where the paper's released code (or verl, or
another framework) computes the same quantity, both get the same batch and must agree on the loss and on its
gradient w.r.t. the current log-probs (float64); where they differ on purpose, the test says how and checks it.

The peers' functions are copied below, verbatim up to the imports and the config objects they read (their
settings become keyword arguments with the config's defaults), each with its repository, path and commit:
  - KL-Cov / Clip-Cov (Cui et al. 2025, arXiv 2505.22617): verl `compute_policy_loss_kl_cov`,
    `compute_policy_loss_clip_cov` (the authors' code, PRIME-RL/Entropy-Mechanism-of-RL, merged into verl);
  - GMPO (Zhao et al. 2025, arXiv 2507.20673): the release callsys/GMPO `train_zero_math_gmpo.py`, and verl's
    adaptation `compute_policy_loss_geo_mean`;
  - GPG (Chu et al. 2025, arXiv 2504.02546): the release AMAP-ML/GPG `open-r1/src/open_r1/gpg_trainer.py`;
  - TOPR (Le Roux et al. 2025, arXiv 2503.14286): no release by the authors was found; alibaba/ROLL's
    `_compute_topr_loss` (a third-party implementation) uses the per-token ratio, so it is compared at
    `ratio: token`, and at the spec's `ratio: trajectory` only where the two coincide.
Each test's batch is one micro-batch holding the whole step (the project's step-wide statistics and normalisers,
the peers' per-micro-batch ones, then see the same tokens).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from components.objectives.grpo import Grpo
from composer.batch import PolicyView, TrajectoryBatch
from composer.origins import CODE

PAD, PR, POL = CODE["pad"], CODE["prompt"], CODE["policy"]
EXACT = 1e-12  # float64, the same operations in another order
F64 = torch.float64


# ================================================================================================ peers
# ---- verl: github.com/volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7
#      verl/utils/torch_functional.py (masked_sum, masked_mean), verl/trainer/ppo/core_algos.py (agg_loss,
#      compute_policy_loss_clip_cov, compute_policy_loss_kl_cov, compute_policy_loss_geo_mean).
#      Adaptation: `config.*` reads become keyword arguments (verl's defaults); `**config.global_batch_info` is
#      dropped (one data-parallel rank, the micro-batch is the global batch); the decorators are dropped.

def _verl_masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    s = _verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


verl_F = SimpleNamespace(masked_sum=_verl_masked_sum, masked_mean=_verl_masked_mean)


def verl_agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = verl_F.masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_F.masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        loss = torch.sum(seq_losses) / loss_scale_factor
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")

    return loss


def verl_compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_cov_ratio: float = 0.0002,
    cliprange: float = 0.2,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_cov_ub: float = 5.0,
    clip_cov_lb: float = 1.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    assert clip_cov_ratio > 0, "clip_ratio should be larger than 0."

    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio

    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange

    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)

    cov_all = (advantages - verl_F.masked_mean(advantages, response_mask)) * (
        log_prob - verl_F.masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf

    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)

    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)

    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0

    pg_clipfrac = verl_F.masked_mean((corr == 0).float(), response_mask)

    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr

    # Apply rollout correction weights if provided
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
    }
    return pg_loss, pg_metrics


def verl_compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
) -> tuple[torch.Tensor, dict[str, Any]]:
    assert kl_cov_ratio > 0, "kl_cov_ratio should be larger than 0."

    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = verl_F.masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1

    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()

    k = min(kl_cov_ratio, len(all_valid_adv))

    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices

        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = pg_losses_kl[
                large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            ]

    # Apply rollout correction weights if provided
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    pg_metrics = {
        "actor/ppo_kl": ppo_kl_abs.detach().item(),
    }
    return pg_loss, pg_metrics


def verl_compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    clip_ratio_low = clip_ratio_low if clip_ratio_low is not None else clip_ratio
    clip_ratio_high = clip_ratio_high if clip_ratio_high is not None else clip_ratio

    cliprange = clip_ratio
    cliprange_low = clip_ratio_low
    cliprange_high = clip_ratio_high
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange

    negative_approx_kl = log_prob - old_log_prob
    # Clamp negative_approx_kl for stability (uncomment it if you like)
    # negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)

    # Clipping at token-level & Clipping wider
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min

    # Geometric-Mean Policy Optimization
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    # we only support sequence level advantage for now,
    # otherwise, below would be not consistent with the paper
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio

    # Apply rollout correction weights if provided
    # For geo_mean, IS weights are 2D (batch_size, seq_length) and need to be aggregated to sequence level
    if rollout_is_weights is not None:
        # Aggregate token-level weights to sequence level using geometric mean for consistency
        # Note: rollout_is_weights is always 2D regardless of aggregation mode
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights

    pg_loss = torch.mean(pg_losses)

    # higher: ratio is too large that need clamp to clip_high (when adv > 0)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = verl_F.masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = verl_F.masked_mean((clipped * (advantages < 0)).float(), response_mask)
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics


# ---- GMPO's release: github.com/callsys/GMPO @ 205b2bf412f150cf96c29b33273b81bcd1a9b20f, train_zero_math_gmpo.py
#      ZeroMathLearner.compute_monte_carlo_advantages (lines 407-421; `self.args` -> arguments) and the
#      `critic_type_modify == "gmpo"` branch of learning_step (lines 675-688), which runs on a micro-batch of ONE
#      sequence (scripts/qwen2.5-math-7b-gmpo.sh: --train_batch_size_per_device 1, --cliprange 0.4,
#      --critic_type grpo, --num_ppo_epochs 1).

def gmpo_release_advantages(rewards, num_samples, critic_type="grpo"):
    rewards = rewards.sum(-1)
    # Compute monte carlo trajectory-level advantage
    values = rewards.view(-1, num_samples).mean(dim=1)
    values = values.repeat_interleave(num_samples, dim=0)
    advantages = rewards - values
    if critic_type == "grpo":
        # Additionally normalize by std.
        std_grouped_rewards = rewards.view(-1, num_samples).std(dim=1)
        std_grouped_rewards = std_grouped_rewards.repeat_interleave(
            num_samples, dim=0
        )
        advantages = advantages / (std_grouped_rewards + 1e-8)
    return advantages


def gmpo_release_loss(new_logps, mb_logps, mb_advantage, mb_response_masks, cliprange):
    low_cliprange = torch.tensor(-cliprange).to(new_logps)
    high_cliprange = torch.tensor(cliprange).to(new_logps)

    sgn_advantage = -1 if mb_advantage >= 0 else 1
    logprobs_diff = new_logps - mb_logps
    sgn_logprobs_diff = sgn_advantage * logprobs_diff
    sgn_logprobs_diff_clamp = torch.clamp(sgn_logprobs_diff, low_cliprange, high_cliprange)
    sgn_logprobs_diff_max = torch.max(sgn_logprobs_diff, sgn_logprobs_diff_clamp)
    logprobs_diff_max = sgn_advantage * sgn_logprobs_diff_max

    ratio = torch.exp(logprobs_diff_max[mb_response_masks].sum() / mb_response_masks.sum())
    pg_losses = -mb_advantage * ratio
    return pg_losses


# ---- GPG's release: github.com/AMAP-ML/GPG @ e096da8ce527a1636272469cee383ba71ec4a511,
#      open-r1/src/open_r1/gpg_trainer.py: GPGTrainer._generate_and_score_completions (the valid-group count,
#      lines 540-554, and the advantages / inverse_alpha, lines 614-626, one generation round: n_gen = 1) and
#      GPGTrainer.compute_loss (lines 284-318, beta = 0). `self.num_generations` / `self.args.*` -> arguments.

def gpg_release_advantages(rewards, num_generations, scale_rewards=False):
    n_valid_samples = 0
    stds = rewards.view(-1, num_generations).std(dim=1)
    identical_value_mask = stds == 0
    num_identical_reward_groups = identical_value_mask.sum().item()
    num_samples = stds.numel()
    n_valid_samples += num_samples - num_identical_reward_groups

    mean_grouped_rewards = rewards.view(-1, num_generations).mean(dim=1)
    std_grouped_rewards = rewards.view(-1, num_generations).std(dim=1)
    # Normalize the rewards to compute the advantages
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    std_grouped_rewards = std_grouped_rewards.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards:
        advantages = advantages / (std_grouped_rewards + 1e-4)

    inverse_alpha = n_valid_samples / num_samples
    inverse_alpha = min(1.0, inverse_alpha)
    return advantages, inverse_alpha


def gpg_release_loss(per_token_logps, advantages, completion_mask, inverse_alpha, adjust_gd=True):
    per_token_loss = - per_token_logps * advantages.unsqueeze(1)
    loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
    if adjust_gd:
        loss = loss / inverse_alpha
    return loss


# ---- TOPR in ROLL (Alibaba; not the paper's authors): github.com/alibaba/ROLL @
#      8eb27cc2dc34c4d1310b169d9b86d339004d811a, roll/pipeline/rlvr/actor_pg_worker.py (the ratio of loss_func,
#      `ratio = (log_probs - old_log_probs).exp()`, and _compute_topr_loss without its logging and metrics;
#      `data.batch['scores']` -> scores; topr_positive_weight = topr_negative_weight = 1, the defaults) and
#      roll/utils/functionals.py (agg_loss's seq-mean-token-sum branch, masked_sum).

def roll_masked_sum(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is not None:
        mask_sum = mask.sum(axis=dim)
        return torch.where(mask_sum > 0, (tensor * mask).sum(axis=dim), torch.zeros_like(mask_sum))
    else:
        return (tensor * mask).sum()


def roll_agg_loss_seq_mean_token_sum(loss_mat, loss_mask, batch_num_tokens=None, global_valid_samples=None,
                                     weights=None):
    if batch_num_tokens is None:
        batch_num_tokens = loss_mask.sum()
    if global_valid_samples is None:
        global_valid_samples = loss_mat.size(0)
    seq_losses = roll_masked_sum(loss_mat, loss_mask, dim=-1)  # token-sum
    valid_samples = torch.any(loss_mask > 0, dim=-1).float()
    if weights is None:
        weights = torch.ones(loss_mask.shape[0], device=loss_mask.device)
    loss = (seq_losses * weights * valid_samples).sum() / (global_valid_samples + 1e-8)  # seq-mean
    return loss


def roll_compute_topr_loss(log_probs, old_log_probs, advantages, scores, positive_weight=1.0, negative_weight=1.0):
    ratio = (log_probs - old_log_probs).exp()
    positive_mask = (scores > 0).float()
    negative_mask = (scores <= 0).float()

    # 计算损失组件
    positive_token_mask = positive_mask.unsqueeze(-1)
    negative_token_mask = negative_mask.unsqueeze(-1)

    positive_loss = - advantages * log_probs * positive_token_mask

    # 负样本: TIS更新，使用clipped importance sampling ratio
    # 梯度是: -[π(τ)/μ(τ)]_0^1 * R(τ) * ∇log π(τ)
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    negative_loss = - clipped_ratio * advantages * log_probs * negative_token_mask

    weighted_positive_loss = positive_weight * positive_loss
    weighted_negative_loss = negative_weight * negative_loss

    topr_loss = weighted_positive_loss + weighted_negative_loss
    return topr_loss


# ================================================================================================ helpers

def _batch(old: torch.Tensor, lens, rewards, group, P: int = 2) -> tuple[TrajectoryBatch, torch.Tensor]:
    """old [B, L] (the response's behaviour log-probs; positions past lens[i] are ignored) -> (the project's batch of
    P prompt tokens + L response positions, response mask [B, L] float64 for the peers)."""
    B, L = old.shape
    resp = (torch.arange(L)[None, :] < torch.as_tensor(lens)[:, None])  # [B, L] bool
    origin = torch.full((B, P + L), PAD, dtype=torch.uint8)
    origin[:, :P] = PR
    origin[:, P:][resp] = POL
    behav = torch.zeros(B, P + L, dtype=F64)
    behav[:, P:] = torch.where(resp, old, torch.zeros_like(old))
    b = TrajectoryBatch(tokens=(torch.arange(B * (P + L)).reshape(B, P + L) % 97) + 3, origin=origin,
                        behavior_logprobs=behav, group=torch.as_tensor(group), control=torch.ones(B, dtype=torch.bool),
                        rewards=torch.as_tensor(rewards, dtype=F64))
    return b, resp.to(F64)


def _ours(obj: Grpo, b: TrajectoryBatch, cur: torch.Tensor, P: int = 2):
    """The project's advantages, loss and gradient w.r.t. the response's current log-probs cur [B, L]."""
    adv = obj.advantages(b)  # [B]; the step's token selection too
    lp = torch.zeros(b.size, P + cur.shape[1], dtype=F64)
    lp[:, P:] = cur
    lp.requires_grad_(True)
    loss, metrics = obj.loss(b, PolicyView(logprobs=lp), adv)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(g[:, :P].abs().max()) == 0.0  # prompt tokens get no gradient
    return adv, loss.detach(), g[:, P:], metrics


def _peer_grad(fn, cur: torch.Tensor):
    lp = cur.clone().requires_grad_(True)
    loss = fn(lp)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def _diff(ours, theirs, resp):
    """(|loss difference|, max |gradient difference| over the response tokens)."""
    (l1, g1), (l2, g2) = ours, theirs
    return abs(float(l1) - float(l2)), float(((g1 - g2) * resp).abs().max())


# ================================================================================================ KL-Cov, Clip-Cov
# 4 groups x 4 rows, 480 response tokens: k = r = 0.01 picks int(0.01 * 480) = 4 tokens (both sides' formula).
LENS = [20, 25, 33, 28, 37, 22, 30, 39, 26, 35, 31, 24, 38, 29, 27, 36]
GROUP = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
L_MAX = 40


def _kl_cov_data(unselected_step: float):
    """Rewards with every group mixed (std-normalised A in {+-0.5, +-0.87, +-1.5}); log-probs in [-2, -0.05] except
    four planted tokens in rows with A < 0 at -7 .. -8.5, whose Cov_t (5.4 and more) is far above every other
    token's (at most 1.5 from the old log-probs, 1.9 from the current ones at step 0.5): both sides select these
    four.
    Current log-probs move the planted tokens by -0.6 .. +0.5 (|log rho| and rho outside the clip) and the others by
    at most +-`unselected_step`."""
    g = torch.Generator().manual_seed(11)
    rewards = [1, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0]
    old = -torch.rand(16, L_MAX, generator=g, dtype=F64) * 1.95 - 0.05
    step = (torch.rand(16, L_MAX, generator=g, dtype=F64) * 2 - 1) * unselected_step
    planted = [((7, 3), -7.0, 0.5), ((7, 10), -7.5, -0.6), ((1, 5), -8.0, 0.45), ((15, 8), -8.5, -0.3)]
    for (i, t), lp, d in planted:
        old[i, t], step[i, t] = lp, d
    b, resp = _batch(old, LENS, rewards, GROUP)
    want = torch.zeros(16, L_MAX, dtype=torch.bool)
    for (i, t), _, _ in planted:
        want[i, t] = True
    return b, resp, old, old + step, want


@pytest.mark.parametrize("case", ["clip-idle", "clip-opened"])
def test_kl_cov_matches_verl(case):
    """KL-Cov at specs/methods/kl-cov.yaml's settings (k 0.01, beta 1, clip 0.2, std-normalised group advantages,
    token-mean, no KL) against verl's compute_policy_loss_kl_cov (kl_cov_ratio 0.01, ppo_kl_coef 1, token-mean) on
    one micro-batch that is the whole step, fed the project's advantages: loss and gradient equal (float64).

    Intended differences, each neutralised here and said so:
      - the statistic: verl's Cov_t is per micro-batch from the CURRENT log-probs, the project's is over the whole
        step from the log-probs the step starts with (here the behaviour ones); the batch plants four tokens whose
        Cov_t leads by far under either, so both select the same four (k N = 4);
      - the unselected tokens: verl gives them the unclipped -A rho, the project keeps the PPO clip. clip-idle:
        every unselected ratio lies inside [0.8, 1.2], where the clip does not act, at the shipped clip 0.2;
        clip-opened: unselected ratios up to e^+-0.5, where the shipped clip differs from verl (checked), and the
        project's clip opened (clip_low 1, clip_high 1e9) equals it.
    """
    b, resp, old, cur, want_sel = _kl_cov_data(0.15 if case == "clip-idle" else 0.5)
    shipped = Grpo(token_selection={"kind": "kl_cov", "k": 0.01, "beta": 1.0}, kl_coef=0.0)
    obj = shipped if case == "clip-idle" else Grpo(token_selection={"kind": "kl_cov", "k": 0.01, "beta": 1.0},
                                                   kl_coef=0.0, clip_low=1.0, clip_high=1e9)
    adv, loss, g, m = _ours(obj, b, cur)
    assert b.token_select[:, 2:].equal(want_sel) and m["token_selection/selected"] == 4
    assert m["token_selection/tokens"] == 480 and sorted(set(adv.tolist())) != [0.0]

    A = adv[:, None] * resp  # verl's token-level advantages
    theirs = _peer_grad(lambda lp: verl_compute_policy_loss_kl_cov(old, lp, A, resp, "token-mean",
                                                                   kl_cov_ratio=0.01, ppo_kl_coef=1.0)[0], cur)
    dl, dg = _diff((loss, g), theirs, resp)
    assert dl < EXACT and dg < EXACT, (dl, dg)
    # the selection acts: the four tokens' gradient carries beta sign(log rho) / N on top of -A rho / N
    plain = -(A * (cur - old).exp()) / 480
    assert torch.allclose((g - plain)[want_sel].abs(), torch.full((4,), 1 / 480, dtype=F64), rtol=1e-9, atol=0)
    if case == "clip-opened":  # the shipped clip on unselected tokens: not verl's number
        _, loss_shipped, _, _ = _ours(shipped, b, cur)
        assert abs(float(loss_shipped) - float(theirs[0])) > 1e-3


def _clip_cov_data():
    """Every group 2 of 4 right (A = +-0.87). Rows with A > 0 hold log-probs in [-4, -3], rows with A < 0 in
    [-0.8, -0.05]: every such token has Cov_t < -0.6. Four planted tokens in rows with A > 0 at -0.4 .. -0.7 have
    Cov_t in 1.0 .. 1.4, inside the shipped band (0.02, 5), under the old log-probs and the current ones alike; their
    ratio stays within e^+-0.1, so verl's exclusion of tokens the PPO clip binds does not touch them. The other
    tokens move by up to +-0.4, so the PPO clip binds on many of them (both sides clip them alike)."""
    g = torch.Generator().manual_seed(5)
    rewards = [1, 0, 1, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    pos = torch.tensor(rewards, dtype=torch.bool)[:, None]
    lo = torch.where(pos, torch.full((16, 1), -4.0, dtype=F64), torch.full((16, 1), -0.8, dtype=F64))
    width = torch.where(pos, torch.full((16, 1), 1.0, dtype=F64), torch.full((16, 1), 0.75, dtype=F64))
    old = lo + torch.rand(16, L_MAX, generator=g, dtype=F64) * width
    step = (torch.rand(16, L_MAX, generator=g, dtype=F64) * 2 - 1) * 0.4
    planted = [((0, 4), -0.4, 0.08), ((4, 17), -0.5, -0.1), ((10, 9), -0.6, 0.05), ((14, 20), -0.7, -0.07)]
    want = torch.zeros(16, L_MAX, dtype=torch.bool)
    for (i, t), lp, d in planted:
        old[i, t], step[i, t] = lp, d
        want[i, t] = True
    b, resp = _batch(old, LENS, rewards, GROUP)
    return b, resp, old, old + step, want


def test_clip_cov_matches_verl():
    """Clip-Cov at specs/methods/clip-cov.yaml's settings (r 0.01, band 0.02 < Cov_t < 5, clip 0.2, std-normalised
    group advantages, token-mean, no KL) against verl's compute_policy_loss_clip_cov (clip_cov_ratio 0.01,
    clip_cov_lb 0.02, clip_cov_ub 5, clip 0.2, token-mean) on one micro-batch that is the whole step, fed the
    project's advantages: loss and gradient equal (float64).

    The random draw is made exact by the batch: the number to select, max(1, int(0.01 * 480)) = 4, equals the
    number of candidates in the band (4, on both sides), so verl's torch.randperm (global RNG; run under
    fork_rng so this test leaves the RNG as it was) and the project's seeded generator both take every candidate.
    Intended differences, neutralised by the batch: verl's Cov_t is per micro-batch from the current log-probs
    and leaves out tokens the PPO clip binds; the project's is over the step from the starting log-probs, with
    no exclusion (at the step's start the ratio is 1); the four planted tokens are the band's only members under
    either statistic and no clip binds on them.
    """
    b, resp, old, cur, want_sel = _clip_cov_data()
    obj = Grpo(token_selection={"kind": "clip_cov", "r": 0.01, "omega_low": 0.02, "omega_high": 5.0}, kl_coef=0.0)
    adv, loss, g, m = _ours(obj, b, cur)
    assert b.token_select[:, 2:].equal(want_sel)
    assert m["token_selection/candidates"] == 4 and m["token_selection/selected"] == 4
    A = adv[:, None] * resp
    clipped = (((cur - old).exp() > 1.2) & (A > 0)) | (((cur - old).exp() < 0.8) & (A < 0))
    assert int((clipped & (resp > 0)).sum()) > 50  # the PPO clip binds on many tokens: it is compared too

    def peer(lp):
        with torch.random.fork_rng():
            loss, metrics = verl_compute_policy_loss_clip_cov(old, lp, A, resp, "token-mean", clip_cov_ratio=0.01,
                                                              cliprange=0.2, clip_cov_lb=0.02, clip_cov_ub=5.0)
        assert metrics["actor/pg_clipfrac"] == pytest.approx(4 / 480, rel=1e-6)  # verl's count of corr = 0
        return loss

    theirs = _peer_grad(peer, cur)
    dl, dg = _diff((loss, g), theirs, resp)
    assert dl < EXACT and dg < EXACT, (dl, dg)
    assert float((g * want_sel).abs().max()) == 0.0 and float((theirs[1] * want_sel).abs().max()) == 0.0


# ================================================================================================ GMPO

def _gmpo_data():
    """Two groups of four (rewards mixed: A from the std-normalised group mean), ragged responses of 3..12 tokens,
    log-ratios up to +-0.9 so the 0.4 log-space clip binds on both sides."""
    g = torch.Generator().manual_seed(3)
    lens = [12, 5, 9, 3, 11, 7, 10, 4]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    old = -torch.rand(8, 12, generator=g, dtype=F64) * 2 - 0.05
    cur = old + (torch.rand(8, 12, generator=g, dtype=F64) * 2 - 1) * 0.9
    b, resp = _batch(old, lens, rewards, [0] * 4 + [1] * 4)
    return b, resp, old, cur, rewards


GMPO_SHIPPED = {"ratio": "sequence", "bound": "log_clip", "clip_low": 0.4, "clip_high": 0.4,
                "loss_agg": "seq-mean-token-mean", "kl_coef": 0.0}


def test_gmpo_matches_the_release():
    """GMPO at specs/methods/gmpo.yaml's settings (ratio: sequence, bound: log_clip, 0.4 / 0.4,
    seq-mean-token-mean, no KL) against callsys/GMPO's train_zero_math_gmpo.py (critic_type_modify gmpo,
    cliprange 0.4): loss and gradient equal (float64).

    The release updates one sequence per micro-batch (-A_i s_i, s_i its clipped geometric-mean ratio) and
    DeepSpeed averages the gradients over the accumulation steps and ranks: the peer's loss here is the mean of its
    per-row losses. The advantages are the release's too (compute_monte_carlo_advantages, std + 1e-8), equal to the
    project's estimator with eps 1e-8; the shipped spec uses verl's eps 1e-6 (a stated departure), and the loss is
    compared with the shipped estimator's advantages fed to both. A row with A = 0 (none here) takes the release's
    cap-above branch and the project's two-sided clip: its loss and gradient are 0 either way.
    The release builds its clip bounds as float32 tensors (torch.tensor(0.4) = 0.4000000059604645, then moved to the
    log-probs' dtype): against the project at that bound the loss and gradient agree to 1e-12; at the shipped 0.4
    they differ by that rounding only (at most 6e-9 max|A| e^0.4).
    """
    b, resp, old, cur, rewards = _gmpo_data()
    obj = Grpo(**GMPO_SHIPPED)
    adv, loss, g, m = _ours(obj, b, cur)
    assert m["clip_frac"] > 0.2  # the clip binds on a good share of the tokens

    rel_adv = gmpo_release_advantages(torch.tensor(rewards, dtype=F64)[:, None], 4)
    ours_1e8 = Grpo(**GMPO_SHIPPED, estimator={"kind": "group_mean", "std": "group", "eps": 1e-8}).advantages(b)
    assert float((rel_adv - ours_1e8).abs().max()) < EXACT
    assert 1e-7 < float((rel_adv - adv).abs().max()) < 1e-5  # the spec's eps 1e-6: the stated departure

    def peer(lp):
        rows = [gmpo_release_loss(lp[i:i + 1], old[i:i + 1], adv[i].reshape(1, 1), resp[i:i + 1].bool(), 0.4)
                for i in range(b.size)]
        return torch.cat(rows).mean()

    theirs = _peer_grad(peer, cur)
    dl, dg = _diff((loss, g), theirs, resp)
    # shipped 0.4: each row's log s moves by at most 6e-9 (the rounding), so -A s by at most 6e-9 max|A| e^0.4
    tol = 6e-9 * float(adv.abs().max()) * 1.5
    assert 0 < dl < tol and dg < tol, (dl, dg)
    eps32 = float(torch.tensor(0.4))  # the release's bound, float32-rounded
    _, loss32, g32, _ = _ours(Grpo(**{**GMPO_SHIPPED, "clip_low": eps32, "clip_high": eps32}), b, cur)
    dl, dg = _diff((loss32, g32), theirs, resp)
    assert dl < EXACT and dg < EXACT, (dl, dg)


def test_gmpo_matches_verl_geo_mean():
    """The same batch against verl's adaptation compute_policy_loss_geo_mean (clip_ratio 0.4; its loss is the mean
    over rows whatever loss_agg_mode says). verl divides the token sums by |o_i| + 1e-8 (the log-ratio's mean and the
    advantage's), the project by |o_i|: a relative difference of at most 1e-8 / 3 here (the shortest row has 3
    tokens), so the tolerance is 1e-8 relative, not 1e-12."""
    b, resp, old, cur, _ = _gmpo_data()
    adv, loss, g, _ = _ours(Grpo(**GMPO_SHIPPED), b, cur)
    theirs = _peer_grad(lambda lp: verl_compute_policy_loss_geo_mean(old, lp, adv[:, None] * resp, resp,
                                                                     "seq-mean-token-mean", clip_ratio=0.4)[0], cur)
    dl, dg = _diff((loss, g), theirs, resp)
    assert dl < 1e-8 * abs(float(loss)) and dg < 1e-8 * float(g.abs().max()), (dl, dg)


# ================================================================================================ GPG

def _gpg_data(rewards):
    g = torch.Generator().manual_seed(7)
    lens = [6, 3, 5, 8, 2, 7, 4, 8, 5, 1, 6, 3]
    old = -torch.rand(12, 8, generator=g, dtype=F64) * 2 - 0.05
    cur = old + (torch.rand(12, 8, generator=g, dtype=F64) * 2 - 1) * 0.5
    b, resp = _batch(old, lens, rewards, [0] * 4 + [1] * 4 + [2] * 4)
    return b, resp, cur


GPG_SHIPPED = {"estimator": {"kind": "group_mean", "std": "none"}, "bound": "none", "valid_rows_scale": True,
               "loss_agg": "token-mean", "kl_coef": 0.0}


def test_gpg_matches_the_release():
    """GPG at specs/methods/gpg.yaml's settings (group mean, no std; bound none; alpha = B / B_valid; token-mean; no
    KL) against AMAP-ML/GPG's GPGTrainer (scale_rewards false, as its config_v0_nostd.yaml; adjust_gd on, which
    divides the loss by inverse_alpha = valid groups / groups): advantages x alpha, loss and gradient equal
    (float64). The middle group's rewards are all equal (alpha = 12 / 8 = 1.5 on both sides). The release's loss is
    per micro-batch (token sum over the micro-batch's tokens), here the whole step."""
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    b, resp, cur = _gpg_data(rewards)
    adv, loss, g, _ = _ours(Grpo(**GPG_SHIPPED), b, cur)
    rel_adv, inv_alpha = gpg_release_advantages(torch.tensor(rewards, dtype=F64), 4)
    assert inv_alpha == pytest.approx(2 / 3, abs=1e-15)
    assert float((adv - rel_adv / inv_alpha).abs().max()) < EXACT
    theirs = _peer_grad(lambda lp: gpg_release_loss(lp, rel_adv, resp, inv_alpha), cur)
    dl, dg = _diff((loss, g), theirs, resp)
    assert dl < EXACT and dg < EXACT, (dl, dg)


def test_gpg_valid_rows_differ_from_the_release_with_graded_rewards():
    """The intended difference: the project's B_valid counts rows whose advantage is not 0 (the spec's alpha), the
    release counts every row of a group whose rewards are not all equal. They agree for 0/1 rewards (a row of a
    mixed group then never sits at the group mean); with graded rewards [1, 0.5, 0, 0.5] two rows have A = 0:
    the project's alpha is 12 / 6 = 2, the release's 12 / 8 = 1.5, and the losses differ by exactly that factor."""
    rewards = [1.0, 0.5, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    b, resp, cur = _gpg_data(rewards)
    adv, loss, g, _ = _ours(Grpo(**GPG_SHIPPED), b, cur)
    rel_adv, inv_alpha = gpg_release_advantages(torch.tensor(rewards, dtype=F64), 4)
    theirs = _peer_grad(lambda lp: gpg_release_loss(lp, rel_adv, resp, inv_alpha), cur)
    assert float((adv - 2.0 * rel_adv).abs().max()) < EXACT
    assert abs(float(loss) - float(theirs[0]) * 2.0 / 1.5) < EXACT
    assert float(((g - theirs[1] * 2.0 / 1.5) * resp).abs().max()) < EXACT


# ================================================================================================ TOPR

def _topr_data(negative_len):
    """Three groups of four with 0/1 rewards (the last all 0, so A = 0 there); rows with reward 1 are long, rows with
    reward 0 have `negative_len` tokens (None: ragged lengths); log-ratios up to +-0.6, so a negative trajectory's
    ratio falls on both sides of 1."""
    g = torch.Generator().manual_seed(9)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    ragged = [7, 4, 6, 3, 5, 8, 2, 7, 6, 1, 4, 5]
    lens = [n if (r > 0 or negative_len is None) else negative_len for n, r in zip(ragged, rewards)]
    old = -torch.rand(12, 8, generator=g, dtype=F64) * 2 - 0.05
    cur = old + (torch.rand(12, 8, generator=g, dtype=F64) * 2 - 1) * 0.6
    b, resp = _batch(old, lens, rewards, [0] * 4 + [1] * 4 + [2] * 4)
    return b, resp, old, cur, torch.tensor(rewards, dtype=F64)


TOPR_SHIPPED = {"estimator": {"kind": "group_mean", "std": "none"}, "ratio": "trajectory", "bound": "topr",
                "loss_agg": "seq-mean-token-sum", "kl_coef": 0.0}


def _roll(old, cur, adv, resp, scores):
    return _peer_grad(lambda lp: roll_agg_loss_seq_mean_token_sum(
        roll_compute_topr_loss(lp, old, adv[:, None] * resp, scores), resp.long()), cur)


def test_topr_token_ratio_matches_roll():
    """No TOPR code by the paper's authors was found; ROLL (Alibaba) implements it with the PER-TOKEN ratio
    sg(clip(pi(y_t)/mu(y_t), 0, 1)) on negative samples, which is the project's `ratio: token, bound: topr`
    (a setting of grpo, not the shipped spec's). With specs/methods/topr.yaml's other settings (group mean, no std,
    seq-mean-token-sum, no KL): loss and gradient equal. ROLL splits by the score (R > 0 positive), the project
    by the sign of A = R - mean_group R: the same split for 0/1 rewards (a row with A = 0, in an all-equal group,
    adds 0 either way). ROLL divides by (rows + 1e-8): a relative difference of about 1e-9, so the tolerance is
    1e-8 relative."""
    b, resp, old, cur, scores = _topr_data(None)
    obj = Grpo(**{**TOPR_SHIPPED, "ratio": "token"})
    adv, loss, g, m = _ours(obj, b, cur)
    assert m["clip_frac"] > 0  # some negative token's ratio is above 1: the truncation acts
    dl, dg = _diff((loss, g), _roll(old, cur, adv, resp, scores), resp)
    assert dl < 1e-8 * abs(float(loss)) and dg < 1e-8 * float(g.abs().max()), (dl, dg)


@pytest.mark.parametrize("negative_len", [1, None], ids=["one-token-negatives", "ragged-negatives"])
def test_topr_trajectory_ratio_against_roll(negative_len):
    """The shipped spec (ratio: trajectory: pi(tau)/mu(tau) = exp(sum_t log rho_t), the paper's) against ROLL's
    per-token form. Where every negative trajectory has one token, the trajectory ratio IS the token ratio, and the
    two agree (1e-8 relative, ROLL's + 1e-8); with longer negative trajectories they differ by design (the
    paper's trajectory weight against ROLL's token weights), and the project's `ratio: token` still equals ROLL."""
    b, resp, old, cur, scores = _topr_data(negative_len)
    adv, loss, g, _ = _ours(Grpo(**TOPR_SHIPPED), b, cur)
    neg = (adv < 0)[:, None] & (resp > 0)
    ratios = (cur - old).exp()
    assert bool((ratios[neg] > 1).any()) and bool((ratios[neg] < 1).any())  # both sides of the truncation
    dl, dg = _diff((loss, g), _roll(old, cur, adv, resp, scores), resp)
    if negative_len == 1:
        assert dl < 1e-8 * abs(float(loss)) and dg < 1e-8 * float(g.abs().max()), (dl, dg)
    else:
        assert dg > 1e-3
