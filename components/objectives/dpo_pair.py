"""Online DPO from a group: a preference loss over pairs of the step's own rollouts (ALGORITHMS.md section 15).

DPO (Rafailov et al. 2023, "Direct Preference Optimization", arXiv 2305.18290), online: the pairs are drawn from the
policy's own rollouts of a prompt, ranked by their reward (as in online / iterative DPO, Guo et al. 2024, arXiv
2402.04792; Xiong et al. 2024, arXiv 2312.11456, and the GRPO + DPO hybrids of 2025):

  s_i   = sum_t m_it (log pi_theta(y_it) - log pi_ref(y_it))          the sequence log-ratio of row i to the reference
  l_p   = -log sigmoid(beta (s_w - s_l))                              pair p = (w, l): r_w > r_l, same group
  L     = (1 / P) sum_p l_p                                           P: the step's pairs

pi_ref is the frozen reference policy (the initial weights, as a KL term's: batch.initial_logprobs); m the loss
tokens (the policy's response tokens by default). Pairs are formed inside each advantage group (one prompt's
rollouts) among the rows the term trains (a gate's rows, with at least one loss token):
  best_worst     the highest- and the lowest-reward row, when their rewards differ (the first row in batch order
                 among ties); at most one pair per group
  all_distinct   every pair of rows whose rewards differ, the better one chosen

The loss of one row depends on another row of its group, so the term declares `couples_rows = "group"`: every part
of a step its loss sees (a mini-batch, a DDP rank's rows, a micro-batch) holds whole groups, and its normaliser is
the number of pairs, so the parts' losses scaled by their shares add up to the whole step's (composer/step.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from components.objectives.base import Objective
from composer.capabilities import Capabilities, Need
from composer.lazy import torch
from composer.registry import register

if TYPE_CHECKING:
    from torch import Tensor

    from composer.batch import PolicyView, TrajectoryBatch


def preference_pairs(rewards: Tensor, group: Tensor, eligible: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """The pairs of one batch of whole groups: (chosen [P], rejected [P]) row indices, in group order.

    rewards [B], group [B], eligible [B] bool (rows that may enter a pair), mode best_worst | all_distinct.
    best_worst: per group the first row with the highest reward and the first with the lowest, if they differ;
    all_distinct: every (i, j) of a group with r_i > r_j, i and j in row order."""
    r = rewards.detach().to(torch.float64).cpu()  # [B]
    g = group.detach().cpu()  # [B]
    ok = eligible.detach().cpu().to(torch.bool)  # [B]
    win, lose = [], []
    for gid in torch.unique(g).tolist():
        rows = torch.nonzero((g == gid) & ok).flatten()  # [n] this group's eligible rows, in order
        if rows.numel() < 2:
            continue
        vals = r[rows]  # [n]
        if mode == "best_worst":
            hi, lo = rows[torch.argmax(vals)], rows[torch.argmin(vals)]  # argmax/argmin: the first extremum
            if r[hi] > r[lo]:
                win.append(int(hi))
                lose.append(int(lo))
        else:
            better = vals[:, None] > vals[None, :]  # [n, n]: row a's reward above row b's
            a, b = torch.nonzero(better, as_tuple=True)
            win += rows[a].tolist()
            lose += rows[b].tolist()
    dev = rewards.device
    return torch.tensor(win, dtype=torch.long, device=dev), torch.tensor(lose, dtype=torch.long, device=dev)


def sequence_log_ratio(logp: Tensor, ref: Tensor, mask: Tensor) -> Tensor:
    """s_i = sum_t m_it (log pi_theta - log pi_ref): logp [B, T], ref [B, T] (detached), mask [B, T] bool -> [B].
    Masked-out entries are zeroed before the difference (padding may hold -inf)."""
    zero = torch.zeros_like(logp)
    return (torch.where(mask, logp, zero) - torch.where(mask, ref.detach().to(logp.dtype), zero)).sum(-1)


def dpo_pair_loss(s: Tensor, chosen: Tensor, rejected: Tensor, beta: float) -> Tensor:
    """-log sigmoid(beta (s_w - s_l)) per pair: s [B], chosen [P], rejected [P] -> [P]."""
    return -torch.nn.functional.logsigmoid(beta * (s[chosen] - s[rejected]))


@register("objective")
class DpoPair(Objective):
    """Online DPO from a group (ALGORITHMS.md section 15; DPO: Rafailov et al. 2023, arXiv 2305.18290):

      L = (1/P) sum_{(w,l)} -log sigmoid(beta ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))))

    over the step's pairs (w, l) of rollouts of one group with r_w > r_l (`pairs`), sequence log-probs summed over
    the loss tokens, pi_ref the frozen reference (the initial policy). A term coupling two rows: every part of the
    step it sees holds whole groups (`couples_rows`), its normaliser is the number of pairs."""

    kind: Literal["dpo_pair"] = Field("dpo_pair", description="Component kind.")
    beta: float = Field(0.1, gt=0, description="DPO's beta: the scale of the sequence log-ratio margin inside the sigmoid (DPO and TRL's default 0.1).")
    pairs: Literal["best_worst", "all_distinct"] = Field("best_worst", description="Which pairs each group gives: best_worst, the highest- and the lowest-reward rollout when their rewards differ (one pair per group; the first row among ties); all_distinct, every two rollouts whose rewards differ, the better one chosen.")

    needs: ClassVar = ("reward",)
    couples_rows: ClassVar = "group"
    several_updates: ClassVar = "a preference loss against the frozen reference on the step's fixed pairs (DPO's epochs over a preference set)"

    def capabilities(self) -> Capabilities:
        """Not on-policy only (no importance ratio: the pairs are a preference set, the reference is frozen); it needs
        a backend whose every micro-batch and rank holds whole groups (`coupled_rows`)."""
        return Capabilities(on_policy_only=False, needs=(Need("coupled_rows"),))

    @property
    def wants_initial(self) -> bool:
        """The sequence log-ratios are against the frozen reference (the initial policy's log-probs)."""
        return True

    def anchors(self) -> dict[str, str]:
        return {o: "summed into the sequence log-ratio to the frozen reference (initial policy), in pairs" for o in
                self.loss_tokens}

    def describe(self) -> list[str]:
        which = {"best_worst": "the highest- and the lowest-reward rollout of each group (rewards distinct)",
                 "all_distinct": "every two rollouts of a group whose rewards differ"}[self.pairs]
        return [(f"online DPO pairs: {which}; loss -log sigmoid({self.beta:g} ((log pi(y_w) - log pi_ref(y_w)) - "
                f"(log pi(y_l) - log pi_ref(y_l)))), sequence log-probs summed over the loss tokens, pi_ref the frozen "
                "initial policy; the mean over the step's pairs"),
                ("couples rows: every mini-batch, micro-batch and rank holds whole groups, the normaliser is the "
                "step's number of pairs")]

    def eligible(self, batch) -> Tensor:
        """[B] bool: rows that may enter a pair (a loss token in the term's rows)."""
        return self.loss_mask(batch).any(-1)

    def pairs_of(self, batch) -> tuple[Tensor, Tensor]:
        if batch.rewards is None:
            raise ValueError("dpo_pair: the batch has no rewards (a reward signal must fill batch.rewards)")
        return preference_pairs(batch.rewards, batch.group, self.eligible(batch), self.pairs)

    def normalizer(self, batch) -> Tensor:
        """P, the pairs of `batch` (a part holding whole groups holds whole pairs: the parts' P add up)."""
        return torch.tensor(float(self.pairs_of(batch)[0].numel()))

    def normaliser_words(self) -> str:
        return "the step's pairs (whole groups in every part)"

    def loss(self, batch: TrajectoryBatch, cur: PolicyView, adv=None) -> tuple[Tensor, dict[str, float]]:
        if batch.initial_logprobs is None:
            raise ValueError("dpo_pair needs batch.initial_logprobs (the frozen reference policy's log-probs)")
        mask = self.loss_mask(batch)  # [B, T]
        s = sequence_log_ratio(cur.logprobs, batch.initial_logprobs.to(cur.logprobs.device), mask)  # [B]
        win, lose = self.pairs_of(batch)  # [P], [P]
        win, lose = win.to(s.device), lose.to(s.device)
        if win.numel() == 0:  # no pair: 0, with a graph (a part with no pair still joins the backward)
            return (s * 0.0).sum(), {"loss": 0.0, "pairs": 0.0}
        per_pair = dpo_pair_loss(s, win, lose, self.beta)  # [P]
        loss = per_pair.mean()
        margin = (s[win] - s[lose]).detach()  # [P]
        return loss, {"loss": float(loss.detach()), "pairs": float(win.numel()),
                      "margin_mean": float(margin.float().mean()),
                      "pair_accuracy": float((margin > 0).float().mean()),
                      "chosen_logratio": float(s[win].detach().float().mean()),
                      "rejected_logratio": float(s[lose].detach().float().mean())}

    def reference_loss(self, batch, mask, view, inputs: dict) -> dict:
        """The referee's loss (DESIGN.md section 10), written again with loops in float64: the pairs from the recorded
        rewards and groups over the rows with a loss token in `mask`, s_i = sum_t mask_it (log pi_it - initial_it)
        with the reference log-probs the referee recomputed (`inputs["initial"]`), then

          L = (1/P) sum_p -log sigmoid(beta (s_w - s_l)),
          d L / d log pi_t = -(beta / P) sigmoid(-beta (s_w - s_l)) on y_w's loss tokens, +(same) on y_l's

        "acted": {"pairs": P}, the pairs the run formed."""
        import math

        import torch as th

        m = mask.cpu().bool()
        B = m.shape[0]
        lp = view.logprobs.detach().cpu().double()
        ref = inputs["initial"].detach().cpu().double()
        r = [float(x) for x in batch.rewards.cpu().tolist()]
        g = [int(x) for x in batch.group.cpu().tolist()]
        rows_with = [i for i in range(B) if bool(m[i].any())]
        s = {i: sum(float(lp[i, t]) - float(ref[i, t]) for t in range(m.shape[1]) if m[i, t]) for i in rows_with}
        pairs = []
        for gid in sorted(set(g)):
            rows = [i for i in rows_with if g[i] == gid]
            if len(rows) < 2:
                continue
            if self.pairs == "best_worst":
                best = worst = rows[0]
                for i in rows:
                    best = i if r[i] > r[best] else best
                    worst = i if r[i] < r[worst] else worst
                if r[best] > r[worst]:
                    pairs.append((best, worst))
            else:
                pairs += [(i, j) for i in rows for j in rows if r[i] > r[j]]
        grad = th.zeros(m.shape, dtype=th.float64)
        value = 0.0
        for w, lo in pairs:
            x = self.beta * (s[w] - s[lo])
            value += (math.log1p(math.exp(-x)) if x >= 0 else -x + math.log1p(math.exp(x))) / len(pairs)  # -log sig(x)
            sig_neg = math.exp(-x) / (1.0 + math.exp(-x)) if x >= 0 else 1.0 / (1.0 + math.exp(x))  # sigmoid(-x)
            d = -self.beta * sig_neg / len(pairs)  # d/ds_w of -log sigmoid(beta (s_w - s_l)) / P
            grad[w] += m[w].double() * d
            grad[lo] -= m[lo].double() * d
        return {"value": value, "grad": grad, "scale": self.beta / max(len(pairs), 1), "acted": {"pairs": len(pairs)}}
