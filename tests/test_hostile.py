"""Hostile and careless input (issue 17): each attack of the red-team pass, kept fixed.

Code rewards and the sandbox's filesystem view are in tests/test_sandbox.py; the fuzzer's run and
compile passes in tests/test_fuzz.py. Here: code run on a spec's behalf, pickled checkpoints, model
folders with custom code, lost runs, resumes with another spec, non-finite weights, full disks, and
every input that used to end in a traceback or a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from composer.cli.main import main
from composer.checks.validate import validate_file

REPO = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "train.eval_every=0", "train.eval_samples=2"]
HEAD = "name: x\nsources:\n  verifier: {kind: outcome_reward}\nsignal: {kind: reward, source: verifier}\n" \
       "objective: {kind: grpo}\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def cli(*args, env=None):
    return CliRunner(env=env).invoke(main, [str(a) for a in args], catch_exceptions=False)


def composer(*args, cwd=REPO, env=None, timeout=300):
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "composer", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=timeout)


def run_spec(spec, out: Path, overrides, resume=False):
    from composer.backends.lightning.run import train

    return train(validate_file(spec, overrides), out, resume=resume, progress=False)


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != ".lock"}


# ------------------------------------------------------------------------------ 2. plugins never run unasked


def test_validate_and_explain_never_import_a_spec_named_module(tmp_path):
    marker = tmp_path / "PWNED"
    (tmp_path / "evil_plugin_mod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "plugins: [evil_plugin_mod, venv.__main__]\n")
    for command in (["validate", spec], ["explain", spec, "--format", "dot"]):
        r = composer(*command, cwd=tmp_path)  # `python -m composer` puts the current folder on the path
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "plugins[0]: the spec asks to import module 'evil_plugin_mod'; not imported" in r.stderr
        assert "plugins[1]: 'venv.__main__' is a standard-library module, not a plugin" in r.stderr
        assert "--allow-plugins" in r.stderr
    assert not marker.exists()
    r = composer("validate", "--allow-plugins", spec, cwd=tmp_path)  # the user's explicit choice
    assert marker.exists() and "the spec asks to import module 'evil_plugin_mod'" not in r.stderr
    assert "'venv.__main__' is a standard-library module" in r.stderr  # never a plugin, allowed or not


def test_allow_plugins_by_environment_and_a_refusal_is_printed(tmp_path):
    (tmp_path / "shadow_grpo_mod.py").write_text(
        "from typing import Literal\nfrom pydantic import Field\nfrom composer.registry import register\n"
        "from components.objectives.grpo import Grpo\n\n@register('objective')\nclass Shadow(Grpo):\n"
        "    '''Replaces grpo.'''\n    kind: Literal['grpo'] = Field('grpo', description='Component kind.')\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "plugins: [shadow_grpo_mod]\n")
    r = composer("validate", spec, cwd=tmp_path, env={"COMPOSER_ALLOW_PLUGINS": "1"})
    assert r.returncode == 2, r.stderr  # imported (the environment allowed it), and refused (tests/test_trust_boundary.py)
    assert "error: plugins[0]: plugin module 'shadow_grpo_mod' registers kind 'grpo' of objective" in r.stderr
    assert "which is built in; a plugin adds names, choose another kind name" in r.stderr


def test_a_module_name_that_is_not_one_is_refused(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "plugins: ['..os', 'a b']\n")
    r = cli("validate", "--allow-plugins", spec)
    assert r.exit_code == 2 and "is not a module name" in r.stderr


# ------------------------------------------------------------------------------ 3. checkpoints are never unpickled


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    from composer.runtime.checkpoint import CheckpointError, load

    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "global_step": 1, "x": _Boom(marker)}, ckpt)
    with pytest.raises(CheckpointError, match="refused unread"):
        load(ckpt)
    assert not marker.exists()


def test_checkpoint_state_is_plain_data_and_round_trips():
    from composer.runtime.checkpoint import CheckpointError, from_plain, to_plain
    from composer.batch import TrajectoryBatch
    from composer.data import Example, Verdict

    ex = Example(prompt="Q:1+1\nA:", answer="2", solution="1+1=2\n#2", tier=1, meta={"file": "x", "n": [1, 2]})
    b = TrajectoryBatch(tokens=torch.ones(1, 3, dtype=torch.long), origin=torch.ones(1, 3, dtype=torch.uint8),
                        behavior_logprobs=torch.zeros(1, 3), group=torch.zeros(1, dtype=torch.long),
                        control=torch.zeros(1, dtype=torch.bool), examples=[ex],
                        info={"verdicts": [Verdict(1.0)], "temperature": 1.0, "cache": object()})
    plain = to_plain({"buffer": [b], "rng": (3, (1, 2), None)})
    buf = __import__("io").BytesIO()
    torch.save(plain, buf)
    buf.seek(0)
    back = from_plain(torch.load(buf, weights_only=True))  # no allow-listed global needed at all
    got = back["buffer"][0]
    assert isinstance(got, TrajectoryBatch) and got.examples == [ex] and torch.equal(got.tokens, b.tokens)
    assert got.info["verdicts"] == [Verdict(1.0)] and "cache" not in got.info  # caches are dropped, not pickled
    with pytest.raises(CheckpointError, match="cannot store"):
        to_plain({"x": object()})


@pytest.mark.parametrize("damage", ["truncated", "random", "empty", "directory"])
def test_damaged_checkpoints_are_a_clear_error(tiny, tmp_path, damage):
    out = tmp_path / "run"
    assert cli("run", "specs/grpo.yaml", f"policy.model={tiny}", "train.steps=1", *FAST, "--no-progress",
               "--out", out).exit_code == 0
    ckpt = out / "checkpoints" / "last.ckpt"
    good = ckpt.read_bytes()
    ckpt.unlink()
    if damage == "truncated":
        ckpt.write_bytes(good[: len(good) // 3])
    elif damage == "random":
        ckpt.write_bytes(os.urandom(4096))
    elif damage == "empty":
        ckpt.write_bytes(b"")
    else:
        ckpt.mkdir()
    r = cli("run", "--resume", out, "--no-progress")
    assert r.exit_code == 2 and "last.ckpt" in r.stderr and "Traceback" not in r.stderr
    assert "internal error" not in r.stderr and "Aborted" not in r.stderr


# ------------------------------------------------------------------------------ 5. model folders with custom code


def _custom_code_folder(tiny: str, folder: Path, marker: Path) -> Path:
    import shutil

    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="composer_custom", auto_map={"AutoConfig": "custom_code.CustomConfig",
                                                       "AutoModelForCausalLM": "custom_code.CustomModel"})
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import Qwen3Config, Qwen3ForCausalLM\n"
        "class CustomConfig(Qwen3Config):\n    model_type = 'composer_custom'\n"
        "class CustomModel(Qwen3ForCausalLM):\n    config_class = CustomConfig\n")
    return folder


def test_a_model_folder_with_custom_code_is_refused_without_asking(tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = _custom_code_folder(tiny, tmp_path / "custom", marker)
    r = subprocess.run([sys.executable, "-m", "composer", "run", "specs/grpo.yaml", f"policy.model={folder}",
                        "train.steps=1", *FAST, "--out", tmp_path / "o", "--no-progress"],
                       input="y\n", capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})  # a `y` on stdin must not be read
    assert r.returncode == 2 and "policy.trust_remote_code: true" in r.stderr, r.stderr[-2000:]
    assert not marker.exists() and "[y/N]" not in r.stdout + r.stderr


def test_trust_remote_code_is_passed_through(tiny, tmp_path, monkeypatch):
    from composer.runtime.models import load_model

    monkeypatch.setenv("COMPOSER_TRUST_REMOTE_CODE", "1")  # the user's opt-in
    marker = tmp_path / "RAN"
    folder = _custom_code_folder(tiny, tmp_path / "custom", marker)
    assert type(load_model(str(folder), trust_remote_code=True)).__name__ == "CustomModel"
    assert marker.exists()


# ------------------------------------------------------------------------------ 6. run folders are never replaced


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


# ------------------------------------------------------------------------------ 7. resume checks the spec


def test_resume_refuses_another_spec_or_override_and_applies_steps(tiny, tmp_path):
    out = tmp_path / "run"
    base = [f"policy.model={tiny}", *FAST, "--no-progress"]
    assert cli("run", "specs/grpo.yaml", "train.steps=1", *base, "--out", out).exit_code == 0
    sft = [f"policy.model={tiny}", *[o for o in FAST if not o.startswith("rollout.samples")], "--no-progress"]
    r = cli("run", "specs/sft.yaml", "train.steps=1", *sft, "--resume", out)  # (SFT samples no rollouts)
    assert r.exit_code == 2 and "trained with another spec" in r.stderr
    assert 'signal.kind: "reward" -> "sft"' in r.stderr
    r = cli("run", "--resume", out, "train.lr=0.001", "--no-progress")
    assert r.exit_code == 2 and "train.lr: 0.0001 -> 0.001" in r.stderr
    r = cli("run", "--resume", out, "train.seed=7", "--no-progress")
    assert r.exit_code == 2 and "train.seed: 0 -> 7" in r.stderr
    r = cli("run", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 0, r.stderr
    assert "resuming with train.steps: 1 -> 2" in r.stderr and "steps: 2" in (out / "spec.yaml").read_text()


def test_resume_with_another_architecture_is_refused(tiny, tmp_path):
    import shutil

    from components.tasks.bootstrap import tiny_random_checkpoint
    from composer.runtime.checkpoint import CheckpointError

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    run_spec(REPO / "specs/grpo.yaml", tmp_path / "run", [f"policy.model={model}", "train.steps=1", *FAST])
    shutil.rmtree(model)
    tiny_random_checkpoint(str(model), hidden=32)  # same path, other weights' shapes
    with pytest.raises(CheckpointError, match="another architecture"):
        run_spec(REPO / "specs/grpo.yaml", tmp_path / "run", [f"policy.model={model}", "train.steps=2", *FAST],
                 resume=True)


# ------------------------------------------------------------------------------ 8. non-finite weights, full disks


def test_non_finite_weights_are_never_checkpointed(tiny, tmp_path, monkeypatch):
    from composer.backends.lightning import module as mod
    from composer.backends.lightning.module import NonFiniteError

    out = tmp_path / "run"
    ov = [f"policy.model={tiny}", "train.checkpoint_every=1", *FAST]
    run_spec(REPO / "specs/grpo.yaml", out, ov + ["train.steps=1"])
    good = (out / "checkpoints" / "last.ckpt").read_bytes()
    real = mod.ComposerModule.after_step

    def poison(self):  # finite gradients, a weight driven to inf (what weight_decay: 1e300 did)
        real(self)
        with torch.no_grad():
            next(self.policy.parameters()).fill_(float("inf"))

    monkeypatch.setattr(mod.ComposerModule, "after_step", poison)
    with pytest.raises(NonFiniteError, match="not finite after step 2; no checkpoint was written"):
        run_spec(REPO / "specs/grpo.yaml", out, ov + ["train.steps=3"], resume=True)
    assert (out / "checkpoints" / "last.ckpt").read_bytes() == good


def test_a_non_finite_gradient_stops_the_step_and_an_overflowing_norm_does_not():
    """The gradient check before each optimiser step: one fused norm, then a per-tensor look only when the
    norm is not finite. A NaN or an infinity in any gradient stops the step; finite gradients whose norm
    overflows float32 (1e30 each) do not."""
    from types import SimpleNamespace

    from composer.backends.lightning.module import ComposerModule, NonFiniteError

    policy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    host = SimpleNamespace(policy=policy, global_step=7, ctx=None)  # ctx None: no critic head to step
    check = ComposerModule.on_before_optimizer_step
    check(host, None)  # no gradients yet
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    check(host, None)
    for p in policy.parameters():
        p.grad = torch.full_like(p, 1e30)
    assert not torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in policy.parameters()]))
    check(host, None)  # the norm overflows, every gradient is finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        for p in policy.parameters():
            p.grad = torch.ones_like(p)
        policy[1].weight.grad[1, 2] = bad
        with pytest.raises(NonFiniteError, match="a gradient is not finite at step 7"):
            check(host, None)


def test_a_full_disk_keeps_the_previous_checkpoint_and_no_temp_file(tiny, tmp_path, monkeypatch):
    import errno

    from composer.backends.lightning import callbacks
    from composer.runtime.checkpoint import CheckpointError

    out = tmp_path / "run"
    ov = [f"policy.model={tiny}", "train.checkpoint_every=1", *FAST]
    run_spec(REPO / "specs/grpo.yaml", out, ov + ["train.steps=1"])
    good = (out / "checkpoints" / "last.ckpt").read_bytes()

    def full_disk(obj, f):
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(callbacks.torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        run_spec(REPO / "specs/grpo.yaml", out, ov + ["train.steps=2"], resume=True)
    assert (out / "checkpoints" / "last.ckpt").read_bytes() == good
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt"]


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


# ------------------------------------------------------------------------------ what validation refuses


REFUSED = {
    "steps beyond int64": ("train.steps=9223372036854775808", "train.steps"),
    "lr inf": ("train.lr=.inf", "train.lr"),
    "beta of 1": ("train.betas=[0.9,1.0]", "train.betas[1]"),
    "negative beta": ("train.betas=[-0.1,0.9]", "train.betas[0]"),
    "unknown precision": ("train.precision=33", "train.precision"),
    "unknown accelerator": ("train.accelerator=tpu", "train.accelerator"),
    "unknown strategy": ("train.strategy=ddp_magic", "train.strategy"),
    "zero devices": ("train.devices=0", "train.devices"),
    "devices mapping": ("train.devices={a:1}", "train.devices"),
    "weight decay that flips weights": ("train.weight_decay=1e300", "train.weight_decay"),
    "unknown verifier": ("sources.verifier.verifier=mathh", "sources.verifier.verifier"),
    "empty tiers": ("data.tiers=[]", "data.tiers"),
    "empty train tiers": ("data.train_tiers=[]", "data.train_tiers"),
    "tier 0": ("data.tiers=[0]", "data.tiers[0]"),
    "steps: true": ("train.steps=true", "train.steps"),
    "boolean lr": ("train.lr=false", "train.lr"),
    "huge eval samples": ("train.eval_samples=100000000000", "train.eval_samples"),
    "negative seed": ("train.seed=-1", "train.seed"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_validation_refuses_what_cannot_run(tmp_path, case):
    override, path = REFUSED[case]
    r = cli("validate", REPO / "specs/grpo.yaml", override)
    assert r.exit_code == 2 and f": error: {path}" in r.stderr, r.stderr
    assert "internal error" not in r.stderr


@pytest.mark.parametrize("text, path, expected", [
    ("train: {steps: true}\n", "train.steps", "got true"),
    ("train: {steps: 1:30}\n", "train.steps", "'1:30'"),
    ("train: {steps: yes}\n", "train.steps", "'yes'"),
    ("train: {prompts_per_step: 010}\n", None, None),  # decimal 10, not YAML 1.1 octal 8
    ("train: {steps: " + "9" * 5000 + "}\n", "train.steps", "5000 digits"),
])
def test_yaml_1_1_coercions_are_not_applied(tmp_path, text, path, expected):
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + text)
    r = cli("validate", spec)
    if path is None:
        assert r.exit_code == 0 and validate_file(spec).spec.train.prompts_per_step == 10
    else:
        assert r.exit_code == 2 and path in r.stderr and expected in r.stderr, r.stderr


@pytest.mark.parametrize("name", ['a"b', "a\nb", "x\u202eevil", "A", "a b", "x];evil[", "-->"])
def test_source_names_cannot_inject_into_diagrams(tmp_path, name):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: x\nsources:\n  {json.dumps(name)}: {{kind: outcome_reward}}\n"
                    f"signal: {{kind: reward, source: {json.dumps(name)}}}\nobjective: {{kind: grpo}}\n")
    for fmt in ("dot", "mermaid"):
        r = cli("explain", spec, "--format", fmt)
        assert r.exit_code == 2 and "names are [a-z0-9_-]+" in r.stderr and r.stdout == ""


def test_multi_node_without_a_launcher_is_refused_not_hung(tiny, tmp_path):
    r = composer("run", "specs/grpo.yaml", f"policy.model={tiny}", "train.num_nodes=2", *FAST, "--out",
                 tmp_path / "o", "--no-progress", timeout=120)
    assert r.returncode == 2 and "no multi-node launcher" in r.stderr and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ data files


def _data_spec(tmp_path, train) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: exact}")
                    + f"data: {{train: {json.dumps(str(train))}, prompt_field: q, answer_field: a}}\n")
    return spec


@pytest.mark.parametrize("row, why", [
    ('{"q": "x", "a": ' + "9" * 5000 + "}", "integer string conversion"),
    ('{"q": "x", "a": NaN}', "NaN is not a JSON number"),
    ('{"q": "x", "a": Infinity}', "Infinity is not a JSON number"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_bad_rows_are_named_not_tracebacks(tmp_path, row, why):
    from composer.runtime.binding import DataError, bind_task

    train = tmp_path / "train.jsonl"
    train.write_text('{"q": "1+1", "a": "2"}\n' + row + "\n")
    v = validate_file(_data_spec(tmp_path, train))
    with pytest.raises(DataError, match=f"row 2: not valid JSON .*{why}"):
        bind_task(v.spec)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_special_data_files_do_not_hang(tmp_path, kind):
    from composer.runtime.binding import DataError, bind_task

    if kind == "fifo":
        train = tmp_path / "fifo.jsonl"
        os.mkfifo(train)
    else:
        train = Path("/dev/zero")
    from composer.errors import SpecError

    with pytest.raises(SpecError, match="data.train: .*not a regular file"):  # validate refuses it (issue 56)
        validate_file(_data_spec(tmp_path, train))
    good = tmp_path / "good.jsonl"  # and binding on its own, should the path change after validation
    good.write_text('{"q": "1+1", "a": "2"}\n')
    v = validate_file(_data_spec(tmp_path, good)).spec
    with pytest.raises(DataError, match="not a regular file"):
        bind_task(v.model_copy(update={"data": v.data.model_copy(update={"train": str(train)})}))


def test_a_fifo_spec_file_does_not_hang(tmp_path):
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    r = cli("validate", fifo)
    assert r.exit_code == 2 and "named pipe" in r.stderr


def test_code_rows_with_a_bad_timeout_are_refused():
    from composer.data import Example
    from composer.runtime.binding import DataError, validate_answers

    rows = [Example(prompt="p", answer="assert f(1) == 2", row=i + 1, meta={"timeout": t})
            for i, t in enumerate([5, "soon", -1, 1e9])]
    with pytest.raises(DataError, match="row 2: field 'timeout'"):
        validate_answers(rows, "code")
    kept, skipped = validate_answers(rows, "code", on_bad_row="skip")
    assert [e.row for e in kept] == [1] and skipped == 3


# ------------------------------------------------------------------------------ commands that used to crash


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


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_before_training_exits_130(tmp_path, inherited):
    """Also when started as a script's background job (`composer run ... &`), which inherits SIGINT ignored:
    a signal during validation was lost there and the run trained to the end with exit status 0."""
    disposition = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    p = subprocess.Popen([sys.executable, "-m", "composer", "run", "specs/grpo.yaml", "--out", tmp_path / "o",
                          "--no-progress"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    time.sleep(1.0 if inherited == "default" else 0.3)  # importing and validating: long before the first step
    # again every 0.25 s until it exits: an ignored SIGINT that comes before `composer run` restores the handler
    # is dropped (the process cannot see it), and setup lasts seconds, so one lands in it on a loaded machine too
    # (and no more once it says it stopped: a second SIGINT would land in its exit)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    for _ in range(240):
        if any("stopped before training" in line for line in lines):
            break
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            pass
    p.wait(timeout=120)
    reader.join(timeout=30)
    out = "".join(lines)
    # 130; or, where one of this loop's later SIGINTs landed while the process was already exiting after its stop
    # message (1 run in 58 on 2 busy cores, cause not found: the run's code ignores SIGINT from the message on),
    # killed by that signal: the stop itself happened before training either way
    stopped = "stopped before training" in out
    assert p.returncode == 130 or (p.returncode == -signal.SIGINT and stopped), out[-2000:]
    assert stopped and "Traceback" not in out and not (tmp_path / "o").exists()


def test_a_signal_during_setup_inside_fit_stops_before_the_first_step(tiny, tmp_path, monkeypatch):
    """Lightning turns a KeyboardInterrupt inside fit into exit status 1: there a signal is only recorded."""
    from composer.backends.lightning import module as mod
    from composer.backends.lightning.run import Interrupted

    real = mod.ComposerModule.setup

    def signalled_setup(self, stage):
        real(self, stage)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(mod.ComposerModule, "setup", signalled_setup)
    with pytest.raises(Interrupted, match="stopped before the first step"):
        run_spec(REPO / "specs/grpo.yaml", tmp_path / "o", [f"policy.model={tiny}", "train.steps=3", *FAST])
    assert not (tmp_path / "o" / "metrics.csv").exists()
