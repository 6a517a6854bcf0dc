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
- `count_flops` / `generation_flops`: a step's matrix FLOPs (each side counts its own step: what it runs, padded
  rows and all) and the part spent generating.
- `peak_gflops` / `bandwidth_gbs` / `bound_ms`: the host's measured matmul peak and memory-read bandwidth, and
  the step at that floor (training at the peak, decode at the bandwidth).
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
    and LR the Trainer built, and the forward model the step uses. Rows that cannot differ are left out: the
    thread count (one process, read once) and the KV cache (our sampler never reads a flag: it always caches)."""
    ctx, spec, policy = ours.ctx, ours.ctx.spec, ours.policy
    opt = trainer.optimizers[0] if trainer is not None else ours.opt
    engine = ctx.engine
    gen_model = getattr(engine, "model", None)
    rollouts = ours.rollouts
    s = {
        "step timed": "lightning.Trainer step" if trainer is not None else "module step (no Trainer)",
        "gradient checkpointing": _checkpointing(policy),
        "dtype": _dtype(policy),
        "training precision": str(trainer.precision) if trainer is not None else "32-true",
        "linear backend": _linears([policy, gen_model, *_frozen(ctx)]),
        "compiled": "torch.compile" if ours.train_model is not policy else "eager",
        "rows per step": ours.rows_per_step,
        "data order": getattr(ctx.task.sample_train, "order", "the task's sampler"),
        **_optimizer(opt),
        "lr": round(opt.param_groups[0]["lr"], 12),
        "grad clip": float(spec.train.grad_clip or 0.0),
    }
    if rollouts:
        gc = getattr(gen_model, "generation_config", None)
        if getattr(ours, "pair", "grpo") == "grpo":  # GKD has no such setting (its data repeats each prompt)
            s["completions per prompt"] = spec.rollout.samples_per_prompt
        s["completion tokens (min, max)"] = (getattr(gc, "min_new_tokens", None) or 0, ctx.max_new_tokens)
        s["rollout precision"] = ("bf16" if getattr(engine, "precision", "auto") == "bf16"
                                  else _dtype(gen_model).replace("float32", "fp32"))
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
    model = trainer.model
    args = trainer.args
    opt = optimizer or trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
    wrapped = getattr(trainer, "model_wrapped", model)
    compiled = hasattr(wrapped, "_orig_mod") or hasattr(model, "_orig_mod")
    others = [getattr(trainer, "ref_model", None), getattr(trainer, "teacher_model", None)]
    mixed = getattr(getattr(trainer, "accelerator", None), "mixed_precision", "no")
    s = {
        "step timed": "HF Trainer step",
        "gradient checkpointing": _checkpointing(model),
        "dtype": _dtype(model),
        "training precision": {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}.get(str(mixed), str(mixed)),
        "linear backend": _linears([model, *[o for o in others if hasattr(o, "modules")]]),
        "compiled": "torch.compile" if compiled else "eager",
        "rows per step": args.per_device_train_batch_size * args.gradient_accumulation_steps,
        "data order": _trl_order(trainer),
        **_optimizer(opt),
        "lr": round(opt.param_groups[0]["lr"], 12),
        "grad clip": float(args.max_grad_norm or 0.0),
    }
    if pair != "sft":
        gc = getattr(trainer, "generation_config", None)  # None: generation elsewhere (vLLM), not readable here
        if pair == "grpo":
            s["completions per prompt"] = getattr(trainer, "num_generations", None)
        s["completion tokens (min, max)"] = None if gc is None else (gc.min_new_tokens or 0, gc.max_new_tokens)
        s["rollout precision"] = getattr(trainer, "bench_rollout_precision", None) or _dtype(model).replace(
            "float32", "fp32")
    return s


def _trl_order(trainer) -> str:
    """The order TRL's sampler hands out the dataset, read off the sampler its trainer builds: 'in order' (a
    SequentialSampler, or GRPO's RepeatSampler without shuffling), else the sampler's name."""
    from torch.utils.data import SequentialSampler

    try:
        sampler = trainer._get_train_sampler()
    except (AttributeError, TypeError) as e:  # a TRL without the method: said so, compared as a difference
        return f"unreadable ({type(e).__name__})"
    if isinstance(sampler, SequentialSampler) or getattr(sampler, "shuffle", None) is False:
        return "in order"
    return f"shuffled ({type(sampler).__name__})"


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

    def __init__(self, module, root: str, accelerator: str = "cpu", precision: str = "32-true"):
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
            max_steps=-1, max_epochs=-1, accelerator=accelerator, devices=1, precision=precision, logger=False,
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
            try:  # a counted step that failed: its FLOP counter leaves this thread's mode stack (and its
                self._counting.close()  # global module hooks go) here, in the thread that entered it
            except Exception as e:  # noqa: BLE001 (the step's own error, if any, is the one to report)
                self.error = self.error or e
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
    """FlopCounterMode formulas (on shapes) for the products composer.runtime.onednn routes around aten::mm; for
    the in-place aten.addmm_ (acc += a b: TRL's fused LM head's backward), which torch's counter misses; and for
    the CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu` and its backward, which torch's
    counter leaves at 0): 4 B H Tq Tk d forward (Q K^T and P V), 8 B H Tq Tk d backward (dV, dP, dQ, dK), at the
    full Tq x Tk whatever the mask (the causal half is counted too, on both sides alike)."""
    import torch

    from composer.runtime import onednn  # noqa: F401 (registers composer::onednn_mm)

    def mm(x2, w, *_a, out_shape=None, **_k):
        return 2 * x2[0] * x2[1] * w[0]

    def attention(q, k, v, *_a, out_shape=None, **_k):  # q [B, H, Tq, d], k [B, Hk, Tk, d], v [B, Hk, Tk, dv]
        b, h, tq, d = q
        return 2 * b * h * tq * k[2] * d + 2 * b * h * tq * k[2] * v[3]  # Q K^T, then P V

    def attention_backward(grad, q, k, v, *_a, out_shape=None, **_k):
        b, h, tq, d = q
        tk, dv = k[2], v[3]
        return 2 * b * h * tq * tk * (dv + dv + d + d)  # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q

    mapping = {}
    for ns, name in (("composer", "onednn_mm"), ("mkldnn", "_linear_pointwise")):
        pkt = getattr(getattr(torch.ops, ns), name, None)
        if pkt is not None:
            mapping[pkt] = mm  # FlopCounterMode looks its formulas up by overload packet
    def addmm_(_acc, a, b, *_a, out_shape=None, **_k):  # acc += a @ b (TRL's fused LM head's backward)
        return 2 * a[0] * a[1] * b[1]

    aten = torch.ops.aten  # the CPU attention kernel (torch counts only the CUDA ones), at full Tq x Tk
    mapping[aten.addmm_] = addmm_  # in place: not the overload packet of aten.addmm, which torch counts
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", attention),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", attention_backward)):
        pkt = getattr(aten, name, None)
        if pkt is not None:
            mapping[pkt] = fn
    return mapping


@contextlib.contextmanager
def count_flops(box: dict):
    """Count the matrix FLOPs (mm, bmm, addmm, attention, oneDNN's products) run inside, into box['flops']."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=flop_mapping())
    box["counter"] = counter  # read mid-step (the generation's share: `generation_flops`)
    try:
        with counter:
            yield counter
    finally:
        box.pop("counter", None)
    box["flops"] = counter.get_total_flops()


def generation_flops(fn, box_of, into: dict):
    """`fn` (a `generate`) wrapped so that, while a `count_flops` box (`box_of()`) is counting, the FLOPs it runs
    are added to into['generation']: the part of a counted step spent generating."""
    import functools

    @functools.wraps(fn)
    def generate(*a, **k):
        box = box_of()
        counter = (box or {}).get("counter")
        before = counter.get_total_flops() if counter is not None else 0
        try:
            return fn(*a, **k)
        finally:
            if counter is not None:
                into["generation"] = into.get("generation", 0) + counter.get_total_flops() - before

    return generate


def peak_gflops(threads: int, n: int = 1024, repeats: int = 5, dtype: str = "float32") -> dict:
    """The host's matmul peak as measured here: an n x n x n product through MKL and through oneDNN (float32),
    median of `repeats`; 'peak' is the faster of the two. dtype bfloat16: the product in bf16 (F.linear, ATen's
    oneDNN/AMX path where the CPU has one), the peak of bf16-mixed training."""
    import torch
    import torch.nn.functional as F

    from composer.bench.throughput import _gflops
    from composer.runtime import onednn

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    x, w = torch.randn(n, n, generator=g).to(dt), torch.randn(n, n, generator=g).to(dt)
    flop = 2 * n ** 3
    mkl = _gflops(flop, lambda: F.linear(x, w), repeats)
    dnn = (_gflops(flop, lambda: onednn._raw(x, w), repeats)
           if onednn.available() and dtype == "float32" else None)
    return {"shape": n, "dtype": dtype, "mkl": round(mkl, 1), "onednn": round(dnn, 1) if dnn else None,
            "peak": round(max(mkl, dnn or 0.0), 1)}


def bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> dict:
    """The host's memory-read bandwidth as measured here, the floor of a decode step (every weight streamed
    once per generated position): the sum of a float32 buffer of `mib` MiB (far past the last-level cache),
    bytes read over the median time of `repeats` (after one untimed pass), on `threads` threads, in GB/s."""
    import statistics

    import torch

    torch.set_num_threads(threads)
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return {"mib": mib, "gbs": round(x.numel() * 4 / statistics.median(times) / 1e9, 2)}


def weight_bytes(model, dtype_bytes: int | None = None) -> int:
    """Bytes of a model's distinct parameters (tied embeddings once): what one decode position streams from
    memory; `dtype_bytes` (2: bf16 weights) instead of each tensor's own element size."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * (dtype_bytes or p.element_size())
    return total


def bound_ms(train_flops: float | None, gen_flops: float | None, decode_positions: int, weight_bytes_: int,
             peak_gflops_: float | None, bandwidth: float | None) -> dict | None:
    """The step at the host's measured floor: the training passes (train_flops: the step's FLOPs outside
    generation) at the matmul peak, plus generation at the slower of its compute at the peak (gen_flops: prefill
    and decode products) and its weights streamed once per decode position at the measured bandwidth
    (decode_positions x weight_bytes_ / bandwidth). Milliseconds, and the parts. None without a peak."""
    if not train_flops or not peak_gflops_:
        return None
    train = train_flops / (peak_gflops_ * 1e9) * 1e3
    compute = (gen_flops or 0) / (peak_gflops_ * 1e9) * 1e3
    stream = decode_positions * weight_bytes_ / (bandwidth * 1e9) * 1e3 if bandwidth and decode_positions else 0.0
    return {"train_ms": train, "generation_ms": max(compute, stream), "decode_stream_ms": stream,
            "generation_compute_ms": compute, "ms": train + max(compute, stream)}
