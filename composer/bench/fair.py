"""What makes `composer bench --throughput` fair by construction (issue 45).

- `settings_ours` / `settings_trl`: the trainer settings each side trains with, read off the live objects at
  train start (our Lightning module, its rollout engine and the optimiser Lightning built; TRL's trainer, its
  model, its generation config and the optimiser HF's Trainer built), never from the config the bench passed.
- `compare`: the rows that differ; `SettingsMismatch`: raised at TRL's train start (matched and compiled
  modes) when a row differs, so a bench whose two sides do not train alike refuses to time them.
- `LightningLoop`: our side run by a real `lightning.Trainer` (the Lightning backend's own loop: training_step,
  backward, clipping, optimiser and scheduler steps, AfterStep, Lightning's per-step bookkeeping), in a thread
  that the bench advances block by block, so our timed step is the whole trainer step, as TRL's is.
- `linear_backend`: MKL or oneDNN for every float32 linear, on both sides alike.
- `matmul_checkpoint`: a random-weight Qwen3 of tens of millions of parameters, built locally (no download).
- `count_flops` / `peak_gflops`: our step's matrix FLOPs and the host's measured float32 matmul peak.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

LINEARS = ("mkl", "onednn")


class SettingsMismatch(RuntimeError):
    """The two sides would not train alike: the bench refuses to time them."""


# ------------------------------------------------------------------------------------- the settings


def _dtype(model) -> str:
    try:
        return str(next(model.parameters()).dtype).removeprefix("torch.")
    except (StopIteration, AttributeError):
        return "-"


def _device(model) -> str:
    try:
        return next(model.parameters()).device.type
    except (StopIteration, AttributeError):
        return "-"


def _checkpointing(model) -> bool:
    model = getattr(model, "_orig_mod", model)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def _linears(models) -> str:
    """'oneDNN' when every plain linear of the models computes through composer.runtime.onednn (and it is on),
    'MKL' when none does, else the count."""
    import torch

    from composer.runtime import onednn

    n = dnn = 0
    for m in models:
        if m is None:
            continue
        if _device(m) not in ("cpu", "-"):
            return "cuBLAS"
        for mod in getattr(m, "_orig_mod", m).modules():
            if isinstance(mod, torch.nn.Linear):
                n += 1
                dnn += isinstance(mod, onednn.OneDNNLinear)
    if not onednn._ON or dnn == 0:
        return "MKL"
    return "oneDNN" if dnn == n else f"oneDNN {dnn} of {n}"


def _optimizer(opt) -> dict:
    g = opt.param_groups[0]
    impl = "fused" if g.get("fused") else ("foreach" if g.get("foreach") else "for-loop")
    return {"optimizer": f"{type(opt).__name__} ({impl})", "betas": tuple(round(b, 6) for b in g.get("betas", ())),
            "weight decay": g.get("weight_decay"), "eps": g.get("eps")}


def settings_ours(ours, trainer=None) -> dict:
    """Our side's settings, read at train start off the module, its policy, the rollout engine, the optimiser
    and LR the Trainer built, and the forward model the step uses."""
    import torch

    ctx, spec, policy = ours.ctx, ours.ctx.spec, ours.policy
    opt = trainer.optimizers[0] if trainer is not None else ours.opt
    engine = ctx.engine
    gen_model = getattr(engine, "model", None)
    rollouts = ours.rollouts
    s = {
        "step timed": "lightning.Trainer step" if trainer is not None else "module step (no Trainer)",
        "gradient checkpointing": _checkpointing(policy),
        "dtype": _dtype(policy),
        "threads": torch.get_num_threads(),
        "linear backend": _linears([policy, gen_model, *_frozen(ctx)]),
        "compiled": "torch.compile" if ours.train_model is not policy else "eager",
        "rows per step": ours.rows_per_step,
        **_optimizer(opt),
        "lr": round(opt.param_groups[0]["lr"], 12),
        "grad clip": float(spec.train.grad_clip or 0.0),
    }
    if rollouts:
        gc = getattr(gen_model, "generation_config", None)
        s["KV cache in generation"] = bool(getattr(gc, "use_cache", True) if gc is not None else True)
        s["completions per prompt"] = spec.rollout.samples_per_prompt
        s["completion tokens (min, max)"] = (getattr(gc, "min_new_tokens", None) or 0, ctx.max_new_tokens)
    return s


def _frozen(ctx) -> list:
    """The frozen models our step reads (initial policy, teachers), where already built."""
    out = []
    models = getattr(ctx, "models", None)
    for name in ("initial", "_initial"):
        m = getattr(models, name, None)
        if hasattr(m, "modules"):
            out.append(m)
    return out


def settings_trl(trainer, pair: str, optimizer=None) -> dict:
    """TRL's side's settings, read at train start off the trainer, its (wrapped) model and generation config,
    the optimiser and LR HF's Trainer built."""
    import torch

    model = trainer.model
    args = trainer.args
    opt = optimizer or trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
    wrapped = getattr(trainer, "model_wrapped", model)
    compiled = hasattr(wrapped, "_orig_mod") or hasattr(model, "_orig_mod")
    others = [getattr(trainer, "ref_model", None), getattr(trainer, "teacher_model", None)]
    s = {
        "step timed": "HF Trainer step",
        "gradient checkpointing": _checkpointing(model),
        "dtype": _dtype(model),
        "threads": torch.get_num_threads(),
        "linear backend": _linears([model, *[o for o in others if hasattr(o, "modules")]]),
        "compiled": "torch.compile" if compiled else "eager",
        "rows per step": args.per_device_train_batch_size * args.gradient_accumulation_steps,
        **_optimizer(opt),
        "lr": round(opt.param_groups[0]["lr"], 12),
        "grad clip": float(args.max_grad_norm or 0.0),
    }
    if pair != "sft":
        gc = getattr(trainer, "generation_config", None)  # None: generation elsewhere (vLLM), not readable here
        use_cache = getattr(gc, "use_cache", None)
        s["KV cache in generation"] = None if gc is None else (True if use_cache is None else bool(use_cache))
        s["completions per prompt"] = getattr(trainer, "num_generations", None) or getattr(
            trainer, "bench_completions_per_prompt", None)
        s["completion tokens (min, max)"] = None if gc is None else (gc.min_new_tokens or 0, gc.max_new_tokens)
    return s


# rows that differ by design: ours is timed through Lightning's loop, TRL's through HF's
BY_DESIGN = ("step timed",)


def compare(ours: dict, trl: dict) -> list[str]:
    """The settings rows (in both tables) whose values differ, by name; 'step timed' differs by design, and a
    value None (not readable on that side, e.g. TRL generating in vLLM) is not compared. A row one side lacks
    differs."""
    out = []
    for k in dict.fromkeys([*ours, *trl]):
        if k in BY_DESIGN:
            continue
        a, b = ours.get(k, "(absent)"), trl.get(k, "(absent)")
        if a is None or b is None:
            continue
        if isinstance(a, float) and isinstance(b, float):
            same = abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)
        else:
            same = a == b
        if not same:
            out.append(k)
    return out


def format_settings(ours: dict | None, trl: dict | None, title: str) -> str:
    ours, trl = ours or {}, trl or {}
    diff = set(compare(ours, trl)) if ours and trl else set()
    keys = list(dict.fromkeys([*ours, *trl]))
    lines = [f"{title}: settings read at train start", f"  {'setting':30s} {'ours':34s} {'TRL':34s}"]
    for k in keys:
        mark = "  <- differs" if k in diff else ""
        lines.append(f"  {k:30s} {str(ours.get(k, '-')):34s} {str(trl.get(k, '-')):34s}{mark}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- the linear backend


@contextlib.contextmanager
def linear_backend(name: str):
    """Every float32 linear of both sides through MKL (oneDNN switched off: composer.runtime.onednn falls back
    to F.linear) or through oneDNN (TRL's models converted with `use_onednn`, see `to_backend`)."""
    from composer.runtime import onednn

    if name not in LINEARS:
        raise ValueError(f"linear backend {name!r}: expected one of {', '.join(LINEARS)}")
    before = onednn._ON
    onednn._ON = before and name == "onednn"
    try:
        yield onednn._ON
    finally:
        onednn._ON = before


def to_backend(models, name: str) -> None:
    """TRL's models on the same linear backend as ours: oneDNN converts their nn.Linear layers (in place)."""
    from composer.runtime import onednn

    if name == "onednn" and onednn._ON:
        for m in models:
            if hasattr(m, "modules"):
                onednn.use_onednn(m)


# ------------------------------------------------------------------------------------ our Lightning side


class LightningLoop:
    """Our module trained by a real lightning.Trainer in a worker thread, one block of steps at a time.

    `start()` runs `fit` up to `on_train_start` (setup, optimisers: untimed); `run(n)` lets the loop take n
    steps and returns the wall time from the go signal to the n-th step's `on_train_batch_end` (after the
    AfterStep callback); `close()` stops the loop after its current step and joins the thread. The Trainer is
    the backend's (run.py `_fit`) without what TRL's side has off too: no logger, progress bar, checkpoints."""

    def __init__(self, module, root: str, accelerator: str = "cpu"):
        import lightning as L

        from composer.backends.lightning.callbacks import AfterStep

        self.module = module
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._todo = 0
        self._stop = False
        self.error: BaseException | None = None
        self.steps = 0
        self.count_box: dict | None = None  # set: the next step's matrix FLOPs are counted into it
        self._counting = contextlib.ExitStack()
        loop = self

        class Gate(L.Callback):
            def on_train_start(self, trainer, pl_module):
                loop._pause(trainer)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if loop.count_box is not None:  # dispatch modes are per thread: entered in the loop's own
                    loop._counting.enter_context(count_flops(loop.count_box))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                loop._counting.close()
                loop.count_box = None
                loop.steps += 1
                loop._todo -= 1
                if loop._todo <= 0:
                    loop._pause(trainer)

        self.trainer = L.Trainer(  # (AfterStep runs before Gate: the step's bookkeeping is inside its time)
            max_steps=-1, max_epochs=-1, accelerator=accelerator, devices=1, precision="32-true", logger=False,
            callbacks=[AfterStep(), Gate()], log_every_n_steps=1, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False, default_root_dir=root,
            limit_val_batches=0)
        self._thread = threading.Thread(target=self._fit, name="bench-lightning", daemon=True)

    def _pause(self, trainer) -> None:
        self._done.release()
        self._go.acquire()
        if self._stop:
            trainer.should_stop = True
            raise _Stop()

    def _fit(self) -> None:
        try:
            self.trainer.fit(self.module)
        except _Stop:
            pass
        except BaseException as e:  # handed to the caller of run()
            self.error = e
        finally:
            self._stop = True
            self._done.release()

    def start(self) -> None:
        self._thread.start()
        self._done.acquire()
        self._raise()

    def run(self, n: int) -> float:
        self._raise()
        if n <= 0:
            return 0.0
        self._todo = n
        t0 = time.perf_counter()
        self._go.release()
        self._done.acquire()
        took = time.perf_counter() - t0
        self._raise()
        return took

    def _raise(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e
        if self._stop and not self._thread.is_alive():
            raise RuntimeError("our Lightning loop has stopped")

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop = True
            self._go.release()
            self._thread.join(timeout=600)


class _Stop(Exception):
    """Raised inside the loop's thread to end `fit` when the bench is done with it."""


# ------------------------------------------------------------------------------- the matmul-bound model

MATMUL_MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1536}


def matmul_checkpoint(out_dir: str, seed: int = 0, **shape) -> str:
    """A random-weight Qwen3 (MATMUL_MODEL: 8 layers, hidden 512, MLP 1536; ~26M parameters with the char
    tokenizer's embeddings) saved with the toy tokenizer to `out_dir`: built here, nothing downloaded."""
    import torch

    from components.tasks.bootstrap import char_tokenizer, qwen3

    cfg = {**MATMUL_MODEL, **shape}
    tok = char_tokenizer()
    torch.manual_seed(seed)
    model = qwen3(len(tok), layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"],
                  kv_heads=cfg["kv_heads"], intermediate=cfg["intermediate"], tok=tok)
    model.config.max_position_embeddings = 1024
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def n_params(path_or_model) -> int:
    m = path_or_model
    if isinstance(m, str):
        from transformers import AutoConfig, AutoModelForCausalLM

        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(m))
    return sum(p.numel() for p in m.parameters())


def stretch(examples, chars: int):
    """The examples with each solution repeated (whole lines) to at least `chars` characters: SFT rows of the
    matmul size's length (the char tokenizer: a character is a token)."""
    import dataclasses

    out = []
    for e in examples:
        sol = e.solution or ""
        lines = sol.split("\n")
        body = list(lines)
        while len("\n".join(body)) < chars:
            body += lines
        out.append(dataclasses.replace(e, solution="\n".join(body)))
    return out


# ------------------------------------------------------------------------------------ FLOPs and the peak


def flop_mapping() -> dict:
    """FlopCounterMode formulas (on shapes) for the products composer.runtime.onednn routes around aten::mm."""
    import torch

    from composer.runtime import onednn  # noqa: F401 (registers composer::onednn_mm)

    def mm(x2, w, *_a, out_shape=None, **_k):
        return 2 * x2[0] * x2[1] * w[0]

    mapping = {}
    for ns, name in (("composer", "onednn_mm"), ("mkldnn", "_linear_pointwise")):
        pkt = getattr(getattr(torch.ops, ns), name, None)
        if pkt is not None:
            mapping[pkt] = mm  # FlopCounterMode looks its formulas up by overload packet
    return mapping


@contextlib.contextmanager
def count_flops(box: dict):
    """Count the matrix FLOPs (mm, bmm, addmm, attention, oneDNN's products) run inside, into box['flops']."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=flop_mapping())
    with counter:
        yield counter
    box["flops"] = counter.get_total_flops()


def peak_gflops(threads: int, n: int = 1024, repeats: int = 5) -> dict:
    """The host's float32 matmul peak as measured here: an n x n x n product through MKL and through oneDNN,
    median of `repeats`; 'peak' is the faster of the two."""
    import torch
    import torch.nn.functional as F

    from composer.bench.throughput import _gflops
    from composer.runtime import onednn

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    flop = 2 * n ** 3
    mkl = _gflops(flop, lambda: F.linear(x, w), repeats)
    dnn = _gflops(flop, lambda: onednn._raw(x, w), repeats) if onednn.available() else None
    return {"shape": n, "mkl": round(mkl, 1), "onednn": round(dnn, 1) if dnn else None,
            "peak": round(max(mkl, dnn or 0.0), 1)}
