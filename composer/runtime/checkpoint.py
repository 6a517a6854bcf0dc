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
