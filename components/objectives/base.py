"""What every objective config shares, plus the loss helpers they all use.

Helpers are pure functions over plain tensors (ALGORITHMS.md section 0). torch is reached through
the lazy proxy so that importing this module (spec validation) never loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple, final

from pydantic import Field

from composer.capabilities import Capabilities
from composer.lazy import torch
from composer.origins import Origin
from composer.registry import Component

if TYPE_CHECKING:
    from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


@dataclass(frozen=True)
class Reduction:
    """How an objective's `loss` reduces per-token losses to one number (`aggregate`'s arguments): the step-wide
    normaliser derives from it, so micro-batches and ranks add up to the loss of the whole step."""

    mode: str  # one of AGGREGATIONS
    norm_const: float | None = None  # C of seq-mean-token-sum-norm
    weighted: bool = False  # sequence weights s_i = batch.weights() enter the aggregation


class InertSetting(NamedTuple):
    """A field of an objective that can never act where it stands: why, the fix, and whether validation refuses
    it (`error`) or only says so (`warning`, for a guard that is harmless where it cannot act)."""

    field: str
    reason: str
    hint: str
    severity: str = "error"


class Objective(Component):
    """Base of every objective. The contract both backends drive (DESIGN.md section 8):

      advantages(batch) -> Tensor [B] or None   over whole groups (every row of each group present),
                                                where the rollouts are gathered; None: no advantage
      loss(batch, view, adv) -> (loss, metrics) per micro-batch, where gradients are; `adv` holds the
                                                rows' advantages from `advantages` (None if it has none)
    A backend calls both, never looks at the kind, and never calls `loss` without the advantages of
    whole groups; an objective whose loss couples rows (`couples_rows`: a pair term) gets whole groups in every
    call of `loss` too. Class-level flags and hooks below are read by validation rules and the backends; what the
    objective can run with (on-policy only, exact origins, backend features) is its `capabilities()` record
    (composer/capabilities.py), on-policy only unless it says otherwise.
    """

    loss_tokens: list[Origin] = Field(default_factory=lambda: ["policy"], description="Token origins that get loss: prompt, policy, guide_prefix, guide_intervention, demonstration.")

    policy_gradient: ClassVar[bool] = False  # importance-ratio policy gradient: off-policy tokens must be masked
    uses_group_baseline: ClassVar[bool] = False
    # Why several optimizer steps on one rollout batch (train.epochs x train.mini_batches) stay sound for this
    # objective, in words; None: it assumes data from the current weights (refused unless sync.off_policy_ok).
    several_updates: ClassVar[str | None] = None
    # Rows whose loss reads other rows: "group" (a pair term: one row's loss depends on another rollout of its
    # group), None (each row's loss is its own). With "group", every part of a step handed to `loss` (a mini-batch,
    # a DDP rank's rows, a micro-batch) holds whole groups, and the normaliser counts what the loss averages (the
    # pairs), so the parts' losses scaled by their shares still add up to the whole step's (composer/step.py); a
    # backend that cannot keep groups together lacks the feature `coupled_rows` (composer/capabilities.py).
    couples_rows: ClassVar[str | None] = None

    def inert(self, spec) -> list["InertSetting"]:
        """Settings of this objective that cannot act (or are impossible) in a segment resolved as `spec`
        (composer/checks/inert.py refuses those the spec sets; `explain` shows them all). Default: none."""
        return []

    def group_baseline(self) -> bool:
        """Whether this term's advantages subtract a baseline taken from the rows of each group (a group whose
        rewards are all equal then trains nothing): one rollout per prompt zeroes every advantage, and a check of
        the advantages must see groups of mixed rewards. Default: the class's `uses_group_baseline`; an objective
        with an estimator part answers for the estimator in force."""
        return type(self).uses_group_baseline

    def openrlhf_sft(self) -> bool:
        """The engine mapping for fixed demonstrations: OpenRLHF's train_sft computes exactly this loss (its token-mean
        cross-entropy on the target tokens). Default: no."""
        return False

    def openrlhf_native(self) -> list[str]:
        """The mapping of this objective onto OpenRLHF's own PolicyLoss (its native flags; DESIGN.md section 11,
        "Backend mappings"): the settings that keep it off that route, each with why; [] when every field maps.
        A mapping is complete or absent: a field it does not carry, set away from its default, is listed here, and
        the term then runs through the composer's own loss in the bundle's plugin, never a silent drop. Default: no
        native mapping (the composer's loss always)."""
        return [f"{self.kind}: no native OpenRLHF mapping (the composer's loss in the plugin)"]

    def describe(self) -> list[str]:
        """Every setting in words, for `explain` (default: each field and its value)."""
        skip = {"kind", "loss_tokens"}
        parts = [f"{n}: {_words(getattr(self, n))}" for n in type(self).model_fields if n not in skip]
        return ["; ".join(parts)] if parts else []

    @property
    def wants_logits(self) -> bool:
        """Needs full-vocabulary logits of the policy (PolicyView.logits) and of the teacher."""
        return False

    @property
    def wants_initial(self) -> bool:
        """Reads batch.initial_logprobs (the frozen reference policy: a KL term, A*PO's anchor)."""
        return False

    @property
    def wants_old_entropy(self) -> bool:
        """Reads batch.old_entropy: the entropy of the policy's next-token distribution at each token at the step's
        start (an entropy token selection), which the step computes once before the advantages."""
        return False

    @property
    def wants_old(self) -> bool:
        """Reads batch.old_logprobs (the trainer's log-probs at the step's start) even at one update per step, where
        the step otherwise keeps the sampler's behaviour log-probs as the ratio's denominator (a rollout correction
        weighs pi_old / mu)."""
        return False

    def behavior_origins(self) -> set[str]:
        """Token origins whose behaviour log-probs `loss` reads (the rollout weights score guide tokens of
        these origins). Default: the loss tokens of a policy-gradient objective, less those it trains exactly
        (its capabilities' exact_origins) or with a declared weight form."""
        if not type(self).policy_gradient:
            return set()
        return set(self.loss_tokens) - self.capabilities().exact_origins - self.weighted_origins()

    def weighted_origins(self) -> set[str]:
        """Origins the policy did not write that this objective trains with a declared importance-weight form of the
        current policy's probability alone (grpo's `off_policy_weight`: LUFFY's policy shaping), reading no
        behaviour log-prob, so such tokens are fine there. None by default."""
        return set()

    def anchors(self) -> dict[str, str]:
        """What each loss origin is anchored to, in words, for `explain` and plan.json."""
        ratio = "importance ratio to the behaviour log-prob" if type(self).policy_gradient else None
        return {o: ratio for o in self.loss_tokens}

    def advantages(self, batch) -> Tensor | None:
        """[B] per-row (or [B, T] per-token) advantages over whole groups, or None (the default: no advantage)."""
        return None

    def reference_advantages(self, rewards: list[float], group: list, control: list[bool],
                             policy_tokens: list[int]) -> list[float] | None:
        """The referee's per-row advantages (DESIGN.md section 10), from the recorded rewards, groups, control flags
        and each row's policy-token count: this objective's formula written again plainly, sharing nothing with
        `advantages`. None (the default): no reference, so the referee reports the advantages "not covered"."""
        return None

    def short_run_overrides(self, spec) -> list[str]:
        """Overrides the referee's short run needs for this objective's parts to act (none by default)."""
        return []

    def reference_loss(self, batch, mask, view, inputs: dict) -> dict | None:
        """The referee's loss (DESIGN.md section 10): this objective's loss on `batch` written again plainly, from
        the loss tokens `mask` [B, T] (the plan's origins in the gate's rows), the policy as the loss read it
        (`view`: log-probs [B, T], logits [B, T, V] where it reads them) and what the referee recomputed itself
        (`inputs`: "old" [B, T] log-probs of the weights at the step's start or the sampler's, "initial" [B, T] the
        frozen reference's, "advantages" [B] from the parts' references, "kl_coef" at the step): {"value": float,
        "grad": d value / d log-probs [B, T] float64}. None (the default): "not covered" by a reference."""
        return None

    def value_model(self):
        """The learned value model (critic) this objective reads and trains, or None (the default). With one, a
        backend fills batch.values [B, T] (the critic's old values) before `advantages`, and trains the critic on
        `critic_loss` over the same updates as the policy (components/objectives/critic.py: settings, runtime)."""
        return None

    def critic_loss(self, batch, values) -> tuple[Tensor, dict[str, float]]:
        """The critic's loss of `values` [B, T] (the critic now) on `batch` (an objective with a value_model)."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def critic_normalizer(self, batch) -> Tensor:
        """What `critic_loss` divides its sum by on `batch` (micro-batches and ranks scale by it, as `normalizer`)."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def advantage_metrics(self, batch) -> dict[str, float]:
        """Facts of the advantages over the whole batch (its groups), logged with the term's loss."""
        if batch.rewards is None or batch.advantages is None:
            return {}
        return {"zero_advantage_frac": float(zero_advantage_fraction(batch.rewards, batch.group))}

    def loss(self, batch, view, adv) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def reduction(self) -> Reduction | None:
        """The aggregation `loss` uses; `normalizer` derives from it. An objective returns one, or overrides
        `normalizer` (a loss that is not an `aggregate`); a class doing neither is refused when defined."""
        return None

    def normalizer(self, batch) -> Tensor:
        """What `loss` divides its sum by on `batch` (a scalar tensor). A backend that splits a step into
        micro-batches (OpenRLHF) or ranks (DDP) scales each part's loss by normalizer(part) / normalizer(step),
        so the parts add up to the loss of the whole step, as one batch would give it. Derived from
        `reduction()` (aggregate_count of the same arguments)."""
        r = self.reduction()
        if r is None:
            raise TypeError(f"{type(self).__name__} declares no reduction() and does not override normalizer()")
        return aggregate_count(self.loss_mask(batch), r.mode, r.norm_const,
                               seq_weight=batch.weights() if r.weighted else None)

    def normaliser_words(self) -> str | None:
        """What an overridden `normalizer` counts, in words (the Plan's schedule, `explain`); None: the reduction's."""
        return None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs):
        super().__pydantic_init_subclass__(**kwargs)
        concrete = cls.loss is not Objective.loss
        if concrete and cls.reduction is Objective.reduction and cls.normalizer is Objective.normalizer:
            raise TypeError(f"objective {cls.__name__}: return its aggregation from reduction() (normalizer derives "
                            "from it) or override normalizer(); a defaulted normaliser would be silently wrong on "
                            "micro-batches and under DDP")

    def read_mask(self, batch) -> Tensor:
        """[B, T] bool: the positions whose policy log-prob, entropy or logits `loss` reads (its metrics
        included). The policy forward promises those only: elsewhere the view holds 0 (log-prob, entropy)
        and zero logits, and the flat layout skips the last layer's MLP and the LM head there
        (composer/runtime/varlen.py). Default: `loss_mask`; an objective that reads more overrides this."""
        return self.loss_mask(batch)

    @final
    def loss_mask(self, batch) -> Tensor:
        """[B, T] bool: tokens of `loss_tokens` origins that are not padding, in the rows the term's gate took
        (batch.row_mask, composer/gates.py): a gated-out row gets no loss and no share of the normaliser."""
        mask = batch.mask(self.loss_tokens) & batch.attention_mask
        return mask if batch.row_mask is None else mask & batch.row_mask[:, None]


def _words(v) -> str:
    if hasattr(v, "describe") and callable(v.describe):
        return v.describe()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def whole_batch_loss(obj: Objective, batch, view):
    """`loss` on a batch that holds whole groups: its own advantages first (tests, single-batch callers)."""
    batch.advantages = obj.advantages(batch)
    value, metrics = obj.loss(batch, view, batch.advantages)
    return value, {**obj.advantage_metrics(batch), **metrics}


# ----------------------------------------------------------------------------------------------
# Aggregation (ALGORITHMS.md section 0; verl `core_algos.agg_loss`, as in lasgroup/SDPO)
# ----------------------------------------------------------------------------------------------

def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, 0 where den == 0 (no NaN forward or backward)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def aggregate(loss_tok: Tensor, mask: Tensor, mode: str, norm_const: float | None = None,
              seq_weight: Tensor | None = None) -> Tensor:
    """Reduce a per-token loss matrix to a scalar (ALGORITHMS.md section 0, verl `agg_loss`).

    loss_tok [B, T], mask [B, T] (bool or 0/1), seq_weight [B] (s_i, default 1) -> scalar. With m = mask:
      token-mean:              sum_{i,t} m s_i l / sum_{i,t} m s_i     (verl/DAPO; SDPO with s_i)
      seq-mean-token-mean:     sum_i s_i (sum_t m l / sum_t m) / sum_i s_i   (GRPO paper form)
      seq-mean-token-sum:      sum_i s_i (sum_t m l) / sum_i s_i
      seq-mean-token-sum-norm: sum_{i,t} m s_i l / C, C = norm_const or T   (Dr. GRPO, Liu et al. 2025)
      token-sum:               sum_{i,t} m s_i l, no normaliser            (Tinker's built-in losses)
    The seq-means run over rows with at least one loss token (an empty row is no sequence; newer
    verl does the same); with s = 1 and no empty row they are the plain (1/B) sum_i of section 0.
    Masked-out entries are replaced by 0 before summing, so NaN/inf at pad positions never leaks.
    An all-empty mask gives 0.
    """
    m = mask.to(loss_tok.dtype)  # [B, T]
    s = torch.ones(loss_tok.shape[0], dtype=loss_tok.dtype, device=loss_tok.device) if seq_weight is None \
        else seq_weight.to(loss_tok.dtype)  # [B]
    w = m * s[:, None]  # [B, T]
    l = torch.where(w != 0, loss_tok, torch.zeros_like(loss_tok))  # [B, T]
    if mode == "token-mean":
        return _safe_div((w * l).sum(), w.sum())
    if mode == "seq-mean-token-sum-norm":
        C = float(norm_const) if norm_const is not None else float(loss_tok.shape[1])
        return (w * l).sum() / C
    if mode == "token-sum":
        return (w * l).sum()
    row_sum = (m * l).sum(-1)  # [B]
    n_tok = m.sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = _safe_div(row_sum, n_tok)  # [B]
    elif mode == "seq-mean-token-sum":
        per_seq = row_sum  # [B]
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
    s_rows = s * (n_tok > 0).to(s.dtype)  # [B]: rows with no loss token do not count
    return _safe_div((s_rows * per_seq).sum(), s_rows.sum())


def reference_token_weights(mask, mode: str, seq_weight=None, norm_const: float | None = None):
    """The references' aggregation (DESIGN.md section 10; never used by a loss): W [B, T] float64 with
    aggregate(l) = sum_{i,t} W_it l_it, written again from the formulas above with a loop over rows:
      token-mean m s_i / sum m s;  seq-mean-token-mean s_i m / (n_i sum_j s_j);  seq-mean-token-sum s_i m / sum_j s_j
      (the sums over rows with a loss token);  seq-mean-token-sum-norm m s_i / C;  token-sum m s_i."""
    import torch

    m = mask.double()  # [B, T]
    B, T = m.shape
    s = [1.0] * B if seq_weight is None else [float(x) for x in seq_weight]
    n = [float(m[i].sum()) for i in range(B)]
    rows = [i for i in range(B) if n[i] > 0]
    W = torch.zeros_like(m)
    tokens = sum(n[i] * s[i] for i in rows)
    seqs = sum(s[i] for i in rows)
    for i in rows:
        if mode == "token-mean":
            scale = s[i] / tokens if tokens else 0.0
        elif mode == "seq-mean-token-mean":
            scale = s[i] / (n[i] * seqs) if seqs else 0.0
        elif mode == "seq-mean-token-sum":
            scale = s[i] / seqs if seqs else 0.0
        elif mode == "seq-mean-token-sum-norm":
            scale = s[i] / (float(norm_const) if norm_const is not None else float(T))
        else:  # token-sum
            scale = s[i]
        W[i] = m[i] * scale
    return W


def aggregate_count(mask: Tensor, mode: str, norm_const: float | None = None,
                    seq_weight: Tensor | None = None) -> Tensor:
    """The denominator `aggregate` divides by for (mask, mode, seq_weight): sum m s for token-mean, the
    weight of rows with a loss token for the seq-means, C for seq-mean-token-sum-norm. -> scalar."""
    m = mask.float()  # [B, T]
    s = torch.ones(m.shape[0], device=m.device) if seq_weight is None else seq_weight.float()  # [B]
    if mode == "token-mean":
        return (m * s[:, None]).sum()
    if mode == "seq-mean-token-sum-norm":
        return torch.tensor(float(norm_const) if norm_const is not None else float(m.shape[1]), device=m.device)
    if mode == "token-sum":
        return torch.tensor(1.0, device=m.device)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (s * (m.sum(-1) > 0).float()).sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(m x) / sum(m) over every entry, 0 if the mask is empty. x, mask: same shape -> scalar."""
    m = mask.to(x.dtype)
    return _safe_div((torch.where(m != 0, x, torch.zeros_like(x)) * m).sum(), m.sum())


# ----------------------------------------------------------------------------------------------
# Group statistics (GRPO, Shao et al. 2024, arXiv 2402.03300; verl `compute_grpo_outcome_advantage`)
# ----------------------------------------------------------------------------------------------

def group_index(group: Tensor) -> tuple[Tensor, int]:
    """group [B] ids (any values) -> (inverse [B] in 0..G-1, G)."""
    uniq, inv = torch.unique(group, return_inverse=True)
    return inv, int(uniq.numel())


def group_stats(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row statistics of each row's group.

    rewards [B] float, group [B] -> (mean [B], std [B], count [B], constant [B] bool).
    std is unbiased (n-1, like torch.std), 0 for a group of one; `constant` marks rows whose group
    has all rewards equal (then mean is set to that reward exactly, so r - mean == 0 bit-exactly).
    Computed in float64, returned in the rewards' dtype.
    """
    inv, G = group_index(group)
    r = rewards.detach().to(torch.float64)  # [B]
    zeros = torch.zeros(G, dtype=torch.float64, device=r.device)
    n = zeros.index_add(0, inv, torch.ones_like(r))  # [G]
    mean = zeros.index_add(0, inv, r) / n  # [G]
    sq = zeros.index_add(0, inv, (r - mean[inv]) ** 2)  # [G]
    std = torch.sqrt(sq / (n - 1).clamp(min=1))  # [G]; n == 1 -> sq == 0 -> 0
    gmax = torch.full((G,), -float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((G,), float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amin")
    const = gmax == gmin  # [G]
    mean = torch.where(const, gmax, mean)
    std = torch.where(const, torch.zeros_like(std), std)
    dt = rewards.dtype
    return mean[inv].to(dt), std[inv].to(dt), n[inv].to(dt), const[inv]


def group_advantages(rewards: Tensor, group: Tensor, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantage A_i = (r_i - mean_g r) / (std_g r + eps), or r_i - mean_g r (Dr. GRPO).

    rewards [B], group [B] -> A [B]. Unbiased std with eps added to it (verl). A group whose rewards
    are all equal (including a group of one) gets exactly 0.
    """
    mean, std, _, const = group_stats(rewards, group)
    r = rewards.detach()
    adv = r - mean
    if std_norm:
        adv = adv / (std + eps)
    return torch.where(const, torch.zeros_like(adv), adv)


def zero_advantage_fraction(rewards: Tensor, group: Tensor) -> Tensor:
    """Fraction of trajectories whose group has all rewards equal (no group-relative signal). -> scalar."""
    _, _, _, const = group_stats(rewards, group)
    return const.to(torch.float32).mean()
