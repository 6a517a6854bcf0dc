"""Runs on a researcher's own data files and model (tests/realmodel.py: a byte-level BPE with a ChatML template,
a random Qwen3 model, \\boxed{} word problems): exact resume mid-epoch, evaluation with the spec's verifier,
pass@k, `composer eval`, the loggers with their default settings, and what a run prints without a terminal.
Nothing is downloaded; each run is a few steps of a 250k-parameter model."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import realmodel
import torch

ROOT = Path(__file__).resolve().parent.parent
BODY = """sources: {verifier: {kind: outcome_reward}}
rollout: {samples_per_prompt: 2, max_new_tokens: 12}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
"""
# 5 prompts a step over 12 rows: step 3 starts mid-epoch, and the second epoch's order differs from the first
TRAIN = {"prompts_per_step": 5, "eval_every": 0, "eval_samples": 2, "lr": 1.0e-3, "loggers": ["csv"],
         "samples_every": 1, "checkpoint_every": 1}


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    return realmodel.built(tmp_path_factory)


def write_spec(path: Path, real: dict, train: str, body: str = BODY, data: dict | None = None, **settings) -> Path:
    fields = {"train": train, "eval": real["eval"], "prompt_field": "problem", **(data or {})}
    text = (f"name: d\npolicy: {{model: {json.dumps(real['model'])}}}\ndata: {json.dumps(fields)}\n" + body
            + "train: " + json.dumps({**TRAIN, **settings}) + "\n")
    path.write_text(text)
    return path


def rows(out: Path) -> list[dict]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def weights(out: Path) -> dict:
    from composer.runtime import checkpoint as ckpt_format

    return ckpt_format.load(out / "checkpoints" / "last.ckpt")["state_dict"]


def same_run(ref: Path, out: Path, steps: int) -> None:
    """metrics.csv equal step for step (every column, each step once) and the final weights bit for bit."""
    want, got = rows(ref), rows(out)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert len({r["step"] for r in got}) == len(got), "a step was written twice"
    for a, b in zip(want, got):
        for key in ("loss", "reward_mean", "entropy", "response_len"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    wa, wb = weights(ref), weights(out)
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    prompts_ref = [json.loads(x)["prompt"] for x in (ref / "samples.jsonl").read_text().splitlines()]
    prompts_got = [json.loads(x)["prompt"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert prompts_got == prompts_ref


def data_file(real: dict, kind: str, tmp: Path) -> str:
    """The training rows as a jsonl, a parquet file, or a `datasets` DatasetDict folder (train + test)."""
    if kind == "jsonl":
        return real["train"]
    import datasets

    train = datasets.Dataset.from_list(real["rows"])
    if kind == "parquet":
        path = tmp / "train.parquet"
        train.to_parquet(str(path))
        return str(path)
    path = tmp / "dsdict"
    datasets.DatasetDict({"train": train, "test": datasets.Dataset.from_list(realmodel.rows(4, 1))}).save_to_disk(
        str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasetdict"])
def test_lengthened_run_on_a_data_file_resumes_exactly(real, tmp_path, kind):
    """A finished 2-step run lengthened to 4 steps with --resume equals a 4-step run (the data order
    mid-epoch and across the epoch boundary included). Before: AttributeError '_order' on the first draw."""
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    spec = write_spec(tmp_path / "s.yaml", real, data_file(real, kind, tmp_path))
    train(validate_file(spec, ["train.steps=4"]), tmp_path / "ref", progress=False)
    out = tmp_path / "run"
    train(validate_file(spec, ["train.steps=2"]), out, progress=False)
    train(validate_file(spec, ["train.steps=4"]), out, resume=True, progress=False)
    same_run(tmp_path / "ref", out, 4)


def _cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "composer", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_a_killed_run_on_a_jsonl_resumes_exactly(real, tmp_path, how):
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], steps=5)
    ref = _cli(["run", str(spec), "--no-progress", "--out", str(tmp_path / "ref")])
    assert ref.wait(timeout=300) == 0, ref.stdout.read()
    out = tmp_path / "run"
    p = _cli(["run", str(spec), "--no-progress", "--out", str(out)])
    ckpt = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(how)
    p.wait(timeout=120)
    r = _cli(["run", "--resume", str(out), "--no-progress"])
    assert r.wait(timeout=300) == 0, r.stdout.read()
    same_run(tmp_path / "ref", out, 5)


def _tb_scalars(folder: Path) -> dict[str, list[int]]:
    """{tag: [steps]} of TensorBoard's scalar events in `folder` (purged events left out, as TensorBoard shows)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(folder))
    mux.Reload()
    out: dict[str, list[int]] = {}
    for run, tags in mux.Runs().items():
        for tag in tags.get("scalars", []):
            out.setdefault(tag, []).extend(e.step for e in mux.Scalars(run, tag))
    return out


def test_every_logger_with_evaluation_on_completes_offline_with_one_name_per_metric(real, tmp_path, monkeypatch):
    """csv, TensorBoard, W&B (offline) and MLflow (file store) with evaluation every step: the run completes
    (before: MLflow's `pass1` file collided with its `pass1/eval` folder and the run folder was deleted), every
    metric has the same name in metrics.csv, TensorBoard and MLflow, TensorBoard's hparams.yaml holds the spec,
    and a lengthened run shows each step once in TensorBoard."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], eval_every=1,
                      loggers=["csv", "tensorboard", "wandb", "mlflow"])
    out = tmp_path / "run"
    train(validate_file(spec, ["train.steps=2"]), out, progress=False)
    train(validate_file(spec, ["train.steps=3"]), out, resume=True, progress=False)
    csv_names = {k for r in rows(out) for k, v in r.items() if v not in ("", None)} - {"step", "epoch"}
    assert "pass_at_1/eval" in csv_names and not any("@" in k for k in csv_names)
    assert not [k for k in csv_names if any(o.startswith(k + "/") for o in csv_names)]  # no name is another's folder
    ids = json.loads((out / "loggers.json").read_text())
    run = next((out / "mlruns").glob(f"*/{ids['mlflow']}"))
    ml_names = {str(p.relative_to(run / "metrics")) for p in (run / "metrics").rglob("*") if p.is_file()}
    assert ml_names == csv_names
    assert "status: 3" in (run / "meta.yaml").read_text()  # FINISHED
    assert list((out / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    tb = _tb_scalars(out / "tensorboard")
    assert set(tb) == csv_names
    assert sorted(tb["pass_at_1/eval"]) == [0, 1, 2, 3] and sorted(tb["loss"]) == [0, 1, 2]  # each step once
    import yaml

    hp = yaml.safe_load((out / "tensorboard" / "hparams.yaml").read_text())
    assert hp["train.eval_every"] == 1 and hp["data.prompt_field"] == "problem"


# ------------------------------------------------------------------------------------------ evaluation


def always_right(response, example):
    from composer.data import Verdict

    return Verdict(1.0, detail="always right", answer=response[-3:])


@pytest.fixture
def always_verifier():
    """A verifier that rewards every response (registered for the test only)."""
    from composer.registry import VERIFIERS, register_verifier

    register_verifier("always_right_test", "test only")(always_right)
    yield "always_right_test"
    VERIFIERS.pop("always_right_test", None)


def _eval_rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]


def test_evaluation_uses_the_spec_verifier_and_eval_samples(real, tmp_path, always_verifier):
    """The reward's verifier scores evaluation too (before: math, 0.0 on a random model although every reward
    was 1.0), train.eval_samples rows of the eval file are evaluated (before: the whole file), and the
    generations are kept in eval_samples.jsonl with what the verifier said."""
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    body = BODY.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: always_right_test}")
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], body=body, eval_every=1, eval_samples=3, steps=2)
    out = tmp_path / "run"
    final = train(validate_file(spec), out, progress=False)
    assert final == {"pass@1/eval": 1.0}
    got = rows(out)
    assert [float(r["reward_mean"]) for r in got if r["reward_mean"]] == [1.0, 1.0]
    assert [float(r["pass_at_1/eval"]) for r in got if r["pass_at_1/eval"]] == [1.0, 1.0, 1.0]
    ev = _eval_rows(out)
    assert [r["step"] for r in ev] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # 3 of the 4 eval rows, each evaluation
    assert {r["detail"] for r in ev} == {"always right"} and {r["tier"] for r in ev} == {"eval"}
    assert [r["answer"] for r in ev[:3]] == [r["answer"] for r in realmodel.rows(4, 1)[:3]]
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in ev)
    assert all(r["parsed"] == r["response"][-3:] for r in ev)  # what the verifier read, in both files
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["verifier"].get("answer"), str) for s in samples)


def test_unbiased_pass_at_k_by_hand():
    from composer.runtime.evaluate import ks_up_to, unbiased_pass_at_k

    # 1 - C(n-c, k) / C(n, k)
    assert unbiased_pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert unbiased_pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert unbiased_pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert unbiased_pass_at_k(4, 0, 4) == 0.0 and unbiased_pass_at_k(4, 3, 2) == 1.0
    assert ks_up_to(4) == [1, 2, 4] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]


def test_composer_eval_reproduces_the_final_evaluation_of_a_run(real, tmp_path, cli):
    """`composer eval RUN` evaluates the run's last checkpoint with its spec: the same pass@1 and the same greedy
    generations as the run's own final evaluation; --data and --k evaluate another file with pass@k; an
    exported model directory is evaluated alone with --data."""
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_file

    spec = write_spec(tmp_path / "s.yaml", real, real["train"], steps=2, eval_samples=4)
    out = tmp_path / "run"
    final = train(validate_file(spec), out, progress=False)
    (out / "spec.yaml").write_text(spec.read_text())  # as `composer run` keeps it
    run_final = [r for r in _eval_rows(out) if r["step"] == 2]
    r = cli("eval", out)
    assert r.exit_code == 0, r.output
    assert f"pass@1/eval: {final['pass@1/eval']:.3f}" in r.stdout
    ev = json.loads((out / "eval" / "eval.json").read_text())
    assert ev["metrics"] == final and ev["verifier"] == "math" and ev["step"] == 2
    assert [x["response"] for x in _eval_rows(out / "eval")] == [x["response"] for x in run_final]

    r = cli("eval", out, "--data", real["train"], "--k", "4", "--out", tmp_path / "k")
    assert r.exit_code == 0, r.output
    ev = json.loads((tmp_path / "k" / "eval.json").read_text())
    assert set(ev["metrics"]) == {"pass@1/eval", "pass@1_sampled/eval", "pass@2/eval", "pass@4/eval"}
    assert ev["data"] == real["train"]
    assert len([x for x in _eval_rows(tmp_path / "k") if "sample" in x]) == 4 * 4  # eval_samples=4 rows, 4 each

    r = cli("eval", out / "model", "--data", real["eval"], "data.prompt_field=problem", "--out", tmp_path / "m")
    assert r.exit_code == 0, r.output
    r = cli("eval", tmp_path / "s.yaml")
    assert r.exit_code == 2 and "the checkpoint cannot be read" in r.stderr


# ------------------------------------------------------------------------------------------ loading


def _data(**kw):
    from composer.lang.spec import Data

    return Data(train="x", prompt_field="problem", **kw)


def _load(name, role="train", split=None, **kw):
    from composer.runtime.binding import load_examples_counted

    return load_examples_counted(str(name), _data(**kw), split, role)[0]


def test_a_datasetdict_as_eval_reads_its_test_split_and_splits_are_chosen(real, tmp_path):
    """Before: a DatasetDict given as data.eval silently used its `train` split, and no field chose a split."""
    import datasets

    from composer.runtime.binding import DataError

    folder = tmp_path / "dd"
    train, test, val = realmodel.rows(5, 0), realmodel.rows(3, 1), realmodel.rows(2, 2)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test),
                          "validation": datasets.Dataset.from_list(val)}).save_to_disk(str(folder))
    assert [e.answer for e in _load(folder, "eval")] == [r["answer"] for r in test]
    assert [e.answer for e in _load(folder, "eval", "validation")] == [r["answer"] for r in val]
    assert [e.answer for e in _load(folder)] == [r["answer"] for r in train]
    assert [e.answer for e in _load(folder, "train", "test")] == [r["answer"] for r in test]
    with pytest.raises(DataError, match=r"no split 'dev' \(data.eval_split\); its splits: train, test, validation"):
        _load(folder, "eval", "dev")
    with pytest.raises(DataError, match=r"JSON-lines file has no split 'test'"):
        _load(real["eval"], "eval", "test")


def test_bind_evaluates_a_split_of_the_training_source(real, tmp_path):
    import datasets

    from composer.runtime.binding import bind_task
    from composer.checks.validate import validate_file

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(realmodel.rows(6, 0)),
                          "test": datasets.Dataset.from_list(realmodel.rows(2, 1))}).save_to_disk(str(folder))
    spec = write_spec(tmp_path / "s.yaml", real, str(folder), data={"eval": None, "eval_split": "test"})
    text = spec.read_text().replace('"eval": null, ', "")
    spec.write_text(text)
    task = bind_task(validate_file(spec).spec)
    assert len(task.train) == 6 and [e.answer for e in task.eval["eval"]] == [r["answer"] for r in realmodel.rows(2, 1)]
    assert task.eval["eval"][0].meta["file"] == f"{folder} [split test]"


def test_csv_json_and_a_folder_of_parquet_shards_load_through_datasets(real, tmp_path):
    """Before: a csv was "no such data file"-like refused as JSON lines, a folder of shards was no `datasets`
    folder; now each loads, and a bad row is still named with file, split, row and field."""
    import datasets

    from composer.runtime.binding import DataError

    rows_ = realmodel.rows(6, 0)
    ds = datasets.Dataset.from_list(rows_)
    ds.to_csv(str(tmp_path / "t.csv"), index=False)
    (tmp_path / "t.json").write_text(json.dumps(rows_))
    shards = tmp_path / "snapshot" / "data"
    shards.mkdir(parents=True)
    ds.select(range(3)).to_parquet(str(shards / "train-00000-of-00002.parquet"))
    ds.select(range(3, 6)).to_parquet(str(shards / "train-00001-of-00002.parquet"))
    datasets.Dataset.from_list(realmodel.rows(2, 1)).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    want = [r["answer"] for r in rows_]
    assert [e.answer for e in _load(tmp_path / "t.csv")] == want
    assert [e.answer for e in _load(tmp_path / "t.json")] == want
    assert sorted(e.answer for e in _load(tmp_path / "snapshot")) == sorted(want)
    assert len(_load(tmp_path / "snapshot", "eval")) == 2
    bad = rows_[:2] + [{"problem": "", "answer": "3", "solution": "x"}]
    datasets.Dataset.from_list(bad).to_csv(str(tmp_path / "bad.csv"), index=False)
    with pytest.raises(DataError, match=r"bad.csv: row 3: field 'problem'"):
        _load(tmp_path / "bad.csv")


def test_hub_ids_are_read_from_the_local_cache_only(real, tmp_path, monkeypatch):
    """A hub dataset id whose snapshot is in the local cache loads; one that is not is refused with the `hf`
    command that downloads it (before: "no such data file", no hint); nothing is downloaded."""
    import datasets
    import huggingface_hub.constants as hc

    from composer.runtime.paths import data_problem
    from composer.runtime.binding import DataError

    cache = tmp_path / "hub"
    snap = cache / "datasets--someorg--sums" / "snapshots" / ("a" * 40)
    (snap / "data").mkdir(parents=True)
    (cache / "datasets--someorg--sums" / "refs").mkdir()
    (cache / "datasets--someorg--sums" / "refs" / "main").write_text("a" * 40)
    datasets.Dataset.from_list(realmodel.rows(4, 0)).to_parquet(str(snap / "data" / "train-00000-of-00001.parquet"))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert [e.answer for e in _load("someorg/sums")] == [r["answer"] for r in realmodel.rows(4, 0)]
    assert data_problem("someorg/sums") is None
    why = data_problem("someorg/absent")
    assert "not in the local Hugging Face cache" in why and "hf download someorg/absent --repo-type dataset" in why
    assert "huggingface-cli" not in why
    with pytest.raises(DataError, match="hf download someorg/absent"):
        _load("someorg/absent")
    assert "no such data file: missing.csv" == data_problem("missing.csv")
    assert ".xlsx is not a data format read here" in data_problem("missing.xlsx")


# ------------------------------------------------------------------------------------------ what a run shows


def test_without_a_terminal_a_run_names_its_folder_and_engine_first_and_logs_each_step(real, tmp_path):
    """Before: with --no-progress (or no terminal) nothing was printed until the end, the run folder only then,
    and the rollout engine line never."""
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], steps=3, eval_every=2, log_every=1)
    out = tmp_path / "run"
    p = _cli(["run", str(spec), "--no-progress", "--out", str(out)])
    text = p.communicate(timeout=300)[0]
    assert p.returncode == 0, text
    lines = text.splitlines()
    first_step = next(i for i, ln in enumerate(lines) if ln.startswith("step 1/3"))
    assert any(ln == f"run folder: {out}" for ln in lines[:first_step])
    assert any(ln.startswith("rollout engine: hf") for ln in lines[:first_step])
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    for ln in steps:
        assert " | loss " in ln and " | reward " in ln and " tok/s" in ln and " | ETA " in ln, ln
    assert " | pass@1 " in steps[0] and " | pass@1 " not in steps[1] and " | pass@1 " in steps[2]  # steps 0, 2
    assert "Setting accelerator" not in text  # before: DeepSpeed's line, imported by the export (accelerate)


def test_curves_show_loss_per_term_reward_per_source_and_evaluation(real, tmp_path):
    """Before: curves.png drew reward and pass@1 only (an SFT run got an empty panel and no loss), and two
    reward terms logged one reward_mean."""
    from composer.backends.lightning.run import train
    from composer.runtime.report import plotted_keys
    from composer.checks.validate import validate_file

    two = """sources:
  strict: {kind: outcome_reward, verifier: math}
  loose: {kind: outcome_reward, verifier: exact}
rollout: {samples_per_prompt: 2, max_new_tokens: 12}
terms:
  - {name: a, signal: {kind: reward, source: strict}, objective: {kind: grpo}}
  - {name: b, signal: {kind: reward, source: loose}, objective: {kind: grpo}}
"""
    out = tmp_path / "two"
    train(validate_file(write_spec(tmp_path / "two.yaml", real, real["train"], body=two, steps=2)), out,
          progress=False)
    keys = plotted_keys(out / "metrics.csv")
    assert keys["loss"] == ["loss", "a/loss", "b/loss"]
    assert keys["reward"] == ["reward_mean", "source_reward/loose", "source_reward/strict"]
    assert keys["evaluation"] == ["pass_at_1/eval"]
    sft = """sources: {reference: {kind: reference_solution}}
signal: {kind: sft, target: reference}
objective: {kind: cross_entropy, loss_tokens: [demonstration]}
"""
    out = tmp_path / "sft"
    train(validate_file(write_spec(tmp_path / "sft.yaml", real, real["train"], body=sft, steps=2)), out,
          progress=False)
    keys = plotted_keys(out / "metrics.csv")
    assert keys == {"loss": ["loss"], "reward": [], "evaluation": ["pass_at_1/eval"]}
    assert (out / "curves.png").stat().st_size > 0 and "curves.png" in (out / "report.md").read_text()


# ------------------------------------------------------------------------------------------ smaller items


def test_a_teacher_with_another_tokenizer_is_refused_with_a_reason(real, tmp_path, cli):
    """Before: "internal error ... please report it"."""
    from components.tasks.bootstrap import tiny_random_checkpoint

    other = tiny_random_checkpoint(str(tmp_path / "other"))  # the toy's character-level tokenizer
    body = f"""sources:
  teacher: {{kind: policy_model, model: {json.dumps(other)}}}
rollout: {{samples_per_prompt: 2, max_new_tokens: 12}}
signal: {{kind: distillation, teacher: teacher}}
objective: {{kind: divergence, measure: reverse_kl, estimator: sampled}}
"""
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], body=body, steps=1)
    r = cli("run", spec, "--no-progress", "--out", tmp_path / "run")
    assert r.exit_code == 2, r.output
    assert "differs from the policy's tokenizer" in r.stderr and "internal error" not in r.stderr


def test_explain_with_a_data_field_the_rows_lack_fails_like_the_run(real, tmp_path, cli):
    """Before: explain printed "prompts: not rendered here" and exited 0; now validation refuses it at the spec
    line of data.prompt_field (issue 56: it reads the file's first row)."""
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], data={"prompt_field": "question"})
    r = cli("explain", spec)
    assert r.exit_code == 2
    assert f"{spec}:3:" in r.stderr and "data.prompt_field" in r.stderr, r.stderr
    assert "has no column 'question' (data.prompt_field); its columns: problem, answer, solution" in r.stderr
    ok = cli("explain", spec, "data.prompt_field=problem")
    assert ok.exit_code == 0 and f"train data: {real['train']}: JSON lines" in ok.stdout
    assert "eval data: " in ok.stdout and "greedy pass@1 on the first 2 rows" in ok.stdout


def test_lora_fields_are_listed(cli):
    """Before: `composer list policy` and docs/reference.md showed `lora` as a mapping without its fields."""
    r = cli("list", "policy")
    assert r.exit_code == 0 and all(f"lora.{k}" in r.stdout for k in ("r", "alpha", "dropout", "target_modules"))
    assert "`lora.r`" in (ROOT / "docs" / "reference.md").read_text() or "lora.r" in (ROOT / "docs" / "reference.md").read_text()


def test_loading_dependencies_are_part_of_the_install():
    """parquet and `datasets` folders need pyarrow and datasets: main dependencies, not extras."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    assert {"datasets", "pyarrow"} <= names
    assert "loggers]" in (ROOT / "Makefile").read_text()


def test_bench_refuses_a_data_spec(real, tmp_path, cli):
    """Before: pass@32 = 0.000 over zero problems, under a "toy testbed" heading."""
    spec = write_spec(tmp_path / "s.yaml", real, real["train"])
    r = cli("bench", spec, "--out", tmp_path / "b")
    assert r.exit_code == 2 and "the bench runs on the toy testbed" in r.stderr and "composer eval RUN --k N" in r.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_ddp_run_on_a_jsonl_lengthened_with_resume_equals_the_longer_run(real, tmp_path):
    """Two CPU ranks (gloo): every rank draws the global batch at the checkpointed data position, mid-epoch. SFT
    on the rows' solutions: it samples nothing, so two DDP runs agree bit for bit (each rank's sampling is its
    own generator's, tests/test_ddp.py) and what is compared is the data order and the weights."""
    ddp = ["train.strategy=ddp", "train.devices=2", "train.accelerator=cpu", "--no-progress"]
    sft = """sources: {reference: {kind: reference_solution}}
signal: {kind: sft, target: reference}
objective: {kind: cross_entropy, loss_tokens: [demonstration]}
"""
    spec = write_spec(tmp_path / "s.yaml", real, real["train"], body=sft, samples_every=0)
    env_run = [str(spec), *ddp]

    def go(args):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COMPOSER_THREADS": "1"}
        env.pop("COMPOSER_RUN_DIR", None)
        p = subprocess.Popen([sys.executable, "-m", "composer", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            text = p.communicate(timeout=600)[0]
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise
        assert p.returncode == 0, text[-4000:]

    go(["run", *env_run, "train.steps=4", "--out", str(tmp_path / "ref")])
    go(["run", *env_run, "train.steps=2", "--out", str(tmp_path / "run")])
    go(["run", "--resume", str(tmp_path / "run"), "train.steps=4", "--no-progress"])
    want, got = rows(tmp_path / "ref"), rows(tmp_path / "run")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        for key in ("loss", "entropy", "response_len"):
            assert a[key] == b[key], (a["step"], key)
    wa, wb = weights(tmp_path / "ref"), weights(tmp_path / "run")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_openrlhf_refuses_the_evaluation_it_cannot_run(real, tmp_path, cli):
    spec = write_spec(tmp_path / "s.yaml", real, real["train"])
    base = ["compile", spec, "--backend", "openrlhf", "rollout.max_new_tokens=64", "train.prompts_per_step=4"]
    r = cli(*base, "train.eval_k=4", "--out", tmp_path / "a")
    assert r.exit_code == 2 and "train.eval_k: OpenRLHF cannot express this" in r.stderr
    r = cli(*base, "train.eval_verifier=exact", "--out", tmp_path / "b")
    assert r.exit_code == 2 and "train.eval_verifier: OpenRLHF cannot express this" in r.stderr
    assert cli(*base, "train.eval_verifier=math", "--out", tmp_path / "c").exit_code == 0  # auto is math on data
