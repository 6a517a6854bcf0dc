"""Bind a spec to what it trains on: the toy testbed when no data is given, else the data files."""

from __future__ import annotations

import json
from pathlib import Path

from composer.data import Example, Task


class DataError(Exception):
    """Bad input data: names the file, the row and the field."""


def bind_task(spec) -> Task:
    from components.tasks.toy import toy_task

    d = spec.data
    if d.train is None:
        task = toy_task(tiers=tuple(d.tiers), train_tiers=tuple(d.train_tiers), eval_per_tier=spec.train.eval_samples,
                        seed=spec.train.seed)
        return task
    train, skipped = load_examples(d.train, d)
    evals = {}
    if d.eval:
        evals["eval"], s2 = load_examples(d.eval, d)
        skipped += s2
    task = Task(name=Path(d.train).stem, train=train, eval=evals, verifier="math")
    task.skipped_rows = skipped
    return task


def _rows(path: Path):
    if path.is_dir():
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys") and "train" in ds:
            ds = ds["train"]
        yield from enumerate(ds)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist())
    else:
        with path.open("rb") as f:
            for i, raw in enumerate(f):
                if not raw.strip():
                    continue
                try:
                    yield i, json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    yield i, DataError(f"{path}: row {i + 1}: not UTF-8 text")
                except json.JSONDecodeError as e:
                    yield i, DataError(f"{path}: row {i + 1}: not valid JSON ({e.msg})")


def load_examples(file: str, d) -> tuple[list[Example], int]:
    """Examples from jsonl / parquet / a `datasets` directory; bad rows stop the run or are skipped."""
    path = Path(file)
    if not path.exists():
        raise DataError(f"{file}: no such data file")
    out, skipped = [], 0
    for i, row in _rows(path):
        try:
            if isinstance(row, DataError):
                raise row
            out.append(_example(path, i, row, d))
        except DataError:
            if d.on_bad_row == "skip":
                skipped += 1
                continue
            raise
    if not out:
        raise DataError(f"{file}: no usable rows" + (f" ({skipped} skipped)" if skipped else ""))
    return out, skipped


def _example(path: Path, i: int, row, d) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{path}: row {i + 1}: expected an object with fields, got {type(row).__name__}")
    for fld in (d.prompt_field, d.answer_field):
        if fld not in row or row[fld] is None:
            raise DataError(f"{path}: row {i + 1}: missing field '{fld}' (fields: {', '.join(map(str, row))})")
    prompt = str(row[d.prompt_field])
    if not prompt.strip():
        raise DataError(f"{path}: row {i + 1}: field '{d.prompt_field}' is empty")
    sol = row.get(d.solution_field)
    return Example(prompt=prompt, answer=str(row[d.answer_field]), solution=None if sol is None else str(sol),
                   row=i + 1, meta={k: v for k, v in row.items()} | {"file": str(path)})
