"""CPU stand-ins for the parts of OpenRLHF 0.11.2's PPO run that need a GPU cluster (and nothing else).

Replaced (each a small class or function below, installed by `install`):
  Ray's cluster   `ray.init/put/get/wait` over an in-process object store that copies every value through
                  Ray's serializer (cloudpickle), as a value crossing a process boundary is copied; the
                  `@ray.remote` actor classes OpenRLHF defines (PPOTrainer, PolicyModelActor, the reference,
                  reward and critic actors, RolloutRayActor) are replaced in their modules by `LocalActorClass`,
                  which builds the class Ray would ship (`__ray_metadata__.modified_class`, the one the hooks
                  patch) in this process; `.remote()` calls resolve ObjectRef arguments and copy arguments and
                  results like Ray. Placement groups are records (no GPUs to reserve).
  vLLM's engine   `vllm.AsyncEngineArgs` / `vllm.AsyncLLMEngine` (added to the import stub): `CpuLLM` loads the
                  checkpoint in the engine's dtype (bfloat16) and samples on CPU with temperature, top-k, top-p,
                  min_tokens and vLLM's stop tokens (the tokenizer's EOS, generation_config.json's eos_token_id,
                  SamplingParams.stop_token_ids), returning vLLM's RequestOutput shape (token_ids, text, per-token logprobs
                  dicts, prompt_logprobs, finish_reason); sleep / wake_up are tracked and enforced; the weight
                  sync RPCs of OpenRLHF's WorkerWrap (update_weight over a broadcast group, update_weight_cuda_ipc)
                  load the trainer's tensors by name, with WorkerWrap's dtype check. OpenRLHF's RolloutRayActor
                  (its __init__, generate, generate_responses, wake_up, ...) is the real one around it.
  DeepSpeed       `deepspeed.init_distributed` -> a gloo process group of world size 1 (MASTER_ADDR/PORT from
                  OpenRLHF's own BaseDistributedActor), `init_device_mesh('cuda')` -> the same mesh on CPU,
                  `deepspeed.initialize` -> `EngineStandIn`: ZeRO-2 semantics on one rank (fp32 master weights
                  and gradient accumulation, loss / gradient_accumulation_steps in backward, the optimizer step
                  at the accumulation boundary only, global-norm clipping, AdamW from the config's optimizer
                  section, the lr scheduler factory; save_checkpoint writes the module's weights and the client
                  state, as after an evaluation's new best). OpenRLHF's DeepspeedStrategy itself is the real class.
  CUDA            torch.cuda.current_device / synchronize / set_device / current_stream / empty_cache, and
                  OpenRLHF's get_physical_gpu_id (the CUDA-IPC handle key), answer for the CPU.
  torchdata       StatefulDataLoader: torch's DataLoader with state_dict / load_state_dict (the import stub
                  has none; PPOTrainer.fit saves the loader state every step).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

_WORLD: World | None = None


# ----------------------------------------------------------------------------------------------- CUDA

class CpuDevice(str):
    """What torch.cuda.current_device() answers here: "cpu" for `.to(device)`, and "0" inside an f-string
    (NaiveReplayBuffer builds `torch.device(f"cuda:{current_device()}")` for a method the PPO path never calls)."""

    def __new__(cls):
        return str.__new__(cls, "cpu")

    def __format__(self, spec):
        return "0"


def patch_cuda() -> None:
    torch.cuda.current_device = lambda: CpuDevice()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: None


def physical_gpu_id() -> str:
    return "cpu-0"


# ------------------------------------------------------------------------------------------ torchdata

def patch_torchdata() -> None:
    from torch.utils.data import DataLoader

    class StatefulDataLoader(DataLoader):
        """torchdata's StatefulDataLoader as far as OpenRLHF uses it: iteration, state_dict, load_state_dict."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._served = 0

        def __iter__(self):
            for batch in super().__iter__():
                self._served += 1
                yield batch

        def state_dict(self):
            return {"batches_served": self._served}

        def load_state_dict(self, state):
            self._served = int(state.get("batches_served", 0))

    import torchdata.stateful_dataloader as mod

    mod.StatefulDataLoader = StatefulDataLoader


# ------------------------------------------------------------------------------------------------ Ray

class LocalRef:
    """An ObjectRef of the in-process store."""

    __slots__ = ("id",)

    def __init__(self, i: int):
        self.id = i

    def __repr__(self):
        return f"LocalRef({self.id})"

    def __reduce__(self):
        return (LocalRef, (self.id,))


class ObjectStore:
    """ray.put / ray.get / ray.wait in one process: every get returns a fresh copy made by Ray's serializer."""

    def __init__(self):
        from ray import cloudpickle

        self.pickle = cloudpickle
        self.blobs: dict[int, bytes] = {}
        self.ids = itertools.count()

    def copy(self, value):
        return self.pickle.loads(self.pickle.dumps(value))

    def put(self, value, **_kw) -> LocalRef:
        ref = LocalRef(next(self.ids))
        self.blobs[ref.id] = self.pickle.dumps(value)
        return ref

    def get(self, refs, timeout=None):
        if isinstance(refs, (list, tuple)):
            return [self.get(r) for r in refs]
        if not isinstance(refs, LocalRef):
            raise TypeError(f"ray.get of {type(refs).__name__}, not an ObjectRef")
        return self.pickle.loads(self.blobs[refs.id])

    def wait(self, refs, num_returns=1, timeout=None, fetch_local=True):
        refs = list(refs)
        return refs[:num_returns], refs[num_returns:]  # every call finished when .remote() returned


class FakePlacementGroup:
    def __init__(self, bundles, strategy="PACK", **kw):
        self.bundle_specs, self.strategy = list(bundles), strategy

    def ready(self):
        return _WORLD.store.put(True)


def placement_group(bundles, strategy="PACK", **kw):
    _WORLD.placement_groups.append({"bundles": list(bundles), "strategy": strategy})
    return FakePlacementGroup(bundles, strategy)


class LocalActorClass:
    """Stands where a `@ray.remote` class was: `.options(...).remote(*args)` builds the class Ray would ship
    (`__ray_metadata__.modified_class`) here. Keeps `__ray_metadata__`, so the hooks find the shipped class."""

    def __init__(self, world: World, actor_class, role: str):
        self.__ray_metadata__ = actor_class.__ray_metadata__
        self.cls = actor_class.__ray_metadata__.modified_class
        self.original, self.role, self.world = actor_class, role, world
        self.options_seen: list[dict] = []

    def options(self, **options):
        self.options_seen.append({k: v for k, v in options.items() if k != "scheduling_strategy"})
        return self

    def remote(self, *args, **kwargs):
        return self.world.create(self, args, kwargs)

    def __reduce__(self):
        return (_actor_class, (self.role,))


def _actor_class(role):
    return _WORLD.classes[role]


class LocalHandle:
    """An actor handle: `handle.method.remote(*args)` runs the method now, here, and returns an ObjectRef."""

    def __init__(self, world, obj, role: str, index: int):
        self._world, self._obj, self._role, self._index = world, obj, role, index

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def __reduce__(self):
        return (_handle, (self._index,))

    def __repr__(self):
        return f"LocalHandle({self._role}#{self._index})"


def _handle(index):
    return _WORLD.actors[index]


class _Method:
    def __init__(self, handle, name):
        self.handle, self.name = handle, name

    def options(self, **_kw):
        return self

    def remote(self, *args, **kwargs):
        return self.handle._world.call(self.handle, self.name, args, kwargs)


class World:
    """The in-process cluster: the object store, the actors, one event loop for the async (vLLM) actors,
    and `before` / `after` callbacks that see every actor call."""

    def __init__(self):
        self.store = ObjectStore()
        self.actors: list[LocalHandle] = []
        self.classes: dict[str, LocalActorClass] = {}
        self.placement_groups: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.before: list = []
        self.after: list = []
        self.created: list = []  # callbacks(handle)
        self.calls: list[tuple[str, str]] = []
        self.runtime_env: dict = {}
        self.t0 = time.time()
        self.timeline: list[tuple] = []

    def run(self, value):
        if inspect.isawaitable(value):
            return self.loop.run_until_complete(value)
        return value

    def resolve(self, args, kwargs):
        """Top-level ObjectRefs become their values (as Ray resolves task arguments); everything is copied."""
        args = [self.store.get(a) if isinstance(a, LocalRef) else a for a in args]
        kwargs = {k: self.store.get(v) if isinstance(v, LocalRef) else v for k, v in kwargs.items()}
        return self.store.copy((args, kwargs))

    def create(self, cls: LocalActorClass, args, kwargs) -> LocalHandle:
        args, kwargs = self.resolve(args, kwargs)
        obj = cls.cls.__new__(cls.cls)
        self.run(cls.cls.__init__(obj, *args, **kwargs))
        handle = LocalHandle(self, obj, cls.role, len(self.actors))
        self.actors.append(handle)
        for cb in self.created:
            cb(handle)
        return handle

    def call(self, handle: LocalHandle, name: str, args, kwargs) -> LocalRef:
        args, kwargs = self.resolve(args, kwargs)
        self.calls.append((handle._role, name))
        self.timeline.append((round(time.time() - self.t0, 2), handle._role, name))
        for cb in self.before:
            cb(handle, name, args, kwargs)
        result = self.run(getattr(handle._obj, name)(*args, **kwargs))
        for cb in self.after:
            cb(handle, name, args, kwargs, result)
        return self.store.put(result)


def patch_ray(world: World) -> None:
    import ray
    import ray.util.placement_group

    pg_mod = sys.modules["ray.util.placement_group"]

    def init(*args, runtime_env=None, **kwargs):
        """The entry point's ray.init: the runtime env's env_vars reach the actors (all in this process)."""
        world.runtime_env = dict(runtime_env or {})
        os.environ.update((runtime_env or {}).get("env_vars", {}))
        os.environ.setdefault("RAY_ADDRESS", "in-process")  # read by RolloutRayActor._configure_vllm_env

    ray.init = init
    ray.is_initialized = lambda: True
    ray.shutdown = lambda *a, **k: None
    ray.put = world.store.put
    ray.get = world.store.get
    ray.wait = world.store.wait
    pg_mod.placement_group = placement_group


def replace_actor_classes(world: World) -> None:
    """The `@ray.remote` classes, in the modules OpenRLHF's train() and its helpers look them up in."""
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import launcher, ppo_actor, ppo_critic, vllm_engine

    table = [(ppo_trainer, "PPOTrainer", "trainer"), (ppo_actor, "PolicyModelActor", "actor"),
             (launcher, "ReferenceModelActor", "ref"), (launcher, "RewardModelActor", "reward"),
             (ppo_critic, "CriticModelActor", "critic"), (vllm_engine, "RolloutRayActor", "engine")]
    for mod, name, role in table:
        local = LocalActorClass(world, getattr(mod, name), role)
        world.classes[role] = local
        setattr(mod, name, local)
    vllm_engine.placement_group = placement_group
    launcher.placement_group = placement_group
    ppo_actor.get_physical_gpu_id = physical_gpu_id
    ppo_actor.stateless_init_process_group = lambda *a, **k: BroadcastGroup(world)


# ----------------------------------------------------------------------------------------------- vLLM

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


class BroadcastGroup:
    """The trainer's end of the weight-sync group (stateless_init_process_group): `broadcast` delivers the
    tensor to every engine that announced the parameter with update_weight."""

    def __init__(self, world):
        self.world = world

    def broadcast(self, tensor, src=0, stream=None):
        for llm in CpuLLM.instances:
            if llm.pending:
                llm.load(llm.pending.pop(0), tensor)


def fingerprint(params) -> str:
    h = hashlib.sha1()
    for _name, p in params:
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def generation_eos(model: str) -> set:
    """eos_token_id of the model folder's generation_config.json (an int or a list), as vLLM reads it with
    `generation_config="auto"` and adds to every request's stop tokens; none without the file."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        return set()
    return {eos} if isinstance(eos, int) else set(eos or ())


class CpuLLM:
    """vllm.AsyncLLMEngine on CPU (see the module docstring)."""

    instances: ClassVar[list[CpuLLM]] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> CpuLLM:
        return cls(engine_args.kwargs)

    def __init__(self, kw: dict):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.kw = kw
        self.dtype = getattr(torch, kw.get("dtype", "bfloat16"))
        self.model = AutoModelForCausalLM.from_pretrained(kw["model"], dtype=self.dtype, attn_implementation="sdpa")
        self.model.eval()
        self.tok = AutoTokenizer.from_pretrained(kw["model"])
        self.eos = self.tok.eos_token_id
        self.stops = ({self.eos} | generation_eos(kw["model"])) - {None}  # what vLLM stops at unasked
        self.max_model_len = int(kw["max_model_len"])
        self.generator = torch.Generator().manual_seed(int(kw.get("seed", 0)))
        self.logprobs_mode = kw.get("logprobs_mode") or "raw_logprobs"
        self.enable_sleep = bool(kw.get("enable_sleep_mode"))
        self.asleep: set[str] = set()
        self.pending: list[tuple] = []
        self.updates: list[str] = []
        self.rpcs: list[str] = []
        self.requests = 0
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.output_processor = types.SimpleNamespace(get_num_unfinished_requests=lambda: 0)
        CpuLLM.instances.append(self)

    def weights(self) -> str:
        return fingerprint(self.model.named_parameters())

    # ---- sleep mode ----
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

    # ---- the worker extension's RPCs (openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap) ----
    async def collective_rpc(self, method: str, args=(), kwargs=None):
        self.rpcs.append(method)
        if method == "init_process_group":
            return
        if "weights" in self.asleep:
            raise RuntimeError(f"vLLM: {method} while the weights sleep (wake_up(tags=['weights']) first)")
        if method == "update_weight":
            name, dtype, shape = args[:3]
            self._check(name, dtype, shape)
            self.pending.append(name)  # the tensor arrives through the trainer's broadcast
            return
        if method == "update_weight_cuda_ipc":
            name, dtype, shape, ipc_handles = args[:4]
            self._check(name, dtype, shape)
            func, fargs = ipc_handles[physical_gpu_id()]
            self.load(name, func(*fargs))
            return
        raise NotImplementedError(f"CpuLLM.collective_rpc({method!r})")

    def _check(self, name, dtype, shape):
        assert dtype == self.dtype, f"mismatch dtype: src {dtype}, dst {self.dtype}"  # WorkerWrap's check
        p = dict(self.model.named_parameters()).get(name)
        if p is None:
            raise KeyError(f"vLLM load_weights: no parameter {name!r}")
        assert tuple(p.shape) == tuple(shape), (name, tuple(p.shape), tuple(shape))

    def load(self, name, tensor):
        with torch.no_grad():
            dict(self.model.named_parameters())[name].copy_(tensor)
        self.updates.append(name)

    # ---- generation ----
    async def generate(self, prompt, sampling_params, request_id=None):
        yield self._generate(list(prompt["prompt_token_ids"]), sampling_params, request_id)

    def _process(self, logits: torch.Tensor, sp, n_out: int, stops=()) -> torch.Tensor:
        """Temperature, min_tokens (every stop token masked, as vLLM masks all_stop_token_ids), top-k, top-p: the
        distribution that is sampled."""
        x = logits.clone()
        if n_out < (getattr(sp, "min_tokens", 0) or 0):
            x[sorted(set(stops) | self.stops)] = float("-inf")
        t = sp.temperature if sp.temperature and sp.temperature > 0 else 1.0
        x = x / t
        k = getattr(sp, "top_k", -1) or -1
        if 0 < k < x.shape[-1]:
            kth = torch.topk(x, k).values[-1]
            x[x < kth] = float("-inf")
        p = getattr(sp, "top_p", 1.0)
        if p is not None and p < 1.0:
            srt, idx = torch.sort(x, descending=True)
            probs = torch.softmax(srt, -1)
            drop = probs.cumsum(-1) - probs > p
            x[idx[drop]] = float("-inf")
        return x

    def _logprob_entry(self, lp: torch.Tensor, tok: int) -> dict:
        """vLLM's per-position logprobs dict with logprobs=1: the chosen token and the top-1 token."""
        top = int(torch.argmax(lp))
        out = {tok: Logprob(float(lp[tok]), int((lp > lp[tok]).sum()) + 1, self.tok.decode([tok]))}
        if top != tok:
            out[top] = Logprob(float(lp[top]), 1, self.tok.decode([top]))
        return out

    @staticmethod
    def _cache(out):
        return out["cache"] if "cache" in out else out.past_key_values  # noqa: SIM401 (the old name warns)

    @torch.no_grad()
    def _generate(self, ids: list, sp, request_id) -> RequestOutput:
        if self.asleep:
            raise RuntimeError(f"vLLM: generate while {sorted(self.asleep)} sleep (wake_up() first)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"vLLM: the prompt ({len(ids)} tokens) is longer than max_model_len {self.max_model_len}")
        self.requests += 1
        room = self.max_model_len - len(ids)
        max_tokens = room if sp.max_tokens is None else min(int(sp.max_tokens), room)
        greedy = not sp.temperature or sp.temperature <= 0
        processed = self.logprobs_mode.startswith("processed")
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        prompt_lps = None
        if getattr(sp, "prompt_logprobs", None) is not None:  # the model's own in either mode: vLLM never tempers
            lps = torch.log_softmax(out.logits[0, :-1].float(), -1)  # them (tests/test_vllm_real.py, real vLLM)
            prompt_lps = [None] + [self._logprob_entry(lps[i], t) for i, t in enumerate(ids[1:])]
        cache, logits = self._cache(out), out.logits[0, -1].float()
        toks, entries, finish = [], [], "length"
        stops = self.stops | set(getattr(sp, "stop_token_ids", None) or ())
        for _ in range(max_tokens):
            x = self._process(logits, sp, len(toks), stops)
            if greedy:
                tok = int(torch.argmax(x))
            else:
                tok = int(torch.multinomial(torch.softmax(x, -1), 1, generator=self.generator))
            if getattr(sp, "logprobs", None) is not None:
                entries.append(self._logprob_entry(torch.log_softmax(x if processed else logits, -1), tok))
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


def patch_vllm() -> None:
    import vllm

    vllm.AsyncEngineArgs = EngineArgs
    vllm.AsyncLLMEngine = CpuLLM


# ------------------------------------------------------------------------------------------- DeepSpeed

class MasterAdamW:
    """DeepSpeed's bf16 ZeRO-2 optimizer on one rank: fp32 master weights and gradients, AdamW on the
    masters, the low-precision parameters refreshed from them after each step."""

    def __init__(self, groups, params: dict, clip: float):
        self.params = [p for g in groups for p in g["params"]]
        self.master = {id(p): p.detach().float().clone() for p in self.params}
        mgroups = [{"params": [self.master[id(p)] for p in g["params"]], "weight_decay": g.get("weight_decay", 0.0)}
                   for g in groups if g["params"]]
        kw = {k: params[k] for k in ("lr", "eps", "weight_decay") if k in params}
        if "betas" in params:
            kw["betas"] = tuple(params["betas"])
        self.inner = torch.optim.AdamW(mgroups, **kw)
        self.clip = float(clip or 0.0)
        self.offloads = 0

    @property
    def param_groups(self):
        return self.inner.param_groups

    def accumulate(self):
        for p in self.params:
            if p.grad is not None:
                m = self.master[id(p)]
                g = p.grad.detach().float()
                m.grad = g.clone() if m.grad is None else m.grad + g
                p.grad = None

    def step(self) -> float:
        grads = [m.grad for m in self.master.values() if m.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else torch.tensor(0.0)
        if self.clip > 0 and grads:
            coef = self.clip / (float(norm) + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        self.inner.step()
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.master[id(p)].to(p.dtype))
        self.inner.zero_grad(set_to_none=True)
        return float(norm)

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def offload_states(self, include=None, device=None, pin_memory=True, non_blocking=False):
        self.offloads += 1  # one CPU rank: nothing to move


class EngineStandIn(torch.nn.Module):
    """deepspeed.DeepSpeedEngine for world size 1 (see the module docstring). Records every backward's loss."""

    def __init__(self, module, config: dict, model_parameters=None, lr_scheduler=None):
        super().__init__()
        self.module = module
        self.config = config
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        micro = int(config.get("train_micro_batch_size_per_gpu", 1))
        self.gas = max(1, int(config.get("gradient_accumulation_steps") or config.get("train_batch_size", micro) // (micro * world)))
        self.optimizer = None
        self.lr_scheduler = None
        if model_parameters is not None and "optimizer" in config:
            groups = model_parameters if isinstance(model_parameters[0], dict) else [{"params": list(model_parameters)}]
            self.optimizer = MasterAdamW(groups, config["optimizer"]["params"], config.get("gradient_clipping", 0.0))
            self.lr_scheduler = lr_scheduler(self.optimizer.inner) if callable(lr_scheduler) else lr_scheduler
        self.micro_steps = 0
        self.global_steps = 0
        self._grad_norm = None
        self.backwards: list[dict] = []
        self.reloads = 0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_optimization_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        assert self.optimizer is not None, "must provide optimizer during init in order to use backward"
        scaled = loss / self.gas if scale_wrt_gas else loss
        self.backwards.append({"loss": float(loss.detach()), "scaled": float(scaled.detach()), "micro": self.micro_steps})
        scaled.backward(retain_graph=retain_graph)
        self.optimizer.accumulate()
        return scaled

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def step(self, lr_kwargs=None):
        if self.is_gradient_accumulation_boundary():
            self._grad_norm = self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def get_global_grad_norm(self):
        return self._grad_norm

    def empty_partition_cache(self):
        pass

    def reload_states(self, non_blocking=True):
        self.reloads += 1

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """DeepSpeedEngine.save_checkpoint (OpenRLHF saves one after an evaluation that set a new best: `best_*`):
        the module's weights and the client state under save_dir/tag, enough for a test to see it happened."""
        import json

        folder = os.path.join(save_dir, str(tag or f"global_step{self.global_steps}"))
        os.makedirs(folder, exist_ok=True)
        torch.save(self.module.state_dict(), os.path.join(folder, "module.pt"))
        with open(os.path.join(folder, "client_state.json"), "w") as f:
            json.dump(client_state or {}, f, default=str)
        if save_latest:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(os.path.basename(folder))
        return True


def ds_initialize(model=None, optimizer=None, model_parameters=None, lr_scheduler=None, config=None, args=None,
                  dist_init_required=None, **_kw):
    engine = EngineStandIn(model, config or {}, model_parameters, lr_scheduler)
    _WORLD.engines.append(engine)
    return engine, engine.optimizer, None, engine.lr_scheduler


def ds_init_distributed(dist_backend=None, timeout=None, init_method=None, **_kw):
    import torch.distributed as dist

    if not dist.is_initialized():
        extra = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group("gloo", init_method="env://", rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")), **extra)


def patch_deepspeed() -> None:
    import deepspeed
    import openrlhf.utils.deepspeed.deepspeed as ds_mod
    from torch.distributed.device_mesh import init_device_mesh

    deepspeed.initialize = ds_initialize
    deepspeed.init_distributed = ds_init_distributed
    deepspeed.DeepSpeedEngine = EngineStandIn  # DeepspeedStrategy.save_ckpt asserts the engine's class
    ds_mod.init_device_mesh = lambda device_type, shape, mesh_dim_names=None: init_device_mesh(
        "cpu", shape, mesh_dim_names=mesh_dim_names)


# ---------------------------------------------------------------------------------------------- install

def install() -> World:
    """Every stand-in, before OpenRLHF's trainer modules are imported (they bind some names at import)."""
    global _WORLD
    _WORLD = World()
    _WORLD.engines = []
    patch_cuda()
    patch_torchdata()
    patch_vllm()
    patch_ray(_WORLD)
    import openrlhf.trainer.ppo_trainer
    import openrlhf.trainer.ray.ppo_actor
    import openrlhf.trainer.ray.ppo_critic  # noqa: F401

    patch_deepspeed()
    replace_actor_classes(_WORLD)
    return _WORLD
