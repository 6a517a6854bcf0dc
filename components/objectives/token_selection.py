"""Step-wide token selection for the policy-gradient objective (`grpo.token_selection`): KL-Cov and Clip-Cov
(Cui et al. 2025, The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models, arXiv 2505.22617;
ALGORITHMS.md section 14), by a covariance; the 80/20 high-entropy update (Wang et al. 2025, arXiv 2506.01939) and
Archer's dual-token constraints (Wang et al. 2025, arXiv 2507.15778; ALGORITHMS.md section 15), by the entropy
(the second half of this file).

Over the N loss tokens of the WHOLE STEP (every micro-batch, every rank),
    Cov_t = (log pi(y_t) - mean_t log pi) * (A_t - mean_t A),
the means over those N tokens, A_t the advantage of the token's row. A selection kind picks tokens by Cov_t:
  kl_cov:   the top max(1, floor(k N)) tokens by Cov_t; grpo's loss there is -A rho + beta |log rho| in place
            of the bounded (clipped) term (verl `compute_policy_loss_kl_cov`);
  clip_cov: among the tokens with omega_low < Cov_t < omega_high, min(max(1, floor(r N)), #band) chosen
            uniformly at random; grpo's loss there is 0, so they get no gradient (verl
            `compute_policy_loss_clip_cov`: corr = 0).

The selection is computed once per step where the advantages are (the objective's `advantages`, over whole
groups, before micro-batches), stored on the batch (`batch.token_select` [B, T] bool) and read by every
micro-batch's `loss`, so micro-batching and DDP do not change it: under torch.distributed each rank all-gathers
the (log-prob, advantage, token id) of every rank's loss tokens, in rank order, computes the same statistic and
the same choice over all of them and keeps its own slice.

Intended differences from verl (the paper's code):
  - verl computes Cov_t per micro-batch over the current log-probs; here it is one statistic over the step, from
    the log-probs the step starts with: the rollout's behaviour log-probs (the sampler's; on-policy they are the
    current policy's at the step's first update, up to the sampler's numerical mismatch);
  - verl's Clip-Cov leaves out tokens the PPO clip already binds; at the step's start the ratio is 1, so no
    token is clipped there and that exclusion has nothing to remove;
  - verl's Clip-Cov draws with torch.randperm on the global RNG; here a private torch.Generator seeded from
    `seed` and the step's tokens (the sum of every rank's loss-token ids), so every rank and a resumed run draw
    the same tokens and the global RNG is never touched;
  - the top-k breaks ties by position (a stable sort), so the choice is a function of the step's tokens;
  - verl's KL-Cov gives the unselected tokens the unclipped -A rho; here they keep grpo's `bound` (the PPO clip,
    as the paper's PPO baseline): the same with one on-policy update per step (rho = 1).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from composer.capabilities import Capabilities, Need
from composer.lazy import torch
from composer.registry import Component, register

if TYPE_CHECKING:
    from torch import Tensor


def _dist():
    d = torch.distributed
    return d if d.is_available() and d.is_initialized() and d.get_world_size() > 1 else None


def gather_rows(x: Tensor) -> tuple[Tensor, int]:
    """x [n, c] (this rank's rows) -> (every rank's rows concatenated in rank order [N, c], this rank's offset).
    Without torch.distributed (or one process): (x, 0). Ranks may hold different n (two all_gathers)."""
    d = _dist()
    if d is None:
        return x, 0
    n = torch.tensor([x.shape[0]], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(d.get_world_size())]
    d.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    pad = torch.cat([x, x.new_zeros((max(sizes) - x.shape[0],) + tuple(x.shape[1:]))])
    out = [torch.zeros_like(pad) for _ in sizes]
    d.all_gather(out, pad)
    return torch.cat([o[:s] for o, s in zip(out, sizes)]), sum(sizes[: d.get_rank()])


def covariance(logp: Tensor, adv: Tensor) -> Tensor:
    """Cov_t = (logp_t - mean logp) (A_t - mean A) over the N tokens given. logp, adv [N] float64 -> [N]."""
    if logp.numel() == 0:
        return logp
    return (logp - logp.mean()) * (adv - adv.mean())


class TokenSelection(Component):
    """Base of every step-wide token selection: `choose(cov [N], seed_data) -> chosen [N] bool, facts` over the
    step's loss tokens; `select` gathers them (every rank), computes Cov_t and keeps this rank's part."""

    acts: ClassVar[bool] = True  # False: no selection (the objective's loss as without it)
    by_entropy: ClassVar[bool] = False  # what it selects by: the covariance Cov_t (False) or the entropy H_t (True)

    def capabilities(self) -> Capabilities:
        """A selection that acts is a per-token mask over the whole step's tokens, read by every micro-batch."""
        return Capabilities(needs=(Need("step_token_mask"),) if type(self).acts else ())

    def count(self, n: int) -> int:
        raise NotImplementedError

    def choose(self, cov: Tensor, token_sum: int) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    # ---- the referee's formulas (DESIGN.md section 10): written again in plain Python, sharing nothing above

    def reference_problem(self, cov: list[float], chosen: list[bool], rows: list[int] | None = None) -> str | None:
        """Why the run's choice `chosen` [N] over the step's N loss tokens (row-major) is not this selection's at the
        statistic the referee recomputed (`cov` [N]: Cov_t, or H_t for an entropy selection; `rows` [N]: each token's
        row, for a selection per response), or None when it is."""
        raise NotImplementedError

    def reference_token(self, adv: float, d: float) -> tuple[float, float]:
        """(l_t, d l_t / d log pi) of a token whose loss the selection replaces (`reference_replaces`) at the advantage
        `adv` and log-ratio d = log pi - log pi_old."""
        raise NotImplementedError

    def reference_replaces(self, selected: bool) -> bool:
        """The token's loss is the selection's own (`reference_token`): a selected token, by default."""
        return selected

    def reference_clip(self, selected: bool, clip_low: float, clip_high: float) -> tuple[float, float]:
        """The clip epsilons (low, high) of a token the selection does not replace: the term's own, by default."""
        return clip_low, clip_high

    def reference_kl_coef(self, selected: bool, kl_coef: float) -> float:
        """The KL coefficient of a token: the term's own, by default."""
        return kl_coef

    def selected_kl_coef(self) -> float | None:
        """The KL coefficient of the selected tokens in place of the term's, or None (the term's: the default)."""
        return None

    def select(self, logp: Tensor, adv: Tensor, mask: Tensor, tokens: Tensor,
               entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """logp [B, T] (the step's starting log-probs), adv [B] (the rows' advantages), mask [B, T] bool (the loss
        tokens), tokens [B, T] (entropy [B, T]: read by an entropy selection) -> (selected [B, T] bool, facts over the
        whole step: tokens N, selected, and the kind's own counts). The statistic and the choice are over every
        rank's loss tokens."""
        a = adv.detach().to(torch.float64)[:, None].expand(mask.shape)  # [B, T]
        local = torch.stack([logp.detach().to(torch.float64)[mask], a[mask], tokens.to(torch.float64)[mask]], -1)
        full, offset = gather_rows(local)  # [N, 3]
        cov = covariance(full[:, 0], full[:, 1])  # [N]
        chosen, facts = self.choose(cov.cpu(), int(full[:, 2].sum()))  # [N] bool
        sel = torch.zeros_like(mask)
        sel[mask] = chosen[offset: offset + local.shape[0]].to(mask.device)
        return sel, {"tokens": float(full.shape[0]), "selected": float(chosen.sum()), **facts}


@register("token_selection")
class NoSelection(TokenSelection):
    """No token selection: every loss token gets the objective's own term."""

    kind: Literal["none"] = Field("none", description="Component kind.")
    acts: ClassVar[bool] = False

    def describe(self) -> str:
        return "none"


@register("token_selection")
class KlCov(TokenSelection):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the top k N tokens of the step by Cov_t get -A rho + beta |log rho|.

      Cov_t = (log pi(y_t) - mean log pi) (A_t - mean A) over the step's N loss tokens (every rank);
      the max(1, floor(k N)) tokens of largest Cov_t (ties: first by position) get l_t = -A rho_t + beta |log rho_t|
      in place of the clipped term (verl compute_policy_loss_kl_cov, kl_cov_ratio / ppo_kl_coef).
    """

    kind: Literal["kl_cov"] = Field("kl_cov", description="Component kind.")
    k: float = Field(2e-3, gt=0, le=1, description="Fraction of the step's loss tokens that get the KL penalty: the top max(1, floor(k N)) by Cov_t (paper: 2e-3 for 7B, 2e-4 for 32B; verl kl_cov_ratio).")
    beta: float = Field(1.0, ge=0, description="Coefficient of |log pi_theta - log pi_old| on the selected tokens (paper and verl ppo_kl_coef: 1).")

    def count(self, n: int) -> int:
        return max(1, int(n * self.k)) if n else 0

    def choose(self, cov, token_sum):
        n = cov.numel()
        chosen = torch.zeros(n, dtype=torch.bool)
        top = torch.sort(cov, descending=True, stable=True).indices[: self.count(n)]
        chosen[top] = True
        return chosen, {}

    def reference_problem(self, cov, chosen, rows=None):
        n = len(cov)
        count = max(1, math.floor(self.k * n)) if n else 0
        order = sorted(range(n), key=lambda i: (-cov[i], i))  # largest first, ties by position
        want = set(order[:count])
        got = {i for i in range(n) if chosen[i]}
        if len(got) != count:
            return f"the run selected {len(got)} tokens, max(1, floor({self.k:g} x {n})) = {count}"
        kth = cov[order[count - 1]] if count else 0.0
        bad = [i for i in want ^ got if abs(cov[i] - kth) > 1e-9]  # only ties at the k-th value may differ
        return f"the top {count} by Cov_t differ from the run's at {len(bad)} tokens" if bad else None

    def reference_token(self, adv, d):
        rho = math.exp(d)  # l = -A rho + beta |d|; d l / d log pi = -A rho + beta sign(d)
        return -adv * rho + self.beta * abs(d), -adv * rho + self.beta * ((d > 0) - (d < 0))

    def describe(self) -> str:
        return (f"KL-Cov: the top max(1, floor({self.k:g} N)) of the step's N loss tokens by Cov_t = (log pi - mean) "
                f"(A - mean) get -A rho + {self.beta:g} |log rho| in place of the bounded term")


@register("token_selection")
class ClipCov(TokenSelection):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): r N random tokens of the step with Cov_t in (omega_low, omega_high)
    get no gradient.

      Cov_t = (log pi(y_t) - mean log pi) (A_t - mean A) over the step's N loss tokens (every rank);
      of the tokens with omega_low < Cov_t < omega_high, min(max(1, floor(r N)), their number) drawn uniformly
      (a private generator seeded from `seed` and the step's tokens) get l_t = 0 (verl compute_policy_loss_clip_cov,
      clip_cov_ratio / clip_cov_lb / clip_cov_ub: corr = 0).
    """

    kind: Literal["clip_cov"] = Field("clip_cov", description="Component kind.")
    r: float = Field(2e-4, gt=0, le=1, description="Fraction of the step's loss tokens whose gradient is removed: max(1, floor(r N)) drawn from the band (paper and verl clip_cov_ratio: 2e-4).")
    omega_low: float = Field(1.0, description="Lower end of the Cov_t band the tokens are drawn from, exclusive (paper and verl clip_cov_lb: 1).")
    omega_high: float = Field(5.0, description="Upper end of the Cov_t band, exclusive (paper and verl clip_cov_ub: 5).")
    seed: int = Field(0, ge=0, description="Seed of the private generator that draws the tokens (mixed with the step's tokens, so each step draws anew and every rank the same); never the global RNG.")

    @model_validator(mode="after")
    def _band(self):
        if self.omega_low >= self.omega_high:
            raise ValueError(f"clip_cov: omega_low {self.omega_low:g} >= omega_high {self.omega_high:g}: the band "
                             "omega_low < Cov_t < omega_high is empty, so no token can ever be chosen (paper: 1 and 5)")
        return self

    def count(self, n: int) -> int:
        return max(1, int(self.r * n)) if n else 0

    def band(self, cov: Tensor) -> Tensor:
        return (cov > self.omega_low) & (cov < self.omega_high)

    def choose(self, cov, token_sum):
        cand = torch.nonzero(self.band(cov)).flatten()
        g = torch.Generator(device="cpu")
        g.manual_seed((self.seed * 1_000_003 + token_sum) % (2 ** 63))
        pick = cand[torch.randperm(cand.numel(), generator=g)[: min(self.count(cov.numel()), cand.numel())]]
        chosen = torch.zeros(cov.numel(), dtype=torch.bool)
        chosen[pick] = True
        return chosen, {"candidates": float(cand.numel())}

    def reference_problem(self, cov, chosen, rows=None):
        n = len(cov)
        band = {i for i in range(n) if self.omega_low < cov[i] < self.omega_high}
        count = min(max(1, math.floor(self.r * n)) if n else 0, len(band))
        got = {i for i in range(n) if chosen[i]}
        if len(got) != count or got - band:
            return (f"the run selected {len(got)} tokens ({len(got - band)} outside the band {self.omega_low:g} < "
                    f"Cov_t < {self.omega_high:g}); the spec's count is {count} of {len(band)} in the band")
        return None

    def reference_token(self, adv, d):
        return 0.0, 0.0  # no loss, no gradient

    def describe(self) -> str:
        return (f"Clip-Cov: max(1, floor({self.r:g} N)) of the step's N loss tokens with {self.omega_low:g} < Cov_t < "
                f"{self.omega_high:g}, Cov_t = (log pi - mean) (A - mean), drawn at random (seed {self.seed}), get no "
                "loss and no gradient")




# ------------------------------------------------------------------------------------------------ by the entropy
#
# H_t = -sum_v pi_old(v | y_<t) log pi_old(v | y_<t): the entropy of the full next-token distribution that predicted
# the response token at t, under the policy at the step's START (the weights before the step's first update: the old
# policy of the ratio), at the loss's temperature (the rollout's sampling temperature, as the log-probs). The step
# computes it once, by a no-grad forward with the full logits, where the advantages are (composer/step.py, part 2:
# `batch.old_entropy`, when the objective's `wants_old_entropy`), and the selection is made there over the whole
# step (every micro-batch; every rank for `scope: step`), stored as `batch.token_select` and read by every
# micro-batch's loss, like the covariance above.
#
# Intended difference from both papers' code (verl forks): there H_t comes from the actor's update forward, per
# micro-batch, of the CURRENT policy, so with several updates per step (Archer: 3 epochs x 2 mini-batches; the 80/20
# recipe: 16 mini-batches) a token's class moves from one update to the next and the 80/20 top-20% depends on how the
# step is cut into micro-batches. Here it is the old policy's, once per step: the same as theirs at the step's first
# update on-policy, and independent of micro-batching and DDP. The referee recomputes H_t by a fresh forward of the
# weights recorded at the step's start.

ENTROPY_TIE = 1e-4  # the referee's H_t (a fresh float32 forward, another layout) may differ from the run's by float
# noise: a token this close to the cut (the k-th entropy, Archer's quantile) may fall on either side


class EntropySelection(TokenSelection):
    """Base of the selections by the entropy H_t of the old policy's next-token distribution: `choose_entropy(h [n]
    float64) -> [n] bool` over one unit of tokens (the whole step, or one response), `select` reads batch.old_entropy."""

    by_entropy: ClassVar[bool] = True

    def choose_entropy(self, h: Tensor) -> Tensor:
        raise NotImplementedError

    def units(self, rows: list[int] | None, n: int) -> list[list[int]]:
        """The referee's units of the N tokens (row-major): every token (scope: step), or each row's tokens."""
        if self.scope == "step" or rows is None:
            return [list(range(n))]
        out: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            out.setdefault(r, []).append(i)
        return list(out.values())

    def select(self, logp, adv, mask, tokens, entropy=None):
        if entropy is None:
            raise ValueError(f"token_selection {self.kind}: needs batch.old_entropy, the entropy of the policy's "
                             "next-token distribution at the step's start; the step computes it before the advantages "
                             "when the objective's wants_old_entropy is true (composer/step.py, part 2)")
        h = entropy.detach().to(torch.float64)  # [B, T]
        local = h[mask]  # [n] this rank's loss tokens, row-major
        if self.scope == "step":  # one cut over every rank's tokens, in rank order
            full, offset = gather_rows(local[:, None])
            mine = self.choose_entropy(full[:, 0].cpu())[offset: offset + local.numel()]
        else:  # each response on its own: a row is never split across micro-batches or ranks
            parts = [self.choose_entropy(h[i][mask[i]].cpu()) for i in range(mask.shape[0])]
            mine = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
        mine = mine.to(mask.device)
        sums = torch.stack([torch.tensor(float(local.numel()), dtype=torch.float64, device=h.device),
                            mine.sum().to(torch.float64), local.sum(), local[mine].sum()])[None]  # [1, 4]
        n, k, h_sum, h_sel = gather_rows(sums)[0].sum(0).tolist()  # over every rank
        sel = torch.zeros_like(mask)
        sel[mask] = mine
        return sel, {"tokens": n, "selected": k, "entropy_mean": h_sum / max(n, 1.0),
                     "selected_entropy_mean": h_sel / max(k, 1.0)}


@register("token_selection")
class Entropy(EntropySelection):
    """The 80/20 high-entropy update (Wang et al. 2025, Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
    Effective Reinforcement Learning for LLM Reasoning, arXiv 2506.01939): only the "forking" tokens, the top rho of
    the step's loss tokens by H_t, keep their policy-gradient loss; the others get l_t = 0 and still count in the
    normaliser (the paper's J: the indicator 1[H_t >= tau_rho] inside DAPO's sum over every token / sum_i |o_i|).

      count = max(1, ceil(rho n)) (the release: int(rho n + 0.9999)) over the unit's n tokens (the step, or a
      response), the largest H_t first (ties: first by position); l_t = 0 on the others. The KL term, if any, keeps
      every token (the release's kl_loss over the response mask).
    """

    kind: Literal["entropy"] = Field("entropy", description="Component kind.")
    rho: float = Field(0.2, gt=0, le=1, description="Fraction of the tokens that keep their policy-gradient loss: the top max(1, ceil(rho n)) by the old policy's entropy H_t (paper: 0.2, the top 20% 'forking' tokens; the release's entropy_top_ratio).")
    scope: Literal["step", "response"] = Field("step", description="The tokens the top rho is taken over: the whole step's loss tokens (step: the paper's batch-wide threshold tau_rho^B, over every micro-batch and rank) or each response's own (response).")

    def count(self, n: int) -> int:
        return max(1, int(self.rho * n + 0.9999)) if n else 0

    def choose_entropy(self, h):
        n = h.numel()
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[torch.sort(h, descending=True, stable=True).indices[: self.count(n)]] = True
        return chosen

    def reference_problem(self, cov, chosen, rows=None):
        h = cov  # the entropies H_t the referee recomputed, row-major
        for unit in self.units(rows, len(h)):
            count = max(1, math.floor(self.rho * len(unit) + 0.9999))
            order = sorted(unit, key=lambda i: (-h[i], i))  # largest first
            want, got = set(order[:count]), {i for i in unit if chosen[i]}
            if len(got) != count:
                return f"the run kept {len(got)} of {len(unit)} tokens, max(1, ceil({self.rho:g} x {len(unit)})) = {count}"
            kth = h[order[count - 1]]
            bad = [i for i in want ^ got if abs(h[i] - kth) > ENTROPY_TIE]  # only near-ties at the cut may differ
            if bad:
                return (f"the top {count} of {len(unit)} tokens by entropy differ from the run's at {len(bad)} tokens "
                        f"(e.g. H {h[bad[0]]:.6g} against the cut {kth:.6g})")
        return None

    def reference_replaces(self, selected):
        return not selected  # the tokens below the cut: no policy-gradient loss

    def reference_token(self, adv, d):
        return 0.0, 0.0

    def describe(self) -> str:
        n, where = ("N", "the step's N loss tokens") if self.scope == "step" else ("n", "each response's n loss tokens")
        return (f"80/20 high-entropy update: only the top max(1, ceil({self.rho:g} {n})) of {where} by the old policy's "
                "entropy H_t (the full next-token distribution at the step's start) keep the policy-gradient loss; "
                "the others get 0 and still count in the normaliser")


@register("token_selection")
class Archer(EntropySelection):
    """Archer's dual-token constraints (Wang et al. 2025, Stabilizing Knowledge, Promoting Reasoning: Dual-Token
    Constraints for RLVR, arXiv 2507.15778): within one term and one normaliser, each token's clip range and KL
    coefficient by its entropy class.

      tau = the `quantile` (0.8) of the response's H_t (linear interpolation, torch.nanquantile; the release's
      token_entropy_quantile per response); H_t > tau: high-entropy ("reasoning"), the others low-entropy
      ("knowledge"). High: clip [1 - high_entropy_clip_low, 1 + high_entropy_clip_high] (0.5, 0.5) and KL coefficient
      high_entropy_kl_coef (0); low: the term's own clip (clip / clip_low / clip_high, Archer 0.2) and kl_coef
      (Archer 0.001, k3). The dual clip, the aggregation and the normaliser are the term's, for every token.
    """

    kind: Literal["archer"] = Field("archer", description="Component kind.")
    quantile: float = Field(0.8, gt=0, lt=1, description="The class cut: a token is high-entropy when its H_t is above this quantile of its unit's entropies (linear interpolation; Archer: 0.8, the top 20% are high-entropy; the release's token_entropy_quantile).")
    scope: Literal["response", "step"] = Field("response", description="The unit the quantile is taken over: each response's loss tokens (response: Archer's release, torch.nanquantile per row) or the whole step's (step: every micro-batch and rank).")
    high_entropy_clip_low: float = Field(0.5, ge=0, description="Lower clip epsilon of the high-entropy tokens: their ratio is clipped at 1 - this (Archer: 0.5, high_entropy_clip_ratio_low); low-entropy tokens keep the term's clip_low.")
    high_entropy_clip_high: float = Field(0.5, ge=0, description="Upper clip epsilon of the high-entropy tokens: 1 + this (Archer: 0.5, high_entropy_clip_ratio_high); low-entropy tokens keep the term's clip_high.")
    high_entropy_kl_coef: float = Field(0.0, ge=0, description="KL coefficient of the high-entropy tokens in place of the term's kl_coef (Archer: 0, no KL on reasoning tokens; the release's high_entropy_kl_loss_scale_coef); low-entropy tokens keep kl_coef.")

    def threshold(self, h: list[float]) -> float:
        """The quantile of the values h (plain, float64): v[j] + f (v[j+1] - v[j]) at q (n - 1) = j + f."""
        v = sorted(h)
        pos = self.quantile * (len(v) - 1)
        j = math.floor(pos)
        return v[j] + (pos - j) * (v[min(j + 1, len(v) - 1)] - v[j])

    def choose_entropy(self, h):
        n = h.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.bool)
        v = torch.sort(h).values
        pos = self.quantile * (n - 1)
        j = math.floor(pos)
        tau = torch.lerp(v[j], v[min(j + 1, n - 1)], pos - j)
        return h > tau

    def reference_problem(self, cov, chosen, rows=None):
        h = cov
        for unit in self.units(rows, len(h)):
            tau = self.threshold([h[i] for i in unit])
            bad = [i for i in unit if bool(chosen[i]) != (h[i] > tau) and abs(h[i] - tau) > ENTROPY_TIE]
            if bad:
                return (f"{len(bad)} tokens of a unit of {len(unit)} are in the other entropy class than the run's "
                        f"(e.g. H {h[bad[0]]:.6g}, the {self.quantile:g}-quantile {tau:.6g}, the run: "
                        f"{'high' if chosen[bad[0]] else 'low'})")
        return None

    def reference_replaces(self, selected):
        return False  # every token keeps the clipped surrogate, with its class's epsilons

    def reference_clip(self, selected, clip_low, clip_high):
        return (self.high_entropy_clip_low, self.high_entropy_clip_high) if selected else (clip_low, clip_high)

    def reference_kl_coef(self, selected, kl_coef):
        return self.high_entropy_kl_coef if selected else kl_coef

    def selected_kl_coef(self):
        return self.high_entropy_kl_coef

    def describe(self) -> str:
        where = "its response's" if self.scope == "response" else "the step's"
        return (f"Archer dual-token constraints: tokens whose old-policy entropy H_t is above the {self.quantile:g}-"
                f"quantile of {where} entropies are high-entropy: clip [1-{self.high_entropy_clip_low:g}, "
                f"1+{self.high_entropy_clip_high:g}] and KL coefficient {self.high_entropy_kl_coef:g}; the others keep "
                "the term's clip and kl_coef (one term, one normaliser)")


AnyTokenSelection = Annotated[Union[NoSelection, KlCov, ClipCov, Entropy, Archer], Field(discriminator="kind")]
