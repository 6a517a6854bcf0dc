"""GPU smoke test of the OpenRLHF backend on ONE node with ONE GPU: six checks, in order, on real job output.

  1 start         specs/grpo.yaml: `launch.sh --check` reports no problem (the Ray worker's setup hook ran),
                  then the job itself logs OpenRLHF's "Global step 1" line and exits 0
  2 oapl_sync     specs/oapl.yaml with sync.every=3, 7 steps: `composer/synced` is 1 exactly at steps 3 and 6
                  and 0 otherwise (mostly 0), OpenRLHF's `timing/broadcast` is ~0 on the steps between syncs
  3 phase_switch  specs/mintrl.yaml with phases until 2 and 4: the judge reviews rollouts (composer_reviews > 0)
                  at steps 0-1, and from step 2 on nothing is reviewed or guided (composer_reviews and
                  composer_guided 0): the guide of phase 1 (none) took over at its step
  4 int_stage1    specs/int.yaml, run `sft` (stage 1) for one step: the job logs "Global step 1" with a finite
                  loss and exits 0
  5 loss_step0    OAPL's and OPD's step-0 loss as the plugin returned it to OpenRLHF (summed over the step's
                  micro-batches, recorded in the training actor by smoke_capture.py) against the Lightning
                  backend's loss (composer.step.loss, its fp32 forward of the initial policy and of the
                  teacher) on the same tokens, within LOSS_ABS + LOSS_REL * |loss|
  6 opd_teacher   specs/opd.yaml: the reference slot's log-probs of the step-0 tokens (base_action_log_probs)
                  are the teacher's (Lightning forward of the teacher checkpoint), not the student's; and the
                  ReferenceModelActor's model print in the log has the teacher's number of layers

What cannot be compared exactly (check 5): the two backends never sample the same batch (vLLM samples on
OpenRLHF), so the Lightning figure is computed on the tokens the OpenRLHF job sampled, turned into the
composer's TrajectoryBatch by the plugin's own converter (composer.backends.openrlhf.batch.to_batch, tested on
CPU in tests/test_openrlhf.py). What differs, and is compared: the policy's log-probs (DeepSpeed bf16 vs the
Lightning fp32 forward), the teacher's (reference slot vs the Lightning forward), the advantages (the
plugin's make-experience step vs the objective on the whole step) and the micro-batch sums. The step-0
weights are the initial checkpoint on both sides (one optimiser step per rollout step: train.batch_size is
the step's rows, max_epochs 1).

Starts `ray start --head` when no head is running (and stops it afterwards); exit 0 when every selected
check passes, 1 when one fails, 2 when this machine cannot run the test at all (no GPU, missing packages).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHECKS = ("start", "oapl_sync", "phase_switch", "int_stage1", "loss_step0", "opd_teacher")
COMMON = ("train.eval_every=0", "train.checkpoint_every=1000")
SYNC_EVERY, OAPL_STEPS = 3, 7
PHASE_SWITCH = 2  # global step (0-based) where mintrl's phase 1 (guide: none) starts
BROADCAST_IDLE_S = 0.05  # timing/broadcast of a step without a sync: the patched broadcast returns at once
LOSS_ABS, LOSS_REL = 2e-2, 5e-2  # bf16 DeepSpeed actor vs fp32 Lightning forward
REF_TOL = 0.1  # mean |log-prob difference| per policy token between the reference slot and the teacher
JOB_TIMEOUT_S = 1800
STEP = re.compile(r"Global step (\d+): (\{.*\})")
PAIR = re.compile(r"'([^']+)': (nan|-?inf|-?[0-9][0-9.e+-]*)")
CHECK_LINE = re.compile(r"composer-check: (\{.*\})")
LAYERS = (re.compile(r"\((\d+)-(\d+)\): (\d+) x \w*DecoderLayer"), re.compile(r"\((\d+)\): \w*DecoderLayer"))
SHOWN = ("rollout/reward_mean", "policy_loss", "composer/loss", "composer/synced", "timing/broadcast",
         "composer_guided", "composer_reviews", "composer_offpolicy_frac")


class SmokeError(Exception):
    """This machine cannot run the smoke test (said once, clearly, exit 2)."""


# ------------------------------------------------------------------------------------- reading the log

def step_rows(text: str) -> list[tuple[int, dict]]:
    """OpenRLHF's per-step status lines ("✨ Global step N: {...}", N counted from 1) as (N, numbers)."""
    rows = []
    for m in map(STEP.search, text.splitlines()):
        if m:
            rows.append((int(m.group(1)), {k: float(v) for k, v in PAIR.findall(m.group(2))}))
    return rows


def runs_of(rows: list[tuple[int, dict]]) -> list[list[tuple[int, dict]]]:
    """The rows split into runs: a job's runs follow each other and each counts its steps from 1."""
    runs: list[list] = []
    for n, m in rows:
        if not runs or n <= runs[-1][-1][0]:
            runs.append([])
        runs[-1].append((n, m))
    return runs


def check_report(text: str) -> dict | None:
    """The `composer-check: {...}` line the entry point prints in --check mode."""
    found = [m for m in map(CHECK_LINE.search, text.splitlines()) if m]
    return json.loads(found[-1].group(1)) if found else None


def layers_printed(text: str, actor: str) -> set[int]:
    """Decoder-layer counts in the model prints (`strategy.print(model)`) of Ray actor class `actor`."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        who = re.match(r"\((\w+) pid=(\d+)", line.strip())
        if not who or who.group(1) != actor:
            continue
        for rx in LAYERS:
            for m in rx.finditer(line):
                last = int(m.group(2)) if rx is LAYERS[0] else int(m.group(1))
                counts[who.group(2)] = max(counts.get(who.group(2), 0), last + 1)
    return set(counts.values())


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


# ------------------------------------------------------------------------------------------ the checks

def check_sync(rows: list[tuple[int, dict]], every: int) -> list[str]:
    """Problems with OAPL's lagged sync: synced exactly every `every` steps, broadcasts ~0 in between."""
    if not rows:
        return ["no step was logged"]
    problems = []
    synced = [(n, m.get("composer/synced")) for n, m in rows]
    wrong = [(n, s) for n, s in synced if s != float(n % every == 0)]
    if wrong:
        problems.append(f"composer/synced should be 1 exactly at the steps divisible by {every}: (step, synced) {wrong}")
    if not any(n % every == 0 for n, _ in rows):
        problems.append(f"the job ended before its first sync (step {every}): run it longer")
    idle = [(n, m.get("timing/broadcast")) for n, m in rows if n % every]
    slow = [(n, t) for n, t in idle if not finite(t) or t > BROADCAST_IDLE_S]
    if slow:
        problems.append(f"timing/broadcast between syncs should be ~0 (<= {BROADCAST_IDLE_S}s): (step, s) {slow}")
    busy = [m.get("timing/broadcast") for n, m in rows if n % every == 0]
    if busy and not all(finite(b) for b in busy):
        problems.append(f"sync steps without a broadcast time: {busy}")
    elif busy and idle and not slow and max(t for _, t in idle) >= min(busy):
        problems.append(f"a sync step's broadcast ({busy}) took no longer than the idle ones: weights not sent?")
    return problems


def check_phase(rows: list[tuple[int, dict]], switch: int) -> list[str]:
    """Problems with mintrl's phase switch at global step `switch` (log step n is global step n - 1): the
    judge reviews before it, and from it on nothing is reviewed or guided."""
    before = [(n, m) for n, m in rows if n - 1 < switch]
    after = [(n, m) for n, m in rows if n - 1 >= switch]
    if not before or not after:
        return [f"need steps on both sides of step {switch}; logged {[n for n, _ in rows]}"]
    problems = []
    missing = [n for n, m in rows if "composer_reviews" not in m or "composer_guided" not in m]
    if missing:
        problems.append(f"steps {missing} do not log composer_reviews / composer_guided (the agent's extra logs)")
    quiet = [n for n, m in before if not (m.get("composer_reviews", 0) > 0 or m.get("composer_guided", 0) > 0)]
    if quiet:
        problems.append(f"phase 0 (intervention guide) reviewed nothing at log steps {quiet}")
    still = [(n, m.get("composer_reviews"), m.get("composer_guided")) for n, m in after
             if m.get("composer_reviews", 0) != 0 or m.get("composer_guided", 0) != 0]
    if still:
        problems.append(f"after the switch the guide still acts: (step, reviews, guided) {still}")
    return problems


def check_first_step(rows: list[tuple[int, dict]], rc: int) -> list[str]:
    first = next((m for n, m in rows if n == 1), None)
    if first is None:
        return [f"no 'Global step 1' line (job exit {rc})"]
    loss = first.get("composer/loss", first.get("policy_loss"))
    problems = [] if finite(loss) else [f"step 1 has no finite loss: {first}"]
    return problems + ([f"the job exited {rc}"] if rc else [])


def close(a: float, b: float) -> bool:
    return abs(a - b) <= LOSS_ABS + LOSS_REL * abs(b)


# ------------------------------------------------------------------------------------- running jobs

@dataclass
class Job:
    name: str
    bundle: Path
    rc: int = 0
    log: str = ""
    rows: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def capture(self) -> Path:
        return self.bundle.parent / f"{self.bundle.name}-capture"


def sh(*cmd, check: bool = False, **kw):
    print("$", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=check, **kw)


def compile_spec(spec: str, overrides: list[str], bundle: Path, out: Path) -> None:
    r = sh(sys.executable, "-m", "composer.cli.main", "compile", ROOT / "specs" / f"{spec}.yaml", *COMMON, *overrides,
           "--backend", "openrlhf", "--out", bundle, "--nodes", 1, "--gpus-per-node", 1, "--cluster-dir", out / "runs",
           cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SmokeError(f"composer compile {spec} failed:\n{r.stderr.strip()}")


def instrument(bundle: Path, capture: Path | None) -> None:
    """The bundle's runtime env with every worker log line kept (no Ray dedup: the model prints of two actors
    may repeat) and, with `capture`, smoke_capture.py as the worker setup hook (it runs the composer's first)."""
    path = bundle / "runtime_env.json"
    env = json.loads(path.read_text())
    env["env_vars"]["RAY_DEDUP_LOGS"] = "0"
    if capture is not None:
        shutil.copy2(HERE / "smoke_capture.py", bundle / "composer_smoke_capture.py")
        env["worker_process_setup_hook"] = "composer_smoke_capture.setup_worker"
        env["env_vars"]["COMPOSER_SMOKE_CAPTURE"] = str(capture)
        shutil.rmtree(capture, ignore_errors=True)
    path.write_text(json.dumps(env, indent=1) + "\n")


def stream(cmd: list, cwd: Path, log: Path, tag: str) -> int:
    """Run `cmd`, its output into `log` (step and error lines echoed); killed after JOB_TIMEOUT_S."""
    with open(log, "w") as f:
        p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)

        def pump():
            for line in p.stdout:
                f.write(line)
                if "Global step" in line or "rror" in line or "composer-" in line:
                    print(f"  [{tag}] {line.rstrip()[:300]}", flush=True)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        try:
            rc = p.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 15)
            rc = 124
            print(f"  [{tag}] killed after {JOB_TIMEOUT_S}s", flush=True)
        t.join(timeout=10)
    return rc


def submit(job: Job, address: str, run: str | None = None, check: bool = False) -> Job:
    """The bundle's launch.sh (all its runs), or with `run` that one run through `ray job submit` as launch.sh does."""
    t0 = time.time()
    log = job.bundle / ("check.log" if check else "job.log")
    if run is None:
        cmd = ["bash", job.bundle / "launch.sh", *(["--check"] if check else []), address]
    else:
        cmd = ["ray", "job", "submit", "--address", address, "--runtime-env-json",
               (job.bundle / "runtime_env.json").read_text(), "--", "python", "-m", "composer.backends.openrlhf",
               "--plan", "plan.json", "--run", run, *(["--check"] if check else [])]
    job.rc = stream(cmd, job.bundle, log, job.name)
    job.log = log.read_text(errors="replace")
    job.rows = step_rows(job.log)
    job.seconds = time.time() - t0
    for n, m in job.rows:
        print(f"  [{job.name}] step {n}: " + ", ".join(f"{k}={m[k]:.4g}" for k in SHOWN if k in m), flush=True)
    return job


# ------------------------------------------------------------------- the Lightning figure (check 5, 6)

def captured(job: Job) -> list[dict]:
    import torch

    files = sorted(job.capture.glob("step0-*.pt"))
    return [torch.load(f, weights_only=False) for f in files]


def _cat(tensors, value=0):
    """Right-pad [b, T_k] tensors to one width and concatenate (micro-batches differ in width)."""
    import torch
    import torch.nn.functional as F

    if any(t is None for t in tensors):
        return None
    width = max(t.shape[1] for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def step0_batch(recs: list[dict], pad_id: int, device):
    """(TrajectoryBatch of the whole step 0 in the loss view, raw sequences, attention mask) on `device`."""
    import torch

    from composer.backends.openrlhf.batch import decode_label, group_ids, to_batch

    seqs = _cat([r["sequences"] for r in recs], pad_id).to(device)
    att = _cat([r["attention_mask"] for r in recs]).to(device)
    act = _cat([r["action_mask"] for r in recs]).to(device)
    rlp = _cat([r["rollout_log_probs"] for r in recs])
    rew = None if any(r["rewards"] is None for r in recs) else torch.cat([r["rewards"].reshape(-1) for r in recs])
    prompts = [p for r in recs for p in r["prompts"]]
    labels = [x for r in recs for x in r["labels"]]
    group = group_ids(prompts, [decode_label(x) for x in labels]).to(device)
    batch = to_batch(seqs, att, act, prompts, labels, rollout_log_probs=None if rlp is None else rlp.to(device),
                     rewards=None if rew is None else rew.to(device), group=group, trainable_only=True)
    return batch, seqs, att


def _model(path: str, dtype: str, device):
    from composer.runtime.models import load_model

    return load_model(path, dtype=dtype).to(device).eval()


def _logprobs(model, seqs, att, temperature: float):
    import torch

    from composer.runtime.models import token_logprobs

    with torch.no_grad():
        return token_logprobs(model, seqs, att.bool(), temperature)[0]


def read_plan(bundle: Path) -> dict:
    """The bundle's plan.json with its model paths as this machine reaches them (a toy bundle ships its
    checkpoints under models/, relative to the bundle)."""
    plan = json.loads((bundle / "plan.json").read_text())
    o = plan["openrlhf"]
    o["policy_path"] = os.path.join(bundle, o["policy_path"])
    o["source_paths"] = {k: v if v == "self" else os.path.join(bundle, v) for k, v in o["source_paths"].items()}
    for run in o["runs"]:
        for t in (run["plugin"].get("teachers") or {}).values():
            if t.get("path"):
                t["path"] = os.path.join(bundle, t["path"])
    return plan


def lightning_loss(plan: dict, recs: list[dict]) -> tuple[float | None, str]:
    """The Lightning backend's step-0 loss on the recorded tokens: (value or None, what was compared)."""
    import dataclasses

    import torch

    from composer import step as run_step
    from composer.plan.plan import Plan
    from composer.runtime.models import policy_view

    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = plan["openrlhf"]["runs"][0]
    steps = Plan(plan, run["segments"])
    at = steps.at(steps.offset)
    spec = at.spec
    if spec.train.entropy_coef:
        return None, "the spec has an entropy bonus, which OpenRLHF adds outside the composer's loss"
    policy = _model(plan["openrlhf"]["policy_path"], spec.policy.dtype, device)
    from composer.runtime.models import load_tokenizer

    tok = load_tokenizer(plan["openrlhf"]["policy_path"])
    batch, seqs, att = step0_batch(recs, tok.pad_token_id, device)
    batches = []
    for term in at.terms:
        sig, obj = term.signal, term.declared
        b = dataclasses.replace(batch)
        name = sig.teacher_source
        if name is not None:
            info = run["plugin"]["teachers"][name]
            if info["self"]:
                return None, f"teacher '{name}' is the policy itself (scored in the training step)"
            b.teacher_logprobs = _logprobs(_model(info["path"], spec.policy.dtype, device), seqs, att,
                                           info["temperature"])
        if obj.wants_initial:
            b.initial_logprobs = _logprobs(policy, seqs, att, 1.0)  # step 0: the initial weights are the policy's
        adv = obj.advantages(b)
        b.advantages = None if adv is None else adv.detach()
        batches.append(b)
    with torch.no_grad():
        loss, _ = run_step.loss(at, batches, lambda b, want, read: policy_view(policy, b, want, read))
    return float(loss), f"{batch.size} rows of step 0, {len(recs)} micro-batch(es)"


def check_loss(job: Job) -> list[str]:
    recs = captured(job)
    if not recs:
        return [(f"{job.name}: the training actor recorded no step-0 micro-batch in {job.capture} "
                 "(no 'composer-smoke-capture:' line in the log?)")]
    plan = read_plan(job.bundle)
    rows = sum(len(r["prompts"]) for r in recs)
    gbs = recs[0]["global_batch_size"]
    if gbs is not None and rows != gbs:
        return [f"{job.name}: recorded {rows} step-0 rows, the optimiser step has {gbs}: not one window"]
    theirs = sum(r["loss"] for r in recs)
    ours, what = lightning_loss(plan, recs)
    if ours is None:
        return [f"{job.name}: cannot compare: {what}"]
    print(f"  [{job.name}] step-0 loss: OpenRLHF plugin {theirs:.6g}, Lightning {ours:.6g} ({what})", flush=True)
    if close(theirs, ours):
        return []
    return [f"{job.name}: step-0 loss {theirs:.6g} (OpenRLHF) vs {ours:.6g} (Lightning), beyond "
            + f"{LOSS_ABS} + {LOSS_REL} x |loss|"]


def check_teacher(job: Job) -> list[str]:
    import torch

    from composer.backends.openrlhf.batch import shift
    from composer.runtime.models import load_tokenizer

    recs = captured(job)
    if not recs or any(r["base_action_log_probs"] is None for r in recs):
        return ["no reference-slot log-probs (base_action_log_probs) were recorded at step 0"]
    plan = read_plan(job.bundle)
    info = plan["openrlhf"]["runs"][0]["plugin"]["teachers"]["teacher"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, seqs, att = step0_batch(recs, load_tokenizer(plan["openrlhf"]["policy_path"]).pad_token_id, device)
    ref = shift(_cat([r["base_action_log_probs"] for r in recs]).to(device))
    mask = batch.policy_mask.float()
    n = mask.sum().clamp(min=1)
    dist = {}
    for who, path in (("teacher", info["path"]), ("student", plan["openrlhf"]["policy_path"])):
        lp = _logprobs(_model(path, "float32", device), seqs, att, info["temperature"])
        dist[who] = float(((ref - lp).abs() * mask).sum() / n)
    print(f"  [{job.name}] reference slot vs teacher {dist['teacher']:.4g}, vs student {dist['student']:.4g} "
          "(mean |log-prob difference| per policy token)", flush=True)
    problems = []
    if not (dist["teacher"] <= REF_TOL and dist["teacher"] < dist["student"]):
        problems.append(f"the reference slot's log-probs are not the teacher's: {dist}")
    want = json.loads((Path(info["path"]) / "config.json").read_text()).get("num_hidden_layers")
    printed = layers_printed(job.log, "ReferenceModelActor")
    if printed and printed != {want}:
        problems.append(f"the ReferenceModelActor printed a model of {sorted(printed)} layers, the teacher has {want}")
    if not printed:
        print(f"  [{job.name}] note: no ReferenceModelActor model print in the log (checked the log-probs only)")
    return problems


# --------------------------------------------------------------------------------------------- driver

class Smoke:
    def __init__(self, out: Path, address: str):
        self.out, self.address, self.jobs = out, address, {}

    def job(self, name: str, spec: str, overrides: list[str], capture=False, run=None) -> Job:
        if name not in self.jobs:
            job = Job(name, self.out / name)
            compile_spec(spec, overrides, job.bundle, self.out)
            instrument(job.bundle, job.capture if capture else None)
            self.jobs[name] = submit(job, self.address, run=run)
        return self.jobs[name]

    def oapl(self) -> Job:
        return self.job("oapl", "oapl", [f"sync.every={SYNC_EVERY}", f"train.steps={OAPL_STEPS}"], capture=True)

    def opd(self) -> Job:
        return self.job("opd", "opd", ["train.steps=2"], capture=True)

    def start(self) -> list[str]:
        job = Job("grpo-check", self.out / "grpo")
        compile_spec("grpo", ["train.steps=2"], job.bundle, self.out)
        instrument(job.bundle, None)
        submit(job, self.address, check=True)
        report = check_report(job.log)
        if report is None or job.rc:
            return [f"launch.sh --check: no composer-check report (exit {job.rc}); see {job.bundle / 'check.log'}"]
        problems = [f"launch.sh --check: {p}" for p in report.get("problems", [])]
        ran = submit(Job("grpo", job.bundle), self.address)
        return problems + check_first_step(ran.rows, ran.rc)

    def oapl_sync(self) -> list[str]:
        job = self.oapl()
        return check_sync(job.rows, SYNC_EVERY) + ([f"the job exited {job.rc}"] if job.rc else [])

    def phase_switch(self) -> list[str]:
        job = self.job("mintrl", "mintrl", [f"phases.0.until={PHASE_SWITCH}", f"phases.1.until={PHASE_SWITCH + 2}",
                                            f"train.steps={PHASE_SWITCH + 2}", "train.prompts_per_step=2"])
        return check_phase(job.rows, PHASE_SWITCH) + ([f"the job exited {job.rc}"] if job.rc else [])

    def int_stage1(self) -> list[str]:
        job = self.job("int", "int", ["stages.0.train.steps=1", "stages.1.train.steps=1"], run="sft")
        return check_first_step(job.rows, job.rc)

    def loss_step0(self) -> list[str]:
        return check_loss(self.oapl()) + check_loss(self.opd())

    def opd_teacher(self) -> list[str]:
        job = self.opd()
        return check_teacher(job) + ([f"the job exited {job.rc}"] if job.rc else [])


def require_gpu_stack() -> None:
    """SmokeError unless this machine has an NVIDIA GPU and the packages the jobs need."""
    smi = shutil.which("nvidia-smi")
    listed = subprocess.run([smi, "-L"], check=False, capture_output=True, text=True).stdout if smi else ""
    if "GPU" not in listed:
        raise SmokeError("no NVIDIA GPU on this machine (`nvidia-smi -L` lists none): the smoke test trains with "
                         "vLLM and DeepSpeed on one GPU; run it on a GPU node (CPU checks: tests/test_openrlhf*.py)")
    missing = [m for m in ("torch", "ray", "openrlhf", "vllm", "deepspeed", "flash_attn")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise SmokeError(f"missing Python packages: {', '.join(missing)} (OpenRLHF 0.11.2 with vLLM, DeepSpeed, "
                         "flash-attn and Ray, next to `pip install -e .` of this repository)")
    if shutil.which("ray") is None:
        raise SmokeError("the `ray` command is not on PATH")


def head_running() -> bool:
    return subprocess.run(["ray", "status"], check=False, capture_output=True).returncode == 0


def run_checks(smoke: Smoke, names: list[str]) -> list[tuple[str, list[str]]]:
    results = []
    for name in names:
        t0 = time.time()
        try:
            problems = getattr(smoke, name)()
        except SmokeError as e:
            problems = [str(e)]
        except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check with its reason
            problems = [f"the check itself failed: {type(e).__name__}: {e}"]
        print(f"== {name}: {'ok' if not problems else 'FAILED'} ({time.time() - t0:.0f}s)", flush=True)
        results.append((name, problems))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CHECKS), help=f"checks to run, in this order: {','.join(CHECKS)}")
    ap.add_argument("--out", type=Path, default=Path("/tmp/composer-smoke"))
    ap.add_argument("--address", default="http://127.0.0.1:8265")
    args = ap.parse_args(argv)
    names = [c for c in CHECKS if c in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(CHECKS)
    if unknown or not names:
        print(f"smoke: error: --only takes {', '.join(CHECKS)} (not {', '.join(sorted(unknown)) or 'nothing'})",
              file=sys.stderr)
        return 2
    try:
        require_gpu_stack()
    except SmokeError as e:
        print(f"smoke: error: {e}", file=sys.stderr)
        return 2
    started = not head_running()
    if started:
        if sh("ray", "start", "--head", "--num-gpus", 1, "--disable-usage-stats").returncode:
            print("smoke: error: `ray start --head` failed (see its output above)", file=sys.stderr)
            return 2
        time.sleep(5)
    try:
        results = run_checks(Smoke(args.out.resolve(), args.address), names)  # absolute: workers write there
    finally:
        if started:
            sh("ray", "stop", check=False)
    print("\nsmoke summary (in order):")
    for i, (name, problems) in enumerate(results, 1):
        print(f"  {i} {name}: {'ok' if not problems else 'FAILED'}")
        for p in problems:
            print(f"      - {p}")
    return 0 if all(not p for _, p in results) else 1


if __name__ == "__main__":
    sys.exit(main())
