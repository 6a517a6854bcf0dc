"""`composer run`: build the Lightning Trainer around the module, run, and write what a run keeps."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from composer.backends.lightning.callbacks import AfterStep, AtomicCheckpointIO, GracefulStop, RunCSVLogger

from composer.backends.lightning.module import ComposerModule, NonFiniteError
from composer.plan import compile_plan
from composer.runtime.binding import bind_task, check_task_lengths, context_length
from composer.runtime.models import load_model, load_tokenizer

log = logging.getLogger("composer")


class Interrupted(RuntimeError):
    pass


def default_out(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def last_checkpoint(out: Path) -> Path | None:
    """The last complete checkpoint: Lightning writes to a temp file and renames, so a file here is whole."""
    ckpt = out / "checkpoints" / "last.ckpt"
    return ckpt if ckpt.exists() else None


def train(validated, out: Path, resume: bool = False, progress: bool = True, final_eval=None) -> dict:
    """Run a validated spec on the Lightning backend. Returns the final metrics.

    `final_eval(ctx, policy)`, when given, runs on the trained policy before the report is written.
    """
    spec = validated.spec
    quiet_libraries()
    torch.manual_seed(spec.train.seed)
    # tiny models are bound by per-op overhead: on a small machine extra threads only contend
    cores = os.cpu_count() or 1
    torch.set_num_threads(int(os.environ.get("COMPOSER_THREADS", 1 if cores <= 2 else min(cores, 8))))
    out.mkdir(parents=True, exist_ok=True)
    plan = compile_plan(validated, "lightning")
    (out / "plan.json").write_text(json.dumps(plan, indent=2, default=str))
    task = bind_task(spec)
    policy_name = spec.policy.model or "toy:student"
    trust = spec.policy.trust_remote_code
    tokenizer = load_tokenizer(spec.policy.tokenizer or policy_name, trust_remote_code=trust)
    policy = load_model(policy_name, spec.policy.dtype, trust_remote_code=trust)
    check_task_lengths(task, tokenizer, context_length(policy), spec.data.on_bad_row, spec.data.prompt_field)
    if any(getattr(s, "verifier", "") == "code" for seg in validated.segments for s in seg.spec.sources.values()):
        from components.tasks.code_verifier import ensure_sandbox

        ensure_sandbox()  # fail closed before any training: code never runs outside the sandbox
    module = ComposerModule(validated, task, tokenizer, policy)
    module.start_metrics = {"skipped_rows": float(getattr(task, "skipped_rows", 0))}
    t = spec.train
    ckpt = last_checkpoint(out) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"{out}: no checkpoint to resume from (looked for checkpoints/last.ckpt)")
    resumed_at = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] if ckpt else None
    stop = GracefulStop(out / "checkpoints" / "last.ckpt")
    callbacks = [AfterStep(), stop,
                 ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=t.checkpoint_every,
                                 save_last=True, save_top_k=0, save_on_train_epoch_end=False)]
    if progress:
        callbacks.append(_progress_bar())
    loggers = [RunCSVLogger(out, keep_before=resumed_at)]
    try:
        from lightning.pytorch.loggers import TensorBoardLogger
        import tensorboard  # noqa: F401

        loggers.append(TensorBoardLogger(save_dir=str(out), name="tensorboard", version=""))
    except ImportError:
        pass
    trainer = L.Trainer(
        max_steps=validated.total_steps, max_epochs=-1, accelerator=t.accelerator, devices=t.devices,
        strategy=t.strategy, num_nodes=t.num_nodes, precision=t.precision,
        gradient_clip_val=t.grad_clip or None, logger=loggers, callbacks=callbacks, log_every_n_steps=1,
        enable_progress_bar=progress, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=True, default_root_dir=str(out), limit_val_batches=0,
        plugins=[AtomicCheckpointIO()],
    )
    try:
        trainer.fit(module, ckpt_path=str(ckpt) if ckpt else None)
    except NonFiniteError as e:
        last = last_checkpoint(out)
        raise NonFiniteError(f"{e}; the run stopped, the last good checkpoint is "
                             f"{last if last else '(none yet)'}; fix the spec and continue with --resume {out}") from None
    if getattr(module, "stopped_by", None):
        raise Interrupted(f"{module.stopped_by}: stopped after step {module.global_step}, checkpoint written; "
                          f"continue with --resume {out}")
    if module.ctx is None:  # resumed from the last step's checkpoint: Lightning ran nothing
        module.setup("fit")
    module.final_evaluation(loggers)
    final = dict(module.last_eval)
    if final_eval is not None:
        final_eval(module.ctx, module.policy)
    write_report(out, plan, final)
    return final


def quiet_libraries() -> None:
    """Keep the console for the run: no library tips, deprecation notes or weight-loading bars."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for pattern in (".*LeafSpec.*", ".*does not have many workers.*", ".*exists and is not empty.*",
                    ".*reproducible.*", ".*dataloader is not resumable.*", ".*Checkpoint directory.*exists and is not empty.*"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric.utilities.rank_zero").setLevel(logging.WARNING)


def _progress_bar():
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    try:
        return RichProgressBar(leave=True)
    except Exception:
        return TQDMProgressBar()


def write_report(out: Path, plan: dict, final: dict) -> None:
    """report.md with a PNG of reward and pass@1 against step."""
    from composer.report import plot_metrics

    metrics = out / "metrics.csv"
    png = plot_metrics(metrics, out / "curves.png", plan["name"]) if metrics.exists() else None
    lines = [f"# {plan['name']}", "", plan.get("summary", ""), "",
             f"Steps: {plan['total_steps']}, backend: lightning, testbed: {plan['testbed']}.", "",
             "## Final evaluation (greedy pass@1 per tier)", "", "| tier | pass@1 |", "| --- | --- |"]
    lines += [f"| {k.split('/', 1)[-1]} | {v:.3f} |" for k, v in sorted(final.items())]
    if png:
        lines += ["", f"![reward and pass@1]({png.name})"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
