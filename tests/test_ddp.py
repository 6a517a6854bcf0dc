"""Lightning DDP with two CPU processes (gloo), as `composer run ... train.strategy=ddp train.devices=2` starts
it (issue 15): prompts split by rank from one global batch, groups whole on one rank, each term's loss
scaled by the rank's share of its step-wide normaliser, metrics reduced over ranks, files written by rank 0
only, and a SIGKILL/resume that continues exactly.

What differs from one process of the same global batch, and why: the sampled responses. Each rank samples
its own rows with its own torch generator, so a GRPO run's rollouts (and everything computed from them)
are not the single-process ones. SFT on reference solutions samples nothing, so there the two must agree:
the same loss at every step and the same weights (the test below).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from composer.runtime import checkpoint as ckpt_format

ROOT = Path(__file__).resolve().parent.parent
FAST = ["rollout.max_new_tokens=24", "train.eval_every=0", "train.eval_samples=2", "train.samples_every=0",
        "train.accelerator=cpu", "--no-progress"]
DDP = ["train.strategy=ddp", "train.devices=2"]


def cli(args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1", COMPOSER_THREADS="1")
    env.pop("COMPOSER_RUN_DIR", None)
    return subprocess.Popen([sys.executable, "-m", "composer", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def finish(p, timeout=400):
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    out = p.stdout.read()
    assert rc == 0, out[-4000:]
    return out


def rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("loss")]


def weights(out: Path) -> dict:
    state = ckpt_format.load(out / "checkpoints" / "last.ckpt")
    return {k: v for k, v in state["state_dict"].items() if k.startswith("policy.")}


def test_ddp_sft_equals_one_process_of_the_same_global_batch(tmp_path):
    single = tmp_path / "single"
    ddp = tmp_path / "ddp"
    finish(cli(["run", "specs/sft.yaml", "train.steps=3", "train.prompts_per_step=4", *FAST, "--out", str(single)]))
    finish(cli(["run", "specs/sft.yaml", "train.steps=3", "train.prompts_per_step=2", *DDP, *FAST, "--out", str(ddp)]))
    a, b = rows(single), rows(ddp)  # equal losses need both ranks' prompts: rank 0's two alone give another mean
    assert [r["step"] for r in a] == [r["step"] for r in b] == ["0", "1", "2"]
    for x, y in zip(a, b):  # the global token mean, whichever rank held which tokens
        assert float(x["loss"]) == pytest.approx(float(y["loss"]), rel=1e-5, abs=1e-6), x["step"]
        # counts of the step's rows are sums over the ranks, as one process counts them (issue 56: the ranks' mean)
        for key in ("tokens", "response_tokens"):
            assert float(x[key]) == float(y[key]), (x["step"], key)
    wa, wb = weights(single), weights(ddp)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k
    # rank 0 wrote the run's files; no second run folder, no file of another rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "single"]
    assert (ddp / "model" / "config.json").exists() and (ddp / "report.md").exists()


def test_ddp_grpo_costs_and_metrics_are_reduced_over_ranks(tmp_path):
    out = tmp_path / "grpo"
    log = finish(cli(["run", "specs/grpo.yaml", "train.steps=2", "train.prompts_per_step=2", *DDP, *FAST, "--out",
                      str(out)]))
    r = rows(out)
    assert len(r) == 2
    # the end-of-run reward warning agrees with metrics.csv (issue 56: it read rank 0's rollouts only)
    said = "the reward was 0.0 for every one of" in log
    assert said == all(float(row["reward_mean"]) == 0.0 for row in r), (said, [row["reward_mean"] for row in r])
    # 2 ranks x 2 prompts x 8 samples = 32 rollouts: the generated tokens are summed over the ranks, the mean
    # response length is averaged over them (rank 0's 16 rollouts alone would give half the tokens)
    first = r[0]
    assert abs(float(first["cost/policy_tokens"]) - 32 * float(first["response_len"])) <= 32
    # response_tokens is the step's sum over its rows (docs/runs.md), so over both ranks' rows too (issue 56:
    # it was the ranks' mean, half the step's tokens)
    for row in r:
        assert float(row["response_tokens"]) == pytest.approx(32 * float(row["response_len"]), abs=1e-3), row["step"]


def _watch_rank(rank: int, world: int, store: str, seen: dict) -> None:
    """One DDP rank's reward watch: rank 0's rollouts all scored 0, rank 1's hold a reward of 1."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from composer.runtime.reward_watch import RewardWatch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        watch = RewardWatch()
        for _ in range(3):
            verdicts = [SimpleNamespace(parsed=True, reward=float(rank == 1 and k == 0)) for k in range(4)]
            watch.note("", [SimpleNamespace(info={"verdicts": verdicts})])
        seen[rank] = (watch.problems(), watch.gathered().problems(), watch.gathered().seen[""]["rollouts"])
    finally:
        dist.destroy_process_group()


def test_ddp_reward_warning_reads_every_ranks_rollouts(tmp_path):
    """Issue 56: the end-of-run "the reward was 0.0 for every one of 3 step(s)" came from rank 0's rows alone,
    while metrics.csv (averaged over ranks) showed a reward. The watch's counts are gathered over the ranks."""
    import torch.multiprocessing as mp

    seen = mp.Manager().dict()
    mp.spawn(_watch_rank, args=(2, str(tmp_path / "store"), seen), nprocs=2, join=True)
    alone, together, rollouts = seen[0]
    assert alone and "the reward was 0.0 for every one of 3 step(s)" in alone[0]  # what rank 0 said before
    assert together == [] and rollouts == 24
    assert seen[1][1] == []


def test_ddp_sigkill_then_resume_continues_exactly(tmp_path):
    args = ["specs/sft.yaml", "train.steps=5", "train.prompts_per_step=2", "train.checkpoint_every=2", *DDP, *FAST]
    ref = tmp_path / "ref"
    finish(cli(["run", *args, "--out", str(ref)]))
    out = tmp_path / "killed"
    p = cli(["run", *args, "--out", str(out)])
    ckpt = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)  # both ranks
    p.wait()
    assert ckpt.exists()
    finish(cli(["run", "--resume", str(out), "--no-progress"]))
    want, got = rows(ref), rows(out)
    assert [x["step"] for x in got] == [x["step"] for x in want]
    for a, b in zip(want, got):
        assert a["loss"] == b["loss"], a["step"]
    wa, wb = weights(ref), weights(out)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_each_rank_takes_its_slice_of_the_global_batch():
    """Rank r's prompts are slice r of the prompts one process draws for the whole global batch, step after
    step (same seed, same data position on every rank), so a prompt and its samples stay on one rank."""
    import random

    from components.tasks.toy import toy_task
    from composer.runtime.context import RunContext

    def ctx(rank, world):
        return RunContext(task=toy_task(), tokenizer=None, policy=None, engine=None, rng=random.Random(0),
                          rank=rank, world=world)

    one, r0, r1 = ctx(0, 1), ctx(0, 2), ctx(1, 2)
    for _ in range(3):
        every = [e.prompt for e in one.next_prompts(4)]
        assert [e.prompt for e in r0.next_prompts(2)] + [e.prompt for e in r1.next_prompts(2)] == every


def test_merged_ranks_that_all_scored_zero_still_warn():
    """The legitimate warning survives the gather: every rank's rewards 0 is still "nothing was learned"."""
    from types import SimpleNamespace

    from composer.runtime.reward_watch import RewardWatch

    ranks = []
    for _ in range(2):
        w = RewardWatch()
        w.note("", [SimpleNamespace(info={"verdicts": [SimpleNamespace(parsed=True, reward=0.0)] * 4})])
        ranks.append(w.seen)
    merged = RewardWatch()
    for seen in ranks:
        merged.merge(seen)
    assert merged.seen[""]["steps"] == 1 and merged.seen[""]["rollouts"] == 8
    assert "the reward was 0.0 for every one of 1 step(s), 8 rollouts" in merged.problems()[0]
    assert RewardWatch().gathered().problems() == []  # one process: the watch itself
