"""The trajectory batch: token ids with provenance, the one runtime value every objective reads.

Layout: B trajectories, each `[prompt][response]`, right-padded to T tokens. Per-token tensors are
aligned with `tokens`: `x_logprobs[b, t]` is log p(tokens[b, t] | tokens[b, :t]) under model x, and
`x_logits[b, t]` is the distribution that predicts tokens[b, t]. Position 0 has no prediction and
holds 0 (it is always a prompt token, so it never gets loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

from composer.lazy import torch
from composer.origins import CODE, ON_POLICY


@dataclass
class TrajectoryBatch:
    tokens: "torch.Tensor"  # [B, T] long
    origin: "torch.Tensor"  # [B, T] uint8, codes of composer.origins.ORIGINS (0 = pad)
    behavior_logprobs: "torch.Tensor"  # [B, T] float: log-prob under the weights that wrote the token
    group: "torch.Tensor"  # [B] long: advantage group id (prompt x guided/unguided)
    control: "torch.Tensor"  # [B] bool: never touched by the guide
    rewards: Optional["torch.Tensor"] = None  # [B] float
    teacher_logprobs: Optional["torch.Tensor"] = None  # [B, T]
    teacher_logits: Optional["torch.Tensor"] = None  # [B, T, V]
    initial_logprobs: Optional["torch.Tensor"] = None  # [B, T]: the frozen initial policy (KL, A*PO anchor)
    seq_weight: Optional["torch.Tensor"] = None  # [B]: per-trajectory weight (SDPO: 0 without teacher signal)
    examples: list = field(default_factory=list)  # [B] composer.data.Example
    prompt_index: Optional["torch.Tensor"] = None  # [B] long: which prompt of the step
    guided: Optional["torch.Tensor"] = None  # [B] bool: a guide wrote tokens into it
    info: dict[str, Any] = field(default_factory=dict)  # per-batch scalars for metrics
    behavior_known: Optional["torch.Tensor"] = None  # [B, T] bool: behavior_logprobs holds a real value (None: all)
    notes: list = field(default_factory=list)  # [B] dict: what the guide saw and did for each row
    advantages: Optional["torch.Tensor"] = None  # [B] (or [B, T] per token): the term's advantages (objectives that use them)
    row_mask: Optional["torch.Tensor"] = None  # [B] bool: the rows this term trains on (its gate); None: all
    old_logprobs: Optional["torch.Tensor"] = None  # [B, T]: the policy at the start of the step's first pass (set
    # when a step makes several updates, train.epochs x train.mini_batches; the importance ratio's denominator)
    token_select: Optional["torch.Tensor"] = None  # [B, T] bool: tokens a step-wide token selection chose (grpo's
    # token_selection: KL-Cov, Clip-Cov), computed with the advantages over the whole step, read by every micro-batch
    old_entropy: Optional["torch.Tensor"] = None  # [B, T]: entropy of the policy's next-token distribution at each
    # position at the step's start (the old policy), for an entropy token selection (grpo's token_selection: entropy,
    # archer); computed once per step before the advantages (composer/step.py, part 2)
    values: Optional["torch.Tensor"] = None  # [B, T]: a critic's values V(tokens[b, :t]) before the step's update (ppo)
    returns: Optional["torch.Tensor"] = None  # [B, T]: the critic's targets G_t = A_t + V_t (ppo's advantages)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def attention_mask(self) -> "torch.Tensor":
        return self.origin != CODE["pad"]  # [B, T]

    def mask(self, origins) -> "torch.Tensor":
        """[B, T] bool: tokens whose origin is one of `origins`."""
        m = torch.zeros_like(self.origin, dtype=torch.bool)
        for name in origins:
            m |= self.origin == CODE[name]
        return m

    @property
    def response_mask(self) -> "torch.Tensor":
        return self.attention_mask & (self.origin != CODE["prompt"])

    @property
    def prompt_len(self) -> "torch.Tensor":
        """[B] long: each row's leading prompt tokens (what rows of a group share; `token_logprobs` runs it once)."""
        return (self.origin == CODE["prompt"]).long().cumprod(1).sum(1)

    @property
    def known_mask(self) -> "torch.Tensor":
        """[B, T] bool: tokens whose behaviour log-prob is known (every non-pad token when not recorded)."""
        return self.attention_mask if self.behavior_known is None else self.behavior_known & self.attention_mask

    @property
    def policy_mask(self) -> "torch.Tensor":
        return self.mask(ON_POLICY)

    def weights(self) -> "torch.Tensor":
        return self.seq_weight if self.seq_weight is not None else torch.ones(self.size, dtype=torch.float32,
                                                                              device=self.tokens.device)

    def select(self, index) -> "TrajectoryBatch":
        """Rows `index` (a list or long tensor) of every per-row field."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.tokens.device)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("examples", "notes"):
                v = [v[i] for i in idx.tolist()] if v else v
            elif f.name == "info":
                v = dict(v)
            elif v is not None and hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == self.size:
                v = v[idx]
            out[f.name] = v
        return TrajectoryBatch(**out)

    def to(self, device, moved: dict | None = None) -> "TrajectoryBatch":
        """This batch on `device`. Pass one `moved` dict for all of a step's batches: tensors that terms
        share (their common rollout) are moved once and stay shared."""
        moved = {} if moved is None else moved
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if hasattr(v, "to") and not isinstance(v, (list, dict)):
                if id(v) not in moved:
                    moved[id(v)] = v.to(device)
                out[f.name] = moved[id(v)]
        return replace(self, **out)

    def term_view(self) -> "TrajectoryBatch":
        """A shallow copy for one term: the rollout's tensors are shared, while what a term's signal
        writes (rewards, teacher log-probs, sequence weights) stays that term's own."""
        return replace(self, info=dict(self.info))


def to_device(batches: list[TrajectoryBatch], device) -> list[TrajectoryBatch]:
    """A step's batches on `device`; tensors that terms share (their common rollout) are moved once."""
    moved: dict = {}
    return [b.to(device, moved) for b in batches]


@dataclass
class PolicyView:
    """The current policy on a batch: what objectives differentiate through."""

    logprobs: "torch.Tensor"  # [B, T] log pi_theta(tokens[b, t] | tokens[b, :t]), 0 at t = 0
    logits: Optional["torch.Tensor"] = None  # [B, T, V] predicting tokens[b, t]; only when wanted
    entropy: Optional["torch.Tensor"] = None  # [B, T] entropy of the predicting distribution
    values: Optional["torch.Tensor"] = None  # [B, T] a critic head on the policy's network (ppo critic.network: shared)


def concat(batches: list[TrajectoryBatch], pad_id: int) -> TrajectoryBatch:
    """Stack batches row-wise (right-padding to the longest T); group ids stay distinct per batch."""
    T = max(b.tokens.shape[1] for b in batches)
    offset, parts = 0, []
    for b in batches:
        grow = T - b.tokens.shape[1]

        def pad(x, value=0):
            if x is None or x.dim() < 2 or grow == 0:
                return x
            shape = (x.shape[0], grow) + tuple(x.shape[2:])
            return torch.cat([x, x.new_full(shape, value)], dim=1)

        parts.append(replace(b, tokens=pad(b.tokens, pad_id), origin=pad(b.origin), group=b.group + offset,
                             behavior_logprobs=pad(b.behavior_logprobs), behavior_known=pad(b.behavior_known, False),
                             teacher_logprobs=pad(b.teacher_logprobs),
                             teacher_logits=pad(b.teacher_logits), initial_logprobs=pad(b.initial_logprobs),
                             old_logprobs=pad(b.old_logprobs), token_select=pad(b.token_select, False),
                             old_entropy=pad(b.old_entropy),
                             values=pad(b.values), returns=pad(b.returns), advantages=pad(b.advantages)))
        offset += int(b.group.max()) + 1 if b.size else 0
    out = {}
    for f in fields(TrajectoryBatch):
        vals = [getattr(p, f.name) for p in parts]
        if f.name in ("examples", "notes"):
            out[f.name] = [e for v in vals for e in v]
        elif f.name == "info":
            out[f.name] = dict(vals[-1])
        elif any(v is None for v in vals):
            out[f.name] = None
        else:
            out[f.name] = torch.cat(vals, dim=0)
    return TrajectoryBatch(**out)
