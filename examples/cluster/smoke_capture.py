"""Ray worker setup hook of the GPU smoke test (examples/cluster/smoke.py copies it into a bundle).

It runs the composer's own hook (composer.backends.openrlhf.hooks.setup_worker) first, so the job trains
exactly as the bundle would; then, when COMPOSER_SMOKE_CAPTURE names a folder, it records what the
composer's loss saw at step 0 in the training actor: each micro-batch's Experience fields (tokens, masks,
labels, rewards, vLLM's rollout log-probs, the reference slot's log-probs) and the loss value the plugin
returned to OpenRLHF, one torch file per micro-batch. smoke.py recomputes the Lightning backend's loss on
those same tokens and compares. Nothing here changes a value the job computes.
"""

from __future__ import annotations

import inspect
import os
import time

ENV = "COMPOSER_SMOKE_CAPTURE"
PREFIX = "composer-smoke-capture:"


def setup_worker() -> None:
    from composer.backends.openrlhf import hooks

    hooks.setup_worker()
    folder = os.environ.get(ENV)
    if folder:
        hooks.when_imported("composer.backends.openrlhf.loss", lambda mod: record_losses(mod, folder))


def record_losses(mod, folder: str) -> None:
    """Wrap ComposerLoss.__call__ (a class attribute: every instance OpenRLHF calls goes through it)."""
    cls = mod.ComposerLoss
    if getattr(cls.__call__, "__smoke_capture__", False):
        return
    orig = cls.__call__
    sig = inspect.signature(orig)

    def __call__(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        try:
            _record(mod, self, sig.bind(self, *args, **kwargs).arguments, out, folder)
        except Exception as e:  # noqa: BLE001 - recording must never break the job
            print(f"{PREFIX} not recorded: {type(e).__name__}: {e}", flush=True)
        return out

    __call__.__smoke_capture__ = True
    cls.__call__ = __call__


def _cpu(x):
    return None if x is None else x.detach().float().cpu() if x.is_floating_point() else x.detach().cpu()


def _record(mod, loss_fn, arguments: dict, out, folder: str) -> None:
    import torch

    exp = loss_fn.ctx["experience"]
    if mod.step_of(exp.labels) != 0:
        return
    rec = {
        "sequences": _cpu(exp.sequences), "attention_mask": _cpu(exp.attention_mask),
        "action_mask": _cpu(arguments.get("action_mask")), "rollout_log_probs": _cpu(arguments.get("rollout_log_probs")),
        "rewards": _cpu(exp.rewards), "base_action_log_probs": _cpu(getattr(exp, "base_action_log_probs", None)),
        "prompts": list(exp.prompts), "labels": list(exp.labels), "loss": float(out[0].detach()),
        "global_batch_size": arguments.get("global_batch_size"), "dp_size": arguments.get("dp_size", 1),
    }
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step0-{time.monotonic_ns()}-{os.getpid()}.pt")
    torch.save(rec, path)
    print(f"{PREFIX} step 0 micro-batch of {len(rec['prompts'])} rows, loss {rec['loss']:.6g} -> {path}", flush=True)
