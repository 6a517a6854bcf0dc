"""What a run keeps besides metrics: rollout samples, the exported policy, its loggers, and the checks of
every path it reads before anything is written (issue 15). Real toy runs of 2-3 steps."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from _helpers import cli, composer

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=1", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "train.eval_every=0", "train.eval_samples=2"]
GUIDED = ["train.steps=2", "phases.0.until=1", "phases.1.until=2", "train.prompts_per_step=1",
          "rollout.samples_per_prompt=4", "rollout.guide.control_samples=2", "train.eval_every=0",
          "train.eval_samples=2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def train_run(spec: str, out: Path, overrides: list[str], resume: bool = False, **kw):
    from composer.backends.lightning.run import train

    return train(validate_file(ROOT / spec, overrides), out, resume=resume, progress=False, **kw)


def samples_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------ samples


def test_a_run_writes_samples_and_the_samples_command_prints_them(cli, tiny, tmp_path):
    out = tmp_path / "run"
    r = cli("run", "specs/grpo.yaml", f"policy.model={tiny}", "train.steps=3", "train.samples_every=2", *FAST,
            "--no-progress", "--out", out)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith(f"model: {out / 'model'}")  # the final console line
    rows = samples_of(out)
    assert sorted({r["step"] for r in rows}) == [0, 2]  # every 2nd step, and the last one
    assert len(rows) == 2 * 2  # every rollout of those steps: 1 prompt x 2 samples
    row = rows[0]
    for key in ("step", "prompt", "response", "spans", "reward", "verifier", "answer"):
        assert key in row, key
    assert row["prompt"].startswith("Q:") and isinstance(row["reward"], float)
    assert {s["origin"] for r in rows for s in r["spans"]} == {"policy"}
    assert "".join(s["text"] for s in row["spans"]) == row["response"]
    assert "detail" in row["verifier"]

    shown = cli("samples", out)  # default: the last step written; not a terminal: plain text
    assert shown.exit_code == 0 and "step 2: 2 of 2 samples" in shown.stdout
    assert shown.stdout.count("reward ") == 2 and "\x1b[" not in shown.stdout
    assert cli("samples", out, "--step", 0, "--limit", 1).stdout.count("reward ") == 1
    missing = cli("samples", out, "--step", 1)
    assert missing.exit_code == 2 and "steps with samples: 0, 2" in missing.stderr


def test_guided_samples_show_the_guide_spans_and_the_judges_corrections(cli, tiny, tmp_path):
    out = tmp_path / "run"
    train_run("specs/mintrl.yaml", out, [f"policy.model={tiny}", *GUIDED])
    rows = samples_of(out)
    assert sorted({r["step"] for r in rows}) == [0, 1] and len(rows) == 8
    guided = [r for r in rows if r["guided"]]
    assert guided and all(r["segment"] == "phase0" for r in guided)
    g = guided[0]
    assert "guide_intervention" in {s["origin"] for s in g["spans"]}
    assert g["guide"]["corrections"] and g["guide"]["reviews"] >= 1
    assert any(r["guide"].get("reviews") == 0 for r in rows if r["control"] and r["step"] == 0)  # controls
    assert all("guide" not in r for r in rows if r["step"] == 1)  # phase 1: no guide
    shown = cli("samples", out, "--step", 0)
    text = next(s["text"] for s in g["spans"] if s["origin"] == "guide_intervention")
    assert f"[[{text}]]" in shown.stdout and "judge corrections:" in shown.stdout


def test_resume_writes_no_sample_twice(tiny, tmp_path):
    out = tmp_path / "run"
    base = [f"policy.model={tiny}", "train.samples_every=1", "train.checkpoint_every=1", *FAST]
    train_run("specs/grpo.yaml", out, base + ["train.steps=2"])
    before = samples_of(out)
    assert [r["step"] for r in before] == [0, 0, 1, 1]
    with open(out / "samples.jsonl", "a") as f:  # what a run killed after step 2's samples, before its
        f.write(json.dumps({**before[-1], "step": 2}) + "\n")  # checkpoint, leaves: a row past the checkpoint
        f.write('{"step": 2, "prompt": "cut o')  # and half a line
    train_run("specs/grpo.yaml", out, base + ["train.steps=3"], resume=True)
    after = samples_of(out)
    assert [r["step"] for r in after] == [0, 0, 1, 1, 2, 2]
    assert after[:4] == before


def test_sample_writing_never_stops_a_run(tiny, tmp_path, monkeypatch, caplog):
    from composer.runtime import samples

    def full_disk(path, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(samples, "append", full_disk)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="composer"):
        final = train_run("specs/grpo.yaml", out, [f"policy.model={tiny}", "train.steps=2", *FAST])
    assert final and (out / "report.md").exists() and not (out / "samples.jsonl").exists()
    assert sum("No space left" in m for m in caplog.messages) == 1  # one warning, the run went on


# ------------------------------------------------------------------------------------------ export


def test_the_exported_model_computes_the_trained_policys_logits(cli, tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([[3, 7, 11, 5, 2, 9]])
    trained = {}

    def final_eval(ctx, policy):
        policy.eval()
        with torch.no_grad():
            trained["logits"] = policy(input_ids=ids).logits.clone()

    out = tmp_path / "run"
    sft = [o for o in FAST if not o.startswith("rollout.samples")]  # SFT samples no rollouts
    train_run("specs/sft.yaml", out, [f"policy.model={tiny}", "train.steps=2", "train.lr=1e-3", *sft],
              final_eval=final_eval)
    with torch.no_grad():
        initial = AutoModelForCausalLM.from_pretrained(tiny)(input_ids=ids).logits
    assert not torch.equal(initial, trained["logits"])  # it trained
    exported = AutoModelForCausalLM.from_pretrained(out / "model")
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained["logits"])
    assert AutoTokenizer.from_pretrained(out / "model").get_vocab() == AutoTokenizer.from_pretrained(tiny).get_vocab()
    assert f"AutoModelForCausalLM.from_pretrained(\"{out / 'model'}\")" in (out / "report.md").read_text()

    for src in (out, out / "checkpoints" / "last.ckpt"):  # a run folder, or the checkpoint itself
        dest = tmp_path / f"export-{src.name}"
        r = cli("export", src, "--out", dest)
        assert r.exit_code == 0, r.stderr
        with torch.no_grad():
            assert torch.equal(AutoModelForCausalLM.from_pretrained(dest)(input_ids=ids).logits, trained["logits"])
    bad = cli("export", tmp_path / "nope", "--out", tmp_path / "x")
    assert bad.exit_code == 2 and "no such checkpoint or run folder" in bad.stderr
    taken = cli("export", out, "--out", out)  # a folder of other files is never replaced
    assert taken.exit_code == 2 and "not an earlier export" in taken.stderr


# ------------------------------------------------------------------------------------------ early errors


@pytest.mark.parametrize("case", ["missing", "no_config", "hub_id", "tokenizer", "data", "source"])
def test_every_path_is_checked_before_the_run_folder_exists(cli, tmp_path, case):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "no" / "model"
    spec, ov, want = {
        "missing": ("grpo", [f"policy.model={missing}"], f"no such model directory: {missing}"),
        "no_config": ("grpo", [f"policy.model={empty}"], f"{empty}: the directory has no config.json"),
        "hub_id": ("grpo", ["policy.model=some-org/some-model"], "hub id (org/name) needs network access"),
        "tokenizer": ("grpo", [f"policy.tokenizer={missing}"], f"no such tokenizer directory: {missing}"),
        "data": ("grpo", [f"data.train={tmp_path / 'train.jsonl'}"], f"no such data file: {tmp_path / 'train.jsonl'}"),
        "source": ("opd", [f"sources.teacher.model={missing}"], "sources.teacher.model: no such model directory"),
    }[case]
    out = tmp_path / "run"
    r = cli("run", f"specs/{spec}.yaml", *ov, "--out", out, "--no-progress")
    assert r.exit_code == 2 and want in r.stderr, r.stderr
    assert "Repo id" not in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_train_checks_paths_itself_and_the_loader_names_a_missing_directory(tmp_path):
    from composer.runtime.paths import PathError
    from composer.runtime.models import ModelLoadError, load_model

    missing = tmp_path / "no" / "model"
    with pytest.raises(PathError, match="no such model directory"):
        train_run("specs/grpo.yaml", tmp_path / "run", [f"policy.model={missing}"])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ModelLoadError, match=f"^no such model directory: {missing}$"):
        load_model(str(missing))


# ------------------------------------------------------------------------------------------ loggers


def test_a_chosen_logger_whose_package_is_missing_is_refused_before_anything_is_written(cli, tmp_path,
                                                                                          monkeypatch):
    from composer.runtime import paths

    monkeypatch.setattr(paths, "installed", lambda module: False)
    out = tmp_path / "run"
    r = cli("run", "specs/grpo.yaml", "train.loggers=[csv,wandb,mlflow]", "--out", out, "--no-progress")
    assert r.exit_code == 2 and "pip install wandb" in r.stderr and "pip install mlflow" in r.stderr
    assert not out.exists()
    r = cli("run", "specs/grpo.yaml", "train.loggers=[csv,csv]", "--out", out, "--no-progress")
    assert r.exit_code == 2 and "a logger is listed twice" in r.stderr


def offline_loggers(monkeypatch, tmp_path: Path) -> None:
    """W&B offline and MLflow in a file store under tmp_path: no server, nothing leaves the machine."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())


def test_loggers_csv_only_and_the_optional_ones(tiny, tmp_path, monkeypatch):
    """csv alone writes metrics.csv and nothing else; each optional logger that is installed records the run
    (wandb offline, mlflow in a file: store, tensorboard with the samples as text)."""
    from composer.runtime.paths import installed

    out = tmp_path / "csv"
    train_run("specs/grpo.yaml", out, [f"policy.model={tiny}", "train.steps=2", "train.loggers=[csv]", *FAST])
    assert (out / "metrics.csv").exists() and not (out / "tensorboard").exists()

    have = [k for k, m in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")) if installed(m)]
    if not have:
        pytest.skip("none of tensorboard, wandb, mlflow is installed")
    offline_loggers(monkeypatch, tmp_path)
    out = tmp_path / "all"
    train_run("specs/grpo.yaml", out, [f"policy.model={tiny}", "train.steps=2", "train.samples_every=1",
                                       f"train.loggers=[csv,{','.join(have)}]", *FAST])
    assert len(samples_of(out)) == 4 and (out / "metrics.csv").exists()
    if "tensorboard" in have:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tags = set()
        for f in (out / "tensorboard").glob("events.out.tfevents.*"):
            ea = EventAccumulator(str(f), size_guidance={"tensors": 0})
            ea.Reload()
            tags |= set(ea.Tags()["tensors"]) | set(ea.Tags()["scalars"])
        assert "samples/text_summary" in tags and "loss" in tags
    ids = json.loads((out / "loggers.json").read_text()) if {"wandb", "mlflow"} & set(have) else {}
    if "wandb" in have:
        assert list((out / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    if "mlflow" in have:
        run = next((tmp_path / "mlruns").glob(f"*/{ids['mlflow']}"))
        assert (run / "metrics" / "loss").exists() and list((run / "params").iterdir())
        assert "status: 3" in (run / "meta.yaml").read_text()  # FINISHED
        assert list((run / "artifacts" / "samples").glob("step-*.md"))


def test_a_resumed_run_records_each_step_once_in_mlflow_and_wandb(tiny, tmp_path, monkeypatch):
    """A run killed after logging a step but before its checkpoint trains that step again on --resume;
    the W&B and MLflow runs it continues already hold it: each step is recorded once (before: MLflow's
    history held the re-run step twice)."""
    import shutil

    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    offline_loggers(monkeypatch, tmp_path)
    out = tmp_path / "run"
    base = [f"policy.model={tiny}", "train.checkpoint_every=1", "train.loggers=[csv,wandb,mlflow]", *FAST]
    train_run("specs/grpo.yaml", out, base + ["train.steps=2"])
    shutil.copytree(out / "checkpoints", tmp_path / "at2")
    train_run("specs/grpo.yaml", out, base + ["train.steps=3"], resume=True)
    shutil.rmtree(out / "checkpoints")  # killed after step 3 was logged, before its checkpoint was written
    shutil.copytree(tmp_path / "at2", out / "checkpoints")
    train_run("specs/grpo.yaml", out, base + ["train.steps=3"], resume=True)
    ids = json.loads((out / "loggers.json").read_text())
    run = next((tmp_path / "mlruns").glob(f"*/{ids['mlflow']}"))
    steps = [int(line.split()[2]) for line in (run / "metrics" / "loss").read_text().splitlines()]
    assert steps == [0, 1, 2]
    import csv

    with open(out / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f) if r.get("loss")] == ["0", "1", "2"]


# ------------------------------------------------------------------------- composer samples on hostile files (issue 29)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_samples_on_a_fifo_or_dev_zero_does_not_hang(tmp_path, kind):
    target = tmp_path / "samples.jsonl"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    r = composer("samples", tmp_path, timeout=60)
    assert r.returncode == 2 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


GOOD = {"step": 1, "row": 1, "prompt": "p", "spans": [{"text": "a", "origin": "policy"}], "reward": 1.0}


MALFORMED = [
    {**GOOD, "spans": "text"},
    {**GOOD, "spans": [1, 2]},
    {**GOOD, "spans": [{"text": 5}]},
    {**GOOD, "reward": "high"},
    {**GOOD, "guide": [1]},
    {**GOOD, "verifier": "ok"},
    {**GOOD, "guide": {"verdicts": 3, "reviews": 1}},
    {**GOOD, "step": True},
    {**GOOD, "spans": [{"text": "x", "origin": {"a": 1}}]},
]


@pytest.mark.parametrize("i", range(len(MALFORMED)))
def test_samples_skips_malformed_rows_without_a_traceback(tmp_path, i):
    (tmp_path / "samples.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(MALFORMED[i]) + "\n")
    r = cli("samples", tmp_path)
    assert r.exit_code == 0 and "1 unreadable line skipped" in r.stderr, r.output


def test_samples_never_sends_escape_bytes_to_the_terminal(tmp_path):
    row = {**GOOD, "prompt": "\x1b]0;pwned\x07\x1b[2J", "spans": [{"text": "\x1b[31mred\x9b", "origin": "policy"}]}
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n")
    r = cli("samples", tmp_path)
    assert r.exit_code == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout and "\x9b" not in r.stdout
    assert "\\x1b[31mred" in r.stdout


# -------------------------------------------------------------------------- loggers: MLflow at a closed port (issue 29)


def test_mlflow_at_a_closed_port_is_a_clear_error(tmp_path):
    pytest.importorskip("mlflow")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = composer("run", "specs/sft.yaml", "train.steps=1", "train.loggers=[csv,mlflow]", "--out", tmp_path / "o",
                 "--no-progress", env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}, timeout=120)
    assert r.returncode == 2 and "tracking server" in r.stderr and "does not answer" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()
