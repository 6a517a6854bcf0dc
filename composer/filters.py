"""Rollout filters (DESIGN.md section 9): run after rewards and before advantages.

`equal_groups: drop` is DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476; verl `filter_groups`):
a prompt whose rollouts all got the same reward gives GRPO no signal (A = 0 for every row), so it is dropped
and more prompts are sampled until the step holds train.prompts_per_step prompts with mixed rewards, at most
`max_rounds` extra rounds (then the step is filled up with dropped prompts, counted as filter/unfilled).
The extra rounds' tokens count in the run's cost columns (cost/policy_tokens, and cost/filter_extra_tokens,
cost/filter_extra_prompts on their own).

`truncated` is DAPO's overlong filtering: a response that stopped at the length cap (no EOS at its end)
is kept, masked (no loss in any term, outside every normaliser) or dropped (removed before advantages).

The config is validated without torch; the helpers are shared by both backends. `RolloutFilter.reference_rows`
is the same filter written again, plainly, for the referee (`composer check`, DESIGN.md section 10).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from composer.capabilities import Capabilities, Capable, Need
from composer.lazy import torch


class RolloutFilter(Capable, BaseModel):
    """Which rollouts of a step are trained on, decided after rewards and before advantages."""

    model_config = ConfigDict(extra="forbid")

    equal_groups: Literal["keep", "drop"] = Field("keep", description="`drop`: a prompt whose rollouts all got the same reward is dropped and more prompts are sampled until the step is full (DAPO dynamic sampling).")
    max_rounds: Optional[int] = Field(4, ge=1, le=1000, description="With equal_groups: drop, the most extra sampling rounds per step (null: no cap, as OpenRLHF's dynamic filtering); past it the step is filled up with dropped prompts.")
    truncated: Literal["keep", "mask", "drop"] = Field("keep", description="A response cut at max_new_tokens (no EOS at its end): `keep`, `mask` (no loss from any term, outside every normaliser; DAPO overlong filtering) or `drop` (removed before advantages).")
    source: Optional[str] = Field(None, description="The outcome_reward source whose rewards decide equal groups (default: the reward signal's source).")

    @property
    def active(self) -> bool:
        return self.equal_groups == "drop" or self.truncated != "keep"

    def capabilities(self) -> Capabilities:
        needs = [Need("capped_refill", ("max_rounds",))] if self.equal_groups == "drop" and self.max_rounds is not None \
            else []
        needs += [Need("row_drop", ("truncated",))] if self.truncated == "drop" else []
        return Capabilities(needs=tuple(needs))

    def describe(self) -> str:
        parts = []
        if self.equal_groups == "drop":
            cap = "no cap" if self.max_rounds is None else f"at most {self.max_rounds} extra round(s)"
            parts.append(f"drop prompts whose rewards are all equal and sample more until the step is full ({cap})")
        if self.truncated != "keep":
            parts.append(f"{self.truncated} responses cut at max_new_tokens")
        return "; ".join(parts)

    def reference_rows(self, rewards_of, cut: list, n: int, prompts: int) -> dict:
        """The filter written again, plainly, for the referee (DESIGN.md section 10: it calls none of the helpers
        below): which rows of a step's recorded sampling rounds the step trains on.

        `cut[k][i]`: row i of sampling round k ended without a stop token (cut at max_new_tokens); rows are written
        prompt by prompt, `n` each. `rewards_of(k)`: the filter source's reward of each row of round k (None where
        it cannot be recomputed), read only by `equal_groups: drop`. `prompts`: the step's prompts (prompts_per_step).

        equal_groups: drop (DAPO's dynamic sampling): round k's prompts whose n rewards are all equal are dropped,
        the others kept in order; rounds go on while fewer than `prompts` are kept and round k < max_rounds (null:
        no cap); the step is the first `prompts` kept prompts, topped up with the first dropped ones when the
        rounds ran out. truncated (DAPO's overlong filtering), on those rows: `mask` takes the cut rows out of every
        loss; `drop` removes them (the prompt's group keeps its other rows), unless every row was cut: then they
        are masked instead (a step needs rows).

        -> {"rounds": how many rounds the step takes (None: more than were recorded), "rows": [(k, i)] the rows of
        the step's batch in its order, "prompt": the slot (0..) of each row's prompt in the step, "trained": [bool]
        per row (False: masked), "mixed": kept prompts per round, "topped_up": dropped prompts the step holds,
        "cut": cut rows among the step's prompts' rows, "equal": per kept slot, whether its prompt is all-equal};
        None when a reward the filter reads cannot be recomputed."""
        kept, dropped, mixed = [], [], []  # (round, the prompt's first row)
        rounds = None
        for k in range(len(cut)):
            rewards = rewards_of(k) if self.equal_groups == "drop" else None
            if self.equal_groups == "drop" and rewards is None:
                return None
            m = 0
            for first in range(0, len(cut[k]), n):
                equal = rewards is not None and max(rewards[first:first + n]) == min(rewards[first:first + n])
                if equal:
                    dropped.append((k, first))
                else:
                    kept.append((k, first))
                    m += 1
            mixed.append(m)
            if len(kept) >= prompts or self.equal_groups != "drop" or (self.max_rounds is not None
                                                                       and k >= self.max_rounds):
                rounds = k + 1
                break
        top_up = dropped[:max(prompts - len(kept), 0)]
        slots = kept[:prompts] + top_up
        rows, prompt = [], []
        for slot, (k, first) in enumerate(slots):
            for i in range(first, min(first + n, len(cut[k]))):
                rows.append((k, i))
                prompt.append(slot)
        was_cut = [cut[k][i] for k, i in rows]
        trained = [True] * len(rows)
        if self.truncated == "drop" and any(was_cut) and not all(was_cut):
            rows = [r for r, c in zip(rows, was_cut) if not c]
            prompt = [p for p, c in zip(prompt, was_cut) if not c]
            trained = [True] * len(rows)
        elif self.truncated != "keep":
            trained = [not c for c in was_cut]
        return {"rounds": rounds, "rows": rows, "prompt": prompt, "trained": trained, "mixed": mixed,
                "topped_up": len(top_up), "cut": sum(was_cut), "equal": [s in top_up for s in slots]}


def filter_source(flt: RolloutFilter, spec) -> str | None:
    """The source whose rewards decide equal groups: the declared one, else the first reward signal's."""
    if flt.source is not None:
        return flt.source
    from composer.checks.terms import terms

    for _n, sig, _o, _w in terms(spec):
        if sig is not None and sig.kind_name() == "reward":
            return sig.source
    names = [n for n, s in spec.sources.items() if s.kind_name() == "outcome_reward"]
    return names[0] if len(names) == 1 else None


def truncated_rows(batch, eos_id):
    """[B] bool: rows whose response does not end in a stop token (cut at the length cap), as the OpenRLHF agent
    reports `truncated`; an episode's row (rollout.environment) is cut when its policy was cut in the middle of a
    turn (composer/episodes.py `cut_mid_turn`), not when the environment or the turn limit ended it. `eos_id`: one
    id or the model's stop tokens (composer/stops.py)."""
    from composer.episodes import cut_mid_turn

    resp = batch.response_mask  # [B, T]
    T = resp.shape[1]
    pos = torch.arange(T, device=resp.device).expand_as(resp)
    last = torch.where(resp, pos, torch.full_like(pos, -1)).max(-1).values  # [B] last response position
    tok = batch.tokens.gather(1, last.clamp(min=0)[:, None]).squeeze(1)  # [B]
    stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=tok.dtype, device=tok.device)
    out = (last < 0) | ~torch.isin(tok, stops)  # [B]
    for i, note in enumerate((batch.notes or [])[: out.shape[0]]):
        cut = cut_mid_turn(note)
        if cut is not None:
            out[i] = cut
    return out


def equal_prompts(rewards, prompt_index) -> dict[int, bool]:
    """{prompt: whether all its rollouts got the same reward} over rewards [N], prompt_index [N]."""
    out = {}
    for p in sorted(set(prompt_index.tolist())):
        r = rewards[prompt_index == p]
        out[p] = bool((r == r[0]).all())
    return out


def filtered_rollout(ctx, examples: list, n: int):
    """The step's rollout under the spec's rollout.filter (Lightning): -> (batch, examples of its prompts).
    Rows keep their groups; prompt_index is renumbered 0..P-1 in the order of the returned examples."""
    from composer.batch import concat

    spec = ctx.spec
    flt, guide = spec.rollout.filter, spec.rollout.guide
    want = len(examples)
    kept, dropped = [], []  # (batch of one prompt's rows, example)
    todo, rounds, sampled = list(examples), 0, 0
    extra_tokens = 0
    while True:
        before = ctx.costs["policy_tokens"]
        batch = guide.rollout(ctx, todo, n)
        if rounds:
            extra_tokens += ctx.costs["policy_tokens"] - before
        sampled += len(todo)
        equal = {}
        if flt.equal_groups == "drop":
            rewards = ctx.source(filter_source(flt, spec)).rewards(ctx, batch)  # [B]
            equal = equal_prompts(rewards, batch.prompt_index)
        for k, ex in enumerate(todo):
            rows = (batch.prompt_index == k).nonzero().flatten().tolist()
            part = (_rows(batch, rows), ex)
            (dropped if equal.get(k, False) else kept).append(part)
        missing = _most_missing(ctx, max(want - len(kept), 0))  # the same on every rank: one data stream
        if missing == 0 or flt.equal_groups != "drop" or (flt.max_rounds is not None and rounds >= flt.max_rounds):
            break
        rounds += 1
        todo = ctx.next_prompts(missing)
    kept_frac = len(kept) / max(sampled, 1)
    unfilled = max(want - len(kept), 0)
    parts = kept[:want] + dropped[:unfilled]
    for i, (b, _ex) in enumerate(parts):
        b.prompt_index = torch.full((b.size,), i, dtype=torch.long)
    out = concat([b for b, _ in parts], ctx.pad_id)
    out.info = {"temperature": batch.info.get("temperature", 1.0)}
    truncated = truncated_rows(out, ctx.stop_ids)  # [B]
    if flt.truncated == "drop" and truncated.any() and not truncated.all():
        out = _rows(out, (~truncated).nonzero().flatten().tolist())
        truncated = torch.zeros(out.size, dtype=torch.bool)
    elif flt.truncated != "keep":
        out.row_mask = ~truncated  # `drop` of every row falls back to masking them: a step needs rows
    metrics = {"filter/truncated_frac": float(truncated.float().mean())}
    if flt.equal_groups == "drop":
        ctx.costs["filter_extra_prompts"] = ctx.costs.get("filter_extra_prompts", 0) + (sampled - len(examples))
        ctx.costs["filter_extra_tokens"] = ctx.costs.get("filter_extra_tokens", 0) + extra_tokens
        metrics.update({"filter/kept_frac": kept_frac, "filter/rounds": float(rounds),
                        "filter/extra_prompts": float(sampled - len(examples)), "filter/unfilled": float(unfilled)})
    ctx.log(**metrics)
    return out, [ex for _b, ex in parts]


def _most_missing(ctx, missing: int) -> int:
    """The largest number of missing prompts over the ranks (DDP): every rank draws that many, so the ranks'
    data streams stay one global stream (a rank that needs fewer keeps its first ones)."""
    if ctx.data.world <= 1:
        return missing
    t = torch.tensor([missing], dtype=torch.long)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t)


def _rows(batch, rows: list[int]):
    """Rows of a rollout batch, without its per-row caches (verdicts, texts: recomputed for the new rows)."""
    out = batch.select(rows)
    out.info = {k: v for k, v in out.info.items() if not isinstance(v, list)}
    return out
