"""SFT signal: teacher-forced targets, from a reference solution or from guided rollouts (InT)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from composer.contract import Signal
from composer.registry import register


@register("signal")
class SftSignal(Signal):
    """Demonstrations as training targets: a reference solution, or `guided` (policy prefix + intervention, InT)."""

    kind: Literal["sft"] = Field("sft", description="Component kind.")
    target: str = Field(..., description="A reference_solution source, or `guided`: the policy prefix plus the intervention of guided rollouts, truncated after it.")
    filter_samples: int = Field(8, ge=0, description="With `guided`: keep a target only if at least one of this many continuations from it succeeds (InT used 32); 0 keeps all.")

    refs: ClassVar = {"target": ("reference_solution",)}
    provides: ClassVar = ("sft_target",)
    usage: ClassVar[str] = "target"

    def ref_names(self) -> dict[str, list[str]]:
        return {} if self.target == "guided" else {"target": [self.target]}

    @property
    def makes_batch(self) -> bool:
        """A reference target needs no rollout: the batch is the demonstrations themselves."""
        return self.target != "guided"

    def origins(self, guide) -> set[str]:
        if self.target != "guided":
            return {"prompt", "demonstration"}
        return {"prompt", "policy", *guide.writes_now()}

    def describe(self, spec) -> str:
        if self.makes_batch:
            return f"SFT targets from '{self.target}' (teacher-forced; no rollout)"
        return "SFT targets from guided rollouts (policy prefix + intervention)"

    def make_batch(self, ctx, examples):
        """prompt + the reference solution + EOS per example, the target tokens of origin `demonstration`."""
        from composer.runtime.protocol import Trace
        from composer.runtime.trajectory import assemble

        ref = ctx.source(self.target)
        traces = []
        for ex in examples:
            trace = Trace(ctx.prompt_ids(ex))
            trace.add(ctx.encode(ref.example_text(ex)) + [ctx.eos_id], "demonstration")
            traces.append(trace)
        batch = assemble(traces, list(examples), list(range(len(examples))), ctx.pad_id)
        batch.info["temperature"] = 1.0
        return batch

    def apply(self, ctx, batch):
        if self.target == "guided":
            return guided_targets(ctx, batch, self.filter_samples)
        return batch

    @property
    def targets_rows(self) -> bool:
        return self.target == "guided"

    def row_target(self, ctx, example, trace):
        """One row's InT target (see `guided_targets`): (the trace cut after its intervention, weight 1 when
        kept), or weight 0 for a row without intervention or failing the filter."""
        if self.target != "guided":
            return None
        return row_target_program(ctx, example, trace, self.filter_samples)


def cut_after_intervention(trace):
    """The trace up to and including its last intervention token (a new Trace), or None without one."""
    from composer.runtime.protocol import Trace

    last = max((i for i, p in enumerate(trace.pieces) if p.origin == "guide_intervention"), default=None)
    if last is None:
        return None
    out = Trace(list(trace.prompt), control=False, guided=True, tag=trace.tag, notes=dict(trace.notes))
    for p in trace.pieces[: last + 1]:
        out.add(p.tokens, p.origin, p.logprobs)
    return out


def keep_program(ctx, example, trace, filter_samples: int):
    """Program: whether one of `filter_samples` continuations of `trace` (no reference shown) succeeds."""
    from components.guides.intervention import successes
    from composer.runtime.protocol import Sample

    if filter_samples <= 0:
        return True
    gens = yield Sample(trace.tokens, ctx.max_new_tokens - len(trace.response), n=filter_samples, purpose="filter")
    texts = [ctx.decode(trace.response + g.tokens) for g in gens]
    return any(successes(ctx, [example] * len(texts), texts))


def row_target_program(ctx, example, trace, filter_samples: int):
    cut = cut_after_intervention(trace) if trace.guided else None
    if cut is None:
        return trace, 0.0
    kept = yield from keep_program(ctx, example, cut, filter_samples)
    return cut, 1.0 if kept else 0.0


def guided_targets(ctx, batch, filter_samples: int):
    """InT's SFT targets (Yang et al. 2026, arXiv 2601.14209, pipeline steps 4-5), from this step's rollouts.

    From each guided row: prompt + policy prefix + intervention, cut right after the last intervention
    token (the continuation is dropped; no EOS is trained). Kept only if at least one of
    `filter_samples` continuations sampled from it (without the reference) succeeds (`keep_program`, the
    OpenRLHF agent's filter too); 0 keeps all. Returns a new TrajectoryBatch of the kept rows (origins
    policy + guide_intervention). With none kept, the rows are cut to their prompts and weighted 0: the
    loss is exactly zero.
    """
    from composer.lazy import torch
    from composer.origins import CODE, ORIGINS
    from composer.runtime.protocol import Trace
    from composer.runtime.rollout import run
    from composer.runtime.trajectory import assemble

    inter = batch.origin == CODE["guide_intervention"]  # [B, T]
    guided = batch.guided if batch.guided is not None else torch.zeros(batch.size, dtype=torch.bool)  # [B]
    known = batch.known_mask
    cands = []  # (row, trace cut after its last intervention token)
    for i in range(batch.size):
        if not (bool(guided[i]) and bool(inter[i].any())):
            continue
        cut = int(inter[i].nonzero().max()) + 1
        ids, org = batch.tokens[i, :cut].tolist(), batch.origin[i, :cut].tolist()
        lps, kn = batch.behavior_logprobs[i, :cut].tolist(), known[i, :cut].tolist()
        plen = sum(o == CODE["prompt"] for o in org)
        trace = Trace(ids[:plen], control=False, guided=True)
        for t in range(plen, cut):
            trace.add([ids[t]], ORIGINS[org[t]], [lps[t]] if kn[t] else None)
        cands.append((i, trace))
    keep = run(ctx, [keep_program(ctx, batch.examples[i], t, filter_samples) for i, t in cands])
    cands = [c for c, k in zip(cands, keep) if k]
    ctx.log(sft_kept=len(cands), sft_candidates=int(guided.sum()))
    empty = not cands
    if empty:  # zero loss without crashing: prompt-only rows, weight 0
        i = 0
        plen = int((batch.origin[i] == CODE["prompt"]).sum())
        cands = [(i, Trace(batch.tokens[i, :plen].tolist()))]
    out = assemble([t for _, t in cands], [batch.examples[i] for i, _ in cands],
                   [int(batch.prompt_index[i]) for i, _ in cands], ctx.pad_id)
    out.info["temperature"] = batch.info.get("temperature", 1.0)
    if empty:
        out.seq_weight = torch.zeros(out.size)
    return out
