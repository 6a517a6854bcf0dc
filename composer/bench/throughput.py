"""Throughput of this project's training step against TRL's trainers, in one process, interleaved.

    python examples/bench/throughput.py [--pairs grpo,opd,sft] [--sampler hf|fast] [--length 32] ...
    (later: composer bench --throughput, which calls main(argv))

Pairs, each on the same model, the same prompts, the same rows per step and the same completion length:

    grpo  specs/grpo.yaml            vs  trl.GRPOTrainer (num_generations = G, beta = kl_coef, epsilon = clip)
    opd   specs/opd.yaml             vs  trl.experimental.gkd.GKDTrainer (lmbda 1: on-policy; beta 1: reverse KL)
    sft   specs/sft.yaml             vs  trl.SFTTrainer (prompt-completion data, completion-only loss)

Our side is the Lightning backend's own step without the Trainer around it: `ComposerModule.setup` builds
the run context (rollout engine, initial policy), `configure_optimizers` the optimiser and LR scheduler,
and every step calls `ComposerModule.step_loss` (the module's training step: segment, prompts,
`step.collect`, `step.loss`), then does the Trainer's part (backward, gradient clipping, AdamW and
scheduler step) and calls `ComposerModule.after_step` (EMA teachers, the Plan's sync schedule). What it
leaves out is Lightning's own per-step bookkeeping (logging, progress bar, checkpoint callback).

TRL's side is its own `Trainer.train()` loop on CPU (use_cpu, fp32, no vLLM, no logging, no saving);
a TrainerCallback runs our steps in between TRL's, so the two sides alternate block by block
(ours, TRL, ours, TRL, ...) on the same cores. Each side's first step is untimed and FLOP-counted
(FlopCounterMode over what that side runs: its padding, its rows, its generation, counted apart), then
--warmup untimed steps on each side, then the timed blocks; both sides read the same examples in the same
order (ours cycles through the list; TRL's sampler is sequential). The table shows each side's own FLOPs per
step, its share of the host's measured matmul peak (its own count over its own time), and the step at the
host's floor (fair.bound_ms: training at the peak, decode at the measured memory bandwidth).
A TRL block is timed from the end of our previous block to TRL's `on_step_end`, so it holds all of
TRL's per-step work (data loading, generation, reward, reference/teacher forward, loss, backward,
optimiser, callbacks).

Completion length is forced on both sides (min_new_tokens = max_new_tokens = --length; for our side
through the rollout copy's generation_config, which `generate` reads), so samples/s compares equal work;
tokens/s is printed too. The numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"grpo": "grpo.yaml", "opd": "opd.yaml", "sft": "sft.yaml"}
TRL_NAME = {"grpo": "GRPOTrainer", "opd": "GKDTrainer", "sft": "SFTTrainer"}
TARGET = {"matched": 2.0, "compiled": 2.0, "rollout-bf16": 2.0, "defaults": 1.0}  # ours/TRL the issue asks for
MODES = ("matched", "compiled", "rollout-bf16", "defaults")
WORK = {  # what each side's step runs (the table's FLOPs count it), per pair: (ours, TRL)
    "grpo": (("each distinct prompt prefilled once and its cache copied to the group's rows, every row decoded; "
              "training forwards padding-free (composer/runtime/varlen.py) with a group's shared prompt run once "
              "(shared_prefix_plan; in float32 only: under bf16-mixed every row's prompt runs, as OpenRLHF's actor "
              "does, since a copied bf16 past rounds differently from one pass)"),
             ("every row's prompt prefilled (G left-padded copies), every row decoded; training forwards on the "
              "padded [rows, prompt + completion] grid")),
    "opd": ("the same sampler as grpo; student and teacher forwards padding-free, a group's shared prompt run once "
            "(float32 only, as for grpo)",
            ("every row's prompt prefilled (the dataset repeats each prompt G times), every row decoded; student "
             "and teacher forwards on the padded grid")),
    "sft": ("padding-free forwards (composer/runtime/varlen.py: the rows' real tokens only, attention per row)",
            ("padding_free=True: the rows flattened into one sequence, attention under a block-causal mask over "
             "the whole of it (counted at full length)")),
}
MODE_TITLE = {
    "matched": "matched work (same model, batch, data order, forced completion length, KL setting, gradient "
               "checkpointing, training and rollout precision, optimiser, linear backend: read off both sides at "
               "train start; TRL's SFT padding-free)",
    "compiled": "matched work as above, both sides compiled: ours with train.compile: true (the log-prob forwards "
                "and the hf engine's decode step, compiled in the untimed warm-up), TRL with its own "
                "TrainingArguments.torch_compile",
    "rollout-bf16": "matched work as in compiled, rollouts in bf16 on both sides: ours with rollout.precision: bf16 "
                    "(the hf engine's copy rounded to bfloat16 at each sync) and train.compile: true (its compiled "
                    "decode step), TRL generating under bfloat16 autocast, with its torch_compile; our sampler's "
                    "mismatch with the trainer (mismatch/*) in the row",
    "defaults": "TRL defaults (TRL's config defaults for the same spec: GRPO beta 0, so no reference model, and "
                "generation stopping at EOS; gradient checkpointing on; SFTTrainer's defaults) vs our spec as "
                "written (its KL term, EOS stops); settings printed, not required to match",
}


# ------------------------------------------------------------------------------------------ data


def toy_examples(n: int, seed: int, tiers=(2, 4, 6)):
    """A fixed list of toy training examples; both sides cycle through the same list."""
    from components.tasks import toy

    rng = random.Random(f"bench/{seed}")
    return [toy.make_example(toy.random_problem(rng, rng.choice(tiers), "train")) for _ in range(n)]


def cycler(examples):
    """A `Task.sample_train` that hands out `examples` in order, round and round."""
    state = {"i": 0}

    def sample_train(_rng, n):
        out = []
        for _ in range(n):
            out.append(examples[state["i"] % len(examples)])
            state["i"] += 1
        return out

    sample_train.order = "in order"  # the settings row "data order" (TRL's sampler: sequential too)
    return sample_train


# --------------------------------------------------------------------------------------- our side


@dataclass
class Phases:
    """Seconds per phase of our step, summed over the measured steps."""

    seconds: dict = field(default_factory=dict)
    steps: int = 0
    profiling: bool = False  # also mark each phase for torch.profiler (see profile_ours)

    @contextlib.contextmanager
    def timed(self, name):
        mark = contextlib.nullcontext()
        if self.profiling:
            from torch.profiler import record_function

            mark = record_function(f"phase:{name}")
        t0 = time.perf_counter()
        try:
            with mark:
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def per_step_ms(self) -> dict:
        return {k: 1000 * v / max(self.steps, 1) for k, v in self.seconds.items()}


class Ours:
    """The composer's step on the Lightning backend's module, driven without the Trainer."""

    def __init__(self, spec_path: str, overrides: list[str], examples, length: int | None, sampler: str,
                 compile_model: bool = False, rollouts: bool | None = None, device: str = "cpu",
                 lightning: bool = False, root: str | None = None, pair: str = "grpo"):
        import torch

        from composer.backends.lightning.module import ComposerModule
        from composer.plan.compile import compile_plan
        from composer import step as run_step
        from composer.runtime.binding import bind_task
        from composer.runtime.models import load_model, load_tokenizer, prepare_policy
        from composer.checks.validate import validate_file

        self.torch, self.run_step = torch, run_step
        self.pair = pair
        self.mismatch: dict[str, list[float]] = {}  # mismatch/* of the timed steps (composer/step.py)
        self.flops: dict = {}  # the counted step's: step, generation
        self._box: dict | None = None  # the count_flops box while a step is counted
        v = validate_file(spec_path, overrides + (["train.compile=true"] if compile_model else []))
        spec = v.spec
        self.spec = spec
        task = bind_task(spec)
        tok = load_tokenizer(spec.policy.tokenizer or spec.policy.model)
        policy = prepare_policy(load_model(spec.policy.model, spec.policy.dtype), spec.policy)  # as run.py does
        self.module = ComposerModule(compile_plan(v, "lightning"), task, tok, policy, validated=v)
        if device != "cpu":  # the Trainer's move to its device, before setup builds the engine
            self.module.to(device)
        self.module.setup("fit")
        self.ctx = self.module.ctx
        self.policy = policy
        self.ctx.task.sample_train = cycler(examples)
        cap = self.ctx.task.max_new_tokens
        if length and cap and cap < length:  # the forced length is the matched work: the task's response cap
            self.ctx.task.max_new_tokens = length  # (the toy task's is 59) must not cut ours short of TRL's
        self.loop = None
        if lightning:  # the whole Lightning step (fair.LightningLoop): Lightning builds the optimiser
            from composer.bench.fair import LightningLoop

            self.loop = LightningLoop(self.module, root or tempfile.mkdtemp(prefix="bench-ours-"), device,
                                      precision=spec.train.precision)
            self.opt = self.lr_sched = None
        else:
            optim = self.module.configure_optimizers()
            self.opt, self.lr_sched = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
        self.train_model = self.ctx.forward_model(policy)  # compiled with train.compile, as in a run
        self.rows_per_step = spec.train.prompts_per_step * (spec.rollout.samples_per_prompt
                                                            if (length is not None if rollouts is None else rollouts)
                                                            else 1)
        self.done = 0
        self.graphs_in_rounds = 0
        self.phases = Phases()
        self.measuring = False
        self.rows = 0
        self.tokens = 0  # response tokens (rollouts) or every real token (SFT)
        self.rollouts = (length is not None) if rollouts is None else rollouts
        engine = self.ctx.engine
        if length:
            self._force_length(engine, length)
        if sampler == "fast":
            self._use_fast_sampler(engine)
        self._wrap("generate", engine)
        self._wrap("score", engine)
        self._orig = {}
        for holder, name, label in ((self.ctx, "initial_logprobs", "initial_logprobs"), (run_step, "collect", "collect"),
                                    (run_step, "loss", "loss (policy forward + objective)")):
            self._time(holder, name, label)
        if self.loop is not None:  # rows and tokens of each Lightning step, off the module's own step_loss
            real = self.module.step_loss

            def step_loss(step, optimizer):
                loss, metrics = real(step, optimizer)
                self._count(metrics["_batches"])
                self._keep_mismatch(metrics)
                return loss, metrics

            self.module.step_loss = step_loss
            self.loop.start()  # fit up to on_train_start: setup and optimisers, untimed

    def _count(self, batches) -> None:
        if not self.measuring:
            return
        self.phases.steps += 1
        first = batches[0]
        self.rows += first.size
        if self.rollouts:  # generated tokens
            self.tokens += int((first.response_mask & first.attention_mask).sum())
        else:  # every real token the step trains on
            self.tokens += int(first.attention_mask.sum())

    def _keep_mismatch(self, metrics: dict) -> None:
        if self.measuring:
            for k, v in metrics.items():
                if k.startswith("mismatch/"):
                    self.mismatch.setdefault(k, []).append(float(v))

    def settings(self) -> dict:
        """This side's trainer settings, read off the live objects (composer/bench/fair.py)."""
        from composer.bench.fair import settings_ours

        return settings_ours(self, self.loop.trainer if self.loop is not None else None)

    def count_flops(self) -> dict:
        """One untimed step with its matrix FLOPs counted (FlopCounterMode): {'step': all of them,
        'generation': those inside the rollout engine's generate}."""
        from composer.bench.fair import count_flops

        box: dict = {}
        self._box = box
        self.flops.clear()  # (the generate wrapper adds into this very dict)
        try:
            if self.loop is not None:
                self.loop.count_box = box
                self.loop.run(1)
            else:
                with count_flops(box):
                    self.step()
        finally:
            self._box = None
        self.flops.update(step=float(box.get("flops", 0)), generation=float(self.flops.get("generation", 0)))
        return dict(self.flops)

    def _time(self, holder, name: str, label: str) -> None:
        """Time `holder.<name>` (what the module's step calls: composer.step's parts, the run context's initial
        log-probs) as phase `label`."""
        orig = getattr(holder, name)
        self._orig[(holder, name)] = orig if holder is self.run_step else None  # an instance's: delete to restore

        def timed(*a, **kw):
            with self._phase(label):
                return orig(*a, **kw)

        setattr(holder, name, timed)

    def close(self):
        if self.loop is not None:
            self.loop.close()
        for (holder, name), fn in self._orig.items():
            if fn is None:
                vars(holder).pop(name, None)
            else:
                setattr(holder, name, fn)

    def _phase(self, name):
        return self.phases.timed(name) if self.measuring else contextlib.nullcontext()

    def _wrap(self, name, engine):
        fn = getattr(engine, name, None)
        if fn is None:
            return
        if name == "generate":  # the counted step's generation FLOPs
            from composer.bench.fair import generation_flops

            fn = generation_flops(fn, lambda: self._box, self.flops)

        def wrapped(*a, **kw):
            with self._phase(f"engine.{name}"):
                return fn(*a, **kw)

        setattr(engine, name, wrapped)

    @staticmethod
    def _force_length(engine, length: int) -> None:
        """min_new_tokens = length: through the hf engine's generation_config (its sampler reads it), or the
        vLLM engine's SamplingParams (min_tokens)."""
        gc = getattr(getattr(engine, "model", None), "generation_config", None)
        if gc is not None:
            gc.min_new_tokens = length
        elif hasattr(engine, "_params"):
            make = engine._params

            def params(max_tokens, *a, **k):
                p = make(max_tokens, *a, **k)
                p.min_tokens = min(length, max_tokens)
                return p

            engine._params = params
        else:
            raise SystemExit(f"the rollout engine {engine.name} offers no way to force the completion length")

    @staticmethod
    def _use_fast_sampler(engine):
        """fast: the KV-cache sampler without keeping its log-probs, so `score` runs its forward pass again
        (what the hf engine did before it reused the sampler's log-probs)."""
        from composer.runtime.fast_sampler import fast_generate

        if not hasattr(engine, "model"):
            raise SystemExit(f"--sampler fast: the rollout engine {engine.name} has no local model to sample from")

        def generate(prompts, max_new_tokens, sampling):
            out = fast_generate(engine.model, engine.tok, prompts, max_new_tokens, sampling, engine.batch_size)
            engine.generated_tokens += sum(len(g.tokens) for g in out)
            return out

        engine.generate = generate

    def step(self) -> None:
        """One optimiser step: the Lightning module's own step (`ComposerModule.step_loss`: segment, prompts,
        rollouts, signals, loss), then what the Trainer does around it (backward, gradient clip, AdamW, the
        LR scheduler) and the module's `after_step` (EMA teachers, the Plan's sync schedule)."""
        torch = self.torch
        with self._phase("total"):
            loss, metrics = self.module.step_loss(self.done, self.opt)
            batches = metrics.pop("_batches")
            metrics.pop("_eval", None)
            with self._phase("backward"):
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
            with self._phase("clip + optimizer"):
                self.module.on_before_optimizer_step(self.opt)
                clip = self.ctx.spec.train.grad_clip
                if clip:
                    torch.nn.utils.clip_grad_norm_(self.policy.parameters(), clip)
                self.opt.step()
                self.lr_sched.step()
            self.done += 1
            with self._phase("sync + hooks"):
                self.module.after_step(self.done)
        self._count(batches)

    def block(self, n: int, measure: bool) -> float:
        self.measuring = measure
        before = compiled_graphs()
        if self.loop is not None:  # the whole Lightning step, timed by the loop
            try:
                took = self.loop.run(n)
            finally:
                self.measuring = False
            if measure:
                self.phases.seconds["total"] = self.phases.seconds.get("total", 0.0) + took
                self.graphs_in_rounds += compiled_graphs() - before
            return took
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        took = time.perf_counter() - t0
        self.measuring = False
        if measure:  # torch.compile graphs built inside timed blocks (with train.compile: recompiles)
            self.graphs_in_rounds += compiled_graphs() - before
        return took


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (0 before any compile)."""
    import sys as _sys

    dynamo = _sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


# --------------------------------------------------------------------------------------- TRL side


def _trl_common(args, out: str, rows: int, spec) -> dict:
    mode = getattr(args, "mode", "matched")
    return _common_trl_args(out, rows, args.trl_steps, spec, args.threads,
                            args.trl_compile or mode in COMPILED_MODES, getattr(args, "device", "cpu"),
                            matched=mode != "defaults", checkpointing=getattr(args, "checkpointing", "off") == "on",
                            bf16=getattr(args, "precision", "32-true") == "bf16-mixed")


COMPILED_MODES = ("compiled", "rollout-bf16")


def _common_trl_args(out: str, rows: int, steps: int, spec, threads: int, compile_model: bool = False,
                     device: str = "cpu", matched: bool = True, checkpointing: bool = False,
                     bf16: bool = False) -> dict:
    """TrainingArguments for TRL's side. matched: the settings ours trains with (gradient checkpointing as
    `checkpointing`, which TRL's configs turn on by default; torch's fused AdamW, as ours); else TRL's defaults
    for both (only the batch, LR, clip, betas and budget from the spec). Always: the dataset in order (our side
    cycles through the same list in order; GRPO's own sampler: shuffle_dataset=False in trl_grpo), and
    bf16 (bf16-mixed training: accelerate's bfloat16 autocast) as `bf16`."""
    t = spec.train
    # ours takes torch's fused AdamW in full precision and the per-tensor one under Lightning's mixed precision
    # (which refuses to clip an optimiser that unscales: composer/backends/lightning/module.py)
    same = dict(gradient_checkpointing=checkpointing, optim="adamw_torch" if bf16 else "adamw_torch_fused") \
        if matched else {}
    return dict(
        torch_compile=compile_model,
        output_dir=out, per_device_train_batch_size=rows, gradient_accumulation_steps=1, max_steps=steps,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=t.grad_clip or 0.0,
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], weight_decay=t.weight_decay, **same,
        use_cpu=device == "cpu", bf16=bf16, fp16=False, report_to="none", train_sampling_strategy="sequential", logging_strategy="no", save_strategy="no",
        eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False, seed=t.seed,
    )


def trl_grpo(args, spec, model_dir, examples, callback, out):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from components.tasks.verifiers import toy_verifier
    from composer.data import Example
    from composer.runtime.models import load_tokenizer

    obj, r = spec.objective, spec.rollout
    G, P = r.samples_per_prompt, spec.train.prompts_per_step

    def toy_reward(completions, answer, **_):
        return [toy_verifier(c, Example(prompt="", answer=a)).reward for c, a in zip(completions, answer)]

    ds = Dataset.from_dict({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})
    tok = load_tokenizer(model_dir)
    if getattr(args, "mode", "matched") == "defaults":  # TRL's defaults; only batch, lr and budget from the spec
        cfg = GRPOConfig(**_trl_common(args, out, P * G, spec),
                         num_generations=G, max_completion_length=r.max_new_tokens, log_completions=False,
                         model_init_kwargs={"dtype": "float32"}, shuffle_dataset=False, **getattr(args, "trl_grpo_extra", {}))
        return GRPOTrainer(model=model_dir, reward_funcs=toy_reward, args=cfg, train_dataset=ds, processing_class=tok,
                           callbacks=[callback])
    cfg = GRPOConfig(
        **_trl_common(args, out, P * G, spec),
        num_generations=G, max_completion_length=args.length, temperature=r.temperature, top_p=r.top_p,
        top_k=r.top_k, generation_kwargs={"min_new_tokens": args.length}, beta=obj.kl_coef,
        epsilon=obj.clip_low if obj.clip_low is not None else obj.clip,
        epsilon_high=obj.clip_high if obj.clip_high is not None else obj.clip,
        loss_type="dapo", scale_rewards="group" if obj.std_norm else "none", num_iterations=1,
        steps_per_generation=1, log_completions=False, model_init_kwargs={"dtype": "float32"}, shuffle_dataset=False,
        # opt-in: transformers' continuous batching (paged KV cache, prompt blocks shared: the work of our
        # sampler); off by default: on CPU its scheduler costs ~90 s a step on the tiny test model
        **({"use_transformers_continuous_batching": True} if getattr(args, "trl_continuous_batching", False) else {}),
        **getattr(args, "trl_grpo_extra", {}),  # e.g. use_vllm (examples/gpu/throughput_vllm.py)
    )
    return GRPOTrainer(model=model_dir, reward_funcs=toy_reward, args=cfg, train_dataset=ds, processing_class=tok,
                       callbacks=[callback])


def trl_gkd(args, spec, model_dir, teacher_dir, examples, callback, out):
    import torch
    from datasets import Dataset

    from composer.runtime.models import load_tokenizer

    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError:  # older TRL
        from trl import GKDConfig, GKDTrainer

    tok = load_tokenizer(model_dir)
    G, P = spec.rollout.samples_per_prompt, spec.train.prompts_per_step
    ds = Dataset.from_dict({"prompt": [e.prompt for e in examples for _ in range(G)]})

    def collate(features):
        """Left-padded prompts; GKD (lmbda 1) replaces input_ids/labels with the student's own samples.

        The placeholder labels mark `length` completion tokens per row: transformers' Trainer counts them
        (num_items_in_batch) before GKD swaps in the samples, and with a forced length that count is exact
        (all -100 labels would make GKD divide by zero).
        """
        enc = [tok.encode(f["prompt"], add_special_tokens=False) for f in features]
        L, n = max(len(e) for e in enc), args.length
        ids = torch.full((len(enc), L), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(enc), L), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, L - len(e):] = torch.tensor(e)
            mask[i, L - len(e):] = 1
        full = torch.cat([ids, torch.full((len(enc), n), tok.eos_token_id, dtype=torch.long)], dim=1)
        labels = torch.cat([torch.full_like(ids, -100), torch.full((len(enc), n), tok.eos_token_id)], dim=1)
        return {"prompts": ids, "prompt_attention_mask": mask, "input_ids": full,
                "attention_mask": torch.cat([mask, torch.ones((len(enc), n), dtype=torch.long)], dim=1),
                "labels": labels}

    cfg = GKDConfig(**_trl_common(args, out, P * G, spec),
                    lmbda=1.0, beta=1.0, temperature=spec.rollout.temperature, max_new_tokens=args.length,
                    remove_unused_columns=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GKDTrainer(model=model_dir, teacher_model=teacher_dir, args=cfg, train_dataset=ds,
                             processing_class=tok, data_collator=collate, callbacks=[callback])
    trainer.generation_config.min_new_tokens = args.length
    trainer.generation_kwargs["min_new_tokens"] = args.length
    return trainer


def trl_sft(args, spec, model_dir, examples, callback, out):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from composer.runtime.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    ds = Dataset.from_dict({"prompt": [e.prompt for e in examples], "completion": [e.solution for e in examples]})
    if getattr(args, "mode", "matched") == "defaults":  # SFTConfig's defaults (completion-only loss on this data)
        cfg = SFTConfig(**_trl_common(args, out, spec.train.prompts_per_step, spec),
                        model_init_kwargs={"dtype": "float32"})
        return SFTTrainer(model=model_dir, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[callback])
    free = sft_padding_free(args, model_dir)
    cfg = SFTConfig(**_trl_common(args, out, spec.train.prompts_per_step, spec),
                    completion_only_loss=True, packing=False, max_length=None, dataset_num_proc=None,
                    padding_free=free, model_init_kwargs={"dtype": "float32"})
    trainer = SFTTrainer(model=model_dir, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[callback])
    trainer.bench_sft_padding = "free" if free else "padded"
    return trainer


def sft_padding_free(args, model_dir: str) -> bool:
    """TRL's padding_free for the SFT pair (--trl-sft-padding): free (the rows flattened into one sequence, as
    ours runs the real tokens only), padded, or auto: free only where the model attends with flash-attention,
    whose varlen kernels keep each row's attention to itself (TRL's documented requirement). Under SDPA (CPU)
    the flattened sequence's attention spans all N tokens under a block mask (N^2 where the rows need their own
    L^2: at the toy's 32 rows 14.9 GFLOP a step against 9.4 padded and our 6.1), more work than padding."""
    choice = getattr(args, "trl_sft_padding", "auto")
    if choice != "auto":
        return choice == "free"
    from transformers import AutoConfig

    attn = getattr(AutoConfig.from_pretrained(model_dir), "_attn_implementation", None) or ""
    return str(attn).startswith("flash")


def _interleaver(ours, args, record, pair: str = "grpo"):
    """A TrainerCallback that times TRL's blocks and runs our blocks between them. At TRL's train start (its
    optimiser and model prepared) it puts TRL's models on the bench's linear backend, reads both sides' settings
    off the live objects and, unless TRL runs its defaults, refuses to go on when they differ."""
    from transformers import TrainerCallback

    from composer.bench import fair

    class Interleave(TrainerCallback):
        trainer = None  # set by run_pair once the trainer is built

        def on_step_begin(self, _args, state, *_a, **_k):
            if state.global_step == 0 and record.get("count_trl"):  # TRL's first step: counted, untimed
                box = record["trl_box"] = {}
                record["counting"].enter_context(fair.count_flops(box))

        def on_train_begin(self, _args, _state, _control, optimizer=None, **_k):
            tr = self.trainer
            if tr is not None:
                fair.to_backend([tr.model, getattr(tr, "ref_model", None), getattr(tr, "teacher_model", None)],
                                getattr(args, "linear", "onednn"))
                record["settings_trl"] = fair.settings_trl(tr, pair, optimizer)
            if ours is not None:
                record["settings_ours"] = ours.settings()
            if (tr is not None and ours is not None and getattr(args, "mode", "matched") != "defaults"
                    and fair.compare(record["settings_ours"], record["settings_trl"])):
                diff = fair.compare(record["settings_ours"], record["settings_trl"])
                raise fair.SettingsMismatch("the two sides would not train alike: " + "; ".join(
                    f"{k}: ours {record['settings_ours'].get(k, '-')}, TRL {record['settings_trl'].get(k, '-')}"
                    for k in diff))
            if ours is not None:
                ours.block(args.warmup, measure=False)  # our warm-up
            record["mark"] = time.perf_counter()

        def on_step_end(self, _args, state, *_a, **_k):
            now = time.perf_counter()
            g = state.global_step
            if g == 1 and record.get("count_trl"):
                record["counting"].close()
                box = record.pop("trl_box", {})
                record["trl_flops"] = {"step": float(box.get("flops", 0)),
                                       "generation": float(record["trl_gen"].get("generation", 0))}
            untimed = 1 + args.warmup  # the first (counted) step and the warm-up, as on our side
            if g <= untimed:
                if g == untimed:  # TRL's warm-up ends here
                    record["mark"] = time.perf_counter()
                return
            if (g - args.warmup) % args.steps == 0:
                record["trl"].append(now - record["mark"])
                if ours is not None:
                    record["ours"].append(ours.block(args.steps, measure=True))
                record["mark"] = time.perf_counter()

    return Interleave()


# ------------------------------------------------------------------------------------------ a pair


def overrides_for(pair: str, args) -> list[str]:
    o = [f"policy.model={args.model}", "train.eval_every=0"]
    if pair in ("grpo", "opd"):
        if getattr(args, "mode", "matched") != "defaults":  # forced length; with TRL defaults, the spec's budget
            o.append(f"rollout.max_new_tokens={args.length}")
        if args.group:
            o.append(f"rollout.samples_per_prompt={args.group}")
    if pair == "opd":
        o.append(f"sources.teacher.model={args.teacher}")
    if pair != "sft" and getattr(args, "mode", "matched") == "rollout-bf16":
        o.append("rollout.precision=bf16")
    if getattr(args, "precision", "32-true") != "32-true":
        o.append(f"train.precision={args.precision}")
    if args.prompts:
        o.append(f"train.prompts_per_step={args.prompts}")
    return o + list(args.override or [])


def run_pair(pair: str, args, mode: str = "matched") -> dict:
    """One pair in one comparison mode: "matched" (equal work, forced length), "compiled" (the same, ours with
    train.compile) or "defaults" (TRL's defaults
    against our spec as written; lengths are the models' own, so samples/s compares, tokens/s does not)."""
    from composer.checks.validate import validate_file

    args.mode = mode
    forced = mode != "defaults"
    compiled = args.compile or mode in COMPILED_MODES
    spec_path = str(ROOT / "specs" / SPECS[pair])
    ovr = overrides_for(pair, args)
    spec = validate_file(spec_path, ovr).spec
    rollouts = pair != "sft"
    rows = spec.train.prompts_per_step * (spec.rollout.samples_per_prompt if rollouts else 1)
    examples = toy_examples(max(256, 4 * spec.train.prompts_per_step), args.seed)
    if not rollouts and getattr(args, "sft_chars", None):  # the matmul size's SFT rows: length-long solutions
        from composer.bench.fair import stretch

        examples = stretch(examples, args.sft_chars)
    res = {"pair": pair, "mode": mode, "trl": TRL_NAME[pair], "rows_per_step": rows, "ours_error": None,
           "trl_error": None, "size": getattr(args, "size", "toy"), "linear": getattr(args, "linear", "onednn"),
           "length": args.length}
    from composer.bench.fair import linear_backend

    with linear_backend(res["linear"]):
        return _run_pair(pair, args, mode, res, spec_path, ovr, spec, rollouts, rows, examples, forced, compiled)


def _run_pair(pair, args, mode, res, spec_path, ovr, spec, rollouts, rows, examples, forced, compiled) -> dict:
    ours = None
    graphs_before = compiled_graphs()
    t_setup = time.perf_counter()
    cache = getattr(args, "flops_cache", None)
    if cache is None:
        cache = args.flops_cache = {}
    # each side's counted step, per work (the compiled modes reuse the eager count of the same work)
    entry = cache.setdefault((res["size"], pair, mode == "defaults", res["rows_per_step"], args.length), {})
    try:
        ours = Ours(spec_path, ovr, examples, args.length if rollouts and forced else None, args.sampler, compiled,
                    rollouts=rollouts, device=getattr(args, "device", "cpu"), lightning=True, pair=pair)
        # the first step, untimed (fails early if this spec does not run here): its matrix FLOPs counted, unless
        # compiled (counted in the eager mode of the same work)
        if "ours" not in entry and not compiled:
            entry["ours"] = ours.count_flops()
        else:
            ours.block(1, measure=False)
        res["ours_first_step_s"] = time.perf_counter() - t_setup  # loading + the first step (compiling with it)
    except Exception as e:  # reported, not raised: the TRL side still runs
        res["ours_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if ours is not None:
            ours.close()
        ours = None
    trl_compiled = args.trl_compile or mode in COMPILED_MODES
    trl_vllm = bool(getattr(args, "trl_grpo_extra", {}).get("use_vllm"))  # its engine's products: not counted here
    record = {"trl": [], "ours": [], "mark": 0.0,
              "count_trl": "trl" not in entry and not trl_compiled and not trl_vllm,
              "counting": contextlib.ExitStack(), "trl_gen": {}}
    args.trl_steps = 1 + args.warmup + args.rounds * args.steps  # the first (counted) step, warm-up, timed blocks
    cb = _interleaver(ours, args, record, pair)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out:
        try:
            if pair == "grpo":
                trainer = trl_grpo(args, spec, args.model, examples, cb, out)
            elif pair == "opd":
                trainer = trl_gkd(args, spec, args.model, args.teacher, examples, cb, out)
            else:
                trainer = trl_sft(args, spec, args.model, examples, cb, out)
            cb.trainer = trainer
            res["trl_sft_padding"] = getattr(trainer, "bench_sft_padding", None)
            _trl_generation(trainer, record, bf16=mode == "rollout-bf16")
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stderr if args.debug else devnull):
                try:
                    trainer.train()  # Trainer prints its summary dict; the bench prints its own
                finally:
                    record["counting"].close()  # never leave a FLOP counter on the stack (a failed step)
        except Exception as e:
            res["trl_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if args.debug:
                raise
    if ours is not None and not record["ours"] and "SettingsMismatch" not in (res["trl_error"] or ""):
        # TRL failed before interleaving: measure ours alone
        for _ in range(args.rounds):
            record["ours"].append(ours.block(args.steps, measure=True))
    if record.get("trl_flops"):
        entry["trl"] = record["trl_flops"]
    res["trl_block_s"] = record["trl"]
    res["ours_block_s"] = record["ours"]
    res["settings_ours"], res["settings_trl"] = record.get("settings_ours"), record.get("settings_trl")
    if res["settings_ours"] and res["settings_trl"]:
        from composer.bench.fair import compare

        res["settings_differ"] = compare(res["settings_ours"], res["settings_trl"])
    n = args.steps
    if record["trl"]:
        res["trl_samples_per_s"] = rows * n * len(record["trl"]) / sum(record["trl"])
        res["trl_tokens_per_s"] = (res["trl_samples_per_s"] * args.length) if rollouts and forced else None
    if ours is not None and record["ours"]:
        total = sum(record["ours"])
        res["ours_samples_per_s"] = ours.rows / total
        res["ours_tokens_per_s"] = ours.tokens / total
        res["ours_phases_ms"] = ours.phases.per_step_ms()
        if compiled:
            res["ours_compiled_graphs"] = compiled_graphs() - graphs_before
            res["ours_graphs_in_rounds"] = ours.graphs_in_rounds
        if not rollouts:  # SFT tokens on TRL's side: the same examples, prompt + solution + eos
            from composer.runtime.models import load_tokenizer

            tok = load_tokenizer(args.model)
            mean_len = statistics.mean(len(tok.encode(e.prompt + e.solution, add_special_tokens=False)) + 1
                                       for e in examples)
            res["trl_tokens_per_s"] = res.get("trl_samples_per_s", 0) * mean_len if record["trl"] else None
            res["ours_tokens_per_s"] = ours.tokens / total
        else:
            res["ours_mean_response_tokens"] = ours.tokens / max(ours.rows, 1)
        if ours.mismatch:  # the sampler's mismatch with the trainer over the timed steps (composer/step.py)
            res["ours_mismatch"] = {k.removeprefix("mismatch/"): (max(v) if k.endswith(("_max", "abs_max"))
                                                                  else min(v) if k.endswith("_min")
                                                                  else statistics.mean(v))
                                    for k, v in ours.mismatch.items()}
    weights = None
    if ours is not None:
        from composer.bench.fair import weight_bytes

        weights = weight_bytes(ours.policy, 2 if mode == "rollout-bf16" else None)
        ours.close()
    _work_and_bound(res, entry, n, rollouts and forced, args, weights, forced)
    if res.get("trl_samples_per_s") and res.get("ours_samples_per_s"):
        res["ratio"] = res["ours_samples_per_s"] / res["trl_samples_per_s"]
        res["round_ratios"] = [t / o for o, t in zip(record["ours"], record["trl"])]
        res["median_round_ratio"] = statistics.median(res["round_ratios"])
    return res


def _work_and_bound(res: dict, entry: dict, n: int, decode: bool, args, weights: int | None,
                    forced: bool = True) -> None:
    """Each side's own FLOPs per step (its counted first step: what it runs, padding and every row included),
    its ms per step, its share of the host's matmul peak on its own count and its own time, and the step at the
    host's floor (fair.bound_ms: the fewer training FLOPs of the two sides at the peak, generation at the slower
    of its fewer FLOPs at the peak and the policy's weights streamed once per completion position at the
    measured bandwidth) with each side's time over it. Not forced (TRL's defaults: lengths vary from step to
    step): the counted step's FLOPs only, no rates and no bound."""
    from composer.bench.fair import bound_ms

    floor = getattr(args, "floor", None) or {}
    peak, bw = floor.get("peak"), floor.get("bandwidth")
    for side in ("ours", "trl"):
        fl = entry.get(side) or {}
        res[f"{side}_step_flops"] = fl.get("step")
        res[f"{side}_generation_flops"] = fl.get("generation")
        blocks = res.get(f"{side}_block_s")
        if blocks:
            res[f"{side}_ms_per_step"] = 1e3 * sum(blocks) / (n * len(blocks))
            if fl.get("step") and forced:
                res[f"{side}_gflops"] = fl["step"] * n * len(blocks) / sum(blocks) / 1e9
    counted = [entry[s] for s in ("ours", "trl") if (entry.get(s) or {}).get("step")]
    if not counted or not peak or not forced:
        return
    train = min(c["step"] - c.get("generation", 0) for c in counted)
    gen = min(c.get("generation", 0) for c in counted) if decode else 0
    b = bound_ms(train, gen, args.length if decode else 0, weights or 0, peak, bw)
    if b is None:
        return
    res["bound"] = {**{k: round(v, 3) for k, v in b.items()}, "peak_gflops": peak, "bandwidth_gbs": bw,
                    "weight_bytes": weights if decode else None, "decode_positions": args.length if decode else 0}
    for side in ("ours", "trl"):
        if res.get(f"{side}_ms_per_step"):
            res[f"{side}_over_bound"] = res[f"{side}_ms_per_step"] / b["ms"]


def _trl_generation(trainer, record: dict, bf16: bool = False) -> None:
    """TRL's model's `generate` (GRPO's and GKD's, through unwrap_model_for_generation: the same object on one
    CPU process) counted into record['trl_gen'] while TRL's first step is counted; bf16: run under bfloat16
    autocast (the rollout-bf16 mode: TRL generating in bf16, its settings row 'rollout precision' says so)."""
    import functools

    import torch

    from composer.bench.fair import generation_flops

    model = trainer.model
    fn = getattr(model, "generate", None)
    if fn is None:
        return
    fn = generation_flops(fn, lambda: record.get("trl_box"), record["trl_gen"])
    if bf16:
        inner = fn

        @functools.wraps(inner)
        def fn(*a, **k):
            with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16):
                return inner(*a, **k)

        trainer.bench_rollout_precision = "bf16"
    model.generate = fn


# ------------------------------------------------------------------------------------- guided rollouts

GUIDED_SPEC = "specs/mintrl.yaml"


def guided_overhead(model: str | None, prompts: int = 4, repeats: int = 5, overrides=(), spec: str = GUIDED_SPEC,
                    seed: int = 0) -> dict:
    """Wall time per generated policy token of guided rollouts (the spec's guide; MInTRL's chunk reviews with
    its judge) over plain sampling of the same prompts with the same engine. Repeats interleave plain and
    guided; the ratio is the median of the per-repeat ratios, discarded tokens included."""
    import torch

    from components.guides.none import NoGuide
    from composer.runtime.binding import bind_task
    from composer.runtime.context import RunContext
    from composer.runtime.engine import HFEngine
    from composer.runtime.models import load_model, load_tokenizer
    from composer.checks.validate import validate_file

    ovr = ([f"policy.model={model}"] if model else []) + list(overrides)
    sp = validate_file(str(ROOT / spec), ovr).segments[0].spec
    task = bind_task(sp)
    tok = load_tokenizer(sp.policy.tokenizer or sp.policy.model or "toy:student")
    policy = load_model(sp.policy.model or "toy:student")
    ctx = RunContext(task=task, tokenizer=tok, policy=policy, engine=HFEngine(policy, tok), spec=sp,
                     rng=random.Random(seed))
    guide, n = sp.rollout.guide, sp.rollout.samples_per_prompt
    plain_rollout = NoGuide().rollout  # the same driver without a guide

    def timed(fn, examples):
        torch.manual_seed(seed)
        before = ctx.costs["policy_tokens"]
        t0 = time.perf_counter()
        fn(ctx, examples, n)
        return time.perf_counter() - t0, ctx.costs["policy_tokens"] - before

    timed(plain_rollout, ctx.next_prompts(prompts))  # warm-up
    plain, guided, revise = [], [], []
    for _ in range(repeats):
        examples = ctx.next_prompts(prompts)
        plain.append(timed(plain_rollout, examples))
        guided.append(timed(guide.rollout, examples))
        revise.append(ctx.metrics.get("guide/revise_rate", 0.0))
    ratios = [(tg / max(ng, 1)) / (tp / max(np_, 1)) for (tp, np_), (tg, ng) in zip(plain, guided)]
    return {"spec": spec, "guide": guide.kind, "judge": getattr(guide, "judge", None), "prompts": prompts,
            "samples_per_prompt": n, "plain": plain, "guided": guided, "revise_rate": statistics.median(revise),
            "plain_ms_per_token": 1e3 * statistics.median(t / max(k, 1) for t, k in plain),
            "guided_ms_per_token": 1e3 * statistics.median(t / max(k, 1) for t, k in guided),
            "round_ratios": ratios, "ratio": statistics.median(ratios)}


def format_guided(g: dict) -> str:
    rr = g["round_ratios"]
    return (f"guided rollouts ({g['spec']}: guide {g['guide']}, judge {g['judge']}, {g['prompts']} prompts x "
            f"{g['samples_per_prompt']}): {g['guided_ms_per_token']:.3f} vs plain {g['plain_ms_per_token']:.3f} ms per "
            f"generated token = {g['ratio']:.2f}x (median of {len(rr)} interleaved repeats, {min(rr):.2f}-{max(rr):.2f}; "
            f"revise rate {g['revise_rate']:.2f}; target <= 1.3x)")


# ------------------------------------------------------------------------------------------ sweep

SWEEP_AXES = "group=4,8,16,32;length=16,32,64,128;prompts=1,2,4"
SWEEP_COLUMNS = ["axis", "value", "group", "length", "prompts", "rows_per_step", "ours_ms_per_step", "trl_ms_per_step",
                 "ours_mean_ms_per_step", "trl_mean_ms_per_step",
                 "ours_samples_per_s", "trl_samples_per_s", "ratio", "round_ratios", "ours_error", "trl_error"]


def sweep_points(axes: str, base: dict) -> list[tuple[str, dict]]:
    """(axis, point) for every value of every axis, the other two at `base`; "group=4,8;length=16" -> points."""
    out = []
    for part in filter(None, (p.strip() for p in axes.split(";"))):
        name, _, values = part.partition("=")
        if name not in base or not values:
            raise ValueError(f"--sweep-axes: {part!r}: expected one of {', '.join(base)}=v1,v2,...")
        for v in values.split(","):
            out.append((name, {**base, name: int(v)}))
    return out


def run_sweep(args) -> int:
    """GRPO, matched work, at every sweep point: ours and TRL interleaved as in the table (fewer rounds);
    sweep.csv and sweep.png under --out. A point measured for one axis is reused for the others."""
    import copy
    import csv

    base = {"group": args.group or 8, "length": args.length, "prompts": args.prompts or 2}
    try:
        points = sweep_points(args.sweep_axes, base)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/throughput-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    done: dict[tuple, dict] = {}
    keys = list(dict.fromkeys((pt["group"], pt["length"], pt["prompts"]) for _axis, pt in points))
    for p in range(args.sweep_passes):  # passes at different times: a load spike hits one pass, not every one
        for key in keys:
            a = copy.copy(args)
            a.group, a.length, a.prompts = key
            a.rounds = args.sweep_rounds
            print(f"[sweep] pass {p + 1}/{args.sweep_passes}: group {a.group}, length {a.length}, prompts {a.prompts} "
                  "...", flush=True)
            r = run_pair("grpo", a, "matched")
            if key not in done:
                done[key] = r
                continue
            d = done[key]  # the passes' rounds together
            for k in ("ours_block_s", "trl_block_s", "round_ratios"):
                d[k] = d.get(k, []) + r.get(k, [])
            d["ours_error"], d["trl_error"] = d["ours_error"] or r["ours_error"], d["trl_error"] or r["trl_error"]
            for side in ("ours", "trl"):
                if d[f"{side}_block_s"]:
                    d[f"{side}_samples_per_s"] = d["rows_per_step"] * args.steps * len(d[f"{side}_block_s"]) / sum(
                        d[f"{side}_block_s"])
            if d["ours_block_s"] and d["trl_block_s"]:
                d["ratio"] = d["ours_samples_per_s"] / d["trl_samples_per_s"]
    rows = []
    for axis, pt in points:
        r = done[(pt["group"], pt["length"], pt["prompts"])]
        # the least-disturbed block (min over rounds) per side: on a shared machine, load only adds time
        ms = {side: 1000 * min(r[f"{side}_block_s"]) / args.steps if r.get(f"{side}_block_s") else None
              for side in ("ours", "trl")}
        mean = {side: 1000 * statistics.mean(r[f"{side}_block_s"]) / args.steps if r.get(f"{side}_block_s") else None
                for side in ("ours", "trl")}
        rows.append({"axis": axis, "value": pt[axis], **pt, "rows_per_step": r["rows_per_step"],
                     "ours_ms_per_step": ms["ours"], "trl_ms_per_step": ms["trl"],
                     "ours_mean_ms_per_step": mean["ours"], "trl_mean_ms_per_step": mean["trl"],
                     "ours_samples_per_s": r.get("ours_samples_per_s"), "trl_samples_per_s": r.get("trl_samples_per_s"),
                     "ratio": r.get("ratio"), "round_ratios": " ".join(f"{x:.3f}" for x in r.get("round_ratios", [])),
                     "ours_error": r.get("ours_error"), "trl_error": r.get("trl_error")})
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=SWEEP_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot_sweep(rows, out / "sweep.png", args)
    for r in rows:
        print(f"{r['axis']:8s} {r['value']:>4d}  rows {r['rows_per_step']:>4d}  ours {_fmt(r['ours_ms_per_step'])} ms  "
              f"TRL {_fmt(r['trl_ms_per_step'])} ms  (fastest round each)  ratio of all rounds {_fmt(r['ratio'], 2)}")
    print(f"wrote {out / 'sweep.csv'} and {out / 'sweep.png'}")
    failed = [r for r in rows if r["ours_ms_per_step"] is None or r["trl_ms_per_step"] is None]
    for r in failed:
        print(f"[sweep] a side did not run at {r['axis']}={r['value']}: ours {r['ours_error']}, TRL {r['trl_error']}",
              file=sys.stderr)
    return 1 if failed else 0


def _fmt(x, d=0) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def plot_sweep(rows: list[dict], path: Path, args) -> None:
    """One figure, a panel per axis: ms per GRPO step, ours and TRL, against the axis (log2 x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = list(dict.fromkeys(r["axis"] for r in rows))
    fig, panels = plt.subplots(1, len(axes), figsize=(4.2 * len(axes), 3.6), squeeze=False)
    label = {"group": "group size (samples per prompt)", "length": "response length (forced tokens)",
             "prompts": "prompts per step"}
    for ax, name in zip(panels[0], axes):
        pts = sorted((r for r in rows if r["axis"] == name), key=lambda r: r["value"])
        xs = [r["value"] for r in pts]
        for side, style in (("ours", "o-"), ("trl", "s--")):
            ys = [r[f"{side}_ms_per_step"] for r in pts]
            ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], style,
                    label="ours" if side == "ours" else "TRL GRPOTrainer")
        if len(set(xs)) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel(label.get(name, name))
        ax.set_ylabel("ms per step (fastest round)")
        others = {k: pts[0][k] for k in ("group", "length", "prompts") if k != name}
        ax.set_title(", ".join(f"{k} {v}" for k, v in others.items()), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"GRPO step cost, matched work, {args.threads} CPU thread(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------- profiling


MATMUL_SHAPES = ((2048, 128, 384), (2048, 384, 128), (2048, 128, 256), (64, 128, 768), (64, 384, 128))  # M, K, N


def _gflops(flop: int, fn, repeats: int) -> float:
    """flop / the median wall time of `repeats` calls of fn (after 5 untimed ones), in GFLOPS."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return flop / statistics.median(times) / 1e9


def host_info(threads: int) -> dict:
    """What the ratios depend on: the CPU (vendor, family/model, name), ATen's vector ISA, and how fast one
    float32 product of the toy step (2048 x 128 x 384) runs through MKL and through oneDNN here. MKL takes
    its AVX2 path on AMD CPUs: where the core runs 512-bit FMAs at full width (e.g. Zen 5) oneDNN's product is
    about twice as fast, where it runs them as two 256-bit halves (Zen 4: family 25, model 17) both reach the
    same speed, and our matched ratios move with it (README, throughput)."""
    import platform

    import torch
    import torch.nn.functional as F

    from composer.runtime import onednn

    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("vendor_id", "cpu family", "model", "model name") and k not in cpu:
                cpu[k] = v.strip()
    except OSError:
        pass
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2048, 128, generator=g), torch.randn(384, 128, generator=g)
    flop = 2 * 2048 * 128 * 384
    return {
        "cpu": cpu.get("model name") or platform.processor() or platform.machine(),
        "vendor": cpu.get("vendor_id"), "family": cpu.get("cpu family"), "model": cpu.get("model"),
        "isa": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "threads": threads,
        "mkl_gflops": round(_gflops(flop, lambda: F.linear(x, w), 10), 1),
        "onednn_gflops": round(_gflops(flop, lambda: onednn._raw(x, w), 10), 1) if onednn.available() else None,
    }


def format_host(h: dict) -> str:
    dnn = f"{h['onednn_gflops']:.0f}" if h.get("onednn_gflops") else "-"
    return (f"host: {h['cpu']} ({h['vendor']}, family {h['family']} model {h['model']}), ATen ISA {h['isa']}, "
            f"torch {h['torch']}; one 2048x128x384 float32 product on {h['threads']} thread(s): MKL "
            f"{h['mkl_gflops']:.0f} / oneDNN {dnn} GFLOPS")


def matmul_table(threads: int, shapes=MATMUL_SHAPES, repeats: int = 20) -> str:
    """GFLOPS of y = x w^T (x [M, K], w [N, K]) and of its two gradient products (g w, g^T x) through MKL's
    sgemm (`F.linear`, `mm`) and through oneDNN (`composer.runtime.onednn`, in the operand order its backward
    uses), float32 on CPU, median of `repeats`: whether routing the linears through oneDNN pays here."""
    import torch
    import torch.nn.functional as F

    from composer.runtime import onednn

    torch.set_num_threads(threads)

    def gflops(flop, fn):
        return _gflops(flop, fn, repeats)

    lines = [f"float32 products on {threads} thread(s), GFLOPS, MKL / oneDNN (oneDNN "
             f"{'in use' if onednn.available() else 'not available or switched off'}):",
             f"  {'M x K x N':>18s} {'forward':>15s} {'grad of x':>15s} {'grad of w':>15s}"]

    def products(x, w, d):
        """(MKL, oneDNN) callables for x w^T, d w and d^T x; oneDNN's weight gradient in the operand order the
        backward uses (the narrower operand first)."""
        wide = w.shape[0] > w.shape[1]  # N > K
        return ((lambda: F.linear(x, w), lambda: onednn._raw(x, w)),
                (lambda: d.mm(w), lambda: onednn._raw(d, w.t())),
                (lambda: d.t().mm(x),
                 (lambda: onednn._raw(x.t(), d.t())) if wide else (lambda: onednn._raw(d.t(), x.t()))))

    g = torch.Generator().manual_seed(0)
    for M, K, N in shapes:
        x, w, d = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(M, N, generator=g)
        flop = 2 * M * K * N
        cells = [f"{gflops(flop, mkl):6.0f} / "
                 + (f"{gflops(flop, dnn):5.0f}" if onednn.available() else f"{'-':>5s}")
                 for mkl, dnn in products(x, w, d)]
        lines.append(f"  {f'{M} x {K} x {N}':>18s} " + " ".join(f"{c:>15s}" for c in cells))
    return "\n".join(lines)


def decode_stream_table(threads: int, shape: dict | None = None, rows=(1, 8), steps: int = 20) -> str:
    """The decode step's products at the matmul size (fair.MATMUL_MODEL: per layer the fused q/k/v, o, the fused
    gate/up and down weights, every layer's its own tensors, so each step streams all of them from memory as a
    decode step does): ms per step for `rows` rows through F.linear in float32 and with bfloat16 weights, the
    weights' read rate, against the bandwidth probe (fair.bandwidth_gbs) that the bound's decode floor reads."""
    import time

    import torch
    import torch.nn.functional as F

    from composer.bench.fair import MATMUL_MODEL, bandwidth_gbs

    torch.set_num_threads(threads)
    c = {**MATMUL_MODEL, **(shape or {})}
    h, d = c["hidden"], c["hidden"] // c["heads"]
    per_layer = [((c["heads"] + 2 * c["kv_heads"]) * d, h), (h, c["heads"] * d), (2 * c["intermediate"], h),
                 (h, c["intermediate"])]  # (out, in): qkv, o, gate_up, down
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) for _ in range(c["layers"]) for o, i in per_layer]
    weight_bytes = sum(w.numel() for w in ws) * 4
    bw = bandwidth_gbs(threads)["gbs"]
    lines = [f"decode-step products at the matmul size ({c['layers']} layers, hidden {h}, MLP {c['intermediate']}: "
             f"{weight_bytes / 1e6:.0f} MB of float32 weights, streamed once a step) on {threads} thread(s); the "
             f"bound's floor at the probe's {bw:.1f} GB/s: {weight_bytes / bw / 1e6:.2f} ms a step",
             f"  {'rows':>5s} {'weights':>9s} {'ms/step':>8s} {'GB/s':>6s} {'x floor':>8s}"]
    def step(wd, xs):  # one decode step's products: every weight once
        for w in wd:
            F.linear(xs[w.shape[1]], w)

    for dtype in (torch.float32, torch.bfloat16):
        wd = [w.to(dtype) for w in ws]
        nbytes = sum(w.numel() * w.element_size() for w in wd)
        for m in rows:
            xs = {i: torch.randn(m, i, generator=g).to(dtype) for i in {w.shape[1] for w in wd}}
            for _ in range(3):
                step(wd, xs)
            t0 = time.perf_counter()
            for _ in range(steps):
                step(wd, xs)
            ms = (time.perf_counter() - t0) / steps * 1e3
            lines.append(f"  {m:5d} {str(dtype).removeprefix('torch.'):>9s} {ms:8.2f} {nbytes / ms / 1e6:6.1f} "
                         f"{ms / (nbytes / bw / 1e6):7.1f}x")
    return "\n".join(lines)


KERNELS = ("aten::", "mkldnn::")  # profiler events that are kernels (oneDNN's linear: composer/runtime/onednn.py)


def profile_ours(pair: str, args, steps: int = 3) -> str:
    """Where our step's time goes: per phase, wall time vs time inside ATen ops (the rest is Python,
    dispatch and module-call overhead, plus the profiler's own per-op cost), and the heaviest ops."""
    import bisect

    from torch.profiler import ProfilerActivity, profile

    spec_path = str(ROOT / "specs" / SPECS[pair])
    ovr = overrides_for(pair, args)
    spec_rollouts = pair != "sft"
    examples = toy_examples(256, args.seed)
    ours = Ours(spec_path, ovr, examples, args.length if spec_rollouts else None, args.sampler, args.compile)
    try:
        ours.block(args.warmup + 1, measure=False)
        ours.phases.profiling = True
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours.block(steps, measure=True)
    finally:
        ours.close()
    events = prof.events()
    ops = sorted((e for e in events if e.name.startswith(KERNELS)), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ops]
    prefix = [0.0]
    for e in ops:
        prefix.append(prefix[-1] + e.self_cpu_time_total)
    rows = {}
    for e in events:
        if not e.name.startswith("phase:"):
            continue
        lo = bisect.bisect_left(starts, e.time_range.start)
        hi = bisect.bisect_left(starts, e.time_range.end)
        wall, aten = rows.get(e.name[6:], (0.0, 0.0))
        rows[e.name[6:]] = (wall + e.time_range.elapsed_us(), aten + prefix[hi] - prefix[lo])
    lines = [f"{pair} ours under torch.profiler, {steps} steps, sampler {args.sampler}, {args.threads} thread(s); "
             "ms per step (profiled, so slower than the timed runs):",
             f"  {'phase':36s} {'wall':>7s} {'in ATen':>8s} {'other':>7s}"]
    for name, (wall, aten) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name:36s} {wall / 1e3 / steps:7.0f} {aten / 1e3 / steps:8.0f} "
                     f"{(wall - aten) / 1e3 / steps:7.0f}")
    top = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:8]
    lines.append("  heaviest ATen ops (self ms per step): " + ", ".join(
        f"{a.key.removeprefix('aten::')} {a.self_cpu_time_total / 1e3 / steps:.0f} ({a.count // steps}x)"
        for a in top if a.key.startswith(KERNELS)))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- printing


def format_results(results: list[dict], args, host: dict | None = None) -> str:
    from composer.bench.fair import format_settings

    peak = ((host or {}).get("matmul_peak") or {}).get("peak")
    bw = (host or {}).get("bandwidth")
    lines = [(f"throughput on {args.threads} CPU thread(s); toy model {args.model} at completion length {args.length}; "
              f"matmul model: random Qwen3 (composer/bench/fair.py MATMUL_MODEL) at length {args.matmul_length}, "
              f"{args.matmul_prompts} prompts x {args.matmul_group}; forced lengths, matched rows; gradient "
              f"checkpointing {args.checkpointing} on both sides; training precision "
              f"{getattr(args, 'precision', '32-true')} on both sides; the same data in the same order on both sides; "
              f"{args.rounds} rounds x {args.steps} steps, each side's first step (FLOP-counted) and {args.warmup} "
              f"warm-up step(s) untimed; ours timed as whole lightning.Trainer steps, TRL as whole HF Trainer steps"
              + (f"; host matmul peak {peak:.0f} GFLOPS ({host['matmul_peak'].get('dtype', 'float32')} "
                 f"{host['matmul_peak']['shape']}^3, " + (
                     f"faster of MKL {host['matmul_peak']['mkl']:.0f} / oneDNN {host['matmul_peak']['onednn']:.0f})"
                     if host['matmul_peak']['onednn'] else "ATen's product; oneDNN's float32 linear not probed)")
                 if peak else "")
              + (f"; memory-read bandwidth {bw['gbs']:.1f} GB/s (sum of a {bw['mib']} MiB float32 buffer)"
                 if bw else ""))]

    def f(r, k, d=1):
        return f"{r[k]:.{d}f}" if r.get(k) is not None else "-"

    def share(r, side):  # a side's own FLOPs over its own time, over the peak
        g = r.get(f"{side}_gflops")
        return f"{100 * g / peak:.0f}%" if g and peak else "-"

    def gflop(r, side):
        st, gen = r.get(f"{side}_step_flops"), r.get(f"{side}_generation_flops")
        if not st:
            return "-"
        return f"{st / 1e9:.3g}" + (f" ({gen / 1e9:.3g})" if gen else "")

    def over(r, side):
        x = r.get(f"{side}_over_bound")
        return f"{x:.2f}x" if x else "-"

    groups = list(dict.fromkeys((r.get("size", "toy"), r.get("linear", "onednn"), r.get("mode", "matched"))
                                for r in results))
    for size, linear, mode in groups:
        group = [r for r in results if (r.get("size", "toy"), r.get("linear", "onednn"), r.get("mode", "matched"))
                 == (size, linear, mode)]
        header = (f"{'pair':6s} {'ours vs TRL':26s} {'rows/step':>9s} {'ours samp/s':>12s} {'TRL samp/s':>11s} "
                  f"{'ours tok/s':>11s} {'TRL tok/s':>10s} {'ratio':>6s} {'median':>7s} {'peak% ours/TRL':>15s}  "
                  "per-round ratios (min-max)")
        lines += ["", f"{size} model, linear backend {linear} on both sides, {mode}: {MODE_TITLE[mode]}", header]
        for r in group:
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
            med = f"{r['median_round_ratio']:.2f}x" if r.get("median_round_ratio") else "-"
            rr = r.get("round_ratios", [])
            spread = f"{' '.join(f'{x:.2f}' for x in rr)}  ({min(rr):.2f}-{max(rr):.2f})" if rr else ""
            lines.append(f"{r['pair']:6s} {SPECS[r['pair']] + ' vs ' + r['trl']:26s} {r['rows_per_step']:>9d} "
                         f"{f(r, 'ours_samples_per_s'):>12s} {f(r, 'trl_samples_per_s'):>11s} "
                         f"{f(r, 'ours_tokens_per_s', 0):>11s} {f(r, 'trl_tokens_per_s', 0):>10s} {ratio:>6s} "
                         f"{med:>7s} {share(r, 'ours') + ' / ' + share(r, 'trl'):>15s}  {spread}")
        if any(r.get("ours_step_flops") or r.get("trl_step_flops") for r in group):
            lines += ["", ("  each side's own work per step (GFLOP of matrix products, counted on its first step; "
                           "in brackets: inside generation), its own peak share, and the step at the host's floor"),
                      (f"  {'pair':6s} {'ours ms':>8s} {'TRL ms':>8s} {'ours GFLOP':>14s} {'TRL GFLOP':>14s} "
                       f"{'peak% ours/TRL':>15s} {'bound ms (train + gen)':>24s} {'ours/bound':>10s} "
                       f"{'TRL/bound':>9s}")]
            for r in group:
                b = r.get("bound") or {}
                bound = (f"{b['ms']:.4g} ({b['train_ms']:.4g} + {b['generation_ms']:.3g})" if b else "-")
                lines.append(f"  {r['pair']:6s} {f(r, 'ours_ms_per_step', 0):>8s} {f(r, 'trl_ms_per_step', 0):>8s} "
                             f"{gflop(r, 'ours'):>14s} {gflop(r, 'trl'):>14s} "
                             f"{share(r, 'ours') + ' / ' + share(r, 'trl'):>15s} {bound:>24s} "
                             f"{over(r, 'ours'):>10s} {over(r, 'trl'):>9s}")
    lines.append("")
    for pair in dict.fromkeys(r["pair"] for r in results):
        ours_work, trl_work = WORK[pair]
        padding = {r.get("trl_sft_padding") for r in results if r["pair"] == "sft"} - {None}
        if pair == "sft" and padding != {"free"}:
            trl_work = (f"padding_free=False (--trl-sft-padding {getattr(args, 'trl_sft_padding', 'auto')}; SDPA "
                        "would attend over the whole flattened sequence): every row padded to the batch's longest"
                        + (" (padding-free in some rows of the table)" if "free" in padding else ""))
        if pair == "grpo" and getattr(args, "trl_continuous_batching", False):
            trl_work = ("generation by transformers' continuous batching (paged KV cache, shared prompt blocks), "
                        "training forwards on the padded grid")
        lines.append(f"{pair}: the work each side does: ours: {ours_work}; TRL {TRL_NAME[pair]}: {trl_work}")
    lines.append("the bound (composer/bench/fair.py bound_ms): the fewer training FLOPs of the two sides at the "
                 "measured matmul peak, plus generation at the slower of its fewer FLOPs at the peak and the "
                 "policy's weights streamed once per completion position at the measured bandwidth; side/bound: "
                 "that side's ms per step over it")
    lines.append("")
    for r in results:
        tag = f"{r['pair']} ({r.get('size', 'toy')}, {r.get('linear', 'onednn')}, {r.get('mode', 'matched')})"
        mode = r.get("mode", "matched")
        if r.get("settings_ours") or r.get("settings_trl"):
            lines.append(format_settings(r.get("settings_ours"), r.get("settings_trl"), tag))
            if r.get("settings_differ"):
                lines.append(f"  differ: {', '.join(r['settings_differ'])}"
                             + (" (TRL's defaults: by design)" if mode == "defaults" else " (refused)"))
    for r in results:
        mode = r.get("mode", "matched")
        tag = f"{r['pair']} ({r.get('size', 'toy')}, {r.get('linear', 'onednn')}, {mode})"
        if r.get("ratio"):
            verdict = "meets" if r["ratio"] >= TARGET[mode] else "below"
            lines.append(f"{tag}: ours/TRL = {r['ratio']:.2f} over all rounds, median round "
                         f"{r['median_round_ratio']:.2f} ({verdict} the {TARGET[mode]}x target)")
        if r.get("ours_gflops") or r.get("trl_gflops"):
            lines.append(f"{tag}: each on its own FLOPs per step: ours {gflop(r, 'ours')} GFLOP at "
                         f"{f(r, 'ours_gflops')} GFLOPS, TRL {gflop(r, 'trl')} GFLOP at {f(r, 'trl_gflops')} GFLOPS"
                         + (f" = {share(r, 'ours')} / {share(r, 'trl')} of the host's measured peak" if peak else ""))
        b = r.get("bound")
        if b:
            gen = (f"; generation {b['generation_ms']:.1f} ms: {b['generation_compute_ms']:.1f} ms of compute, "
                   f"{b['decode_stream_ms']:.1f} ms to stream {(b.get('weight_bytes') or 0) / 1e6:.1f} MB of weights "
                   f"x {b['decode_positions']} positions at {b.get('bandwidth_gbs') or 0:.1f} GB/s"
                   if b.get("decode_positions") else "")
            lines.append(f"{tag}: at the host's floor the step takes {b['ms']:.1f} ms (training {b['train_ms']:.1f} "
                         f"ms at {b['peak_gflops']:.0f} GFLOPS{gen}); ours {over(r, 'ours')}, TRL {over(r, 'trl')} "
                         "of it")
        mm = r.get("ours_mismatch")
        base = next((x.get("ours_mismatch") for x in results if x.get("mode", "matched") == "matched" and x is not r
                     and (x["pair"], x.get("size"), x.get("linear")) == (r["pair"], r.get("size"), r.get("linear"))
                     and x.get("ours_mismatch")), None) if mode != "matched" else None
        if mm:
            lines.append(f"{tag}: our sampler against our trainer (mismatch/*, timed steps): kl {mm.get('kl', 0):.2e}, "
                         f"rho {mm.get('rho_min', 0):.4f}-{mm.get('rho_max', 0):.4f} (mean {mm.get('rho_mean', 0):.4f}), "
                         f"max |log-ratio| {mm.get('abs_max', 0):.2e}"
                         + (f" (the matched row's, fp32 rollouts: kl {base.get('kl', 0):.2e}, max |log-ratio| "
                            f"{base.get('abs_max', 0):.2e})" if base else "")
                         + "; settings row 'rollout precision': ours "
                         f"{(r.get('settings_ours') or {}).get('rollout precision', '-')}, TRL "
                         f"{(r.get('settings_trl') or {}).get('rollout precision', '-')}")
        if r.get("ours_compiled_graphs") is not None:
            lines.append(f"{tag}: torch.compile built {r['ours_compiled_graphs']} graph(s) for our side, "
                         f"{r['ours_graphs_in_rounds']} of them inside timed rounds (recompiles); loading + first "
                         f"step {r.get('ours_first_step_s', 0):.0f} s")
        if r.get("ours_mean_response_tokens") is not None and mode == "defaults":
            lines.append(f"{tag}: our mean response {r['ours_mean_response_tokens']:.1f} tokens "
                         "(stops at EOS on both sides)")
        if r.get("ours_error"):
            lines.append(f"{tag}: ours did not run: {r['ours_error']}")
        if r.get("trl_error"):
            lines.append(f"{tag}: TRL did not run: {r['trl_error']}")
    for r in results:
        ph = r.get("ours_phases_ms")
        if ph:
            total = ph.get("total", 0.0)
            parts = [f"{k} {v:.0f}" for k, v in ph.items() if k != "total"]
            lines.append(f"{r['pair']} ({r.get('size', 'toy')}, {r.get('mode', 'matched')}) ours, ms per step "
                         f"(nested: collect holds engine.* and initial_logprobs): whole Lightning step {total:.0f}; "
                         + ", ".join(parts))
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="throughput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Policy checkpoint directory (default: the toy student, bootstrapped if missing).")
    p.add_argument("--teacher", help="Teacher checkpoint directory for opd/GKD (default: the toy teacher).")
    p.add_argument("--pairs", default="grpo,opd,sft",
                   help="Comma-separated subset of grpo,opd,sft ('' for none: e.g. only --sweep).")
    p.add_argument("--guided", type=int, default=5, metavar="REPEATS",
                   help="Also measure guided (specs/mintrl.yaml) vs plain rollouts per token, this many interleaved "
                        "repeats (0: skip).")
    p.add_argument("--modes", default="matched,defaults",
                   help="Comparisons: matched (equal work, forced length), compiled (the same with our "
                        "train.compile: true and TRL's torch_compile), rollout-bf16 (compiled, rollouts in bf16 on "
                        "both sides: ours rollout.precision bf16, TRL generating under bf16 autocast; grpo and opd) "
                        "and/or defaults (TRL's default config for the same spec; grpo and sft only).")
    p.add_argument("--sweep", action="store_true",
                   help="After the table: how a GRPO step's cost grows with group size, response length and "
                        "prompts per step, ours and TRL (CSV + PNG under --out).")
    p.add_argument("--out", help="Folder for the sweep's CSV and PNG (default runs/throughput-sweep-<time>).")
    p.add_argument("--sweep-passes", type=int, default=2,
                   help="Passes over all sweep points, one after the other (each point's rounds pooled).")
    p.add_argument("--sweep-rounds", type=int, default=2,
                   help="Timed blocks per side at each sweep point (the CSV and plot keep each side's fastest).")
    p.add_argument("--sweep-axes", default=SWEEP_AXES,
                   help="The sweep's points: axis=v1,v2;... over group, length, prompts; the other axes stay at "
                        "--group (default 8), --length and --prompts (default 2).")
    p.add_argument("--sampler", choices=("hf", "fast"), default="hf",
                   help="Our rollout sampler: the hf engine as runs use it (hf: the KV-cache sampler, keeping its "
                        "log-probs), or fast: the same sampler with its log-probs re-scored by a forward pass.")
    p.add_argument("--compile", action="store_true",
                   help="Run ours with train.compile: true (torch.compile of the policy and initial-policy forwards; compiling takes "
                        "minutes and happens in the untimed warm-up).")
    p.add_argument("--trl-compile", action="store_true",
                   help="TRL's side with TrainingArguments.torch_compile (compare with --compile on ours).")
    p.add_argument("--trl-continuous-batching", action="store_true",
                   help="TRL's GRPO generating with transformers' continuous batching (use_transformers_continuous_"
                        "batching: padding-free, prompt blocks shared, as our sampler); off by default: its CPU "
                        "scheduler is far slower than generate here.")
    p.add_argument("--trl-sft-padding", choices=("auto", "free", "padded"), default="auto",
                   help="TRL's SFT rows: free (padding_free=True, the rows flattened into one sequence; with SDPA, as "
                        "on CPU, its attention spans the whole flattened sequence under a block mask: more work than "
                        "padding), padded (padding_free=False), or auto: free where the model attends with "
                        "flash-attention (per-row varlen kernels), else padded. Each side's counted FLOPs are in the "
                        "table either way.")
    p.add_argument("--length", type=int, default=32, help="Completion length, forced on both sides (toy size).")
    p.add_argument("--sizes", default="toy,matmul",
                   help="Model sizes: toy (the toy student, --model) and/or matmul (a random-weight Qwen3 of ~26M "
                        "parameters built here, composer/bench/fair.py MATMUL_MODEL, at --matmul-length).")
    p.add_argument("--matmul-length", type=int, default=128,
                   help="The matmul size's forced completion length (and its SFT rows' length), 128-512.")
    p.add_argument("--matmul-prompts", type=int, default=2, help="The matmul size's prompts per step.")
    p.add_argument("--matmul-group", type=int, default=4, help="The matmul size's samples per prompt.")
    p.add_argument("--linear", default="onednn",
                   help="Linear backend of BOTH sides: onednn (composer/runtime/onednn.py, TRL's models converted "
                        "too), mkl (oneDNN off on ours), or mkl,onednn to measure both.")
    p.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true",
                   help="Training precision of BOTH sides: 32-true (float32), or bf16-mixed (ours: train.precision "
                        "bf16-mixed, Lightning's precision plugin; TRL: bf16=True, accelerate's autocast); the "
                        "peak share and the bound then use the host's bfloat16 matmul peak.")
    p.add_argument("--checkpointing", choices=("off", "on"), default="off",
                   help="Gradient checkpointing on both sides (matched and compiled; TRL's defaults row keeps "
                        "TRL's own default, on).")
    p.add_argument("--prompts", type=int, default=None, help="Prompts per step (default: the spec's).")
    p.add_argument("--group", type=int, default=None, help="Samples per prompt (default: the spec's).")
    p.add_argument("--warmup", type=int, default=1, help="Warm-up steps per side, not timed.")
    p.add_argument("--steps", type=int, default=1, help="Steps per timed block.")
    p.add_argument("--rounds", type=int, default=None, help="Timed blocks per side (interleaved; default 6).")
    p.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)), help="torch CPU threads.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", help="Extra spec override path=value for our side (repeatable).")
    p.add_argument("--json", help="Also write the results as JSON here.")
    p.add_argument("--profile", action="store_true",
                   help="Instead of comparing, profile our step for each pair (phase wall time vs ATen time).")
    p.add_argument("--matmul", action="store_true",
                   help="Instead of comparing, time float32 products at the toy step's shapes through MKL "
                        "(F.linear) and oneDNN (composer/runtime/onednn.py), forward and both backward products.")
    p.add_argument("--debug", action="store_true", help="Raise TRL errors instead of reporting them.")
    return p.parse_args(argv)


def _size_args(args, size: str, built: str):
    """The bench's arguments at one model size: toy as given; matmul with the locally built random Qwen3
    (policy and, for opd, a teacher of another seed), its length, prompts and group."""
    import copy

    a = copy.copy(args)
    a.size = size
    if size == "matmul":
        from composer.bench.fair import matmul_checkpoint, n_params

        a.model = matmul_checkpoint(os.path.join(built, "policy"), seed=0)
        a.teacher = matmul_checkpoint(os.path.join(built, "teacher"), seed=1)
        a.length, a.prompts, a.group = args.matmul_length, args.matmul_prompts, args.matmul_group
        a.sft_chars = args.matmul_length
        a.params = n_params(a.model)
    return a


def quiet() -> None:
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in ("trl", "accelerate", "lightning", "lightning.pytorch", "lightning.fabric", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
    except Exception:
        pass


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.rounds = args.rounds or 6
    import torch

    torch.set_num_threads(args.threads)
    quiet()
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    bad = [p for p in pairs if p not in SPECS]
    if bad:
        print(f"unknown pair(s) {', '.join(bad)}; choose from {', '.join(SPECS)}", file=sys.stderr)
        return 2
    if args.matmul:  # no model: no toy bootstrap
        print(format_host(host_info(args.threads)))
        print(matmul_table(args.threads, MATMUL_SHAPES))
        print(decode_stream_table(args.threads))
        return 0
    if not args.model or ("opd" in pairs and not args.teacher):
        from components.tasks.bootstrap import ensure_checkpoints

        paths = ensure_checkpoints()
        args.model = args.model or paths["student"]
        args.teacher = args.teacher or paths["teacher"]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if [m for m in modes if m not in MODES]:
        print(f"unknown mode(s) in {args.modes!r}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
    linears = [x.strip() for x in args.linear.split(",") if x.strip()]
    from composer.bench import fair

    if [x for x in sizes if x not in ("toy", "matmul")] or [x for x in linears if x not in fair.LINEARS]:
        print(f"--sizes {args.sizes!r} / --linear {args.linear!r}: choose sizes from toy, matmul and linear backends "
              f"from {', '.join(fair.LINEARS)}", file=sys.stderr)
        return 2
    if args.profile:  # at each size of --sizes (the matmul size's checkpoint built as for the comparison)
        with tempfile.TemporaryDirectory(prefix="bench-matmul-") as built:
            for size in sizes:
                a = _size_args(args, size, built)
                for pair in pairs:
                    print(f"[{size}]", profile_ours(pair, a), flush=True)
        return 0
    if args.checkpointing == "on":
        args.override = list(args.override or []) + ["policy.gradient_checkpointing=true"]
    results = []
    args.flops_cache = {}  # each side's counted step per (size, pair, work), shared by the sizes' copies of args
    # the host's floor, measured before the pairs (the bound in the table): matmul peak in the training
    # precision's dtype, memory-read bandwidth
    peak = fair.peak_gflops(args.threads, dtype="bfloat16" if args.precision == "bf16-mixed" else "float32")
    bw = fair.bandwidth_gbs(args.threads)
    args.floor = {"matmul_peak": peak, "bandwidth_probe": bw, "peak": peak["peak"], "bandwidth": bw["gbs"]}
    with tempfile.TemporaryDirectory(prefix="bench-matmul-") as built:
        for size in sizes:
            a = _size_args(args, size, built)
            for linear in linears:
                a.linear = linear
                for mode in modes:
                    for pair in pairs:
                        if mode == "defaults" and pair == "opd":
                            continue  # GKD's defaults are another method (mixed on/off-policy data)
                        if mode == "rollout-bf16" and pair == "sft":
                            continue  # no rollouts
                        print(f"[bench] {size} {pair} ({mode}, {linear}): ours ({SPECS[pair]}) vs TRL "
                              f"{TRL_NAME[pair]} ...", flush=True)
                        results.append(run_pair(pair, a, mode))
    host = host_info(args.threads)
    host["matmul_peak"], host["bandwidth"] = args.floor["matmul_peak"], args.floor["bandwidth_probe"]
    text = format_host(host) + "\n" + (format_results(results, args, host) if results else "")
    guided = None
    if args.guided:
        print(f"[bench] guided vs plain rollouts ({GUIDED_SPEC}) ...", flush=True)
        try:
            guided = guided_overhead(args.model, repeats=args.guided, seed=args.seed)
            text += ("\n" if text else "") + format_guided(guided)
        except Exception as e:  # reported; the exit status says so
            guided = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            text += f"\nguided rollouts did not run: {guided['error']}"
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("flops_cache", "floor")}, "host": host,
                                               "results": results, "guided": guided}, indent=2, default=str))
    failed = [f"{r['pair']}{'' if r['mode'] == 'matched' else ' (' + r['mode'] + ')'} {side}: {r[side + '_error']}" for r in results for side in ("ours", "trl")
              if r.get(side + "_error") or (side == "ours" and not r.get("ours_block_s"))
              or (side == "trl" and not r.get("trl_block_s"))]
    if guided and guided.get("error"):
        failed.append(f"guided: {guided['error']}")
    for f in failed:
        print(f"[bench] a side did not run: {f}", file=sys.stderr)
    if args.sweep:
        code = run_sweep(args)
        return 1 if failed else code
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
