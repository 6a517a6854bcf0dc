"""THE ONE REPLACED PART: vLLM's engine, as an HF-transformers model with vLLM's interface (CPU).

OpenRLHF's `RolloutRayActor` (openrlhf/trainer/ray/vllm_engine.py, the real class, in its own Ray worker
process) builds `vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(...))` and calls on it only:
`generate(TokensPrompt, SamplingParams, request_id)` (an async iterator of RequestOutput), `collective_rpc`
(the weight sync RPCs of OpenRLHF's WorkerWrap), `sleep` / `wake_up` / `is_sleeping`, `reset_prefix_cache`.
`HFEngine` answers those with transformers' model.forward and a KV cache on CPU.

Interface assumptions it makes (pinned by tests/test_vllm_interface.py, checked against real vLLM on a GPU by
examples/cluster/vllm_interface_check.py and against vLLM 0.32's CPU build by tests/test_vllm_real.py):
  A1 sampling: logits / temperature, then top-k, then top-p (nucleus over the tempered distribution);
     `min_tokens` masks every stop token; greedy when temperature == 0; stops (finish_reason "stop") at the first
     stop token: the tokenizer's EOS, generation_config.json's eos_token_id (vLLM's update_from_generation_config)
     and `SamplingParams.stop_token_ids`; else at max_tokens ("length"); the stop token is part of `token_ids`.
  A2 `logprobs_mode="processed_logprobs"` (what OpenRLHF asks for with is_correction_level != off): the
     per-token log-probs are of the tempered, top-k/top-p-filtered distribution; "raw_logprobs" of the
     model's own. Each position's dict holds the sampled token (and the top-1 when it differs).
  A3 prompt log-probs are the model's own in either mode, never tempered (vLLM 0.32: logprobs_mode applies to
     sampled tokens only; checked against the real engine, vLLM's CPU build, by tests/test_vllm_real.py);
     position 0 is None.
  A4 weights: `update_weight_cuda_ipc(name, dtype, shape, ipc_handles)` rebuilds the tensor from the handle of
     this device's id and loads it under the HF parameter name (the trainer's names; vLLM maps the same names);
     the dtype must equal the engine's (WorkerWrap's assert).
  A5 a request with `SamplingParams.seed` samples from its own generator seeded with it: the same seed, prompt
     and weights give the same tokens whatever the engine served before (the composer seeds every rollout
     request, composer/backends/openrlhf/batch.py request_seeds); without a seed, the engine's generator.
The offline `vllm.LLM` (the composer's external-judge actor, hooks.start_judges) is the same engine behind
`LLM.generate(prompts, sampling_params, use_tqdm)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str
    stop_reason: Any = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    prompt_logprobs: list | None
    outputs: list
    finished: bool = True


class EngineArgs:
    """vllm.AsyncEngineArgs: keeps the keyword arguments OpenRLHF's create_vllm_engines passes."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def fingerprint(params) -> str:
    h = hashlib.sha1()
    for _name, p in params:
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def process(logits: torch.Tensor, sp, n_out: int, eos) -> torch.Tensor:
    """A1: temperature, min_tokens (the stop tokens `eos`, one id or several, masked), top-k, top-p -> the logits
    that are sampled. [V] -> [V]"""
    x = logits.clone()
    if n_out < (getattr(sp, "min_tokens", 0) or 0):
        x[[eos] if isinstance(eos, int) else sorted(eos)] = float("-inf")
    t = sp.temperature if sp.temperature and sp.temperature > 0 else 1.0
    x = x / t
    k = getattr(sp, "top_k", -1) or -1
    if 0 < k < x.shape[-1]:
        x[x < torch.topk(x, k).values[-1]] = float("-inf")
    p = getattr(sp, "top_p", 1.0)
    if p is not None and p < 1.0:
        srt, idx = torch.sort(x, descending=True)
        probs = torch.softmax(srt, -1)
        x[idx[probs.cumsum(-1) - probs > p]] = float("-inf")
    return x


def generation_eos(model: str) -> set:
    """eos_token_id of the model folder's generation_config.json (an int or a list), as vLLM reads it with
    `generation_config="auto"` and adds to every request's stop tokens (A1); none without the file."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        return set()
    return {eos} if isinstance(eos, int) else set(eos or ())


class HFEngine:
    """vllm.AsyncLLMEngine on CPU (see the module docstring)."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> HFEngine:
        return cls(engine_args.kwargs)

    def __init__(self, kw: dict):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.dtype = getattr(torch, kw.get("dtype", "bfloat16"))
        self.model = AutoModelForCausalLM.from_pretrained(kw["model"], dtype=self.dtype, attn_implementation="sdpa")
        self.model.eval()
        self.tok = AutoTokenizer.from_pretrained(kw["model"])
        self.eos = self.tok.eos_token_id
        self.stops = ({self.eos} | generation_eos(kw["model"])) - {None}  # A1: what vLLM stops at unasked
        self.max_model_len = int(kw["max_model_len"])
        self.generator = torch.Generator().manual_seed(int(kw.get("seed", 0)))
        self.processed = (kw.get("logprobs_mode") or "raw_logprobs").startswith("processed")
        self.enable_sleep = bool(kw.get("enable_sleep_mode"))
        self.asleep: set[str] = set()
        self.updated: list[str] = []
        self.requests, self.version, self.noted = 0, 0, -1
        # vLLM's AsyncLLM.output_processor: OpenRLHF polls it for the requests in flight (none: generate is
        # synchronous here)
        self.output_processor = types.SimpleNamespace(get_num_unfinished_requests=lambda: 0)
        self.log = os.environ.get("COMPOSER_REAL_OUT")
        import inspect  # transformers 5 renamed past_key_values to cache

        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _note(self, **rec) -> None:
        """The harness's record of what reached the engine (one JSON line per event)."""
        if self.log:
            with open(os.path.join(self.log, "engine.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), **rec}) + "\n")

    # ---- sleep mode (colocation): the weights stay in memory on CPU, the state is enforced ----
    async def is_sleeping(self) -> bool:
        return bool(self.asleep)

    async def sleep(self, level: int = 1):
        if not self.enable_sleep:
            raise RuntimeError("vLLM: sleep() on an engine started without enable_sleep_mode")
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags=None):
        self.asleep -= set(tags or ["weights", "kv_cache"])

    async def reset_prefix_cache(self):
        return True

    # ---- OpenRLHF's WorkerWrap RPCs (openrlhf/trainer/ray/vllm_worker_wrap.py) ----
    async def collective_rpc(self, method: str, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "weights" in self.asleep:
            raise RuntimeError(f"vLLM: {method} while the weights sleep (wake_up(tags=['weights']) first)")
        if method != "update_weight_cuda_ipc":
            raise NotImplementedError(f"HFEngine.collective_rpc({method!r}): the harness runs colocated (CUDA-IPC "
                                      "path, shared CPU tensors)")
        # RolloutRayActor.update_weight_cuda_ipc passes args=(name, dtype, shape, ipc_handles, empty_cache)
        name, dtype, shape, ipc_handles, empty_cache = (list(args) + [False])[:5]
        assert dtype == self.dtype, f"mismatch dtype: src {dtype}, dst {self.dtype}"  # WorkerWrap's check
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        func, fargs = ipc_handles[get_physical_gpu_id()]
        tensor = func(*fargs)
        param = dict(self.model.named_parameters())[name]
        assert tuple(param.shape) == tuple(shape), (name, tuple(param.shape), tuple(shape))
        with torch.no_grad():
            param.copy_(tensor)
        self.updated.append(name)
        if empty_cache:  # the last parameter of a sync
            self.version += 1
            self._note(event="sync", version=self.version, params=len(self.updated),
                       weights=fingerprint(self.model.named_parameters()))
            self.updated = []

    # ---- generation ----
    async def generate(self, prompt, sampling_params, request_id=None):
        yield self._generate(list(prompt["prompt_token_ids"]), sampling_params, request_id)

    def _entry(self, lp: torch.Tensor, tok: int) -> dict:
        """vLLM's per-position logprobs dict with logprobs=1: the chosen token and the top-1 token."""
        top = int(torch.argmax(lp))
        out = {tok: Logprob(float(lp[tok]), int((lp > lp[tok]).sum()) + 1, self.tok.decode([tok]))}
        if top != tok:
            out[top] = Logprob(float(lp[top]), 1, self.tok.decode([top]))
        return out

    @staticmethod
    def _cache(out):
        return out["cache"] if "cache" in out else out.past_key_values

    @torch.no_grad()
    def _generate(self, ids: list, sp, request_id) -> RequestOutput:
        if self.asleep:
            raise RuntimeError(f"vLLM: generate while {sorted(self.asleep)} sleep (wake_up() first)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"vLLM: the prompt ({len(ids)} tokens) is longer than max_model_len {self.max_model_len}")
        self.requests += 1
        if self.noted != self.version:  # the weights this engine samples with, once per sync
            self._note(event="generate", version=self.version, weights=fingerprint(self.model.named_parameters()))
            self.noted = self.version
        self._note(event="request", version=self.version, prompt_tokens=len(ids))  # every request it served
        room = self.max_model_len - len(ids)
        max_tokens = room if sp.max_tokens is None else min(int(sp.max_tokens), room)
        greedy = not sp.temperature or sp.temperature <= 0
        seed = getattr(sp, "seed", None)  # A5
        generator = self.generator if seed is None else torch.Generator().manual_seed(int(seed))
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        prompt_lps = None
        if getattr(sp, "prompt_logprobs", None) is not None:  # A3: the model's own, in either mode
            lps = torch.log_softmax(out.logits[0, :-1].float(), -1)
            prompt_lps = [None] + [self._entry(lps[i], tok) for i, tok in enumerate(ids[1:])]
        cache, logits = self._cache(out), out.logits[0, -1].float()
        toks, entries, finish = [], [], "length"
        stops = self.stops | set(getattr(sp, "stop_token_ids", None) or ())  # A1
        for _ in range(max_tokens):
            x = process(logits, sp, len(toks), stops)
            tok = int(torch.argmax(x)) if greedy else int(torch.multinomial(torch.softmax(x, -1), 1,
                                                                            generator=generator))
            if getattr(sp, "logprobs", None) is not None:  # A2
                entries.append(self._entry(torch.log_softmax(x if self.processed else logits, -1), tok))
            toks.append(tok)
            if tok in stops:
                finish = "stop"
                break
            if len(toks) == max_tokens:
                break
            out = self.model(input_ids=torch.tensor([[tok]]), use_cache=True, **{self.cache_kw: cache})
            cache, logits = self._cache(out), out.logits[0, -1].float()
        text = self.tok.decode(toks, skip_special_tokens=getattr(sp, "skip_special_tokens", True))
        cum = sum(next(iter(e.values())).logprob for e in entries) if entries else None
        return RequestOutput(request_id or f"req{self.requests}", None, ids, prompt_lps,
                             [CompletionOutput(0, text, toks, cum, entries or None, finish)])


class LLM:
    """vllm.LLM (offline) as the composer's judge actor uses it: `LLM(path, **kw)`, `generate([{"prompt_token_ids":
    ids}], SamplingParams, use_tqdm=False)` -> [RequestOutput]."""

    def __init__(self, model: str, max_model_len: int | None = None, seed: int = 0, **_kw):
        from transformers import AutoConfig

        n = max_model_len or AutoConfig.from_pretrained(model).max_position_embeddings
        self.engine = HFEngine({"model": model, "dtype": "bfloat16", "max_model_len": n, "seed": seed})
        self.engine.log = None  # engine.jsonl records the rollout engine only

    def generate(self, prompts, sampling_params, use_tqdm: bool = True):
        outs = [self.engine._generate(list(p["prompt_token_ids"]), sampling_params, None) for p in prompts]
        log = os.environ.get("COMPOSER_REAL_OUT")
        if log:  # the harness's record of what the judge served (judge.jsonl)
            with open(os.path.join(log, "judge.jsonl"), "a") as f:
                for p, o in zip(prompts, outs):
                    f.write(json.dumps({"pid": os.getpid(), "prompt_tokens": len(p["prompt_token_ids"]),
                                        "tokens": list(o.outputs[0].token_ids), "seed": sampling_params.seed,
                                        "temperature": sampling_params.temperature}) + "\n")
        return outs
