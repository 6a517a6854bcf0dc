"""The OpenRLHF AgentExecutor: a spec's guide run one rollout at a time inside a vLLM engine actor.

OpenRLHF calls `execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)` once per
sample. The rollout itself is the guide's own program (components/guides, DESIGN.md section 8), the one
the Lightning backend drives in lockstep: this module only answers the program's requests with
`run_async` (composer/protocol.py) against the engines it has. "policy" is `llm_engine` (the
rollout weights); an external judge is its named vLLM actor (`composer-judge-<source>`); "initial" (the
frozen initial policy: POPE's minimal search, a `weights: initial` self-judge) is `llm_engine` while the
Plan's schedule says it holds the initial weights (`Schedule.sampler_is_initial`: before the run's first
broadcast), and an error with the reason after it.

The finished trace becomes OpenRLHF's sample: the tokens, `action_ranges` from the origins of the term's
loss tokens (never empty: a row with nothing to train keeps one token at sequence weight 0, so that no
micro-batch divides by a token count of 0), every token's behaviour log-prob, the reward, and the
provenance in the label (batch.py).

Episodes (rollout.environment, issue 55): the row program is then composer/episodes.py's episode, the same part code
as on Lightning; the environment's answers are `environment` tokens, outside `action_ranges` (OpenRLHF's action_mask
0: no loss, no KL, not in the ratio). The reward is the declared verifier's over the final answer (the response after
the last environment turn the policy answered, as Lightning's `response_texts`), plus turn_reward_weight x the sum of
the per-turn rewards the environment returned (training rows; an evaluation row is the verifier's alone, as
Lightning's pass@1); the episode's counts go to extra_logs as the env/* metrics Lightning logs.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from typing import Optional

from composer import step as the_step
from composer.backends.openrlhf.batch import (action_ranges, decode_label, encode_label, example_of, next_draw,
                                              request_seeds)
from composer.origins import OFF_POLICY
from composer.plan.plan import Plan
from composer.protocol import INITIAL, POLICY, Generation, Score, Trace, run_async


class ComposerAgent:
    """The executor's logic; `executor_class` mixes in OpenRLHF's AgentExecutorBase."""

    def __init__(self, plan="plan.json", run: Optional[str] = None):
        from composer.checks.terms import terms
        from composer.runtime.context import Memo

        self.plan = json.load(open(plan)) if isinstance(plan, str) else plan
        runs = self.plan["openrlhf"]["runs"]
        name = run or os.environ.get("COMPOSER_RUN")
        self.run = next((r for r in runs if r["name"] == name), None) or next(r for r in runs if r["plugin"].get("agent"))
        self.steps = Plan(self.plan, self.run["segments"])  # `steps.at(step)`: the Plan at a global step
        specs = [s.spec for s in self.steps.segments]
        self.trainable = {"policy"} | {o for s in specs for _, _, obj, _ in terms(s) for o in obj.loss_tokens}
        self.counts: dict = {}
        self.contexts: dict = {}
        self.memo = Memo()  # the run's tables, shared by every segment's context
        self.prepared: set = set()
        self.built: dict = {}  # targets a signal builds once per segment (InT offline)
        self.lock: asyncio.Lock | None = None

    # ---- the composer's run context (text, sources, judges, verifier) without a model ----
    def context(self, spec, tok):
        key = id(spec)
        if key not in self.contexts:
            from composer.backends.openrlhf.hooks import task_of
            from composer.runtime.context import RunContext
            from composer.stops import for_spec

            for_spec(tok, spec)  # the policy's stop tokens under the bundle's prompt format (composer/stops.py)
            # one memo for the run, as on Lightning: a phase's context finds what another prepared (prefixes)
            ctx = RunContext(task=task_of(self.plan, self.run, spec), tokenizer=tok, policy=None, engine=None,
                             spec=spec)
            ctx.state.memo = self.memo
            if spec.rollout.environment.active:  # the environment's own checks, in this worker (the python tool's
                spec.rollout.environment.preflight(ctx)  # sandbox: never run code without it), before any episode
            self.contexts[key] = ctx
        return self.contexts[key]

    # ---- answering the guide's requests ----
    def server(self, engine, sp, max_length: int, room: int, prompt_len: int, initial_ok: bool, seeds):
        """`serve(request)` for run_async: Sample and Score requests against this actor's engines. A rollout's
        continuation fits the response room; every request (a judge's prompt included) fits the engine's
        context, one position spare for scoring. Every sampled continuation gets the next of `seeds`
        (batch.request_seeds: fixed by the rollout's step, prompt and draw, so a resumed job samples as an
        uninterrupted one; the requests of one rollout are made in the guide program's order)."""

        async def serve(req):
            if isinstance(req, Score):
                return (await self.score(self._engine(engine, req.model, initial_ok), req.tokens, sp))[req.start:]
            budget = min(req.max_tokens, max_length - len(req.tokens) - 1)
            if req.purpose in ("rollout", "filter"):
                budget = min(budget, room - (len(req.tokens) - prompt_len))
            if req.model not in (POLICY, INITIAL):  # an external judge: its own named actor
                import ray

                actor = ray.get_actor(f"composer-judge-{req.model}")
                outs = [await actor.generate_ids.remote(list(req.tokens), budget, req.greedy, seeds())
                        for _ in range(req.n)]
                return [Generation(t, f, None) for t, f in outs]
            eng = self._engine(engine, req.model, initial_ok)
            return list(await asyncio.gather(*(self.generate(eng, req.tokens, sp, budget, req.greedy, seeds(), req.stop)
                                               for _ in range(req.n))))

        return serve

    @staticmethod
    def _engine(engine, model: str, initial_ok: bool):
        if model == INITIAL and not initial_ok:
            raise RuntimeError("a guide asked for the initial policy after the rollout engine's first weight "
                               "broadcast; on OpenRLHF the initial weights are served by the rollout engine only "
                               "before it (POPE's prefixes are searched for the whole training set then)")
        return engine

    async def generate(self, engine, ids, sp, max_tokens: int, greedy: bool = False,
                       seed: Optional[int] = None, stop: tuple = ()) -> Generation:
        """One continuation of `ids`: its tokens, whether it stopped at EOS, and the sampler's log-probs. `stop`:
        text that also ends it (an episode's `</tool_call>`), passed to vLLM as stop strings kept in the output, so
        the engine stops at the token that completes one instead of sampling past it (the episode cuts there)."""
        if max_tokens < 1:
            return Generation([], False, None if greedy else [])
        p = copy.deepcopy(sp)
        p.max_tokens = max_tokens
        p.seed = seed
        if stop:
            p.stop = sorted(set(getattr(sp, "stop", None) or ()) | set(stop))
            p.include_stop_str_in_output = True
        if greedy:
            p.temperature, p.logprobs = 0.0, None
        out = (await engine.generate(list(ids), p)).outputs[0]
        toks = list(out.token_ids)
        stops = set(getattr(p, "stop_token_ids", None) or ())  # cut at the first (`_with_stops`)
        first = next((k for k, t in enumerate(toks) if t in stops), None)
        toks = toks if first is None else toks[: first + 1]
        lps = None
        if not greedy and getattr(p, "logprobs", None) is not None and out.logprobs is not None:
            lps = [d[t].logprob if t in d else None for t, d in zip(toks, out.logprobs)]
            lps = None if None in lps else lps
        return Generation(toks, first is not None or out.finish_reason != "length", lps)

    async def score(self, engine, ids, sp) -> list[float]:
        """Log-prob of every token of `ids` under the engine's weights (0 for the first)."""
        p = type(sp)(max_tokens=1, temperature=max(getattr(sp, "temperature", 1.0), 1e-5), prompt_logprobs=1)
        out = await engine.generate(list(ids), p)
        return [0.0 if d is None else (d[t].logprob if t in d else 0.0) for t, d in zip(ids, out.prompt_logprobs)]

    # ---- one sample ----
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        """One sample: composer/step.py's part 1 (`row_program`: the guide's row, the terms' row targets, the scores of
        guide tokens) for the Plan at the label's step, answered by this actor's engines."""
        meta = decode_label(label)
        example = example_of(prompt, meta)
        at = self.steps.at(self.steps.offset + int(meta.get("step", 0)))
        spec = at.spec
        draw = next_draw(self.counts, prompt, label)  # modulo samples_per_prompt: which of the prompt's samples
        idx = draw % spec.rollout.samples_per_prompt
        ctx = copy.copy(self.context(spec, hf_tokenizer))  # shares caches; this call's step and room
        ctx.step = at.step
        seeds = request_seeds(spec.train.seed, ctx.step, prompt, draw)  # as hooks.sample_seeds
        # the engine serves "initial" calls only while the Plan says it holds the frozen initial weights
        initial_ok = at.sampler_is_initial
        engines = (llm_engine, sampling_params, max_length, hf_tokenizer)
        serve = self._serve_for(ctx, example, engines, initial_ok, seeds)
        ahead = [t.signal for t in at.terms if t.signal.builds_ahead]
        if ahead:  # targets built once at the segment's start (InT offline): this sample is one of them
            trace, weight = await self._built_ahead(ctx, ahead[0], example, idx, at.segment, engines)
            await run_async(the_step.scored_program(at, trace), serve)
        else:
            if not meta.get("eval"):  # an evaluation row is plain sampling: no guide, nothing to prepare
                await self._prepare(ctx, spec.rollout.guide, example, serve, engines, initial_ok)
            trace, weight = await run_async(the_step.row_program(ctx, at, example, idx, plain=bool(meta.get("eval"))),
                                            serve)
        score = self._reward(ctx, example, hf_tokenizer.decode(final_answer(trace), skip_special_tokens=True))
        reward, env = score, spec.rollout.environment
        if env.active and env.turn_reward_weight and not meta.get("eval"):  # the per-turn rewards (Lightning's
            reward += env.turn_reward_weight * sum(trace.notes.get("env", {}).get("rewards", []))  # RewardSignal)
        # `scores` stays the verifier's: OpenRLHF's dynamic filtering reads it, as Lightning's filter reads the source
        return self._result(ctx, prompt, meta, trace, weight, reward, score)

    def _serve_for(self, ctx, example, engines, initial_ok: bool, seeds=None):
        """`serve` for a rollout of `example` (its own prompt length and response room); `seeds` (default: the
        run's seed, the step, the example's prompt and "prepare") seed its sampled requests."""
        llm_engine, sp, max_length, tok = engines
        sp = _with_stops(sp, ctx.stop_ids)
        n = len(tok.encode(example.prompt, add_special_tokens=False))
        # one position spare: scoring guide tokens (prompt_logprobs) asks vLLM for one more token. An episode's
        # response also holds the environment's answers (at most its max_env_tokens; the episode keeps the policy's
        # own tokens within max_new_tokens)
        extra = ctx.spec.rollout.environment.extra_tokens()
        room = min(min(sp.max_tokens or max_length, ctx.max_new_tokens) + extra, max_length - n - 1)
        if seeds is None:
            seeds = request_seeds(ctx.spec.train.seed, ctx.step, example.prompt, "prepare")
        return self.server(llm_engine, sp, max_length, room, n, initial_ok, seeds)

    async def _built_ahead(self, ctx, sig, example, idx: int, seg, engines):
        """(trace, weight) of sample `idx` of `example` from the targets `sig` builds once (InT offline,
        the signal's `ahead_program`): on the first call of the segment, before the first weight broadcast, for every
        training problem of this run (OpenRLHF draws the prompts); then the idx-th kept target of this problem, or
        its prompt at weight 0 when it has fewer. Every vLLM engine builds the targets of all the run's problems
        itself (its agent serves any prompt)."""
        if self.lock is None:
            self.lock = asyncio.Lock()
        key = ("built_ahead", seg.name, sig.model_dump_json())
        async with self.lock:
            if key not in self.built:
                held, wanted = self.steps.at(ctx.step).sampler_version, self.steps.at(seg.start).sampler_version
                if held != wanted:  # the Plan: the targets come from the sampler's weights at the segment's start
                    raise RuntimeError(f"InT's offline targets are built from the sampler's weights at the segment's "
                                       f"start (after step {wanted}); at step {ctx.step} this engine holds those "
                                       f"after step {held}")
                n = ctx.spec.rollout.samples_per_prompt
                initial_ok = self.steps.at(seg.start).sampler_is_initial
                problems = self._run_problems(ctx, sig)
                if example.prompt not in {ex.prompt for ex in problems}:
                    problems.append(example)
                statuses = await asyncio.gather(*(run_async(sig.ahead_program(ctx, ex, i, n),
                                                            self._serve_for(ctx, ex, engines, initial_ok,
                                                                            request_seeds(ctx.spec.train.seed,
                                                                                          seg.start, ex.prompt,
                                                                                          "built", i)))
                                                  for ex in problems for i in range(n)))
                self.built[key] = sig.ahead_targets(problems, statuses, n)
        targets, _counts = self.built[key]
        mine = targets.get(example.prompt, [])
        if idx < len(mine):
            return mine[idx], 1.0
        return Trace(engines[3].encode(example.prompt, add_special_tokens=False)), 0.0

    def _run_problems(self, ctx, sig=None) -> list:
        """The training problems of this run: the first `data.max_samples` rows of the bundle's train file
        (OpenRLHF's prompt dataset; at most `signal.problems` of them), else the task's own set."""
        plugin = self.run["plugin"]
        path, rows = plugin.get("train_file"), plugin.get("train_rows")
        out = []
        if path and rows and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if len(out) >= rows:
                        break
                    if line.strip():
                        rec = json.loads(line)
                        out.append(example_of(rec["prompt"], decode_label(rec["label"])))
        else:
            out = list(ctx.task.train)
        problems = getattr(sig, "problems", None)
        return out[:problems] if problems else out

    @staticmethod
    def _reads_initial(guide, spec) -> bool:
        """The guide's own calls read the frozen initial policy (POPE's minimal search)."""
        return "initial" in guide.reads().values() or any(c.weights == "initial" for c in guide.model_calls(spec))

    async def _prepare(self, ctx, guide, example, serve, engines=None, initial_ok: bool = True) -> None:
        """The guide's per-problem preparation (POPE's minimal search). A guide whose preparation reads the
        initial policy prepares everything on the run's first call, while the engine still holds the initial
        weights (the Plan's schedule: before the first broadcast): every training problem of the run (the
        bundle's train rows) at every step of the run where this guide is in force, since what it prepares
        may depend on the step (POPE draws the guided prompts per step); a later call finds it done. Any
        other guide prepares the run's training problems once (`_run_problems`: the bundle's train rows, not the
        task's whole set: PrefixRL's teacher writes its traces for those only), then each new problem when first
        seen."""
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            key = guide.model_dump_json()
            if key not in self.prepared:
                self.prepared.add(key)
                if engines is not None and self._reads_initial(guide, ctx.spec):
                    await self._prepare_run(ctx, guide, example, engines, initial_ok)
                else:
                    programs = list(guide.prepare(ctx, self._run_problems(ctx) or [example]))
                    await asyncio.gather(*(run_async(p, serve) for p in programs))
            for p in list(guide.prepare(ctx, [example])):
                await run_async(p, serve)

    async def _prepare_run(self, ctx, guide, example, engines, initial_ok: bool) -> None:
        """`guide.prepare` for every (step, training problem) of this run from the current step on where the
        guide is in force."""
        problems = self._run_problems(ctx)
        if example.prompt not in {ex.prompt for ex in problems}:
            problems.append(example)
        key = guide.model_dump_json()
        for seg in self.steps.segments:
            if seg.spec.rollout.guide.model_dump_json() != key:
                continue
            base = self.context(seg.spec, ctx.tokenizer)
            for step in range(max(seg.start, ctx.step), seg.end):  # this step on (a resumed run: no earlier)
                at = copy.copy(base)
                at.step = step
                work = [(p, ex) for ex in problems for p in guide.prepare(at, [ex])]
                await asyncio.gather(*(run_async(p, self._serve_for(at, ex, engines, initial_ok, request_seeds(
                    at.spec.train.seed, step, ex.prompt, "prepare", j))) for j, (p, ex) in enumerate(work)))

    def _reward(self, ctx, example, text: str) -> float:
        verifier = self.run["plugin"].get("verifier", "none")
        return 0.0 if verifier == "none" else float(ctx.verifier(verifier)(text, example).reward)

    def _result(self, ctx, prompt, meta, trace: Trace, weight, reward, score=None) -> dict:
        spans = trace.spans()
        lps = [0.0] * len(trace.prompt) + [x for p in trace.pieces
                                           for x in (p.logprobs if p.logprobs is not None else [0.0] * len(p.tokens))]
        ranges = action_ranges(spans, self.trainable) if weight != 0 else []
        if not ranges:  # nothing to train: one token at weight 0 (OpenRLHF divides by the token count)
            n = len(trace.tokens)
            ranges, weight = [(n - 1, n)], 0.0
        # off-policy tokens as Lightning's batch_facts counts them (composer/origins.py OFF_POLICY: an environment's
        # tokens are not among them)
        off = sum(len(p.tokens) for p in trace.pieces if p.origin in OFF_POLICY)
        meta = dict(meta, spans=spans, control=trace.control, guided=trace.guided, tag=trace.tag)
        if weight is not None:
            meta["weight"] = weight
        return {
            "prompt": prompt, "label": encode_label(meta), "observation_tokens": trace.tokens,
            "action_ranges": ranges, "rollout_log_probs": lps, "reward": reward,
            "scores": reward if score is None else score,
            "truncated": truncated(trace, ctx.stop_ids),
            "extra_logs": {"composer_guided": float(trace.guided), "composer_control": float(trace.control),
                           "composer_offpolicy_frac": off / max(len(trace.response), 1),
                           "composer_reviews": float(trace.notes.get("reviews", 0)),  # the guide's reviews
                           **episode_logs(ctx.spec, trace)},
        }


def truncated(trace: Trace, stop_ids) -> bool:
    """OpenRLHF's `truncated` flag as the Lightning backend sets it (composer/filters.py `truncated_rows`): an
    episode's when its policy was cut in the middle of a turn, any other row's when it ends in no stop token."""
    from composer.episodes import cut_mid_turn

    cut = cut_mid_turn(trace.notes)
    return cut if cut is not None else not (trace.response and trace.response[-1] in stop_ids)


def final_answer(trace: Trace) -> list[int]:
    """The response tokens a verifier reads: in an episode the final answer (composer/episodes.py `answer_span`: after
    the last environment turn the policy answered), else the whole response."""
    from composer.episodes import answer_span

    s, e = answer_span([p.origin for p in trace.pieces for _ in p.tokens])
    return trace.response[s:e]


def episode_logs(spec, trace: Trace) -> dict[str, float]:
    """One row's env/* metrics (composer/episodes.py `facts` of this row alone; OpenRLHF averages Experience.info over
    the step, as Lightning averages them per row); {} without an active environment. Every row of a spec has the same
    keys (OpenRLHF concatenates each key over the step's rows)."""
    from composer.episodes import facts

    if not spec.rollout.environment.active:
        return {}
    env = spec.rollout.environment
    notes = dict(trace.notes)
    notes.setdefault("env", {"turns": 0, "env_tokens": 0, "env_turns": 0, "ended": "budget", "rewards": [],
                             **env.facts(env.session())})  # never taken: every episode writes its notes
    return facts([notes])


def _with_stops(sp, ids) -> object:
    """A copy of OpenRLHF's sampling params that also stops at every one of the model's stop tokens `ids`
    (composer/stops.py: the tokenizer's eos, generation_config's, the chat template's end of turn); OpenRLHF
    passes none of its own, so vLLM would stop at the eos of the tokenizer and generation_config only."""
    p = copy.copy(sp)
    p.stop_token_ids = sorted(set(getattr(sp, "stop_token_ids", None) or ()) | set(ids))
    if isinstance(getattr(sp, "_all_stop_token_ids", None), set):  # vLLM's set, computed when it was built
        p._all_stop_token_ids = sp._all_stop_token_ids | set(ids)
    return p


def executor_class(plan="plan.json"):
    """OpenRLHF's `AgentExecutor` (no-argument constructor) for the bundle's plan."""
    from openrlhf.utils.agent import AgentExecutorBase

    class AgentExecutor(ComposerAgent, AgentExecutorBase):
        def __init__(self):
            ComposerAgent.__init__(self, plan)

    return AgentExecutor
