"""Run folders (issues 17, 29 and 43): a folder that holds files is never replaced, a folder in use is locked,
a failed start leaves no half-made folder, the environment never hands a run another run's folder; a damaged
run folder gives a message on `run --resume`, `eval`, `export` and `samples`, never a traceback.

- a binary metrics.csv, a bad step cell, a damaged random state on --resume: clear errors, exit 2 (were
  "internal error: ..." tracebacks);
- a checkpoint whose counters disagree with each other or with its run folder's metrics.csv is refused, and
  nothing in the folder changes (was: a tampered global_step deleted metrics rows on resume);
- a seeded fuzz pass: truncated, binary-garbled and wrongly typed metrics.csv, last.ckpt, spec.yaml,
  plan.json, samples files and export files through `run --resume`, `eval`, `export` and `samples`: exit 0 or 2,
  never a traceback or an "internal error". More cases: COMPOSER_FUZZ_RUN_CASES=N (seeded, like
  examples/bench/fuzz_validate.py --cases N).

Output folders of compile, export and eval are in tests/test_output_folders.py; damaged checkpoint fields in
tests/test_checkpoints_damaged.py.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
from _helpers import FAST, clean, cli, composer, snapshot

# --------------------------------- run folders are never replaced, locked while in use, never half made (issues 17, 29)


def test_a_finished_run_folder_is_refused_and_untouched(tiny, tmp_path):
    out = tmp_path / "run"
    args = ["run", "specs/grpo.yaml", f"policy.model={tiny}", "train.steps=1", *FAST, "--no-progress", "--out", out]
    assert cli(*args).exit_code == 0
    before = snapshot(out)
    r = cli(*args[:-2], "train.seed=3", "--out", out)
    assert r.exit_code == 2 and "already holds files" in r.stderr and f"--resume {out}" in r.stderr
    assert snapshot(out) == before
    assert not (out / "checkpoints" / "last-v1.ckpt").exists()


def test_a_folder_in_use_is_locked(tmp_path):
    from composer.backends.lightning.run import RunError, claim_folder

    with claim_folder(tmp_path / "run", resume=False):
        with pytest.raises(RunError, match=f"another run \\(pid {os.getpid()}\\) is using this folder"):
            with claim_folder(tmp_path / "run", resume=True):
                pass


def test_a_failed_start_leaves_no_half_made_folder(tmp_path):
    out = tmp_path / "run"
    r = cli("run", "specs/grpo.yaml", f"policy.model={tmp_path / 'nope'}", "--out", out, "--no-progress")
    assert r.exit_code == 2 and not out.exists()


@pytest.mark.parametrize("out", ["/proc/composer-test", "/sys/composer-test", "FILE", "a" * 300])
def test_unusable_out_folders(tmp_path, out):
    if out == "FILE":
        out = tmp_path / "file"
        out.write_text("keep")
    elif out.startswith("a"):
        out = tmp_path / out
    r = cli("run", "specs/grpo.yaml", "--out", out, "--no-progress")
    assert r.exit_code == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr
    if str(out).endswith("file"):
        assert out.read_text() == "keep"


@pytest.mark.slow
def test_the_environment_never_hands_over_another_runs_folder(finished_run, tiny, tmp_path):
    """COMPOSER_RUN_DIR + LOCAL_RANK set by hand: the run keeps its own --out and lock."""
    before = (finished_run / "checkpoints" / "last.ckpt").read_bytes()
    out = tmp_path / "mine"
    for env in ({"COMPOSER_RUN_DIR": str(finished_run), "LOCAL_RANK": "0"},
                {"COMPOSER_RUN_DIR": str(finished_run), "LOCAL_RANK": "1", "RANK": "1"}):
        shutil.rmtree(out, ignore_errors=True)
        r = composer("run", "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
                     "train.eval_every=0", "train.eval_samples=2", "--no-progress", "--out", out, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert (out / "checkpoints" / "last.ckpt").is_file()
        assert (finished_run / "checkpoints" / "last.ckpt").read_bytes() == before


# ---------------------------------------------------------------------------- damaged files on --resume (issues 29, 43)


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def _copy_run(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def test_resume_with_a_bad_step_cell_in_metrics_csv(finished_run, tmp_path):
    import csv

    out = _copy_run(finished_run, tmp_path)
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    with open(out / "metrics.csv", "a", newline="") as f:
        csv.DictWriter(f, header).writerow({k: "not-a-step" if k == "step" else "" for k in header})
    r = cli("run", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 0, r.output[-2000:]
    assert "not-a-step" not in (out / "metrics.csv").read_text()


def test_resume_with_a_damaged_rng_entry(finished_run, tmp_path):
    import torch

    from composer.runtime import checkpoint as ckpt_format

    out = _copy_run(finished_run, tmp_path)
    ckpt = out / "checkpoints" / "last.ckpt"
    state = ckpt_format.load(ckpt)
    state["composer"]["rng"] = "not a random state"
    torch.save(state, ckpt)
    r = cli("run", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 2 and "training state is damaged" in r.stderr, r.output[-2000:]
    assert "internal error" not in r.stderr


def test_a_binary_metrics_csv_on_resume_is_a_clear_error(run_copy):
    (run_copy / "metrics.csv").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(300)))
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "train.steps=2", "--no-progress")
    clean(r, codes=(2,))
    assert "metrics.csv: not the run's metrics (not UTF-8 text" in r.stderr and "hint:" in r.stderr, r.stderr
    assert snapshot(run_copy) == before


# --------------------------------------------------------------------------- counters against the run folder (issue 43)


def _edit_ckpt(run: Path, edit) -> None:
    import torch

    from composer.runtime import checkpoint as ckpt_format

    path = run / "checkpoints" / "last.ckpt"
    state = ckpt_format.load(path)
    edit(state)
    torch.save(state, path)


def _optim_steps(state: dict, n: int) -> None:
    loop = state["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    loop["total"]["completed"] = n


def test_a_tampered_global_step_is_refused_and_nothing_is_deleted(run_copy):
    """Before: global_step 0 in last.ckpt made the resume cut metrics.csv, samples.jsonl and eval_samples.jsonl
    back to step 0."""
    _edit_ckpt(run_copy, lambda s: s.update(global_step=0))
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "train.steps=2", "--no-progress")
    clean(r, codes=(2,))
    assert "the checkpoint's counters disagree: global_step 0, but its loop counters hold 1" in r.stderr, r.stderr
    assert "nothing in" in r.stderr and snapshot(run_copy) == before


def test_a_checkpoint_ahead_of_its_metrics_is_refused(run_copy):
    """Counters that agree with each other but claim 5 steps where metrics.csv logged 1: not this folder's."""
    def edit(s):
        s["global_step"] = 5
        _optim_steps(s, 5)

    _edit_ckpt(run_copy, edit)
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "train.steps=8", "--no-progress")
    clean(r, codes=(2,))
    assert "the checkpoint is at step 5, but" in r.stderr and "logged only 1 step(s)" in r.stderr, r.stderr
    assert snapshot(run_copy) == before


def test_a_checkpoint_older_than_the_runs_logged_steps_is_refused(run_copy):
    """metrics.csv holds more steps past the checkpoint than one checkpoint interval: a later checkpoint was
    written, this is not the run's last one, and resuming from it would delete those rows."""
    path = run_copy / "metrics.csv"
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    header = list(rows[0])
    train_row = next(r for r in rows if r["loss"])
    extra = [{**train_row, "step": str(s)} for s in range(1, 60)]  # checkpoint_every is 50
    with open(path, "a", newline="") as f:
        csv.DictWriter(f, header).writerows(extra)
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "train.steps=70", "--no-progress")
    clean(r, codes=(2,))
    assert "more than one checkpoint interval (train.checkpoint_every 50) past it" in r.stderr, r.stderr
    assert snapshot(run_copy) == before


def test_a_good_resume_on_a_pipe_ends_with_step_lines_not_a_progress_bar(run_copy):
    """The counters check lets the run's own checkpoint through; without --no-progress and without a terminal
    (CliRunner's stderr, a pipe, CI) the output has step lines and no dumped Rich/TQDM bar."""
    r = cli("run", "--resume", run_copy, "train.steps=2")
    clean(r, codes=(0,))
    assert "step 2/2" in r.stderr, r.stderr
    assert "Training steps" not in r.output and "━" not in r.output and "it/s" not in r.output, r.output[-2000:]


# ------------------------------------------------------------------------------ fuzz pass (issue 43)


DATA_ROWS = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 2 + 3?", "answer": "5"}]
WRONG = [None, [], [1, "x"], {"a": 1}, "text", -1, 1.5e308, True]


def truncate(path: Path, rnd: random.Random) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:rnd.randrange(0, max(len(raw), 1))])


def garble(path: Path, rnd: random.Random) -> None:
    raw = bytearray(path.read_bytes())
    start = rnd.randrange(0, max(len(raw), 1))
    raw[start:start + 64] = bytes(rnd.randrange(256) for _ in range(64))
    path.write_bytes(bytes(raw))


def wrong_types(path: Path, rnd: random.Random) -> None:
    """A value of another type where the file holds one: JSON and JSON lines values, YAML sections, CSV cells
    (the step column included), checkpoint entries."""
    if path.suffix == ".ckpt":
        def edit(s):
            key = rnd.choice(["global_step", "loops", "composer", "state_dict", "composer.spec", "composer.rng"])
            if key.startswith("composer."):
                s["composer"][key.split(".", 1)[1]] = rnd.choice(WRONG)
            else:
                s[key] = rnd.choice(WRONG)
        _edit_ckpt(path.parent.parent, edit)
    elif path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data and rnd.random() < 0.8:
            data[rnd.choice(sorted(data))] = rnd.choice(WRONG)
        else:
            data = rnd.choice(WRONG)
        path.write_text(json.dumps(data))
    elif path.suffix == ".jsonl":
        lines = []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if rnd.random() < 0.5 and isinstance(row, dict):
                row[rnd.choice(sorted(row))] = rnd.choice(WRONG)
            lines.append(json.dumps(row) if rnd.random() < 0.8 else json.dumps(rnd.choice(WRONG)))
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix == ".yaml":
        import yaml

        data = yaml.safe_load(path.read_text())
        data[rnd.choice(sorted(data))] = rnd.choice(WRONG)
        path.write_text(yaml.safe_dump(data))
    else:  # csv
        rows = list(csv.reader(io.StringIO(path.read_text())))
        for r in rows[1:]:
            for i in range(len(r)):
                if rnd.random() < 0.3:
                    r[i] = json.dumps(rnd.choice(WRONG))
        buf = io.StringIO()
        csv.writer(buf).writerows(rows)
        path.write_text(buf.getvalue())


MUTATIONS = {"truncate": truncate, "garble": garble, "types": wrong_types}
# (file in the run folder, commands that read it); `resume+` trains one more step, `resume` is the finished run's
RESUME_MORE = ("run", "--resume", "{run}", "train.steps=2", "--no-progress")
COMMANDS = {
    "resume+": RESUME_MORE,
    "resume": ("run", "--resume", "{run}", "--no-progress"),
    "eval": ("eval", "{run}", "--out", "{tmp}/ev"),
    "export": ("export", "{run}", "--out", "{tmp}/exp"),
    "samples": ("samples", "{run}"),
    "eval-export": ("eval", "{run}/model", "--data", "{tmp}/d.jsonl", "--out", "{tmp}/ev2"),
    "export-over": ("export", "{run}", "--out", "{run}/model"),
}
TARGETS = {
    "checkpoints/last.ckpt": ("resume+", "resume", "eval", "export"),
    "metrics.csv": ("resume+",),
    "spec.yaml": ("resume+", "eval"),
    "plan.json": ("resume",),
    "samples.jsonl": ("samples",),
    "model/config.json": ("eval-export",),
    "model/composer_export.json": ("eval-export", "export-over"),
    "model/tokenizer_config.json": ("eval-export",),
}
# every file with each mutation once, each case one command the file is read by (seeded)
SEEDED = [(f, m, TARGETS[f][i % len(TARGETS[f])]) for i, (f, m) in
          enumerate((f, m) for f in TARGETS for m in MUTATIONS)]


def cases() -> list[tuple[str, str, str, int]]:
    n = int(os.environ.get("COMPOSER_FUZZ_RUN_CASES", "0") or 0)
    rnd = random.Random(43)
    extra = []
    for i in range(n):
        f = rnd.choice(sorted(TARGETS))
        extra.append((f, rnd.choice(sorted(MUTATIONS)), rnd.choice(TARGETS[f]), 1000 + i))
    return [(f, m, c, i) for i, (f, m, c) in enumerate(SEEDED)] + extra


@pytest.mark.parametrize("target, how, command, seed", cases(),
                         ids=[f"{c[1]}-{c[0].replace('/', '_')}-{c[2]}-{c[3]}" for c in cases()])
def test_damaged_run_folders_never_crash_a_command(finished_run, tmp_path, target, how, command, seed):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DATA_ROWS))
    MUTATIONS[how](run / target, random.Random(seed))
    args = [a.format(run=run, tmp=tmp_path) for a in COMMANDS[command]]
    clean(cli(*args))
