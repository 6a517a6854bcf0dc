"""What a checkpoint holds and how it is read back: tensors and plain data only, never pickled objects.

A checkpoint is read with `torch.load(weights_only=True)`: its unpickler builds tensors, numbers,
strings, lists, tuples and dicts and refuses every other global, so a crafted `last.ckpt` cannot run
code. The run's own objects (the rollout buffer's TrajectoryBatch, Example and Verdict dataclasses)
are written as tagged dicts by `to_plain` and rebuilt by `from_plain` from an explicit allow-list.

A checkpoint also records the resolved spec it was trained with (`spec_record`), so that `--resume`
can refuse a different spec or override with the list of what differs (`spec_changes`), except for
the few settings that may change on resume (`RESUMABLE`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from composer.batch import TrajectoryBatch
from composer.data import Example, Verdict

ALLOWED = {cls.__name__: cls for cls in (TrajectoryBatch, Example, Verdict)}
TAG = "__dataclass__"
# Settings a resumed run may change: how long it runs and how often it checkpoints. Everything else
# would make the resumed run a different experiment than the one its checkpoint continues.
RESUMABLE = ("train.steps", "train.checkpoint_every", "train.samples_every", "train.log_every", "summary")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written, or does not fit this run: names the file and the reason."""


# ------------------------------------------------------------------------------------ plain data

def to_plain(value: Any, where: str = "state", lenient: bool = False) -> Any:
    """`value` as tensors and plain data; allow-listed dataclasses become {TAG: name, field: ...}.

    `lenient`: drop what cannot be stored (inside a batch's `info`, which holds caches and metrics the
    run recomputes) instead of raising.
    """
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value).__name__ in ALLOWED \
            and ALLOWED[type(value).__name__] is type(value):
        out = {TAG: type(value).__name__}
        for f in dataclasses.fields(value):
            out[f.name] = to_plain(getattr(value, f.name), f"{where}.{f.name}",
                                   lenient=lenient or (f.name in ("info", "meta")))
        return out
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]", lenient) for i, v in enumerate(value)]
        items = [v for v in items if v is not _DROP]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) or k == TAG:
                if lenient:
                    continue
                raise CheckpointError(f"cannot store the key {k!r} of {where} in a checkpoint")
            plain = to_plain(v, f"{where}.{k}", lenient)
            if plain is not _DROP:
                out[k] = plain
        return out
    if lenient:
        return _DROP
    raise CheckpointError(f"cannot store {type(value).__name__} at {where} in a checkpoint (tensors and plain "
                          "data only)")


_DROP = object()


def from_plain(value: Any) -> Any:
    """Rebuild what `to_plain` wrote; only the allow-listed dataclasses are ever constructed."""
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    if isinstance(value, dict):
        if TAG in value:
            cls = ALLOWED.get(value[TAG])
            if cls is None:
                raise CheckpointError(f"the checkpoint names an unknown type {value[TAG]!r}")
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: from_plain(v) for k, v in value.items() if k in names})
        return {k: from_plain(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------------------------ writing

class _Writes:
    """The checkpoint's file as torch.save's zip writer sees it, keeping the OSError a write raised: the writer
    reports a failed write only as `unexpected pos N vs M` (a full disk, ENOSPC), which names no cause."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = e
            raise


def save(checkpoint: dict, path: Path | str) -> None:
    """Write `checkpoint` to a temporary file beside `path`, then rename it: a half-written checkpoint is never
    taken for a good one. A failed write (a full disk, a folder that went read-only) removes the temporary
    file, keeps the previous checkpoint, and is a CheckpointError naming the path and the cause."""
    import os

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writes = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        from composer import files

        with files.open_new(tmp) as f:  # a link planted at last.ckpt.tmp is removed, never written through
            writes = _Writes(f)
            torch.save(checkpoint, writes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a partial file would keep filling the disk
        error = writes.error if writes is not None and writes.error is not None else e
        # torch's zip writer reports a failed write as a RuntimeError: "PytorchStreamWriter failed writing
        # file" (a file path) or "unexpected pos N vs M" (a file object whose write failed)
        if isinstance(error, OSError) or (isinstance(e, RuntimeError) and (
                "PytorchStreamWriter" in str(e) or "unexpected pos" in str(e))):
            why = error.strerror if isinstance(error, OSError) and error.strerror else (str(e).splitlines() or [""])[0]
            if isinstance(error, OSError) and error.errno == errno.ENOSPC:
                why = f"the disk holding {path.parent} is full ({why})"
            elif not isinstance(error, OSError):
                why += " (a full disk?)"
            raise CheckpointError(f"cannot write the checkpoint {path}: {why}; the previous checkpoint is kept") \
                from None
        raise


# ------------------------------------------------------------------------------------ reading

def load(path: Path | str, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """A checkpoint, read with weights_only=True; a damaged or foreign file is a CheckpointError."""
    path = Path(path)
    what = "the checkpoint"
    try:
        if path.is_dir():
            raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: is empty (a checkpoint write that never finished?)")
        data = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except Exception as e:  # truncated zip, random bytes, a pickle asking for code (UnpicklingError)
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if "Weights only load failed" in str(e) or "Unsupported global" in str(e):
            reason = "it asks to build Python objects that a checkpoint of this program never holds (refused unread)"
        else:
            reason = f"the file is damaged or not a checkpoint ({type(e).__name__}: {detail})"
        raise CheckpointError(f"{path}: {what} cannot be read: {reason}\n    hint: restore a good copy of the "
                              "file, or start a new run") from None
    if not isinstance(data, dict) or "state_dict" not in data:
        raise CheckpointError(f"{path}: not a checkpoint of a run (no state_dict)")
    sd = data["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{path}: the checkpoint is damaged: its state_dict is not a mapping of weight names "
                              "to tensors\n    hint: restore a good copy of the file, or start a new run")
    return data


def first_non_finite(tensors: dict) -> str | None:
    """The name of the first floating-point tensor with a NaN or inf, else None."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


def check_fits(state_dict: dict, module: torch.nn.Module, path: Path) -> None:
    """Refuse a checkpoint whose weights have other names or shapes than this run's model."""
    mine = module.state_dict()
    missing = [k for k in mine if k not in state_dict]
    extra = [k for k in state_dict if k not in mine]
    shapes = [k for k in mine if k in state_dict and tuple(state_dict[k].shape) != tuple(mine[k].shape)]
    if missing or extra or shapes:
        parts = []
        if shapes:
            k = shapes[0]
            parts.append(f"{len(shapes)} weights differ in shape (e.g. {k}: {tuple(state_dict[k].shape)} in the "
                         f"checkpoint, {tuple(mine[k].shape)} here)")
        if missing:
            parts.append(f"{len(missing)} weights are missing (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} weights are unknown here (e.g. {extra[0]})")
        raise CheckpointError(f"{path}: the checkpoint holds another architecture than the policy of this spec: "
                              + "; ".join(parts))


# ------------------------------------------------------------------------------------ the data a run reads

_FINGERPRINTS: dict = {}  # (real path, size, mtime) -> fingerprint: hashed once per process


def _file_fingerprint(path: Path) -> tuple[int, str]:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FINGERPRINTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _FINGERPRINTS[key] = (st.st_size, h.hexdigest())
    return _FINGERPRINTS[key]


def fingerprint(name: str) -> str | None:
    """"<size> bytes, sha256 <hex>" of a data file (a folder: of its files, names and bytes, in order); None for
    a name that is no local path (a cached hub dataset is read from its snapshot folder)."""
    path = Path(name)
    if not path.exists():
        from composer.runtime.datafiles import hub_snapshot

        path = hub_snapshot(name)
        if path is None:
            return None
    if path.is_file():
        size, digest = _file_fingerprint(path)
        return f"{size} bytes, sha256 {digest}"
    h, size = hashlib.sha256(), 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        n, digest = _file_fingerprint(f)
        size += n
        h.update(f"{f.relative_to(path)}\0{digest}\0".encode())
    return f"{size} bytes, sha256 {h.hexdigest()}"


def data_fingerprints(validated) -> dict[str, str]:
    """{path as the spec names it: fingerprint} of every data file the run reads (data.train and data.eval of
    every segment): kept in each checkpoint, so that --resume can refuse data that changed under the same path."""
    segments = getattr(validated, "segments", None) or []
    out = {}
    for spec in [s.spec for s in segments] or [validated.spec]:
        for name in (spec.data.train, spec.data.eval):
            if name and name not in out:
                fp = fingerprint(name)
                if fp is not None:
                    out[name] = fp
    return out


def data_changes(recorded, now: dict) -> list[str]:
    """One line per data file whose fingerprint differs from the checkpoint's (recorded None: an older
    checkpoint, nothing to compare)."""
    if not isinstance(recorded, dict):
        return []
    lines = []
    for name, old in sorted(recorded.items()):
        new = now.get(name)
        if new is not None and new != old:
            sizes = (old.split(",")[0], new.split(",")[0])
            what = f"{sizes[0]} then, {sizes[1]} now" if sizes[0] != sizes[1] else "same size, other bytes"
            lines.append(f"    {name}: its contents changed since the checkpoint ({what})")
    return lines


# ------------------------------------------------------------------------------------ the spec record

def _json_value(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def spec_record(validated) -> dict:
    """{"hash", "json"}: the resolved spec (defaults filled in, overrides applied) a checkpoint was trained with."""
    resolved = _json_value(validated.spec.model_dump(mode="python"))
    text = json.dumps(resolved, sort_keys=True)
    return {"hash": hashlib.sha256(text.encode()).hexdigest(), "json": text}


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def spec_changes(record: dict, validated) -> list[tuple[str, Any, Any]]:
    """(path, value in the checkpoint's spec, value now) for every difference; [] when the specs agree."""
    new = spec_record(validated)
    if record.get("hash") == new["hash"]:
        return []
    old_values, new_values = _flatten(json.loads(record["json"])), _flatten(json.loads(new["json"]))
    missing = object()
    return [(k, old_values.get(k, missing), new_values.get(k, missing))
            for k in sorted(set(old_values) | set(new_values), key=str)
            if old_values.get(k, missing) != new_values.get(k, missing)]


def describe_changes(changes: list) -> str:
    def show(v):
        return "(not set)" if not isinstance(v, (str, int, float, bool, type(None), list, dict)) else json.dumps(v)

    return "\n".join(f"    {path}: {show(old)} -> {show(new)}" for path, old, new in changes)


# ------------------------------------------------------------------------------------ resuming: every field checked
#
# A resume restores a checkpoint's fields in many places (Lightning's loops, callbacks, optimizer and
# schedulers; the module's on_train_start; components' runtimes). A tampered or damaged field used to
# fail deep inside one of them as an internal error. `check_state` checks every field once, against
# templates taken from the live run (never from the file), before anything is restored or any file of
# the run folder is changed.

DAMAGED_HINT = ("    hint: restore a good copy of the file (the run's own checkpoints/last.ckpt), or start a new run; "
                "nothing was restored or changed")
# the module's fields (ComposerModule.on_save_checkpoint): required, optional (older checkpoints lack them)
COMPOSER_FIELDS = ("rollout_weights", "last_sync", "rng", "torch_rng", "data_pos", "segment", "initial")
COMPOSER_OPTIONAL = ("runtimes", "memo", "costs", "buffer", "buffer_version", "vacuous", "spec", "data_files")


class _Bad(Exception):
    """One damaged field: its path in the checkpoint and what is wrong with it."""

    def __init__(self, field: str, why: str):
        super().__init__(field, why)
        self.field, self.why = field, why


@dataclasses.dataclass
class Expected:
    """What this run restores a checkpoint into, taken from the live run: the names and shapes of the
    policy's weights (the rollout copy's too), the optimizer's parameter shapes, fresh states of the
    optimizer, scheduler, loops and callbacks (their structure and types), the segment names, the vocabulary
    size and the number of trainable tensors (the vacuity fingerprint holds two numbers per tensor)."""

    weights: dict
    params: list
    optimizer: dict
    scheduler: dict
    loops: dict
    callbacks: dict
    segments: list
    vocab: int
    trainable: int
    initial: Any = None  # names -> shapes of the initial copy when they differ from `weights` (a LoRA policy)
    needs_initial: bool = False  # a term or source of the spec reads the frozen initial weights
    sharded: bool = False  # FSDP: its optimizer state is keyed by parameter names, checked by the strategy


def damaged(path: Path, field: str, why: str) -> CheckpointError:
    """The error of a damaged field: the file, the field's path in the checkpoint, what is wrong, what to do."""
    return CheckpointError(f"{path}: the checkpoint's training state is damaged, so it cannot be resumed: field "
                           f"{field}: {why}\n{DAMAGED_HINT}")


def check_state(state: dict, path: Path, expected: Expected) -> None:
    """Refuse a checkpoint any of whose fields a resume could not restore as written (a CheckpointError from
    `damaged`)."""
    try:
        for check in (_lightning_fields, _optimizer_fields, _scheduler_fields, _composer_fields):
            check(state, expected)
    except _Bad as bad:
        raise damaged(path, bad.field, bad.why) from None


def restore_runtime(runtime, state: dict, key: str, run_dir=None) -> None:
    """A component's checkpointed state (`composer.runtimes[key]`) back into its freshly built runtime: an EMA
    teacher's weights, a critic's network and optimizer, a reward normaliser's moments. Their layout is each
    component's own, so `check_state` checks only that they are mappings; a state the runtime cannot take is a
    CheckpointError naming the field, never an internal error in the middle of the run."""
    try:
        runtime.load_state_dict(state)
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        path = Path(run_dir) / "checkpoints" / "last.ckpt" if run_dir is not None else Path("the checkpoint")
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise damaged(path, f"composer.runtimes[{key!r:.100}]", f"the {type(runtime).__name__} of this spec cannot "
                                                                 f"take it ({type(e).__name__}: {detail})") from None


def _kind(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "list"
    return {str: "str", dict: "dict"}.get(type(value), type(value).__name__)


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).replace('torch.', '')} tensor"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def like(value, template, field: str) -> None:
    """`value` has the structure of `template` (a fresh state of the same object): every key of a template
    dict (more are allowed: the restoring code ignores them), lists of the same length, and leaves of the
    same kind (int and float alike; where the template holds None, an unset optional, any single value; a
    flag may be None)."""
    kind, want = _kind(value), _kind(template)
    if want == "dict":
        if kind != "dict":
            raise _Bad(field, f"expected a mapping, found {_shown(value)}")
        for k, v in template.items():
            if k not in value:
                raise _Bad(f"{field}.{k}", "missing")
            like(value[k], v, f"{field}.{k}")
    elif want == "list":
        if kind != "list" or len(value) != len(template):
            raise _Bad(field, f"expected a list of {len(template)}, found {_shown(value)}")
        for i, (v, t) in enumerate(zip(value, template)):
            like(v, t, f"{field}[{i}]")
    elif want == "tensor":
        if kind != "tensor" or value.shape != template.shape or value.dtype != template.dtype:
            raise _Bad(field, f"expected {_shown(template)}, found {_shown(value)}")
    elif want == "none":  # an unset optional (a score not yet measured): any single value
        if kind in ("dict", "list"):
            raise _Bad(field, f"expected a single value, found {_shown(value)}")
    elif kind != want and not (kind == "none" and want == "bool"):  # a flag may be unset (None)
        raise _Bad(field, f"expected a {want}, found {_shown(value)}")


def _count(value, field: str, low: int = 0, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise _Bad(field, f"expected a whole number {bound}, found {_shown(value)}")
    return value


def _mapping(value, field: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(field, f"expected a mapping, found {_shown(value)}")
    return value


def _weights(value, field: str, shapes: dict) -> None:
    """A copy of the policy's weights: exactly its names, each a floating tensor of its shape."""
    value = _mapping(value, field)
    missing = [k for k in shapes if k not in value]
    extra = [k for k in value if k not in shapes]
    if missing or extra:
        raise _Bad(field, f"{len(missing)} of the policy's {len(shapes)} weights are missing"
                          + (f" (e.g. {missing[0]})" if missing else "")
                          + (f", {len(extra)} are unknown here (e.g. {extra[0]!r:.80})" if extra else ""))
    for k, shape in shapes.items():
        t = value[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            raise _Bad(f"{field}.{k}", f"expected a {tuple(shape)} tensor, found {_shown(t)}")


def _lightning_fields(state: dict, expected: Expected) -> None:
    """The fields Lightning restores: its version (read to migrate old checkpoints), the epoch, the loops'
    progress counters and the callbacks' states."""
    from packaging.version import InvalidVersion, Version

    version = state.get("pytorch-lightning_version")
    try:
        Version(version)
    except (InvalidVersion, TypeError):
        raise _Bad("pytorch-lightning_version", f"expected a version like '2.5.0', found {_shown(version)}") from None
    _count(state.get("epoch"), "epoch")
    like(state.get("loops"), expected.loops, "loops")
    callbacks = _mapping(state.get("callbacks", {}), "callbacks")
    for key, template in expected.callbacks.items():
        if key in callbacks and template:  # Lightning restores only the callbacks of this run
            like(callbacks[key], template, f"callbacks.{key.split('{')[0]}")


def _optimizer_fields(state: dict, expected: Expected) -> None:
    """The optimizer's moments (one entry per parameter, each the parameter's shape) and settings: a missing
    one would resume with fresh moments."""
    opts = state.get("optimizer_states")
    if not isinstance(opts, list) or len(opts) != 1:
        raise _Bad("optimizer_states", f"expected a list of 1 optimizer state, found {_shown(opts)}")
    opt = _mapping(opts[0], "optimizer_states[0]")
    if expected.sharded:
        _mapping(opt.get("state"), "optimizer_states[0].state")
        return
    like(opt.get("param_groups"), expected.optimizer["param_groups"], "optimizer_states[0].param_groups")
    for i, (group, fresh) in enumerate(zip(opt["param_groups"], expected.optimizer["param_groups"])):
        if list(group["params"]) != list(fresh["params"]):
            raise _Bad(f"optimizer_states[0].param_groups[{i}].params",
                       f"expected the parameter indices 0..{len(fresh['params']) - 1}, found {_shown(group['params'])}")
    moments = _mapping(opt.get("state"), "optimizer_states[0].state")
    for index, entry in moments.items():
        where = f"optimizer_states[0].state[{index!r}]"
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(expected.params):
            raise _Bad(where, f"not a parameter index (0..{len(expected.params) - 1})")
        entry = _mapping(entry, where)
        if entry and not {"step", "exp_avg", "exp_avg_sq"} <= set(entry):
            raise _Bad(where, f"expected step, exp_avg and exp_avg_sq, found {sorted(map(str, entry))}")
        shape = tuple(expected.params[index])
        for name, t in entry.items():
            if name == "step":  # a count: a one-element tensor, or a number in older checkpoints
                if not (isinstance(t, torch.Tensor) and t.numel() == 1 or _kind(t) == "number"):
                    raise _Bad(f"{where}.step", f"expected the parameter's step count, found {_shown(t)}")
            elif not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
                raise _Bad(f"{where}.{name}", f"expected a {shape} floating tensor (the parameter's shape), "
                                              f"found {_shown(t)}")


def _scheduler_fields(state: dict, expected: Expected) -> None:
    """The LR scheduler's state: its step count and the Plan's base rates (a fresh scheduler's structure)."""
    scheds = state.get("lr_schedulers")
    if not isinstance(scheds, list) or len(scheds) != 1:
        raise _Bad("lr_schedulers", f"expected a list of 1 scheduler state, found {_shown(scheds)}")
    like(scheds[0], expected.scheduler, "lr_schedulers[0]")
    _count(scheds[0]["last_epoch"], "lr_schedulers[0].last_epoch")


def _composer_fields(state: dict, expected: Expected) -> None:
    """The run's own state (ComposerModule.on_save_checkpoint): each field as the module restores it."""
    import ast
    import random

    c = _mapping(state.get("composer"), "composer")
    for name in COMPOSER_FIELDS:
        if name not in c:
            raise _Bad(f"composer.{name}", "missing")
    unknown = [k for k in c if k not in COMPOSER_FIELDS + COMPOSER_OPTIONAL]
    if unknown:
        raise _Bad(f"composer.{unknown[0]}", f"not a field of a checkpoint of this program (known: "
                                              f"{', '.join(COMPOSER_FIELDS + COMPOSER_OPTIONAL)})")
    if c["rollout_weights"] is not None:
        _weights(c["rollout_weights"], "composer.rollout_weights", expected.weights)
    if c["initial"] is None and expected.needs_initial:  # else a copy of the weights at resume would stand in
        raise _Bad("composer.initial", "missing, but this spec's terms read the frozen initial weights")
    if c["initial"] is not None and (c["initial"] or expected.initial is None):  # {}: a LoRA policy's base
        _weights(c["initial"], "composer.initial", expected.initial() if expected.initial else expected.weights)
    step = state.get("global_step") if isinstance(state.get("global_step"), int) else None
    _count(c["last_sync"], "composer.last_sync", 0, step)
    try:
        rng = c["rng"]
        random.Random().setstate((rng[0], tuple(rng[1]), rng[2]))
    except (TypeError, ValueError, IndexError, KeyError, OverflowError):
        raise _Bad("composer.rng", f"not a random generator's state (found {_shown(c['rng'])})") from None
    try:
        torch.Generator().set_state(c["torch_rng"])
    except (TypeError, RuntimeError):
        raise _Bad("composer.torch_rng", f"not torch's random state (found {_shown(c['torch_rng'])})") from None
    _count(c["data_pos"], "composer.data_pos")
    if c["segment"] not in expected.segments:
        raise _Bad("composer.segment", f"expected one of this spec's segments ({', '.join(map(repr, expected.segments))}), "
                                       f"found {_shown(c['segment'])}")
    runtimes = _mapping(c.get("runtimes", {}), "composer.runtimes")
    for key, value in runtimes.items():
        _literal_key(key, f"composer.runtimes[{key!r:.60}]", ast)
        _mapping(value, f"composer.runtimes[{key!r:.60}]")
    for key, value in _mapping(c.get("memo", {}), "composer.memo").items():
        where = f"composer.memo[{key!r:.60}]"
        parts = _literal_key(key, where, ast)
        if parts[:2] != ("guide", "prefix-search") or len(parts) not in (3, 4):
            raise _Bad(where, "not a key of a prefix search's table")
        kind = str if parts[2:3] == ("traces",) else int
        if not isinstance(value, dict) or not all(isinstance(k, str) and type(v) is kind for k, v in value.items()):
            raise _Bad(where, f"expected a mapping of prompts to {'trace texts' if kind is str else 'counts'}, "
                              f"found {_shown(value)}")
    for key, value in _mapping(c.get("costs", {}), "composer.costs").items():
        if not isinstance(key, str) or not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value) or value < 0:
            raise _Bad(f"composer.costs.{key}", f"expected a count >= 0, found {_shown(value)}")
    _count(c.get("buffer_version", -1), "composer.buffer_version", -1)
    if c.get("buffer"):
        _buffer(c["buffer"], expected)
    if c.get("vacuous") is not None:
        _vacuous(c["vacuous"], expected)
    files = c.get("data_files")
    if files is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in _mapping(
            files, "composer.data_files").items()):
        raise _Bad("composer.data_files", f"expected a mapping of data paths to fingerprints, found {_shown(files)}")


def _literal_key(key, where: str, ast) -> tuple:
    try:
        parts = ast.literal_eval(key) if isinstance(key, str) else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        parts = None
    if not isinstance(parts, tuple) or not all(isinstance(p, str) for p in parts):
        raise _Bad(where, "its key is not a tuple of names")
    return parts


BATCH_ROWS = ("group", "control", "rewards", "seq_weight", "prompt_index", "guided", "row_mask")
BATCH_TOKENS = ("origin", "behavior_logprobs", "teacher_logprobs", "initial_logprobs", "behavior_known",
                "old_logprobs", "token_select", "old_entropy", "values", "returns")


def _buffer(value, expected: Expected) -> None:
    """The stored rollouts (sync.reuse): a list of TrajectoryBatch, each consistent in its rows and tokens."""
    from composer.origins import ORIGINS

    if not isinstance(value, list):
        raise _Bad("composer.buffer", f"expected a list of trajectory batches, found {_shown(value)}")
    for i, plain in enumerate(value):
        where = f"composer.buffer[{i}]"
        if not isinstance(plain, dict) or plain.get(TAG) != "TrajectoryBatch":
            raise _Bad(where, f"expected a trajectory batch, found {_shown(plain)}")
        try:
            batch = from_plain(plain)
        except (TypeError, ValueError, CheckpointError) as e:
            raise _Bad(where, f"cannot be rebuilt ({str(e)[:120]})") from None
        tokens = batch.tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise _Bad(f"{where}.tokens", f"expected a [rows, tokens] int64 tensor, found {_shown(tokens)}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= expected.vocab):
            raise _Bad(f"{where}.tokens", f"holds token ids outside the policy's vocabulary (0..{expected.vocab - 1})")
        rows = tokens.shape[0]
        for name in BATCH_ROWS + BATCH_TOKENS + ("advantages", "teacher_logits"):
            t = getattr(batch, name)
            if t is None and name not in ("origin", "behavior_logprobs", "group", "control"):
                continue
            lead = tuple(tokens.shape) if name in BATCH_TOKENS else (rows,)
            if not isinstance(t, torch.Tensor) or tuple(t.shape[:len(lead)]) != lead or \
                    (name not in ("advantages", "teacher_logits") and t.dim() != len(lead)):
                raise _Bad(f"{where}.{name}", f"expected a tensor of shape {lead}, found {_shown(t)}")
        for name, ok in (("origin", lambda t: t.dtype == torch.uint8), ("group", lambda t: t.dtype == torch.long),
                         ("control", lambda t: t.dtype == torch.bool),
                         ("behavior_logprobs", lambda t: t.is_floating_point())):
            if not ok(getattr(batch, name)):
                raise _Bad(f"{where}.{name}", f"has the wrong type of elements ({_shown(getattr(batch, name))})")
        if batch.origin.numel() and int(batch.origin.max()) >= len(ORIGINS):
            raise _Bad(f"{where}.origin", "holds an unknown origin code")
        if not isinstance(batch.examples, list) or len(batch.examples) != rows or \
                not all(isinstance(e, Example) for e in batch.examples):
            raise _Bad(f"{where}.examples", f"expected {rows} examples, found {_shown(batch.examples)}")
        if not isinstance(batch.info, dict) or not isinstance(batch.notes, list):
            raise _Bad(f"{where}.info", "expected a mapping (and notes a list)")


def _vacuous(value, expected: Expected) -> None:
    """The vacuity tally of the segment in progress (composer/runtime/vacuous.py) and its weights' fingerprint."""
    from composer.runtime.vacuous import Tally

    value = _mapping(value, "composer.vacuous")
    tally = _mapping(value.get("tally"), "composer.vacuous.tally")
    for f in dataclasses.fields(Tally):
        where = f"composer.vacuous.tally.{f.name}"
        if f.name not in tally:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Bad(where, "missing")
            continue
        v = tally[f.name]
        if f.name == "segment":
            if v not in expected.segments:
                raise _Bad(where, f"expected one of this spec's segments, found {_shown(v)}")
        elif f.name == "moved":
            if v not in (None, True, False):
                raise _Bad(where, f"expected true, false or none, found {_shown(v)}")
        elif f.name in ("gate_empty", "gate_seen"):
            if not isinstance(v, dict) or not all(isinstance(k, str) and type(n) is int and n >= 0 for k, n in v.items()):
                raise _Bad(where, f"expected a mapping of term names to counts, found {_shown(v)}")
        else:
            _count(v, where)
    unknown = [k for k in tally if k not in {f.name for f in dataclasses.fields(Tally)}]
    if unknown:
        raise _Bad(f"composer.vacuous.tally.{unknown[0]}", "not a field of the tally")
    fp = value.get("fingerprint")
    if not isinstance(fp, list) or len(fp) != 2 * expected.trainable or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in fp):
        raise _Bad("composer.vacuous.fingerprint", f"expected {2 * expected.trainable} numbers (two per trainable "
                                                   f"tensor), found {_shown(fp)}")
