#!/usr/bin/env python
"""GRPO step throughput on one GPU: ours with the vLLM engine against TRL's GRPOTrainer with its vLLM
integration (use_vllm, colocate mode), same model, batch and forced completion length, plus the time each
side takes to push the trainer's weights into its colocated vLLM (weight sync). Prints one table.

    python examples/gpu/throughput_vllm.py                     # toy student, 8 prompts x 8, 32 tokens
    python examples/gpu/throughput_vllm.py --model Qwen/Qwen3-0.6B --prompts 16 --group 8 --length 128

Both sides run in this process, interleaved block by block as in `composer bench --throughput`
(composer/bench/throughput.py: ours is the Lightning module's own step, TRL's side its Trainer loop), each
with its own colocated vLLM instance taking --gpu-memory-utilization of the GPU. Sized to finish in under
8 minutes on one GPU with the defaults. Needs a CUDA GPU, vLLM and TRL (`pip install -e '.[gpu,bench]'`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("side", "samples/s", "tokens/s", "ms/step", "sync ms", "syncs", "per-round s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="throughput_vllm.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Policy checkpoint (default: the toy student, bootstrapped if missing).")
    p.add_argument("--prompts", type=int, default=8, help="Prompts per step (default 8).")
    p.add_argument("--group", type=int, default=8, help="Samples per prompt (default 8).")
    p.add_argument("--length", type=int, default=32, help="Completion length, forced on both sides (default 32).")
    p.add_argument("--rounds", type=int, default=5, help="Timed blocks per side, interleaved (default 5).")
    p.add_argument("--steps", type=int, default=2, help="Steps per block (default 2).")
    p.add_argument("--warmup", type=int, default=2, help="Untimed steps per side (CUDA graphs, compilation).")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="Each side's vLLM share of the GPU (default 0.3; both sides are on the GPU at once).")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("prompts", "group", "length", "rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 < args.gpu_memory_utilization < 0.5:
        p.error("--gpu-memory-utilization must be in (0, 0.5): two vLLM instances and two trainers share the GPU")
    return args


def bench_args(args) -> argparse.Namespace:
    """The throughput bench's arguments for one GRPO comparison on the GPU."""
    from composer.bench import throughput as bt

    a = bt.parse_args(["--pairs", "grpo", "--modes", "matched", "--length", str(args.length),
                       "--prompts", str(args.prompts), "--group", str(args.group), "--rounds", str(args.rounds),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
                       "--threads", "4", "--override", "rollout.engine=vllm",
                       "--override", f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}"]
                      + (["--model", args.model] if args.model else []))
    a.device = "cuda"
    a.trl_grpo_extra = {"use_vllm": True, "vllm_mode": "colocate",
                        "vllm_gpu_memory_utilization": args.gpu_memory_utilization}
    return a


def format_table(res: dict, sync: dict, args) -> str:
    """One table: a row per side (samples/s, tokens/s, mean step, mean weight sync) and the ratios."""

    def num(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    def step_ms(side):
        blocks = res.get(f"{side}_block_s") or []
        return 1000 * statistics.mean(blocks) / args.steps if blocks else None

    rows = []
    for side, label in (("ours", "ours (rollout.engine: vllm)"), ("trl", "TRL GRPOTrainer (use_vllm, colocate)")):
        s = sync.get(side) or []
        rows.append((label, num(res.get(f"{side}_samples_per_s")), num(res.get(f"{side}_tokens_per_s"), 0),
                     num(step_ms(side), 0), num(1000 * statistics.mean(s) if s else None, 1), str(len(s)),
                     " ".join(f"{x:.2f}" for x in res.get(f"{side}_block_s", []))))
    widths = [max(len(str(r[i])) for r in rows + [COLUMNS]) for i in range(len(COLUMNS))]
    def line(r):
        return "  ".join(str(c).ljust(w) if i in (0, 6) else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    title = (f"GRPO on one GPU: {args.prompts} prompts x {args.group} samples, {args.length} forced tokens, "
             f"{args.rounds} rounds x {args.steps} steps ({args.warmup} warm-up), vLLM share "
             f"{args.gpu_memory_utilization} each")
    out = [title, line(COLUMNS), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    ratio = res.get("ratio")
    out.append(f"ours/TRL samples/s: {num(ratio, 2)}x" + (
        f" (rounds {min(res['round_ratios']):.2f}-{max(res['round_ratios']):.2f})" if res.get("round_ratios") else ""))
    for side in ("ours", "trl"):
        if res.get(f"{side}_error"):
            out.append(f"{side} did not run: {res[side + '_error']}")
    return "\n".join(out)


def check_machine() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("throughput_vllm: needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for mod, extra in (("vllm", "gpu"), ("trl", "bench")):
        try:
            __import__(mod)
        except ImportError:
            raise SystemExit(f"throughput_vllm: {mod} is not installed (`pip install -e '.[{extra}]'`)") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    check_machine()
    from composer.bench import throughput as bt

    bt.quiet()
    a = bench_args(args)
    if not a.model:
        from components.tasks.bootstrap import ensure_checkpoints

        a.model = ensure_checkpoints()["student"]
    sync: dict[str, list[float]] = {"ours": [], "trl": []}

    def timed(side, fn):
        def wrapped(*x, **k):
            import torch

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*x, **k)
            finally:
                torch.cuda.synchronize()
                sync[side].append(time.perf_counter() - t0)
        return wrapped

    class OursTimed(bt.Ours):  # times the engine's weight sync (the Plan's schedule calls it)
        def __init__(self, *x, **k):
            super().__init__(*x, **k)
            self.ctx.engine.sync = timed("ours", self.ctx.engine.sync)

    real_trl_grpo = bt.trl_grpo

    def trl_grpo_timed(*x, **k):  # times TRL's push of the trainer's weights into its colocated vLLM
        trainer = real_trl_grpo(*x, **k)
        gen = getattr(trainer, "vllm_generation", None)
        if gen is not None:
            gen.sync_weights = timed("trl", gen.sync_weights)
        elif hasattr(trainer, "_move_model_to_vllm"):  # older TRL
            trainer._move_model_to_vllm = timed("trl", trainer._move_model_to_vllm)
        return trainer

    bt.Ours, bt.trl_grpo = OursTimed, trl_grpo_timed
    t0 = time.perf_counter()
    res = bt.run_pair("grpo", a, "matched")
    print(format_table(res, sync, args))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0 if not (res.get("ours_error") or res.get("trl_error")) else 1


if __name__ == "__main__":
    sys.exit(main())
