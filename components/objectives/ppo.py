"""PPO with a learned critic: per-token rewards, GAE, the clipped surrogate and the clipped value loss.

Schulman et al. 2017 (PPO, arXiv 1707.06347); GAE: Schulman et al. 2016 (arXiv 1506.02438); the RLHF form (KL to a
reference in the per-token reward, the sequence reward at the last token) of Ouyang et al. 2022 (InstructGPT) as
OpenRLHF 0.11.2 and TRL's PPOTrainer compute it (ALGORITHMS.md section 14). The value model is `critic`
(components/objectives/critic.py); its old values reach the batch as `batch.values` before the advantages.

Per token of the loss mask (the policy's actions; position t predicts tokens[b, t]):
  r_t   = -beta KL_t, plus the sequence reward R at the row's last action token; KL_t = k(log pi_old - log pi_ref)
  delta_t = r_t + gamma V_{t+1} - V_t  (V past the last action token is 0)
  A_t   = sum_l (gamma lambda)^l delta_{t+l};   G_t = A^c_t + V_t   (old values; A^c the same sum at the critic's
          lambda, `critic_lambda`, VAPO's decoupled GAE: 1.0 for the critic, the policy's own for A)
  lambda (the policy's) a number, or `adaptive`: per row 1 - 1/(alpha l), l its action tokens (VAPO, Yue et al.
          2025, arXiv 2504.05118, section 3.2, alpha 0.05), clamped to [0, 1]
  A     whitened over the step's action tokens (mean and std, or the mean only, or not at all)
  L_pi  = agg( -min(rho_t A_t, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_t) )
  L_V   = token-mean( 0.5 max((V - G)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - G)^2) )
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from components.objectives.base import Aggregation, InertSetting, Objective, Reduction, aggregate, masked_mean
from components.objectives.critic import Critic
from components.objectives.grpo import bounded_surrogate, kl_estimate, sampler_is_trainer, sequence_log_ratio
from composer.lazy import torch
from composer.registry import register

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch


def reward_kl(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """KL_t of the per-token reward: k(log pi - log pi_ref) per token (k1, k2, k3 of ALGORITHMS.md section 0), clamped
    to [-10, 10] as OpenRLHF's compute_approx_kl. logp, ref_logp [B, T] -> [B, T]."""
    return kl_estimate(logp.float() - ref_logp.float(), estimator).clamp(-10.0, 10.0)


def token_rewards(seq_reward: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """r_t = -kl_coef KL_t on the action tokens, plus the sequence reward at each row's last action token.

    seq_reward [B], mask [B, T] bool (actions), kl [B, T] or None -> r [B, T] (0 off the mask; a row without an
    action gets no reward)."""
    B, T = mask.shape
    r = torch.zeros((B, T), dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef:
        r = torch.where(mask, -kl_coef * kl.float(), r)
    pos = torch.arange(T, device=mask.device)[None].expand(B, T)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(1).values  # [B]: the last action's position, -1: none
    has = last >= 0
    r[has, last[has]] += seq_reward.to(r.device, r.dtype)[has]
    return r


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float | Tensor) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each row's action tokens, in order (GAE, Schulman et al. 2016):

      delta_j = r_j + gamma V_{j+1} - V_j,   A_j = delta_j + gamma lambda A_{j+1},   G_j = A_j + V_j
    with j running over the row's action positions (a position off the mask is skipped, not a step of the
    recursion) and V, A past the last action 0. rewards, values [B, T], mask [B, T] bool, lambd a number or [B] (one
    per row: VAPO's length-adaptive lambda) -> (A [B, T], G [B, T]), 0 off the mask. float32, as OpenRLHF's
    get_advantages_and_returns."""
    B, T = mask.shape
    n = mask.sum(1)  # [B]
    L = int(n.max()) if B else 0
    out_a = torch.zeros((B, T), dtype=torch.float32, device=mask.device)
    if L == 0:
        return out_a, out_a.clone()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :L]  # [B, L]: the action positions, in order
    valid = torch.arange(L, device=mask.device)[None] < n[:, None]  # [B, L]
    r = torch.where(valid, rewards.float().gather(1, order), torch.zeros((B, L), device=mask.device))
    v = torch.where(valid, values.float().gather(1, order), torch.zeros((B, L), device=mask.device))
    adv = torch.zeros((B, L), dtype=torch.float32, device=mask.device)
    running = torch.zeros(B, dtype=torch.float32, device=mask.device)
    next_v = torch.zeros(B, dtype=torch.float32, device=mask.device)
    decay = gamma * lambd if not torch.is_tensor(lambd) else gamma * lambd.to(mask.device, torch.float32)  # or [B]
    for j in reversed(range(L)):
        delta = r[:, j] + gamma * next_v - v[:, j]
        running = delta + decay * running
        adv[:, j] = running
        next_v = v[:, j]
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    out_a = out_a.scatter(1, order, adv)  # positions off the mask receive the invalid slots' zeros
    ret = torch.where(mask, out_a + values.float(), torch.zeros_like(out_a))
    return out_a, ret


def adaptive_lambda(mask: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda (Yue et al. 2025, arXiv 2504.05118, eq. 7): lambda = 1 - 1/(alpha l) per row,
    l its action tokens, clamped to [0, 1] (below l = 1/alpha the formula is negative; the paper's responses are
    thousands of tokens long and never reach it). mask [B, T] bool -> [B] float32."""
    n = mask.sum(1).to(torch.float32)  # [B]
    return (1.0 - 1.0 / (alpha * n.clamp(min=1.0))).clamp(0.0, 1.0)


def whiten(adv: Tensor, mask: Tensor, how: str) -> Tensor:
    """Advantages normalised over the step's action tokens (every rank's, under DDP: one all_reduce of the count
    and sum, one of the squared deviations). mean_std: (A - mean) / sqrt(max(var, 1e-8)), var the biased variance
    (OpenRLHF); mean: A - mean (OpenRLHF --algo.advantage.no_std_norm); none: A. adv, mask [B, T] -> [B, T], 0 off
    the mask."""
    if how == "none":
        return torch.where(mask, adv, torch.zeros_like(adv))
    m = mask.float()
    s = torch.stack([m.sum(), (adv.float() * m).sum()])
    dist = torch.distributed
    many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if many:
        dist.all_reduce(s)
    mean = s[1] / s[0].clamp(min=1)
    out = adv.float() - mean
    if how == "mean_std":
        sq = ((out * m) ** 2).sum()
        if many:
            dist.all_reduce(sq)
        out = out * (sq / s[0].clamp(min=1)).clamp(min=1e-8).rsqrt()
    return torch.where(mask, out, torch.zeros_like(out))


def value_loss_tokens(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss 0.5 max((V - G)^2, (V_old + clip(V - V_old, -eps, eps) - G)^2) (OpenRLHF
    ValueLoss, TRL), or 0.5 (V - G)^2 without a clip. values, old_values, returns [B, T] -> (loss [B, T], clipped
    [B, T] bool: the clipped branch is the larger one)."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    old = old_values.detach()
    clipped = (old + (values - old).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


@register("objective")
class Ppo(Objective):
    """PPO with a learned critic (Schulman et al. 2017, arXiv 1707.06347; GAE, Schulman et al. 2016, arXiv 1506.02438;
    KL in the per-token reward as InstructGPT, Ouyang et al. 2022, OpenRLHF and TRL):

      r_t = -kl_coef KL_t (+ R at the last action token);  A = GAE(gamma, lambd) over V_old from `critic`, lambd a
      number or VAPO's length-adaptive 1 - 1/(length_alpha l); the critic's targets at critic_lambda (decoupled GAE)
      L = agg(-min(rho A_t, clip(rho) A_t)) [+ value_coef L_V with a shared network]
    The critic (`critic`) learns L_V = 0.5 max((V - G)^2, (V_old + clip(V - V_old) - G)^2), G = A + V_old, on the
    same mini-batches and epochs as the policy. Reads a sequence reward (an outcome_reward or a reward_model
    source) and, with kl_coef > 0, the frozen initial policy.
    """

    kind: Literal["ppo"] = Field("ppo", description="Component kind.")
    critic: Critic = Field(default_factory=Critic, description="The value model: own network (default: the policy's weights + a scalar head) or a head on the policy; its lr and value clip.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount gamma (recipe 1).")
    lambd: Union[Annotated[float, Field(ge=0, le=1)], Literal["adaptive"]] = Field(0.95, description="GAE lambda of the policy's advantages (recipe 0.95; OpenRLHF --algo.advantage.lambd), or `adaptive`: VAPO's length-adaptive lambda 1 - 1/(length_alpha l) per response, l its action tokens, clamped to [0, 1].")
    length_alpha: float = Field(0.05, gt=0, allow_inf_nan=False, description="With `lambd: adaptive`: alpha of lambda = 1 - 1/(alpha l) (VAPO 0.05: lambda 0 at 20 tokens, 0.95 at 400, 0.995 at 4000).")
    critic_lambda: Optional[Annotated[float, Field(ge=0, le=1)]] = Field(None, description="GAE lambda of the critic's targets G = A + V_old, apart from the policy's (VAPO's decoupled GAE: 1.0, the Monte-Carlo return with gamma 1); null: the policy's lambd (one GAE for both, as OpenRLHF and TRL).")
    whiten: Literal["mean_std", "mean", "none"] = Field("mean_std", description="Normalise the advantages over the step's action tokens: mean and std (OpenRLHF, TRL), the mean only (OpenRLHF no_std_norm), or not at all.")
    kl_coef: float = Field(0.01, ge=0, allow_inf_nan=False, description="beta of the KL penalty in the per-token reward, r_t = -beta KL_t (OpenRLHF --algo.kl.init_coef 0.01; TRL 0.05); 0: no KL and no reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="KL_t of the reward: k1 = log pi_old - log pi_ref (OpenRLHF and TRL default), k2, k3; clamped to [-10, 10].")
    clip: float = Field(0.2, ge=0, description="Symmetric ratio clip epsilon of the policy loss.")
    clip_low: float | None = Field(None, ge=0, description="Lower ratio clip epsilon; overrides `clip` below 1.")
    clip_high: float | None = Field(None, ge=0, description="Upper ratio clip epsilon; overrides `clip` above 1.")
    loss_agg: Aggregation = Field("token-mean", description="Aggregation of the policy loss (OpenRLHF token-mean; the value loss is always a token mean).")

    needs: ClassVar = ("reward",)
    on_policy_only: ClassVar = True
    policy_gradient: ClassVar = True
    several_updates: ClassVar = ("importance ratio to the old log-prob (the policy at the start of the step's first "
                                 "pass); the value loss clipped to the old values")

    @model_validator(mode="after")
    def _alpha_with_adaptive(self):
        if "length_alpha" in self.model_fields_set and self.lambd != "adaptive":
            raise ValueError(f"length_alpha applies to `lambd: adaptive` (this objective's lambda is {self.lambd:g})")
        return self

    @field_validator("critic")
    @classmethod
    def _own_fields(cls, critic: Critic) -> Critic:
        if critic.network == "shared" and critic.model is not None:
            raise ValueError("critic.model names the value model's own checkpoint, and network: shared puts the head "
                             "on the policy's network; drop critic.model or use network: own")
        return critic

    # ---- what runs ----
    def value_model(self) -> Critic:
        return self.critic

    @property
    def wants_initial(self) -> bool:
        return self.kl_coef > 0

    def policy_lambda(self, mask: Tensor) -> float | Tensor:
        """The policy's GAE lambda: the number, or [B] per row (`adaptive`) from the rows' action tokens (mask [B, T])."""
        return adaptive_lambda(mask, self.length_alpha) if self.lambd == "adaptive" else self.lambd

    @property
    def decoupled(self) -> bool:
        """The critic's targets take their own lambda (VAPO's decoupled GAE)."""
        return self.critic_lambda is not None and self.critic_lambda != self.lambd

    def lambda_words(self) -> str:
        return (f"lambda_policy = 1 - 1/({self.length_alpha:g} l) per response (length-adaptive, VAPO; l its action "
                "tokens; clamped to [0, 1])" if self.lambd == "adaptive" else f"lambda {self.lambd:g}")

    def bounds(self) -> tuple[float, float]:
        return (self.clip if self.clip_low is None else self.clip_low,
                self.clip if self.clip_high is None else self.clip_high)

    def anchors(self) -> dict[str, str]:
        return {o: "importance ratio to the old log-prob; per-token GAE advantage from the critic" for o in self.loss_tokens}

    def reduction(self) -> Reduction:
        return Reduction(self.loss_agg)

    def describe(self) -> list[str]:
        lo, hi = self.bounds()
        whiten = {"mean_std": "whitened (mean, std) over the step's action tokens",
                  "mean": "centred (mean) over the step's action tokens", "none": "not normalised"}[self.whiten]
        kl = (f"r_t = -{self.kl_coef:g} x {self.kl_estimator}(log pi_old - log pi_ref) + R at the last token"
              if self.kl_coef else "r_t = R at the last token (no KL)")
        targets = (f"critic targets: G = A^c + V_old, A^c GAE at its own lambda {self.critic_lambda:g} (decoupled GAE; "
                   "the policy's advantages keep theirs)" if self.decoupled else
                   "critic targets: G = A + V_old (one GAE for both)")
        return [f"advantage: GAE gamma {self.gamma:g}, {self.lambda_words()} over the critic's old values; {kl}; "
                f"{whiten}", targets,
                f"ratio: per token; bound: PPO clip [1-{lo:g}, 1+{hi:g}]; aggregation: {self.loss_agg}",
                self.critic.describe()]

    def inert(self, spec) -> list[InertSetting]:
        """The clips cannot act with one on-policy update per step (the ratio is 1, V = V_old); the KL estimator
        without a KL; value_coef with an own network."""
        out = []
        t = spec.train
        if t.epochs * t.mini_batches == 1 and spec.sync.every == 1:
            if sampler_is_trainer(spec):  # else the ratio is the sampler's mismatch, on which the clip acts
                field = next((f for f in ("clip", "clip_low", "clip_high") if f in self.model_fields_set), "clip")
                out.append(InertSetting(field, "the PPO clip cannot act: one update per step on-policy, sampled by "
                                        "the hf engine on the trainer's own weights, keeps the ratio at 1", "update several times per "
                                        "step (train.epochs: 2 or train.mini_batches: 2)", severity="warning"))
            if self.critic.value_clip is not None:
                out.append(InertSetting("critic", "the value clip cannot act: with one update per step the value "
                                        "model is read at the weights that gave V_old (V = V_old)",
                                        "update several times per step (train.epochs: 2), or set critic.value_clip: "
                                        "null", severity="warning"))
        if "value_coef" in self.critic.model_fields_set and self.critic.network == "own":
            out.append(InertSetting("critic", "critic.value_coef weighs the value loss inside the policy's loss, and "
                                    "an own network is trained by its own optimizer", "drop critic.value_coef, or "
                                    "use network: shared"))
        if "kl_estimator" in self.model_fields_set and not self.kl_coef:
            out.append(InertSetting("kl_estimator", "kl_coef is 0: the reward has no KL term", "remove kl_estimator, "
                                    "or set kl_coef > 0"))
        return out

    def advantages(self, batch: TrajectoryBatch) -> Tensor:
        """A [B, T] per token (GAE over the critic's old values, whitened) and batch.returns [B, T] (G = A + V_old,
        before whitening), over the whole step (the whitening is a statistic of every action token of the step)."""
        if batch.rewards is None:
            raise ValueError("ppo: the batch has no rewards (a reward signal must fill batch.rewards)")
        if batch.values is None:
            raise ValueError("ppo: the batch has no values (the step reads the critic before the advantages)")
        mask = self.loss_mask(batch)  # [B, T]
        kl = None
        if self.kl_coef:
            if batch.initial_logprobs is None:
                raise ValueError("ppo: kl_coef > 0 needs batch.initial_logprobs (the frozen initial policy)")
            kl = reward_kl(batch.behavior_logprobs, batch.initial_logprobs, self.kl_estimator)  # [B, T]
            batch.info["reward_kl"] = float(masked_mean(kl, mask))
        r = token_rewards(batch.rewards, mask, kl, self.kl_coef)  # [B, T]
        lam = self.policy_lambda(mask)  # a number, or [B] (adaptive)
        adv, ret = gae(r, batch.values, mask, self.gamma, lam)  # [B, T] each
        if self.decoupled:  # the critic's targets from their own lambda (VAPO: 1.0, the Monte-Carlo return)
            _, ret = gae(r, batch.values, mask, self.gamma, self.critic_lambda)
        if torch.is_tensor(lam):
            has = mask.any(1)
            batch.info["lambda_policy"] = float(lam[has].mean()) if bool(has.any()) else 0.0
        batch.returns = ret
        return whiten(adv, mask, self.whiten)

    def advantage_metrics(self, batch) -> dict[str, float]:
        if batch.values is None or batch.returns is None:
            return {}
        mask = self.loss_mask(batch)
        out = {"values_mean": float(masked_mean(batch.values.float(), mask)),
               "returns_mean": float(masked_mean(batch.returns.float(), mask))}
        for key in ("reward_kl", "lambda_policy"):
            if key in batch.info:
                out[key] = batch.info[key]
        return out

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv: Tensor) -> tuple[Tensor, dict[str, float]]:
        """agg(-min(rho A_t, clip(rho) A_t)) over the loss tokens (+ value_coef L_V with a shared network: `cur.values`)."""
        mask = self.loss_mask(batch)  # [B, T]
        adv = adv.to(cur.logprobs.device, cur.logprobs.dtype)  # [B, T]
        old = batch.old_logprobs if batch.old_logprobs is not None else batch.behavior_logprobs  # [B, T]
        lo, hi = self.bounds()
        log_r = sequence_log_ratio(cur.logprobs, old, mask, "token")  # [B, T]
        loss_tok, bounded, ratio = bounded_surrogate(cur.logprobs, log_r, adv, "clip", lo, hi)
        pg = aggregate(loss_tok, mask, self.loss_agg)
        metrics = {"pg_loss": float(pg.detach()), "clip_frac": float(masked_mean(bounded.float(), mask)),
                   "ratio_mean": float(masked_mean(ratio.detach().float(), mask)),
                   "adv_mean": float(masked_mean(adv.float(), mask))}
        total = pg
        if self.critic.network == "shared":
            if cur.values is None:
                raise ValueError("ppo: critic.network shared needs the policy view's values (the step computes them)")
            vl, vm = self.critic_loss(batch, cur.values)
            total = total + self.critic.value_coef * vl
            metrics.update(vm)
        return total, metrics

    # ---- the referee's formulas (DESIGN.md section 10): written again row by row in float64 from the spec's numbers,
    # calling none of the functions above

    def reference_gae(self, rewards: list[float], behaviour, ref, values, mask) -> tuple:
        """(A [B, T] whitened, G [B, T]): per-token rewards r_t = -kl_coef k(log pi_behaviour - log pi_ref) (k1 d,
        k2 d^2 / 2, k3 exp(-d) + d - 1 with d clamped to +-20, the value clamped to +-10) plus the sequence reward at
        the last action; delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1} over each row's
        action positions, lambda the row's (a number, or 1 - 1/(length_alpha n) clamped to [0, 1] with n the row's
        action count); G_t = C_t + V_t with C the same recursion at critic_lambda (A itself without one); then
        `whiten` over the step's action tokens (mean, or mean and std with the variance floored at 1e-8). behaviour,
        ref, values [B, T] (ref None without a KL), mask [B, T] bool."""
        import torch

        def k(d: float) -> float:
            if self.kl_estimator == "k1":
                x = d
            elif self.kl_estimator == "k2":
                x = 0.5 * d * d
            else:
                dc = max(min(d, 20.0), -20.0)
                x = math.exp(-dc) + dc - 1
            return max(min(x, 10.0), -10.0)

        B, T = mask.shape
        A = torch.zeros((B, T), dtype=torch.float64)
        G = torch.zeros((B, T), dtype=torch.float64)
        beh = behaviour.detach().cpu().double()
        for i in range(B):
            pos = mask[i].nonzero().flatten().tolist()
            if not pos:
                continue
            r = [0.0] * len(pos)
            if self.kl_coef:
                r = [-self.kl_coef * k(float(beh[i, p] - ref[i, p])) for p in pos]
            r[-1] += rewards[i]
            v = [float(values[i, p]) for p in pos]
            if self.lambd == "adaptive":
                lam = min(1.0, max(0.0, 1.0 - 1.0 / (self.length_alpha * len(pos))))
            else:
                lam = self.lambd
            lam_c = lam if self.critic_lambda is None else self.critic_lambda
            running, running_c, nxt = 0.0, 0.0, 0.0
            for j in reversed(range(len(pos))):
                delta = r[j] + self.gamma * nxt - v[j]
                running = delta + self.gamma * lam * running
                running_c = delta + self.gamma * lam_c * running_c
                A[i, pos[j]] = running
                G[i, pos[j]] = running_c + v[j]
                nxt = v[j]
        xs = A[mask]
        if self.whiten != "none" and xs.numel():
            mean = float(xs.sum()) / xs.numel()
            A = torch.where(mask, A - mean, A)
            if self.whiten == "mean_std":
                var = float(((xs - mean) ** 2).sum()) / xs.numel()
                A = torch.where(mask, A / math.sqrt(max(var, 1e-8)), A)
        return A, G

    def reference_policy_loss(self, A, cur, old, mask) -> tuple:
        """(value, d value / d log pi [B, T]) of the clipped surrogate -min(rho A_t, clip(rho, 1 - lo, 1 + hi) A_t),
        rho = exp(log pi - log pi_old), aggregated by loss_agg (the aggregation's reference weights); A, cur, old
        [B, T] float64, mask [B, T] bool."""
        import torch

        from components.objectives.base import reference_token_weights

        lo, hi = self.bounds()
        rho = torch.exp(cur - old)
        cl = rho.clamp(1 - lo, 1 + hi)
        inside = (rho >= 1 - lo) & (rho <= 1 + hi)
        tok = -torch.minimum(rho * A, cl * A)
        dtok = torch.where(inside | (rho * A <= cl * A), -A * rho, torch.zeros_like(rho))
        w = reference_token_weights(mask, self.loss_agg, None, getattr(self, "norm_const", None))  # [B, T]
        return float((w * tok * mask).sum()), w * dtok * mask, w

    def critic_loss(self, batch: TrajectoryBatch, values: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The value loss of `values` [B, T] (the critic now) against the batch's returns, clipped to its old values:
        token-mean over the action tokens."""
        mask = self.loss_mask(batch)
        tok, clipped = value_loss_tokens(values, batch.values.to(values.device), batch.returns.to(values.device),
                                         self.critic.value_clip)
        loss = aggregate(tok, mask, "token-mean")
        return loss, {"critic/loss": float(loss.detach()), "critic/clip_frac": float(masked_mean(clipped.float(), mask)),
                      "critic/values": float(masked_mean(values.detach().float(), mask))}

    def critic_normalizer(self, batch: TrajectoryBatch) -> Tensor:
        """What the value loss divides by on `batch` (its action tokens): a backend scales micro-batch and rank parts
        by it, as `normalizer` for the policy loss."""
        return self.loss_mask(batch).float().sum()
