"""A LightningModule that executes the Plan: rollout -> signals -> objectives, composed from the registry.

The Trainer owns devices, precision, strategy, gradient clipping, checkpointing and loggers; this
module owns the step. It never names a method: segments (phases, stages) swap the resolved spec,
and every component does its own part through the run context.
"""

from __future__ import annotations

import random
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import Dataset

from composer import step as run_step
from composer.batch import to_device
from composer.plan.plan import Plan
from composer.contract import Runtime
from composer.runtime.context import RunContext
from composer.runtime.critic import step_heads, train_critics, with_critic_values
from composer.runtime.engine import make_engine
from composer.runtime import models  # by module: a patched policy_view (tests/mutations.py) is the one that runs
from composer.runtime.report import metric_row
from composer.runtime import vacuous
from composer.runtime.reward_watch import RewardWatch
from composer.runtime.evaluate import evaluate, write_records


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
    """Executes the compiled Plan (plan.json): its segments, each with its resolved spec."""

    def __init__(self, plan: dict, task, tokenizer, policy, recorder=None, validated=None):
        super().__init__()
        self.validated = validated  # recorded in checkpoints, so --resume can refuse another spec
        self.plan = Plan(plan)  # `plan.at(step)`: the segment, every number resolved at the step, syncs, LR, weights
        self.segments = self.plan.segments
        self.recorder = recorder
        self.task = task
        self.tokenizer = tokenizer
        self.policy = policy
        self.ctx: RunContext | None = None
        self.last_eval: dict[str, float] = {}
        self.total_steps = plan["total_steps"]
        self.stopped_by: str | None = None
        self.start_metrics: dict[str, float] = {}
        # a segment that trained on nothing (composer/runtime/vacuous.py): counted per segment, said at its end;
        # strict (`composer run --strict`): an error that stops the run there
        self.strict = False
        self.tally = None
        self._fingerprint = None
        self.vacuous_error: str | None = None
        self.reward_watch = RewardWatch()  # warns after training of a segment whose verifier read nothing
        # Several optimizer steps per rollout batch (train.epochs x train.mini_batches) step the optimizer by hand;
        # a run whose every segment makes one update per step keeps Lightning's automatic optimization as it was.
        # A frozen policy (train.freeze_policy) takes the manual path too: its steps count without an optimizer step.
        self.automatic_optimization = all(s.spec.train.epochs * s.spec.train.mini_batches == 1
                                          and not s.spec.train.freeze_policy for s in self.segments)

    # ---- setup ----
    def segment_at(self, step: int):
        return self.plan.segment_at(step)

    def setup(self, stage: str) -> None:
        if self.ctx is not None:
            return
        seg = self.segments[0]
        spec = seg.spec
        self.policy.train()
        engine = make_engine(spec.rollout.engine, self.policy, self.tokenizer, spec.rollout, spec.train.compile)
        seed = spec.train.seed  # the same data stream on every rank: each takes its slice (next_prompts)
        self.ctx = RunContext(task=self.task, tokenizer=self.tokenizer, policy=self.policy, engine=engine, spec=spec,
                              segment="", seed=seed, rng=random.Random(seed), recorder=self.recorder,
                              run_dir=Path(self.trainer.default_root_dir) if self._trainer is not None else None,
                              rank=self.global_rank, world=self.trainer.world_size if self._trainer is not None else 1)
        if any(_needs_initial(s.spec) for s in self.segments):
            self.ctx.initial_policy()
        for s in self.segments:  # checks that must fail before any training (tokenizers, context placement)
            self.ctx.spec = s.spec
            for name, cfg in s.spec.sources.items():
                cfg.preflight(self.ctx, name)
            s.spec.rollout.guide.preflight(self.ctx)
            s.spec.rollout.environment.preflight(self.ctx)  # a tool's sandbox
            for term in self.plan.at(s.start).terms:
                term.signal.preflight(self.ctx)
        self.ctx.spec = spec

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Steps(self.total_steps), batch_size=None, shuffle=False)

    def configure_optimizers(self):
        """AdamW at unit base LR under torch's LambdaLR, whose factor is the Plan's LR of the step (warm-up and
        decay per segment, composer/plan/schedule.py): the scheduler's state is checkpointed with the optimiser."""
        t = self.segments[0].spec.train
        params = list(self.policy.parameters())
        # torch's fused AdamW (one kernel over all tensors; CPU and CUDA) does the per-tensor loop's arithmetic
        # in a third of its time on the toy student (1.1 vs 2.9 ms with the clip, one thread). Not under
        # Lightning's mixed precision, which refuses to clip the gradients of an optimiser that unscales them
        precision = str(getattr(self._trainer, "precision", "32-true"))
        fused = (precision in ("32-true", "32", "64-true", "64")
                 and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)) or None
        opt = torch.optim.AdamW(params, lr=1.0, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=fused)
        plan = self.plan
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: plan.at(step).lr)  # a function: not pickled
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """The gradient-norm clip of the segment in force (train.grad_clip; 0 disables)."""
        clip = self.ctx.spec.train.grad_clip
        if clip:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")

    # ---- the step ----
    def _enter(self, step: int, optimizer):
        """Make the segment of `step` the one in force: its spec, its optimiser settings from this step on
        (the LR is the scheduler's, from the Plan), where the Plan moves the frozen initial weights (a
        stage's start with train.reference: stage_start, a periodic reset) a fresh copy of them, and where it
        resets the optimizer state (train.optimizer_at_stage: reset, train.reset_every) fresh AdamW moments.
        Returns the Plan at `step`."""
        at = self.plan.at(step)
        seg = at.segment
        ctx = self.ctx
        ctx.step = step
        ctx.segment_start, ctx.segment_end = seg.start, seg.end
        first = ctx.segment == ""
        if seg.name != ctx.segment:
            ctx.segment, ctx.spec = seg.name, seg.spec
            ctx.record("segment", name=seg.name, start=seg.start, end=seg.end)
            for term in at.terms:
                term.signal.start(ctx)
        # a stage's start (train.reference: stage_start) or a periodic reset (train.reset_every): the Plan's
        # versions, so a run resumed at such a step does the same as an uninterrupted one
        if not first and at.reference_moved:
            ctx.models.refresh_initial()
            ctx.record("reference_reset")
        if at.optimizer_reset:  # train.optimizer_at_stage: reset, or train.reset_every
            getattr(optimizer, "optimizer", optimizer).state.clear()  # AdamW re-creates moments and step count
            ctx.record("optimizer_reset")
        if at.critic_reset:  # train.critic_at_stage: reset: every critic starts afresh when next used
            ctx.reset_critics()
            ctx.record("critic_reset")
        t = ctx.spec.train
        for group in optimizer.param_groups:
            group.update(betas=tuple(t.betas), weight_decay=t.weight_decay)
        return at

    def step_loss(self, step: int, optimizer) -> tuple[torch.Tensor, dict]:
        """The loss of global step `step` and its metrics: the segment in force, evaluation when due, the
        prompts, rollouts and signals (`composer.step.collect`), the terms' loss (`composer.step.loss`). Everything
        of a step but the optimiser's part, which the Trainer does (and `composer bench --throughput` without one)."""
        self.ctx.metrics = {}  # before _enter: a segment's start logs into its first step's row
        at = self._enter(step, optimizer)
        ctx = self.ctx
        every = ctx.spec.train.eval_every
        if every and step % every == 0:  # pass@1 of the policy after `step` updates, in this step's row
            self.last_eval = self._evaluate(step)
            metrics_eval = dict(self.last_eval)
        else:
            metrics_eval = {}
        examples = ctx.next_prompts(ctx.spec.train.prompts_per_step)
        batches = run_step.collect(ctx, at, [e for e in examples])
        truncation = mark_truncated(batches, ctx.stop_ids)
        batches = to_device(batches, self.device)
        lr = optimizer.param_groups[0]["lr"]  # this step's (the manual path steps the scheduler inside _updates)
        if at.policy_frozen:  # train.freeze_policy: no policy loss, no policy update; the critics learn below
            loss, metrics = self._frozen(at, batches)
        elif self.automatic_optimization:
            loss, metrics = self._loss(at, ctx.forward_model(self.policy), batches)
            self._check_finite(loss, step)
        else:
            loss, metrics = self._updates(at, batches, step)
        metrics.update(train_critics(ctx, batches))  # a critic with its own network: its value updates (ppo)
        metrics.update(ctx.metrics)
        metrics.update(self.start_metrics)
        metrics.update({f"cost/{k}": float(v) for k, v in ctx.costs.items()})  # cumulative, for compute matching
        metrics.update(metrics_eval)
        metrics.update(truncation)
        metrics["loss"] = float(loss.detach())
        metrics["lr"] = lr
        metrics["_eval"] = metrics_eval  # the training step shows the middle tier's pass@1; dropped before logging
        metrics["_batches"] = batches  # for callers that count rows and tokens; dropped before logging
        return loss, metrics

    def training_step(self, batch_idx, _):
        step = self.global_step
        seg = self.segment_at(step)
        if self.tally is None or self.tally.segment != seg.name:  # before the step's update: the weights it starts from
            self.tally = vacuous.Tally(seg.name, seg.start, seg.end)
            self._fingerprint = vacuous.fingerprint(self.policy)
        loss, metrics = self.step_loss(step, self.optimizers())
        self.reward_watch.note(self.ctx.segment, metrics.pop("_batches"))
        metrics_eval = metrics.pop("_eval")
        # Straight to the loggers: Lightning's result collection would repeat a key logged in an earlier
        # step (a guide metric, an evaluation) into rows where it was not measured. One name per metric in
        # every logger (report.metric_name: pass@1/eval -> pass_at_1/eval).
        row = self._reduced(metric_row({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}))
        for lg in self.loggers:
            lg.log_metrics(row, step=step)
        shown = {k: row[k] for k in ("reward_mean", "tokens_per_s") if k in row}
        if shown_pass_at_1(metrics_eval) is not None:  # the progress bar's pass@1 (never logged: pass_at_1/<tier> are)
            shown["pass@1"] = shown_pass_at_1(metrics_eval)
        self.last_row = {**row, **({"pass@1": shown["pass@1"]} if "pass@1" in shown else {})}
        self.tally.add(seg.spec, row)
        self.log_dict(shown, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        return loss

    def _check_finite(self, loss, step: int) -> None:
        if not torch.isfinite(loss):
            raise NonFiniteError(f"the loss is not finite at step {step} ({float(loss.detach())})")

    def _loss(self, at, model, batches):
        """The step's loss (composer.step.loss) with this backend's policy forward, the ranks' shares of each term's
        normaliser, and the run's recorder."""

        def forward(b, want_logits, read):
            return models.policy_view(model, b, want_logits, read)

        def record(kind, **data):
            self.ctx.record(kind, policy=model, **data)

        def values(term, b, view):  # a critic head on the policy's network (ppo): its values with gradient
            return with_critic_values(self.ctx, term.name, term.declared, model, b, view)

        return run_step.loss(at, batches, forward, self._shares(at, batches), record, values=values)

    def _updates(self, at, batches, step: int):
        """train.epochs passes over the step's rollouts, each split into train.mini_batches mini-batches of whole
        groups (in order, the same split every pass), one optimizer step each (DESIGN.md section 9).

        Three log-probs: behaviour (the sampler's, in the batch as always), old (the policy now, before the first
        pass: `batch.old_logprobs`, the importance ratio's denominator), current (each forward below). The step is
        one unit for checkpoints: a run stopped in the middle of a step's passes resumes from the checkpoint
        before the step and trains the whole step again, bit for bit. Only the last optimizer step goes through
        Lightning (global_step counts rollout steps: sync, phases, schedules and checkpoints see steps as before).
        Returns (the mean loss over the updates, the last update's metrics plus the first update's loss, pg_loss,
        clip_frac and ratio_mean under first_update/, and `updates`)."""
        ctx = self.ctx
        t = ctx.spec.train
        model = ctx.forward_model(self.policy)
        n = t.epochs * t.mini_batches
        # a segment with one update keeps the behaviour log-prob as the denominator, unless a term reads the trainer's
        # own (a rollout correction weighs pi_old / mu)
        if n > 1 or any(term.objective.wants_old for term in at.terms):
            run_step.old_logprobs(batches, lambda b, want, read: models.policy_view(model, b, want, read))
        parts = run_step.mini_batches(batches, t.mini_batches)
        opt = self.optimizers()
        losses, metrics = [], {}
        for k in range(n):
            mb = parts[k % len(parts)]
            loss, metrics = self._loss(at, model, mb)
            self._check_finite(loss, step)
            self.manual_backward(loss)
            if k < n - 1:
                self.on_before_optimizer_step(opt)
                self.configure_gradient_clipping(opt)
                opt.optimizer.step()  # not counted by Lightning: one global step per rollout batch
            else:
                self.configure_gradient_clipping(opt)
                opt.step()  # Lightning's step: runs on_before_optimizer_step, counts the global step
            opt.zero_grad()
            if k == n - 1:  # the Plan's LR is per rollout step; Lightning steps schedulers only under automatic
                self.lr_schedulers().step()  # optimization, so by hand here (else warm-up and decay never moved)
            losses.append(float(loss.detach()))
            if k == 0:
                metrics_first = {f"first_update/{key}": v for key, v in metrics.items()
                                 if key.split("/")[-1] in ("loss", "pg_loss", "clip_frac", "ratio_mean")}
        metrics.update(metrics_first)
        if len(parts) > 1:  # the data's facts (reward, zero-advantage groups, lengths) are the step's, not the last part's
            metrics.update(run_step.step_facts(at, batches))
        metrics["updates"] = float(n)
        return torch.tensor(sum(losses) / n), metrics

    def _frozen(self, at, batches):
        """A step of a frozen policy (train.freeze_policy, VAPO's value pre-training): no policy forward, loss or
        optimizer step (its weights and AdamW state stay as they are), yet the step counts (Lightning's step
        counter and the LR program advance as after an update), so phases, syncs and schedules see steps as
        declared. Returns (0, the data's facts and each critic term's advantage metrics)."""
        metrics = {"policy_frozen": 1.0, **run_step.step_facts(at, batches)}
        for term, b in zip(at.terms, batches):
            metrics.update({(f"{term.name}/{k}" if at.many else k): v
                            for k, v in term.objective.advantage_metrics(b).items()})
        if self._trainer is not None:
            progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
            progress.increment_ready()
            progress.increment_completed()
            import warnings

            with warnings.catch_warnings():  # torch warns of a scheduler step before any optimizer step: intended here
                warnings.simplefilter("ignore", UserWarning)
                self.lr_schedulers().step()
        return torch.zeros(()), metrics

    # ---- several ranks (DDP) ----
    def _shares(self, at, batches) -> dict | None:
        """Each term's share of its step-wide normaliser on this rank, times the number of ranks: DDP averages
        gradients over ranks, so the ranks' scaled losses add up to the loss of the whole step as one batch
        (composer.step.shares, as on OpenRLHF). None with one process."""
        world = self.ctx.data.world
        if world <= 1:
            return None
        local = run_step.normalisers(at, batches)
        total = torch.tensor([local[k] for k in sorted(local)], dtype=torch.float32)
        torch.distributed.all_reduce(total)
        return run_step.shares(local, dict(zip(sorted(local), total.tolist())), world)

    def _reduced(self, row: dict) -> dict:
        """The step's metrics over every rank: costs, token throughput and the counts of the step's rows
        (`summed_over_ranks`) summed, everything else averaged over the ranks that measured it."""
        world = self.ctx.data.world
        if world <= 1:
            return row
        rows = [None] * world
        torch.distributed.all_gather_object(rows, row)
        out = {}
        for k in sorted({k for r in rows for k in r}):
            vals = [r[k] for r in rows if k in r]
            out[k] = sum(vals) if summed_over_ranks(k) else sum(vals) / len(vals)
        return out

    def on_before_optimizer_step(self, optimizer) -> None:
        """Refuse a step whose gradients hold a NaN or an infinity (the weights stay the last good ones)."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        # one fused norm over every gradient (0.2 ms on the toy student, against 1.8 ms for a check per tensor):
        # a NaN or an infinity makes it non-finite; only then look per tensor, since a norm can also overflow
        # on finite gradients (> ~1.8e19), which is not a reason to stop
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads)) and not all(
                torch.isfinite(g).all() for g in grads):
            raise NonFiniteError(f"a gradient is not finite at step {self.global_step}")
        step_heads(self.ctx)  # a critic head on the policy's network: its step on this backward

    def after_step(self, done: int | None = None) -> None:
        """After every optimiser step: EMA teachers, the sync schedule (the Plan's), evaluation.

        Called by the AfterStep callback, which Lightning runs before ModelCheckpoint saves,
        so that a checkpoint of step N holds the state after all of step N's bookkeeping.
        `done`: optimiser steps taken so far (default: the Trainer's count).
        """
        ctx = self.ctx
        done = self.global_step if done is None else done
        for rt in list(ctx.state.runtimes.values()):
            if isinstance(rt, Runtime):
                rt.after_optimizer_step(ctx)
        if self.tally is not None and done >= self.tally.end:
            self._segment_done()
        if self.plan.sync_after(done):
            ctx.engine.sync(self.policy, done)
            ctx.record("sync", after=done)

    def on_train_end(self) -> None:
        """Every rank's verifier verdicts into the watch rank 0 warns from after training (DDP: each rank saw only
        its own rows; every rank runs this hook, so the gather meets)."""
        self.reward_watch = self.reward_watch.gathered()

    def _segment_done(self) -> None:
        """The segment's last step is done: whether its weights moved, and the loud warning (--strict: the error
        the run stops with) when some part of it never acted."""
        import logging

        moved = vacuous.fingerprint(self.policy) != self._fingerprint
        self.tally.moved = None if self.plan.at(self.tally.start).policy_frozen else moved  # frozen: declared
        text = self.tally.report()
        self.tally, self._fingerprint = None, None
        if not text:
            return
        if self.global_rank == 0:
            logging.getLogger("composer").warning(
                "WARNING: " + text + ("" if self.strict else "\n  (`composer run --strict` makes this an error)"))
        if self.strict:
            self.vacuous_error = text

    def _evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the policy now; rank 0 keeps what was generated in eval_samples.jsonl (with `step`)."""
        records: list = []
        out = evaluate(self.ctx, self.policy, records)
        if self.ctx.run_dir is not None and self.global_rank == 0:
            try:
                write_records(self.ctx.run_dir, step, records)
            except OSError as e:  # a full disk loses the generations, not the run
                import logging

                logging.getLogger("composer").warning(f"eval_samples.jsonl: not written ({e})")
        return out

    def final_evaluation(self, loggers) -> None:
        """The final evaluation gets a row of its own, at step = total steps, after every step's row."""
        self.last_eval = self._evaluate(self.global_step)
        for lg in loggers:
            lg.log_metrics(metric_row(self.last_eval), step=self.global_step)
            lg.save()

    # ---- checkpoints hold what continuing exactly needs ----
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Tensors and plain data only (the file is read back with weights_only=True); the rollout buffer's
        batches become tagged dicts, and the resolved spec is recorded so --resume can refuse another one.
        A new field here is checked on resume too: name it in checkpoint.COMPOSER_FIELDS or COMPOSER_OPTIONAL."""
        from composer.runtime.checkpoint import spec_record, to_plain

        ctx = self.ctx
        state = {
            "rollout_weights": ctx.engine.model.state_dict() if hasattr(ctx.engine, "model") else None,
            "last_sync": getattr(ctx.engine, "last_sync", 0),
            "rng": ctx.data.rng.getstate(), "torch_rng": torch.get_rng_state(), "data_pos": ctx.data.pos,
            "segment": ctx.segment, "initial": ctx.models.initial.state_dict() if ctx.models.initial is not None else None,
            "runtimes": {repr(k): rt.state_dict() for k, rt in ctx.state.runtimes.items() if isinstance(rt, Runtime)},
            "memo": ctx.memo.checkpointed(),
            "costs": dict(ctx.costs),
            "buffer": to_device(ctx.state.buffer, "cpu") if ctx.state.buffer else None,
            "buffer_version": ctx.state.buffer_version,
            "vacuous": None if self.tally is None else {"tally": self.tally.state(), "fingerprint": self._fingerprint},
        }
        checkpoint["composer"] = to_plain(state, "composer")
        checkpoint["composer"]["spec"] = spec_record(self.validated)
        checkpoint["composer"]["data_files"] = getattr(self, "data_files", None)  # --resume refuses changed data

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from composer.runtime.checkpoint import from_plain

        self._pending = from_plain(checkpoint.get("composer"))

    def on_train_start(self) -> None:
        state = getattr(self, "_pending", None)
        if not state:
            return
        ctx = self.ctx
        # the segment of the last step trained: entering the next one behaves as in an uninterrupted run
        ctx.segment = state["segment"]
        ctx.spec = next((s.spec for s in self.segments if s.name == ctx.segment), ctx.spec)
        if state["rollout_weights"] is not None and hasattr(ctx.engine, "model"):
            ctx.engine.model.load_state_dict(state["rollout_weights"])
        ctx.engine.last_sync = state["last_sync"]
        try:
            rng = state["rng"]  # random.setstate wants (version, tuple of ints, gauss)
            ctx.data.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
            torch.set_rng_state(state["torch_rng"])
            if type(state["data_pos"]) is not int or state["data_pos"] < 0:
                raise TypeError(f"data_pos {state['data_pos']!r:.40}")
        except (TypeError, ValueError, IndexError, KeyError, RuntimeError) as e:
            from composer.runtime.checkpoint import CheckpointError

            raise CheckpointError(f"the checkpoint's training state is damaged (random state or data position: "
                                  f"{type(e).__name__}: {str(e)[:200]}); it cannot be resumed bit for bit\n"
                                  "    hint: resume from an intact checkpoint, or start a new run") from None
        ctx.data.pos = state["data_pos"]
        if state["initial"] is not None:
            ctx.models.restore_initial(state["initial"])
        ctx.costs.update(state.get("costs", {}))
        ctx.state.buffer = to_device(state["buffer"], self.device) if state.get("buffer") else None
        ctx.state.buffer_version = state.get("buffer_version", -1)
        if state.get("vacuous"):  # the counts of the segment's steps before the checkpoint
            self.tally = vacuous.Tally.from_state(state["vacuous"]["tally"])
            self._fingerprint = list(state["vacuous"]["fingerprint"])
        ctx.state.pending_runtime_state = state.get("runtimes", {})
        for k, v in state.get("memo", {}).items():  # searched prefixes (POPE): the same k after a resume
            ctx.memo.restore(eval_key(k), v)
        self._pending = None


# metrics that count over the step's rows (docs/runs.md: `response_tokens`, their sum over the step's rows; an
# objective's `tokens` and `selected`, a pair term's `pairs`): over DDP ranks the step's count is their sum, not one
# rank's share
SUMMED = ("response_tokens", "tokens", "selected", "tokens_per_s", "pairs")


def summed_over_ranks(key: str) -> bool:
    """Whether a metric of the step is the sum of the ranks' values (cumulative costs, counts, throughput)
    rather than their mean (rates, fractions, means, losses)."""
    return key.startswith("cost/") or key.rsplit("/", 1)[-1] in SUMMED


def mark_truncated(batches, stop_ids) -> dict[str, float]:
    """Each rollout row's `truncated` flag (its response does not end in a stop token: cut at max_new_tokens)
    in batch.info["truncated"], which samples.jsonl shows, and the step's `truncated_fraction`: the share of the
    rows the policy wrote that were cut (a reward of 0 beside a truncated_fraction of 1 means the answers were
    never written). Rows the policy wrote nothing of (SFT demonstrations) are not counted; a rollout that
    several terms view is counted once. {} when the step sampled nothing."""
    from composer.filters import truncated_rows

    seen, cut_rows = set(), []
    for b in batches:
        if id(b.tokens) in seen or not isinstance(b.info, dict):
            continue
        seen.add(id(b.tokens))
        wrote = (b.mask(("policy",)) & b.response_mask).any(1)
        if not wrote.any():
            continue
        cut = truncated_rows(b, stop_ids) & wrote
        b.info["truncated"] = cut.tolist()
        cut_rows += cut[wrote].tolist()
    return {"truncated_fraction": sum(cut_rows) / len(cut_rows)} if cut_rows else {}


def shown_pass_at_1(metrics_eval: dict) -> float | None:
    """The greedy pass@1 the progress line shows: `pass@1/<tier>` of the middle tier, never a pass@k or the
    sampled pass@1 (with train.eval_k the evaluation also holds pass@2/<tier>, pass@1_sampled/<tier>, ...)."""
    greedy = sorted(k for k in metrics_eval if k.startswith("pass@1/"))
    return metrics_eval[greedy[len(greedy) // 2]] if greedy else None


def eval_key(text: str) -> tuple:
    """A memo key back from its repr (tuples of strings), without eval."""
    import ast

    return ast.literal_eval(text)


def _needs_initial(spec) -> bool:
    from composer.checks.terms import terms

    if any(obj.wants_initial for _n, _s, obj, _w in terms(spec)):
        return True
    return any(s.wants_initial for s in spec.sources.values())
