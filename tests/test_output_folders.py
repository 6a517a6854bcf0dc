"""Output folders never lose a user's files (issue 57, item 1).

`composer compile --out DIR` and `composer export --out DIR` used to delete DIR whole when it held an earlier
bundle (plan.json, launch.sh, args.json) or export (composer_export.json), whatever else it held. Now each
writes the list of its files into its manifest (composer_bundle.json, composer_export.json) and, writing
again, replaces or removes only those: the user's files beside them are kept, and a user's file where the new
output goes refuses the command (exit 2, nothing changed).

A run folder's files are never written through a symbolic link: a planted metrics.csv.tmp link used to make
`composer run --resume` write the metrics outside the run folder.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from _helpers import snapshot
from click.testing import CliRunner

from composer.cli.main import main

REPO = Path(__file__).resolve().parent.parent
NO_TRUST = {"COMPOSER_TRUST_REMOTE_CODE": "", "COMPOSER_ALLOW_PLUGINS": ""}


def cli(*args):
    return CliRunner(env=NO_TRUST).invoke(main, [str(a) for a in args], catch_exceptions=False)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (links as the text `link -> target`)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = f"link -> {p.readlink()}".encode()
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


def listed(folder: Path, manifest: str) -> list[str]:
    return json.loads((folder / manifest).read_text())["files"]


def relist(folder: Path, manifest: str, change) -> None:
    """Edit the manifest's file list (as an earlier output that wrote other files would have recorded it)."""
    data = json.loads((folder / manifest).read_text())
    data["files"] = change(data["files"])
    (folder / manifest).write_text(json.dumps(data))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


# ------------------------------------------------------------------------------ composer compile --out


def compile_(tiny, out: Path):
    return cli("compile", REPO / "specs/grpo.yaml", f"policy.model={tiny}", "--backend", "openrlhf", "--out", out)


def test_compiling_again_keeps_the_users_files_beside_the_bundle(tiny, tmp_path):
    out = tmp_path / "b"
    assert compile_(tiny, out).exit_code == 0
    files = listed(out, "composer_bundle.json")
    assert {"plan.json", "launch.sh", "args.json", "composer_bundle.json", "composer/__init__.py"} <= set(files)
    (out / "notes.txt").write_text("my notes")
    (out / "results").mkdir()
    (out / "results" / "run1.csv").write_text("step,reward\n1,0.5\n")
    (out / "stale.txt").write_text("the earlier bundle's")
    (out / "composer" / "stale.py").write_text("# the earlier bundle's")
    relist(out, "composer_bundle.json", lambda names: names + ["stale.txt", "composer/stale.py"])
    r = compile_(tiny, out)
    assert r.exit_code == 0, r.output
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "results" / "run1.csv").read_text() == "step,reward\n1,0.5\n"
    assert not (out / "stale.txt").exists() and not (out / "composer" / "stale.py").exists()  # the bundle's: gone
    assert (out / "launch.sh").stat().st_mode & 0o111 and json.loads((out / "plan.json").read_text())["openrlhf"]
    assert sorted(listed(out, "composer_bundle.json")) == sorted(files)  # the user's files are never listed
    assert not list(tmp_path.glob(".b.partial-*"))


def test_a_users_file_where_the_bundle_writes_refuses_the_compile(tiny, tmp_path):
    out = tmp_path / "b"
    assert compile_(tiny, out).exit_code == 0
    relist(out, "composer_bundle.json", lambda names: [n for n in names if n != "command.txt"])
    (out / "command.txt").write_text("my own command.txt")
    before = tree(out)
    r = compile_(tiny, out)
    assert r.exit_code == 2 and "command.txt" in r.stderr and "nothing was changed" in r.stderr, r.output
    assert "Traceback" not in r.output and tree(out) == before and not list(tmp_path.glob(".b.partial-*"))


def test_an_older_bundle_without_a_list_keeps_the_files_it_did_not_write(tiny, tmp_path):
    out = tmp_path / "b"
    assert compile_(tiny, out).exit_code == 0
    (out / "composer_bundle.json").unlink()  # as an older version wrote it
    (out / "notes.txt").write_text("mine")
    (out / "data" / "my-split.jsonl").write_text("{}\n")
    r = compile_(tiny, out)
    assert r.exit_code == 0, r.output
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "my-split.jsonl").read_text() == "{}\n"
    assert "notes.txt" not in listed(out, "composer_bundle.json")


def test_a_project_folder_with_a_bundles_names_is_refused(tiny, tmp_path):
    """plan.json, launch.sh and args.json alone do not make a bundle: before, the folder was deleted whole."""
    out = tmp_path / "project"
    out.mkdir()
    for name in ("plan.json", "launch.sh", "args.json"):
        (out / name).write_text("{}" if name.endswith(".json") else "#!/bin/sh\n")
    (out / "src").mkdir()
    (out / "src" / "main.py").write_text("print('mine')\n")
    before = tree(out)
    r = compile_(tiny, out)
    assert r.exit_code == 2 and "not a bundle" in r.stderr and "hint:" in r.stderr, r.output
    assert tree(out) == before


def test_a_manifest_listing_a_path_outside_the_folder_is_refused(tiny, tmp_path):
    out = tmp_path / "b"
    assert compile_(tiny, out).exit_code == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    relist(out, "composer_bundle.json", lambda names: names + ["../victim.txt"])
    r = compile_(tiny, out)
    assert r.exit_code == 2 and "../victim.txt" in r.stderr, r.output
    assert victim.read_text() == "keep me"


def test_a_linked_out_folder_is_refused(tiny, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(real)
    r = compile_(tiny, tmp_path / "link")
    assert r.exit_code == 2 and "symbolic link" in r.stderr, r.output
    assert tree(real) == {"notes.txt": b"mine"}


# ------------------------------------------------------------------------------ composer export --out


@pytest.fixture(scope="module")
def finished_run(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    r = cli("run", REPO / "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
            "train.eval_every=0", "train.eval_samples=2", "--no-progress", "--out", out)
    assert r.exit_code == 0, r.output
    return out


def test_exporting_again_keeps_the_users_files_beside_the_export(finished_run, tmp_path):
    out = tmp_path / "e"
    assert cli("export", finished_run, "--out", out).exit_code == 0
    files = listed(out, "composer_export.json")
    assert {"config.json", "model.safetensors", "composer_export.json"} <= set(files)
    (out / "README.md").write_text("my model card")
    (out / "evals").mkdir()
    (out / "evals" / "gsm8k.json").write_text("{}")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"an earlier, sharded export")
    relist(out, "composer_export.json", lambda names: names + ["model-00002-of-00002.safetensors"])
    r = cli("export", finished_run, "--out", out)
    assert r.exit_code == 0, r.output
    assert (out / "README.md").read_text() == "my model card" and (out / "evals" / "gsm8k.json").read_text() == "{}"
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert sorted(listed(out, "composer_export.json")) == sorted(files)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_an_older_export_without_a_list_keeps_the_files_it_did_not_write(finished_run, tmp_path):
    out = tmp_path / "e"
    assert cli("export", finished_run, "--out", out).exit_code == 0
    relist(out, "composer_export.json", lambda names: None)  # as an older version wrote it: no list
    (out / "notes.txt").write_text("mine")
    (out / "pytorch_model.bin").write_bytes(b"an earlier export's weights")  # a name save_pretrained writes
    r = cli("export", finished_run, "--out", out)
    assert r.exit_code == 0, r.output
    assert (out / "notes.txt").read_text() == "mine" and not (out / "pytorch_model.bin").exists()
    assert "notes.txt" not in listed(out, "composer_export.json")


def test_a_users_file_where_the_export_writes_refuses_the_export(finished_run, tmp_path):
    out = tmp_path / "e"
    assert cli("export", finished_run, "--out", out).exit_code == 0
    relist(out, "composer_export.json", lambda names: [n for n in names if n != "config.json"])
    (out / "config.json").write_text('{"mine": true}')
    before = tree(out)
    r = cli("export", finished_run, "--out", out)
    assert r.exit_code == 2 and "config.json" in r.stderr and "nothing was changed" in r.stderr, r.output
    assert "Traceback" not in r.output and tree(out) == before


# ------------------------------------------------------------------------------ run folders: no write through a link


def test_a_planted_metrics_tmp_link_never_carries_the_metrics_out(finished_run, tmp_path):
    """Before: `--resume` rewrote metrics.csv through metrics.csv.tmp, a link to a file outside the run."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (run / "metrics.csv.tmp").symlink_to(victim)
    r = cli("run", "--resume", run, "train.steps=2", "--no-progress")
    assert r.exit_code == 2 and "metrics.csv.tmp" in r.stderr and "symbolic link" in r.stderr, r.output
    assert victim.read_text() == "keep me" and "Traceback" not in r.output
    (run / "metrics.csv.tmp").unlink()  # the fix the message gives: the run resumes
    (run / "wandb" / "run-1").mkdir(parents=True)
    (run / "wandb" / "latest-run").symlink_to("run-1")  # W&B's own links inside wandb/ are its business
    r = cli("run", "--resume", run, "train.steps=2", "--no-progress")
    assert r.exit_code == 0, r.output
    with open(run / "metrics.csv", newline="") as f:
        assert {row["step"] for row in csv.DictReader(f) if row.get("loss")} == {"0", "1"}


def test_the_metrics_writer_never_writes_through_a_link(tmp_path):
    """What the run's start checks, the writer itself keeps: a link that appears later is refused too."""
    from composer import files
    from composer.backends.lightning.callbacks import RunCSVLogger

    victim = tmp_path / "victim.csv"
    victim.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.csv").write_text("loss,step\n1.0,0\n0.9,1\n")  # as the logger writes it: columns sorted
    (out / "metrics.csv.tmp").symlink_to(victim)  # a rewrite goes through a new temporary name, never this
    logger = RunCSVLogger(out, keep_before=1)
    logger.log_metrics({"loss": 0.8}, step=1)
    assert victim.read_text() == "keep me" and not (out / "metrics.csv").is_symlink()
    assert (out / "metrics.csv").read_text().splitlines()[1:] == ["1.0,0", "0.8,1"]
    (out / "metrics.csv").unlink()
    (out / "metrics.csv").symlink_to(victim)  # appending
    with pytest.raises(files.LinkError, match="symbolic link"):
        logger.log_metrics({"loss": 0.7}, step=2)
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("writer", ["samples", "eval_samples", "atomic"])
def test_run_files_are_never_written_through_a_link(tmp_path, writer):
    from composer import files
    from composer.runtime import samples
    from composer.runtime.evaluate import write_records

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    name, write = {
        "samples": ("samples.jsonl", lambda p: samples.append(p, [{"step": 1}])),
        "eval_samples": ("eval_samples.jsonl", lambda p: write_records(p.parent, 1, [{"reward": 1.0}])),
        "atomic": ("report.md", lambda p: files.write_text(p, "report")),
    }[writer]
    path = tmp_path / "run" / name
    path.parent.mkdir()
    write(path)  # the legitimate case: a regular file, written
    assert path.read_text().strip()
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(files.LinkError, match="symbolic link"):
        write(path)
    assert victim.read_text() == "keep me"


def test_a_checkpoint_is_never_written_through_a_link_at_its_temporary_name(tmp_path):
    """last.ckpt.tmp is the checkpoint writer's own name: a link there is removed, never written through."""
    from composer.runtime import checkpoint

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = tmp_path / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    (path.parent / "last.ckpt.tmp").symlink_to(victim)
    checkpoint.save({"global_step": 3}, path)
    assert victim.read_text() == "keep me" and not (path.parent / "last.ckpt.tmp").exists()
    import torch

    assert not path.is_symlink() and torch.load(path, weights_only=True) == {"global_step": 3}


# ------------------------------------------------ toy-data --out, compile --out into a folder of other files (issue 17)


def test_toy_data_writes_and_refuses_to_overwrite(tmp_path):
    r = cli("toy-data", "--out", tmp_path / "d", "--seed", 3)
    assert r.exit_code == 0 and (tmp_path / "d" / "train.jsonl").stat().st_size > 0
    before = snapshot(tmp_path / "d")
    r = cli("toy-data", "--out", tmp_path / "d")
    assert r.exit_code == 2 and "already holds" in r.stderr and snapshot(tmp_path / "d") == before


def test_compile_refuses_a_folder_of_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = cli("compile", REPO / "specs/grpo.yaml", "--out", tmp_path)
    assert r.exit_code == 2 and "not a bundle" in r.stderr and (tmp_path / "notes.txt").read_text() == "mine"


# -------------------------------------- export --out: not an earlier export, non-finite weights, a full disk (issue 29)


def test_export_never_replaces_a_folder_that_is_not_an_export(finished_run, tmp_path, tiny):
    base = tmp_path / "base"
    shutil.copytree(tiny, base)
    (base / "README.md").write_text("my notes")
    (base / "extra-00002.safetensors").write_bytes(b"x")
    before = sorted(p.name for p in base.iterdir())
    r = cli("export", finished_run, "--out", base)
    assert r.exit_code == 2 and "not an earlier export" in r.stderr, r.output
    assert sorted(p.name for p in base.iterdir()) == before and (base / "README.md").read_text() == "my notes"
    # an earlier export's files are replaced, a file the user put beside them is kept (tests/test_output_folders.py)
    assert cli("export", finished_run, "--out", tmp_path / "e").exit_code == 0
    (tmp_path / "e" / "stale.txt").write_text("old")
    assert cli("export", finished_run, "--out", tmp_path / "e").exit_code == 0
    assert (tmp_path / "e" / "stale.txt").read_text() == "old" and (tmp_path / "e" / "config.json").is_file()


def test_export_refuses_non_finite_weights(finished_run, tmp_path):
    import torch

    from composer.runtime import checkpoint as ckpt_format

    state = ckpt_format.load(finished_run / "checkpoints" / "last.ckpt")
    key = next(k for k, v in state["state_dict"].items() if k.startswith("policy.") and v.is_floating_point())
    state["state_dict"][key] = torch.full_like(state["state_dict"][key], float("nan"))
    bad = tmp_path / "bad.ckpt"
    torch.save(state, bad)
    r = cli("export", bad, "--out", tmp_path / "e")
    assert r.exit_code == 2 and "NaN or inf" in r.stderr and not (tmp_path / "e").exists(), r.output


def test_a_full_disk_during_export_is_a_message_and_keeps_the_folder(finished_run, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    assert cli("export", finished_run, "--out", tmp_path / "e").exit_code == 0
    before = sorted(p.name for p in (tmp_path / "e").iterdir())

    class SafetensorError(Exception):  # what safetensors raises for ENOSPC (not an OSError)
        pass

    def full(self, *a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    r = cli("export", finished_run, "--out", tmp_path / "e")
    assert r.exit_code == 2 and "cannot write the model" in r.stderr and "internal error" not in r.stderr, r.output
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


# ----------------------------------------------------------------- eval --out, and a finished run's --resume (issue 43)


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def test_eval_out_never_overwrites_a_run_folder(run_copy):
    """Before: `composer eval RUN --out RUN` overwrote the run's own eval_samples.jsonl (appended to it) and
    wrote eval.json among the run's files."""
    before = snapshot(run_copy)
    r = cli("eval", run_copy, "--out", run_copy)
    assert r.exit_code == 2, r.output
    assert "files `composer eval` did not write" in r.stderr and "nothing is overwritten" in r.stderr
    assert snapshot(run_copy) == before


def test_eval_out_replaces_only_its_own_earlier_output(run_copy, tmp_path):
    ev = tmp_path / "ev"
    assert cli("eval", run_copy, "--out", ev).exit_code == 0
    first = (ev / "eval_samples.jsonl").read_text()
    assert cli("eval", run_copy, "--out", ev).exit_code == 0  # its own folder: replaced, not appended
    assert (ev / "eval_samples.jsonl").read_text() == first
    (ev / "notes.txt").write_text("mine")
    r = cli("eval", run_copy, "--out", ev)
    assert r.exit_code == 2 and "notes.txt" in r.stderr and (ev / "notes.txt").read_text() == "mine"


def test_resume_of_a_finished_run_says_so_and_changes_nothing(run_copy):
    """Before: --resume of a finished run printed nothing to say so and reran the final evaluation."""
    before = snapshot(run_copy)
    r = cli("run", "--resume", run_copy, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "the run already finished (step 1/1" in r.output and "changed nothing" in r.output
    assert snapshot(run_copy) == before


# ----------------------------------- a run folder's files: replaced whole, never through a planted link (issues 17, 29)


def test_run_files_are_replaced_whole(tmp_path, monkeypatch):
    from composer import files

    target = tmp_path / "plan.json"
    files.write_text(target, '{"old": 1}')

    def fail_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", fail_fsync)
    with pytest.raises(OSError):
        files.write_text(target, '{"new": "' + "x" * 10000 + '"}')
    assert target.read_text() == '{"old": 1}' and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_metrics_csv_never_ends_in_half_a_row(tmp_path, monkeypatch):
    from composer.backends.lightning.callbacks import _KeepingWriter

    w = _KeepingWriter(str(tmp_path), None)
    w.log_metrics({"loss": 1.0}, step=0)
    w.save()
    before = (tmp_path / "metrics.csv").read_bytes()
    w.log_metrics({"loss": 2.0}, step=1)

    class HalfWrite:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])
            self.f.flush()
            raise OSError(28, "No space left on device")

    from composer import files  # the metrics writer appends through files.open_append (never through a link)

    real_append = files.open_append
    monkeypatch.setattr(files, "open_append", lambda p, *a, **k: HalfWrite(real_append(p, *a, **k)))
    with pytest.raises(OSError):
        w.save()
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_bytes() == before


def test_a_lock_symlink_never_truncates_its_target(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    r = cli("run", "specs/sft.yaml", "train.steps=1", "--out", out, "--no-progress")
    assert r.exit_code == 2 and "symbolic link" in r.stderr, r.output
    assert victim.read_text() == "keep me"
