"""Where a run's rows come from: data files, folders and hub datasets read with the `datasets` library.

What `data.train` / `data.eval` may name, and how it is read:

  x.jsonl                  one JSON object a line, read line by line here, so that a bad line is named by its
                           line number (invalid JSON, NaN, non-UTF-8 bytes, nesting too deep);
  x.json, x.csv,           `datasets.load_dataset("json" | "csv" | "parquet", data_files=x)`;
  x.parquet
  a save_to_disk folder    `datasets.load_from_disk` (a Dataset, or a DatasetDict and its splits);
  a folder of data files   `datasets.load_dataset(folder)`: shards (train-00000-of-00002.parquet, ...), a hub
                           snapshot's layout (README.md configs, data/), splits named by the files; files of
                           one format only (`datasets` would read one and drop the others: `mixed_formats`);
  org/name                 a hub dataset id, only when its snapshot is in the local Hugging Face cache
                           (`huggingface_hub.snapshot_download(..., local_files_only=True)`); never downloaded.

A source with several splits gives `data.split` (default `train`) for training and `data.eval_split` for
evaluation (default: the eval source's `test`, else `validation`, else its only split). Rows are numbered from
1 within their split; a row's errors name the file (and split), the row and the field (runtime/binding.py).
No torch; `datasets` is imported only when a non-jsonl source is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

FILE_BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet", ".tsv": "csv"}
DATA_SUFFIXES = (".jsonl", ".ndjson", *FILE_BUILDERS)
# The format `datasets` reads each data file of a folder with; it reads only the most common one of a folder.
# (.txt left out: a text file's rows have no fields, so a notes.txt beside the data is no data lost.)
FOLDER_FORMATS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv", ".tsv": "csv",
                  ".parquet": "parquet", ".arrow": "arrow"}
METADATA_FILES = {"dataset_infos.json", "dataset_info.json", "dataset_dict.json", "state.json"}
EVAL_SPLITS = ("test", "validation", "valid", "eval", "dev")
HUB_HINT = ("download it where there is network (`hf download {name} --repo-type dataset`, or `hf download {name} "
            "--repo-type dataset --local-dir DIR` and give DIR); a run never downloads data")


class SourceError(ValueError):
    """A data source that cannot be read as asked: the message names it and says what to give instead."""


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a request to the hub
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def hub_snapshot(name: str) -> Path | None:
    """The local snapshot folder of the hub dataset `name` (org/name), None when it is not cached."""
    from composer.runtime.paths import HUB_ID

    if not HUB_ID.fullmatch(name) or name.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached, not an id the hub accepts
        return None


def locate(name: str) -> Path:
    """The local path of a data source: the path itself, or a cached hub dataset's snapshot folder."""
    path = Path(name)
    if path.exists():
        return path
    snap = hub_snapshot(name)
    if snap is not None:
        return snap
    raise SourceError(absent_reason(name))


def absent_reason(name: str) -> str:
    """Why `name` names no data: with a hint for a hub id that is not cached and for an unknown extension."""
    from composer.runtime.paths import HUB_ID

    suffix = Path(name).suffix.lower()
    if HUB_ID.fullmatch(name) and "/" in name and suffix not in DATA_SUFFIXES:
        return (f"no such data file or folder: {name}; as a hub dataset id it is not in the local Hugging Face cache\n"
                f"    hint: {HUB_HINT.format(name=name)}")
    known = ", ".join(DATA_SUFFIXES)
    hint = "" if suffix in DATA_SUFFIXES or not suffix else f" (and {suffix} is not a data format read here: {known})"
    return f"no such data file: {name}{hint}"


def kind_of(path: Path) -> str:
    """`jsonl`, a `datasets` builder name (json / csv / parquet), `disk` (save_to_disk) or `folder`."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return "disk"
        return "folder"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in FILE_BUILDERS:
        return FILE_BUILDERS[suffix]
    return "jsonl"  # no or another extension: read as JSON lines, each bad line named


def folder_files(path: Path) -> dict[str, list[Path]]:
    """The data files of a folder (hidden files and `datasets` metadata left out), by the format `datasets` reads
    them with: {"json": [...], "csv": [...], ...}."""
    found: dict[str, list[Path]] = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).parts
        if any(p.startswith((".", "_")) for p in rel) or f.name in METADATA_FILES or not f.is_file():
            continue
        fmt = FOLDER_FORMATS.get(f.suffix.lower())
        if fmt:
            found.setdefault(fmt, []).append(f)
    return found


def mixed_formats(path: Path) -> str | None:
    """Why a folder of data files cannot be read as one source (None: one format): `datasets.load_dataset` reads
    the files of its most common format only and would drop the others' rows without a word."""
    found = folder_files(path)
    if len(found) < 2:
        return None

    def names(files: list[Path]) -> str:
        shown = ", ".join(str(f.relative_to(path)) for f in files[:3])
        return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")

    listed = "; ".join(f"{fmt}: {names(files)}" for fmt, files in found.items())
    return (f"{path}: a folder of data files in {len(found)} formats ({listed}); a folder is read as one format, "
            "so the rows of the others would be dropped\n    hint: keep the files of one format in the folder "
            "(convert the others), or give data.train one file")


def _load(path: Path, kind: str):
    """The source as a `datasets` Dataset or DatasetDict (never downloads); a folder of mixed formats refused."""
    if kind == "folder":
        why = mixed_formats(path)
        if why:
            raise SourceError(why)
    ds = _datasets()
    try:
        if kind == "disk":
            return ds.load_from_disk(str(path))
        if kind == "folder":
            return ds.load_dataset(str(path))
        extra = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        return ds.load_dataset(kind, data_files=str(path), split="train", **extra)
    except Exception as e:  # a damaged file, a folder with no data files, mixed formats
        what = {"disk": "`datasets` (save_to_disk) folder", "folder": "folder of data files"}.get(kind, f"{kind} file")
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise SourceError(f"{path}: not a readable {what} ({type(e).__name__}: {detail})") from None


def splits(name: str) -> list[str] | None:
    """The split names of a source (None: a single-table file); SourceError when it cannot be read."""
    path = locate(name)
    kind = kind_of(path)
    if kind == "jsonl":
        return None
    loaded = _load(path, kind)
    return list(loaded.keys()) if hasattr(loaded, "keys") else None


def choose_split(name: str, have: list[str] | None, asked: str | None, role: str) -> str | None:
    """The split a source is read from: `asked`, else `train` for training and test / validation for evaluation;
    SourceError naming the splits when it is not there."""
    if have is None:
        return None
    field = "data.split" if role == "train" else "data.eval_split"
    if asked is not None:
        if asked not in have:
            raise SourceError(f"{name}: no split {asked!r} ({field}); its splits: {', '.join(have)}")
        return asked
    if role == "train":
        if "train" in have:
            return "train"
        if len(have) == 1:
            return have[0]
    else:
        for s in EVAL_SPLITS:
            if s in have:
                return s
        if len(have) == 1:
            return have[0]
    raise SourceError(f"{name}: which split? it has {', '.join(have)}; set {field}")


def rows(name: str, split: str | None = None, role: str = "train") -> tuple[str, Iterator[tuple[int, Any]]]:
    """(where: the name errors give, iterator of (1-based row number, row dict)) of a non-jsonl source; the
    split as chosen by `choose_split`."""
    path = locate(name)
    kind = kind_of(path)
    loaded = _load(path, kind)
    where = str(name)
    if hasattr(loaded, "keys"):
        chosen = choose_split(name, list(loaded.keys()), split, role)
        loaded = loaded[chosen]
        where = f"{name} [split {chosen}]"
    elif split is not None and split != "train":
        raise SourceError(f"{name}: a single table has no split {split!r} "
                          f"({'data.split' if role == 'train' else 'data.eval_split'}); drop the setting")

    def it():
        for i, row in enumerate(loaded):
            yield i + 1, row

    return where, it()


def describe(name: str, split: str | None, role: str) -> str:
    """One line for explain: what the source is and which split a run reads."""
    try:
        path = locate(name)
        kind = kind_of(path)
        have = splits(name)
        chosen = choose_split(name, have, split, role)
    except SourceError as e:
        return f"{name}: {str(e).splitlines()[0]}"
    what = {"jsonl": "JSON lines", "disk": "a `datasets` folder", "folder": "a folder of data files"}.get(kind, kind)
    where = "" if str(path) == str(name) else f" (local hub cache: {path})"
    return f"{name}: {what}{where}" + (f", split {chosen!r} of {', '.join(have)}" if chosen else "")
