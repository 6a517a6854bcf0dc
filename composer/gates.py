"""Term gates: a term trains only on the rows a declared predicate selects (DESIGN.md section 9).

A gate reads facts of the step's rollout, never the loss: the row's own outcome (success / failure, by an
outcome_reward source's `success_threshold`), its group's success rate, whether a successful sibling of the
same group exists (never the row itself), and where the row's mean surprisal falls among the step's rows.
Conditions are conjunctive. Rows outside the gate get no loss from the term and do not count in its
normaliser: the gate becomes `batch.row_mask`, which `Objective.loss_mask` applies, so every objective
(and its `normalizer`) honours it without knowing about gates.

A gate sees the step's rollout after `rollout.filter` (composer/filters.py): with `equal_groups: drop`, only the
prompts the filter kept (from every sampling round, the dropped ones that top up the step included), and with
`truncated: drop` only their rows that were not cut, so a group's success rate, a row's siblings and the
surprisal quantiles are over those rows; rows `truncated: mask` masks stay in the rollout (they count in its
groups and quantiles) and get no loss from any term whatever the gate says.

Gates are used by SRPO (GRPO on successes, self-distillation on failures with a successful sibling), HPT
(SFT on prompts the policy fails, GRPO on the others) and KDRL's reward-guided KD mask.

The config is validated without torch; `gate_rows` and the helpers below run on both backends (Lightning's
step, OpenRLHF's advantage step) over plain tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composer.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor


class Gate(BaseModel):
    """Which rows of the step a term trains on: every declared condition must hold (AND)."""

    model_config = ConfigDict(extra="forbid")

    outcome: Optional[Literal["success", "failure"]] = Field(None, description="The row's own outcome: `success` (reward >= the outcome_reward source's success_threshold) or `failure`.")
    group_success_at_most: Optional[float] = Field(None, ge=0, le=1, description="The row's group (the prompt's rollouts) has a success rate <= this (HPT: gamma; 0: no rollout succeeded).")
    group_success_above: Optional[float] = Field(None, ge=0, le=1, description="The row's group has a success rate > this (HPT's RL branch: P > gamma).")
    sibling_success: Optional[bool] = Field(None, description="true: another rollout of the same group succeeded (the row itself never counts); false: none did.")
    entropy_above_quantile: Optional[float] = Field(None, ge=0, lt=1, description="The row's mean surprisal -log pi_behaviour(y_t) over its policy tokens (a one-sample estimate of its per-token entropy) is at least this quantile of the step's rollout rows.")
    entropy_below_quantile: Optional[float] = Field(None, gt=0, le=1, description="The row's mean surprisal is below this quantile of the step's rollout rows.")
    source: Optional[str] = Field(None, description="The outcome_reward source that decides success (default: the spec's only outcome_reward source).")

    @model_validator(mode="after")
    def _something(self):
        conds = [f for f in ROW_FACTS + GROUP_FACTS if getattr(self, f) is not None]
        if not conds:
            raise ValueError("a gate needs at least one condition: outcome, group_success_at_most, "
                             "group_success_above, sibling_success, entropy_above_quantile or entropy_below_quantile")
        lo, hi = self.group_success_above, self.group_success_at_most
        if lo is not None and hi is not None and hi <= lo:
            raise ValueError(f"group_success_above {lo:g} and group_success_at_most {hi:g} select no group")
        lo, hi = self.entropy_above_quantile, self.entropy_below_quantile
        if lo is not None and hi is not None and hi <= lo:
            raise ValueError(f"entropy_above_quantile {lo:g} and entropy_below_quantile {hi:g} select no row")
        return self

    @property
    def reads_surprisal(self) -> bool:
        """An entropy condition: the gate reads each row's mean surprisal."""
        return self.entropy_above_quantile is not None or self.entropy_below_quantile is not None

    def reference_rows(self, success: list, group: list, surprisal: list | None) -> list[bool]:
        """The referee's rows (DESIGN.md section 10), written again in plain Python from the declared conditions,
        sharing nothing with `gate_rows`: row i is kept when every condition holds, with its group's success rate
        (success over the group's rows), a sibling's success (another row of the group), and the quantiles of the
        rows' surprisal by linear interpolation between order statistics (numpy's default)."""
        def quantile(xs: list, q: float) -> float:
            s = sorted(xs)
            pos = q * (len(s) - 1)
            lo = int(pos // 1)
            hi = min(lo + 1, len(s) - 1)
            return s[lo] + (s[hi] - s[lo]) * (pos - lo)

        members: dict = {}
        for i, g in enumerate(group):
            members.setdefault(g, []).append(i)
        out = []
        for i in range(len(success)):
            rows = members[group[i]]
            rate = sum(success[j] for j in rows) / len(rows)
            sib = any(success[j] for j in rows if j != i)
            ok = True
            if self.outcome is not None:
                ok = ok and success[i] == (self.outcome == "success")
            if self.group_success_at_most is not None:
                ok = ok and rate <= self.group_success_at_most + 1e-9
            if self.group_success_above is not None:
                ok = ok and rate > self.group_success_above + 1e-9
            if self.sibling_success is not None:
                ok = ok and sib == self.sibling_success
            if self.entropy_above_quantile is not None:
                ok = ok and surprisal[i] >= quantile(surprisal, self.entropy_above_quantile)
            if self.entropy_below_quantile is not None:
                ok = ok and surprisal[i] < quantile(surprisal, self.entropy_below_quantile)
            out.append(bool(ok))
        return out

    def row_facts(self) -> list[str]:
        """Conditions about a single rollout row (a term whose batch is not the rollout cannot use them)."""
        return [f for f in ROW_FACTS if getattr(self, f) is not None]

    def describe(self) -> str:
        """The gate in words, for explain and plan.json."""
        parts = []
        if self.outcome is not None:
            parts.append(f"the rollout {'succeeded' if self.outcome == 'success' else 'failed'}")
        if self.group_success_at_most is not None:
            parts.append("no rollout of its group succeeded" if self.group_success_at_most == 0 else
                         f"its group's success rate is at most {self.group_success_at_most:g}")
        if self.group_success_above is not None:
            parts.append("at least one rollout of its group succeeded" if self.group_success_above == 0 else
                         f"its group's success rate is above {self.group_success_above:g}")
        if self.sibling_success is not None:
            parts.append("another rollout of its group (a sibling, never the row itself) succeeded"
                         if self.sibling_success else "no other rollout of its group succeeded")
        if self.entropy_above_quantile is not None:
            parts.append(f"its mean surprisal is at or above the step's {self.entropy_above_quantile:g} quantile")
        if self.entropy_below_quantile is not None:
            parts.append(f"its mean surprisal is below the step's {self.entropy_below_quantile:g} quantile")
        return " and ".join(parts)


ROW_FACTS = ["outcome", "sibling_success", "entropy_above_quantile", "entropy_below_quantile"]
GROUP_FACTS = ["group_success_at_most", "group_success_above"]


def gate_source(gate: Gate, spec) -> str | None:
    """The outcome_reward source that decides success: the declared one, else the spec's only one."""
    if gate.source is not None:
        return gate.source
    names = [n for n, s in spec.sources.items() if s.kind_name() == "outcome_reward"]
    return names[0] if len(names) == 1 else None


# ----------------------------------------------------------------------------------------------- the rows

def row_surprisal(behavior_logprobs: Tensor, policy_mask: Tensor) -> Tensor:
    """[B, T] behaviour log-probs, [B, T] bool mask of the policy's tokens -> [B] mean -log pi_beh(y_t) over
    each row's policy tokens (0 for a row without one): E[-log p(y)] = H, one sample per token."""
    m = policy_mask.to(behavior_logprobs.dtype)  # [B, T]
    lp = torch.where(policy_mask, behavior_logprobs, torch.zeros_like(behavior_logprobs))
    return -(lp * m).sum(-1) / m.sum(-1).clamp(min=1)  # [B]


def group_success_rate(success: Tensor, group: Tensor) -> Tensor:
    """success [N] bool, group [N] ids -> [N] the success rate of each row's group."""
    uniq, inv = torch.unique(group, return_inverse=True)  # inv [N]
    zeros = torch.zeros(int(uniq.numel()), dtype=torch.float64, device=success.device)
    hits = zeros.index_add(0, inv, success.to(torch.float64))  # [G]
    n = zeros.index_add(0, inv, torch.ones_like(success, dtype=torch.float64))  # [G]
    return (hits / n)[inv]  # [N]


def sibling_succeeded(success: Tensor, group: Tensor) -> Tensor:
    """[N] bool: another row of the same group succeeded (successes in the group minus the row's own > 0)."""
    uniq, inv = torch.unique(group, return_inverse=True)
    hits = torch.zeros(int(uniq.numel()), dtype=torch.long, device=success.device).index_add(0, inv, success.long())
    return (hits[inv] - success.long()) > 0  # [N]


def gate_rows(gate: Gate, success: Tensor, group: Tensor, surprisal: Tensor | None = None) -> Tensor:
    """The gate over the step's rollout rows: success [N] bool, group [N], surprisal [N] (needed by the
    entropy conditions) -> [N] bool, the rows the term trains on. Quantiles are over all N rows (torch
    `quantile`, linear interpolation)."""
    keep = torch.ones_like(success, dtype=torch.bool)  # [N]
    if gate.outcome is not None:
        keep &= success if gate.outcome == "success" else ~success
    rate = group_success_rate(success, group)  # [N]
    if gate.group_success_at_most is not None:
        keep &= rate <= gate.group_success_at_most + 1e-9
    if gate.group_success_above is not None:
        keep &= rate > gate.group_success_above + 1e-9
    if gate.sibling_success is not None:
        sib = sibling_succeeded(success, group)
        keep &= sib if gate.sibling_success else ~sib
    if gate.entropy_above_quantile is not None or gate.entropy_below_quantile is not None:
        if surprisal is None:
            raise ValueError("an entropy gate needs the rows' surprisal")
        s = surprisal.double()
        if gate.entropy_above_quantile is not None:
            keep &= s >= torch.quantile(s, gate.entropy_above_quantile)
        if gate.entropy_below_quantile is not None:
            keep &= s < torch.quantile(s, gate.entropy_below_quantile)
    return keep


def gate_by_prompt(gate: Gate, success: Tensor, prompt_index: Tensor, rows_prompt: Tensor) -> Tensor:
    """A gate of group facts only, for a batch that is not the rollout (SFT on references): each of its rows
    takes the gate of its prompt's rollouts. success [N], prompt_index [N] of the rollout rows; rows_prompt
    [M] the prompt of each row of the gated batch -> [M] bool (False for a prompt with no rollout)."""
    rate = group_success_rate(success, prompt_index)  # [N]
    out = torch.zeros(rows_prompt.shape[0], dtype=torch.bool, device=rows_prompt.device)
    for m, p in enumerate(rows_prompt.tolist()):
        hit = (prompt_index == p).nonzero()
        if hit.numel() == 0:
            continue
        r = float(rate[int(hit[0])])
        ok = True
        if gate.group_success_at_most is not None:
            ok &= r <= gate.group_success_at_most + 1e-9
        if gate.group_success_above is not None:
            ok &= r > gate.group_success_above + 1e-9
        out[m] = ok
    return out


def gate_metrics(name: str, rows: Tensor, many: bool = True) -> dict[str, float]:
    """The fraction of the term's rows its gate took, as `<term>/gate_frac` (the README's name), with one term
    too: a gate is a term's, and the name says whose (`many` is kept for callers; it no longer changes it)."""
    return {f"{name}/gate_frac": float(rows.float().mean()) if rows.numel() else 0.0}
