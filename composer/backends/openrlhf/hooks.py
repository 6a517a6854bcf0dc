"""Installs the composer's behaviour into OpenRLHF, in every process that runs OpenRLHF code.

Most of OpenRLHF runs in Ray actors (the PPOTrainer controller, DeepSpeed policy/reference actors, vLLM
engines), so a patch made in the driver alone does not reach them. The bundle's runtime environment
names `setup_worker` as Ray's `worker_process_setup_hook`: every worker process of the job runs it at
start. It registers post-import hooks, so each OpenRLHF module is patched when (and only where) it is
imported; a vLLM engine process never imports DeepSpeed because of us. The entry point runs `install`
in the driver too (the reference-slot patch is driver-side).

What is patched, and only when the run's plugin section asks for it:
  samples_generator  SamplesGenerator._dispatch_prompts_to_vllm: the trainer step into every label (phases),
                     top_k into vLLM's SamplingParams; generate_samples: the run ends at its declared steps, a
                     step that cannot be filled fails; _generate_vllm: the rollouts in dispatch order (dispatch_order)
  agent              (always) SingleTurnAgentExecutor.execute (rollout engine, runs without a guide): each sample's
                     vLLM request seeded from (seed, global step, prompt, draw): see sample_seeds, and stopped at
                     every one of the policy's stop tokens (composer/stops.py: OpenRLHF's SamplingParams carry
                     none, so vLLM would stop only at the tokenizer's and generation_config's eos, never at a chat
                     template's end of turn listed in neither): see stop_ids. The composer's agent (agent.py)
                     seeds and stops its own requests the same way
  ppo_trainer        BasePPOTrainer.train_step / broadcast_to_vllm / init_checkpoint_states: weights reach
                     vLLM after the steps the Plan's schedule names; the step counter; save_logs_and_checkpoints:
                     checkpoints only where a resume keeps the sync schedule; prepare_datasets: the prompt
                     loader built under a seeded RNG (torchdata draws its sampler's seed there); fit: fails when
                     the run trained fewer steps than declared. Also the copies Ray made of them on the
                     actor classes built from it (PPOTrainer, TrainingActor): see reach_actor_classes
  experience_maker   RemoteExperienceMaker.make_experience_batch: step advantages and teacher prompts
  ppo_actor          ActorPPOTrainer.__init__ / training_step: the composer loss, self-teacher scores;
                     ppo_train (always): torch's RNG seeded from (seed, global step) before each step's update (the
                     replay buffer's shuffle into micro-batches draws from it), as the rollouts' seeds; the logged
                     policy_loss is the loss DeepSpeed back-propagated (trained_loss)
  launcher           RayActorGroup.async_init_model_from_pretrained (driver): the teacher in the reference slot
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import types

_STATE: dict = {}


# ------------------------------------------------------------------------------------- post-import hooks

class _PostImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed (or now, if it already was)."""

    def __init__(self):
        self.hooks: dict[str, list] = {}
        self.busy = threading.local()  # names this thread is resolving now (re-entrancy guard)

    def find_spec(self, name, path, target=None):
        busy = self.busy.__dict__.setdefault("names", set())
        if name not in self.hooks or name in busy:  # a delegating finder asking back: let the others answer
            return None
        busy.add(name)
        try:
            spec = next((s for f in list(sys.meta_path) if f is not self and hasattr(f, "find_spec")
                         for s in [f.find_spec(name, path, target)] if s is not None), None)
        finally:
            busy.discard(name)
        if spec is None or spec.loader is None:
            return None
        loader, pending = spec.loader, self.hooks  # popped when the module runs: a bare find_spec (an
        # availability check such as importlib.util.find_spec) must not use up the hooks

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for hook in pending.pop(name, []):
                    hook(module)

        spec.loader = Loader()
        return spec


def when_imported(name: str, hook) -> None:
    if name in sys.modules:
        hook(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _PostImport)), None)
    if finder is None:
        finder = _PostImport()
        sys.meta_path.insert(0, finder)
    finder.hooks.setdefault(name, []).append(hook)


# ----------------------------------------------------------------------------------------- installing

def load(plan_path: str, run_name: str | None):
    plan = json.load(open(plan_path))
    runs = plan["openrlhf"]["runs"]
    run = next((r for r in runs if r["name"] == run_name), runs[0])
    return plan, run


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: install the plan named by COMPOSER_PLAN / COMPOSER_RUN."""
    path = os.environ.get("COMPOSER_PLAN")
    if not path:
        return
    if not os.path.exists(path):
        raise FileNotFoundError(f"COMPOSER_PLAN={path}: not found from {os.getcwd()} (the bundle is the job's working_dir)")
    install(*load(path, os.environ.get("COMPOSER_RUN")))


def install(plan: dict, run: dict, driver: bool = False) -> None:
    if _STATE.get("installed"):
        return
    _STATE.update(installed=True, plan=plan, run=run)
    p = run["plugin"]
    when_imported("openrlhf.trainer.ppo_utils.samples_generator", _patch_dispatch)
    when_imported("openrlhf.trainer.ppo_trainer", _patch_trainer)
    when_imported("openrlhf.utils.agent", _patch_single_turn)
    when_imported("openrlhf.trainer.ray.ppo_actor", _patch_step_seed)
    if p.get("loss"):
        when_imported("openrlhf.trainer.ppo_utils.experience_maker", _patch_experience_maker)
    if p.get("loss") or p.get("ema_beta") is not None:
        when_imported("openrlhf.trainer.ray.ppo_actor", _patch_actor)
    if driver and p.get("ref") not in (None, "initial"):
        when_imported("openrlhf.trainer.ray.launcher", _patch_reference_slot)


@functools.lru_cache(maxsize=1)
def _plan():
    """The Plan of this run's segments (composer/plan/plan.py): `_plan().at(step)` at a global step."""
    from composer.plan.plan import Plan

    return Plan(_STATE["plan"], _STATE["run"]["segments"])


def _at(step: int):
    """The Plan at this run's step `step` (OpenRLHF counts a run's steps from its first segment's start)."""
    plan = _plan()
    return plan.at(plan.offset + step)


def task_of(plan: dict, run: dict, spec):
    """The Lightning backend's Task for this run (toy: templates, step checker, response cap, verifier);
    for data the verifier only (the rows travel in the labels)."""
    from composer.data import Task

    if plan["openrlhf"]["toy"]:
        from composer.runtime.binding import bind_task

        return bind_task(spec)
    return Task("data", [], {}, run["plugin"].get("verifier") or "math")


@functools.lru_cache(maxsize=1)
def _task():
    return task_of(_STATE["plan"], _STATE["run"], _plan().segments[0].spec)


# ------------------------------------------------------------------------------------------- patches

def _patch_dispatch(mod) -> None:
    from composer.backends.openrlhf.batch import decode_label, encode_label

    cls = mod.SamplesGenerator
    orig = cls._dispatch_prompts_to_vllm
    top_k = _STATE["run"]["plugin"].get("top_k") or 0

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **kw):
        step = getattr(self, "composer_step", 0)
        labels = [encode_label(dict(decode_label(x), step=step)) for x in labels]
        self.__dict__.setdefault("_composer_dispatched", []).extend(zip(prompts, labels))
        if top_k:
            kw["top_k"] = top_k
        return orig(self, prompts, labels, images=images, **kw)

    cls._dispatch_prompts_to_vllm = _dispatch_prompts_to_vllm
    generate_vllm = cls._generate_vllm

    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kw):
        self._composer_dispatched = []
        experiences, consumed, exhausted = generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kw)
        n = kw.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt)
        return dispatch_order(experiences, self._composer_dispatched, n), consumed, exhausted

    cls._generate_vllm = _generate_vllm
    generate_samples = cls.generate_samples

    def generate_samples_(self, **kw):
        """One step's rollouts, or the end of the episode once the run's declared steps are done (a prompt pool
        sized for dynamic filtering's refills holds more rows than the steps use). A step that cannot be filled
        (the pool ran out) stops the job with an error naming the cause instead of training a short batch."""
        done, steps = getattr(self, "composer_step", 0), run_steps()
        if done >= steps:
            return [], None, 0, True
        out = generate_samples(self, **kw)
        rollout, want = out[0], self.args.rollout.batch_size * self.args.rollout.n_samples_per_prompt
        if rollout and len(rollout) < want:
            raise RuntimeError(short_step(done, steps, len(rollout), want, self.args))
        return out

    cls.generate_samples = generate_samples_


def run_steps() -> int:
    """The steps this run declares (its Plan segments)."""
    items = _plan().segments
    return items[-1].end - items[0].start


def filter_reason(args) -> str:
    if not getattr(args.algo, "dynamic_filtering_enable", False):
        return "the prompt pool ran out"
    return (f"rollout.filter (equal_groups: drop, OpenRLHF's dynamic filtering) dropped so many prompts whose "
            f"rewards were all equal that the prompt pool of {args.data.max_samples} rows ran out; use data the policy solves sometimes (mixed groups), more samples_per_prompt, "
            f"or the Lightning backend (rollout.filter.max_rounds caps the refills there)")


def short_step(done: int, steps: int, got: int, want: int, args) -> str:
    return (f"step {done + 1} of {steps}: only {got} of the {want} rollouts a step trains on could be sampled: "
            f"{filter_reason(args)}")


def _seeded_prepare_datasets(mod) -> None:
    """The prompt order a function of the run's seed: torchdata's StatefulDataLoader (shuffle) draws its
    RandomSampler's seed from torch's global RNG when the loader is BUILT (prepare_datasets, in the trainer's
    process, never seeded there), and keeps its generator in the loader's state_dict (the checkpoint), so
    seeding right before the build makes two jobs equal and a resumed job continue the same order. The LR
    schedule's length (max_steps, from the pool's size) is the declared steps': a pool sized for dynamic
    filtering's refills holds `pool_factor` x the rows the steps use."""
    import torch

    from composer.backends.openrlhf.batch import request_seeds

    prepare = mod.prepare_datasets
    factor = int(_STATE["run"]["plugin"].get("pool_factor") or 1)

    def prepare_datasets(strategy, tokenizer):
        torch.manual_seed(request_seeds(_plan().segments[0].spec.train.seed, "prompts")())
        prompts, evals, max_steps = prepare(strategy, tokenizer)
        return prompts, evals, max(max_steps // factor, 1)

    mod.prepare_datasets = prepare_datasets


def dispatch_order(experiences: list, dispatched: list, n: int) -> list:
    """The step's rollouts in the order their prompts were sent, not the order the engines finished them:
    OpenRLHF collects each prompt's group of n samples as it completes (ray.wait), and that order decides the
    reference forward's batches and the replay buffer's order, which the (seeded) shuffle into micro-batches
    permutes. So two runs, or a run and its resumed copy, with the same rows would otherwise update on other
    micro-batches. Groups keep their samples' order; groups of one (prompt, label) sent twice are ordered by
    their tokens. Left as collected when the rows do not split into groups of n."""
    if n <= 0 or len(experiences) % n:
        return experiences
    first: dict = {}
    for i, key in enumerate(dispatched):
        first.setdefault(key, i)
    groups = [experiences[i: i + n] for i in range(0, len(experiences), n)]

    def key(group):
        e = group[0]
        rank = first.get((e.prompts[0], e.labels[0]), len(first))
        return rank, [g.sequences[0].tolist() for g in group]

    return [e for g in sorted(groups, key=key) for e in g]


def sample_seeds(prompt: str, label, counts: dict):
    """`request_seeds` of the next sample of (prompt, label) in this engine: the run's seed, the global step
    (the label's trainer step), the prompt and how many samples of it this engine started before at that step
    (OpenRLHF starts a prompt's samples in order); returns (seeds, draw number)."""
    from composer.backends.openrlhf.batch import decode_label, next_draw, request_seeds

    step = int(decode_label(label).get("step", 0))
    draw = next_draw(counts, prompt, label)
    at = _at(step)
    return request_seeds(at.spec.train.seed, at.step, prompt, draw), draw


def stop_ids(tokenizer, label, cache: dict) -> tuple:
    """The policy's stop tokens (composer/stops.py) for the sample of `label` (the Plan at its step: its prompt
    format), read with OpenRLHF's tokenizer; computed once per segment (`cache`, the executor's)."""
    from composer.backends.openrlhf.batch import decode_label
    from composer.stops import for_spec

    spec = _at(int(decode_label(label).get("step", 0))).spec
    if id(spec) not in cache:
        cache[id(spec)] = for_spec(tokenizer, spec).ids if tokenizer is not None else ()
    return cache[id(spec)]


def _patch_single_turn(mod) -> None:
    cls = mod.SingleTurnAgentExecutor
    orig = cls.execute

    async def execute(self, prompt, label, sampling_params, *args, **kwargs):
        from composer.backends.openrlhf.agent import _with_stops

        seeds, _draw = sample_seeds(prompt, label, self.__dict__.setdefault("_composer_draws", {}))
        tok = kwargs.get("hf_tokenizer", args[1] if len(args) > 1 else None)  # execute(.., max_length, hf_tokenizer, ..)
        sp = copy.deepcopy(_with_stops(sampling_params, stop_ids(tok, label, self.__dict__.setdefault(
            "_composer_stops", {}))))
        sp.seed = seeds()
        return await orig(self, prompt, label, sp, *args, **kwargs)

    cls.execute = execute


def _patch_step_seed(mod) -> None:
    """Each step's update draws its randomness (OpenRLHF shuffles the replay buffer into micro-batches with
    torch's global RNG) from a seed fixed by the run's seed and the global step, not from the RNG state the
    previous steps left: OpenRLHF's checkpoint holds no RNG state, so a resumed job would otherwise split the
    step into other micro-batches than an uninterrupted one."""
    import torch

    from composer.backends.openrlhf.batch import request_seeds
    from composer.backends.openrlhf.loss import step_of

    cls = mod.ActorPPOTrainer
    ppo_train = cls.ppo_train

    def ppo_train_(self, kl_ctl):
        items = list(getattr(self.replay_buffer, "items", []) or [])
        if items:
            labels = [x for it in items[:1] for x in (it.labels if isinstance(it.labels, (list, tuple)) else [it.labels])]
            step = step_of(labels)
            at = _at(step)
            torch.manual_seed(request_seeds(at.spec.train.seed, at.step, "update")())
        losses, backward = [], self.strategy.backward

        def recorded(loss, *args, **kwargs):  # what DeepSpeed back-propagates, micro-batch by micro-batch
            losses.append(float(loss.detach()))
            return backward(loss, *args, **kwargs)

        self.strategy.backward = recorded
        try:
            status = ppo_train(self, kl_ctl)
        finally:
            del self.strategy.backward  # the instance attribute: the class's method again
        if losses and status:
            status["policy_loss"] = status["composer/loss"] = trained_loss(self.strategy, losses)
        return status

    cls.ppo_train = ppo_train_


def trained_loss(strategy, losses: list[float]) -> float:
    """The loss a step trained on, as logged: OpenRLHF logs `policy_loss` as a token-weighted mean of its
    micro-batch policy losses, which is neither the objective under gradient accumulation (each micro-batch
    loss is its share of the window) nor, on the native route, the loss with its KL term. Logged instead:
    what DeepSpeed back-propagated per optimizer step (the sum of its micro-batch losses / gas), averaged
    over the optimizer steps of this call and over the data-parallel ranks."""
    gas = max(int(getattr(strategy, "accumulated_gradient", 1) or 1), 1)
    return strategy.all_reduce(sum(losses) / gas / max(len(losses) / gas, 1.0))


def _patch_trainer(mod) -> None:
    cls = mod.BasePPOTrainer
    train_step, broadcast, init_states = cls.train_step, cls.broadcast_to_vllm, cls.init_checkpoint_states
    save = cls.save_logs_and_checkpoints
    _seeded_prepare_datasets(mod)

    def train_step_(self, rollout_samples, global_step):
        # the Plan's sync rule (composer/plan/schedule.py), at the global count of steps done after this one
        sync = _plan().sync_after(_plan().offset + global_step + 1)
        self._composer_sync = sync
        try:
            status, step = train_step(self, rollout_samples, global_step)
        finally:
            self._composer_sync = True
        status["composer/synced"] = float(sync)
        self.samples_generator.composer_step = step
        return status, step

    def broadcast_to_vllm_(self):
        if getattr(self, "_composer_sync", True):
            return broadcast(self)

    def init_checkpoint_states_(self):
        states = init_states(self)
        step = states.get("global_step", 0)
        self.samples_generator.composer_step = step
        self._composer_sync = resume_sync(step)  # fit() broadcasts on resume, outside train_step
        return states

    def save_logs_and_checkpoints_(self, global_step, logs_dict=None, client_states=None):
        """A checkpoint only where a resume can keep the sync schedule (resumable): under a lagged sampler
        (sync.every > 1) a checkpoint between two syncs would need the engine's older weights, which it does
        not hold; that step's checkpoint is skipped (the logs are written) and the next resumable one is kept."""
        ckpt = self.args.ckpt
        every = ckpt.save_steps
        if global_step % every == 0 and not resumable(global_step):
            ckpt.save_steps = global_step + 1  # global_step % it != 0: no checkpoint at this step
            try:
                return save(self, global_step, logs_dict, client_states)
            finally:
                ckpt.save_steps = every
        return save(self, global_step, logs_dict, client_states)

    patched = {"train_step": train_step_, "broadcast_to_vllm": broadcast_to_vllm_,
               "init_checkpoint_states": init_checkpoint_states_,
               "save_logs_and_checkpoints": save_logs_and_checkpoints_}
    for name, fn in patched.items():
        setattr(cls, name, fn)
    reach_actor_classes(mod, cls, patched)  # PPOTrainer, built in this module before this hook ran
    wrap_fit(mod, cls)
    when_imported("openrlhf.trainer.ppo_trainer_async",
                  lambda m: (reach_actor_classes(m, cls, patched), wrap_fit(m, cls)))


def wrap_fit(mod, base: type) -> list[str]:
    """Every trainer actor class of `mod` (subclasses of `base`, each defining its own fit): after fit, a run
    that trained fewer steps than the Plan declares fails (the job exits non-zero) instead of saving a model
    and reporting success. OpenRLHF's loop ends quietly when the prompt loader runs out."""
    done = []
    for obj in list(vars(mod).values()):
        meta = getattr(obj, "__ray_metadata__", None) if not isinstance(obj, types.ModuleType) else None
        shipped = getattr(meta, "modified_class", None)
        user = getattr(shipped, "__ray_actor_class__", shipped)
        if not (isinstance(user, type) and issubclass(user, base)) or getattr(user.fit, "__composer_fit__", False):
            continue
        fit = user.fit

        def fit_(self, *args, _fit=fit, **kwargs):
            out = _fit(self, *args, **kwargs)
            trained, steps = getattr(self.samples_generator, "composer_step", 0), run_steps()
            if trained < steps:
                raise RuntimeError(f"run '{_STATE['run']['name']}' trained {trained} of its {steps} declared steps: "
                                   f"{filter_reason(self.args)}")
            return out

        fit_.__composer_fit__ = True
        user.fit = fit_
        if shipped is not user:
            setattr(shipped, "fit", _actor_method(fit_))
        done.append(f"{user.__name__}.fit")
    return done


def resumable(step: int) -> bool:
    """Whether a checkpoint after `step` finished steps (of this run) can be resumed from keeping the sync
    schedule (resume_sync does not refuse it)."""
    plan = _plan()
    done = plan.offset + step
    return step <= 0 or plan.sync_after(done) or plan.schedule.sampler_version(done) <= plan.offset


def resume_sync(step: int) -> bool:
    """Whether fit()'s broadcast on resuming after `step` finished steps (of this stage) keeps the Plan's sync
    schedule: yes when the schedule synced after that step (the checkpoint holds exactly the weights the engine
    had); no broadcast before the first sync (the engine starts from the initial weights, as scheduled). A
    resume between two later syncs needs weights the checkpoint does not hold: refused, never sampled with
    newer weights."""
    if step <= 0:
        return True
    plan = _plan()
    sched, done = plan.schedule, plan.offset + step
    if sched.sync_after(done):
        return True
    last = sched.sampler_version(done)
    if last <= plan.offset:
        return False
    raise RuntimeError(f"resume after step {done}: the lagged rollout engine should hold the weights of the sync "
                       f"after step {last}, which the checkpoint does not keep; resume from a checkpoint at a "
                       f"sync step (syncs: {sched.syncs()[:8]}...)")


def reach_actor_classes(mod, base: type, patched: dict) -> list[str]:
    """Point the actor classes of `mod` built from subclasses of `base` at the patched methods.

    `@ray.remote class PPOTrainer(BasePPOTrainer)` runs while the module executes, before any post-import
    hook: Ray subclasses it (`__ray_metadata__.modified_class`, the class it pickles by value and
    instantiates in the actor's worker) and sets a tracing wrapper of every method, inherited ones
    included, on that subclass (ray/actor.py `_make_actor` -> `_inject_tracing_into_class`). Those
    wrappers hold the original functions, so patching `base` alone never reaches the actor; the copies
    on the shipped class are replaced here (unless the user class overrides the method). Returns the
    patched "Class.method" names."""
    done = []
    for obj in list(vars(mod).values()):
        meta = getattr(obj, "__ray_metadata__", None) if not isinstance(obj, types.ModuleType) else None
        shipped = getattr(meta, "modified_class", None)
        if not (isinstance(shipped, type) and issubclass(shipped, base)):
            continue
        user = getattr(shipped, "__ray_actor_class__", shipped)
        for name, fn in patched.items():
            if getattr(user, name, None) is fn:  # inherited from base, not overridden
                setattr(shipped, name, _actor_method(fn))
                done.append(f"{user.__name__}.{name}")
    return done


def _actor_method(fn):
    """`fn` with the `_ray_trace_ctx` keyword Ray's tracing wrappers accept (Ray passes it to actor methods
    when tracing is on)."""

    @functools.wraps(fn)
    def method(self, *args, _ray_trace_ctx=None, **kwargs):
        return fn(self, *args, **kwargs)

    method.__composer_patch__ = fn
    return method


def _patch_experience_maker(mod) -> None:
    from composer.backends.openrlhf.loss import prepare_step

    cls = mod.RemoteExperienceMaker
    orig = cls.make_experience_batch

    def make_experience_batch(self, rollout_samples):
        experiences = orig(self, rollout_samples)
        prepare_step(experiences, _plan(), _STATE["run"]["plugin"], self.tokenizer, _task())
        return experiences

    cls.make_experience_batch = make_experience_batch


def _capture_logits(actor, sink: dict):
    """Keep the logits of the actor's training forward (full-vocabulary objectives) for the loss; returns
    the undo. An instance attribute shadows Actor.forward, so isinstance checks still see an Actor."""
    forward = actor.forward

    def capture(*args, **kwargs):
        out = forward(*args, **kwargs)
        if kwargs.get("return_output") and isinstance(out, tuple):
            sink["logits"] = out[1]["logits"]
        return out

    actor.forward = capture
    return lambda: actor.__dict__.pop("forward", None)


def _patch_actor(mod) -> None:
    from composer.backends.openrlhf.batch import decode_label, to_batch
    from composer.backends.openrlhf.loss import ComposerLoss, prompt_lengths, step_inputs
    from composer.checks.terms import own_loss_temperature

    cls = mod.ActorPPOTrainer
    init, training_step = cls.__init__, cls.training_step
    plugin = _STATE["run"]["plugin"]

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if plugin.get("loss"):
            self.actor_loss_fn = ComposerLoss(_plan(), plugin)
        if plugin.get("ema_beta") is not None:  # the EMA copy is a teacher: the saved model stays the policy
            self.args.train.enable_ema = False

    def teacher_scores(self, exp, at) -> dict:
        """Each self-teacher's log-probs (and logits when its term wants them) of this micro-batch: the source's
        own scoring (`score_tokens`, as on Lightning) with the actor's or its EMA copy's forward."""
        out = {}
        wanted = {t.signal.teacher_source: t.objective.wants_logits for t in at.terms if t.signal.teacher_source}
        for name, want in wanted.items():
            info = plugin["teachers"].get(name)
            if not info or not info["self"]:
                continue
            model = self.actor if info["weights"] == "current" else self.ema_model
            metas = [decode_label(x) for x in exp.labels]
            full = to_batch(exp.sequences, exp.attention_mask, exp.action_mask, exp.prompts, exp.labels)
            prompts = [(m.get("teacher") or {}).get(name) for m in metas]
            pad = self.tokenizer.pad_token_id

            def forward(ids, mask, model=model):
                was = model.training
                model.eval()
                logits = model(ids, action_mask=None, attention_mask=mask, return_output=True)["logits"]
                model.train(was)
                return logits * getattr(model, "temperature", 1.0)

            out[name] = at.spec.sources[name].score_tokens(forward, exp.sequences, exp.attention_mask,
                                                           prompt_lengths(full), prompts, pad, want)
        return out

    def training_step_(self, experience, kl_ctl, step, loss_batch_info=None):
        loss_fn = self.actor_loss_fn
        if not isinstance(loss_fn, ComposerLoss):
            return training_step(self, experience, kl_ctl, step, loss_batch_info)
        at = loss_fn.at(experience)
        advs, norms = step_inputs(experience)  # the same in every pass (--train.max_epochs)
        loss_fn.ctx = {"experience": experience, "advantages": advs, "norms": norms,
                       "gas": max(int(getattr(self.strategy, "accumulated_gradient", 1) or 1), 1),
                       "teachers": teacher_scores(self, experience, at)}
        undo = _capture_logits(self.actor, loss_fn.ctx) if any(t.objective.wants_logits for t in at.terms) else None
        # a signal's own loss temperature (SFT: 1) for this step's forward; the sampler's otherwise
        own = own_loss_temperature(at.spec)
        sampling = getattr(self.actor, "temperature", 1.0)
        if own is not None:
            self.actor.temperature = own
        try:  # the composer's terms own every KL: OpenRLHF's KL loss (reference slot) gets weight 0
            status = training_step(self, experience, 0.0, step, loss_batch_info)
        finally:
            if undo:
                undo()
            if hasattr(self.actor, "temperature"):
                self.actor.temperature = sampling
            loss_fn.ctx = {}
        return status

    cls.__init__, cls.training_step = __init__, training_step_


def _patch_reference_slot(mod) -> None:
    """Driver side: the reference group loads the external teacher (at its own temperature)."""
    plugin = _STATE["run"]["plugin"]
    info = plugin["teachers"][plugin["ref"]]
    cls = mod.RayActorGroup
    orig = cls.async_init_model_from_pretrained

    def async_init_model_from_pretrained(self, strategy, pretrain, *args, **kwargs):
        if self.ray_actor_type is mod.ReferenceModelActor:
            strategy = copy.copy(strategy)
            strategy.args = copy.deepcopy(strategy.args)
            strategy.args.rollout.temperature = info["temperature"]
            pretrain = info["path"]
        return orig(self, strategy, pretrain, *args, **kwargs)

    cls.async_init_model_from_pretrained = async_init_model_from_pretrained


def start_judges(judges: dict[str, str], max_model_len: int | None = None) -> list:
    """Driver side: one named vLLM actor per external judge model (`composer-judge-<source>`), one GPU each,
    with the context the compiler computed for the longest judge prompt plus its answer (plugin judge_max_len)."""
    import ray

    @ray.remote(num_gpus=1)
    class JudgeEngine:
        def __init__(self, path: str):
            from vllm import LLM

            extra = {"max_model_len": max_model_len} if max_model_len else {}
            self.llm = LLM(path, gpu_memory_utilization=0.85, enforce_eager=True, **extra)

        def generate_ids(self, ids: list, max_tokens: int, greedy: bool = True,
                         seed: int | None = None) -> tuple[list, bool]:
            """(tokens, stopped at EOS) of one continuation of token ids (the guide protocol's Sample); a sampled
            one from its own generator seeded with `seed` (the agent's request_seeds)."""
            from vllm import SamplingParams

            p = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=max(max_tokens, 1), seed=seed)
            out = self.llm.generate([{"prompt_token_ids": list(ids)}], p, use_tqdm=False)[0].outputs[0]
            return list(out.token_ids), out.finish_reason != "length"

    actors = [JudgeEngine.options(name=f"composer-judge-{name}").remote(path) for name, path in judges.items()]
    ray.get([a.__ray_ready__.remote() for a in actors])
    return actors

