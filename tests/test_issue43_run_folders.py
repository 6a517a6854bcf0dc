"""Damaged run folders, checkpoints and exports (issue 43, items 3 and 5), and the smaller items of item 2.

- a binary metrics.csv on --resume, and an export from a model folder with an unknown model_type plus
  auto_map: clear errors, exit 2 (were "internal error: ..." tracebacks);
- a checkpoint whose counters disagree with each other or with its run folder's metrics.csv is refused, and
  nothing in the folder changes (was: a tampered global_step deleted metrics rows on resume);
- a seeded fuzz pass: truncated, binary-garbled and wrongly typed metrics.csv, last.ckpt, spec.yaml,
  plan.json, samples files and export files through `run --resume`, `eval`, `export` and `samples`: exit 0 or 2,
  never a traceback or an "internal error". More cases: COMPOSER_FUZZ_RUN_CASES=N (seeded, like
  examples/bench/fuzz_validate.py --cases N);
- an unquoted `data.prompt_template={prompt}` override says to quote it; data errors carry the hint of their
  own reason; a run on a pipe ends with its step lines, not a dumped progress bar; `composer eval` shows
  progress.
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
from test_hostile3 import cli, custom_code_folder, finished_run, tiny  # noqa: F401 (fixtures)
from test_hostile4 import snapshot


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def clean(r, codes=(0, 2)) -> None:
    """Exit 0 or 2, and no traceback or internal error anywhere in the output."""
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert r.exit_code in codes, text[-3000:]
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]


# ------------------------------------------------------------------------------ the two tracebacks


def test_a_binary_metrics_csv_on_resume_is_a_clear_error(run_copy):
    (run_copy / "metrics.csv").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(300)))
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "train.steps=2", "--no-progress")
    clean(r, codes=(2,))
    assert "metrics.csv: not the run's metrics (not UTF-8 text" in r.stderr and "hint:" in r.stderr, r.stderr
    assert snapshot(run_copy) == before


def test_export_from_a_folder_with_an_unknown_model_type_and_auto_map(finished_run, tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = custom_code_folder(tiny, tmp_path / "custom", marker)
    r = cli("export", finished_run, "--base", folder, "--out", tmp_path / "e")
    clean(r, codes=(2,))
    assert "auto_map" in r.stderr and "--trust-remote-code" in r.stderr, r.stderr
    assert not marker.exists() and not (tmp_path / "e").exists()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(cfg))
    r = cli("export", finished_run, "--base", folder, "--out", tmp_path / "e")
    clean(r, codes=(2,))
    assert "model_type 'composer_custom' is not one this transformers knows" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ counters against the run folder


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


# ------------------------------------------------------------------------------ fuzz pass

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


# ------------------------------------------------------------------------------ smaller items


def test_an_unquoted_brace_override_says_to_quote_it():
    """Before: only "Input should be a valid string" (YAML reads {prompt} as the mapping {prompt: null})."""
    r = cli("validate", "specs/grpo.yaml", "data.prompt_template={prompt}")
    assert r.exit_code == 2
    assert "is a mapping, not text" in r.stderr and "'data.prompt_template=\"{prompt}\"'" in r.stderr, r.stderr
    assert cli("validate", "specs/grpo.yaml", 'data.prompt_template="{prompt}"').exit_code == 0


@pytest.mark.parametrize("row, expected", [
    ('{"question": "1+1?", "answer": "2"}', "set data.prompt_field to the name the rows use"),
    ('{"prompt": "1+1?", "answer": "2"', "each line of a .jsonl file is one JSON object"),
    ('{"prompt": "", "answer": "2"}', "remove the rows with an empty 'prompt'"),
    ('[1, 2]', "each row is an object with named fields"),
    ('{"prompt": ["a"], "answer": "2"}', "must hold text"),
])
def test_each_data_error_has_the_hint_of_its_reason(tmp_path, row, expected):
    """Before: every data error of `explain` said "check data.prompt_field / answer_field / split"."""
    (tmp_path / "d.jsonl").write_text(row + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: d\ndata: {{train: {tmp_path / 'd.jsonl'}}}\nsources: {{verifier: {{kind: outcome_reward, "
                    "verifier: math}}\nsignal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    r = cli("explain", spec)
    assert r.exit_code == 2 and expected in r.stderr, r.stderr
    assert "check data.prompt_field / answer_field / split" not in r.stderr


def test_a_run_time_data_error_carries_its_hint():
    from composer.cli.run import _failure
    from composer.errors import DataError
    from composer.runtime.binding import MISSING_FIELD, UNPARSABLE_ANSWER

    msg = _failure(DataError("d.jsonl: row 1: field 'answer': missing", field="answer", reason=MISSING_FIELD))
    assert "hint: the rows have no field 'answer': set data.answer_field" in msg
    msg = _failure(DataError("d.jsonl: row 1: field 'answer': verifier 'math': no number", field="answer",
                             reason=UNPARSABLE_ANSWER))
    assert "composer list verifiers" in msg


def test_composer_eval_shows_progress(run_copy, tmp_path):
    r = cli("eval", run_copy, "--out", tmp_path / "ev")
    clean(r, codes=(0,))
    assert "loading the model" in r.stderr and "eval 1/5 tier1: 2 problem(s), greedy" in r.stderr, r.stderr
    assert "eval 5/5 tier8: pass@1 " in r.stderr and "Loading weights" not in r.stderr
