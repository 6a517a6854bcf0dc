"""Judge interventions inside rollouts (MInTRL chunk reviews, InT end-of-rollout rewrites).

A trajectory is built as pieces with provenance: the policy's accepted steps (origin `policy`) and
the judge's corrections (origin `guide_intervention`). Policy tokens a REVISE discards never enter
the stored sequence. All generation is batched: one policy `generate` per round over every live
row, one judge call per round over every row under review.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import ClassVar, Literal

from pydantic import Field

from components.guides.judges import MALFORMED, REVISE, make_judge
from composer.registry import Component, register


@register("guide")
class InterventionGuide(Component):
    """A judge reviews the policy's steps and replaces the first wrong one with a short correction.

    `review: chunk` is MInTRL's Algorithm 1 (Chen et al. 2026): review every `chunk_tokens` of new text.
    `review: end` is InT (Yang et al. 2026, arXiv 2601.14209): one review of a finished, failed rollout.
    """

    kind: Literal["intervention"] = Field("intervention", description="Component kind.")
    judge: str = Field(..., description="The source that reviews: a policy_model (external or `self`) or an oracle.")
    review: Literal["chunk", "end"] = Field("chunk", description="`chunk`: review every chunk (MInTRL); `end`: one review of a finished, failed rollout (InT).")
    chunk_tokens: int = Field(512, ge=1, description="Policy tokens generated between reviews.")
    step_split: str = Field("\n\n", min_length=1, description="Separator that splits new text into numbered steps.")
    max_reviews: int = Field(4, ge=0, description="Most reviews per trajectory.")
    max_correction_tokens: int = Field(64, ge=1, description="Longest correction the judge may write.")
    control_samples: int = Field(0, ge=0, description="Of samples_per_prompt, how many are never guided (control rollouts).")

    refs: ClassVar = {"judge": ("policy_model", "oracle")}
    provides: ClassVar = ("guided_tokens",)

    def rollout(self, ctx, examples, n: int):
        """n rollouts per prompt, one advantage group per prompt; the first `control_samples` are controls.

        chunk (MInTRL Algorithm 1): accepted prefix p = empty; repeat: the policy writes `chunk_tokens`
        more; the new complete steps (split on `step_split`) go to the judge with (x, p); KEEP appends
        them to p; REVISE k keeps the steps before k and appends the judge's correction h (at most
        `max_correction_tokens`); at most `max_reviews` reviews; until EOS or max_new_tokens.
        end (InT): sample to the end; a failed rollout gets one review; on REVISE the policy continues
        from the kept steps + correction, without the reference.
        """
        from composer.runtime.trajectory import Row, assemble

        lives = []
        for i, ex in enumerate(examples):
            prompt = ctx.encode(ex.prompt)
            lives += [Live(Row(ex, prompt, group=i, prompt_index=i, control=j < self.control_samples))
                      for j in range(n)]
        judge = make_judge(ctx, self.judge, self.max_correction_tokens)
        stats = Stats()
        (chunk_loop if self.review == "chunk" else end_review)(ctx, self, judge, lives, stats)
        for s in lives:  # whatever is left unreviewed is the policy's
            s.accept(len(s.pending), [])
        rows = [s.row for s in lives]
        for r in rows:
            r.pieces = merge_pieces(r.pieces)
        logprobs = ctx.engine.score([r.tokens for r in rows], ctx.sampling.temperature)
        eligible = sum(not r.control for r in rows)
        ctx.log(**{
            "guide/guided_frac": sum(r.guided for r in rows) / len(rows),
            "guide/reviews_per_traj": stats.reviews / max(eligible, 1),
            "guide/revise_rate": stats.revises / max(stats.reviews, 1),
            "guide/correction_len": stats.correction_tokens / max(stats.revises, 1),
            "guide/malformed": stats.malformed,
            "guide/dropped_tokens": stats.dropped_tokens / len(rows),
        })
        return assemble(rows, ctx.pad_id, logprobs)


# ------------------------------------------------------------------------------------ row state


@dataclass
class Stats:
    reviews: int = 0
    revises: int = 0
    malformed: int = 0
    correction_tokens: int = 0
    dropped_tokens: int = 0


@dataclass
class Live:
    """A row under construction: accepted pieces live in row.pieces; `pending` is unreviewed policy text."""

    row: object  # composer.runtime.trajectory.Row
    steps: list[str] = field(default_factory=list)  # accepted step texts (policy steps and corrections)
    pending: list[int] = field(default_factory=list)  # policy tokens generated since the last review
    reviews: int = 0
    done: bool = False  # stopped: EOS generated, or the response is at max_new_tokens

    @property
    def length(self) -> int:
        return len(self.row.response) + len(self.pending)

    @property
    def context(self) -> list[int]:
        return self.row.tokens + self.pending

    def accept(self, end: int, texts: list[str]) -> None:
        """Move pending[:end] into the accepted prefix as policy tokens (with its step texts)."""
        if end:
            self.row.pieces.append((self.pending[:end], "policy"))
        self.pending = self.pending[end:]
        self.steps += texts


def merge_pieces(pieces: list[tuple[list[int], str]]) -> list[tuple[list[int], str]]:
    """Adjacent pieces of one origin joined, empty ones dropped."""
    out: list[tuple[list[int], str]] = []
    for ids, origin in pieces:
        if not ids:
            continue
        if out and out[-1][1] == origin:
            out[-1] = (out[-1][0] + ids, origin)
        else:
            out.append((list(ids), origin))
    return out


def extend(ctx, lives: list[Live], budget: int) -> None:
    """One batched generate: each live row writes up to `budget` more tokens (never past max_new_tokens)."""
    if not lives:
        return
    cap, eos = ctx.max_new_tokens, ctx.eos_id
    gens = ctx.engine.generate([s.context for s in lives], budget, ctx.sampling)
    for s, g in zip(lives, gens):
        toks = g.tokens[: cap - s.length]
        ctx.costs["policy_tokens"] += len(g.tokens)
        s.pending += toks
        s.done = not toks or toks[-1] == eos or s.length >= cap


def split_steps(ctx, ids: list[int], sep: str, final: bool) -> list[tuple[str, int]]:
    """The complete steps of `ids` as (text, end): end is the token index right after the step's separator.

    A step owns its separator; with a multi-character token across a separator the cut falls after
    that token (exact for the toy's character tokenizer). With `final` (EOS or cap) the rest after the
    last separator is a step too (an empty rest, e.g. a lone EOS, joins the step before it).
    """
    memo = ctx.runtimes.setdefault(("guide", "token-text"), {})  # token id -> its text alone
    for t in set(ids) - memo.keys():
        memo[t] = ctx.decode([t])
    parts = [memo[t] for t in ids]
    text = "".join(parts)
    if text == ctx.decode(ids):
        ends = list(accumulate(len(p) for p in parts))  # char end of each token
    else:  # a tokenizer whose pieces do not concatenate: cumulative decode
        text = ctx.decode(ids)
        ends = [len(ctx.decode(ids[: i + 1])) for i in range(len(ids))]
    out, start = [], 0
    while (pos := text.find(sep, start)) >= 0:
        stop = pos + len(sep)
        out.append((text[start:pos], next(i + 1 for i, e in enumerate(ends) if e >= stop)))
        start = stop
    if final and len(ids) > (out[-1][1] if out else 0):
        rest = text[start:]
        if rest.strip() or not out:
            out.append((rest, len(ids)))
        else:
            out[-1] = (out[-1][0], len(ids))
    return out


def correction_tokens(ctx, guide: InterventionGuide, s: Live, text: str) -> list[int]:
    """The correction as tokens: text + separator, at most max_correction_tokens and within the cap.

    An empty correction (the oracle's "the response should have ended here") is EOS.
    """
    ids = ctx.encode(text + guide.step_split) if text else [ctx.eos_id]
    return ids[: min(guide.max_correction_tokens, ctx.max_new_tokens - s.length)]


def review_round(ctx, guide: InterventionGuide, judge, lives: list[Live], stats: Stats) -> None:
    """One batched judge call over every reviewable row with complete new steps; apply KEEP / REVISE."""
    items, who = [], []
    for s in lives:
        if s.row.control or s.reviews >= guide.max_reviews:
            continue
        steps = split_steps(ctx, s.pending, guide.step_split, final=s.done)
        if not steps:
            continue
        if not any(t.strip() for t, _ in steps):  # nothing to judge (e.g. a lone EOS)
            s.accept(steps[-1][1], [t for t, _ in steps])
            continue
        items.append((s.row.example, list(s.steps), [t for t, _ in steps]))
        who.append((s, steps))
    for (s, steps), d in zip(who, judge.review(ctx, items, guide.step_split)):
        s.reviews += 1
        stats.reviews += 1
        stats.malformed += d.kind == MALFORMED
        if d.kind != REVISE:  # KEEP, or an unreadable answer acted on as KEEP
            s.accept(steps[-1][1], [t for t, _ in steps])
            continue
        keep = steps[d.index - 1][1] if d.index else 0
        stats.dropped_tokens += len(s.pending) - keep
        s.accept(keep, [t for t, _ in steps[: d.index]])
        s.pending = []  # the wrong step and everything after it are dropped
        h = correction_tokens(ctx, guide, s, d.correction)
        s.row.pieces.append((h, "guide_intervention"))
        s.steps.append(d.correction)
        s.row.guided = True
        s.done = (bool(h) and h[-1] == ctx.eos_id) or s.length >= ctx.max_new_tokens
        stats.revises += 1
        stats.correction_tokens += len(h)


def chunk_loop(ctx, guide: InterventionGuide, judge, lives: list[Live], stats: Stats) -> None:
    """MInTRL Algorithm 1 over all rows at once: generate a chunk, review, until every row stops.

    Control rows ride along in the same generate calls (never reviewed); once no live row can be
    reviewed any more, the rest is written in one call with the remaining budget.
    """
    cap = ctx.max_new_tokens
    while True:
        live = [s for s in lives if not s.done]
        if not live:
            break
        reviewable = any(not s.row.control and s.reviews < guide.max_reviews for s in live)
        extend(ctx, live, guide.chunk_tokens if reviewable else max(cap - s.length for s in live))
        review_round(ctx, guide, judge, lives, stats)


def end_review(ctx, guide: InterventionGuide, judge, lives: list[Live], stats: Stats) -> None:
    """InT: sample to the end; one review of every failed non-control rollout; continue the revised ones."""
    cap = ctx.max_new_tokens
    extend(ctx, lives, cap)
    if guide.max_reviews < 1:
        return
    ok = successes(ctx, [s.row.example for s in lives], [ctx.decode(s.pending) for s in lives])
    failed = [s for s, good in zip(lives, ok) if not good and not s.row.control]
    for s in failed:
        s.done = True  # the whole response is final: its last partial step is a step too
    review_round(ctx, guide, judge, failed, stats)
    revised = [s for s in failed if not s.done]
    extend(ctx, revised, max([cap - s.length for s in revised], default=0))


def successes(ctx, examples, texts: list[str]) -> list[bool]:
    """The task verifier's success per response: the spec's outcome_reward source, else the task's own."""
    verify, threshold = ctx.verifier("auto"), 0.5
    for cfg in ctx.spec.sources.values():
        if getattr(cfg, "kind", "") == "outcome_reward":
            verify, threshold = ctx.verifier(cfg.verifier), cfg.success_threshold
            break
    return [verify(t, ex).reward >= threshold for t, ex in zip(texts, examples)]


# ------------------------------------------------------------------------------- InT SFT targets


def sft_targets_from_guided(ctx, batch, filter_samples: int):
    """InT's SFT targets (Yang et al. 2026, arXiv 2601.14209, pipeline steps 4-5).

    From each guided row: prompt + policy prefix + intervention, cut right after the last intervention
    token (the continuation is dropped; no EOS is trained). Kept only if at least one of
    `filter_samples` continuations sampled from it (without the reference) succeeds; 0 keeps all.
    Returns a new TrajectoryBatch of the kept rows (origins policy + guide_intervention). With none
    kept, the rows are cut to their prompts and weighted 0: the loss is exactly zero.
    """
    from composer.lazy import torch
    from composer.origins import CODE, ORIGINS
    from composer.runtime.trajectory import Row, assemble

    inter = batch.origin == CODE["guide_intervention"]  # [B, T]
    guided = batch.guided if batch.guided is not None else torch.zeros(batch.size, dtype=torch.bool)  # [B]
    cands = [(i, int(inter[i].nonzero().max()) + 1)  # (row, one past its last intervention token)
             for i in range(batch.size) if bool(guided[i]) and bool(inter[i].any())]
    if cands and filter_samples > 0:
        prompts = [batch.tokens[i, :cut].tolist() for i, cut in cands for _ in range(filter_samples)]
        plens = [int((batch.origin[i] == CODE["prompt"]).sum()) for i, _ in cands]
        room = [ctx.max_new_tokens - (cut - p) for (_i, cut), p in zip(cands, plens)]
        gens = ctx.engine.generate(prompts, max(max(room), 1), ctx.sampling)
        ctx.costs["policy_tokens"] += sum(len(g.tokens) for g in gens)
        texts, exs = [], []
        for k, g in enumerate(gens):
            c = k // filter_samples
            i, cut = cands[c]
            texts.append(ctx.decode(batch.tokens[i, plens[c]:cut].tolist() + g.tokens[: max(room[c], 0)]))
            exs.append(batch.examples[i])
        ok = successes(ctx, exs, texts)
        cands = [c for k, c in enumerate(cands) if any(ok[k * filter_samples: (k + 1) * filter_samples])]
    ctx.log(sft_kept=len(cands), sft_candidates=int(guided.sum()))
    empty = not cands
    if empty:  # zero loss without crashing: prompt-only rows, weight 0
        cands = [(i, int((batch.origin[i] == CODE["prompt"]).sum())) for i in range(min(batch.size, 1))]
    rows, lps = [], []
    for i, cut in cands:
        ids, org = batch.tokens[i, :cut].tolist(), batch.origin[i, :cut].tolist()
        plen = sum(o == CODE["prompt"] for o in org)
        pieces = merge_pieces([([t], ORIGINS[o]) for t, o in zip(ids[plen:], org[plen:])])
        rows.append(Row(batch.examples[i], ids[:plen], pieces, group=int(batch.group[i]),
                        prompt_index=int(batch.prompt_index[i]) if batch.prompt_index is not None else 0,
                        control=False, guided=True))
        lps.append(batch.behavior_logprobs[i, :cut].tolist())
    out = assemble(rows, ctx.pad_id, lps)
    out.info["temperature"] = batch.info.get("temperature", 1.0)
    if empty:
        out.seq_weight = torch.zeros(out.size)
    return out
