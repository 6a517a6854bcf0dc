"""Data input, checked early and bounded (issues 56 and 57).

Two parts, neither imports torch:

  `check` (validation, `composer validate`): what can be told about the data from the files alone, without
    loading a model or a tokenizer: data.train / data.eval exist and are readable, a folder holds one format,
    the columns the spec names (prompt_field, answer_field, solution_field when set) are in the file's header or
    first row, and the first rows fit the policy's declared context (max_position_embeddings of the model
    folder's config.json; the toy testbed's known context), alone and with rollout.max_new_tokens after them:
    counted exactly where the policy tokenizer's folder has a tokenizer.json (read with `tokenizers`, the prompt
    rendered as the run renders it: data.prompt_template, data.system_prompt, the chat template by transformers'
    Jinja renderer under composer/template_limits.py's limits, the BOS the tokenizer adds), else bounded below at
    CHARS_PER_TOKEN characters a token. Each problem is located at its spec line.
  `screen_task` (a run binding its data, before any row is rendered or tokenised): a row whose text is longer
    than the context can hold at CHARS_PER_TOKEN characters a token is refused (or skipped and counted) by its
    length in characters, so a 30 MiB row costs no tokenisation; a row whose text holds one of the policy
    tokenizer's control tokens (`<|im_end|>`, `<|im_start|>`) is refused, since prompts are carried as text and
    tokenised with special tokens parsed: in a prompt it would become that token (a forged turn), not text.

The bound is a ceiling, not an estimate: no tokenizer's token covers more than CHARS_PER_TOKEN characters of
text in practice, so a row over it can never fit; rows under it are counted exactly by the tokenizer later
(runtime/binding.py `check_lengths`).
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from pathlib import Path

from composer.errors import Diagnostic, Location

CHARS_PER_TOKEN = 64  # a generous ceiling on the characters of text one token covers
TOY_CONTEXT = 512  # the toy testbed's max_position_embeddings (components/tasks/bootstrap.py `qwen3`)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length", "n_ctx")
HEAD_ROWS = 64  # rows validation reads from the top of a data file
JSON_WHOLE_MAX = 8 << 20  # a .json file (one array) validation parses whole only up to this size
CONTROL_TOKEN = "control_token"  # skip reason (task.skipped_by_reason)
FIELD_SETTINGS = ("prompt_field", "answer_field", "solution_field")


# ------------------------------------------------------------------------------------------ context


def declared_context(model: str | None) -> tuple[int | None, str]:
    """(context in tokens, where it was read) of a policy model, from its config.json without loading it: a
    local folder or a hub id in the local Hugging Face cache; the toy testbed's known context; (None, "") when
    it cannot be read here."""
    name = model or "toy:student"
    if name.startswith("toy:"):
        return TOY_CONTEXT, "the toy testbed"
    path = Path(name) / "config.json"
    if not path.is_file():
        path = _cached_config(name)
        if path is None:
            return None, ""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, ""
    for part in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        for key in CONTEXT_KEYS:
            value = part.get(key) if isinstance(part, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{key} in {path}"
    return None, ""


def _cached_config(name: str) -> Path | None:
    """config.json of a hub model id in the local Hugging Face cache (never downloaded)."""
    from composer.runtime.paths import HUB_ID

    if not HUB_ID.fullmatch(name) or "/" not in name or name.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not an id the hub library accepts
        return None
    return Path(found) if isinstance(found, str) else None


def declared_controls(tokenizer: str | None) -> tuple[str, ...]:
    """The control-token strings of a local tokenizer folder, read from its tokenizer.json (`added_tokens`) and
    tokenizer_config.json without loading it (as prompts.py `control_tokens` has them); the toy's specials."""
    from composer.prompts import control_tokens, is_control

    name = tokenizer or "toy:student"
    if name.startswith("toy:"):
        return control_tokens(None, name)
    folder, found = Path(name), set()
    try:
        if (folder / "tokenizer.json").is_file():
            added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens") or []
            found |= {t.get("content") for t in added if isinstance(t, dict) and is_control(t.get("content"),
                                                                                         bool(t.get("special")))}
        if (folder / "tokenizer_config.json").is_file():
            cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = cfg.get(key)
                found.add(value.get("content") if isinstance(value, dict) else value)
            for t in (cfg.get("added_tokens_decoder") or {}).values():
                if isinstance(t, dict) and is_control(t.get("content"), bool(t.get("special"))):
                    found.add(t["content"])
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(sorted(t for t in found if is_control(t, True)))


class DeclaredTokenizer:
    """The policy tokenizer as validation reads it, without transformers or torch: tokenizer.json through
    `tokenizers`, the chat template and special-token texts from tokenizer_config.json (or chat_template.jinja).
    `prompt_tokens(data, text)`: the token count of the prompt the run builds from a row's problem `text`."""

    def __init__(self, tok, template: str | None, specials: dict, name: str):
        self.tok, self.template, self.specials, self.name = tok, template, specials, name

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def chat(self, data) -> bool:
        """Prompts are rendered with the chat template (data.prompt_format chat, or auto with a template)."""
        return bool(self.template) and data.prompt_format != "plain"

    def adds_bos(self) -> bool:
        """The tokenizer puts its BOS first on its own (prompts.py `added_bos`: the run writes it under plain)."""
        bos = self.specials.get("bos_token")
        bos_id = self.tok.token_to_id(bos) if bos else None
        if bos_id is None:
            return False
        with_, without = (self.tok.encode("x", add_special_tokens=on).ids[:1] for on in (True, False))
        return with_ == [bos_id] and without != [bos_id]

    def prompt_tokens(self, data, text: str) -> int:
        """Tokens of the prompt the run renders for problem `text` (composer/prompts.py PromptFormat)."""
        from composer.prompts import _format

        user = _format(data.prompt_template, prompt=text)
        if not self.chat(data):
            body = (f"{data.system_prompt}\n\n" if data.system_prompt is not None else "") + user
            return self.count(body) + int(self.adds_bos())
        from transformers.utils.chat_template_utils import render_jinja_template

        from composer.template_limits import _Limits

        messages = ([{"role": "system", "content": data.system_prompt}] if data.system_prompt is not None else []) \
            + [{"role": "user", "content": user}]
        with _Limits():  # code from a model folder: rendered with time and size limits
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template,
                                                add_generation_prompt=True,
                                                **{**self.specials, **(data.chat_template_kwargs or {})})
        return self.count(rendered[0])


def declared_tokenizer(name: str | None) -> DeclaredTokenizer | None:
    """The policy tokenizer of a local folder (or a hub id's files in the local cache) for exact token counts at
    validation; None when it has no tokenizer.json here (the toy's, a slow tokenizer) or it cannot be read."""
    name = name or "toy:student"
    if name.startswith("toy:"):
        return None
    folder = Path(name)

    def file(n: str) -> Path | None:
        if folder.is_dir():
            return folder / n if (folder / n).is_file() else None
        from composer.runtime.paths import HUB_ID

        if not HUB_ID.fullmatch(name) or "/" not in name or name.startswith((".", "/")):
            return None
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, n)
        except Exception:  # noqa: BLE001 - not an id the hub library accepts
            return None
        return Path(found) if isinstance(found, str) else None

    path = file("tokenizer.json")
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        cfg_path = file("tokenizer_config.json")
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path is not None else {}
        jinja = file("chat_template.jinja")
        template = jinja.read_text(encoding="utf-8") if jinja is not None else cfg.get("chat_template")
    except Exception:  # noqa: BLE001 - a file `tokenizers` cannot read: the run loads and checks it
        return None
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    specials = {}
    for key, value in (cfg.items() if isinstance(cfg, dict) else ()):
        value = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(value, str):
            specials[key] = value
    return DeclaredTokenizer(tok, template if isinstance(template, str) else None, specials, name)


def row_limit(context: int) -> int:
    """The most characters a row's text may have and still fit `context` tokens."""
    return context * CHARS_PER_TOKEN


# ------------------------------------------------------------------------------------------ run-time screen


def control_pattern(controls) -> re.Pattern | None:
    """One regex matching any of the control-token strings (longest first), None when there are none."""
    controls = sorted(set(controls), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, controls))) if controls else None


def screen_task(task, spec, fmt) -> Counter:
    """Refuse, or skip and count (data.on_bad_row), the rows of `task` (train and eval, in place) that must not
    be rendered or tokenised: text longer than the policy's declared context holds (by characters), and text
    holding a control token of the policy tokenizer (`fmt.controls`). Returns the skipped counts by reason."""
    from composer.runtime.binding import _Skips

    d = spec.data
    context, where = declared_context(getattr(getattr(spec, "policy", None), "model", None))
    pattern = control_pattern(getattr(fmt, "controls", ()))
    fields = ((d.prompt_field, "problem"), (d.solution_field, "solution"), (d.answer_field, "answer"))
    counts: Counter = Counter()
    parts = [("train", task.train)] + [(k, v) for k, v in task.eval.items()]
    for name, examples in parts:
        skips, kept = _Skips(d.on_bad_row), []
        for ex in examples:
            err = _row_problem(ex, fields, context, where, pattern, getattr(fmt, "tokenizer_name", ""))
            if err is None:
                kept.append(ex)
            else:
                skips.bad(err)
        skips.report(f"{name} rows")
        counts += skips.counts
        if name == "train":
            task.train = kept
        else:
            task.eval[name] = kept
    if not task.train:
        from composer.errors import DataError

        raise DataError(f"{d.train}: no usable rows (every row refused: {dict(counts)})", file=str(d.train))
    return counts


def _row_problem(ex, fields, context, where, pattern, tokenizer_name):
    """The DataError for one example's first refused field, or None."""
    from composer.runtime.binding import TOO_LONG, _error

    src = (ex.meta or {}).get("file", "<data>")
    conv = getattr(ex, "conversation", None)
    if conv is not None:  # a messages row: every message's text (composer/conversations.py)
        return _conversation_problem(ex, src, conv, context, where, pattern, tokenizer_name)
    for field, attr in fields:
        text = getattr(ex, attr, None)
        if not isinstance(text, str):
            continue
        if context is not None and len(text) > row_limit(context):
            return _error(src, ex.row, field, f"{len(text)} characters, more than the policy's context ({context} "
                          f"tokens, {where}) can hold at {CHARS_PER_TOKEN} characters a token ({row_limit(context)} "
                          "characters); refused before it is tokenised", TOO_LONG)
        hit = pattern.search(text) if pattern is not None else None
        if hit:
            return _error(src, ex.row, field, f"holds {hit.group(0)!r}, a control token of the policy tokenizer "
                          f"{tokenizer_name}: in a prompt it would be read as that token (e.g. a forged turn), "
                          "not as text", CONTROL_TOKEN)
    return None


def _conversation_problem(ex, src, conv, context, where, pattern, tokenizer_name):
    """_row_problem of a conversation: its messages' text together longer than the context holds, or a message
    spelling a control token (a forged turn: `<|im_end|>` inside a user message would end it)."""
    from composer.conversations import FIELD
    from composer.runtime.binding import TOO_LONG, _error

    total = sum(len(m["content"]) for m in conv.messages)
    if context is not None and total > row_limit(context):
        return _error(src, ex.row, FIELD, f"{total} characters of messages, more than the policy's context ({context} "
                      f"tokens, {where}) can hold at {CHARS_PER_TOKEN} characters a token ({row_limit(context)} "
                      "characters); refused before it is tokenised", TOO_LONG)
    for j, m in enumerate(conv.messages, start=1):
        hit = pattern.search(m["content"]) if pattern is not None else None
        if hit:
            return _error(src, ex.row, FIELD, f"message {j} ({m['role']}) holds {hit.group(0)!r}, a control token of "
                          f"the policy tokenizer {tokenizer_name}: rendered by the chat template it would be read as "
                          "that token (e.g. a forged turn), not as text", CONTROL_TOKEN)
    return None


def generation_room(task, tokenizer, context: int | None, max_new_tokens: int, extra: int = 0) -> str | None:
    """A run's check of its bound prompts (train and eval, as rendered) against the policy's context with the
    response budget after them: the warning to log when the longest prompt plus rollout.max_new_tokens exceeds the
    context (validation sees the first rows only), else None. `extra`: the tokens an environment may add to an
    episode (its max_env_tokens), counted after max_new_tokens. Prompts longer than the context alone were refused or
    skipped before (runtime/binding.py `check_task_lengths`)."""
    from composer.runtime.binding import _encode_all

    if context is None or tokenizer is None:
        return None
    prompts = [ex.prompt for ex in task.train] + [ex.prompt for v in task.eval.values() for ex in v]
    counts = _encode_all(tokenizer, prompts) if prompts else []
    over = [n for n in counts if n + max_new_tokens + extra > context]
    if not over:
        return None
    longest = max(over)
    env = f" + the environment's max_env_tokens ({extra})" if extra else ""
    return (f"WARNING: {len(over)} of {len(counts)} prompts leave fewer than rollout.max_new_tokens "
            f"({max_new_tokens}){env} positions in the policy's context ({context} tokens; the longest prompt is {longest} "
            "tokens): a response that runs long goes past the positions the model was trained on\n"
            f"    hint: set rollout.max_new_tokens to {max(context - longest - extra, 1)} or less to keep every response "
            "inside the context")


# ------------------------------------------------------------------------------------------ validation


def check(loaded, spec, segments=()) -> list[Diagnostic]:
    """Validation's data checks (see the module docstring): errors and warnings, located in the spec. `segments`:
    the spec's phases and stages (a source of messages rows is refused for a segment that is not SFT)."""
    d = spec.data
    if d.train is None:
        return []
    context, where = declared_context(spec.policy.model if spec.policy else None)
    out = _max_new_tokens(loaded, spec, context, where)
    for key in ("train", "eval"):
        name = getattr(d, key)
        if name:
            out += _source(loaded, spec, key, name, context, where, segments)
    return out


def _at(loaded, *paths) -> Location:
    """Where the first of `paths` the spec wrote stands (else the nearest enclosing key; else line 1)."""
    for path in paths:
        if path in loaded.positions:
            return loaded.positions[path]
    return loaded.locate(paths[-1]) or Location(loaded.file, 1, 1)


def _diag(loaded, message: str, path: tuple, hint: str, severity: str = "error", at: tuple = ()) -> Diagnostic:
    return Diagnostic("semantics", message, path, _at(loaded, *(at or (path,))), hint, severity, rule="data_input")


def _env_extra(spec) -> int:
    """What an active environment may write into an episode's response (its max_env_tokens,
    `Environment.extra_tokens`); 0 without one."""
    env = getattr(spec.rollout, "environment", None)
    return env.extra_tokens() if env is not None else 0


def response_budget(spec) -> int:
    """The most tokens a response may hold: rollout.max_new_tokens plus the environment's answers."""
    return spec.rollout.max_new_tokens + _env_extra(spec)


def _env_words(spec) -> str:
    """' (rollout.max_new_tokens N + the environment's max_env_tokens M)' when an environment adds to the response
    budget, for messages."""
    extra = _env_extra(spec)
    return f" (rollout.max_new_tokens {spec.rollout.max_new_tokens} + the environment's max_env_tokens {extra})" \
        if extra else ""


def _max_new_tokens(loaded, spec, context, where) -> list[Diagnostic]:
    """A response budget that leaves no room for a prompt in the declared context (a warning: the run does
    not stop on it, but every response can run past the positions the model was trained on)."""
    n = response_budget(spec)
    if context is None or n < context:
        return []
    path = ("rollout", "max_new_tokens")
    return [_diag(loaded, f"{n} new tokens{_env_words(spec)} leave no room for a prompt in the policy's context "
                  f"({context} tokens, {where}): every response can run past it", path, "set rollout.max_new_tokens below the "
                  "context, less the longest prompt", "warning", at=(path, ("policy", "model")))]


def _source(loaded, spec, key: str, name: str, context, where, segments=()) -> list[Diagnostic]:
    """The checks of one data source (data.train or data.eval)."""
    from composer.runtime.datafiles import SourceError, kind_of, locate, mixed_formats
    from composer.runtime.paths import data_path_problem

    path = ("data", key)
    why = data_path_problem(name)
    if why:
        message, _, hint = why.partition("\n    hint: ")
        return [_diag(loaded, message, path, hint or "give a local file (jsonl, json, csv, parquet) or a `datasets` "
                      "folder; paths are relative to the folder the command runs in")]
    try:
        real = locate(name)
    except SourceError as e:
        return [_diag(loaded, str(e).split("\n")[0], path, "give a local data file or folder")]
    kind = kind_of(real)
    if kind == "folder":
        mixed = mixed_formats(real)
        if mixed:
            message, _, hint = mixed.partition("\n    hint: ")
            return [_diag(loaded, message, path, hint)]
    columns, rows = head(real, kind, spec.data.split if key == "train" else spec.data.eval_split)
    if columns is None:
        return []
    from composer import conversations

    if conversations.are_columns(columns, spec.data):  # messages rows: SFT data (composer/conversations.py)
        return _conversation_source(loaded, spec, key, name, rows, context, where, segments)
    out = _columns(loaded, spec, key, name, columns)
    if not out and context is not None:
        out += _row_sizes(loaded, spec, key, name, rows, context, where)
    if not out:
        out += _row_controls(loaded, spec, key, name, rows)
    return out


def declared_chat_template(tokenizer: str | None) -> bool | None:
    """Whether a local tokenizer folder has a chat template (tokenizer_config.json's chat_template, or a
    chat_template.jinja / chat_template.json file beside it), read without loading it; None when it cannot be told
    here (the toy's has none: False)."""
    name = tokenizer or "toy:student"
    if name.startswith("toy:"):
        return False
    folder = Path(name)
    if not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file() or \
            (folder / "additional_chat_templates").is_dir():
        return True
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return bool(cfg.get("chat_template")) if isinstance(cfg, dict) else None


def _conversation_source(loaded, spec, key: str, name: str, rows, context, where, segments) -> list[Diagnostic]:
    """The checks of a source of messages rows: the spec trains them with SFT only, the data settings that
    apply to prompt rows are not set, the policy tokenizer has a chat template, and the first rows are
    conversations (roles, content, an assistant turn) that fit the context and spell no control token."""
    from composer import conversations

    d, policy, out = spec.data, spec.policy, []
    bad = conversations.settings_problem(d)
    if bad:
        out.append(_diag(loaded, f"{name} holds messages rows (conversations): {bad[1]}", ("data", bad[0]),
                         f"drop data.{bad[0]}", at=(("data", bad[0]), ("data", key))))
    if key == "train":
        for seg in list(segments) or [None]:
            sp = spec if seg is None else seg.spec
            why = conversations.spec_problem(sp)
            if why:
                label = "" if seg is None or not seg.origin else f"in segment '{seg.name}': "
                out.append(_diag(loaded, f"{label}{name}: {why}", ("signal",), "train messages rows with an SFT spec "
                                 "(signal: {kind: sft, target: <a reference_solution source>}, e.g. specs/sft.yaml), "
                                 "or give this method prompt rows (prompt, answer fields)",
                                 at=(("signal",), ("terms",), ("data", key))))
                break
    tok = policy.tokenizer or policy.model
    if declared_chat_template(tok) is False:
        out.append(_diag(loaded, f"{name} holds messages rows (conversations), rendered with the policy tokenizer's "
                         f"chat template, but {tok or 'the toy testbed tokenizer'} has none",
                         ("policy", "tokenizer" if policy.tokenizer else "model"), "give policy.tokenizer (or "
                         "policy.model) a tokenizer whose tokenizer_config.json has a chat_template (an instruct "
                         "model's), or write the rows as prompt and solution fields",
                         at=(("policy", "tokenizer"), ("policy", "model"), ("data", key))))
    if out:
        return out
    severity = "warning" if d.on_bad_row == "skip" else "error"
    skip = "or set data.on_bad_row: skip (such rows are then skipped and counted)"
    pattern = control_pattern(declared_controls(tok))
    for row, fields in rows:
        if conversations.FIELD not in fields:
            return [_diag(loaded, f"{name}: row {row}: field '{conversations.FIELD}': missing (the row has fields: "
                          f"{', '.join(map(str, fields)) or 'none'}), but row 1 is a conversation", ("data", key),
                          f"keep messages rows and prompt rows in separate files, {skip}", severity)]
        try:
            messages = conversations.check(fields[conversations.FIELD])
        except conversations.Problem as p:
            return [_diag(loaded, f"{name}: row {row}: field '{conversations.FIELD}': {p.what}", ("data", key),
                          p.hint, severity)]
        total = sum(len(m["content"]) for m in messages)
        if context is not None and total > row_limit(context):
            return [_diag(loaded, f"{name}: row {row}: field '{conversations.FIELD}' is {total} characters, more than "
                          f"the policy's context ({context} tokens, {where}) can hold at {CHARS_PER_TOKEN} characters "
                          "a token", ("data", key), f"shorten or split the conversation, {skip}", severity)]
        for j, m in enumerate(messages, start=1):
            hit = pattern.search(m["content"]) if pattern is not None else None
            if hit:
                return [_diag(loaded, f"{name}: row {row}: field '{conversations.FIELD}': message {j} ({m['role']}) "
                              f"holds {hit.group(0)!r}, a control token of the policy tokenizer: the chat template's "
                              "rendering would read it as that token (a forged turn), not as text", ("data", key),
                              f"rewrite the text so it does not spell the token (e.g. '< |im_end| >'), {skip}",
                              severity)]
    return out


def _columns(loaded, spec, key: str, name: str, columns: list[str]) -> list[Diagnostic]:
    """The fields the spec names that the source's rows do not have."""
    d = spec.data
    data = loaded.data.get("data") if isinstance(loaded.data.get("data"), dict) else {}
    out = []
    for setting in FIELD_SETTINGS:
        field = getattr(d, setting)
        if setting == "solution_field" and setting not in data:
            continue  # optional unless the spec names it: a row without one has no reference solution
        if field in columns:
            continue
        shown = ", ".join(columns[:20]) + (", ..." if len(columns) > 20 else "") or "none"
        out.append(_diag(loaded, f"{name} has no column '{field}' (data.{setting}); its columns: {shown}",
                         ("data", setting), f"set data.{setting} to the name the rows use",
                         at=(("data", setting), ("data", key))))
    return out


def _row_sizes(loaded, spec, key: str, name: str, rows: list[tuple[int, dict]], context: int,
               where: str) -> list[Diagnostic]:
    """First rows whose prompt cannot fit the context (an error, as the run refuses them; a warning with
    on_bad_row skip), or cannot fit it with max_new_tokens after it (a warning: the run starts, and every response
    of such a prompt that runs long goes past the positions the model was trained on). Counted exactly with the
    declared tokenizer (`declared_tokenizer`), else bounded below by characters."""
    d, budget, policy = spec.data, response_budget(spec), spec.policy
    tok = declared_tokenizer(policy.tokenizer or policy.model)
    skip = "or set data.on_bad_row: skip (the row is then skipped and counted)"
    out, fits_alone, too_long = [], [], []
    for row, fields in rows:
        text = fields.get(d.prompt_field)
        if not isinstance(text, str):
            continue
        if len(text) > row_limit(context):
            severity = "warning" if d.on_bad_row == "skip" else "error"
            out.append(_diag(loaded, f"{name}: row {row}: field '{d.prompt_field}' is {len(text)} characters, more "
                             f"than the policy's context ({context} tokens, {where}) can hold at {CHARS_PER_TOKEN} "
                             "characters a token", ("data", key), "shorten or remove the row, use a policy with a "
                             f"longer context, {skip}", severity))
            continue
        exact = None
        if tok is not None:
            try:
                exact = tok.prompt_tokens(d, text)
            except Exception:  # noqa: BLE001 - a template that fails here: the run renders it and says why
                tok = None
        if exact is not None and exact > context:
            severity = "warning" if d.on_bad_row == "skip" else "error"
            out.append(_diag(loaded, f"{name}: row {row}: its prompt is {exact} tokens ({_counted(tok, d)}), longer "
                             f"than the policy's context ({context} tokens, {where})", ("data", key),
                             f"shorten or remove the row, use a policy with a longer context, {skip}", severity))
        elif budget < context:
            n = exact if exact is not None else -(-len(text) // CHARS_PER_TOKEN)  # else tokens, at the fewest
            (fits_alone if n + budget <= context else too_long).append((row, n))
    if too_long:
        row, n = max(too_long, key=lambda x: x[1])
        many = f"{len(too_long)} of the first {len(rows)} rows; the longest, row {row}," if len(too_long) > 1 else \
            f"row {row}:"
        size = f"{n} tokens ({_counted(tok, d)})" if tok is not None else f"at least {n} tokens"
        out.append(_diag(loaded, f"{name}: {many} its prompt is {size}; with a response budget of {budget}"
                         f"{_env_words(spec)} it "
                         f"cannot fit the policy's context ({context} tokens, {where}): a response that runs long "
                         "goes past the positions the model was trained on", ("data", key),
                         f"lower rollout.max_new_tokens to {max(context - n - _env_extra(spec), 1)}"
                         " or less, or shorten the rows",
                         "warning", at=(("data", key), ("rollout", "max_new_tokens"))))
    return out


def _counted(tok, d) -> str:
    """How a prompt was counted, for a message."""
    if tok is None:
        return "its text"
    if tok.chat(d):
        return f"rendered with the chat template of {tok.name}, counted by its tokenizer.json"
    return f"as plain text, counted by {tok.name}'s tokenizer.json"


def _row_controls(loaded, spec, key: str, name: str, rows: list[tuple[int, dict]]) -> list[Diagnostic]:
    """The first of the first rows whose text spells a control token of the policy tokenizer (read from its
    folder's files): an error, as the run refuses it (a warning with on_bad_row skip)."""
    d, policy = spec.data, spec.policy
    pattern = control_pattern(declared_controls(policy.tokenizer or policy.model))
    if pattern is None:
        return []
    for row, fields in rows:
        for field in (d.prompt_field, d.solution_field, d.answer_field):
            text = fields.get(field)
            hit = pattern.search(text) if isinstance(text, str) else None
            if hit:
                severity = "warning" if d.on_bad_row == "skip" else "error"
                return [_diag(loaded, f"{name}: row {row}: field '{field}' holds {hit.group(0)!r}, a control token of "
                              "the policy tokenizer: in a prompt it would be read as that token, not as text",
                              ("data", key), "rewrite the text so it does not spell the token (e.g. '< |im_end| >'), "
                              "or set data.on_bad_row: skip (such rows are then skipped and counted)", severity)]
    return []


# ------------------------------------------------------------------------------------------ reading the head


def head(path: Path, kind: str, split: str | None = None) -> tuple[list[str] | None, list[tuple[int, dict]]]:
    """(the columns, the first HEAD_ROWS rows as (row number, dict)) of a data source, read cheaply: a file's
    header or first lines, a parquet file's schema, a `datasets` folder's features; (None, []) when they cannot
    be told this way (the run then reads and reports)."""
    try:
        if kind == "folder":
            return _folder_head(path, split)
        if kind == "disk":
            return _disk_columns(path, split), []
        if kind == "parquet":
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(str(path)).schema_arrow.names), []
        if kind == "csv":
            return _csv_head(path)
        if kind == "json":
            return _json_head(path)
        return _jsonl_head(path)
    except Exception:  # noqa: BLE001 - a damaged file: the run names what is wrong with it, row by row
        return None, []


def _folder_head(path: Path, split: str | None):
    """The head of the folder's first data file (of the split's files, when their names say the split)."""
    from composer.runtime.datafiles import folder_files, kind_of

    files = [f for group in folder_files(path).values() for f in group]
    want = split or "train"
    named = [f for f in files if want in f.name or want in f.parent.name]
    for f in named or files:
        return head(f, kind_of(f))
    return None, []


def _disk_columns(path: Path, split: str | None) -> list[str] | None:
    """The features of a save_to_disk folder (a Dataset, or one split of a DatasetDict)."""
    info = path / "dataset_info.json"
    if not info.is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        chosen = split if split in splits else ("train" if "train" in splits else (splits or [None])[0])
        if chosen is None:
            return None
        info = path / chosen / "dataset_info.json"
    features = json.loads(info.read_text()).get("features")
    return list(features) if isinstance(features, dict) else None


def _csv_head(path: Path):
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    rows = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        columns = list(reader.fieldnames or [])
        try:
            for i, row in enumerate(reader, start=1):
                if i > HEAD_ROWS:
                    break
                rows.append((i, row))
        except csv.Error:  # a field past csv's size limit: the columns are known, the rows are the run's to read
            pass
    return columns, rows


def _jsonl_head(path: Path):
    rows = []
    with path.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            if len(rows) >= HEAD_ROWS:
                break
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8").lstrip("\ufeff"))
            except ValueError:  # a bad line: the run names it; the rows above it still tell the columns
                break
            if not isinstance(row, dict):
                break
            rows.append((i, row))
    return (list(rows[0][1]) if rows else None), rows


def _json_head(path: Path):
    """A .json file: JSON lines (the `datasets` json builder reads both), or one array of objects."""
    with path.open("rb") as f:
        start = f.read(1 << 10).lstrip()
    if start.startswith(b"{"):
        return _jsonl_head(path)
    if start.startswith(b"[") and path.stat().st_size <= JSON_WHOLE_MAX:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = [(i, r) for i, r in enumerate(data[:HEAD_ROWS], start=1) if isinstance(r, dict)]
        return (list(rows[0][1]) if rows else None), rows
    return None, []
