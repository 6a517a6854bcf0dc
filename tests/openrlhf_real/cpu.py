"""CPU patches for a real OpenRLHF 0.11.2 job, and the harness's recorder. Installed in every Python process
of the test's Ray head (head, job driver, every actor's worker) by site/sitecustomize.py, lazily: each patch
runs right after the module it changes is imported, so a process that never imports OpenRLHF is untouched.

The patches (nothing else of OpenRLHF, Ray, DeepSpeed or transformers is changed):
  P1 torch.cuda     current_device() -> "cpu"; set_device / synchronize / empty_cache / current_stream: no-ops
                    (OpenRLHF calls them unconditionally; torch's CPU build raises)
  P2 device mesh    DeepspeedStrategy's init_device_mesh("cuda", ...) -> the same mesh on "cpu" (gloo)
  P3 optimizer      DeepSpeed's own optimizer path: the engine still builds the optimizer from OpenRLHF's
                    `optimizer` config (DeepSpeedEngine._configure_basic_optimizer, ZeRO-2, bf16), with
                    DeepSpeed's own `torch_adam: true` option, so it picks torch.optim.AdamW instead of FusedAdam
                    (a CUDA kernel). DeepSpeedCPUAdam (--ds.adam_offload) is the CPU path DeepSpeed has, but a
                    C++ JIT build (~6.5 min on this machine) per fresh worker environment
  P4 weight sync    the colocated CUDA-IPC path runs as is on CPU tensors: torch's "file_system" sharing
                    strategy (a handle that can cross Ray's pickling) and get_physical_gpu_id() -> "cpu"
  P5 sleep mode     OpenRLHF's offload_deepspeed_states / reload_deepspeed_states (move optimizer state and
                    weights GPU <-> CPU for colocation): no-ops: with no GPU there is no memory to free for
                    the colocated engine; the state already lives on the CPU (reload would ask DeepSpeed's
                    accelerator for its CUDA device)
  P6 vLLM           vllm.AsyncLLMEngine / AsyncEngineArgs / LLM -> hf_vllm (THE replaced part); the rest of
                    the `vllm` import stub (tests/openrlhf_cpu_stubs) is names only
  (torchdata 0.11 and pylatexenc are the real packages: the openrlhf-cpu extra installs them)
  P9 EMA copy       DeepspeedStrategy.moving_average on "cpu" (OpenRLHF's actor asks for "cuda")
  P8 shm all-reduce DeepSpeed's optional CPU shared-memory all-reduce kernel (a JIT compile) is not built:
                    DeepSpeed then uses torch.distributed's gloo collectives, as where the kernel is unavailable
  P6r/P11 the real engine (only with COMPOSER_REAL_VLLM=1: tests/test_openrlhf_vllm_real.py, in .venv-vllm with vLLM's
                    CPU build; P6 is then not installed and the vllm import stub is off the path): OpenRLHF's own
                    RolloutRayActor builds the real vllm.AsyncLLMEngine (V1 AsyncLLM, its engine core and worker in
                    processes of their own). P6r: enable_sleep_mode False (vLLM's CPU platform has no sleep mode:
                    config validation refuses it), OpenRLHF's sleep / wake_up calls kept as a state that generate
                    enforces (as P5: no accelerator memory to free), a KV cache of kv_cache_memory_bytes (64 MiB)
                    instead of gpu_memory_utilization x the machine's RAM, and a record of what reached the engine.
                    P11: WorkerWrap.update_weight_cuda_ipc, in vLLM's worker process, rebuilds each parameter from
                    the trainer's handle as is (a CPU tensor's handle has no CUDA device id to rewrite: upstream
                    writes args[6]) and at the sync's last parameter loads the whole set through vLLM's own
                    reload_weights (the CPU build repacks linear weights: upstream's model.load_weights no longer
                    reaches them), a tied head named as lm_head.weight too (the reload refreshes it only then)
  P10 no mlflow     `mlflow` reads as not installed in these processes (None in sys.modules: its import fails,
                    importlib.util.find_spec answers None), as on a cluster without it. DeepSpeed's autotuner
                    imports it at `import deepspeed` whenever it is installed (the project's `loggers` extra
                    puts it in the same venv), 2.3 s of CPU in each of a job's ~5 processes that import
                    DeepSpeed; no job of the tier logs to MLflow
The recorder (only with COMPOSER_REAL_OUT set) writes fits.jsonl: per PolicyModelActor fit (PPO runs) and per
SFTTrainer optimizer step (train_sft runs), the loss the real DeepSpeed engine back-propagated, the Lightning
backend's loss of the same batch and weights, the weights before and after, and what each row holds. A fit of
several optimizer steps (train.epochs passes) records each step's loss and a Lightning figure on the weights
that step started from (`update_losses`, `lightning_losses`).
The preemption switch (test-only, COMPOSER_REAL_KILL names a file holding a checkpoint tag, e.g.
`global_step1`): the training actor's process that has just written that checkpoint deletes the file and
SIGKILLs itself, as a preempted node would die; the job fails and a resubmitted one resumes from the checkpoint.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


class _After(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module executes (re-entrant: other finders may call back).

    The same mechanism as composer/backends/openrlhf/hooks.py's `_PostImport`, kept apart on purpose: this
    file runs as a sitecustomize at interpreter start, and importing `composer` there would put the
    installed copy in sys.modules before the job's working_dir (the bundle's own copy) is on the path."""

    def __init__(self, hooks: dict):
        self.hooks, self.busy = hooks, threading.local()

    def find_spec(self, name, path, target=None):
        busy = self.busy.__dict__.setdefault("names", set())
        if name not in self.hooks or name in busy:
            return None
        busy.add(name)
        try:
            spec = next((s for f in list(sys.meta_path) if f is not self and hasattr(f, "find_spec")
                         for s in [f.find_spec(name, path, target)] if s is not None), None)
        finally:
            busy.discard(name)
        if spec is None or spec.loader is None:
            return None
        loader, hooks = spec.loader, self.hooks  # popped when the module runs: a bare find_spec (e.g.
        # transformers' is_deepspeed_available) must not use up the hook

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                hook = hooks.pop(name, None)
                if hook is not None:
                    hook(module)

        spec.loader = Loader()
        return spec


# ------------------------------------------------------------------------------------------- patches

class CpuDevice(str):
    """torch.cuda.current_device() here: "cpu" for `.to(device)`, "0" inside an f-string (cuda:{...})."""

    def __new__(cls):
        return str.__new__(cls, "cpu")

    def __format__(self, spec):
        return "0"


def p1_torch(torch) -> None:
    torch.cuda.current_device = lambda: CpuDevice()
    for name in ("set_device", "synchronize", "empty_cache", "current_stream"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")  # P4


def p2_strategy(mod) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mod.init_device_mesh = lambda device_type, shape, mesh_dim_names=None: init_device_mesh(
        "cpu", shape, mesh_dim_names=mesh_dim_names)
    cls = mod.DeepspeedStrategy
    backward = cls.backward

    def recorded_backward(self, loss, model, optimizer, **kw):  # the recorder: what DeepSpeed back-propagates
        BACKWARDS.append(float(loss.detach()))
        return backward(self, loss, model, optimizer, **kw)

    cls.backward = recorded_backward
    save_ckpt = cls.save_ckpt

    def save_ckpt_(self, model, save_dir, tag=None, *args, **kw):  # the preemption switch
        out = save_ckpt(self, model, save_dir, tag, *args, **kw)
        switch = os.environ.get("COMPOSER_REAL_KILL")
        if switch and os.path.exists(switch) and open(switch).read().strip() == str(tag):
            import signal

            os.remove(switch)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    cls.save_ckpt = save_ckpt_
    moving_average = cls.moving_average  # P9: ActorPPOTrainer passes device "cuda" for the EMA copy

    def moving_average_(self, model, model_ema, beta=0.992, device="cpu"):
        return moving_average(self, model, model_ema, beta, "cpu")

    cls.moving_average = moving_average_


def p3_deepspeed(ds) -> None:
    initialize = ds.initialize

    def initialize_(*args, config=None, **kw):
        if isinstance(config, dict) and "optimizer" in config:
            config = {**config, "optimizer": {**config["optimizer"],
                                              "params": {**config["optimizer"].get("params", {}), "torch_adam": True}}}
        return initialize(*args, config=config, **kw)

    ds.initialize = initialize_


def p8_shm(mod) -> None:
    mod.build_shm_op = lambda: None


def p4_gpu_id(mod) -> None:
    mod.get_physical_gpu_id = lambda: "cpu"


def p5_offload(mod) -> None:
    mod.offload_deepspeed_states = lambda *a, **k: None
    mod.reload_deepspeed_states = lambda *a, **k: None


def p6_vllm(vllm) -> None:
    sys.path.insert(0, HERE)
    import hf_vllm

    vllm.AsyncEngineArgs, vllm.AsyncLLMEngine, vllm.LLM = hf_vllm.EngineArgs, hf_vllm.HFEngine, hf_vllm.LLM


KV_BYTES = 64 * 2**20  # P6r: the real engine's KV cache on CPU (the toy: 1 KiB a token in bf16)


def _engine_note(**rec) -> None:
    """The harness's record of what reached the real engine (engine.jsonl, one JSON line per event)."""
    out = os.environ.get("COMPOSER_REAL_OUT")
    if out:
        with open(os.path.join(out, "engine.jsonl"), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "engine": "vllm", **rec}) + "\n")


def p6_real_vllm(vllm) -> None:
    """P6r (COMPOSER_REAL_VLLM=1): the real vllm.AsyncLLMEngine with the CPU platform's settings (module doc)."""
    Args, Engine = vllm.AsyncEngineArgs, vllm.AsyncLLMEngine

    def engine_args(*args, **kwargs):
        kwargs["enable_sleep_mode"] = False
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs.setdefault("kv_cache_memory_bytes", KV_BYTES)
        _engine_note(event="start", version=vllm.__version__, dtype=kwargs.get("dtype"),
                     logprobs_mode=kwargs.get("logprobs_mode"), enforce_eager=kwargs.get("enforce_eager"))
        return Args(*args, **kwargs)

    class CpuEngine(Engine):
        _asleep: frozenset = frozenset()
        _version = 0

        async def is_sleeping(self) -> bool:
            return bool(self._asleep)

        async def sleep(self, level: int = 1, **kw):
            self._asleep = frozenset({"weights", "kv_cache"})

        async def wake_up(self, tags=None):
            self._asleep = self._asleep - frozenset(tags or ["weights", "kv_cache"])
            return True

        async def generate(self, prompt, sampling_params, *args, **kwargs):
            if self._asleep:
                raise RuntimeError(f"vLLM: generate while {sorted(self._asleep)} sleep (wake_up() first)")
            _engine_note(event="request", version=self._version, prompt_tokens=len(prompt["prompt_token_ids"]),
                         temperature=sampling_params.temperature, logprobs=sampling_params.logprobs)
            async for out in super().generate(prompt, sampling_params, *args, **kwargs):
                yield out

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            if "weights" in self._asleep:
                raise RuntimeError(f"vLLM: {method} while the weights sleep (wake_up(tags=['weights']) first)")
            out = await super().collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
            if method == "update_weight_cuda_ipc" and args[4]:  # empty_cache: the sync's last parameter
                self._version += 1
                _engine_note(event="sync", version=self._version)
            return out

    vllm.AsyncEngineArgs, vllm.AsyncLLMEngine = engine_args, CpuEngine


def p11_worker_wrap(mod) -> None:
    """P11 (COMPOSER_REAL_VLLM=1): OpenRLHF's weight sync into the real engine through vLLM's reload path."""

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        from openrlhf.trainer.ray.utils import get_physical_gpu_id

        assert dtype == self.model_config.dtype, f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        func, args = ipc_handles[get_physical_gpu_id()]
        weight = func(*args)
        assert tuple(weight.shape) == tuple(shape), (name, tuple(weight.shape), tuple(shape))
        pending = self.__dict__.setdefault("_composer_sync", [])
        pending.append((name, weight.detach().clone()))
        if empty_cache:  # the last parameter: the whole set through vLLM's own in-place reload
            names = dict(pending)
            if getattr(self.model_config.hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in names \
                    and "model.embed_tokens.weight" in names:
                # the trainer's named_parameters hold a tied head once (as the embedding); the CPU build's reload
                # refreshes the head only when it is named (measured on the toy: without it vLLM's log-probs of
                # moved weights are 4x further from the trainer's, mean 0.05 nats against 0.012 in bf16)
                pending.append(("lm_head.weight", names["model.embed_tokens.weight"]))
            self.reload_weights(weights_iterator=pending)
            _engine_note(event="reloaded", params=len(pending), where="worker")
            self._composer_sync = []

    mod.WorkerWrap.update_weight_cuda_ipc = update_weight_cuda_ipc


def p_actor(mod) -> None:
    p4_gpu_id(mod)  # ppo_actor binds get_physical_gpu_id by name
    p5_offload(mod)
    if os.environ.get("COMPOSER_REAL_OUT"):
        record_fits(mod)


def p_sft(mod) -> None:
    if os.environ.get("COMPOSER_REAL_OUT"):
        record_sft(mod)


# ------------------------------------------------------------------------------------------ recorder

BACKWARDS: list[float] = []


def record_fits(mod) -> None:
    cls = mod.ActorPPOTrainer
    ppo_train = cls.ppo_train

    def ppo_train_(self, kl_ctl):
        from openrlhf.trainer.ppo_utils.replay_buffer import make_experience_batch

        from hf_vllm import fingerprint

        module = self.actor.model.module
        gas = int(self.strategy.accumulated_gradient)
        rec = {"pid": os.getpid(), "weights_before": fingerprint(module.named_parameters()),
               "gas": gas, "rows": len(self.replay_buffer.items), "samples": samples(self),
               "behaviour": _safe(behaviour, self)}
        exp = make_experience_batch(list(self.replay_buffer.items), False)
        # optimizer steps of one pass over the step's rows: more than one (mini-batches of shuffled rows) has no
        # Lightning figure (Lightning's mini-batches are whole groups in order)
        per_pass = len(self.replay_buffer) // self.replay_buffer.sample_batch_size // max(1, gas)
        figures, old = [], {}  # the Lightning loss at every optimizer step; the pre-update log-probs (passes > 1)

        def lightning_figure():
            if per_pass > 1:
                raise RuntimeError(f"{per_pass} optimizer steps per pass over the step's rows: no Lightning figure")
            fig = lightning(self, module, exp, self.tokenizer.pad_token_id, old)
            figures.append(fig.pop("lightning_loss"))
            rec.update(fig)

        training_step = self.training_step

        def training_step_(experience, kl_ctl, step, *args, **kw):  # an optimizer step starts at every gas-th call
            if step % gas == 0 and "lightning_error" not in rec:
                try:
                    lightning_figure()
                except Exception:  # noqa: BLE001 - reported; the test names it
                    import traceback

                    rec["lightning_error"] = traceback.format_exc()
            return training_step(experience, kl_ctl, step, *args, **kw)

        self.training_step = training_step_  # this call's passes only
        start = len(BACKWARDS)
        try:
            status = ppo_train(self, kl_ctl)
        finally:
            del self.training_step
        losses = BACKWARDS[start:]
        updates = [sum(losses[i:i + gas]) / gas for i in range(0, len(losses), gas)]  # each optimizer step's loss
        rec.update(micro_batches=len(losses), update_losses=updates, lightning_losses=figures,
                   openrlhf_loss=sum(updates) / max(1, len(updates)),  # the step's loss: the mean over its updates,
                   logged_policy_loss=(status or {}).get("policy_loss"),  # as both backends log it
                   weights_after=fingerprint(module.named_parameters()))
        if figures and "lightning_error" not in rec:
            rec["lightning_loss"] = sum(figures) / len(figures)
        with open(os.path.join(os.environ["COMPOSER_REAL_OUT"], "fits.jsonl"), "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
        return status

    cls.ppo_train = ppo_train_


def samples(trainer) -> list[dict]:
    """What each row of the step holds: the dataset prompt, the prompt the sequence was sampled from (the
    tokens before its first action token, decoded), the label's guided / control flags, tag and weight."""
    from composer.backends.openrlhf.batch import decode_label

    out = []
    for item in trainer.replay_buffer.items:
        seq, act = item.sequences.reshape(-1).tolist(), item.action_mask.reshape(-1).tolist()
        first = next((j + 1 for j, a in enumerate(act) if a), len(seq))
        meta = decode_label(item.labels if isinstance(item.labels, str) else item.labels[0])
        prompt = item.prompts if isinstance(item.prompts, str) else item.prompts[0]
        out.append({"prompt": prompt, "sampled_prompt": trainer.tokenizer.decode(seq[:first]),
                    "guided": bool(meta.get("guided", False)), "control": bool(meta.get("control", True)),
                    "tag": meta.get("tag", ""), "weight": meta.get("weight"), "solution": meta.get("solution"),
                    "tokens": [t for t, m in zip(seq, item.attention_mask.reshape(-1).tolist()) if m],  # sampled
                    "teacher_weight": meta.get("teacher_weight"), "teacher": meta.get("teacher"),  # prompt ids
                    # what the loss saw of an episode (rollout.environment): the label's origin spans, OpenRLHF's
                    # action_mask (entry j: token j + 1), the row's reward and its env/* extra_logs
                    "spans": meta.get("spans"), "action_mask": act,
                    "reward": _scalar((item.info or {}).get("reward")),  # the agent's / reward function's reward
                    "env": {k: _scalar(v) for k, v in (item.info or {}).items() if k.startswith("env/")}})
    return out


def _scalar(v):
    """A per-sample Experience.info value as a float (None: absent)."""
    import torch

    return None if v is None else float(torch.as_tensor(v).reshape(-1)[0])


def _safe(fn, *args):
    """A record that must not stop the job it records: the error, as the record."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported; the test names it
        return {"error": f"{type(e).__name__}: {e}"}


def behaviour(trainer) -> dict | None:
    """The engine's behaviour log-probs (Experience.rollout_log_probs, with is_correction_level != off) against the
    training actor's forward of the same tokens (action_log_probs: OpenRLHF's make-experience log-probs of the
    weights the step starts from, which the engine holds after every step's sync) and against the initial weights'
    (base_action_log_probs, the reference actor): |difference| over the action tokens. None without them."""
    import torch

    cur, ini = [], []
    for item in trainer.replay_buffer.items:
        if getattr(item, "rollout_log_probs", None) is None:
            return None
        mask = item.action_mask.reshape(-1).bool()
        rollout = item.rollout_log_probs.reshape(-1).float()
        if rollout.shape != mask.shape:
            return {"error": f"shapes {tuple(rollout.shape)} {tuple(mask.shape)}"}
        cur.append((rollout - item.action_log_probs.reshape(-1).float()).abs()[mask])
        if item.base_action_log_probs is not None:
            ini.append((rollout - item.base_action_log_probs.reshape(-1).float()).abs()[mask])
    if not cur:
        return None
    cur = torch.cat(cur)
    out = {"tokens": int(cur.numel()), "mean_vs_current": float(cur.mean()), "max_vs_current": float(cur.max())}
    if ini:
        ini = torch.cat(ini)
        out.update(mean_vs_initial=float(ini.mean()), max_vs_initial=float(ini.max()))
    return out


def teacher_forward(trainer, info: dict):
    """Raw next-token logits of a term's teacher, as the Lightning backend scores it: an external teacher is
    its checkpoint loaded here with transformers (bf16, the engine's dtype), not the reference actor's slot;
    a self-teacher is the policy module (current weights) or the trainer's frozen initial copy."""
    if info["self"]:
        model = trainer.actor if info["weights"] == "current" else trainer.ema_model
        return lambda ids, mask: model(ids, action_mask=None, attention_mask=mask, return_output=True)["logits"] * \
            getattr(model, "temperature", 1.0)  # OpenRLHF's Actor divides by the rollout temperature: undone
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(info["path"], dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return lambda ids, mask: hf(input_ids=ids, attention_mask=mask).logits


def lightning(trainer, module, exp, pad_id: int, old: dict) -> dict:
    """The Lightning backend's loss of this step (composer/step.py `loss`) on the same batch and the
    module as it is now (before the step's first update, or before a later pass's update): the batch rebuilt with
    loss.step_batch, each term's own batch with its objective's own advantages (Lightning's term views), teacher
    log-probs scored by the composer's score_responses (both backends' scorer) with teacher_forward. With several
    updates per step, the ratio's denominator is the policy's log-probs before the first one (Lightning's
    set_old_logprobs), computed at the first call and kept in `old`."""
    import dataclasses

    from components.sources.policy_model import score_responses
    from composer.backends.openrlhf.batch import to_batch
    from composer.backends.openrlhf.loss import prompt_lengths

    experiences = [exp]

    import torch

    from composer.backends.openrlhf import hooks
    from composer.backends.openrlhf.batch import decode_label, shift
    from composer import step as lightning_step
    from composer.backends.openrlhf.loss import _pad_cat, step_batch, step_of, term_batches
    from composer.checks.terms import own_loss_temperature
    from composer.runtime.models import policy_view

    plan, run = hooks._plan(), hooks._STATE["run"]
    labels = [x for e in experiences for x in e.labels]
    metas = [decode_label(x) for x in labels]
    at = plan.at(plan.offset + step_of(labels))
    spec = at.spec
    full = step_batch(experiences, pad_id, trainable_only=True)
    whole = step_batch(experiences, pad_id)
    # what the Lightning backend's batch records: a signal's own loss temperature (SFT, InT's guided targets:
    # signal.temperature, 1), else the sampler's
    own = own_loss_temperature(spec)
    full.info["temperature"] = own if own is not None else spec.rollout.temperature
    if not run["plugin"].get("loss"):  # native route: OpenRLHF's PPO reads the trainer's own rollout log-probs
        full.behavior_logprobs = shift(_pad_cat([e.action_log_probs for e in experiences]).float())
        base = [e.base_action_log_probs for e in experiences]
        if all(b is not None for b in base):
            full.initial_logprobs = shift(_pad_cat(base).float())
    elif run["plugin"].get("ref") == "initial":  # the plugin's loss reads the reference actor's (ComposerLoss.batches)
        base = [e.base_action_log_probs for e in experiences]
        if all(b is not None for b in base):
            full.initial_logprobs = shift(_pad_cat(base).float())
    batches = term_batches(at, full, metas)
    if any(t.declared.value_model() is not None for t in at.terms):  # ppo: OpenRLHF's critic's old values, and the
        # reward's KL on the actor's make-experience log-probs as OpenRLHF reads them (docs/openrlhf.md): the
        # composer's GAE and loss on the same values and rewards
        whole.values = shift(_pad_cat([e.values for e in experiences]).float())
        whole.behavior_logprobs = shift(_pad_cat([e.action_log_probs for e in experiences]).float())
        # OpenRLHF drops the reference's log-probs and the reward's KL once it has the advantages: the reference
        # (the run's starting checkpoint, which OpenRLHF's reference actor loads) scored here again
        from transformers import AutoModelForCausalLM

        from composer.runtime.models import token_logprobs

        dtype = next(module.parameters()).dtype
        ref = AutoModelForCausalLM.from_pretrained(trainer.strategy.args.actor.model_name_or_path, dtype=dtype).eval()
        with torch.no_grad():
            whole.initial_logprobs = token_logprobs(ref, whole.tokens, whole.attention_mask, full.info["temperature"],
                                                    prefix_len=whole.prompt_len)[0].float()
    for k, (t, b) in enumerate(zip(at.terms, batches)):  # terms may share one view: a copy each
        batches[k] = dataclasses.replace(b, advantages=t.declared.advantages(whole) if whole.rewards is not None
                                         or not t.declared.needs else None)
    plugin = run["plugin"]
    for k, (t, b) in enumerate(zip(at.terms, batches)):
        obj, name = t.objective, t.signal.teacher_source
        if name is None:
            continue
        info = plugin["teachers"][name]
        whole_rows = to_batch(exp.sequences, exp.attention_mask, exp.action_mask, exp.prompts, exp.labels)
        prompts = [(m.get("teacher") or {}).get(name) for m in metas]
        lp, lg = score_responses(teacher_forward(trainer, info), exp.sequences, exp.attention_mask,
                                 prompt_lengths(whole_rows), prompts, info["temperature"], pad_id, obj.wants_logits)
        batches[k] = dataclasses.replace(b, teacher_logprobs=lp, teacher_logits=lg)
    if spec.train.epochs * spec.train.mini_batches > 1:  # Lightning's set_old_logprobs, before the first update
        if not old:
            for b in batches:
                if id(b.tokens) not in old:
                    with torch.no_grad():
                        old[id(b.tokens)] = policy_view(module, b, False).logprobs.detach()
            old["first"] = [old[id(b.tokens)] for b in batches]
        batches = [dataclasses.replace(b, old_logprobs=o) for b, o in zip(batches, old["first"])]
    was = module.training
    with torch.no_grad():  # the Lightning backend's loss: its policy forward, the Plan at the step
        total, _metrics = lightning_step.loss(at, batches, lambda b, want, read: policy_view(module, b, want, read))
    module.train(was)
    import inspect

    objs = [t.objective for t in at.terms]
    return {"lightning_loss": float(total), "label_steps": sorted({int(m.get("step", -1)) for m in metas}),
            "objectives": [f"{type(o).__module__}.{type(o).__name__}" for o in objs],
            "objective_files": [inspect.getfile(type(o)) for o in objs]}


# ------------------------------------------------------------------------------- the SFT recorder

SFT: dict = {}


def record_sft(mod) -> None:
    """OpenRLHF's SFTTrainer (train_sft, torchrun): per optimizer step (a window of gas micro-batches, each
    normalised by the whole window's token count), the loss DeepSpeed back-propagated and the Lightning
    backend's loss of the same tokens and pre-update weights, into fits.jsonl as for the PPO path."""
    fit, window_iter = mod.SFTTrainer.fit, mod.iter_grad_accum_global_norm

    def fit_(self, *args, **kwargs):
        SFT["trainer"] = self
        return fit(self, *args, **kwargs)

    def recorded(window, strategy, gas, mask_fn):
        from hf_vllm import fingerprint

        trainer = SFT["trainer"]
        engine = trainer.model.model
        module = engine.module
        rec = {"pid": os.getpid(), "trainer": "sft", "step": int(engine.global_steps), "gas": int(gas),
               "weights_before": fingerprint(module.named_parameters()), "rows": sum(len(b[0]) for b in window)}
        try:
            rec.update(lightning_sft(trainer, module, list(window), int(engine.global_steps)))
        except Exception:  # noqa: BLE001 - reported; the test names it
            import traceback

            rec["lightning_error"] = traceback.format_exc()
        start = len(BACKWARDS)
        yield from window_iter(window, strategy, gas, mask_fn)  # resumes after the last micro-batch's step
        losses = BACKWARDS[start:]
        rec.update(micro_batches=len(losses), openrlhf_loss=sum(losses) / max(int(gas), 1),
                   weights_after=fingerprint(module.named_parameters()))
        with open(os.path.join(os.environ["COMPOSER_REAL_OUT"], "fits.jsonl"), "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")

    mod.SFTTrainer.fit, mod.iter_grad_accum_global_norm = fit_, recorded


def sft_run(plan: dict) -> dict:
    """The plan's train_sft run this process runs (its output folder is in this process's arguments)."""
    runs = [r for r in plan["openrlhf"]["runs"] if r["trainer"] == "sft"]
    return next((r for r in runs if r["output_dir"] + "/" in " ".join(sys.argv)), runs[0])


def lightning_sft(trainer, module, window: list, step: int) -> dict:
    """The Lightning backend's loss (composer/step.py `loss`) of the window's tokens: OpenRLHF's
    loss mask (the target tokens, shifted: mask[t-1] marks token t) as origin `demonstration`, every term of
    the run's spec at this step, the signal's loss temperature."""
    import torch

    from composer import step as lightning_step
    from composer.backends.openrlhf.batch import shift, to_batch
    from composer.backends.openrlhf.loss import _pad_cat
    from composer.checks.terms import own_loss_temperature
    from composer.origins import CODE
    from composer.plan.plan import Plan
    from composer.runtime.models import policy_view

    plan = json.load(open(os.environ.get("COMPOSER_PLAN", "plan.json")))
    run = sft_run(plan)
    steps = Plan(plan, run["segments"])
    at = steps.at(steps.offset + step)
    spec = at.spec
    pad = trainer.tokenizer.pad_token_id
    ids = _pad_cat([b[0].squeeze(1) for b in window], pad)  # [B, T]
    att = _pad_cat([b[1].squeeze(1) for b in window])  # [B, T]
    lm = _pad_cat([b[2].squeeze(1) for b in window])  # [B, T]
    batch = to_batch(ids, att, lm[:, :-1], [""] * len(ids), ["{}"] * len(ids))
    demo = shift(lm[:, :-1]).bool() & att.bool()
    batch.origin = torch.where(demo, torch.tensor(CODE["demonstration"], dtype=torch.uint8),
                               torch.where(att.bool(), torch.tensor(CODE["prompt"], dtype=torch.uint8),
                                           torch.tensor(CODE["pad"], dtype=torch.uint8)))
    own = own_loss_temperature(spec)
    batch.info["temperature"] = own if own is not None else 1.0
    was = module.training
    with torch.no_grad():
        total, _metrics = lightning_step.loss(at, [batch] * len(at.terms),
                                              lambda b, want, read: policy_view(module, b, want, read))
    module.train(was)
    return {"lightning_loss": float(total), "run": run["name"], "demo_tokens": int(demo.sum()),
            "sequences": [x[a.bool()].tolist() for x, a in zip(ids, att)], "demo_masks": demo.tolist()}


HOOKS = {
    "torch": p1_torch,
    "openrlhf.utils.deepspeed.deepspeed": p2_strategy,
    "deepspeed": p3_deepspeed,
    "deepspeed.comm.torch": p8_shm,
    "openrlhf.trainer.ray.utils": p4_gpu_id,
    "openrlhf.utils.deepspeed.deepspeed_utils": p5_offload,
    "openrlhf.trainer.ray.ppo_actor": p_actor,
    "vllm": p6_vllm,
    "openrlhf.trainer.sft_trainer": p_sft,
}


def install() -> None:
    sys.modules.setdefault("mlflow", None)  # P10
    if os.environ.get("COMPOSER_REAL_VLLM") == "1":  # the real engine: P6r and P11 instead of P6
        HOOKS.update({"vllm": p6_real_vllm, "openrlhf.trainer.ray.vllm_worker_wrap": p11_worker_wrap})
    pending = {}
    for name, hook in HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            pending[name] = hook
    sys.meta_path.insert(0, _After(pending))
