"""Real OpenRLHF 0.11.2 jobs on CPU: the cluster path as a cluster runs it, with only vLLM replaced (issue 27).

What runs for real: a private local Ray 2.55 head (free port, its own temp dir, stopped at the end); each
bundle compiled by `composer compile`, submitted by its own `launch.sh` (`ray job submit` with the bundle as
working_dir and the composer's worker setup hook); the composer's entry point and OpenRLHF's `train()` in the
job driver; OpenRLHF's PPOTrainer, PolicyModelActor (real DeepSpeed ZeRO-2 engine, bf16, gloo), the
reference actor and RolloutRayActor (with the bundle's reward.py / agent.py), each a separate Ray worker
process, talking through Ray; the colocated weight sync over OpenRLHF's CUDA-IPC code path on shared CPU
tensors; checkpoints, TensorBoard logs and the final model written by OpenRLHF.

What is replaced: vLLM's engine (tests/openrlhf_real/hf_vllm.py, an HF-transformers model with vLLM's
interface; its assumptions are pinned by test_engine_interface and checked against real vLLM on a GPU by
examples/cluster/vllm_interface_check.py). CPU patches (tests/openrlhf_real/cpu.py, P1-P7): torch.cuda
no-ops, a CPU device mesh, DeepSpeed's `torch_adam` optimizer setting, file-system tensor sharing, DeepSpeed
state offload as no-ops, a StatefulDataLoader. Two argv changes in the copied plan.json: sdpa attention (no
flash-attn) and the test's folders.

Marked `cluster` (pytest -m cluster): `make test` runs this tier as its own pytest call.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests" / "openrlhf_real"
STUBS = ROOT / "tests" / "openrlhf_cpu_stubs"
HAVE = all(importlib.util.find_spec(m) is not None for m in ("openrlhf", "ray", "deepspeed"))
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not HAVE, reason="needs openrlhf==0.11.2 (--no-deps), ray and deepspeed "
                                 "(the project's openrlhf-cpu extra, installed by make setup)")]
# overrides added to every spec, e.g. other checkpoints than the toy testbed's:
# COMPOSER_REAL_OVERRIDES="policy.model=/path/a sources.teacher.model=/path/b" (only where a spec has the field)
EXTRA_ALL = os.environ.get("COMPOSER_REAL_OVERRIDES", "").split()
TOL = float(os.environ.get("COMPOSER_REAL_TOL", "2e-3"))  # bf16 weights on both sides: the same forward


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Head:
    """The private Ray head (tests/openrlhf_real/head.py) and the environment every job inherits."""

    def __init__(self, gpus: int = 1):
        self.tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
        self.out = self.tmp / "record"
        self.out.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                   PYTHONPATH=f"{HERE / 'site'}{os.pathsep}{STUBS}", RAY_TMP=str(self.tmp), RAY_TMPDIR=str(self.tmp),
                   COMPOSER_REAL_OUT=str(self.out), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   RAY_DEDUP_LOGS="0")
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(HERE / "head.py"), str(_free_port()), str(gpus)], env=env,
                                     cwd=self.tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("head: "):
            self.stop()
            raise RuntimeError(f"the Ray head did not start: {line!r}")
        self.address = json.loads(line[len("head: "):])["address"]

    def submit(self, bundle: Path, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
        """`launch.sh [args] ADDRESS` of the bundle; the recorder's files of this job move to bundle/record."""
        for f in self.out.iterdir():
            f.unlink()
        t0 = time.time()
        r = subprocess.run(["bash", str(bundle / "launch.sh"), *args, self.address], env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        r.seconds = time.time() - t0
        rec = bundle.parent / "record"
        shutil.rmtree(rec, ignore_errors=True)
        shutil.copytree(self.out, rec)
        return r

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head(gpus=1)
    yield h
    h.stop()


def _extra(spec: str) -> list[str]:
    """EXTRA_ALL, a `sources.NAME.model=` only for a spec whose source NAME is a toy checkpoint."""
    lines = (ROOT / spec).read_text().splitlines()
    return [o for o in EXTRA_ALL if not o.startswith("sources.")
            or any(x.strip().startswith(o.split(".")[1] + ":") and '"toy:' in x for x in lines)]


def compile_for_cpu(spec: str, overrides: list[str], out: Path, gpus_per_node: int = 1, nodes: int = 1) -> Path:
    """`composer compile` (the library call) for a 1 x 1-GPU colocated cluster, then the CPU argv changes."""
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout

    v = validate_file(ROOT / spec, overrides + _extra(spec))
    bundle = out / "bundle"
    compile_bundle(v, bundle, Layout(nodes=nodes, gpus_per_node=gpus_per_node, cluster_dir=str(out / "cluster")))
    plan = json.loads((bundle / "plan.json").read_text())
    for run in plan["openrlhf"]["runs"]:
        if run["trainer"] == "ppo":
            run["argv"] += ["--ds.attn_implementation", "sdpa"]
    (bundle / "plan.json").write_text(json.dumps(plan, indent=1))
    return bundle


def records(bundle: Path, name: str) -> list[dict]:
    f = bundle.parent / "record" / name
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def job(head: Head, bundle: Path) -> dict:
    r = head.submit(bundle)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    fits, engine = records(bundle, "fits.jsonl"), records(bundle, "engine.jsonl")
    print(f"\n{bundle.parent.name}: job {r.seconds:.0f}s, fits "
          + "; ".join(f"openrlhf {f.get('openrlhf_loss')!r} lightning {f.get('lightning_loss')!r}" for f in fits))
    return {"fits": fits, "engine": engine, "stdout": r.stdout, "seconds": r.seconds}


def check_losses(out: dict, steps: int) -> float:
    """Every fit's loss (what DeepSpeed back-propagated) equals the Lightning backend's loss of the same batch
    and weights; returns the largest difference."""
    fits = out["fits"]
    assert len(fits) == steps, fits
    worst = 0.0
    for f in fits:
        assert "lightning_error" not in f, f["lightning_error"]
        assert f["micro_batches"] >= 1
        d = abs(f["openrlhf_loss"] - f["lightning_loss"])
        assert d <= TOL * max(1.0, abs(f["lightning_loss"])), f
        worst = max(worst, d)
    assert any(abs(f["lightning_loss"]) > 1e-4 for f in fits), "every loss ~0: the comparison says nothing"
    return worst


# ------------------------------------------------------------------------------------------------ specs

SMALL = ["train.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.temperature=1.5"]


@pytest.fixture(scope="module")
def oapl(head, tmp_path_factory):
    # lr 0.02 and beta2 1: the lagged steps (1 and 3) then sample with weights far from the trainer's, so
    # OAPL's beta2 * log-ratio term is far from 0 there and the loss comparison says something even where
    # every reward is 0 (the spec's beta2 1e-3 leaves ~1e-6)
    bundle = compile_for_cpu("specs/oapl.yaml", ["sync.every=2", "train.steps=4", "train.micro_batch_size=4",
                                                 "train.lr=0.02", "objective.beta2=1.0", *SMALL],
                             tmp_path_factory.mktemp("oapl"))
    return bundle, job(head, bundle)


def test_oapl_losses_equal_lightning(oapl):
    _bundle, out = oapl
    print(f"oapl: largest |openrlhf - lightning| = {check_losses(out, 4):.3g}")


def logged_steps(stdout: str) -> list[dict]:
    """The numbers of OpenRLHF's `Global step N: {...}` log lines (the dicts its loggers receive), in order."""
    import re

    return [{k: float(v) for k, v in re.findall(r"'([^']+)': (-?[0-9.]+(?:e-?[0-9]+)?)", line)}
            for line in stdout.splitlines() if re.search(r"Global step \d+: \{", line)]


def test_oapl_logged_loss_is_the_objective_under_gradient_accumulation(oapl):
    """Two micro-batches per optimizer step: the logged policy_loss is what DeepSpeed back-propagated (the
    composer objective), not OpenRLHF's token-weighted mean of the micro-batch values."""
    _bundle, out = oapl
    steps = logged_steps(out["stdout"])
    assert len(steps) == 4 and all(f["gas"] == 2 and f["micro_batches"] == 2 for f in out["fits"])
    for logged, f in zip(steps, out["fits"]):
        assert logged["policy_loss"] == pytest.approx(f["openrlhf_loss"], rel=1e-5, abs=1e-7)


def test_oapl_syncs_only_at_declared_steps(oapl):
    """sync.every 2 over 4 steps: the engine receives weights after steps 2 and 4 only (OpenRLHF alone
    would broadcast after every step), each time the trainer's weights after that step, and every rollout is
    sampled with the weights of the last declared sync."""
    _bundle, out = oapl
    fits, engine = out["fits"], out["engine"]
    syncs = [e for e in engine if e["event"] == "sync"]
    assert [e["weights"] for e in syncs] == [fits[1]["weights_after"], fits[3]["weights_after"]]
    gens = [e for e in engine if e["event"] == "generate"]
    assert [g["version"] for g in gens][:3] == [0, 1, 2][:len(gens)]
    assert gens[0]["weights"] == fits[0]["weights_before"]
    assert gens[1]["weights"] == fits[1]["weights_after"] == fits[2]["weights_before"]


def _method(name: str, spec: str, overrides: list[str], steps: int):
    @pytest.fixture(scope="module", name=f"{name}_job")
    def fixture(head, tmp_path_factory):
        bundle = compile_for_cpu(spec, [f"train.steps={steps}", *overrides], tmp_path_factory.mktemp(name))
        return bundle, job(head, bundle)

    def test(request):
        _bundle, out = request.getfixturevalue(f"{name}_job")
        print(f"{name}: largest |openrlhf - lightning| = {check_losses(out, steps):.3g}")

    test.__name__ = f"test_{name}_losses_equal_lightning"
    test.__doc__ = f"{spec}: every step's loss on OpenRLHF equals the Lightning backend's on the same batch and weights."
    return fixture, test


# native route (OpenRLHF's PolicyLoss, group_norm advantages, KL loss against the reference actor), two
# micro-batches per optimizer step
grpo_job, test_grpo_losses_equal_lightning = _method("grpo", "specs/grpo.yaml", [*SMALL, "train.micro_batch_size=4"], 2)
# the teacher in the reference slot (a separate Ray actor loading the teacher checkpoint)
opd_job, test_opd_losses_equal_lightning = _method("opd", "specs/opd.yaml", SMALL, 2)
# a self-teacher (the policy's initial weights with the reference solution in its prompt), scored in the
# training actor
opsd_job, test_opsd_losses_equal_lightning = _method("opsd", "specs/opsd.yaml", SMALL, 2)
# the agent (the oracle judge's chunked reviews spliced into the rollouts, control rows), the kappa anchor on
# the intervention tokens, two micro-batches per step, and the phase switch (guide off) at step 1
mintrl_job, test_mintrl_losses_equal_lightning = _method(
    "mintrl", "specs/mintrl.yaml", [*SMALL, "rollout.guide.control_samples=2", "phases[0].until=1",
                                    "phases[1].until=2", "train.micro_batch_size=4"], 2)


def test_check_names_the_gpus_the_cluster_lacks(head, tmp_path):
    """A bundle compiled for 2 nodes x 8 GPUs, checked on the 1-GPU head: launch.sh --check fails and says what
    is missing instead of OpenRLHF waiting forever for its placement group."""
    bundle = compile_for_cpu("specs/oapl.yaml", ["train.steps=2"], tmp_path, gpus_per_node=8, nodes=2)
    r = head.submit(bundle, "--check", timeout=600)
    assert r.returncode != 0
    report = json.loads(r.stdout.split("composer-check: ", 1)[1].splitlines()[0])
    assert report["cluster"] == {"nodes": 1, "gpus_per_node": [1], "gpus": 1}
    assert any("missing 2 node(s) with 8 GPU(s)" in p for p in report["problems"]), report["problems"]
