"""Per-token divergence to a teacher on the student's own rollouts (OPD, OPSD, SDPO, GKD)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from components.objectives.base import (Aggregation, InertSetting, Objective, Reduction, aggregate, masked_mean,
                                        reference_token_weights)
from composer.capabilities import Capabilities
from composer.lazy import F, torch
from composer.registry import register

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch


def sampled_distill_loss(logp: Tensor, behavior_logp: Tensor, teacher_logp: Tensor,
                         kl_coef: float = 1.0) -> Tensor:
    """On-policy distillation as an importance-weighted policy gradient (Lu / Thinking Machines 2025;
    Tinker `importance_sampling` loss, kl_discount_factor 0).

    A_t = -c (log pi_beh(y_t) - log pi_T(y_t)) (detached); l_t = -exp(log pi_theta - log pi_beh) A_t.
    At pi_theta = pi_beh, E_y[grad l] = c grad KL(pi_theta || pi_T). All [B, T] -> [B, T].
    """
    adv = (-kl_coef * (behavior_logp - teacher_logp)).detach()  # [B, T]
    ratio = torch.exp(logp - behavior_logp.detach())  # [B, T]
    return -ratio * adv


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last dim; 0 * log 0 = 0. [..., V] -> [...]."""
    pos = torch.isfinite(logp)  # p_v > 0
    lp = torch.where(pos, logp, torch.zeros_like(logp))
    lq = torch.where(pos, logq, torch.zeros_like(logq))
    return torch.where(pos, torch.exp(lp) * (lp - lq), torch.zeros_like(lp)).sum(-1)


def token_divergence(student_logp: Tensor, teacher_logp: Tensor, measure: str, beta: float = 0.5) -> Tensor:
    """Per-position divergence between normalised log-distributions S (student) and T (teacher).

    student_logp, teacher_logp [..., V] (log-softmaxed) -> [...]:
      reverse_kl: KL(S || T) (SDPO paper form; mode seeking)
      forward_kl: KL(T || S)
      jsd: generalised JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S,
           log M = logsumexp(log beta + log T, log(1 - beta) + log S). As in TRL `generalized_jsd_loss`
           (GKD, Agarwal et al. 2024, arXiv 2306.13649; OPSD) and SDPO's alpha: beta = 0 is forward
           KL(T || S) and beta = 1 reverse KL(S || T), special-cased exactly.
    The teacher is the caller's to detach.
    """
    if measure == "reverse_kl" or (measure == "jsd" and beta == 1):
        return _kl(student_logp, teacher_logp)
    if measure == "forward_kl" or (measure == "jsd" and beta == 0):
        return _kl(teacher_logp, student_logp)
    if measure != "jsd":
        raise ValueError(f"unknown divergence measure {measure!r}; expected reverse_kl, forward_kl or jsd")
    log_m = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(teacher_logp, log_m) + (1.0 - beta) * _kl(student_logp, log_m)


def add_tail(logp_k: Tensor) -> Tensor:
    """Append the tail bucket log(1 - sum_k p) to top-k log-probs (SDPO, Hübotter et al. 2026,
    arXiv 2601.20802): log_s = logsumexp clamped to <= -1e-7, tail = log(-expm1(log_s)).
    [..., k] -> [..., k + 1]."""
    log_s = torch.logsumexp(logp_k, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp_k, torch.log(-torch.expm1(log_s))], dim=-1)


def top_k_with_tail(student_logp: Tensor, teacher_logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Restrict both distributions to the student's top-k indices (chosen without gradient) plus a
    tail bucket (SDPO). student_logp, teacher_logp [..., V] -> ([..., k+1], [..., k+1])."""
    k = min(k, student_logp.shape[-1])
    idx = torch.topk(student_logp.detach(), k, dim=-1).indices  # [..., k]
    return add_tail(student_logp.gather(-1, idx)), add_tail(teacher_logp.gather(-1, idx))


def is_weight(logp: Tensor, behavior_logp: Tensor, is_clip: float) -> Tensor:
    """Detached truncated importance weight w_t = min(exp(log pi_theta - log pi_beh), is_clip)
    (SDPO is_clip = 2; log-ratio clamped to +-20). [B, T] -> [B, T]."""
    return torch.exp((logp - behavior_logp).detach().clamp(-20.0, 20.0)).clamp(max=is_clip)


def _probs(logits) -> list[float]:
    """softmax of one position's logits, in float64 (the references' own)."""
    x = [float(v) for v in logits.detach().cpu().double()]
    top = max(x)
    e = [math.exp(v - top) for v in x]
    z = sum(e)
    return [v / z for v in e]


def _with_tail(p: list[float]) -> list[float]:
    """p plus the tail bucket 1 - sum p, kept at least 1 - exp(-1e-7) as SDPO clamps it (the references' own)."""
    return p + [max(1.0 - sum(p), -math.expm1(-1e-7))]


@register("objective")
class Divergence(Objective):
    """Distil a teacher into the policy on the policy's own tokens.

    `sampled`: on-policy distillation (Lu / Thinking Machines 2025): A_t = -c (log pi_beh - log pi_T),
    importance-weighted policy gradient, discount 0. `full`: exact divergence over the vocabulary
    (GKD, Agarwal et al. 2024; OPSD, Zhao et al. 2026). `top_k`: the student's top-k plus a tail
    bucket (SDPO, Hübotter et al. 2026).
    """

    kind: Literal["divergence"] = Field("divergence", description="Component kind.")
    measure: Literal["reverse_kl", "forward_kl", "jsd"] = Field("reverse_kl", description="KL(student||teacher), KL(teacher||student), or generalised JSD_beta.")
    beta: float = Field(0.5, ge=0, le=1, description="JSD mixture weight: beta KL(T||M) + (1-beta) KL(S||M), M = beta T + (1-beta) S.")
    estimator: Literal["sampled", "full", "top_k"] = Field("sampled", description="Single-sample per-token advantage (reverse KL only), exact over the vocabulary, or top-k + tail.")
    k: int = Field(100, ge=1, description="top_k: vocabulary entries kept (student's top-k).")
    kl_coef: float = Field(1.0, gt=0, description="sampled: c in A_t = -c (log pi_beh - log pi_T).")
    is_clip: float = Field(2.0, gt=0, description="Cap of the detached importance weight pi_theta/pi_beh on full/top_k losses (SDPO is_clip=2).")
    aggregation: Aggregation = Field("token-mean", description="How per-token losses become one number.")

    needs: ClassVar = ("teacher_logprobs",)
    policy_gradient: ClassVar = True

    @property
    def wants_logits(self) -> bool:
        return self.estimator != "sampled"

    def anchors(self) -> dict[str, str]:
        what = {"sampled": "teacher log-prob of the sampled token (importance-weighted)",
                "full": "teacher distribution over the vocabulary", "top_k": "teacher distribution on the top-k + tail"}
        return {o: what[self.estimator] for o in self.loss_tokens}

    def reduction(self) -> Reduction:
        return Reduction(self.aggregation, weighted=True)

    def inert(self, spec) -> list[InertSetting]:
        """A field that only one measure or estimator reads, set with another (only those the spec sets)."""
        out = []
        if self.measure != "jsd":
            out.append(InertSetting("beta", f"beta is the JSD mixture weight, and measure is {self.measure}: it is "
                                    "never read", "remove beta, or use measure: jsd"))
        if self.estimator != "top_k":
            out.append(InertSetting("k", f"k is the top_k estimator's vocabulary size, and estimator is "
                                    f"{self.estimator}: it is never read", "remove k, or use estimator: top_k"))
        if self.estimator != "sampled":
            out.append(InertSetting("kl_coef", f"kl_coef scales the sampled estimator's advantage, and estimator is "
                                    f"{self.estimator}: it is never read", "remove kl_coef (weight the term with "
                                    "`weight` under terms), or use estimator: sampled"))
        else:
            out.append(InertSetting("is_clip", "is_clip caps the importance weight of the full and top_k losses, "
                                    "and estimator is sampled: it is never read", "remove is_clip, or use "
                                    "estimator: full or top_k"))
        return [x for x in out if x.field in self.model_fields_set]  # a default nobody chose is not worth a word

    def capabilities(self) -> Capabilities:
        """On-policy only; full / top_k compare whole distributions at each position: no sample of the policy is
        needed, so they train on tokens the policy did not write (GKD's dataset or teacher sequences) exactly, with
        weight 1."""
        exact = () if self.estimator == "sampled" else ("demonstration", "guide_prefix", "guide_intervention")
        return Capabilities(on_policy_only=True, exact_origins=frozenset(exact))

    def reference_loss(self, batch, mask, view, inputs: dict) -> dict:
        """The referee's loss (DESIGN.md section 10), written again from the formulas, in float64:
        sampled  l_t = c rho_t (log pi_beh - log pi_T)(y_t), rho_t = pi_theta / pi_beh (= -rho A_t), d l / d log pi = l;
        full     l_t = w_t D(S_t, T_t), S, T the softmax of the student's and the teacher's logits at t, D the
                 measure (KL(S||T); KL(T||S); beta KL(T||M) + (1 - beta) KL(S||M), M = beta T + (1 - beta) S),
                 w_t = min(rho_t, is_clip) on policy tokens (1 elsewhere), detached: no gradient through log pi;
        top_k    the same on the student's k most likely entries plus one tail bucket 1 - sum of the k (both
                 distributions at the student's indices).
        Aggregated with SDPO's row weights s_i (`reference_token_weights`)."""
        import torch

        W = reference_token_weights(mask.cpu(), self.aggregation, batch.weights().cpu())  # [B, T]
        cur = view.logprobs.detach().cpu().double()
        beh = batch.behavior_logprobs.detach().cpu().double()
        if self.estimator == "sampled":
            l = self.kl_coef * torch.exp(cur - beh) * (beh - batch.teacher_logprobs.detach().cpu().double())
            l = torch.where(W != 0, l, torch.zeros_like(l))
            return {"value": float((W * l).sum()), "grad": W * l}
        div = torch.zeros_like(W)
        for i, j in (W != 0).nonzero().tolist():
            s = _probs(view.logits[i, j])
            q = _probs(batch.teacher_logits[i, j])
            if self.estimator == "top_k":
                idx = sorted(range(len(s)), key=lambda v: -s[v])[: self.k]
                s, q = _with_tail([s[v] for v in idx]), _with_tail([q[v] for v in idx])
            div[i, j] = self._reference_divergence(s, q)
        w = torch.exp(cur - beh).clamp(max=self.is_clip)
        w = torch.where(batch.policy_mask.cpu(), w, torch.ones_like(w))
        return {"value": float((W * w * div).sum()), "grad": torch.zeros_like(W)}

    def _reference_divergence(self, s: list[float], q: list[float]) -> float:
        """D(S, T) of two probability lists, the measure written out (0 log 0 = 0)."""
        def kl(p, r):
            return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, r) if a > 0)

        if self.measure == "reverse_kl" or (self.measure == "jsd" and self.beta == 1):
            return kl(s, q)
        if self.measure == "forward_kl" or (self.measure == "jsd" and self.beta == 0):
            return kl(q, s)
        mix = [self.beta * b + (1 - self.beta) * a for a, b in zip(s, q)]
        return self.beta * kl(q, mix) + (1 - self.beta) * kl(s, mix)

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv=None) -> tuple[Tensor, dict[str, float]]:
        """Per-token divergence, weighted by SDPO's s_i (and w_t for full/top_k), aggregated:
        token-mean is sum m s w l / sum m s (SDPO `compute_self_distillation_loss`)."""
        mask = self.loss_mask(batch)  # [B, T]
        s = batch.weights()  # [B]
        beh = batch.behavior_logprobs.detach()
        if self.estimator == "sampled":
            if self.measure != "reverse_kl":
                raise ValueError(f"divergence: estimator 'sampled' estimates reverse KL only (got measure "
                                 f"{self.measure!r}); use estimator 'full' or 'top_k' for {self.measure}")
            if batch.teacher_logprobs is None:
                raise ValueError("divergence: estimator 'sampled' needs batch.teacher_logprobs")
            teacher_tok = batch.teacher_logprobs.detach()  # [B, T]
            loss_tok = sampled_distill_loss(cur.logprobs, beh, teacher_tok, self.kl_coef)  # [B, T]
            div_tok = beh - teacher_tok  # [B, T] single-sample reverse-KL estimate
        else:
            if cur.logits is None or batch.teacher_logits is None:
                raise ValueError(f"divergence: estimator {self.estimator!r} needs full logits of the student "
                                 "(PolicyView.logits) and the teacher (batch.teacher_logits)")
            rows, cols = mask.nonzero(as_tuple=True)  # N loss positions
            s_lp = F.log_softmax(cur.logits[rows, cols].float(), dim=-1)  # [N, V]
            t_lp = F.log_softmax(batch.teacher_logits[rows, cols].detach().float(), dim=-1)  # [N, V]
            if self.estimator == "top_k":
                s_lp, t_lp = top_k_with_tail(s_lp, t_lp, self.k)  # [N, k+1]
            div_n = token_divergence(s_lp, t_lp, self.measure, self.beta)  # [N]
            div_tok = torch.zeros(mask.shape, dtype=div_n.dtype, device=div_n.device).index_put((rows, cols), div_n)
            w_is = is_weight(cur.logprobs, beh, self.is_clip).to(div_tok.dtype)  # [B, T]
            w_is = torch.where(batch.policy_mask, w_is, torch.ones_like(w_is))  # 1 on tokens the policy did not write
            loss_tok = w_is * div_tok  # [B, T]
            teacher_tok = batch.teacher_logprobs
            if teacher_tok is None:
                teacher_tok = F.log_softmax(batch.teacher_logits.detach().float(), -1).gather(
                    -1, batch.tokens[..., None]).squeeze(-1)
            teacher_tok = teacher_tok.detach()
        loss = aggregate(loss_tok, mask, self.aggregation, seq_weight=s)
        metrics = {
            "loss": float(loss.detach()),
            "divergence": float(aggregate(div_tok.detach(), mask, "token-mean", seq_weight=s)),
            "reverse_kl_to_teacher": float(masked_mean((beh - teacher_tok).float(), mask)),
            "no_signal_frac": float((s == 0).float().mean()),
        }
        return loss, metrics
