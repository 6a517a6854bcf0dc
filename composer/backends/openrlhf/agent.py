"""The OpenRLHF AgentExecutor of a spec's guide: prefix (POPE) and intervention (MInTRL, InT) rollouts.

OpenRLHF calls `execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)` once per
sample inside a vLLM engine actor; `llm_engine.generate(token_ids, SamplingParams)` drives the policy
token-in/token-out. This module owns only that async engine loop. The text and step logic is the
Lightning guides' own (components/guides): `PrefixGuide.conditioned` / `max_steps` / `ref_steps` for
prefixes, `split_steps`, `correction_tokens` and the judges (`make_judge`: the oracle step checker, or
a policy_model's prompt and `parse_decision`) for interventions, `successes` for the verifier. The
trajectory is kept as pieces with origins; the trainable pieces become `action_ranges` and the
provenance travels in the label (see batch.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import types
from dataclasses import dataclass, field
from typing import Optional

from composer.backends.openrlhf.batch import action_ranges, decode_label, encode_label, example_of


@dataclass
class Trace:
    """One rollout as pieces after the prompt: (token ids, origin, behaviour log-probs or None)."""

    prompt: list[int]
    pieces: list = field(default_factory=list)

    def add(self, ids, origin: str, logprobs=None) -> None:
        if ids:
            self.pieces.append((list(ids), origin, None if logprobs is None else list(logprobs)))

    @property
    def response(self) -> list[int]:
        return [t for ids, _, _ in self.pieces for t in ids]

    def spans(self) -> list[list]:
        out, pos = [], len(self.prompt)
        for ids, origin, _ in self.pieces:
            if out and out[-1][2] == origin:
                out[-1][1] += len(ids)
            else:
                out.append([pos, pos + len(ids), origin])
            pos += len(ids)
        return out


class ComposerAgent:
    """The executor's logic; `executor_class` mixes in OpenRLHF's AgentExecutorBase."""

    def __init__(self, plan="plan.json", run: Optional[str] = None):
        from composer import registry
        from composer.backends.openrlhf.loss import Segments, terms

        self.plan = json.load(open(plan)) if isinstance(plan, str) else plan
        runs = self.plan["openrlhf"]["runs"]
        name = run or os.environ.get("COMPOSER_RUN")
        self.run = next((r for r in runs if r["name"] == name), None) or next(r for r in runs if r["plugin"].get("agent"))
        self.segments = Segments(self.plan, self.run["segments"])
        registry.load_all()
        specs = [s for _, _, s in self.segments.items]
        self.trainable = {"policy"} | {o for s in specs for _, _, obj, _ in terms(s) for o in obj.loss_tokens}
        self.counts: dict = {}
        self.prefix_k: dict = {}
        self.contexts: dict = {}
        self.max_len = 1 << 30

    # ---- the composer's run context (text, sources, judges, verifier) without a model ----
    def context(self, spec, tok):
        key = id(spec)
        if key not in self.contexts:
            from composer.backends.openrlhf.hooks import task_of
            from composer.runtime.context import RunContext

            self.contexts[key] = RunContext(task=task_of(self.plan, self.run, spec), tokenizer=tok, policy=None,
                                            engine=None, spec=spec)
        return self.contexts[key]

    # ---- engine calls ----
    async def generate(self, engine, ids, sp, max_tokens: int):
        """(tokens, behaviour log-probs or None, stopped at EOS) of one policy continuation of `ids`."""
        if max_tokens < 1:
            return [], ([] if getattr(sp, "logprobs", None) is not None else None), False
        p = copy.deepcopy(sp)
        p.max_tokens = max_tokens
        out = (await engine.generate(list(ids), p)).outputs[0]
        toks = list(out.token_ids)
        lps = None
        if getattr(sp, "logprobs", None) is not None and out.logprobs is not None:
            lps = [d[t].logprob if t in d else 0.0 for t, d in zip(toks, out.logprobs)]
        return toks, lps, out.finish_reason != "length"

    async def score(self, engine, ids, sp) -> list[float]:
        """Log-prob of every token of `ids` under the engine's weights (0 for the first): the guide tokens'
        behaviour log-probs (MInTRL-Proxy's anchor), as the Lightning engine's `score`."""
        p = type(sp)(max_tokens=1, temperature=max(getattr(sp, "temperature", 1.0), 1e-5), prompt_logprobs=1)
        out = await engine.generate(list(ids), p)
        return [0.0 if d is None else (d[t].logprob if t in d else 0.0) for t, d in zip(ids, out.prompt_logprobs)]

    # ---- the sample ----
    def _index(self, prompt: str, label, n: int) -> int:
        """Which of the n samples of this prompt this call is (OpenRLHF starts them in order)."""
        key = (prompt, str(label))
        i = self.counts.get(key, 0)
        self.counts[key] = i + 1
        if len(self.counts) > 100_000:
            self.counts.clear()
        return i % n

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        meta = decode_label(label)
        example = example_of(prompt, meta)
        step = int(meta.get("step", 0))
        spec = self.segments.at(step)
        guide = spec.rollout.guide
        kind = "none" if meta.get("eval") else guide.kind_name()
        idx = self._index(prompt, label, spec.rollout.samples_per_prompt)
        tok, sp = hf_tokenizer, sampling_params
        ctx = self.context(spec, tok)
        self.max_len = max_length
        ids = tok.encode(prompt, add_special_tokens=False)
        # one position spare: scoring guide tokens (prompt_logprobs) asks vLLM for one more token
        budget = min(sp.max_tokens or max_length, ctx.max_new_tokens, max_length - len(ids) - 1)
        info = {"control": True, "guided": False, "tag": "", "weight": None, "reviews": 0}
        if kind == "prefix":
            trace, finished = await self._prefix(ctx, example, guide, step, ids, budget, sp, llm_engine, info)
        elif kind == "intervention" and idx >= guide.control_samples:
            info["control"] = False
            trace, finished = await self._intervene(ctx, example, guide, ids, budget, sp, llm_engine, info)
        else:
            trace, finished = await self._plain(ids, budget, sp, llm_engine)
        reward = info.pop("reward", None)
        if reward is None:
            reward = self._reward(ctx, example, tok.decode(trace.response, skip_special_tokens=True))
        return await self._result(prompt, meta, trace, reward, finished, sp, llm_engine, info)

    async def _plain(self, ids, budget, sp, engine):
        """(trace, stopped at EOS) of one unguided policy rollout."""
        trace = Trace(ids)
        toks, lps, finished = await self.generate(engine, ids, sp, budget)
        trace.add(toks, "policy", lps)
        return trace, finished

    def _reward(self, ctx, example, text: str) -> float:
        verifier = self.run["plugin"].get("verifier", "none")
        return 0.0 if verifier == "none" else float(ctx.verifier(verifier)(text, example).reward)

    async def _result(self, prompt, meta, trace: Trace, reward, finished, sp, engine, info):
        spans = trace.spans()
        lps = None
        if getattr(sp, "logprobs", None) is not None:
            if any(p[2] is None for p in trace.pieces):  # guide tokens: scored with the rollout weights
                scored = await self.score(engine, trace.prompt + trace.response, sp)
                lps = scored[: len(trace.prompt)]
                for ids, _, piece in trace.pieces:
                    lps += piece if piece is not None else scored[len(lps): len(lps) + len(ids)]
            else:
                lps = [0.0] * len(trace.prompt) + [x for _, _, p in trace.pieces for x in p]
        weight = info.get("weight")
        off = sum(len(i) for i, o, _ in trace.pieces if o != "policy")
        meta = dict(meta, spans=spans, control=info["control"], guided=info["guided"], tag=info["tag"])
        if weight is not None:
            meta["weight"] = weight
        return {
            "prompt": prompt, "label": encode_label(meta), "observation_tokens": trace.prompt + trace.response,
            "action_ranges": [] if weight == 0 else action_ranges(spans, self.trainable), "rollout_log_probs": lps,
            "reward": reward, "scores": reward, "truncated": not finished,
            "extra_logs": {"composer_guided": float(info["guided"]), "composer_control": float(info["control"]),
                           "composer_offpolicy_frac": off / max(len(trace.response), 1),
                           "composer_reviews": float(info["reviews"])},
        }

    # ---- prefix guide (POPE, Qu et al. 2026, arXiv 2601.18779) ----
    async def _prefix(self, ctx, example, guide, step, ids, budget, sp, engine, info):
        """A prompt is guided with probability guided_fraction (a hash of prompt, step and seed: every sample
        of the prompt agrees); guided prompts form their own advantage group (tag)."""
        key = f"{example.prompt}|{step}|{ctx.spec.train.seed}".encode()
        if int(hashlib.sha256(key).hexdigest()[:8], 16) / 16 ** 8 >= guide.guided_fraction or not example.solution:
            return await self._plain(ids, budget, sp, engine)
        k = await self._prefix_steps(ctx, example, guide, sp, engine)
        info.update(control=k == 0, guided=k > 0, tag="guided")
        prompt, prefix = guide.conditioned(ctx, example, k)
        trace = Trace(prompt)
        trace.add(prefix, "guide_prefix")
        room = min(budget, self.max_len - len(prompt) - 1) - len(prefix)
        toks, lps, finished = await self.generate(engine, prompt + prefix, sp, room)
        trace.add(toks, "policy", lps)
        return trace, finished

    async def _prefix_steps(self, ctx, example, guide, sp, engine) -> int:
        """k: the largest (`fixed`), or the smallest in 0..k_max from which one of `search_samples`
        continuations succeeds (`minimal`, searched the first time a prompt is seen, cached)."""
        from components.guides.intervention import successes

        kmax = guide.max_steps(len(guide.ref_steps(ctx, example)))
        if guide.search == "fixed":
            return kmax
        if example.prompt not in self.prefix_k:
            self.prefix_k[example.prompt] = kmax
            for k in range(kmax + 1):
                prompt, prefix = guide.conditioned(ctx, example, k)
                room = min(ctx.max_new_tokens, self.max_len - len(prompt) - 1) - len(prefix)
                texts = []
                for _ in range(guide.search_samples):
                    toks, _, _ = await self.generate(engine, prompt + prefix, sp, room)
                    texts.append(ctx.decode(prefix + toks))
                if any(successes(ctx, [example] * len(texts), texts)):
                    self.prefix_k[example.prompt] = k
                    break
        return self.prefix_k[example.prompt]

    # ---- intervention guide (MInTRL Algorithm 1, Chen et al. 2026; InT, Yang et al. 2026) ----
    async def _decide(self, ctx, guide, example, accepted, new, sp, engine):
        """The judge's Decision on the new steps: the oracle directly, a model judge through its prompt and
        parser with greedy generation on the policy engine (`self`) or the named judge actor."""
        from components.guides.judges import ModelJudge, make_judge, parse_decision

        cfg = ctx.spec.sources[guide.judge]
        if cfg.kind == "oracle":
            return make_judge(ctx, guide.judge, guide.max_correction_tokens).review(
                ctx, [(example, accepted, new)], guide.step_split)[0]
        judge = ModelJudge(ctx, guide.judge, cfg.model_copy(update={"model": "self"}), guide.max_correction_tokens)
        text = judge.prompt(ctx, example, accepted, new, guide.step_split)
        if cfg.is_self:
            p = type(sp)(max_tokens=judge.max_tokens, temperature=0.0)
            out = await engine.generate(ctx.encode(text), p)
            answer = out.outputs[0].text
        else:
            import ray

            answer = await ray.get_actor(f"composer-judge-{guide.judge}").generate_text.remote(text, judge.max_tokens)
        return parse_decision(answer, len(new), guide.step_split)

    async def _intervene(self, ctx, example, guide, ids, budget, sp, engine, info):
        """The Lightning guide's state machine (components/guides/intervention.py) for one row: pending policy
        tokens since the last review, complete steps split on step_split, KEEP accepts them, REVISE keeps the
        steps before the wrong one and appends the judge's correction; `end` reviews a finished failed rollout
        once. With an sft signal on guided targets (InT stage 1) the row stops right after the correction."""
        from components.guides.intervention import correction_tokens, split_steps, successes
        from components.guides.judges import REVISE

        trace, st = Trace(ids), types.SimpleNamespace(pending=[], lps=[], steps=[], done=False)
        sft = self._sft_target(ctx.spec)

        def length():
            return len(trace.response) + len(st.pending)

        async def extend(n):
            toks, lps, stopped = await self.generate(engine, ids + trace.response + st.pending, sp,
                                                     min(n, budget - length()))
            st.pending += toks
            st.lps += lps if lps is not None else [None] * len(toks)
            st.done = stopped or not toks or length() >= budget

        def accept(end, texts):
            lps = st.lps[:end]
            trace.add(st.pending[:end], "policy", None if None in lps else lps)
            st.pending, st.lps = st.pending[end:], st.lps[end:]
            st.steps += texts

        async def review():
            steps = split_steps(ctx, st.pending, guide.step_split, final=st.done)
            if not steps:
                return
            texts = [t for t, _ in steps]
            if not any(t.strip() for t in texts):
                return accept(steps[-1][1], texts)
            d = await self._decide(ctx, guide, example, list(st.steps), texts, sp, engine)
            info["reviews"] += 1
            if d.kind != REVISE:
                return accept(steps[-1][1], texts)
            accept(steps[d.index - 1][1] if d.index else 0, texts[: d.index])
            st.pending, st.lps = [], []
            h = correction_tokens(ctx, guide, types.SimpleNamespace(length=length()), d.correction)[: budget - length()]
            trace.add(h, "guide_intervention")
            st.steps.append(d.correction)
            info["guided"] = True
            st.done = (bool(h) and h[-1] == ctx.eos_id) or length() >= budget or sft is not None

        if guide.review == "chunk":
            while not st.done:
                reviewable = info["reviews"] < guide.max_reviews
                await extend(guide.chunk_tokens if reviewable else budget)
                if reviewable:
                    await review()
        else:
            await extend(budget)
            if guide.max_reviews >= 1 and not successes(ctx, [example], [ctx.decode(st.pending)])[0]:
                st.done = True
                await review()
                if not st.done:
                    await extend(budget)
        accept(len(st.pending), [])
        if sft is not None:
            if not info["guided"]:
                info["weight"] = 0.0  # no target: InT trains prefix + intervention of guided rows only
            else:
                await self._filter(ctx, example, sft, ids, trace, budget, sp, engine, info)
        return trace, st.done

    @staticmethod
    def _sft_target(spec):
        """The sft signal with target `guided` of this segment (InT's stage 1), else None."""
        from composer.backends.openrlhf.loss import terms

        return next((sig for _, sig, _, _ in terms(spec) if sig.kind_name() == "sft" and sig.target == "guided"), None)

    async def _filter(self, ctx, example, sig, ids, trace, budget, sp, engine, info) -> None:
        """InT: keep prefix + intervention as an SFT target only if one of `filter_samples` continuations from
        it succeeds (components/guides/intervention.sft_targets_from_guided; the suffix is not trained)."""
        from components.guides.intervention import successes

        if not sig.filter_samples:
            info["weight"] = 1.0
            return
        texts = []
        for _ in range(sig.filter_samples):
            toks, _, _ = await self.generate(engine, ids + trace.response, sp, budget - len(trace.response))
            texts.append(ctx.decode(trace.response + toks))
        ok = successes(ctx, [example] * len(texts), texts)
        info.update(weight=float(any(ok)), reward=sum(ok) / len(ok))


def executor_class(plan="plan.json"):
    """OpenRLHF's `AgentExecutor` (no-argument constructor) for the bundle's plan."""
    from openrlhf.utils.agent import AgentExecutorBase

    class AgentExecutor(ComposerAgent, AgentExecutorBase):
        def __init__(self):
            ComposerAgent.__init__(self, plan)

    return AgentExecutor
