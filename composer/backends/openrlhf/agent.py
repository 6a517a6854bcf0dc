"""The OpenRLHF AgentExecutor of a spec's guide: prefix (POPE) and intervention (MInTRL, InT) rollouts.

OpenRLHF calls `execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)` once per
sample inside a vLLM engine actor; `llm_engine.generate(token_ids, SamplingParams)` drives the policy
token-in/token-out. The executor writes the trajectory as pieces with origins (prompt, policy,
guide_prefix, guide_intervention), returns the trainable pieces as `action_ranges` and carries the
provenance in the label (see batch.py). The text/step logic is the task's: the toy testbed's judge
prompt, judge answer parser, step checker and prefix prompt (components/tasks/toy.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Optional

from composer.backends.openrlhf.batch import action_ranges, decode_label, encode_label, example_of

GENERIC_JUDGE = ("Problem:\n{problem}\n{context}\nAccepted steps:\n{accepted}\n\nNew steps:\n{steps}\n\n"
                 "Reply KEEP if every new step is right; otherwise reply REVISE <k> (k: the first wrong new step) "
                 "and, on the next line, the corrected step k.\n")


@dataclass
class Trace:
    """One rollout as pieces: (token ids, origin, behaviour log-probs or None) after the prompt."""

    prompt: list[int]
    pieces: list = field(default_factory=list)

    def add(self, ids, origin: str, logprobs=None) -> None:
        if ids:
            self.pieces.append((list(ids), origin, None if logprobs is None else list(logprobs)))

    @property
    def response(self) -> list[int]:
        return [t for ids, _, _ in self.pieces for t in ids]

    def cut(self, n: int) -> None:
        """Keep the first n response tokens."""
        out, left = [], n
        for ids, origin, lps in self.pieces:
            if left <= 0:
                break
            out.append((ids[:left], origin, None if lps is None else lps[:left]))
            left -= len(ids)
        self.pieces = [p for p in out if p[0]]

    def spans(self) -> list[list]:
        out, pos = [], len(self.prompt)
        for ids, origin, _ in self.pieces:
            out.append([pos, pos + len(ids), origin])
            pos += len(ids)
        return out


def _steps(text: str, split: str) -> list[str]:
    parts = text.split(split)
    while parts and not parts[-1].strip():
        parts.pop()
    return parts


def cut_tokens(decode, ids: list[int], n_chars: int, text: str) -> int:
    """The most tokens of `ids` whose decoded text is a prefix of text[:n_chars] (binary search)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        d = decode(ids[:mid])
        if len(d) <= n_chars and text.startswith(d):
            lo = mid
        else:
            hi = mid - 1
    return lo


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
        verifier = self.run["plugin"].get("verifier", "none")
        self.verify = registry.VERIFIERS[verifier].load() if verifier != "none" else None
        self.toy = self.plan["openrlhf"]["toy"]
        specs = [s for _, _, s in self.segments.items]
        self.trainable = {"policy"} | {o for s in specs for _, _, obj, _ in terms(s) for o in obj.loss_tokens}
        self.counts: dict = {}
        self.prefix_k: dict = {}
        self.judges: dict = {}

    # ---- engine calls ----
    @staticmethod
    def _params(sp, **over):
        p = copy.deepcopy(sp)
        for k, v in over.items():
            setattr(p, k, v)
        return p

    async def generate(self, engine, ids, sp, max_tokens: int):
        """(tokens, behaviour log-probs or None, finished) of one policy continuation of `ids`."""
        out = (await engine.generate(list(ids), self._params(sp, max_tokens=max(1, max_tokens)))).outputs[0]
        toks = list(out.token_ids)
        lps = None
        if getattr(sp, "logprobs", None) is not None and out.logprobs is not None:
            lps = [d[t].logprob if t in d else 0.0 for t, d in zip(toks, out.logprobs)]
        return toks, lps, out.finish_reason != "length"

    async def score(self, engine, ids, sp) -> list[float]:
        """Log-prob of every token of `ids` under the engine's weights (0 for the first): guide tokens'
        behaviour log-probs (the MInTRL-Proxy anchor)."""
        p = type(sp)(max_tokens=1, temperature=max(getattr(sp, "temperature", 1.0), 1e-5), prompt_logprobs=1)
        out = await engine.generate(list(ids), p)
        return [0.0 if d is None else (d[t].logprob if t in d else 0.0) for t, d in zip(ids, out.prompt_logprobs)]

    async def greedy_text(self, engine, tok, prompt: str, max_tokens: int, sp) -> str:
        p = type(sp)(max_tokens=max_tokens, temperature=0.0)
        out = await engine.generate(tok.encode(prompt, add_special_tokens=False), p)
        return out.outputs[0].text

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
        spec = self.segments.at(int(meta.get("step", 0)))
        guide = spec.rollout.guide
        kind = "none" if meta.get("eval") else guide.kind_name()
        idx = self._index(prompt, label, spec.rollout.samples_per_prompt)
        tok = hf_tokenizer
        ids = tok.encode(prompt, add_special_tokens=False)
        budget = min(sampling_params.max_tokens or max_length, max_length - len(ids))
        info = {"control": True, "guided": False, "tag": "", "weight": None, "reviews": 0}
        if kind == "prefix":
            trace, finished = await self._prefix(example, guide, spec, ids, budget, sampling_params, tok, llm_engine,
                                                 prompt, info)
        elif kind == "intervention" and idx >= guide.control_samples:
            info["control"] = False
            trace, finished = await self._intervene(example, guide, spec, ids, budget, sampling_params, tok,
                                                    llm_engine, info)
        else:
            trace = Trace(ids)
            toks, lps, finished = await self.generate(llm_engine, ids, sampling_params, budget)
            trace.add(toks, "policy", lps)
        text = tok.decode(trace.response, skip_special_tokens=True)
        reward = info.pop("reward", None)
        if reward is None:
            reward = float(self.verify(text, example).reward) if self.verify else 0.0
        return await self._result(prompt, meta, trace, reward, finished, sampling_params, llm_engine, info)

    async def _result(self, prompt, meta, trace: Trace, reward, finished, sp, engine, info):
        spans = trace.spans()
        lps = None
        if getattr(sp, "logprobs", None) is not None:
            if any(p[2] is None for p in trace.pieces):  # guide tokens: score them with the rollout weights
                scored = await self.score(engine, trace.prompt + trace.response, sp)
                lps = scored[: len(trace.prompt)]
                for ids, _, piece_lps in trace.pieces:
                    lps += piece_lps if piece_lps is not None else scored[len(lps): len(lps) + len(ids)]
            else:
                lps = [0.0] * len(trace.prompt) + [x for _, _, p in trace.pieces for x in p]
        weight = info.get("weight")
        ranges = [] if weight == 0 else action_ranges(spans, self.trainable)
        off = sum(len(i) for i, o, _ in trace.pieces if o != "policy")
        meta = dict(meta, spans=spans, control=info["control"], guided=info["guided"], tag=info["tag"])
        if weight is not None:
            meta["weight"] = weight
        return {
            "prompt": prompt, "label": encode_label(meta), "observation_tokens": trace.prompt + trace.response,
            "action_ranges": ranges, "rollout_log_probs": lps, "reward": reward, "scores": reward,
            "truncated": not finished,
            "extra_logs": {"composer_guided": float(info["guided"]), "composer_control": float(info["control"]),
                           "composer_offpolicy_frac": off / max(len(trace.response), 1),
                           "composer_reviews": float(info["reviews"])},
        }

    # ---- prefix guide (POPE, Qu et al. 2026, arXiv 2601.18779) ----
    def prefix_prompt(self, example, guide, k: int, split: str) -> str:
        lines = (example.solution or "").split(split)
        if self.toy:
            from components.tasks.toy import prefix_prompt

            return prefix_prompt(example, k)[0]
        return example.prompt + "\n" + guide.instruction + split.join(lines[:k]) + split

    async def _prefix(self, example, guide, spec, ids, budget, sp, tok, engine, prompt, info):
        frac = guide.guided_fraction
        h = int(hashlib.sha256(f"{prompt}|{spec.train.seed}".encode()).hexdigest()[:8], 16) / 16 ** 8
        split = "\n" if self.toy else "\n\n"
        if h >= frac or not example.solution:
            trace = Trace(ids)
            toks, lps, finished = await self.generate(engine, ids, sp, budget)
            trace.add(toks, "policy", lps)
            return trace, finished
        info.update(control=False, guided=True, tag="guided")
        k = await self._prefix_length(example, guide, split, budget, sp, tok, engine)
        lines = example.solution.split(split)
        if guide.placement == "prompt":
            gids = tok.encode(self.prefix_prompt(example, guide, k, split), add_special_tokens=False)
            trace = Trace(gids)
            toks, lps, finished = await self.generate(engine, gids, sp, budget)
            trace.add(toks, "policy", lps)
            return trace, finished
        trace = Trace(ids)
        trace.add(tok.encode(split.join(lines[:k]) + split, add_special_tokens=False), "guide_prefix")
        toks, lps, finished = await self.generate(engine, ids + trace.response, sp, budget - len(trace.response))
        trace.add(toks, "policy", lps)
        return trace, finished

    async def _prefix_length(self, example, guide, split, budget, sp, tok, engine) -> int:
        """`fixed`: max_fraction of the steps; `minimal`: the fewest steps from which one of search_samples
        continuations succeeds (searched once per problem, cached)."""
        n = len(example.solution.split(split))
        kmax = max(1, int(guide.max_fraction * n))
        if guide.search == "fixed" or self.verify is None:
            return kmax
        key = example.problem or example.prompt
        if key not in self.prefix_k:
            self.prefix_k[key] = kmax
            for k in range(1, kmax + 1):
                gids = tok.encode(self.prefix_prompt(example, guide, k, split), add_special_tokens=False)
                for _ in range(guide.search_samples):
                    toks, _, _ = await self.generate(engine, gids, sp, budget)
                    if self.verify(tok.decode(toks, skip_special_tokens=True), example).reward >= 0.5:
                        self.prefix_k[key] = k
                        break
                if self.prefix_k[key] == k:
                    break
        return self.prefix_k[key]

    # ---- intervention guide (MInTRL Algorithm 1, Chen et al. 2026; InT, Yang et al. 2026) ----
    async def judge(self, name, spec, example, accepted, new, tok, engine, sp):
        """None (KEEP) or (k 1-based within `new`, correction text), from the spec's judge source."""
        from components.tasks import toy

        src = spec.sources[name]
        if src.kind_name() == "oracle":
            return toy.parse_judge(toy.judge_target(example, accepted, new))
        if self.toy:
            prompt = toy.judge_prompt(example, accepted, new)
        else:
            ctx = "".join(f"\n{c}:\n{example.solution if spec.sources[c].kind_name() == 'reference_solution' else ''}\n"
                          for c in src.context)
            prompt = GENERIC_JUDGE.format(problem=example.problem, context=ctx, accepted="\n".join(accepted),
                                          steps="\n".join(f"{i + 1}: {s}" for i, s in enumerate(new)))
        max_tokens = spec.rollout.guide.max_correction_tokens + 16
        if src.is_self:
            text = await self.greedy_text(engine, tok, prompt, max_tokens, sp)
        else:
            text = await self._external_judge(name).generate_text.remote(prompt, max_tokens)
        return toy.parse_judge(text)

    def _external_judge(self, name):
        if name not in self.judges:
            import ray

            self.judges[name] = ray.get_actor(f"composer-judge-{name}")
        return self.judges[name]

    async def _intervene(self, example, guide, spec, ids, budget, sp, tok, engine, info):
        split = guide.step_split
        trace = Trace(ids)
        reviewed = 0  # characters of the response text already accepted (at a step boundary)
        finished = False
        sft = self._sft_target(spec)
        while len(trace.response) < budget:
            left = budget - len(trace.response)
            chunk = left if guide.review == "end" or info["reviews"] >= guide.max_reviews else min(guide.chunk_tokens, left)
            toks, lps, finished = await self.generate(engine, ids + trace.response, sp, chunk)
            trace.add(toks, "policy", lps)
            if info["reviews"] >= guide.max_reviews or not toks:
                break
            if guide.review == "end":
                if not finished:
                    continue
                text = tok.decode(trace.response, skip_special_tokens=True)
                if self.verify is not None and self.verify(text, example).reward >= 0.5:
                    break
            text = tok.decode(trace.response, skip_special_tokens=True)
            cut = len(text) if finished else (text.rfind(split) + len(split) if split in text[reviewed:] else -1)
            if cut <= reviewed:
                continue  # no complete new step yet
            accepted, new = _steps(text[:reviewed], split), _steps(text[reviewed:cut], split)
            if not new:
                reviewed = cut
                continue
            info["reviews"] += 1
            verdict = await self.judge(guide.judge, spec, example, accepted, new, tok, engine, sp)
            if verdict is None:
                reviewed = cut
                if finished:
                    break
                continue
            k, correction = verdict
            keep = text[:reviewed] + "".join(s + split for s in new[: k - 1])
            n_keep = cut_tokens(lambda x: tok.decode(x, skip_special_tokens=True), trace.response, len(keep), keep)
            leftover = keep[len(tok.decode(trace.response[:n_keep], skip_special_tokens=True)):]
            trace.cut(n_keep)
            fix = tok.encode(leftover + correction + split, add_special_tokens=False)
            fix = fix[: guide.max_correction_tokens + len(tok.encode(leftover + split, add_special_tokens=False))]
            trace.add(fix, "guide_intervention")
            info["guided"] = True
            reviewed = len(tok.decode(trace.response, skip_special_tokens=True))
            finished = False
            if sft is not None:
                return await self._filter(example, sft, ids, trace, budget, sp, tok, engine, info), True
        if sft is not None:  # an SFT target exists only for a guided rollout
            info.update(weight=0.0)
        return trace, finished

    @staticmethod
    def _sft_target(spec):
        """The sft signal with target `guided` of this segment (InT's stage 1), else None."""
        from composer.backends.openrlhf.loss import terms

        return next((sig for _, sig, _, _ in terms(spec) if sig.kind_name() == "sft" and sig.target == "guided"), None)

    async def _filter(self, example, sig, ids, trace, budget, sp, tok, engine, info) -> Trace:
        """InT: keep prefix + intervention as an SFT target only if one of `filter_samples` continuations from
        it succeeds (the successful suffix itself is not trained)."""
        ok = 0
        for _ in range(sig.filter_samples):
            toks, _, _ = await self.generate(engine, ids + trace.response, sp, budget - len(trace.response))
            text = tok.decode(trace.response + toks, skip_special_tokens=True)
            ok += self.verify is not None and self.verify(text, example).reward >= 0.5
        info.update(weight=1.0 if ok or not sig.filter_samples else 0.0,
                    reward=ok / max(sig.filter_samples, 1))
        return trace


def executor_class(plan="plan.json"):
    """OpenRLHF's `AgentExecutor` (no-argument constructor) for the bundle's plan."""
    from openrlhf.utils.agent import AgentExecutorBase

    class AgentExecutor(ComposerAgent, AgentExecutorBase):
        def __init__(self):
            ComposerAgent.__init__(self, plan)

    return AgentExecutor
