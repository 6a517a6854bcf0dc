"""Real OpenRLHF 0.11.2 jobs on CPU: the cluster path as a cluster runs it, with only vLLM replaced (issue 27).

What runs for real: a private local Ray 2.55 head (free port, its own temp dir, stopped at the end); each
bundle compiled by `composer compile`, submitted by its own `launch.sh` (`ray job submit` with the bundle as
working_dir and the composer's worker setup hook); the composer's entry point and OpenRLHF's `train()` in the
job driver; OpenRLHF's PPOTrainer, PolicyModelActor (real DeepSpeed ZeRO-2 engine, bf16, gloo), the
reference actor and RolloutRayActor (with the bundle's reward.py / agent.py), each a separate Ray worker
process, talking through Ray; the colocated weight sync over OpenRLHF's CUDA-IPC code path on shared CPU
tensors; checkpoints, TensorBoard logs and the final model written by OpenRLHF; for SFT runs the entry
point's `torchrun -m openrlhf.cli.train_sft` (OpenRLHF's SFTTrainer on the same DeepSpeed setup); a bundle's
later runs (stages) starting from the model the earlier run saved; plugin modules imported from the bundle's
copy in the workers; the composer's external-judge actor (its own worker, a logical GPU of its own); a job
resubmitted by launch.sh after a preemption resuming from OpenRLHF's checkpoint.

What is replaced: vLLM's engine (tests/openrlhf_real/hf_vllm.py, an HF-transformers model with vLLM's
interface, also as the judge actor's offline vllm.LLM; its assumptions are pinned by test_engine_interface and checked against real vLLM on a GPU by
examples/cluster/vllm_interface_check.py). CPU patches (tests/openrlhf_real/cpu.py, P1-P10, each with why): torch.cuda
no-ops, a CPU device mesh, DeepSpeed's own `torch_adam` optimizer option (DeepSpeed still builds the
optimizer from OpenRLHF's config), file-system tensor sharing, sleep-mode state offload as no-ops, the EMA
copy on the CPU, no shared-memory all-reduce kernel, mlflow hidden (DeepSpeed imports it when present); import stubs for vLLM and flash-attn
(tests/openrlhf_cpu_stubs: neither installs without CUDA). torchdata 0.11 (StatefulDataLoader) and pylatexenc
are the real packages; the test-only preemption switch (the training actor SIGKILLs
itself right after writing a named checkpoint). Two argv changes in the copied plan.json: sdpa attention (no
flash-attn) and the test's folders.

Marked `cluster` (`pytest -m cluster tests/test_openrlhf_real.py` alone): `make test` runs this tier in its one
xdist call, its tests in order on one worker, the suite's tests beside it at nice 19 (tests/conftest.py). The head
writes its address where Ray's job supervisor looks for it (head.py): with another Ray running on the machine,
jobs would otherwise connect to it.
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


NO_AGENT = "No available agent to submit job"


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
                   COMPOSER_REAL_OUT=str(self.out), COMPOSER_REAL_KILL=str(self.tmp / "kill_after"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
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
        for _ in range(60):
            r = subprocess.run(["bash", str(bundle / "launch.sh"), *args, self.address], env=self.env,
                               capture_output=True, text=True, timeout=timeout)
            # the head's job agent registers some seconds after the job server answers (longer on a busy
            # machine): the server then refuses the submission before creating any job, so submit again
            if r.returncode == 0 or NO_AGENT not in r.stdout + r.stderr:
                break
            time.sleep(2)
        r.seconds = time.time() - t0
        rec = bundle.parent / "record"
        shutil.rmtree(rec, ignore_errors=True)
        shutil.copytree(self.out, rec)
        return r

    def stop(self) -> None:
        keep = os.environ.get("COMPOSER_REAL_KEEP_LOGS")  # a folder: the head's Ray logs are copied there
        if keep:
            shutil.copytree(self.tmp / "session_latest" / "logs", Path(keep) / self.tmp.name, dirs_exist_ok=True,
                            ignore_dangling_symlinks=True)
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head(gpus=2)  # 2 logical GPUs: judge-proxy-half's external judge takes one of its own
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
    for run in plan["openrlhf"]["runs"]:  # both trainers: no flash-attn on CPU
        run["argv"] += ["--ds.attn_implementation", "sdpa"]
    (bundle / "plan.json").write_text(json.dumps(plan, indent=1))
    (out / "job.json").write_text(json.dumps({"spec": spec, "overrides": overrides + _extra(spec),
                                              "gpus": nodes * gpus_per_node, "total_steps": v.total_steps}))
    return bundle


def records(bundle: Path, name: str) -> list[dict]:
    f = bundle.parent / "record" / name
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def job(head: Head, bundle: Path) -> dict:
    r = head.submit(bundle)
    fits, engine = records(bundle, "fits.jsonl"), records(bundle, "engine.jsonl")
    out = {"fits": fits, "engine": engine, "stdout": r.stdout, "seconds": r.seconds, "bundle": bundle,
           "returncode": r.returncode}
    if r.returncode != 0 or "succeeded" not in r.stdout:
        note(out, None)  # the table's row of a job that failed (how far it got)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    print(f"\n{bundle.parent.name}: job {r.seconds:.0f}s, fits "
          + "; ".join(f"openrlhf {f.get('openrlhf_loss')!r} lightning {f.get('lightning_loss')!r}" for f in fits))
    return out


def summary(out: dict, steps: int | None) -> dict:
    """What check_losses asserts, as figures (no assertion): the closing table's row of a job."""
    fits = out["fits"]
    runs = [[f for f in fits if f["pid"] == pid] for pid in dict.fromkeys(f["pid"] for f in fits)]
    ppo = [f for f in fits if f.get("trainer", "ppo") == "ppo"]
    logged = logged_steps(out["stdout"]) if "stdout" in out and ppo else None
    pairs = [updates(f) for f in fits]
    diffs = [abs(o - lt) for fit in pairs for o, lt in fit]
    return {"succeeded": out.get("returncode", 0) == 0, "seconds": out.get("seconds"),
            "steps_trained": len(fits), "steps_declared": steps, "runs": len(runs),
            "runs_moved": sum(run[0]["weights_before"] != run[-1]["weights_after"] for run in runs),
            "logged_is_trained": None if logged is None else len(logged) == len(ppo) and all(
                s.get("policy_loss") == pytest.approx(f["openrlhf_loss"], rel=1e-5, abs=1e-7) for s, f in zip(logged, ppo)),
            "worst": max(diffs, default=None),
            "within_tol": all(fit and all(abs(o - lt) <= TOL * max(1.0, abs(lt)) for o, lt in fit) for fit in pairs),
            "updates": sum(len(fit) for fit in pairs),
            "largest_loss": max((abs(f["lightning_loss"]) for f in fits if "lightning_loss" in f), default=None)}


def note(out: dict, steps: int | None) -> None:
    """With COMPOSER_REAL_TABLE=FILE: append this job's row (spec, overrides, test, summary) to FILE, the input
    of tests/openrlhf_real/table.py. A job without a compiled spec (the resume test's joined record) adds none."""
    table, bundle = os.environ.get("COMPOSER_REAL_TABLE"), out.get("bundle")
    if not table or bundle is None or not (bundle.parent / "job.json").exists():
        return
    compiled = json.loads((bundle.parent / "job.json").read_text())
    row = {**compiled, **summary(out, compiled["total_steps"] if steps is None else steps),
           "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    with open(table, "a") as f:
        f.write(json.dumps(row) + "\n")


def check_losses(out: dict, steps: int) -> float:
    """Every optimizer step's loss (what DeepSpeed back-propagated; train.epochs > 1: one per pass) equals the
    Lightning backend's loss of the same batch and weights; the job trained its declared steps (the compiled
    plan's); every run (stage: one training process) moved the weights; the policy_loss OpenRLHF logged for each
    PPO step is the loss it trained on (the mean over the step's updates). With COMPOSER_REAL_TABLE set, the
    job's row of the closing table first (`note`). Returns the largest difference."""
    note(out, steps)
    compiled = out["bundle"].parent / "job.json" if out.get("bundle") else None
    if compiled is not None and compiled.exists():  # the steps the test expects are the compiled plan's
        assert steps == json.loads(compiled.read_text())["total_steps"], (steps, compiled.read_text())
    fits = out["fits"]
    assert len(fits) == steps, f"trained {len(fits)} of {steps} declared steps"
    for pid in dict.fromkeys(f["pid"] for f in fits):
        run = [f for f in fits if f["pid"] == pid]
        assert run[0]["weights_before"] != run[-1]["weights_after"], f"a run (pid {pid}) moved no weight: {run}"
    ppo = [f for f in fits if f.get("trainer", "ppo") == "ppo"]
    if "stdout" in out and ppo:
        logged = logged_steps(out["stdout"])
        assert len(logged) == len(ppo), (len(logged), len(ppo))
        for step, f in zip(logged, ppo):
            assert step["policy_loss"] == pytest.approx(f["openrlhf_loss"], rel=1e-5, abs=1e-7), (step, f)
    worst = 0.0
    for f in fits:
        assert "lightning_error" not in f, f["lightning_error"]
        assert f["micro_batches"] >= 1
        pairs = updates(f)
        assert pairs and len(pairs) * f["gas"] == f["micro_batches"], f  # a Lightning figure per optimizer step
        for o, lt in pairs:
            assert abs(o - lt) <= TOL * max(1.0, abs(lt)), (o, lt, f)
            worst = max(worst, abs(o - lt))
    assert any(abs(f["lightning_loss"]) > 1e-4 for f in fits), "every loss ~0: the comparison says nothing"
    return worst


def updates(fit: dict) -> list[tuple[float, float]]:
    """(OpenRLHF, Lightning) loss of each optimizer step of a fit: one per pass over the step's rows
    (train.epochs), each Lightning figure on the weights that update started from; an SFT window is one."""
    if "update_losses" not in fit:
        return [(fit["openrlhf_loss"], fit["lightning_loss"])] if "lightning_loss" in fit else []
    if len(fit["update_losses"]) != len(fit["lightning_losses"]):
        return []
    return list(zip(fit["update_losses"], fit["lightning_losses"]))


# ------------------------------------------------------------------------------------------------ specs

SMALL = ["train.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.temperature=1.5"]


# lr 0.02 and beta2 1: the lagged steps (1 and 3) then sample with weights far from the trainer's, so OAPL's
# beta2 * log-ratio term is far from 0 there and the loss comparison says something even where every reward is
# 0 (the spec's beta2 1e-3 leaves ~1e-6)
OAPL = ["sync.every=2", "train.steps=4", "train.micro_batch_size=4", "train.lr=0.02", "objective.beta2=1.0", *SMALL]


@pytest.fixture(scope="module")
def oapl(head, tmp_path_factory):
    bundle = compile_for_cpu("specs/oapl.yaml", OAPL, tmp_path_factory.mktemp("oapl"))
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


# exact resume: the same OAPL job with a checkpoint every step, preempted right after step 1's checkpoint (the
# training actor's process SIGKILLs itself once it has written global_step1: cpu.py's preemption switch), then
# the same bundle submitted again by its launch.sh; OpenRLHF resumes from the checkpoint (ckpt.load_enable)
@pytest.fixture(scope="module")
def oapl_resumed(head, tmp_path_factory):
    bundle = compile_for_cpu("specs/oapl.yaml", [*OAPL, "train.checkpoint_every=1"], tmp_path_factory.mktemp("resume"))
    switch = Path(head.env["COMPOSER_REAL_KILL"])
    switch.write_text("global_step1")
    try:
        r = head.submit(bundle)
    finally:
        left = switch.exists()
        switch.unlink(missing_ok=True)
    ckpt = bundle.parent / "cluster" / "main" / "ckpt" / "_actor"
    killed = {"returncode": r.returncode, "switch_left": left, "seconds": r.seconds,
              "checkpoints": sorted(p.name for p in ckpt.glob("global_step*")) if ckpt.is_dir() else [],
              "fits": records(bundle, "fits.jsonl"), "engine": records(bundle, "engine.jsonl")}
    print(f"\nresume: preempted job {r.seconds:.0f}s (exit {r.returncode})")
    return bundle, killed, job(head, bundle)


def _rows(fit: dict) -> list:
    """What a step trained on, in the replay buffer's order (the prompts' dispatch order, whatever order the
    rollouts finished in: hooks.dispatch_order): (prompt, sampled tokens) of every row."""
    return [(r["prompt"], r["tokens"]) for r in fit["samples"]]


def test_oapl_resume_is_exact(oapl, oapl_resumed):
    """A real OAPL job (sync every 2) preempted after step 1 and resumed from its checkpoint by launch.sh does
    what the uninterrupted job did: the same prompts in the same steps, the same sampled tokens (each rollout
    request seeded from the run's seed, the step, the prompt and its draw), the engine holding the initial
    weights for step 2 (no broadcast on resume at a step the schedule does not sync after) and receiving the
    trainer's weights after steps 2 and 4 only, the same weights after every step and the same losses."""
    _b, whole = oapl
    bundle, killed, resumed = oapl_resumed
    assert killed["returncode"] != 0 and not killed["switch_left"], killed["returncode"]
    assert len(killed["fits"]) == 1 and killed["checkpoints"] == ["global_step1"], killed["checkpoints"]
    fits = killed["fits"] + resumed["fits"]
    assert len(resumed["fits"]) == 3 and len(whole["fits"]) == 4
    assert resumed["fits"][0]["weights_before"] == killed["fits"][0]["weights_after"]  # the checkpoint's weights
    for i, (a, b) in enumerate(zip(whole["fits"], fits)):
        assert _rows(a) == _rows(b), f"step {i + 1}: other prompts or other sampled tokens after the resume"
        assert a["label_steps"] == b["label_steps"] == [i]
        assert a["weights_before"] == b["weights_before"] and a["weights_after"] == b["weights_after"], i + 1
        assert abs(a["lightning_loss"] - b["lightning_loss"]) <= TOL * max(1.0, abs(a["lightning_loss"])), (i, a, b)
        assert abs(a["openrlhf_loss"] - b["openrlhf_loss"]) <= TOL * max(1.0, abs(a["openrlhf_loss"])), (i, a, b)
    worst = check_losses({"fits": fits}, 4)
    # checkpoints only where a resume keeps the sync schedule (checkpoint_every 1, sync every 2): after step 1
    # (before the first sync) and the sync steps 2 and 4, never after step 3
    ckpt = bundle.parent / "cluster" / "main" / "ckpt" / "_actor"
    kept = sorted(p.name for p in ckpt.glob("global_step*"))
    assert "global_step3" not in kept and "global_step4" in kept, kept
    # the engine: the resumed job's engine starts from the initial weights and samples step 2 with them (a
    # broadcast on resume would give it step 1's), then receives the weights after steps 2 and 4
    eng = resumed["engine"]
    gens = [e for e in eng if e["event"] == "generate"]
    assert gens[0]["weights"] == whole["fits"][0]["weights_before"] != fits[0]["weights_after"]
    assert [e["weights"] for e in eng if e["event"] == "sync"] == [fits[1]["weights_after"], fits[3]["weights_after"]]
    assert [e["weights"] for e in eng if e["event"] == "sync"] == [e["weights"] for e in whole["engine"]
                                                                   if e["event"] == "sync"]
    print(f"resume: resumed job {resumed['seconds']:.0f}s, largest |openrlhf - lightning| = {worst:.3g}, "
          f"largest |resumed - uninterrupted| = "
          f"{max(abs(a['openrlhf_loss'] - b['openrlhf_loss']) for a, b in zip(whole['fits'], fits)):.3g}")


def _method(name: str, spec: str, overrides: list[str], steps: int, gpus: int = 1):
    @pytest.fixture(scope="module", name=f"{name}_job")
    def fixture(head, tmp_path_factory):
        bundle = compile_for_cpu(spec, [f"train.steps={steps}", *overrides], tmp_path_factory.mktemp(name),
                                 gpus_per_node=gpus)
        return bundle, job(head, bundle)

    def test(request):
        _bundle, out = request.getfixturevalue(f"{name}_job")
        print(f"{name}: largest |openrlhf - lightning| = {check_losses(out, steps):.3g}")

    test.__name__ = f"test_{name}_losses_equal_lightning"
    test.__doc__ = f"{spec}: every step's loss on OpenRLHF equals the Lightning backend's on the same batch and weights."
    return fixture, test


# a self-teacher (the policy's initial weights with the reference solution in its prompt), scored in the
# training actor
opsd_job, test_opsd_losses_equal_lightning = _method("opsd", "specs/opsd.yaml", SMALL, 2)
# the agent (the oracle judge's chunked reviews spliced into the rollouts, control rows), the kappa anchor on
# the intervention tokens, two micro-batches per step, and the phase switch (guide off) at step 1
mintrl_job, test_mintrl_losses_equal_lightning = _method(
    "mintrl", "specs/mintrl.yaml", [*SMALL, "rollout.guide.control_samples=2", "phases[0].until=1",
                                    "phases[1].until=2", "train.micro_batch_size=4"], 2)

# SDPO: the self-teacher is the EMA copy of the policy (rate 0.05) re-prompted with a successful sibling or
# the verifier's feedback, scored in the training actor; alpha-JSD over the student's top-k plus a tail
# bucket (full-vocabulary logits of the training forward); rows with neither context get no loss. lr 0.02:
# the EMA teacher moves after step 1, so step 2's teacher differs from the initial weights
sdpo_job, test_sdpo_losses_equal_lightning = _method("sdpo", "specs/sdpo.yaml", [*SMALL, "train.lr=0.02"], 2)
# POPE: the minimal prefix search runs in the agent on the rollout engine while it holds the initial
# weights; guided prompts carry the reference prefix in the prompt and form their own advantage groups
# (tiers 6 and 8: references long enough for a prefix within max_fraction 0.25; every prompt drawn for
# guidance; 2 search samples per candidate prefix)
POPE = ["data.train_tiers=[6,8]", "rollout.guide.search_samples=2"]
# lr 0.02 and kl_coef 1: step 2's KL term against the initial policy is far from 0 whatever the rewards
pope_job, test_pope_losses_equal_lightning = _method("pope", "specs/pope.yaml",
                                                     [*SMALL, *POPE, "rollout.guide.guided_fraction=1.0",
                                                      "train.lr=0.02", "objective.kl_coef=1.0"], 2)


def test_pope_rollouts_were_sampled_from_prefixed_prompts(pope_job):
    """The guide acted on the cluster: some rows of the trained batches were sampled from a prompt that is the
    dataset prompt plus the start of the reference solution (the minimal search's prefix), labelled guided and
    tagged as their own group; the other rows from the plain dataset prompt."""
    _bundle, out = pope_job
    rows = [r for f in out["fits"] for r in f["samples"]]
    guided = [r for r in rows if r["guided"]]
    assert guided, "no guided rollout reached the trainer"
    for r in guided:
        first_step = r["solution"].split("\n")[0].strip()
        assert r["tag"] == "guided" and not r["control"]
        assert r["sampled_prompt"] != r["prompt"] and first_step in r["sampled_prompt"], r
    plain = [r for r in rows if not r["guided"]]
    assert all(r["sampled_prompt"] == r["prompt"] for r in plain), plain[:2]
    # the minimal search ran on the rollout engine while it held the initial weights (version 0): it served
    # more requests then than step 0's 2 x 4 rollouts
    assert sum(e["event"] == "request" and e["version"] == 0 for e in out["engine"]) > 2 * 4


def test_sdpo_teacher_context_reached_the_loss(sdpo_job):
    """Some rows had a teacher context (a successful sibling or feedback: weight 1) and the loss is non-zero
    because of them (check_losses); the rows' teacher weights come from the experience step's labels."""
    _bundle, out = sdpo_job
    weights = [(r["teacher_weight"] or {}).get("teacher") for f in out["fits"] for r in f["samples"]]
    assert any(w not in (None, 0, 0.0) for w in weights), weights


# hybrids. OPD plus outcome reward: two terms in the composer's loss, the teacher in the reference slot and
# GRPO advantages over the step's groups
opd_reward_job, test_opd_reward_losses_equal_lightning = _method("opd_reward", "specs/hybrids/opd-plus-reward.yaml",
                                                                 SMALL, 2)
# OAPL with POPE prefixes: the lagged engine (sync every 2) holds the initial weights for both steps, so the
# minimal search and the rollouts share the engine; beta2 1 and a large lr, as for OAPL, so that the
# lagged step's log-ratio term is far from 0
oapl_pope_job, test_oapl_pope_losses_equal_lightning = _method(
    "oapl_pope", "specs/hybrids/oapl-pope.yaml", [*SMALL, *POPE, "sync.every=2", "train.lr=0.005",
                                                  "objective.beta2=1.0"], 2)


def test_oapl_pope_guided_rows_come_from_prefixed_prompts(oapl_pope_job):
    """POPE's guided rollouts reached the OAPL trainer, sampled from prefixed prompts, tagged as their own
    advantage group."""
    _bundle, out = oapl_pope_job
    rows = [r for f in out["fits"] for r in f["samples"]]
    assert any(r["guided"] and r["sampled_prompt"] != r["prompt"] for r in rows)
    assert all(r["tag"] == "guided" for r in rows if r["guided"])
    assert all(r["sampled_prompt"] == r["prompt"] for r in rows if not r["guided"])


# MInTRL's self-judge ablation: the policy, shown the reference solution, reviews its own chunks on the rollout
# engine (the agent's "policy" calls); the Proxy anchor on intervention tokens; the guide on for both steps. At
# temperature 1: its objective reads the behaviour log-probs of intervention tokens, which OpenRLHF's engines give
# only untempered (compile refuses another temperature; tests/test_openrlhf.py); the toy's middle tier (6), where
# the student's rollouts at temperature 1 still disagree, so the losses are not all ~0
mintrl_self_proxy_job, test_mintrl_self_proxy_losses_equal_lightning = _method(
    "mintrl_self_proxy", "specs/hybrids/mintrl-self-proxy.yaml",
    [*SMALL, "rollout.temperature=1.0", "data.train_tiers=[6]", "rollout.guide.control_samples=2", "phases[0].until=2",
     "phases[1].until=3", "train.micro_batch_size=4"], 2)


def test_mintrl_self_proxy_judge_is_the_policy(mintrl_self_proxy_job):
    """Each step trained 2 control and 2 reviewed rollouts per prompt; the reviews were served by the rollout
    engine (it answered more requests than the steps' rollouts alone make) and corrections reached the
    trained rows (guided rows: the judge wrote into them)."""
    _bundle, out = mintrl_self_proxy_job
    for f in out["fits"]:
        assert sum(r["control"] for r in f["samples"]) == 2 * 2 == len(f["samples"]) - 4, f["samples"]
    assert any(r["guided"] for f in out["fits"] for r in f["samples"])
    assert sum(e["event"] == "request" for e in out["engine"]) > 2 * 2 * 4


# judge-proxy-half: an external judge (the toy teacher checkpoint, shipped in the bundle) served by the
# composer's named judge actor (hooks.start_judges: vLLM's offline LLM, here hf_vllm.LLM) on a GPU of its own:
# compiled for 1 node x 2 GPUs (one trains and samples, colocated; one serves the judge); the guide on for
# step 1 only (the phase switch to plain rollouts at step 2, as the spec's half)
judge_proxy_half_job, test_judge_proxy_half_losses_equal_lightning = _method(
    "judge_proxy_half", "specs/hybrids/judge-proxy-half.yaml",
    [*SMALL, "rollout.temperature=1.0", "rollout.guide.control_samples=2", "phases[0].until=1", "phases[1].until=2",
     "data.train_tiers=[2]"], 2, gpus=2)


def test_judge_proxy_half_external_judge_served_the_reviews(judge_proxy_half_job):
    """The judge actor (its own Ray worker, the teacher's checkpoint from the bundle) answered the reviews of
    step 1, whose guided rows reached the loss; step 2 (guide off) trained plain rollouts only and the judge
    served nothing more."""
    bundle, out = judge_proxy_half_job
    judged = records(bundle, "judge.jsonl")
    assert judged and len({j["pid"] for j in judged} | {e["pid"] for e in out["engine"]}) == 2, judged[:2]
    one, two = out["fits"]
    assert sum(r["control"] for r in one["samples"]) == 2 * 2 == len(one["samples"]) - 4
    assert any(r["guided"] for r in one["samples"])
    assert all(r["control"] and not r["guided"] for r in two["samples"])
    assert (bundle / "models" / "teacher" / "config.json").exists()


# plugins: one job for a plugin objective (examples/custom_component: `length_penalized_grpo`) and a plugin guide
# (tests/openrlhf_real/plugin_src/first_step_hint.py), both named by the spec's `plugins:`, shipped in the bundle
# and imported by the composer in the job driver and every Ray worker (tests/openrlhf_real/plugins.yaml)
PLUGIN_SRC = ROOT / "examples" / "custom_component" / "src"


def compile_with_plugins(spec: str, srcs: list[Path], overrides: list[str], out: Path) -> Path:
    """compile_for_cpu for a spec whose `plugins:` live in the folders `srcs` (allowed, as --allow-plugins does);
    the bundle carries its own copy, and the Ray workers' path never holds them."""
    from composer import registry

    sys.path[:0] = [str(s) for s in srcs]
    registry.allow_spec_plugins(True)
    try:
        return compile_for_cpu(spec, overrides, out)
    finally:
        registry.allow_spec_plugins(None)
        for s in srcs:
            sys.path.remove(str(s))


@pytest.fixture(scope="module")
def plugins_job(head, tmp_path_factory):
    bundle = compile_with_plugins("tests/openrlhf_real/plugins.yaml", [PLUGIN_SRC, HERE / "plugin_src"],
                                  ["rollout.temperature=1.5"], tmp_path_factory.mktemp("plugins"))
    return bundle, job(head, bundle)


def test_plugin_objective_runs_in_the_workers(plugins_job):
    """The bundle's copy of the plugin module is what the training actor's loss used: the recorder (in that
    actor's process) found `length_penalized_grpo` from the bundle's `length_penalty/`, and OpenRLHF's loss
    equals the Lightning loss of that objective on the same batch."""
    bundle, out = plugins_job
    assert (bundle / "length_penalty" / "__init__.py").exists()
    print(f"plugins: largest |openrlhf - lightning| = {check_losses(out, 2):.3g}")
    for f in out["fits"]:
        assert f["objectives"] == ["length_penalty.LengthPenalizedGrpo"], f["objectives"]
        assert f["objective_files"][0].endswith("length_penalty/__init__.py")
        assert str(PLUGIN_SRC) not in f["objective_files"][0]  # the bundle's copy, not the source tree


def test_plugin_guide_runs_in_the_rollout_workers(plugins_job):
    """The rows of the trained batches are what the plugin guide (the bundle's copy) wrote: even rollouts carry
    the reference's first line as guide_prefix tokens after the prompt (no loss: they come before the first
    action token) and are tagged as their own group, odd ones are plain."""
    bundle, out = plugins_job
    assert (bundle / "first_step_hint.py").exists()
    rows = [r for f in out["fits"] for r in f["samples"]]
    hinted = [r for r in rows if r["guided"]]
    assert rows and len(hinted) == len(rows) // 2
    for r in rows:
        if r["guided"]:
            assert r["tag"] == "hint" and r["sampled_prompt"] == r["prompt"] + r["solution"].split("\n")[0] + "\n"
        else:
            assert r["control"] and r["sampled_prompt"] == r["prompt"]


# episodes (issue 55, item 5): rollout.environment run by the bundle's agent.py (composer/episodes.py with the spec's
# own environment part). tool-grpo with both tools on the toy's tool task (toy:tools, the student taught to call the
# calculator now and then; 4 prompts x 4 samples at temperature 1): the agent checks the python tool's sandbox in the
# vLLM engine's Ray worker before its first episode (the job fails with the reason where it cannot run). The plugin
# environment `retry` (examples/custom_component, shipped in the bundle): a wrong final line gets "F:line N is wrong,
# try again" and another attempt at -0.1 (turn_reward_weight 1), so the toy student's wrong answers put environment
# tokens into the trained batch
TOOL_GRPO = ["train.steps=2", "rollout.environment.tools=[calculator,python]", *SMALL, "train.prompts_per_step=4",
             "rollout.temperature=1.0", "policy.model=toy:tools", "data.toy_task=tools"]
RETRY_ENV = ["train.steps=2", *SMALL]


@pytest.fixture(scope="module")
def tool_grpo_job(head, tmp_path_factory):
    bundle = compile_for_cpu("specs/methods/tool-grpo.yaml", TOOL_GRPO, tmp_path_factory.mktemp("tool_grpo"))
    return bundle, job(head, bundle)


@pytest.fixture(scope="module")
def retry_env_job(head, tmp_path_factory):
    bundle = compile_with_plugins("examples/custom_component/retry-env.yaml", [PLUGIN_SRC], RETRY_ENV,
                                  tmp_path_factory.mktemp("retry_env"))
    return bundle, job(head, bundle)


def episode_rows(bundle: Path, out: dict, turn_reward: float) -> list[dict]:
    """Every trained row of an episode job, checked on the batch OpenRLHF trained (the recorder's rows): the tokens
    with action_mask 1 are exactly the policy's (the label's spans: no environment token, no prompt token in the loss
    mask); every row logged its env/* counts; the reward is the toy verifier's, written plainly here (the last
    non-empty line of the final answer, the policy's tokens after the last environment answer it answered, is the
    solution's '#N'), plus turn_reward x the environment's answers. Returns the rows, each with its environment
    token count and final answer."""
    from transformers import AutoTokenizer

    from composer.episodes import answer_span

    plan = json.loads((bundle / "plan.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(bundle / plan["openrlhf"]["policy_path"]))
    rows = [r for f in out["fits"] for r in f["samples"]]
    assert rows
    for r in rows:
        spans, act, toks = r["spans"], r["action_mask"], r["tokens"]
        P = spans[0][0]
        trained = {j + 1 for j, a in enumerate(act) if a}
        origin = {t: o for s, e, o in spans for t in range(s, e)}
        assert trained == {t for t, o in origin.items() if o == "policy"}, (spans, sorted(trained))
        assert all(origin.get(t) in ("policy", "environment") for t in range(P, len(toks)))
        s, e = answer_span([origin[t] for t in range(P, len(toks))])
        r["final"] = tok.decode(toks[P + s:P + e], skip_special_tokens=True)
        r["env_tokens"] = sum(o == "environment" for o in origin.values())
        env_turns = sum(o == "environment" for _, _, o in spans)
        lines = [x.strip() for x in r["final"].splitlines() if x.strip()]
        right = bool(lines) and lines[-1] == r["solution"].splitlines()[-1].strip()
        assert r["reward"] == pytest.approx(float(right) + turn_reward * env_turns, abs=1e-6), r
        assert r["env"]["env/turns"] >= 1 and r["env"]["env/env_tokens"] == r["env_tokens"], r["env"]
    return rows


def test_tool_grpo_trains_through_the_agent(tool_grpo_job):
    """tool-grpo (calculator and python) on toy:tools as a real job: every step's loss equals Lightning's on the same
    batch, every rollout was an episode (env/* logged per row), no environment token and no prompt token in
    OpenRLHF's loss mask, rewards the verifier's over the final answer; the policy called the calculator in some
    episodes, and each answer in the trained batch is the declared tool's (the part's reference replay:
    ToolEnvironment.reference_replies, a parser of its own, rendered as the plain prompts' answer line)."""
    from transformers import AutoTokenizer

    from components.environments.tools import ToolEnvironment

    bundle, out = tool_grpo_job
    print(f"tool-grpo: largest |openrlhf - lightning| = {check_losses(out, 2):.3g}")
    rows = episode_rows(bundle, out, 0.0)
    assert all("env/tool_calls" in r["env"] and "env/tool_errors" in r["env"] for r in rows)
    plan = json.loads((bundle / "plan.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(bundle / plan["openrlhf"]["policy_path"]))
    env, answers = ToolEnvironment(tools=["calculator", "python"]), 0
    for r in rows:
        pieces = [(o, tok.decode(r["tokens"][s:e], skip_special_tokens=True)) for s, e, o in r["spans"]]
        turns = [text for k, (o, text) in enumerate(pieces) if o == "policy" and k + 1 < len(pieces)
                 and pieces[k + 1][0] == "environment"]
        said = [text for o, text in pieces if o == "environment"]
        want = [env.render_plain(a) for a, _reward, _done in env.reference_replies(None, turns)]
        assert said == want, (said, want)
        answers += len(said)
    calls = sum(r["env"]["env/tool_calls"] for r in rows)
    print(f"tool-grpo: {len(rows)} episodes, {calls:g} tool calls, {answers} tool answers in the trained batch "
          f"({sum(r['env_tokens'] for r in rows)} environment tokens, none in the loss mask)")
    assert calls >= 1 and answers >= 1, "no tool call in the job: the episode checks say little"


def test_plugin_environment_tokens_never_in_the_loss(retry_env_job):
    """The plugin environment `retry` as a real job: the trained batch holds environment tokens (the toy student's
    wrong answers were answered), none of them in OpenRLHF's action_mask; the reward is the verifier's over the last
    attempt minus 0.1 per answered wrong attempt; every step's loss equals Lightning's (whose loss also never reads
    environment tokens) on the same batch."""
    bundle, out = retry_env_job
    assert (bundle / "length_penalty" / "retry_env.py").exists()
    print(f"retry-env: largest |openrlhf - lightning| = {check_losses(out, 2):.3g}")
    rows = episode_rows(bundle, out, -0.1)
    answered = [r for r in rows if r["env_tokens"]]
    assert answered, "no environment answer reached the trained batch: the check says nothing"
    print(f"retry-env: {len(rows)} episodes, {len(answered)} with environment turns, "
          f"{sum(r['env_tokens'] for r in rows)} environment tokens, none in the loss mask")

# SDPO over episodes with the environment's feedback as the teacher's privileged context
# (examples/custom_component/sdpo-env-feedback.yaml: the feedback source's detail: environment, the retry
# environment's messages); lr 0.02: the EMA teacher moves after step 1
@pytest.fixture(scope="module")
def sdpo_env_job(head, tmp_path_factory):
    bundle = compile_with_plugins("examples/custom_component/sdpo-env-feedback.yaml", [PLUGIN_SRC],
                                  ["train.steps=2", "train.lr=0.02", *SMALL], tmp_path_factory.mktemp("sdpo_env"))
    return bundle, job(head, bundle)


def test_teacher_sees_the_environment_feedback(sdpo_env_job):
    """The self-teacher's prompt of every row the environment answered holds that row's environment text (the retry
    messages, decoded from the trained batch's environment tokens) and the row has teacher weight 1; a row the
    environment never answered has no teacher context (weight 0); environment tokens never in the loss mask; every
    step's loss equals Lightning's."""
    from transformers import AutoTokenizer

    bundle, out = sdpo_env_job
    print(f"sdpo-env-feedback: largest |openrlhf - lightning| = {check_losses(out, 2):.3g}")
    rows = episode_rows(bundle, out, 0.0)
    plan = json.loads((bundle / "plan.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(bundle / plan["openrlhf"]["policy_path"]))
    answered = 0
    for r in rows:
        weight = (r["teacher_weight"] or {}).get("teacher")
        if not r["env_tokens"]:
            assert weight == 0.0, r
            continue
        answered += 1
        said = [tok.decode(r["tokens"][s:e], skip_special_tokens=True).strip() for s, e, o in r["spans"]
                if o == "environment"]
        prompt = tok.decode(r["teacher"]["teacher"], skip_special_tokens=True)
        assert weight == 1.0 and "\n".join(said) in prompt, (said, prompt)
    assert answered, "no row the environment answered: the check says nothing"
    print(f"sdpo-env-feedback: {answered} of {len(rows)} rows with the environment's feedback in the teacher's prompt")

# InT: stage 1 (SFT on the agent's guided targets, built once by the engine's agent from the initial weights)
# and stage 2 (GRPO) as two OpenRLHF runs chained in one job, stage 2 starting from stage 1's saved model
# The spec's own policy (toy:instruct) and tiers (4 and 6), where its failed attempts get interventions and some
# targets are kept (stage 1: 3 steps of 4 problems, whose targets are built before its first step); the test
# fails if stage 1's loss is 0 or any run moves no weight
INT = ["stages[0].train.steps=3", "stages[0].train.prompts_per_step=4", "stages[1].train.steps=2",
       "stages[1].train.prompts_per_step=2", "stages[1].rollout.samples_per_prompt=4",
       "stages[1].rollout.temperature=1.5"]


@pytest.fixture(scope="module")
def int_job(head, tmp_path_factory):
    bundle = compile_for_cpu("specs/int.yaml", INT, tmp_path_factory.mktemp("int"))
    return bundle, job(head, bundle)


def test_int_stages_chain_and_losses_equal_lightning(int_job):
    """Both runs' step losses equal Lightning's; stage 2's trainer starts from exactly the weights stage 1
    ended with (its saved final model, loaded by both the policy actor and the rollout engine of run 2)."""
    bundle, out = int_job
    plan = json.loads((bundle / "plan.json").read_text())
    assert [r["name"] for r in plan["openrlhf"]["runs"]] == ["sft", "rl"]
    fits, engine = out["fits"], out["engine"]
    print(f"int: largest |openrlhf - lightning| = {check_losses(out, 5):.3g}")
    one, two = fits[:3], fits[3:]
    assert len({f["pid"] for f in one}) == 1 and len({f["pid"] for f in two}) == 1 and one[0]["pid"] != two[0]["pid"]
    # targets reached the loss: stage 1 trained on kept interventions, so the weights moved
    assert any(abs(f["lightning_loss"]) > 1e-3 for f in one), [f["lightning_loss"] for f in one]
    assert one[0]["weights_before"] != one[-1]["weights_after"]
    assert two[0]["weights_before"] == one[-1]["weights_after"]
    pids = list(dict.fromkeys(e["pid"] for e in engine))  # each run's engine, in order
    first_gen = [next(e for e in engine if e["pid"] == p and e["event"] == "generate") for p in pids]
    assert first_gen[-1]["weights"] == one[-1]["weights_after"]  # run 2's engine loaded stage 1's model
    assert (bundle.parent / "cluster" / "sft" / "model" / "config.json").exists()


# the shipped curriculum: SFT (train_sft, torchrun), then OPD, then GRPO: three OpenRLHF runs of two trainers
# in one job, each from the model the previous one saved. Its three runs are also the tier's SFT, OPD and GRPO
# jobs (the stages hold exactly specs/sft.yaml's, specs/opd.yaml's and specs/grpo.yaml's components, which the
# every-spec tier runs as shipped): SFT through OpenRLHF's native route (the entry point execs `torchrun -m
# openrlhf.cli.train_sft` in the job driver's node), OpenRLHF normalising by the window's token count; OPD
# with the teacher in the reference slot (a separate Ray actor loading the teacher checkpoint); GRPO on the
# native route (OpenRLHF's PolicyLoss, group_norm advantages, KL loss against the reference actor); every run
# two micro-batches per optimizer step (SFT 8 prompts, OPD and GRPO 2 x 4 rollouts; micro-batches of 4)
CURRICULUM = ["train.prompts_per_step=2", "stages[0].train.steps=2", "stages[1].train.steps=2",
              "stages[2].train.steps=2", "rollout.samples_per_prompt=4", "stages[2].rollout.samples_per_prompt=4",
              "rollout.temperature=1.5", "train.micro_batch_size=4", "stages[0].train.prompts_per_step=8"]


@pytest.fixture(scope="module")
def curriculum_job(head, tmp_path_factory):
    bundle = compile_for_cpu("specs/hybrids/sft-opd-grpo.yaml", CURRICULUM, tmp_path_factory.mktemp("curriculum"))
    return bundle, job(head, bundle)


def test_sft_opd_grpo_stages_chain_across_trainers(curriculum_job):
    """Every step of the three runs equals Lightning's loss; the OPD run starts from the weights train_sft
    saved and the GRPO run from those the OPD run saved; every step of the three runs took two micro-batches;
    the GRPO run has OpenRLHF's KL loss against the reference actor."""
    bundle, out = curriculum_job
    plan = json.loads((bundle / "plan.json").read_text())
    assert [(r["name"], r["trainer"]) for r in plan["openrlhf"]["runs"]] == [("sft", "sft"), ("opd", "ppo"),
                                                                               ("grpo", "ppo")]
    fits = out["fits"]
    print(f"sft-opd-grpo: largest |openrlhf - lightning| = {check_losses(out, 6):.3g}")
    assert [f.get("trainer", "ppo") for f in fits] == ["sft"] * 2 + ["ppo"] * 4
    for before, after in ((2, 1), (4, 3)):
        assert fits[before]["weights_before"] == fits[after]["weights_after"], (before, after)
    assert fits[1]["weights_after"] != fits[0]["weights_before"]
    assert [(f["gas"], f["micro_batches"]) for f in fits] == [(2, 2)] * 6, fits
    grpo = plan["openrlhf"]["runs"][2]["argv"]  # GRPO's KL loss against the reference actor (kl_coef 0.001)
    assert "--algo.kl.use_loss" in grpo and float(grpo[grpo.index("--algo.kl.init_coef") + 1]) > 0, grpo


def test_sft_trained_the_lightning_demonstrations(curriculum_job):
    """The tokens OpenRLHF's SFT dataset built (the curriculum's SFT run) are the Lightning backend's SFT rows
    (components/signals/sft.py make_batch: the prompt's ids, then the reference solution's ids and EOS as
    `demonstration`): each trained sequence is one of them, its loss tokens exactly the demonstration; the run's
    final model was written."""
    from transformers import AutoTokenizer

    bundle, out = curriculum_job
    plan = json.loads((bundle / "plan.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(bundle / plan["openrlhf"]["policy_path"]))
    rows = [json.loads(x) for x in (bundle / "data" / "train.jsonl").read_text().splitlines()]
    lightning = {}
    for r in rows:
        p = tok.encode(r["prompt"], add_special_tokens=False)
        d = tok.encode(json.loads(r["label"])["solution"], add_special_tokens=False) + [tok.eos_token_id]
        lightning[tuple(p + d)] = [False] * len(p) + [True] * len(d)
    sft = [f for f in out["fits"] if f.get("trainer") == "sft"]
    assert len(sft) == 2, [f.get("trainer", "ppo") for f in out["fits"]]
    assert sft[1]["weights_before"] == sft[0]["weights_after"] != sft[0]["weights_before"]
    seen = 0
    for f in sft:
        assert f["gas"] == 2 and f["micro_batches"] == 2 and f["demo_tokens"] > 0
        for seq, mask in zip(f["sequences"], f["demo_masks"]):
            assert tuple(seq) in lightning, tok.decode(seq)
            assert mask[:len(seq)] == lightning[tuple(seq)]
            seen += 1
    assert seen == 2 * 8
    assert (bundle.parent / "cluster" / "sft" / "model" / "config.json").exists()


# DAPO (dynamic sampling): the prompt pool holds the refills; the job trains exactly its declared steps, each
# step on prompts_per_step mixed groups (OpenRLHF's dynamic filtering), and the loss equals Lightning's
DAPO = ["train.steps=2", "rollout.filter.max_rounds=null", "train.mini_batches=1", *SMALL]


@pytest.fixture(scope="module")
def dapo_job(head, tmp_path_factory):
    bundle = compile_for_cpu("specs/methods/dapo.yaml", DAPO, tmp_path_factory.mktemp("dapo"))
    return bundle, job(head, bundle)


def test_dapo_trains_its_declared_steps(dapo_job):
    """2 steps declared, 2 trained, each on 2 prompts x 4 samples whose 0/1 rewards are mixed; the bundle's
    prompt pool is larger than steps x prompts (the refills come from it)."""
    bundle, out = dapo_job
    print(f"dapo: largest |openrlhf - lightning| = {check_losses(out, 2):.3g}")
    plan = json.loads((bundle / "plan.json").read_text())
    argv = plan["openrlhf"]["runs"][0]["argv"]
    assert int(argv[argv.index("--data.max_samples") + 1]) > 2 * 2
    for f in out["fits"]:
        assert len(f["samples"]) == 2 * 4
        groups = {}
        for r in f["samples"]:
            groups.setdefault(r["prompt"], []).append(r)
        assert len(groups) == 2


def test_plain_launch_fails_fast_without_the_gpus(head, tmp_path):
    """A bundle compiled for 2 nodes x 8 GPUs, launched plainly (no --check) on the 2-GPU head: the resource
    preflight each run starts with fails the job at once, naming what is missing; --no-preflight skips it."""
    bundle = compile_for_cpu("specs/oapl.yaml", ["train.steps=2"], tmp_path, gpus_per_node=8, nodes=2)
    r = head.submit(bundle, timeout=600)
    assert r.returncode != 0
    report = json.loads((r.stdout + r.stderr).split("composer-preflight: ", 1)[1].splitlines()[0])
    assert report["cluster"]["gpus"] == 2
    assert any("missing 2 node(s) with 8 GPU(s)" in p for p in report["problems"]), report["problems"]
    print(f"plain launch on a head without the GPUs: failed after {r.seconds:.0f}s")
    assert "--no-preflight" in (bundle / "launch.sh").read_text()


def test_check_names_the_gpus_the_cluster_lacks(head, tmp_path):
    """A bundle compiled for 2 nodes x 8 GPUs, checked on the 2-GPU head: launch.sh --check fails and says what
    is missing instead of OpenRLHF waiting forever for its placement group."""
    bundle = compile_for_cpu("specs/oapl.yaml", ["train.steps=2"], tmp_path, gpus_per_node=8, nodes=2)
    r = head.submit(bundle, "--check", timeout=600)
    assert r.returncode != 0
    report = json.loads(r.stdout.split("composer-check: ", 1)[1].splitlines()[0])
    assert report["cluster"] == {"nodes": 1, "gpus_per_node": [2], "gpus": 2}
    assert any("missing 2 node(s) with 8 GPU(s)" in p for p in report["problems"]), report["problems"]
