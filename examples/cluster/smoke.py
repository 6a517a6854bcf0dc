"""Compile GRPO, OAPL and MInTRL for a 1-GPU node, submit each bundle to a local Ray head, print the metrics.

Starts `ray start --head` when no head is running (and stops it afterwards), compiles each spec with
`composer compile --backend openrlhf --nodes 1 --gpus-per-node 1` for a few steps on the toy testbed,
submits the bundle with its own launch.sh (`ray job submit`, which streams the job's log), and reads
OpenRLHF's per-step status lines ("Global step N: {...}") from that log. Exit status 1 if a job fails
or logs no step.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHOWN = ("rollout/reward_mean", "policy_loss", "composer/loss", "composer/adv_mean", "composer/logratio_mean",
         "composer_guided", "composer_offpolicy_frac", "composer/synced", "kl", "actor_grad_norm", "response_length")
STEP = re.compile(r"Global step (\d+): (\{.*\})")
PAIR = re.compile(r"'([^']+)': (-?[0-9][0-9.e+-]*)")


def sh(*cmd, check=True, **kw):
    print("$", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=check, **kw)


def head_running() -> bool:
    return subprocess.run(["ray", "status"], capture_output=True).returncode == 0


def run_spec(spec: str, steps: int, out: Path) -> list[tuple[int, dict]]:
    bundle = out / spec
    sh(sys.executable, "-c", "from composer.cli import main; main()", "compile", ROOT / "specs" / f"{spec}.yaml",
       f"train.steps={steps}",
       "train.eval_every=0", f"train.checkpoint_every={steps * 10}", "--backend", "openrlhf", "--out", bundle,
       "--nodes", 1, "--gpus-per-node", 1, "--cluster-dir", out / "runs", cwd=ROOT)
    log = bundle / "job.log"
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", str(bundle / "launch.sh"), "http://127.0.0.1:8265"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            f.write(line)
            if "Global step" in line or "Error" in line or "error" in line:
                print(f"  [{spec}] {line.rstrip()[:300]}", flush=True)
        p.wait()
    rows = [(int(m.group(1)), {k: float(v) for k, v in PAIR.findall(m.group(2))})
            for m in map(STEP.search, open(log)) if m]
    if p.returncode or not rows:
        print(f"{spec}: job failed (exit {p.returncode}, {len(rows)} steps); see {log}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default="grpo,oapl,mintrl")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/composer-smoke"))
    args = ap.parse_args()
    started = False
    if not head_running():
        sh("ray", "start", "--head", "--num-gpus", 1, "--disable-usage-stats")
        started = True
        time.sleep(5)
    ok = True
    try:
        for spec in args.specs.split(","):
            t0 = time.time()
            rows = run_spec(spec, args.steps, args.out)
            ok &= len(rows) == args.steps
            print(f"\n== {spec}: {len(rows)}/{args.steps} steps in {time.time() - t0:.0f}s")
            for step, m in rows:
                print(f"  step {step}: " + ", ".join(f"{k}={m[k]:.4g}" for k in SHOWN if k in m))
    finally:
        if started:
            sh("ray", "stop", check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
