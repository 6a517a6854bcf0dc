"""A LightningModule that executes the Plan: rollout -> signals -> objectives, composed from the registry.

The Trainer owns devices, precision, strategy, gradient clipping, checkpointing and loggers; this
module owns the step. It never names a method: segments (phases, stages) swap the resolved spec,
and every component does its own part through the run context.
"""

from __future__ import annotations

import math
import random

import lightning as L
import torch
from torch.utils.data import Dataset

from composer.batch import to_device
from composer.runtime import step as run_step
from composer.runtime.context import RunContext
from composer.runtime.engine import make_engine
from composer.runtime.evaluate import evaluate


class NonFiniteError(RuntimeError):
    pass


class _Steps(Dataset):
    """The data loader only counts steps: prompts are drawn by the run context (exactly resumable)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class ComposerModule(L.LightningModule):
    def __init__(self, validated, task, tokenizer, policy):
        super().__init__()
        self.validated = validated
        self.segments = validated.segments
        self.task = task
        self.tokenizer = tokenizer
        self.policy = policy
        self.ctx: RunContext | None = None
        self.last_eval: dict[str, float] = {}
        self.total_steps = validated.total_steps
        self.stopped_by: str | None = None
        self.start_metrics: dict[str, float] = {}

    # ---- setup ----
    def segment_at(self, step: int):
        for seg in self.segments:
            if seg.start <= step < seg.end:
                return seg
        return self.segments[-1]

    def setup(self, stage: str) -> None:
        if self.ctx is not None:
            return
        seg = self.segments[0]
        spec = seg.spec
        self.policy.train()
        engine = make_engine(spec.rollout.engine, self.policy, self.tokenizer, spec.rollout)
        seed = spec.train.seed + 1000 * self.global_rank
        self.ctx = RunContext(task=self.task, tokenizer=self.tokenizer, policy=self.policy, engine=engine, spec=spec,
                              segment=seg.name, seed=seed, rng=random.Random(seed))
        if any(_needs_initial(s.spec) for s in self.segments):
            self.ctx.initial_policy()
        for s in self.segments:  # checks that must fail before any training (e.g. teacher tokenizers)
            for name, cfg in s.spec.sources.items():
                if hasattr(cfg, "preflight"):
                    cfg.preflight(self.ctx, name)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Steps(self.total_steps), batch_size=None, shuffle=False)

    def configure_optimizers(self):
        t = self.segments[0].spec.train
        return torch.optim.AdamW(self.policy.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)

    # ---- the step ----
    def _enter(self, step: int) -> None:
        seg = self.segment_at(step)
        ctx = self.ctx
        ctx.step = step
        if seg.name != ctx.segment:
            ctx.segment, ctx.spec = seg.name, seg.spec
        t = ctx.spec.train
        local = step - seg.start
        factor = min(1.0, (local + 1) / t.warmup_steps) if t.warmup_steps else 1.0
        if t.lr_schedule == "cosine":
            span = max(seg.end - seg.start - t.warmup_steps, 1)
            frac = min(max(local - t.warmup_steps, 0) / span, 1.0)
            factor *= 0.5 * (1 + math.cos(math.pi * frac))
        for group in self.optimizers().param_groups:
            group["lr"] = t.lr * factor

    def training_step(self, batch_idx, _):
        step = self.global_step
        self._enter(step)
        ctx = self.ctx
        ctx.metrics = {}
        every = ctx.spec.train.eval_every
        if every and step % every == 0:  # pass@1 of the policy after `step` updates, in this step's row
            self.last_eval = evaluate(ctx, self.policy)
            metrics_eval = dict(self.last_eval)
        else:
            metrics_eval = {}
        examples = ctx.next_prompts(ctx.spec.train.prompts_per_step)
        batches = run_step.collect(ctx, [e for e in examples])
        batches = to_device(batches, self.device)
        loss, metrics = run_step.loss(ctx, ctx.forward_model(self.policy), batches)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"the loss is not finite at step {step} ({float(loss.detach())})")
        metrics.update(ctx.metrics)
        metrics.update(self.start_metrics)
        metrics.update({f"cost/{k}": float(v) for k, v in ctx.costs.items()})  # cumulative, for compute matching
        metrics.update(metrics_eval)
        metrics["loss"] = float(loss.detach())
        metrics["lr"] = self.optimizers().param_groups[0]["lr"]
        if metrics_eval:
            metrics["pass@1"] = metrics_eval[sorted(metrics_eval)[len(metrics_eval) // 2]]
        # Straight to the loggers: Lightning's result collection would repeat a key logged in an earlier
        # step (a guide metric, an evaluation) into rows where it was not measured.
        row = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for lg in self.loggers:
            lg.log_metrics(row, step=step)
        shown = {k: row[k] for k in ("reward_mean", "tokens_per_s", "pass@1") if k in row}
        self.log_dict(shown, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        for p in self.policy.parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                raise NonFiniteError(f"a gradient is not finite at step {self.global_step}")

    def after_step(self) -> None:
        """After every optimiser step: EMA teachers, the sync schedule, evaluation.

        Called by the AfterStep callback, which Lightning runs before ModelCheckpoint saves,
        so that a checkpoint of step N holds the state after all of step N's bookkeeping.
        """
        ctx = self.ctx
        done = self.global_step  # optimizer steps taken so far
        for rt in list(ctx.runtimes.values()):
            hook = getattr(rt, "after_optimizer_step", None)
            if hook is not None:
                hook(ctx)
        if done % ctx.spec.sync.every == 0:
            ctx.engine.sync(self.policy, done)
            on_sync = getattr(ctx.spec.rollout.guide, "on_sync", None)
            if on_sync:
                on_sync(ctx)

    def final_evaluation(self, loggers) -> None:
        """The final evaluation gets a row of its own, at step = total steps, after every step's row."""
        self.last_eval = evaluate(self.ctx, self.policy)
        for lg in loggers:
            lg.log_metrics(self.last_eval, step=self.global_step)
            lg.save()

    # ---- checkpoints hold what continuing exactly needs ----
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Tensors and plain data only (the file is read back with weights_only=True); the rollout buffer's
        batches become tagged dicts, and the resolved spec is recorded so --resume can refuse another one."""
        from composer.backends.lightning.checkpoint import spec_record, to_plain

        ctx = self.ctx
        state = {
            "rollout_weights": ctx.engine.model.state_dict() if hasattr(ctx.engine, "model") else None,
            "last_sync": getattr(ctx.engine, "last_sync", 0),
            "rng": ctx.rng.getstate(), "torch_rng": torch.get_rng_state(), "data_pos": ctx.data_pos,
            "segment": ctx.segment, "initial": ctx._initial.state_dict() if ctx._initial is not None else None,
            "runtimes": {repr(k): rt.state_dict() for k, rt in ctx.runtimes.items() if hasattr(rt, "state_dict")
                         and not isinstance(rt, torch.nn.Module)},
            "costs": dict(ctx.costs),
            "buffer": to_device(ctx.buffer, "cpu") if ctx.buffer else None,
            "buffer_version": ctx.buffer_version,
        }
        checkpoint["composer"] = to_plain(state, "composer")
        checkpoint["composer"]["spec"] = spec_record(self.validated)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from composer.backends.lightning.checkpoint import from_plain

        self._pending = from_plain(checkpoint.get("composer"))

    def on_train_start(self) -> None:
        state = getattr(self, "_pending", None)
        if not state:
            return
        ctx = self.ctx
        if state["rollout_weights"] is not None and hasattr(ctx.engine, "model"):
            ctx.engine.model.load_state_dict(state["rollout_weights"])
        ctx.engine.last_sync = state["last_sync"]
        rng = state["rng"]  # random.setstate wants (version, tuple of ints, gauss)
        ctx.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        torch.set_rng_state(state["torch_rng"])
        ctx.data_pos = state["data_pos"]
        if state["initial"] is not None:
            ctx.initial_policy().load_state_dict(state["initial"])
        ctx.costs.update(state.get("costs", {}))
        ctx.buffer = to_device(state["buffer"], self.device) if state.get("buffer") else None
        ctx.buffer_version = state.get("buffer_version", -1)
        ctx.pending_runtime_state = state.get("runtimes", {})
        self._pending = None


def _needs_initial(spec) -> bool:
    if any(getattr(obj, "wants_initial", False) for _n, _s, obj, _w in run_step.terms(spec)):
        return True
    return any(getattr(s, "weights", "") == "initial" for s in spec.sources.values())
