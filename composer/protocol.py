"""The guide protocol: rollouts as programs that ask for generations, one implementation for every backend.

A guide (components/guides) writes each rollout as a *program*: a Python generator that yields
requests and receives their answers, then returns a finished `Trace`.

    def row(ctx, example, index, n):          # one rollout of `example`, sample `index` of n
        trace = Trace(prompt_ids)
        [gen] = yield Sample(trace.tokens, 64)  # answer: one Generation per requested sample
        trace.add(gen.tokens, "policy", gen.logprobs)
        return trace

Requests:
  Sample(tokens, max_tokens, n, model, greedy)  continue `tokens` n times with `model`: "policy" (the
                                                rollout weights), "initial" (the frozen initial policy)
                                                or a source name (an external judge); answer
                                                list[Generation] with the sampler's log-probs
  Score(tokens, start, model)                   log-probs of tokens[start:] under `model`; answer list[float]

A program may also yield a list of requests and receive the list of answers (requests served together).
Drivers serve them: `drive` (the Lightning backend) runs many programs in lockstep and answers each
round's requests with one batched call per kind of request; `run_async` (the OpenRLHF agent) runs one
program against an async server. The state machines (interventions, prefix search, InT filters)
therefore exist once, in the guides. No torch at import.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generator, Optional

POLICY, INITIAL = "policy", "initial"


@dataclass
class Generation:
    """One continuation: its tokens (EOS included when the model stopped), whether it stopped at EOS,
    and the log-prob of each token under the distribution it was drawn from (None for greedy decoding)."""

    tokens: list[int]
    finished: bool
    logprobs: Optional[list[float]] = None


@dataclass
class Sample:
    tokens: list[int]
    max_tokens: int
    n: int = 1
    model: str = POLICY
    greedy: bool = False
    purpose: str = "rollout"  # cost bucket: rollout | judge | search | filter
    stop: tuple = ()  # text that also ends the continuation (an environment's `</tool_call>`): an engine that can
    # stop there does (vLLM's stop strings), one that cannot runs on; the program cuts at it either way

    def key(self) -> tuple:
        return ("sample", self.model, self.greedy, self.purpose)


@dataclass
class Score:
    tokens: list[int]
    start: int
    model: str = POLICY

    def key(self) -> tuple:
        return ("score", self.model)


Request = Any  # Sample | Score
Program = Generator[Request, Any, Any]


@dataclass
class Piece:
    tokens: list[int]
    origin: str  # composer.origins name
    logprobs: Optional[list[float]] = None  # behaviour log-probs of these tokens (None: not known yet)


@dataclass
class Trace:
    """One rollout as it was written: the prompt, then pieces with provenance and behaviour log-probs.

    control: the guide never touched it (MInTRL's control rollouts); guided: a guide wrote into it;
    tag: advantage group within the prompt ("" or e.g. "guided" for POPE's guided prompts);
    weight: a sequence weight (None: 1); notes: what the guide saw and did (prompts it sent to a judge,
    verdicts), for samples and conformance checks.
    """

    prompt: list[int]
    pieces: list[Piece] = field(default_factory=list)
    control: bool = True
    guided: bool = False
    tag: str = ""
    weight: Optional[float] = None
    notes: dict = field(default_factory=dict)

    def add(self, tokens, origin: str, logprobs=None) -> None:
        """Append tokens; adjacent pieces of one origin are joined (log-probs stay aligned)."""
        tokens = list(tokens)
        if not tokens:
            return
        lps = None if logprobs is None else list(logprobs)
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.origin == origin:
            joined = None if last.logprobs is None or lps is None else last.logprobs + lps
            if (last.logprobs is None) == (lps is None):
                self.pieces[-1] = Piece(last.tokens + tokens, origin, joined)
                return
        self.pieces.append(Piece(tokens, origin, lps))

    @property
    def response(self) -> list[int]:
        return [t for p in self.pieces for t in p.tokens]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def note(self, key: str, value) -> None:
        self.notes.setdefault(key, []).append(value)

    def spans(self) -> list[list]:
        """[[start, end, origin], ...] of the pieces, in sequence coordinates (end exclusive)."""
        out, pos = [], len(self.prompt)
        for p in self.pieces:
            if out and out[-1][2] == p.origin:
                out[-1][1] += len(p.tokens)
            else:
                out.append([pos, pos + len(p.tokens), p.origin])
            pos += len(p.tokens)
        return out


def plain_row(ctx, example) -> Program:
    """The program of one unguided rollout: the policy continues the prompt up to max_new_tokens (the `none` guide's
    row, and an evaluation row on every backend); under an active rollout.environment, an episode of policy turns and
    environment turns (composer/episodes.py)."""
    env = getattr(getattr(getattr(ctx, "spec", None), "rollout", None), "environment", None)
    if env is not None and env.active:
        from composer.episodes import episode_row

        return (yield from episode_row(ctx, example, env))
    trace = Trace(ctx.prompt_ids(example))
    [gen] = yield Sample(trace.prompt, ctx.max_new_tokens)
    trace.add(gen.tokens, "policy", gen.logprobs)
    return trace


def fill_scores(trace: Trace, lps: list[float], origins: set[str]) -> None:
    """Give the unscored pieces of `origins` their log-probs from `lps`, the response's scores."""
    pos = 0
    for p in trace.pieces:
        if p.logprobs is None and p.origin in origins:
            p.logprobs = lps[pos: pos + len(p.tokens)]
        pos += len(p.tokens)


def done(value=None) -> Program:
    """A program that asks for nothing and returns `value` (`yield from done(x)` is `x`)."""
    return value
    yield  # noqa: unreachable - makes this a generator


# ------------------------------------------------------------------------------------------ drivers


def drive(programs: list[Program], serve: Callable[[tuple, list[Request]], list[Any]]) -> list[Any]:
    """Run programs in lockstep; each round, requests with one key are answered by one `serve` call.

    A program may yield one request (answered with its answer) or a list of requests (answered with the
    list of their answers). serve(key, requests) -> one answer per request. Returns each program's
    return value, in order.
    """
    results: list[Any] = [None] * len(programs)
    pending: dict[int, Any] = {}  # program -> what it yielded (a request or a list of them)

    def advance(i: int, answer) -> None:
        try:
            pending[i] = programs[i].send(answer)
        except StopIteration as stop:
            results[i] = stop.value

    for i in range(len(programs)):
        advance(i, None)
    while pending:
        by_key: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for i, asked in pending.items():
            for j, req in enumerate(asked if isinstance(asked, list) else [asked]):
                by_key[req.key()].append((i, j))
        current, pending = pending, {}
        got: dict[tuple[int, int], Any] = {}
        for key, where in by_key.items():
            reqs = [(current[i] if not isinstance(current[i], list) else current[i][j]) for i, j in where]
            got.update(zip(where, serve(key, reqs)))
        for i, asked in current.items():
            if isinstance(asked, list):
                advance(i, [got[(i, j)] for j in range(len(asked))])
            else:
                advance(i, got[(i, 0)])
    return results


async def run_async(program: Program, serve: Callable[[Request], Awaitable[Any]]):
    """Run one program, answering each request with `await serve(request)`; returns its value."""
    import asyncio

    answer = None
    while True:
        try:
            asked = program.send(answer)
        except StopIteration as stop:
            return stop.value
        if isinstance(asked, list):
            answer = list(await asyncio.gather(*(serve(r) for r in asked)))
        else:
            answer = await serve(asked)
