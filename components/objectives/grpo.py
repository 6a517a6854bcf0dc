"""GRPO and the policy-gradient family: estimator x importance ratio x bound x aggregation x KL (DESIGN.md 9)."""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from components.objectives.base import (
    Aggregation,
    InertSetting,
    Objective,
    aggregate,
    Reduction,
    group_advantages,
    masked_mean,
    reference_token_weights,
)
from components.objectives.estimators import AnyEstimator, Estimator, GroupMean
from components.objectives.off_policy_weight import AnyOffPolicyWeight, NoOffPolicyWeight
from components.objectives.rollout_correction import AnyCorrection, NoCorrection
from components.objectives.token_selection import AnyTokenSelection, NoSelection
from composer.lazy import torch
from composer.capabilities import departures
from composer.registry import register
from composer.lang.curves import ScheduledNumber, describe, ever_nonzero, is_scheduled, resolved_number, values
from composer.origins import OFF_POLICY

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch


def kl_estimate(delta: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimator of delta = log pi_theta - log pi_ref (ALGORITHMS.md section 0; Schulman 2020).

    k1 = delta; k2 = 0.5 delta^2 (verl "mse"); k3 = exp(-delta) + delta - 1 (verl "low_var_kl",
    delta clamped to +-20 and the output to +-10). Any shape -> same shape.
    """
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta ** 2
    if estimator == "k3":
        d = delta.clamp(-20.0, 20.0)
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def clipped_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, clip_low: float,
                      clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO/GRPO clipped surrogate (Shao et al. 2024, arXiv 2402.03300; DAPO clip-higher, arXiv 2503.14476).

    logp, old_logp [B, T]; adv [B, T] (or broadcastable, e.g. [B, 1]) ->
      surrogate [B, T] = min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A), rho = exp(logp - old_logp)
      clipped [B, T] bool: the clipped branch is the strictly smaller one (verl pg_clipfrac)
      ratio [B, T]
    The log-ratio is clamped to +-20 before exp (verl), which only matters for absurd ratios.
    """
    ratio = torch.exp((logp - old_logp.detach()).clamp(-20.0, 20.0))  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [B, T]
    surrogate = torch.minimum(unclipped, clipped_obj)
    return surrogate, (clipped_obj < unclipped), ratio


def sequence_log_ratio(logp: Tensor, old: Tensor, mask: Tensor, level: str) -> Tensor:
    """The importance log-ratio at `level` (logp, old [B, T], mask [B, T] bool):
      token:          log rho_t = log pi(y_t) - log pi_old(y_t)                               -> [B, T]
      sequence:       log s_i = (1/|y_i|) sum_t m_t (log pi(y_t) - log pi_old(y_t))           -> [B, 1]
                      (GSPO, Zheng et al. 2025, arXiv 2507.18071; TRL importance_sampling_level=sequence)
      sequence-token: log s_it = sg[log s_i] + log pi(y_t) - sg[log pi(y_t)]                  -> [B, T]
                      (GSPO-token: the value of s_i with each token's own gradient)
    """
    d = torch.where(mask, logp - old.detach(), torch.zeros_like(logp))  # [B, T]
    if level == "token":
        return d
    if level == "trajectory":  # log pi(tau) / mu(tau) = sum_t log rho_t (TOPR, Le Roux et al. 2025, arXiv 2503.14286)
        return d.sum(-1, keepdim=True)  # [B, 1]
    seq = d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1).to(d.dtype)  # [B, 1]
    if level == "sequence":
        return seq
    return seq.detach() + logp - logp.detach()  # [B, T]


def bounded_surrogate(logp: Tensor, log_ratio: Tensor, adv: Tensor, bound: str, clip_low: float, clip_high: float,
                      dual_clip: float | None = None,
                      sapo_tau: tuple[float, float] = (1.0, 1.05)) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token policy-gradient loss of an importance ratio rho = exp(log_ratio) and its bound.

    logp [B, T] (the current log-probs), log_ratio [B, T] or [B, 1], adv [B, 1] -> (loss [B, T], bounded [B, T]
    or [B, 1] bool: where the bound acted, rho). With lo = 1 - clip_low, hi = 1 + clip_high:
      clip:  -min(rho A, clip(rho, lo, hi) A)      PPO (Schulman et al. 2017); clip-higher lo != hi (DAPO, Yu et al.
             2025, arXiv 2503.14476). dual_clip c: for A < 0 the loss is at most -c A (Ye et al. 2020, arXiv
             1912.09729), so a huge ratio on a negative advantage cannot blow it up.
      mask:  -rho A * 1[lo <= rho <= hi]           tokens whose ratio leaves [lo, hi] get no loss and no gradient
             (instead of the clip's flat branch, which still counts the token in both directions).
      cispo: -sg(clip(rho, lo, hi)) A log pi        CISPO (MiniMax-M1, arXiv 2506.13585): a REINFORCE term with a
             truncated, stop-gradient importance weight: every token keeps a gradient.
      topr:  -w A log pi, w = 1 for A >= 0, sg(clip(rho, 0, 1)) for A < 0   TOPR (Le Roux et al. 2025, arXiv
             2503.14286): positive trajectories train as SFT, negative ones with a truncated IS weight.
      none:  -A log pi                              plain policy gradient, no ratio (GPG, Chu et al. 2025, arXiv
             2504.02546); log_ratio is not read (bounded is all False, rho is 1).
      sapo:  -(4 / tau) sigmoid(tau (rho - 1)) A    SAPO's soft gate (Gao et al. 2025, arXiv 2511.20347), tau =
             sapo_tau[0] for A > 0, sapo_tau[1] otherwise: d l / d rho = -4 s (1 - s) A, s = sigmoid(tau (rho - 1)),
             the gate's weight 4 s (1 - s) is 1 at rho = 1 and decays smoothly away from it (no hard edge); bounded:
             where that weight differs from 1 by more than 1e-3.
    The log-ratio is clamped to +-20 before exp (verl), which only matters for absurd ratios.
    """
    if bound == "none":
        return -(adv * logp), torch.zeros_like(logp, dtype=torch.bool), torch.ones_like(logp)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    if bound == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, sapo_tau[0]), torch.full_like(adv, sapo_tau[1]))  # [B, 1]
        s = torch.sigmoid(tau * (ratio - 1.0))  # [B, T] or [B, 1]
        weight = (4.0 * s * (1.0 - s)).detach()  # d gate / d rho: 1 at rho = 1
        return -(4.0 / tau) * s * adv, (weight - 1.0).abs() > 1e-3, ratio
    if bound == "topr":
        w = torch.where(adv >= 0, torch.ones_like(ratio), ratio.clamp(0.0, 1.0)).detach()
        return -(w * adv * logp), (adv < 0) & (ratio > 1.0), ratio
    if bound == "cispo":
        w = ratio.clamp(lo, hi).detach()
        return -(w * adv * logp), (ratio < lo) | (ratio > hi), ratio
    if bound == "mask":
        keep = (ratio >= lo) & (ratio <= hi)
        loss = -(ratio * adv) * keep.to(ratio.dtype)
        return torch.where(keep, loss, torch.zeros_like(loss)), ~keep, ratio
    unclipped = ratio * adv
    clipped_obj = ratio.clamp(lo, hi) * adv
    surrogate = torch.minimum(unclipped, clipped_obj)
    bounded = clipped_obj < unclipped
    if dual_clip is not None:
        floor = dual_clip * adv  # [B, 1]
        lifted = (adv < 0) & (surrogate < floor)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, floor), surrogate)
        bounded = bounded | lifted
    return -surrogate, bounded, ratio


def geometric_log_clip(logp: Tensor, old: Tensor, mask: Tensor, adv: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, Tensor]:
    """GMPO's sequence log-ratio (Zhao et al. 2025, arXiv 2507.20673): each token's log-ratio clipped in log space,
    on the side the advantage's sign makes binding, before the geometric mean:
      log s_i = (1/|o_i|) sum_t sgn(A_i) min(sgn(A_i) l_t, sgn(A_i) clip(l_t, -clip_low, clip_high)),
      l_t = log pi(y_t) - log pi_old(y_t)
    (A > 0: l_t capped at clip_high; A < 0: floored at -clip_low; A = 0: the clip on both sides).
    logp, old, mask [B, T], adv [B, 1] -> (log s [B, 1], clipped [B, T] bool: tokens whose log-ratio the clip moved).
    """
    m = mask.to(logp.dtype)
    l = torch.where(mask, logp - old.detach(), torch.zeros_like(logp))  # [B, T]
    c = l.clamp(-clip_low, clip_high)
    sgn = torch.sign(adv)  # [B, 1]
    kept = torch.where(sgn > 0, torch.minimum(l, c), torch.where(sgn < 0, torch.maximum(l, c), c))  # [B, T]
    log_s = (kept * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return log_s, (kept != l) & mask


def valid_row_scale(adv: Tensor) -> Tensor:
    """GPG's alpha = B / B_valid (Chu et al. 2025, arXiv 2504.02546): rows over rows whose advantage is not 0,
    over every rank's rows (one all_reduce under DDP). adv [B] -> scalar (1 when no row is valid)."""
    s = torch.stack([torch.tensor(float(adv.numel()), dtype=torch.float64, device=adv.device),
                     (adv != 0).sum().to(torch.float64)])
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(s)
    return torch.where(s[1] > 0, s[0] / s[1].clamp(min=1), torch.ones_like(s[0]))


def sampler_is_trainer(spec) -> bool:
    """The sampler's log-probs are the trainer's (to float32 rounding): the Lightning backend's hf engine (or auto,
    which is hf without vLLM and a GPU) on its unrounded weights. vLLM (OpenRLHF's always, in bfloat16), or bf16
    rollout weights, differ by the training-inference mismatch (DESIGN.md section 11)."""
    r = spec.rollout
    return spec.train.backend == "lightning" and r.engine != "vllm" and r.precision != "bf16"


@register("objective")
class Grpo(Objective):
    """Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300), and the family:

      L = agg_t( l_t(rho, A) ) + kl_coef * agg_t( k(log pi_theta - log pi_init) )
    A from `estimator` (default: group mean / group std), rho the importance ratio at `ratio` level to the
    old log-prob, l_t the `bound` (clip, dual clip, mask, CISPO, SAPO's soft gate). The old log-prob is the policy's at the
    start of the step's first pass when the step makes several updates (train.epochs x train.mini_batches),
    else the behaviour log-prob of the sampler (the same weights on-policy). GSPO, Dr. GRPO, DAPO's
    objective, RLOO, REINFORCE++-baseline, CISPO, SAPO and NSR / PSR / W-REINFORCE are settings of these fields
    (specs/methods/).
    `token_selection` picks tokens of the whole step whose l_t changes: by a covariance (KL-Cov, Clip-Cov) or by the
    old policy's entropy (the 80/20 update keeps only the top 20%; Archer gives high-entropy tokens their own clip and
    KL coefficient). Loss tokens the policy
    did not write (a trace of the `traces` guide, a guide's prefix) take `off_policy_weight` w(pi) in place of the
    ratio and its bound: l_t = -A w(pi_theta(y_t)), no clip (LUFFY: w = pi / (pi + 0.1)).
    """

    kind: Literal["grpo"] = Field("grpo", description="Component kind.")
    estimator: Optional[AnyEstimator] = Field(None, description="Advantage estimator (group_mean, leave_one_out, reinforce_pp_baseline, soft_value, control_mean, sign_weighted); omitted: group_mean with std by group, or none when std_norm is false, eps std_eps.")
    ratio: Literal["token", "sequence", "sequence-token", "trajectory"] = Field("token", description="Importance ratio level: per token (PPO/GRPO), per sequence as exp of the length-normalised log-ratio (GSPO), its value with per-token gradients (GSPO-token), or the trajectory ratio pi(tau)/mu(tau) = exp(sum_t log rho_t) (TOPR).")
    bound: Literal["clip", "mask", "cispo", "topr", "log_clip", "none", "sapo"] = Field("clip", description="How the ratio is bounded: PPO clip of the surrogate; masking of tokens outside [1-clip_low, 1+clip_high]; CISPO's truncated stop-gradient weight sg(clip(rho, 1-clip_low, 1+clip_high)) on a REINFORCE term; TOPR's asymmetric truncation (weight 1 for A >= 0, sg(clip(rho, 0, 1)) for A < 0, on A log pi); GMPO's per-token clip of the log-ratio to [-clip_low, clip_high] inside the geometric-mean sequence ratio (ratio: sequence), loss -A s; none: plain policy gradient -A log pi with no ratio (GPG); or sapo: SAPO's soft gate, loss -(4/tau) sigmoid(tau (rho - 1)) A with tau sapo_tau_pos (A > 0) or sapo_tau_neg, whose gradient weight 4 s (1 - s) is 1 at rho = 1 and decays smoothly (no clip fields read).")
    valid_rows_scale: bool = Field(False, description="Multiply the advantages by alpha = B / B_valid, the step's rows over those whose advantage is not 0 (GPG, Chu et al. 2025, arXiv 2504.02546), counted over the whole step (every rank).")
    clip: float = Field(0.2, ge=0, description="Symmetric ratio clip epsilon.")
    clip_low: float | None = Field(None, ge=0, description="Lower clip epsilon (DAPO clip-higher); overrides `clip` below 1.")
    clip_high: float | None = Field(None, ge=0, description="Upper clip epsilon (DAPO: 0.28); overrides `clip` above 1.")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip PPO constant c (> 1, e.g. 3): with a negative advantage the loss is at most -c A. bound: clip only.")
    sapo_tau_pos: float = Field(1.0, gt=0, description="bound: sapo only: the soft gate's temperature tau for tokens of rows with A > 0 (Gao et al. 2025, arXiv 2511.20347: 1.0; TRL sapo_temperature_pos).")
    sapo_tau_neg: float = Field(1.05, gt=0, description="bound: sapo only: the soft gate's temperature for rows with A <= 0 (paper: 1.05, above tau_pos so the gradient of negative tokens decays faster; TRL sapo_temperature_neg).")
    std_norm: bool = Field(True, description="Divide group-centred rewards by the group std (False: Dr. GRPO). Shorthand for estimator: {kind: group_mean, std: group | none}.")
    loss_agg: Aggregation = Field("token-mean", description="Loss aggregation (verl default token-mean; the paper's form is seq-mean-token-mean; Dr. GRPO seq-mean-token-sum-norm).")
    norm_const: float | None = Field(None, gt=0, description="C of seq-mean-token-sum-norm (Dr. GRPO: the maximum generation length); default: the batch's padded length T.")
    kl_coef: ScheduledNumber = Field(0.001, description="Coefficient of the KL loss against the initial policy (0 disables; verl 0.001, DeepSeekMath 0.04); a number >= 0 or a schedule ({kind: linear|cosine|step, start, end, steps}).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator of the KL loss.")
    std_eps: float = Field(1e-6, gt=0, description="Added to the group std (with the default estimator).")
    token_selection: AnyTokenSelection = Field(default_factory=NoSelection, description="Step-wide token selection by Cov_t = (log pi - mean log pi)(A - mean A) over the whole step's loss tokens (every micro-batch and rank): none; kl_cov (KL-Cov: the top k N tokens get -A rho + beta |log rho| in place of the clipped term); clip_cov (Clip-Cov: r N random tokens with omega_low < Cov_t < omega_high get no gradient). Cui et al. 2025, arXiv 2505.22617. Or by the entropy H_t of the old policy's next-token distribution (the step's start, one forward with the full logits): entropy (the 80/20 update, Wang et al. 2025, arXiv 2506.01939: only the top rho = 20% of the step's tokens by H_t keep the policy-gradient loss, the others 0, all in the normaliser); archer (Archer's dual-token constraints, arXiv 2507.15778: tokens above the 0.8-quantile of their response's H_t get clip 0.5 and KL coefficient 0, the others the term's clip and kl_coef). Needs ratio: token and bound: clip.")

    off_policy_weight: AnyOffPolicyWeight = Field(default_factory=NoOffPolicyWeight, description="The importance weight w of loss tokens the policy did not write (demonstration: a trace of the `traces` guide; guide_prefix, guide_intervention), a function of the current policy's probability alone (the trace's own probability taken as 1): their loss is -A w(pi), no ratio, no clip. none (default: such tokens are refused in loss_tokens); shaped (LUFFY, Yan et al. 2025, arXiv 2504.14945: pi / (pi + gamma), gamma 0.1); prob (pi); pow (pi^alpha); log (log pi).")

    correction: AnyCorrection = Field(default_factory=NoCorrection, description="Rollout correction, apart from the policy ratio and its bound: each policy token's loss times a weight of rho = pi_old / mu, the trainer's log-prob at the step's start over the sampler's (vLLM, rollout.precision: bf16, a lagged engine). none (default); tis (truncated: min(rho, C), C 2); mis (masked: units whose rho leaves [1/C, C] rejected, per token, sequence or geometric mean); icepop (tokens outside [0.5, 5] get no gradient, the others weight rho). With a correction the old log-probs are the trainer's forward even at one update per step.")

    needs: ClassVar = ("reward",)
    policy_gradient: ClassVar = True
    uses_group_baseline: ClassVar = True
    several_updates: ClassVar = "importance ratio to the old log-prob (the policy at the start of the step's first pass)"

    @field_validator("kl_coef")
    @classmethod
    def _kl_coef_nonnegative(cls, value):
        if min(values(value)) < 0:
            raise ValueError("kl_coef must be >= 0 (a schedule's start and end too)")
        return value

    @model_validator(mode="after")
    def _token_selection_needs_the_token_clip(self):
        if self.token_selection.acts and (self.ratio != "token" or self.bound != "clip"):
            raise ValueError(f"token_selection {self.token_selection.kind} changes the PPO clipped surrogate of single "
                             f"tokens (Cui et al. 2025: KL-Cov replaces it by -A rho_t + beta |log rho_t|, Clip-Cov "
                             f"removes its gradient), and this grpo has ratio: {self.ratio}, bound: {self.bound}; use "
                             "ratio: token and bound: clip (the defaults)")
        return self

    @model_validator(mode="after")
    def _weighted_tokens_are_not_selected(self):
        if self.off_policy_weight.acts and self.token_selection.acts:
            raise ValueError(f"token_selection {self.token_selection.kind} selects by the covariance of log-probs the "
                             "policy sampled with their advantages (Cui et al. 2025), and off_policy_weight "
                             f"{self.off_policy_weight.kind} trains tokens the policy did not write, which no paper "
                             "selects among; use one of them (token_selection: {kind: none} or off_policy_weight: "
                             "{kind: none})")
        return self

    # The fields OpenRLHF's own PolicyLoss carries with its flags on the native route (composer/backends/openrlhf/
    # flags.py): estimator / std_norm -> --algo.advantage.estimator (group_norm, dr_grpo, rloo), clip, clip_low,
    # clip_high -> --actor.eps_clip_low_high, loss_agg -> --actor.loss_agg_mode (its two choices), kl_coef and
    # kl_estimator -> --algo.kl.use_loss / init_coef / estimator, correction -> --algo.advantage.is_correction_* (the
    # forms its `openrlhf_flags` maps). Every other field must keep its default there.
    OPENRLHF_CARRIES: ClassVar = ("kind", "estimator", "std_norm", "clip", "clip_low", "clip_high", "loss_agg",
                                  "kl_coef", "kl_estimator", "correction")
    OPENRLHF_AGG: ClassVar = ("token-mean", "seq-mean-token-mean")  # --actor.loss_agg_mode's choices

    def openrlhf_native(self) -> list[str]:
        """See Objective.openrlhf_native: the fields OPENRLHF_CARRIES leaves out, set away from their defaults, and
        carried fields at values OpenRLHF has no flag for. The mapping is this class's: a subclass (a plugin that
        changes the loss) has none unless it declares its own."""
        if type(self) is not Grpo:
            return super().openrlhf_native()
        out = [f"{name}: no OpenRLHF flag" for name in departures(self) if name not in self.OPENRLHF_CARRIES]
        est = self.est
        if est.native_flag() is None:
            out.append(f"estimator {est.kind} ({est.describe()}): no "
                       "--algo.advantage.estimator computes it")
        elif self.estimator is not None:
            out += [f"estimator.{name}: no OpenRLHF flag" for name in departures(est) if name not in ("kind", "std")]
        if self.loss_agg not in self.OPENRLHF_AGG:
            out.append(f"loss_agg {self.loss_agg}: --actor.loss_agg_mode takes {', '.join(self.OPENRLHF_AGG)}")
        if is_scheduled(self.kl_coef):
            out.append("kl_coef: a schedule (--algo.kl.init_coef is one number)")
        if self.correction.openrlhf_flags() is None:
            out.append(f"correction {self.correction.kind} ({self.correction.describe()}): no "
                       "--algo.advantage.is_correction_* setting computes it")
        return out

    def weighted_origins(self) -> set[str]:
        """The off-policy origins among loss_tokens when a weight form is declared (their loss -A w(pi))."""
        return set(self.loss_tokens) & set(OFF_POLICY) if self.off_policy_weight.acts else set()

    @property
    def wants_initial(self) -> bool:
        """The KL loss reads the frozen initial policy's log-probs (a token selection may give its tokens their own
        KL coefficient: Archer's high-entropy class)."""
        return ever_nonzero(self.kl_coef) or bool(self.token_selection.selected_kl_coef())

    @property
    def wants_old_entropy(self) -> bool:
        """An entropy token selection (entropy, archer) reads batch.old_entropy, the old policy's H_t per token."""
        return self.token_selection.acts and self.token_selection.by_entropy

    @property
    def wants_old(self) -> bool:
        """A rollout correction weighs pi_old / mu: the trainer's log-probs at the step's start, at every update."""
        return self.correction.acts

    @property
    def est(self) -> Estimator:
        """The estimator in force: the field, or group_mean built from std_norm / std_eps."""
        if self.estimator is not None:
            return self.estimator
        return GroupMean(std="group" if self.std_norm else "none", eps=self.std_eps)

    def group_baseline(self) -> bool:
        """The estimator's: a baseline from the group's rows (group_mean, leave_one_out, ...) or none (sign_weighted)."""
        return self.est.group_baseline

    def anchors(self) -> dict[str, str]:
        weighted = self.weighted_origins()
        return {o: (f"weight {self.off_policy_weight.describe()} of the current policy's probability (the trace's "
                    "own probability taken as 1; no ratio, no clip)" if o in weighted else
                    ("importance ratio to the old log-prob (the trainer's at the step's start), times the rollout "
                     f"correction's weight ({self.correction.kind}) of pi_old / mu" if self.correction.acts else
                     "importance ratio to the old log-prob (the behaviour log-prob when a step makes one update)"))
                for o in self.loss_tokens}

    def bounds(self) -> tuple[float, float]:
        return (self.clip if self.clip_low is None else self.clip_low,
                self.clip if self.clip_high is None else self.clip_high)

    def inert(self, spec) -> list[InertSetting]:
        """Clip bounds that cannot act or cannot be (a negative lower bound; `clip` hidden by clip_low and
        clip_high; any bound where one on-policy update per step keeps the ratio at 1), and a KL estimator
        without a KL loss."""
        out = []
        lo, hi = self.bounds()
        set_ = self.model_fields_set
        for name, eps in (("clip_low", self.clip_low), ("clip", self.clip if self.clip_low is None else None)):
            if eps is not None and eps > 1:
                out.append(InertSetting(name, f"{name} {eps:g} puts the lower ratio bound at 1 - {eps:g} = "
                                        f"{1 - eps:g}: an importance ratio is never negative, so that bound can "
                                        "never act", f"use {name} at most 1 (clip_low: 1 already means no lower "
                                        "bound; PPO's usual value is 0.2)"))
        if "clip" in set_ and self.clip_low is not None and self.clip_high is not None:
            out.append(InertSetting("clip", "clip is read only for a side that clip_low / clip_high leave unset, "
                                    "and both are set: clip is never used", "remove clip (or clip_low and "
                                    "clip_high)"))
        t = spec.train
        what = {"clip": f"the PPO clip [1-{lo:g}, 1+{hi:g}]", "mask": f"the mask [1-{lo:g}, 1+{hi:g}]",
                "cispo": f"CISPO's truncation [1-{lo:g}, 1+{hi:g}]", "topr": "TOPR's truncation [0, 1]",
                "log_clip": f"the log-ratio clip [-{lo:g}, {hi:g}]",
                "sapo": f"SAPO's soft gate (tau {self.sapo_tau_pos:g} / {self.sapo_tau_neg:g}; its gradient weight is "
                        "1 at ratio 1)"}.get(self.bound)  # none: no bound to act
        one = t.epochs * t.mini_batches == 1 and spec.sync.every == 1
        # engine-aware (DESIGN.md section 11): at one update per step the ratio's denominator is the sampler's log-prob,
        # so the ratio is 1 only where the sampler is the trainer (float32 weights in the hf engine); with vLLM or
        # bf16 rollout weights it is the mismatch, on which the bound acts. A correction makes the denominator the
        # trainer's own: then the ratio is exactly 1.
        ratio_one = one and (self.correction.acts or sampler_is_trainer(spec))
        why = ("the correction makes the ratio's denominator the trainer's own log-prob at the step's start, so "
               "at one update per step (train.epochs x train.mini_batches = 1, sync.every: 1) the ratio is 1; the "
               "mismatch is the correction's to weigh" if self.correction.acts else
               "one update per step on-policy (train.epochs x train.mini_batches = 1, sync.every: 1) computes the "
               "ratio at the weights that sampled the rollouts, unrounded (the hf engine, rollout.precision not "
               "bf16), so it is 1 up to float32 rounding")
        if what is not None and ratio_one:
            names = ("sapo_tau_pos", "sapo_tau_neg", "bound") if self.bound == "sapo" else \
                ("clip", "clip_low", "clip_high", "dual_clip")
            field = next((f for f in names if f in set_), names[-1] if self.bound == "sapo" else "clip")
            out.append(InertSetting(field, f"{what}{' and the dual clip' if self.dual_clip else ''} cannot act: "
                                    f"{why}, and the loss is the plain policy gradient",
                                    "to make the bound act, update several times per step (train.mini_batches: 2 "
                                    "or train.epochs: 2) or lag the sampler (sync.every > 1); else remove the "
                                    + ("bound" if self.bound == "sapo" else "clip settings"), severity="warning"))
        if self.bound != "sapo":
            for name in ("sapo_tau_pos", "sapo_tau_neg"):
                if name in set_:
                    out.append(InertSetting(name, f"{name} is the temperature of SAPO's soft gate, and bound is "
                                            f"{self.bound}: it is never read", "set bound: sapo, or remove " + name))
        else:
            for name in ("clip", "clip_low", "clip_high", "dual_clip"):
                if name in set_ and getattr(self, name) is not None:
                    out.append(InertSetting(name, f"bound: sapo replaces the clip by a soft gate of temperature "
                                            f"sapo_tau_pos / sapo_tau_neg and reads no clip: {name} is never used",
                                            f"remove {name} (SAPO's gate is shaped by sapo_tau_pos, sapo_tau_neg)"))
        sel = self.token_selection
        if sel.kind == "kl_cov" and sel.beta > 0 and ratio_one:
            out.append(InertSetting("token_selection", f"kl_cov's penalty {sel.beta:g} |log pi_theta - log pi_old| "
                                    "cannot act: one update per step on-policy keeps log pi_theta = log pi_old (up to "
                                    "the sampler's numerical mismatch), so the selected tokens train as -A rho only",
                                    "update several times per step (train.epochs: 2 or train.mini_batches: 2) or lag "
                                    "the sampler (sync.every > 1)", severity="warning"))
        if sel.kind == "archer" and ratio_one:
            out.append(InertSetting("token_selection", f"archer's clip of the high-entropy tokens [1-"
                                    f"{sel.high_entropy_clip_low:g}, 1+{sel.high_entropy_clip_high:g}] cannot act: "
                                    f"{why}; only the classes' KL coefficients differ",
                                    "update several times per step (train.epochs: 2 or train.mini_batches: 2; Archer: "
                                    "3 epochs x 2 mini-batches) or lag the sampler (sync.every > 1)", severity="warning"))
        if "off_policy_weight" in set_ and self.off_policy_weight.acts and not self.weighted_origins():
            out.append(InertSetting("off_policy_weight", f"off_policy_weight {self.off_policy_weight.kind} weighs loss "
                                    "tokens the policy did not write, and loss_tokens "
                                    f"({', '.join(self.loss_tokens)}) holds none", "add the trace tokens to "
                                    "loss_tokens (loss_tokens: [policy, demonstration] with a traces guide), or "
                                    "remove off_policy_weight"))
        if "kl_estimator" in set_ and not self.wants_initial:
            out.append(InertSetting("kl_estimator", f"kl_estimator {self.kl_estimator} with kl_coef "
                                    f"{describe(self.kl_coef)}: there is no KL loss, so the estimator is never "
                                    "computed", "remove kl_estimator, or set kl_coef > 0 (verl: 0.001)"))
        return out

    def advantages(self, batch: TrajectoryBatch) -> Tensor:
        """A [B] from the estimator over each whole group (default: (r_i - mean_g r) / (std_g r + eps))."""
        if batch.rewards is None:
            raise ValueError("grpo: the batch has no rewards (a reward signal must fill batch.rewards)")
        adv = self.est.estimate(batch.rewards, batch.group, batch.control)  # [B]
        adv = adv * valid_row_scale(adv).to(adv.dtype) if self.valid_rows_scale else adv
        if self.token_selection.acts:
            self.select_tokens(batch, adv)
        return adv

    def reference_advantages(self, rewards, group, control, policy_tokens):
        """The estimator's reference (its own file), then GPG's alpha = B / B_valid (rows over rows whose advantage
        is not 0) when valid_rows_scale."""
        out = self.est.reference(rewards, group, control)
        if out is None or not self.valid_rows_scale:
            return out
        valid = sum(1 for x in out if x != 0)
        return [x * len(out) / valid for x in out] if valid else out

    def select_tokens(self, batch: TrajectoryBatch, adv: Tensor) -> None:
        """The step-wide token selection (`token_selection`), where the advantages are computed (whole groups, the
        whole step on this rank; the statistic over every rank): batch.token_select [B, T] bool, and the step's
        counts in batch.info (`token_selection/tokens`, `/selected`, clip_cov `/candidates`, the entropy selections'
        `/entropy_mean`, `/selected_entropy_mean`), which the micro-batches' loss logs. Its log-probs are those the
        step starts with: the behaviour log-probs (the old log-probs, when the batch holds them already); an entropy
        selection reads batch.old_entropy, the old policy's H_t (`wants_old_entropy`)."""
        start = batch.old_logprobs if batch.old_logprobs is not None else batch.behavior_logprobs  # [B, T]
        mask = self.loss_mask(batch) & batch.known_mask  # [B, T]
        sel, facts = self.token_selection.select(start, adv, mask, batch.tokens, entropy=batch.old_entropy)
        batch.token_select = sel
        for k, v in facts.items():
            batch.info[f"token_selection/{k}"] = v

    def reduction(self) -> Reduction:
        return Reduction(self.loss_agg, self.norm_const)

    def describe(self) -> list[str]:
        """Every setting in words (`explain`): two different settings never print the same text."""
        lo, hi = self.bounds()
        ratio = {"token": "per token", "sequence": "per sequence (GSPO: exp of the mean token log-ratio)",
                 "sequence-token": "GSPO-token (sequence value, token gradients)",
                 "trajectory": "per trajectory: pi(tau)/mu(tau) = exp(sum_t log rho_t)"}[self.ratio]
        bound = {"clip": f"PPO clip [1-{lo:g}, 1+{hi:g}]" + (f", dual clip {self.dual_clip:g}" if self.dual_clip else ""),
                 "mask": f"mask tokens outside [1-{lo:g}, 1+{hi:g}]",
                 "cispo": f"CISPO weight sg(clip(rho, 1-{lo:g}, 1+{hi:g})) on A log pi",
                 "topr": "TOPR: A log pi for A >= 0, sg(clip(rho, 0, 1)) A log pi for A < 0",
                 "log_clip": f"GMPO: each token's log-ratio clipped to [-{lo:g}, {hi:g}] (by the sign of A) inside "
                             f"the geometric mean s = exp(mean_t log rho_t); loss -A s",
                 "none": "none: plain policy gradient -A log pi (no ratio)",
                 "sapo": f"SAPO soft gate -(4/tau) sigmoid(tau (rho - 1)) A, tau {self.sapo_tau_pos:g} for A > 0 and "
                         f"{self.sapo_tau_neg:g} otherwise (gradient weight 4 s (1 - s): 1 at rho = 1, no hard clip)"}[self.bound]
        if self.bound == "none":
            ratio = "none"
        if self.token_selection.acts:
            bound += "; " + self.token_selection.describe()
        agg = self.loss_agg + (f" (C = {self.norm_const:g})" if self.norm_const and self.loss_agg ==
                               "seq-mean-token-sum-norm" else "")
        kl = (f"KL to the initial policy: {self.kl_estimator} x {describe(self.kl_coef)}"
              if ever_nonzero(self.kl_coef) else "no KL loss")
        adv = self.est.describe() + ("; x alpha = B / B_valid (rows over rows with a non-zero advantage, GPG)"
                                     if self.valid_rows_scale else "")
        out = [f"advantage: {adv}", f"ratio: {ratio}; bound: {bound}", f"aggregation: {agg}; {kl}"]
        if self.correction.acts:
            out.append(f"rollout correction: {self.correction.describe()}")
        weighted = sorted(self.weighted_origins())
        if weighted:
            out.append(f"tokens the policy did not write ({', '.join(weighted)}): loss -A w(pi), w = "
                       f"{self.off_policy_weight.describe()}, no ratio, no clip"
                       + ("; the KL loss on policy tokens only" if ever_nonzero(self.kl_coef) else ""))
        return out

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv: Tensor) -> tuple[Tensor, dict[str, float]]:
        """agg(l_t(rho, A)) + kl_coef * agg(k(log pi_theta - log pi_init)) over the loss tokens; on loss tokens the
        policy did not write (`weighted_origins`) l_t = -A w(pi_theta) instead, and no KL."""
        mask = self.loss_mask(batch)  # [B, T]
        off = batch.mask(self.weighted_origins()) & mask  # [B, T]: weighted by off_policy_weight
        on = mask & ~off  # [B, T]: tokens the policy sampled (ratio and bound)
        adv = adv.to(cur.logprobs.device, cur.logprobs.dtype)[:, None]  # [B, 1]
        old = batch.old_logprobs if batch.old_logprobs is not None else batch.behavior_logprobs  # [B, T]
        corr_metrics = {}
        if self.correction.acts:  # w [B, T] of pi_old / mu on the policy's tokens; `kept` False: a dropped unit
            if batch.old_logprobs is None:
                raise ValueError(f"grpo: correction {self.correction.kind} needs batch.old_logprobs (the trainer's "
                                 "log-probs at the step's start); the step computes them when wants_old is true")
            corrected = on & batch.known_mask  # [B, T]
            cw, kept = self.correction.weights(old, batch.behavior_logprobs, corrected)
            mask, on = mask & kept, on & kept
            corr_metrics = {"correction/weight_mean": float(masked_mean(cw, corrected & kept)),
                            "correction/rejected_frac": float(masked_mean(((cw == 0) | ~kept).float(), corrected))}
        lo, hi = self.bounds()
        if self.bound == "log_clip":  # GMPO: the clip inside the geometric mean
            log_r, bounded = geometric_log_clip(cur.logprobs, old, on, adv, lo, hi)  # [B, 1], [B, T]
            ratio = torch.exp(log_r.clamp(-20.0, 20.0))
            loss_tok = -(ratio * adv)  # [B, 1]
        else:
            log_r = sequence_log_ratio(cur.logprobs, old, on, self.ratio)  # [B, T] or [B, 1]
            loss_tok, bounded, ratio = bounded_surrogate(cur.logprobs, log_r, adv, self.bound, lo, hi, self.dual_clip,
                                                         (self.sapo_tau_pos, self.sapo_tau_neg))
        loss_tok = loss_tok.expand_as(cur.logprobs)  # [B, T]
        sel_metrics, off_metrics = {}, {}
        if self.token_selection.acts:
            loss_tok, sel_metrics, bounded = self.selected_loss(batch, loss_tok, log_r, ratio, adv, mask, bounded)
        if self.correction.acts:  # the sampler's mismatch: each policy token's loss times its weight
            loss_tok = torch.where(on, loss_tok * cw, loss_tok)
        if self.weighted_origins():  # -A w(pi) on the tokens the policy did not write: no ratio, no clip
            w = self.off_policy_weight.weight(torch.where(off, cur.logprobs, torch.zeros_like(cur.logprobs)))  # [B, T]
            loss_tok = torch.where(off, -(adv * w), loss_tok)
            off_metrics = {"off_policy_weight_mean": float(masked_mean(w.detach(), off)),
                           "off_policy_prob_mean": float(masked_mean(cur.logprobs.detach().exp(), off)),
                           "off_policy_token_frac": float(off.sum() / mask.sum().clamp(min=1))}
        pg_loss = aggregate(loss_tok, mask, self.loss_agg, self.norm_const)
        total = pg_loss
        kl_val = 0.0
        kl_coef = resolved_number(self.kl_coef, "grpo.kl_coef")  # the step's value (composer.lang.curves.resolve)
        sel_kl = self.token_selection.selected_kl_coef()  # the selected tokens' own coefficient (Archer), or None
        if kl_coef > 0 or sel_kl:
            if batch.initial_logprobs is None:
                raise ValueError("grpo: kl_coef > 0 needs batch.initial_logprobs (the frozen initial policy's "
                                 "log-probs); set kl_coef: 0 or provide the initial policy")
            k = kl_estimate(cur.logprobs - batch.initial_logprobs.detach(), self.kl_estimator)  # [B, T]
            k = torch.where(on, k, torch.zeros_like(k))  # an estimate from the policy's own samples only
            kl = aggregate(k, mask, self.loss_agg, self.norm_const)
            if sel_kl is None:
                total = total + kl_coef * kl
            else:  # per-token coefficients by the selection's class, within the one aggregation (one normaliser)
                c = torch.where(batch.token_select.to(k.device) & mask, torch.full_like(k, sel_kl),
                                torch.full_like(k, kl_coef))  # [B, T]
                total = total + aggregate(c * k, mask, self.loss_agg, self.norm_const)
            kl_val = float(kl.detach())
        metrics = {
            "pg_loss": float(pg_loss.detach()),
            "kl": kl_val,
            "clip_frac": float(masked_mean(bounded.expand_as(mask).float(), on)),
            "ratio_mean": float(masked_mean(ratio.detach().expand_as(mask).float(), on)),
            "adv_mean": float(adv.mean()),
            **sel_metrics,
            **off_metrics,
            **corr_metrics,
        }
        return total, metrics

    def short_run_overrides(self, spec) -> list[str]:
        """A bound acts only where the ratio leaves 1: with one on-policy update per step it never does, and one
        more mini-batch at a small LR rarely takes it past the clip, so the referee's short run makes a second pass
        over each step's rollouts (train.epochs=2). `none` too: no bound is told from a clip only where the ratio
        left the clip's range. A bound whose range reaches past twice the ratio (CISPO's cap 1 + 4) takes a ten times
        larger LR too, so that a few tokens pass it within three steps. The overrides are taken together or not at
        all."""
        lr = spec.train.lr
        if self.bound == "topr":  # its truncation acts where a negative row's ratio to the SAMPLER passed 1, which a
            # second pass (pushing those rows down) never makes: the sampler lags a step, as TOPR's off-policy setting
            return ["sync.every=2", "sync.off_policy_ok=true", f"train.lr={10 * lr:g}"]
        out = ["train.epochs=2"] if spec.train.epochs == 1 else []
        if self.bounds()[1] >= 1:
            out.append(f"train.lr={10 * lr:g}")
        return out

    def idle_reason(self, spec, field: str) -> str | None:
        """Why part `field` cannot act in a run of `spec` (the referee's coverage says "cannot act in this run",
        not "not exercised"): the bound, at one update per step on-policy (the ratio is 1; `inert` warns of it)."""
        t = spec.train
        if field != "bound" or t.epochs * t.mini_batches != 1 or spec.sync.every != 1:
            return None
        if self.correction.acts or sampler_is_trainer(spec):
            return ("one update per step on-policy (train.epochs x train.mini_batches = 1, sync.every: 1) keeps the "
                    "ratio at 1, and the spec refuses a second pass")
        return None

    def reference_loss(self, batch, mask, view, inputs: dict) -> dict | None:
        """The referee's loss (DESIGN.md section 10), written again per row in float64 from the formulas of
        `bounded_surrogate`, `sequence_log_ratio` and `geometric_log_clip` (calling none of them), from the inputs
        the referee recomputed itself (`inputs`: old [B, T], initial [B, T], advantages [B], kl_coef):

          d_t = log pi(y_t) - log pi_old(y_t);  x = d_t (token), mean_t d_t (sequence; GSPO-token: the same value,
          each token's own gradient), sum_t d_t (trajectory); rho = exp(x) (x clamped to +-20: no gradient there)
          clip  -min(rho A, clip(rho) A), dual clip c: at most -c A for A < 0;  mask  -rho A on [lo, hi], else 0
          cispo -clip(rho) A log pi;  topr -w A log pi, w = 1 (A >= 0) or clip(rho, 0, 1);  none -A log pi
          sapo  -(4/tau) sigmoid(tau (rho - 1)) A, tau sapo_tau_pos (A > 0) or sapo_tau_neg (acted: gate weight
                4 s (1 - s) differs from 1 by more than 1e-3)
          log_clip (GMPO)  -A exp(mean_t k_t), k_t = d_t clipped to [-clip_low, clip_high] on the side sgn(A) binds
        plus kl_coef x agg(k(log pi - log pi_init)) on the policy's tokens. A token of the step's selection
        (`inputs["token_select"]` [B, T], the run's choice once the referee has checked it against the selection's
        own reference) takes the selection's `reference_token` where the selection replaces its loss
        (`reference_replaces`: KL-Cov's and Clip-Cov's chosen tokens, the 80/20 update's others), else the clip at the
        epsilons and the KL coefficient the selection gives its class (`reference_clip`, `reference_kl_coef`: Archer's
        high-entropy tokens); a token the policy did not write (weighted_origins)
        takes -A w(pi) from the weight form's `reference`, no ratio, no KL (those origins read from loss_tokens here). L = sum_t W_t l_t (the aggregation's
        weights); returns the value, d L / d log pi, the KL term per unit of kl_coef ("kl_value", "kl_grad") and
        "acted": the tokens where the bound, the selection and the weight form changed the loss (a short run whose
        clip never binds has not exercised it).
        None (not covered) when a selection acts and the batch is not its whole step (no "token_select")."""
        import torch

        sel = inputs.get("token_select") if self.token_selection.acts else None
        if self.token_selection.acts and sel is None:
            return None
        m = mask.cpu()
        lp = view.logprobs.detach().cpu().double()
        old = inputs["old"].detach().cpu().double()
        # tokens the policy did not write, trained by the declared weight form (written again: not weighted_origins)
        unwritten = [o for o in self.loss_tokens if o in ("guide_prefix", "guide_intervention", "demonstration")]
        off_m = (batch.mask(unwritten).cpu() & m if unwritten and type(self.off_policy_weight).acts
                 else torch.zeros_like(m))
        # the rollout correction's weight of each policy token, from its own reference (d = log pi_old - log mu)
        cw = torch.ones_like(lp)
        corrected = torch.zeros_like(m)
        if type(self.correction).acts:
            corrected = m & ~off_m & batch.known_mask.cpu()
            beh = batch.behavior_logprobs.detach().cpu().double()
            for i in range(m.shape[0]):
                ts = corrected[i].nonzero().flatten().tolist()
                for t, (w, kept) in zip(ts, self.correction.reference([float(old[i, t] - beh[i, t]) for t in ts])):
                    cw[i, t] = w
                    m[i, t] = m[i, t] and kept  # a dropped unit leaves the loss
        W = reference_token_weights(m, self.loss_agg, None, self.norm_const)  # [B, T]
        lo, hi = self.bounds()
        value, grad = 0.0, torch.zeros_like(W)
        acted = {"bound": 0, "token_selection": 0, "off_policy_weight": int(off_m.sum()),  # tokens where each acted
                 # a weight the referee can tell from 1 (fp32 sampling leaves w = 1 +- 1e-6: it would pass unweighted)
                 "correction": int((((cw - 1.0).abs() > 1e-3) & corrected).sum() + (corrected & ~m).sum())}
        for i in range(m.shape[0]):
            A = float(inputs["advantages"][i]) if m[i].any() else 0.0
            for t in off_m[i].nonzero().flatten().tolist():  # -A w(pi): no ratio, no clip
                w, dw = self.off_policy_weight.reference(float(lp[i, t]))
                value += float(W[i, t]) * -A * w
                grad[i, t] = float(W[i, t]) * -A * dw
            on = (m[i] & ~off_m[i]).nonzero().flatten().tolist()
            if not on:
                continue
            Wc = {t: float(W[i, t]) * float(cw[i, t]) for t in on}  # the aggregation's weight x the correction's
            w_row = sum(Wc.values())  # the row's total weight
            d = {t: float(lp[i, t] - old[i, t]) for t in on}
            if self.bound == "none":
                for t in on:
                    value += Wc[t] * -A * float(lp[i, t])
                    grad[i, t] = Wc[t] * -A
                    # no bound is told from a clip only where the ratio left the clip's range [1 - lo, 1 + hi]
                    acted["bound"] += not 1 - lo <= math.exp(min(max(d[t], -20.0), 20.0)) <= 1 + hi
                continue
            if self.bound == "log_clip":  # GMPO: each log-ratio clipped on the side the advantage binds
                def k(x):
                    c = min(max(x, -lo), hi)
                    return min(x, c) if A > 0 else max(x, c) if A < 0 else c
                x = sum(k(d[t]) for t in on) / len(on)
                s = math.exp(min(max(x, -20.0), 20.0))
                value += w_row * -A * s
                for t in on:  # d k / d d_t: 1 where the clip leaves the log-ratio free, else 0
                    free = d[t] <= hi if A > 0 else d[t] >= -lo if A < 0 else -lo <= d[t] <= hi
                    acted["bound"] += not free
                    grad[i, t] = w_row * -A * s / len(on) * (1.0 if free and abs(x) <= 20 else 0.0)
                continue
            if self.ratio == "token":
                xs = {t: d[t] for t in on}
                per_token, dx = True, None
            else:
                x = sum(d.values()) / len(on) if self.ratio in ("sequence", "sequence-token") else sum(d.values())
                xs = {t: x for t in on}
                per_token = self.ratio == "sequence-token"
                dx = 1.0 / len(on) if self.ratio == "sequence" else 1.0  # d x / d log pi_t (trajectory: 1)
            for t in on:
                x = xs[t]
                rho = math.exp(min(max(x, -20.0), 20.0))
                live = abs(x) <= 20.0  # the clamp of the log-ratio passes no gradient
                picked = sel is not None and bool(sel[i, t])
                if sel is not None and self.token_selection.reference_replaces(picked):  # the selection's own l_t
                    acted["token_selection"] += 1  # (token ratio, clip: validated)
                    l_val, g = self.token_selection.reference_token(A, d[t])
                    value += Wc[t] * l_val
                    grad[i, t] += Wc[t] * g
                    continue
                if self.bound in ("cispo", "topr"):  # a detached weight on -A log pi: every token's own gradient
                    wt = (min(max(rho, 1 - lo), 1 + hi) if self.bound == "cispo"
                          else 1.0 if A >= 0 else min(max(rho, 0.0), 1.0))
                    acted["bound"] += wt != (rho if self.bound == "cispo" or A < 0 else 1.0)
                    value += Wc[t] * -wt * A * float(lp[i, t])
                    grad[i, t] += Wc[t] * -wt * A
                    continue
                if self.bound == "mask":
                    keep = 1 - lo <= rho <= 1 + hi
                    acted["bound"] += not keep
                    l_val, dl_drho = (-rho * A, -A) if keep else (0.0, 0.0)
                elif self.bound == "sapo":  # -(4/tau) sigmoid(tau (rho - 1)) A, d/d rho = -4 s (1 - s) A
                    tau = self.sapo_tau_pos if A > 0 else self.sapo_tau_neg
                    sg = 1.0 / (1.0 + math.exp(-tau * (rho - 1.0)))
                    acted["bound"] += abs(4.0 * sg * (1.0 - sg) - 1.0) > 1e-3  # the gate's weight, told from 1
                    l_val, dl_drho = -(4.0 / tau) * sg * A, -4.0 * sg * (1.0 - sg) * A
                else:  # clip, with the dual clip; a selection may give the token its class's epsilons (Archer)
                    clo, chi = self.token_selection.reference_clip(picked, lo, hi) if sel is not None else (lo, hi)

                    def surr(e_lo, e_hi):
                        clipped = min(max(rho, 1 - e_lo), 1 + e_hi)
                        out = (rho * A, -A) if rho * A <= clipped * A else (clipped * A, 0.0)
                        if self.dual_clip is not None and A < 0 and out[0] < self.dual_clip * A:
                            out = (self.dual_clip * A, 0.0)
                        return out
                    surrogate, dl_drho = surr(clo, chi)
                    acted["bound"] += surrogate != rho * A
                    acted["token_selection"] += (clo, chi) != (lo, hi) and surrogate != surr(lo, hi)[0]
                    l_val = -surrogate
                value += Wc[t] * l_val
                g = Wc[t] * dl_drho * rho * (1.0 if live else 0.0)  # d l_t / d x
                if per_token or self.ratio == "token":
                    grad[i, t] += g
                else:  # x is the row's: every on-token moves it by dx
                    for u in on:
                        grad[i, u] += g * dx
        kl_total, kl_total_grad = 0.0, torch.zeros_like(W)
        kl_coef = float(inputs.get("kl_coef") or 0.0)
        toks = (m & ~off_m).nonzero().tolist()  # the KL on the policy's own tokens (an estimate from its samples)
        coef = {(i, t): self.token_selection.reference_kl_coef(bool(sel[i, t]), kl_coef) if sel is not None else kl_coef
                for i, t in toks}  # a selection may give its class its own coefficient (Archer's high-entropy tokens)
        if any(c > 0 for c in coef.values()):
            delta = lp - inputs["initial"].detach().cpu().double()
            for i, t in toks:
                x = float(delta[i, t])
                if self.kl_estimator == "k1":
                    kv, kg = x, 1.0
                elif self.kl_estimator == "k2":
                    kv, kg = 0.5 * x * x, x
                else:  # k3 with verl's clamps: x to +-20, the value to +-10 (no gradient where either binds)
                    xc = min(max(x, -20.0), 20.0)
                    kv = math.exp(-xc) + xc - 1.0
                    kg = 1.0 - math.exp(-xc) if abs(x) <= 20.0 and abs(kv) <= 10.0 else 0.0
                    kv = min(max(kv, -10.0), 10.0)
                c = coef[(i, t)]
                kl_total += float(W[i, t]) * c * kv
                kl_total_grad[i, t] += float(W[i, t]) * c * kg
                acted["token_selection"] += c != kl_coef and kv != 0.0  # the class's own coefficient changed the loss
        # the KL term per unit of kl_coef (the referee checks it on its own): a class's coefficient as its ratio to it
        kl_value = kl_total / kl_coef if kl_coef > 0 else 0.0
        kl_grad = kl_total_grad / kl_coef if kl_coef > 0 else torch.zeros_like(W)
        scale = float(W[m].max()) if m.any() else 0.0  # errors per unit advantage of a token's weight
        return {"value": value + kl_total, "grad": grad + kl_total_grad,
                "kl_value": kl_value, "kl_grad": kl_grad, "scale": scale, "acted": acted}

    def selected_loss(self, batch: TrajectoryBatch, loss_tok: Tensor, log_r: Tensor, ratio: Tensor, adv: Tensor,
                      mask: Tensor, bounded: Tensor) -> tuple[Tensor, dict[str, float], Tensor]:
        """l_t on the tokens the step's selection chose (batch.token_select, from `advantages`): KL-Cov
        -A rho_t + beta |log rho_t|; Clip-Cov 0 (no loss, no gradient; the token still counts in the normaliser,
        as verl's corr = 0); entropy (80/20): 0 on the tokens NOT chosen (the chosen keep the clipped surrogate; all
        count in the normaliser); archer: the chosen (high-entropy) tokens' clipped surrogate at the selection's
        epsilons (the dual clip as the term's). Logs the selection's step-wide counts (token_selection/selected,
        /tokens). Returns (loss_tok, metrics, bounded: where the bound acted, with the class's epsilons)."""
        sel = batch.token_select
        if sel is None:
            raise ValueError(f"grpo: token_selection {self.token_selection.kind} needs batch.token_select, the step's "
                             "selection that grpo's advantages() computes over the whole step; call advantages() on "
                             "the whole step's batch before the micro-batches' loss")
        sel = sel.to(loss_tok.device) & mask
        kind = self.token_selection.kind
        if kind == "kl_cov":
            kl_tok = -(ratio * adv) + self.token_selection.beta * log_r.abs()  # [B, T]
            loss_tok = torch.where(sel, kl_tok, loss_tok)
        elif kind == "clip_cov":
            loss_tok = torch.where(sel, torch.zeros_like(loss_tok), loss_tok)
        elif kind == "entropy":  # only the high-entropy (forking) tokens keep the policy gradient
            loss_tok = torch.where(sel, loss_tok, torch.zeros_like(loss_tok))
        else:  # archer: the high-entropy class's clip (the ratio is per token: ratio token, bound clip, validated)
            s = self.token_selection
            high, high_bounded, _ = bounded_surrogate(log_r, log_r, adv, "clip", s.high_entropy_clip_low,
                                                      s.high_entropy_clip_high, self.dual_clip)
            loss_tok = torch.where(sel, high, loss_tok)
            bounded = torch.where(sel, high_bounded, bounded.expand_as(sel))
        return loss_tok, {k: float(v) for k, v in batch.info.items() if k.startswith("token_selection/")}, bounded
