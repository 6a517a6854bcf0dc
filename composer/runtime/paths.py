"""Checks of what a run reads from disk, before its run folder exists: every model, tokenizer and data path,
and the packages of the chosen loggers. A run that cannot start says why at once and writes nothing.

Light on purpose (no torch, no transformers): `composer run` calls it before it claims the run folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
from pathlib import Path


class PathError(Exception):
    """What a run would read does not exist or is not what it must be: one line per problem."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")
MODEL_FILES = ("config.json", "adapter_config.json")
# what a hub id looks like: `name` or `org/name` (letters, digits, - _ .)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
NO_HUB = ("not found locally, nor in the local Hugging Face cache; a hub id (org/name) needs network access to "
          "download, and a run never downloads one\n    hint: download the model where there is network "
          "(`hf download ORG/NAME --local-dir DIR`) and give DIR")
LOGGER_PACKAGES = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
                   "wandb": (("wandb",), "wandb"),
                   "mlflow": (("mlflow",), "mlflow (or mlflow-skinny)")}


def _skipped(name: str) -> bool:
    return name == "self" or name.startswith("toy:")


def _hub_cached(name: str) -> bool:
    """A hub id whose config is already in the local Hugging Face cache (loads without network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # not an id the hub accepts, no huggingface_hub
        return False


def _looks_local(name: str) -> bool:
    return (name.startswith(("/", ".", "~")) or name.endswith("/") or "\\" in name
            or not HUB_ID.fullmatch(name))


def _absent(name: str, what: str) -> str | None:
    """Why a path that does not exist cannot load: a local path, or a hub id that is not cached (no network)."""
    if _looks_local(name) or not _hub_cached(name):
        return f"no such {what} directory: {name}" + ("" if _looks_local(name) else f"; {NO_HUB}")
    return None


def model_problem(name: str, tokenizer_too: bool = True) -> str | None:
    """Why the model directory `name` cannot load (None: it can, as far as its files show)."""
    path = Path(name)
    if not path.exists():
        return _absent(name, "model")
    if not path.is_dir():
        return f"{name}: not a directory (a model is a directory with config.json and its weights)"
    if not any((path / f).is_file() for f in MODEL_FILES):
        return (f"{name}: the directory has no config.json, so it is not a transformers model directory "
                "(one that `save_pretrained` wrote)")
    if tokenizer_too:
        return tokenizer_problem(name, "the model directory")
    return None


def tokenizer_problem(name: str, what: str = "the tokenizer directory") -> str | None:
    path = Path(name)
    if not path.exists():
        return _absent(name, "tokenizer")
    if not path.is_dir():
        return f"{name}: not a directory (a tokenizer is a directory with tokenizer.json or tokenizer_config.json)"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        hint = "; give policy.tokenizer" if what == "the model directory" else ""
        return f"{name}: {what} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...){hint}"
    return None


CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")  # where a folder's `auto_map` names its own classes


def _folder_file(name: str, filename: str) -> Path | None:
    """`filename` of the model folder `name`: a local directory, or a hub id's copy in the local cache."""
    if Path(name).is_dir():
        return Path(name) / filename
    if _looks_local(name):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, filename)
    except (ImportError, ValueError):  # no huggingface_hub, not an id the hub accepts
        return None
    return Path(cached) if isinstance(cached, str) else None


def custom_code(name: str) -> tuple[Path, dict] | None:
    """(file, auto_map) of the first config file of the model folder `name` whose `auto_map` names the folder's own
    Python classes; None when none does."""
    for filename in CUSTOM_CODE_FILES:
        path = _folder_file(name, filename)
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
        except (OSError, ValueError):  # unreadable or not JSON: the loader says so
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            return path, auto_map if isinstance(auto_map, dict) else {"auto_map": auto_map}
    return None


def trust_ask(field: str | None) -> str:
    """How the user runs a folder's code: the spec `field` set true (if any) and the command's opt-in."""
    return (f"set `{field}: true` and rerun" if field else "rerun") + \
        " with --trust-remote-code (or COMPOSER_TRUST_REMOTE_CODE=1)"


def custom_code_problem(name: str, trusted: bool, ask: str = trust_ask("policy.trust_remote_code")) -> str | None:
    """Why the model folder `name` is refused: it ships its own Python (`auto_map`) and the run does not trust it.
    transformers would otherwise build its built-in class for a known model_type, silently training another
    model than the folder declares. `ask`: how to opt in (`trust_ask`)."""
    found = None if trusted else custom_code(name)
    if found is None:
        return None
    path, auto_map = found
    classes = ", ".join(f"{k} = {v}" for k, v in auto_map.items())
    return (f"{path} names the folder's own Python code (auto_map: {classes}); it is not run, and no built-in class "
            f"is used in its place\n    hint: only for a folder you trust: {ask}")


SPECIAL_FILESYSTEMS = ("/proc", "/sys", "/dev")  # files there block (/proc/kmsg), never end, or are not data


def data_path_problem(name: str | Path) -> str | None:
    """Why `name` cannot be read as data (None: a regular file, or a folder for `datasets`, outside /proc,
    /sys and /dev). Every data loader calls this before it opens a path: a FIFO or /proc/kmsg would block
    the run, /dev/zero would fill memory. Links are followed: where they lead is what counts."""
    path = Path(name)
    if not path.exists() and not path.is_symlink():
        from composer.runtime.datafiles import absent_reason, hub_snapshot

        return None if hub_snapshot(str(name)) is not None else absent_reason(str(name))  # a cached hub dataset reads
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except (OSError, ValueError) as e:
        return f"no such data file: {name}" if isinstance(e, FileNotFoundError) else f"{name}: cannot be read ({e})"
    root = next((r for r in SPECIAL_FILESYSTEMS if real == r or real.startswith(r + "/")), None)
    if root:
        return (f"{name}: not a regular file or a `datasets` folder ({real} is under {root}, whose files block, "
                "never end or are not data)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return f"{name}: not a regular file or a `datasets` folder (a FIFO, socket or device would block the run)"
    return None


def data_problem(name: str) -> str | None:
    return data_path_problem(name)


def _specs(validated):
    segments = getattr(validated, "segments", None) or []
    return [s.spec for s in segments] or [validated.spec]


def problems(validated) -> list[str]:
    """Every model, tokenizer and data path the run would read that is missing or wrong, as `field: why`."""
    spec = validated.spec
    out: list[str] = []
    seen: set = set()

    def add(field: str, why: str | None) -> None:
        if why and (field, why) not in seen:
            seen.add((field, why))
            out.append(f"{field}: {why}")

    pol = spec.policy
    model = pol.model or "toy:student"
    if not _skipped(model):
        add("policy.model", model_problem(model, tokenizer_too=pol.tokenizer is None))
    if pol.tokenizer and not _skipped(pol.tokenizer):
        add("policy.tokenizer", tokenizer_problem(pol.tokenizer))
    for field in ("train", "eval"):
        value = getattr(spec.data, field)
        if value is not None:
            add(f"data.{field}", data_problem(value))
    for s in _specs(validated):
        for name, cfg in s.sources.items():
            m = getattr(cfg, "model", None)
            if getattr(cfg, "kind", None) != "policy_model" or not isinstance(m, str) or _skipped(m):
                continue
            add(f"sources.{name}.model", model_problem(m))
    for field, why in custom_code_problems(validated):
        add(field, why)
    return out


def custom_code_problems(validated) -> list[tuple[str, str]]:
    """(field, why) for every model folder here that the spec names (the policy's model and tokenizer, every
    source's `model`) whose own Python (`auto_map`) the spec does not trust (`custom_code_problem`)."""
    pol = validated.spec.policy
    named = [("policy.model", pol.model, pol.trust_remote_code, "policy.trust_remote_code"),
             ("policy.tokenizer", pol.tokenizer, pol.trust_remote_code, "policy.trust_remote_code")]
    for s in _specs(validated):
        named += [(f"sources.{name}.model", getattr(cfg, "model", None), bool(getattr(cfg, "trust_remote_code", False)),
                   f"sources.{name}.trust_remote_code") for name, cfg in s.sources.items()]
    out = []
    for field, name, trusted, switch in named:
        why = custom_code_problem(name, trusted, trust_ask(switch)) if isinstance(name, str) and name and \
            not _skipped(name) else None
        if why and (field, why) not in out:
            out.append((field, why))
    return out


def logger_problems(validated) -> list[str]:
    """Chosen loggers whose package is not installed. The default list leaves tensorboard out quietly."""
    train = validated.spec.train
    explicit = "loggers" in train.model_fields_set
    out = []
    for kind in train.loggers:
        if kind not in LOGGER_PACKAGES or (kind == "tensorboard" and not explicit):
            continue
        modules, pip_name = LOGGER_PACKAGES[kind]
        if not any(installed(m) for m in modules):
            out.append(f"train.loggers: {kind} is chosen, but its package is not installed\n"
                       f"    hint: pip install {pip_name} (or leave {kind} out of train.loggers)")
    return out


def tracking_problem(validated, timeout: float = 5.0) -> str | None:
    """mlflow with an http(s) MLFLOW_TRACKING_URI: the server must answer now (a closed port would otherwise be
    retried silently for minutes, the run waiting before its first step)."""
    if "mlflow" not in validated.spec.train.loggers:
        return None
    import socket
    from urllib.parse import urlsplit

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        return f"train.loggers: mlflow: MLFLOW_TRACKING_URI {uri!r} is not a URL ({e})"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = e.strerror or type(e).__name__ if not isinstance(e, TimeoutError) else f"no answer in {timeout:g}s"
        return (f"train.loggers: mlflow: the tracking server at {uri} does not answer ({why})\n"
                "    hint: start the server, fix MLFLOW_TRACKING_URI, or leave mlflow out of train.loggers")
    return None


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_run_inputs(validated) -> None:
    """Raise PathError naming every missing model, tokenizer or data path and every missing logger package."""
    found = problems(validated) + logger_problems(validated)
    if not found:
        found = [p for p in [tracking_problem(validated)] if p]
    if found:
        head = "the run cannot start (nothing was written):" if len(found) > 1 else ""
        raise PathError("\n  ".join([head] + [f.replace("\n", "\n  ") for f in found]) if head else found[0])
