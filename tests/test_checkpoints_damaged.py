"""Checkpoints and --resume that fail with a message, never an internal error (issue 57 items 5 and 4b, issue 56).

Every field a resume restores is checked in one place (composer/runtime/checkpoint.py `check_state`) against
templates taken from the live run, before anything is restored or any of the run's logs is cut: a damaged
field is exit 2 with the file and the field's path named, and the checkpoint is kept. A full disk while
writing a checkpoint keeps the last good one. A data file whose contents changed under the same path is
refused on resume unless --allow-changed-data. `composer run SPEC --resume DIR` with another spec is refused
with the exact command that resumes the run.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _helpers import FAST, REPO, cli, run_spec, snapshot

from composer.runtime import checkpoint as ckpt_format

SFT = ["train.prompts_per_step=2", "rollout.max_new_tokens=8", "train.eval_every=0", "train.eval_samples=2"]
SIZES = [*SFT, "rollout.samples_per_prompt=2"]  # an SFT spec samples no rollouts: it refuses samples_per_prompt


def _run(model: str, spec: str, out: Path, *extra) -> Path:
    sizes = SFT if "sft" in spec else SIZES
    r = cli("run", spec, f"policy.model={model}", "train.steps=1", *sizes, *extra, "--no-progress", "--out", out)
    assert r.exit_code == 0, r.output[-2000:]
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def sft_run(tiny_model, tmp_path_factory) -> Path:
    """One SFT step started with overrides (policy.model, sizes): the run folder's spec.yaml keeps them."""
    return _run(tiny_model, "specs/sft.yaml", tmp_path_factory.mktemp("sft") / "run")


@pytest.fixture(scope="module")
def grpo_run(tiny_model, tmp_path_factory) -> Path:
    """One GRPO step: a checkpoint with rollout weights, initial weights (its KL term), costs and moments."""
    return _run(tiny_model, "specs/grpo.yaml", tmp_path_factory.mktemp("grpo") / "run")


@pytest.fixture(scope="module")
def reuse_run(tiny_model, tmp_path_factory) -> Path:
    """One step with sync.reuse: a checkpoint whose rollout buffer holds the stored batch."""
    return _run(tiny_model, "specs/oapl.yaml", tmp_path_factory.mktemp("reuse") / "run", "sync.reuse=true")


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def _resume(out: Path, *extra):
    return cli("run", "--resume", out, "train.steps=2", "--no-progress", *extra)


# ------------------------------------------------------------------------------ every field, through the CLI

DEL = object()


def _at(state: dict, path: tuple):
    for p in path:
        state = state[p]
    return state


def _set(state: dict, path: tuple, value) -> None:
    parent = _at(state, path[:-1])
    if value is DEL:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


def _callback(state: dict) -> str:
    return next(iter(state["callbacks"]))


# (run, path in the checkpoint, damage, the field the message names): every top-level field and the nested
# fields of the report (buffer, optimizer state, LR schedulers, rollout and initial weights, costs, memo,
# vacuity tally; the ninth of the family: Lightning's version, read to migrate a checkpoint)
CASES = [
    ("grpo", ("pytorch-lightning_version",), "garbage", "pytorch-lightning_version"),
    ("grpo", ("pytorch-lightning_version",), DEL, "pytorch-lightning_version"),
    ("grpo", ("epoch",), "garbage", "epoch"),
    ("grpo", ("loops", "fit_loop", "epoch_loop.batch_progress"), {"total": {}}, "loops.fit_loop.epoch_loop.batch_progress"),
    ("grpo", ("loops", "fit_loop", "epoch_loop.state_dict"), 7, "loops.fit_loop.epoch_loop.state_dict"),
    ("grpo", ("callbacks",), "garbage", "callbacks"),
    ("grpo", ("callbacks", _callback), "garbage", "callbacks.ModelCheckpoint"),
    ("grpo", ("optimizer_states",), [], "optimizer_states"),
    ("grpo", ("optimizer_states", 0, "state"), None, "optimizer_states[0].state"),
    ("grpo", ("optimizer_states", 0, "state", 0, "exp_avg"), "shape", "optimizer_states[0].state[0].exp_avg"),
    ("grpo", ("optimizer_states", 0, "state", 0, "step"), "shape", "optimizer_states[0].state[0].step"),
    ("grpo", ("optimizer_states", 0, "param_groups", 0, "lr"), "garbage", "optimizer_states[0].param_groups[0].lr"),
    ("grpo", ("optimizer_states", 0, "param_groups", 0, "params"), [0], "optimizer_states[0].param_groups[0].params"),
    ("grpo", ("lr_schedulers",), "garbage", "lr_schedulers"),
    ("grpo", ("lr_schedulers", 0, "base_lrs"), [], "lr_schedulers[0].base_lrs"),
    ("grpo", ("lr_schedulers", 0, "last_epoch"), None, "lr_schedulers[0].last_epoch"),
    ("grpo", ("composer",), "garbage", "composer"),
    ("grpo", ("composer", "rollout_weights"), "garbage", "composer.rollout_weights"),
    ("grpo", ("composer", "rollout_weights", "lm_head.weight"), "shape", "composer.rollout_weights.lm_head.weight"),
    ("grpo", ("composer", "initial"), None, "composer.initial"),
    ("grpo", ("composer", "initial", "model.norm.weight"), DEL, "composer.initial"),
    ("grpo", ("composer", "last_sync"), "garbage", "composer.last_sync"),
    ("grpo", ("composer", "rng"), [3, [1, 2], None], "composer.rng"),
    ("grpo", ("composer", "torch_rng"), "shape", "composer.torch_rng"),
    ("grpo", ("composer", "data_pos"), -1, "composer.data_pos"),
    ("grpo", ("composer", "segment"), "nope", "composer.segment"),
    ("grpo", ("composer", "segment"), DEL, "composer.segment"),
    ("grpo", ("composer", "runtimes"), 7, "composer.runtimes"),
    ("grpo", ("composer", "memo"), {"not a tuple(": {}}, "composer.memo"),
    ("grpo", ("composer", "memo"), {repr(("guide", "prefix-search", "{}")): {"Q": "many"}}, "composer.memo"),
    ("grpo", ("composer", "costs"), "garbage", "composer.costs"),
    ("grpo", ("composer", "costs", "policy_tokens"), "many", "composer.costs.policy_tokens"),
    ("grpo", ("composer", "buffer_version"), "garbage", "composer.buffer_version"),
    ("grpo", ("composer", "vacuous"), {"tally": "x", "fingerprint": []}, "composer.vacuous.tally"),
    ("grpo", ("composer", "vacuous"), {"tally": {"segment": "main"}, "fingerprint": []}, "composer.vacuous.tally.start"),
    ("grpo", ("composer", "vacuous"), {"tally": {"segment": "main", "start": 0, "end": 2}, "fingerprint": "x"},
     "composer.vacuous.fingerprint"),
    ("grpo", ("composer", "data_files"), 7, "composer.data_files"),
    ("grpo", ("composer", "tampered"), 1, "composer.tampered"),
    ("reuse", ("composer", "buffer"), "garbage", "composer.buffer"),
    ("reuse", ("composer", "buffer", 0, "tokens"), "shape", "composer.buffer[0].tokens"),
    ("reuse", ("composer", "buffer", 0, "group"), "garbage", "composer.buffer[0].group"),
    ("reuse", ("composer", "buffer", 0, "examples"), [], "composer.buffer[0].examples"),
    ("reuse", ("composer", "buffer", 0, "tokens"), "vocab", "composer.buffer[0].tokens"),
]


def _damage(state: dict, path: tuple, how) -> None:
    path = tuple(p(state) if callable(p) else p for p in path)
    if how == "shape":
        t = _at(state, path)
        how = t.reshape(-1)[:-1] if t.numel() > 1 else torch.zeros(3)
    elif how == "vocab":
        how = _at(state, path).clone().fill_(10 ** 6)
    _set(state, path, how)


@pytest.mark.parametrize("which, path, how, field", CASES,
                         ids=[f"{f}-{'del' if h is DEL else type(h).__name__ if not isinstance(h, str) else h}"
                              for _w, _p, h, f in CASES])
def test_a_damaged_checkpoint_field_is_named_and_the_checkpoint_kept(grpo_run, reuse_run, tmp_path, which, path,
                                                                    how, field):
    """Before: each of these ended in `internal error ... please report it` from deep inside the restore."""
    out = _copy({"grpo": grpo_run, "reuse": reuse_run}[which], tmp_path)
    ckpt = out / "checkpoints" / "last.ckpt"
    state = ckpt_format.load(ckpt)
    _damage(state, path, copy.deepcopy(how) if how is not DEL else DEL)
    torch.save(state, ckpt)
    before = snapshot(out)
    r = _resume(out)
    assert r.exit_code == 2, r.output[-2000:]
    assert "internal error" not in r.stderr and "Traceback" not in r.output
    assert str(ckpt) in r.stderr and f"field {field}" in r.stderr and "hint:" in r.stderr, r.stderr[-1500:]
    assert snapshot(out) == before  # nothing changed: the checkpoint, spec.yaml, plan.json and every log


def test_an_intact_checkpoint_of_each_kind_resumes(grpo_run, reuse_run, tmp_path):
    """The legitimate case: the untouched checkpoints pass every check and train on."""
    for run in (grpo_run, reuse_run):
        out = _copy(run, tmp_path / run.parent.name)
        r = _resume(out)
        assert r.exit_code == 0, r.output[-2000:]
        assert ckpt_format.load(out / "checkpoints" / "last.ckpt")["global_step"] == 2


# ------------------------------------------------------------------------------ a seeded fuzz over every field


@pytest.fixture(scope="module")
def checked(grpo_run, tmp_path_factory):
    """(state, expected) exactly as a real resume passes them to check_state (its Expected is taken from the
    live run: model, optimizer, scheduler, loops, callbacks), and a checkpoint that holds a vacuity tally
    resumes (the tally is checked, not only its absence)."""
    from composer.runtime import vacuous

    seen = []
    real = ckpt_format.check_state

    def spy(state, path, expected):
        seen.append((copy.deepcopy(dict(state)), expected))
        return real(state, path, expected)

    out = _copy(grpo_run, tmp_path_factory.mktemp("fuzz"))
    ckpt = out / "checkpoints" / "last.ckpt"
    state = ckpt_format.load(ckpt)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(Path(grpo_run) / "model"))
    state["composer"]["vacuous"] = {"tally": vacuous.Tally("main", 0, 2, steps=1).state(),
                                    "fingerprint": vacuous.fingerprint(model)}
    torch.save(state, ckpt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt_format, "check_state", spy)
        r = _resume(out)
    assert r.exit_code == 0, r.output[-2000:]
    return seen[0]


def _paths(value, prefix=()):
    """Every container and tensor in a checkpoint, by path (plain leaves are left out: a number replaced by
    another number may be a valid checkpoint; so are the items of a tuple, which cannot be replaced in place)."""
    if prefix[:1] == ("state_dict",) or prefix[:2] == ("composer", "spec"):
        return  # checked by checkpoint.load and check_fits, and by check_resume's spec record
    if isinstance(value, (dict, list, tuple, torch.Tensor)) and prefix:
        yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


BENIGN = {"best_k_models"}  # ModelCheckpoint's table of the best checkpoints: any mapping (none are kept here)


def test_a_seeded_fuzz_of_every_field_is_refused_with_its_path(checked):
    """Each container or tensor of a real checkpoint, replaced by garbage, a number or a wrongly shaped tensor
    (seeded: the same 150 of them every time):
    check_state refuses it and names the field's path (or a field above it)."""
    state, expected = checked
    paths = [p for p in _paths(state) if not any(str(x) in BENIGN for x in p[1:])]
    assert len(paths) > 100
    rng = random.Random(57)
    for path in rng.sample(paths, 150):
        damaged = copy.deepcopy(state)
        target = _at(damaged, path)
        scalar = isinstance(target, torch.Tensor) and target.numel() == 1  # a number may stand for it (a step)
        how = rng.choice(["garbage"] + ([] if scalar else [7]) + (["shape"] if isinstance(target, torch.Tensor) else []))
        _set(damaged, path, (target.reshape(-1)[:-1] if target.numel() > 1 else torch.zeros(3)) if how == "shape"
             else how)
        with pytest.raises(ckpt_format.CheckpointError) as e:
            ckpt_format.check_state(damaged, Path("last.ckpt"), expected)
        top = str(path[0])
        assert "last.ckpt: the checkpoint's training state is damaged" in str(e.value) and top in str(e.value), \
            (path, how, str(e.value))
    ckpt_format.check_state(state, Path("last.ckpt"), expected)  # the undamaged state passes


# ------------------------------------------------------------------------------ a full disk


def test_a_full_disk_names_the_disk_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """ENOSPC inside torch's zip writer surfaced as `unexpected pos N vs M` (a RuntimeError), an internal error."""
    path = tmp_path / "last.ckpt"
    ckpt_format.save({"weights": torch.zeros(10)}, path)
    good = path.read_bytes()

    class Full:
        """The file, until 1000 bytes are written: then ENOSPC, as a full disk says it."""

        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    real_init = ckpt_format._Writes.__init__
    monkeypatch.setattr(ckpt_format._Writes, "__init__", lambda self, f: real_init(self, Full(f)))
    with pytest.raises(ckpt_format.CheckpointError) as e:
        ckpt_format.save({"weights": torch.zeros(100_000)}, path)
    assert f"cannot write the checkpoint {path}" in str(e.value) and "is full" in str(e.value)
    assert "the previous checkpoint is kept" in str(e.value)
    assert path.read_bytes() == good and not (tmp_path / "last.ckpt.tmp").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 2.2 MB tmpfs: room for one tiny-model checkpoint, not for the next one's temporary file beside it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2200k", "tmpfs", str(disk)], capture_output=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:100]}); the monkeypatched test covers it")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)


def test_a_run_on_a_full_disk_stops_with_a_message_and_its_last_checkpoint(tiny_model, small_disk):
    """A real ENOSPC: the step-1 checkpoint fits, the step-2 one does not."""
    out = small_disk / "run"
    r = cli("run", "specs/sft.yaml", f"policy.model={tiny_model}", "train.steps=2", "train.checkpoint_every=1",
            "train.samples_every=0", *SFT, "--no-progress", "--out", out)
    assert r.exit_code == 2, r.output[-2000:]
    assert "internal error" not in r.stderr and "is full" in r.stderr, r.stderr[-1500:]
    assert f"cannot write the checkpoint {out / 'checkpoints' / 'last.ckpt'}" in r.stderr
    assert ckpt_format.load(out / "checkpoints" / "last.ckpt")["global_step"] == 1
    assert not (out / "checkpoints" / "last.ckpt.tmp").exists()


# ------------------------------------------------------------------------------ the data a run trains on


def test_resume_refuses_a_data_file_changed_under_the_same_path(tiny_model, tmp_path):
    """Before: --resume trained on whatever the file held now. The opt-in continues and records the new data."""
    data = tmp_path / "data"
    assert cli("toy-data", "--out", data).exit_code == 0
    train = data / "train.jsonl"
    out = _run(tiny_model, "specs/sft.yaml", tmp_path / "run", f"data.train={train}", f"data.eval={data / 'eval_2.jsonl'}")
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(lines[1:] + lines[:1]))  # the same rows and size, in another order
    before = snapshot(out)
    r = _resume(out)
    assert r.exit_code == 2 and "internal error" not in r.stderr, r.output[-2000:]
    assert f"{train}: its contents changed since the checkpoint (same size, other bytes)" in r.stderr
    assert f"composer run --resume {out} train.steps=2 --allow-changed-data" in r.stderr
    assert snapshot(out) == before
    r = _resume(out, "--allow-changed-data")
    assert r.exit_code == 0, r.output[-2000:]
    assert "resuming on changed data (--allow-changed-data)" in r.stderr
    assert ckpt_format.load(out / "checkpoints" / "last.ckpt")["composer"]["data_files"][str(train)] == \
        ckpt_format.fingerprint(str(train))


def test_resume_on_unchanged_data_needs_no_opt_in_and_the_opt_in_needs_resume(tiny_model, tmp_path):
    data = tmp_path / "data"
    assert cli("toy-data", "--out", data).exit_code == 0
    out = _run(tiny_model, "specs/sft.yaml", tmp_path / "run", f"data.train={data / 'train.jsonl'}",
               f"data.eval={data / 'eval_2.jsonl'}")
    assert _resume(out).exit_code == 0
    r = cli("run", "specs/sft.yaml", "--allow-changed-data", "--out", tmp_path / "new")
    assert r.exit_code == 2 and "only applies to --resume" in r.output


# ------------------------------------------------------------------------------ SPEC with --resume (issue 56)


def _hinted(stderr: str) -> list[str]:
    """The command between backquotes on the hint line, as arguments."""
    line = next(x for x in stderr.splitlines() if "hint:" in x)
    return shlex.split(line.split("`")[1])[2:]  # without `composer run`


def test_the_runs_spec_given_again_resumes(sft_run, tiny_model, tmp_path):
    out = _copy(sft_run, tmp_path)
    r = cli("run", "specs/sft.yaml", "--resume", out, f"policy.model={tiny_model}", *SFT, "train.steps=2",
            "--no-progress")
    assert r.exit_code == 0, r.output[-2000:]


def test_spec_with_resume_that_differs_is_refused_with_the_exact_command(sft_run, tmp_path):
    """Before: the hint said `composer run --resume DIR`, dropping the train.steps=2 the command asked for."""
    out = _copy(sft_run, tmp_path)
    r = cli("run", "specs/sft.yaml", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 2 and "trained with another spec" in r.stderr and "policy.model" in r.stderr
    assert f"`composer run --resume {out} train.steps=2`" in r.stderr, r.stderr
    r = cli(*["run", *_hinted(r.stderr), "--no-progress"])
    assert r.exit_code == 0, r.output[-2000:]
    assert "steps: 2" in (out / "spec.yaml").read_text()  # written once the checkpoint passed its checks


def test_spec_with_resume_and_no_spec_yaml_gives_the_overrides_back(sft_run, tmp_path):
    """Without the folder's spec.yaml, the hint is SPEC with the run's values as overrides, and it works."""
    out = _copy(sft_run, tmp_path)
    (out / "spec.yaml").unlink()
    r = cli("run", "specs/sft.yaml", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 2 and "has no spec.yaml" in r.stderr, r.stderr
    args = _hinted(r.stderr)
    assert args[:3] == ["specs/sft.yaml", "--resume", str(out)] and "train.steps=2" in args
    r = cli(*["run", *args, "--no-progress"])
    assert r.exit_code == 0, r.output[-2000:]


def test_another_spec_with_resume_is_a_clear_refusal(sft_run, tmp_path):
    out = _copy(sft_run, tmp_path)
    before = snapshot(out)
    r = cli("run", "specs/grpo.yaml", "--resume", out, "--no-progress")
    assert r.exit_code == 2 and "trained with another spec" in r.stderr and "objective.kind" in r.stderr
    assert "start a new run" in r.stderr and "internal error" not in r.stderr
    assert snapshot(out) == before


# ------------------------------------------------------------------------------ a component's own state


def test_a_runtime_state_the_component_cannot_take_names_its_field(tmp_path):
    """composer.runtimes holds each component's own layout (EMA teacher, critic, reward normaliser): it is loaded
    when the component is built, mid-run; a state it cannot take was an internal error there."""
    from components.sources.reward_model import RewardModelScorer

    scorer = RewardModelScorer.__new__(RewardModelScorer)  # the real class; its model is not needed to load moments
    key = repr(("source", "rm", "{}"))
    with pytest.raises(ckpt_format.CheckpointError) as e:
        ckpt_format.restore_runtime(scorer, {"count": "many", "mean": 0.0, "m2": 0.0}, key, tmp_path)
    text = str(e.value)
    assert str(tmp_path / "checkpoints" / "last.ckpt") in text and "field composer.runtimes[" in text
    assert "RewardModelScorer" in text and "ValueError" in text
    ckpt_format.restore_runtime(scorer, {"count": 3, "mean": 0.5, "m2": 1.0}, key, tmp_path)  # an intact one loads
    assert (scorer.count, scorer.mean, scorer.m2) == (3, 0.5, 1.0)


# --------------------------------------------------------------- checkpoints are plain data, never unpickled (issue 17)


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


# --------------------------------------------------------------- resume checks the spec and the architecture (issue 17)


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


# ------------------------------------------------------------ a full disk keeps the previous checkpoint (issues 17, 29)


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


def test_a_full_disk_inside_torchs_zip_writer_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch

    from composer.backends.lightning import callbacks
    from composer.runtime.checkpoint import CheckpointError

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"previous")

    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match="the previous checkpoint is kept"):
        callbacks.AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, path)
    assert path.read_bytes() == b"previous" and not (tmp_path / "last.ckpt.tmp").exists()
