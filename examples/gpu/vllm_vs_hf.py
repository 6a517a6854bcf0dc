#!/usr/bin/env python
"""Rollout throughput of the vllm and hf engines on one GPU, on the toy testbed's checkpoints.

Runs GRPO, OAPL (sync every 10 steps, its spec's schedule) and MInTRL for a few steps with each
engine, each run in its own process (so one engine's GPU memory never stays behind for the next),
reads `tokens_per_s` from every run's metrics.csv (mean over the steps after the warm-up), and prints
the tokens per second of each engine and their ratio. Needs a CUDA GPU and vLLM (`pip install -e '.[gpu]'`).

    python examples/gpu/vllm_vs_hf.py                      # all three methods, 12 steps each
    python examples/gpu/vllm_vs_hf.py --methods grpo --steps 30 --set rollout.samples_per_prompt=16
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"grpo": "specs/grpo.yaml", "oapl": "specs/oapl.yaml", "mintrl": "specs/mintrl.yaml"}
ENGINES = ("vllm", "hf")
FORCED = {"oapl": ["sync.every=10"]}  # the lagged sampler of OAPL's spec, kept whatever --set says before it


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm_vs_hf.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="grpo,oapl,mintrl", help="comma-separated, from: " + ", ".join(METHODS))
    p.add_argument("--engines", default="vllm,hf", help="comma-separated, from: vllm, hf")
    p.add_argument("--steps", type=int, default=12, help="optimiser steps per run (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean (compilation, CUDA graphs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="vLLM's share of the GPU; the trainer shares the same GPU (default 0.3)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="override train.prompts_per_step")
    p.add_argument("--samples-per-prompt", type=int, default=None, help="override rollout.samples_per_prompt")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="any further spec override, for every run (repeatable)")
    p.add_argument("--out", default="runs/vllm_vs_hf", help="folder for the runs and summary.json")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run before it is stopped")
    p.add_argument("--one", nargs=2, metavar=("METHOD", "ENGINE"), help=argparse.SUPPRESS)  # a child run
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [m for m in args.methods if m not in METHODS] + [e for e in args.engines if e not in ENGINES]
    if bad:
        p.error(f"unknown method/engine: {', '.join(bad)}")
    return args


def check_machine() -> None:
    """Stop with a clear message when this machine cannot run the comparison."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("vllm_vs_hf: needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
                         "(run it on a GPU machine; `--help` works anywhere)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("vllm_vs_hf: vLLM is not installed; install it with `pip install -e '.[gpu]'`") from None


def overrides(method: str, engine: str, args) -> list[str]:
    out = [f"rollout.engine={engine}", f"train.steps={args.steps}", "train.accelerator=gpu", "train.devices=1",
           "train.eval_every=0", "train.eval_samples=8", f"train.checkpoint_every={max(args.steps, 1)}"]
    if engine == "vllm":  # a vLLM setting: refused with engine: hf, where it cannot act
        out.append(f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}")
    if args.prompts_per_step:
        out.append(f"train.prompts_per_step={args.prompts_per_step}")
    if args.samples_per_prompt:
        out.append(f"rollout.samples_per_prompt={args.samples_per_prompt}")
    return out + list(args.overrides) + FORCED.get(method, [])


def run_one(method: str, engine: str, args) -> None:
    """One run, in this process (the parent starts one process per run)."""
    import logging

    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    v = validate_file(ROOT / METHODS[method], overrides(method, engine, args))
    train(v, Path(args.out) / f"{method}-{engine}", progress=False)


def tokens_per_s(metrics: Path, warmup: int) -> float:
    """Mean tokens_per_s over the logged steps after the first `warmup` (all of them if that leaves none)."""
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("tokens_per_s") not in (None, "")]
    values = [float(r["tokens_per_s"]) for r in rows]
    steps = [int(float(r.get("step") or i)) for i, r in enumerate(rows)]
    kept = [v for s, v in zip(steps, values) if s >= warmup] or values
    return sum(kept) / len(kept) if kept else math.nan


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(ROOT))  # the checkout's composer and components, whatever the working directory
    if args.one:
        run_one(*args.one, args)
        return 0
    check_machine()
    from components.tasks.bootstrap import ensure_checkpoints

    print("toy testbed checkpoints:", ensure_checkpoints()["student"], flush=True)  # once, before the children
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    results: dict[str, dict[str, float]] = {}
    for method in args.methods:
        for engine in args.engines:
            folder = out / f"{method}-{engine}"
            log_file = out / f"{method}-{engine}.log"
            t0 = time.time()
            print(f"{method:7s} {engine:5s} ... ", end="", flush=True)
            with log_file.open("w") as f:
                try:
                    cmd = [sys.executable, __file__, *passthrough, "--one", method, engine]
                    rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                                        check=False).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            metrics = folder / "metrics.csv"
            if rc != 0 or not metrics.exists():
                print(f"failed ({rc}; see {log_file})", flush=True)
                results.setdefault(method, {})[engine] = math.nan
                continue
            tps = tokens_per_s(metrics, args.warmup)
            results.setdefault(method, {})[engine] = tps
            print(f"{tps:10.1f} tokens/s  ({time.time() - t0:.0f} s)", flush=True)

    print()
    print(f"{'method':8s} {'vllm tok/s':>12s} {'hf tok/s':>12s} {'vllm/hf':>8s}")
    for method, r in results.items():
        v, h = r.get("vllm", math.nan), r.get("hf", math.nan)
        ratio = v / h if h and not math.isnan(h) and not math.isnan(v) else math.nan
        r["ratio"] = ratio
        print(f"{method:8s} {v:12.1f} {h:12.1f} {ratio:8.2f}")
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"\nsummary: {out / 'summary.json'}")
    return 0 if all(not math.isnan(x) for r in results.values() for k, x in r.items() if k != "ratio") else 1


if __name__ == "__main__":
    sys.exit(main())
