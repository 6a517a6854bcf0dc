"""The trained policy as a standard transformers directory (`save_pretrained` of model and tokenizer),
loadable with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.

A run writes it to `model/` in its run folder at the end; `composer export CKPT_OR_RUN --out DIR` writes one
from any checkpoint, read with the project's own loader (weights_only=True): the architecture comes from
the config of the model the checkpoint's spec names (or --base DIR), the weights from the checkpoint.
A directory is written whole or not at all: into a temporary sibling, then renamed into place.
"""

from __future__ import annotations

import json
import contextlib
import os
import re
import shutil
from pathlib import Path

MODEL_DIR = "model"
PREFIX = "policy."  # the policy's weights in a checkpoint's state_dict (ComposerModule.policy)


class ExportError(Exception):
    """A checkpoint that cannot be exported, or a destination that cannot be written: says which and why."""


@contextlib.contextmanager
def _no_deepspeed_probe():
    """save_pretrained unwraps the model with accelerate, which imports DeepSpeed when it is installed (only to
    test `isinstance(model, DeepSpeedEngine)`), and DeepSpeed prints "Setting accelerator to CPU" on import.
    A model saved here is never a DeepSpeed engine: skip the probe while DeepSpeed is not already loaded."""
    import sys

    other = sys.modules.get("accelerate.utils.other")
    if other is None:
        try:
            import accelerate.utils.other as other
        except Exception:  # no accelerate: nothing probes
            other = None
    if other is None or "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    old = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = old


MARK = "composer_export.json"  # written into every export, with its files: only a folder holding it is written into
# what save_pretrained writes: the files an older export (one whose MARK lists no files) is known to hold
EXPORT_NAMES = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|"
                          r"chat_template|preprocessor_config|vocab|merges)\.(json|jinja|txt)|(model|pytorch_model|"
                          r"adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?|"
                          r"(tokenizer|spiece|sentencepiece\.bpe)\.model|adapter_config\.json")


def target_problem(dest: Path | str) -> str | None:
    """Why `dest` may not receive an export (None: it is new, empty, or an earlier export, whose files are
    replaced while the files the user added beside them are kept).

    A folder holding a `config.json` is not enough: a base model's folder has one, and writing into it would
    replace its weights and mix two models."""
    dest = Path(dest)
    if dest.is_symlink():
        return "it is a symbolic link; give the real folder"
    if not dest.exists():
        return None
    if not dest.is_dir():
        return "it is a file, not a folder"
    if not any(dest.iterdir()):
        return None
    if (dest / MARK).is_file() and not (dest / MARK).is_symlink():
        return None
    return (f"the folder already holds files and is not an earlier export (no {MARK}); choose a new or empty "
            "folder")


def old_export_file(rel: str) -> bool:
    """Whether `rel` is a file an older export (its MARK lists no files) wrote; any other file is the user's."""
    return "/" not in rel and EXPORT_NAMES.fullmatch(rel) is not None


EVAL_DATA_FIELDS = ("prompt_field", "answer_field", "prompt_format", "system_prompt", "prompt_template",
                    "chat_template_kwargs")


def _verifiers(node) -> list[str]:
    """Every `verifier:` a source of the resolved spec names, in order (base spec, then phases and stages)."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "verifier" and isinstance(v, str):
                found.append(v)
            else:
                found += _verifiers(v)
    elif isinstance(node, list):
        for v in node:
            found += _verifiers(v)
    return found


def eval_settings(resolved: dict, step: int | None = None) -> dict:
    """What `composer eval EXPORT --data D` needs to evaluate as the run did, from the run's resolved spec: the
    prompt and data fields (system prompt, template, fields, format), the verifier, the evaluation's sizes and
    the response length, and `step`, the optimizer steps the exported weights had taken (eval.json's step).
    Kept in the export's composer_export.json."""
    resolved = resolved if isinstance(resolved, dict) else {}
    data = resolved.get("data") if isinstance(resolved.get("data"), dict) else {}
    train = resolved.get("train") if isinstance(resolved.get("train"), dict) else {}
    rollout = resolved.get("rollout") if isinstance(resolved.get("rollout"), dict) else {}
    chosen = train.get("eval_verifier")
    named = [v for v in _verifiers({k: resolved.get(k) for k in ("sources", "phases", "stages")}) if v != "auto"]
    verifier = chosen if chosen and chosen != "auto" else (named[-1] if named else None)
    out = {"data": {k: data[k] for k in EVAL_DATA_FIELDS if k in data},
           "train": {k: train[k] for k in ("eval_samples", "eval_k", "seed") if k in train},
           "rollout": {k: rollout[k] for k in ("max_new_tokens",) if k in rollout}}
    if verifier:
        out["verifier"] = verifier
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        out["step"] = step
    return out


def save_policy(model, tokenizer, dest: Path | str, settings: dict | None = None) -> Path:
    """model + tokenizer via save_pretrained into `dest` (new, empty, or an earlier export: its files are
    replaced, the user's files beside them kept; see files.replace_into). Written whole into a staging folder
    first, so a failure leaves `dest` as it was. `settings` (eval_settings of the run's spec) go into
    composer_export.json for `composer eval`, with the list of the export's files."""
    from composer import files

    dest = Path(dest)
    why = target_problem(dest)
    if why:
        raise ExportError(f"{dest}: {why}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            with _no_deepspeed_probe():
                model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        except Exception as e:  # a full disk: OSError, or safetensors' / torch's own error types
            why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0][:300]
            raise ExportError(f"{dest}: cannot write the model ({type(e).__name__}: {why}; a full disk?); "
                              f"{dest} is as it was") from None
        mark = {"written_by": "composer", "format": "transformers", **({"run": settings} if settings else {})}
        try:
            files.replace_into(tmp, dest, MARK, mark, legacy=old_export_file)
        except files.FolderError as e:
            raise ExportError(f"{dest}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def checkpoint_of(src: Path | str) -> Path:
    """The checkpoint file of `src`: itself, or a run folder's checkpoints/last.ckpt."""
    src = Path(src)
    if src.is_dir():
        ckpt = src / "checkpoints" / "last.ckpt"
        if not ckpt.exists():
            raise ExportError(f"{src}: a folder without checkpoints/last.ckpt (give a run folder or a .ckpt file)")
        return ckpt
    if not src.exists():
        raise ExportError(f"{src}: no such checkpoint or run folder")
    return src


def _spec_policy(state: dict, ckpt: Path) -> dict:
    record = (state.get("composer") or {}).get("spec") if isinstance(state.get("composer"), dict) else None
    if not isinstance(record, dict) or "json" not in record:
        raise ExportError(f"{ckpt}: the checkpoint does not record its spec (written by an older version); "
                          "give --base MODEL_DIR, the model it was trained from")
    try:
        policy = json.loads(record["json"]).get("policy") or {}
    except (TypeError, ValueError, AttributeError):
        policy = None
    if not isinstance(policy, dict):
        raise ExportError(f"{ckpt}: the checkpoint's spec record is damaged; give --base MODEL_DIR, the model it "
                          "was trained from")
    return policy


def _config_problem(arch: str, e: Exception, trust: bool) -> str:
    """Why `arch`'s config.json builds no model, in a line: its own Python code not allowed, an unknown
    model_type, or transformers' first line."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    try:
        cfg = json.loads((Path(arch) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = None
    if not isinstance(cfg, dict):
        return f"config.json is not a JSON object ({type(e).__name__}: {text})"
    if ("trust_remote_code" in str(e) or "custom code" in str(e)) and not trust:
        return (f"config.json names its own Python code (auto_map, model_type {cfg.get('model_type')!r}), which is "
                "not run without --trust-remote-code (or COMPOSER_TRUST_REMOTE_CODE=1): only for a folder you trust")
    if any(w in str(e) for w in ("model_type", "model type", "Unrecognized", "not recognize")):
        return f"model_type {cfg.get('model_type')!r} is not one this transformers knows ({text})"
    return f"{type(e).__name__}: {text}"


def export_checkpoint(src: Path | str, dest: Path | str, base: str | None = None) -> Path:
    """Write the policy of a checkpoint (or run folder) as a transformers directory at `dest`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from composer.runtime import checkpoint as ckpt_format
    from composer.runtime.paths import custom_code_problem, model_problem, tokenizer_problem, trust_ask
    from composer.registry import remote_code_allowed
    from composer.runtime.models import load_tokenizer, resolve

    ckpt = checkpoint_of(src)
    state = ckpt_format.load(ckpt, mmap=True)
    weights = {k[len(PREFIX):]: v for k, v in state["state_dict"].items() if k.startswith(PREFIX)}
    if not weights:
        raise ExportError(f"{ckpt}: the checkpoint holds no policy weights")
    bad = ckpt_format.first_non_finite(weights)
    if bad:
        raise ExportError(f"{ckpt}: the policy weight {bad} holds NaN or inf; such a model only produces garbage, "
                          "so it is not exported\n    hint: export an earlier checkpoint, or rerun with a lower "
                          "train.lr / train.grad_clip")
    policy = {} if base else _spec_policy(state, ckpt)
    # trust comes from this command's user only (--trust-remote-code), never from the checkpoint's spec
    trust = remote_code_allowed()
    candidates = [base] if base else [policy.get("model") or "toy:student"]
    run_model = ckpt.parent.parent / MODEL_DIR  # a run folder's own export: same architecture, same tokenizer
    if not base and not trust and (run_model / "config.json").is_file():  # its code never runs
        candidates.append(str(run_model))
    arch = None
    for name in candidates:
        path = resolve(name) if name.startswith("toy:") else name
        if model_problem(path, tokenizer_too=False) is None and Path(path).is_dir():
            arch = path
            break
    if arch is None:
        why = model_problem(candidates[0], tokenizer_too=False) or f"{candidates[0]}: not a local model directory"
        raise ExportError(f"the model the checkpoint was trained from is needed for its config: {why}\n"
                          "    hint: run from the folder the run was started in, or give --base MODEL_DIR")
    tok_name = base or policy.get("tokenizer") or arch
    tok_path = resolve(tok_name) if tok_name.startswith("toy:") else tok_name
    if tokenizer_problem(tok_path) is not None and tok_path != arch:
        tok_path = arch
    why = tokenizer_problem(tok_path)
    if why:
        raise ExportError(f"the tokenizer: {why}")
    why = custom_code_problem(arch, trust, trust_ask(None))  # else a known model_type builds the built-in class
    if why:
        raise ExportError(why)
    dtype = next((t.dtype for t in weights.values() if torch.is_tensor(t) and t.is_floating_point()), torch.float32)
    try:  # a config.json transformers cannot build a model from: an unknown model_type, custom code (auto_map)
        config = AutoConfig.from_pretrained(arch, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust)  # the checkpoint's dtype
    except Exception as e:
        raise ExportError(f"{arch}: the model's config does not build a model here: {_config_problem(arch, e, trust)}\n"
                          "    hint: give --base the transformers model directory the run was trained from") from None
    if any(k.startswith("base_model.model.") for k in weights):  # trained with LoRA: rebuild the adapter, merge below
        from composer.runtime.models import prepare_policy
        from composer.lang.spec import Policy

        model = prepare_policy(model, Policy(**{k: v for k, v in policy.items() if k in Policy.model_fields}))
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0][:300]
        raise ExportError(f"{ckpt}: its weights do not fit the model at {arch} ({first})\n"
                          "    hint: give --base the model directory the run was trained from") from None
    try:
        model.generation_config = GenerationConfig.from_pretrained(arch)
    except Exception:  # a model folder without generation_config.json keeps the default one
        pass
    from composer.runtime.models import merged

    tokenizer = load_tokenizer(tok_path, trust_remote_code=trust)
    record = (state.get("composer") or {}).get("spec") if isinstance(state.get("composer"), dict) else None
    try:
        settings = eval_settings(json.loads(record["json"]), state.get("global_step")) \
            if isinstance(record, dict) and "json" in record else None
    except (TypeError, ValueError):
        settings = None
    return save_policy(merged(model), tokenizer, dest, settings)


def export_settings(model_dir: Path | str) -> dict:
    """The run settings an export keeps (composer_export.json `run`), {} for another model folder."""
    path = Path(model_dir) / MARK
    try:
        found = json.loads(path.read_text(encoding="utf-8")).get("run") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}
