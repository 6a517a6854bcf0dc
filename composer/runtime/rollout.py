"""The batching driver of the guide protocol (Lightning backend): many rollout programs in lockstep.

Each round, the requests of all live programs are grouped by kind and model and answered with one
batched call: one `generate` over every row that asks the policy for tokens, one over every row under
review by a judge, one forward pass over every sequence to score. The guides' programs are the same
ones the OpenRLHF agent runs one row at a time (composer/backends/openrlhf/agent.py).
"""

from __future__ import annotations

import contextlib
import time

from composer.runtime.engine import Sampling
from composer.protocol import INITIAL, POLICY, Generation, Sample, Score, Trace, drive, fill_scores
from composer.trajectory import assemble
from composer.checks.terms import scored_origins


def serve(ctx, key: tuple, requests: list, scope: contextlib.ExitStack | None = None) -> list:
    """Answer requests that share `key` with one batched call. Within `scope` (one `run`), a local model's
    generate calls reuse the previous call's keys and values for prompts that extend its rows."""
    if key[0] == "score":
        server = ctx.model_server(key[1])
        scored = server.score([r.tokens for r in requests], ctx.sampling.temperature)
        return [s[r.start:] for r, s in zip(requests, scored)]
    _, model, greedy, purpose = key
    flat = [(i, r) for i, r in enumerate(requests) for _ in range(r.n) if r.max_tokens > 0]
    answers: list[list[Generation]] = [[] for _ in requests]
    for i, r in enumerate(requests):
        if r.max_tokens <= 0:  # no room left: an empty, unfinished continuation
            answers[i] = [Generation([], False, None if greedy else []) for _ in range(r.n)]
    if not flat:
        return answers
    sampling = Sampling(greedy=True) if greedy else ctx.sampling
    server = ctx.model_server(model)
    if scope is not None and hasattr(server, "reusing_prefixes") and not server.reuses_prefixes:  # a LocalModel
        scope.enter_context(server.reusing_prefixes())
    gens = server.generate([r.tokens for _, r in flat], [r.max_tokens for _, r in flat], sampling)
    for (i, _r), g in zip(flat, gens):
        answers[i].append(g)
    generated = sum(len(g.tokens) for g in gens)
    if model in (POLICY, INITIAL) and purpose != "rollout":  # the policy writing whole sequences of its own: a
        ctx.costs["policy_samples"] += len(flat)  # self-judge's proposals, filter continuations, prefix search
    if purpose == "judge":
        ctx.costs["judge_tokens"] += generated + sum(len(r.tokens) for _, r in flat)
    elif purpose == "teacher":  # a teacher writing sequences (GKD's off-policy branch)
        ctx.costs["teacher_tokens"] += generated + sum(len(r.tokens) for _, r in flat)
    else:
        ctx.costs["policy_tokens"] += generated
    return answers


def run(ctx, programs: list) -> list:
    """Run protocol programs to completion against this run's models; their return values, in order."""
    with contextlib.ExitStack() as scope:
        return drive(programs, lambda key, reqs: serve(ctx, key, reqs, scope))


def rollout(ctx, guide, examples, n: int):
    """n rollouts per example written by `guide`, as a TrajectoryBatch.

    The guide's `prepare` programs run first (e.g. POPE's prefix search), then one program per rollout.
    Tokens a guide wrote get the rollout weights' log-probs when an objective of this segment reads them
    (`scored_origins`), in one forward pass.
    """
    t0 = time.perf_counter()
    before = ctx.costs["policy_tokens"]
    run(ctx, list(guide.prepare(ctx, examples)))
    ctx.costs["policy_samples"] += len(examples) * n  # one per row, however many requests a guide splits it into
    programs = [guide.row(ctx, ex, j, n) for ex in examples for j in range(n)]
    traces: list[Trace] = run(ctx, programs)
    score_guide_pieces(ctx, traces, scored_origins(ctx.spec))
    ctx.log(**{f"guide/{k}": v for k, v in guide.metrics(traces).items()})
    dt = time.perf_counter() - t0
    ctx.log(tokens_per_s=(ctx.costs["policy_tokens"] - before) / max(dt, 1e-9), rollout_s=dt)
    rows = [i for i in range(len(examples)) for _ in range(n)]
    batch = assemble(traces, [examples[i] for i in rows], rows, ctx.pad_id)
    batch.info["temperature"] = ctx.sampling.temperature
    ctx.record("rollout", batch=batch, engine=ctx.engine, traces=traces, policy=ctx.policy, task_cap=ctx.task.max_new_tokens,
               step_split=ctx.task.step_split)
    return batch


def score_guide_pieces(ctx, traces: list[Trace], origins: set[str]) -> None:
    """Fill the behaviour log-probs of guide-written pieces of `origins` with the rollout weights' log-probs."""
    todo = [t for t in traces if any(p.logprobs is None and p.origin in origins for p in t.pieces)]
    if not todo:
        return
    for t, lps in zip(todo, run(ctx, [_score_program(t) for t in todo])):
        fill_scores(t, lps, origins)


def _score_program(trace: Trace):
    return (yield Score(trace.tokens, len(trace.prompt), POLICY))


def sample_program(tokens, max_tokens: int, **kw):
    """A program of one Sample request; returns its generations."""
    return (yield Sample(list(tokens), max_tokens, **kw))
