"""Bind a spec to what it trains on: the toy testbed when no data is given, else the data files.

Bad data never passes silently. Every bad row is either a `DataError` naming the file, the row
(1-based; for jsonl the line number) and the field, or, with `data.on_bad_row: skip`, skipped and
counted by reason. The counts live on the task: `task.skipped_rows` (total) and
`task.skipped_by_reason` ({reason: count}); the run logs them (`skipped_rows`).

Checks, in order:
  load time (`load_examples`, called by `bind_task`): a data path that is not a regular file or a
    folder (a FIFO, /dev/zero: refused unread), invalid JSON (including NaN / Infinity, integers
    longer than Python converts, rows nested deeper than the parser's recursion), non-UTF-8 bytes (or
    lone surrogates), a row that is not an object, missing / null fields, a prompt that is not text or
    is empty, an answer that is not text or a finite number;
  load time (`screen_task` in composer/checks/data.py, called by `bind_task` before anything renders or
    tokenises a row): text longer than the policy's declared context can hold (by characters: a 30 MiB row
    is never tokenised), text spelling one of the policy tokenizer's control tokens (`<|im_end|>`);
  load time (`validate_answers`, called by `bind_task` for each verifier the spec names): dataset
    answers the verifier cannot read (math: math_verify finds no expression; exact: empty; code:
    no tests or tests that do not compile);
  load time (`render_task`, called by `bind_task`): each prompt is rendered (data.prompt_format: the
    policy tokenizer's chat template, a system prompt, data.prompt_template; composer/prompts.py),
    and a format the tokenizer cannot render is a DataError naming `prompt_format`;
  after the tokenizer is loaded (`check_lengths` / `check_task_lengths`, called by the run): prompts
    longer than the context (the policy's max_position_embeddings, see `context_length`).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from composer.data import Example, Task
from composer.errors import DataError
from composer.prompts import TASK_FORMAT, prompt_format

log = logging.getLogger("composer")

# skip reasons (keys of task.skipped_by_reason)
BAD_JSON, NOT_UTF8, NOT_OBJECT, MISSING_FIELD, BAD_TYPE, EMPTY_PROMPT, TOO_LONG, UNPARSABLE_ANSWER = (
    "bad_json", "not_utf8", "not_object", "missing_field", "bad_type", "empty_prompt", "too_long", "unparsable_answer")


def _error(file, row: int, field: Optional[str], what: str, reason: str) -> DataError:
    where = f"{file}: row {row}" + (f": field '{field}'" if field else "")
    return DataError(f"{where}: {what}", file=str(file), row=row, field=field or "", reason=reason)


SKIP_HINT = "or data.on_bad_row=skip to train on the other rows (the skipped ones are counted)"


def data_hint(e: DataError, d=None) -> str:
    """What to do about a data error, for its reason and field (was: one hint about the fields for every data
    error). `d`: the spec's data settings, to name the field setting that picked the missing field."""
    reason, field = getattr(e, "reason", ""), getattr(e, "field", "")
    text = str(e)
    if reason == MISSING_FIELD:
        defaults = {"prompt_field": "prompt", "answer_field": "answer", "solution_field": "solution"}
        setting = next((f"data.{name}" for name, default in defaults.items()
                        if (getattr(d, name, None) if d is not None else default) == field),
                       "data.prompt_field / data.answer_field")
        return (f"the rows have no field '{field}': set {setting} to the name the rows use for it (their fields are "
                "listed above); `composer explain SPEC` shows the first row's prompt once it reads")
    if reason == BAD_JSON:
        return f"each line of a .jsonl file is one JSON object; fix that row, {SKIP_HINT}"
    if reason == NOT_UTF8:
        return f"save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`), {SKIP_HINT}"
    if reason == NOT_OBJECT:
        return f'each row is an object with named fields, e.g. {{"prompt": "...", "answer": "..."}}; {SKIP_HINT}'
    if reason == BAD_TYPE:
        return f"the field '{field}' must hold text (an answer may be a number); fix those rows, {SKIP_HINT}"
    if reason == EMPTY_PROMPT:
        return f"remove the rows with an empty '{field}', {SKIP_HINT}"
    if reason == TOO_LONG:
        return f"shorten those prompts, or use a policy with a longer context; {SKIP_HINT}"
    if reason == "control_token":
        return f"rewrite the text so it does not spell the token (e.g. '< |im_end| >'), {SKIP_HINT}"
    if reason == UNPARSABLE_ANSWER:
        return ("the answer field must be what the verifier reads (its forms: `composer list verifiers`); choose "
                f"the verifier that matches the answers (sources.<name>.verifier), {SKIP_HINT}")
    if field == "prompt_format":
        return "see `composer list data` for data.prompt_format, system_prompt and prompt_template"
    if "split" in text:
        return "set data.split / data.eval_split to one of the splits named above, or drop the setting"
    if "no such data" in text or "not found" in text or "not a regular file" in text:
        return "give data.train / data.eval a local file (jsonl, json, csv, parquet) or a `datasets` folder"
    if "no usable row" in text:
        return f"every row was refused for the reason shown; fix the rows, or check the field settings"
    return "check the data file against `composer list data`"


class _Skips:
    """Counts skipped rows by reason; raises instead when on_bad_row is `error`."""

    def __init__(self, on_bad_row: str):
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', not {on_bad_row!r}")
        self.on_bad_row, self.counts, self.first = on_bad_row, Counter(), {}

    def bad(self, err: DataError) -> None:
        if self.on_bad_row != "skip":
            raise err
        self.counts[err.reason or "bad_row"] += 1
        self.first.setdefault(err.reason or "bad_row", str(err))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self, what: str) -> None:
        for reason, n in sorted(self.counts.items()):
            log.warning("%s: skipped %d row(s) (%s), e.g. %s", what, n, reason, self.first[reason])


# ------------------------------------------------------------------------------------------ binding


def bind_task(spec) -> Task:
    d = spec.data
    if d.train is None:
        from composer.registry import part

        task = part("toy.task")(tiers=tuple(d.tiers), train_tiers=tuple(d.train_tiers), eval_per_tier=spec.train.eval_samples,
                        seed=spec.train.seed, task=d.toy_task)
        task.skipped_rows, task.skipped_by_reason = 0, {}
        return task
    counts: Counter = Counter()
    train, c = load_examples_counted(d.train, d, d.split, "train")
    counts += c
    evals = {}
    eval_source = eval_file(d)
    if eval_source:
        evals["eval"], c = load_examples_counted(eval_source, d, d.eval_split, "eval")
        counts += c
    task = Task(name=Path(d.train).stem, train=train, eval=evals, verifier="math")
    from composer.checks.data import screen_task
    from composer.prompts import PromptFormatError, render_task

    try:
        fmt = policy_format(spec)
    except PromptFormatError as e:
        raise DataError(str(e), file=str(d.train), field="prompt_format") from None
    counts += screen_task(task, spec, fmt)  # too long for the context, or a control token: before any is tokenised
    for name in spec_verifiers(spec, task):
        task.train, n = validate_answers(task.train, name, d.on_bad_row, file=d.train, field=d.answer_field)
        counts[UNPARSABLE_ANSWER] += n
        for k in task.eval:
            task.eval[k], n = validate_answers(task.eval[k], name, d.on_bad_row, file=eval_file(d), field=d.answer_field)
            counts[UNPARSABLE_ANSWER] += n
    try:  # each prompt rendered once, here: chat template / system prompt / prompt template (data.prompt_format)
        render_task(task, fmt)
    except PromptFormatError as e:
        raise DataError(str(e), file=str(d.train), field="prompt_format") from None
    trains = any(ex.conversation is not None for ex in task.train)  # messages rows: SFT on their assistant turns
    if trains or any(ex.conversation is not None for exs in task.eval.values() for ex in exs):
        from composer.runtime.conversations import bind

        _conversations_apply(spec, d, trains)
        counts += bind(task, spec, fmt)  # tokens and assistant spans, before training
    _set_counts(task, counts)
    return task


def _conversations_apply(spec, d, trains: bool = True) -> None:
    """DataError when messages rows cannot be used by this spec (only SFT trains on them) or these data settings."""
    from composer import conversations

    why = conversations.spec_problem(spec) if trains else None
    bad = conversations.settings_problem(d)
    if why or bad:
        field = bad[0] if bad and not why else "messages"
        raise DataError(f"{d.train}: {why or bad[1]}\n    hint: " + (
            "train these rows with an SFT spec (signal: {kind: sft, target: <a reference_solution source>}, e.g. "
            "specs/sft.yaml), or give prompt rows (prompt, answer) for this method" if why else
            f"drop data.{bad[0]} for messages rows"), file=str(d.train), field=field,
            reason=conversations.BAD_CONVERSATION)


def eval_file(d) -> str | None:
    """The evaluation source: data.eval, else data.train when data.eval_split names one of its splits."""
    return d.eval or (d.train if d.eval_split else None)


def _set_counts(task: Task, counts: Counter) -> None:
    task.skipped_by_reason = {k: v for k, v in counts.items() if v}
    task.skipped_rows = sum(task.skipped_by_reason.values())


def spec_verifiers(spec, task: Task) -> list[str]:
    """Verifier names of the spec's outcome_reward sources (phases and stages included); `auto` -> the task's."""
    found = []

    def add(src):
        kind = getattr(src, "kind", None) if not isinstance(src, dict) else src.get("kind")
        name = getattr(src, "verifier", None) if not isinstance(src, dict) else src.get("verifier")
        if kind == "outcome_reward" or (kind is None and name is not None):
            found.append(task.verifier if name in (None, "auto") else name)

    for src in (getattr(spec, "sources", None) or {}).values():
        add(src)
    for part in list(getattr(spec, "phases", None) or []) + list(getattr(spec, "stages", None) or []):
        for src in (getattr(part, "sources", None) or {}).values():
            add(src)
    return list(dict.fromkeys(found))


# ------------------------------------------------------------------------------------------ reading


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different (json keeps the last of two silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKey(k)
            seen.add(k)
    return out


def _json_row(path: Path, i: int, text: str):
    """One jsonl row, or a DataError: NaN / Infinity are not JSON (Python's parser accepts them), nor are
    integers past Python's conversion limit (4300 digits) or rows nested past its recursion limit."""
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except DuplicateKey as e:
        return _error(path, i, None, f"not valid data: the key {e.key!r} appears twice in one object", BAD_JSON)
    except json.JSONDecodeError as e:
        return _error(path, i, None, f"not valid JSON ({e.msg} at column {e.colno})", BAD_JSON)
    except ValueError as e:
        return _error(path, i, None, f"not valid JSON ({str(e).splitlines()[0][:120]})", BAD_JSON)
    except RecursionError:
        return _error(path, i, None, "not valid JSON (nested too deeply to read)", BAD_JSON)


def open_source(name: str, split: str | None = None, role: str = "train") -> tuple[str, Iterator[tuple[int, Any]]]:
    """(where, rows) of a data source (composer/runtime/datafiles.py): `where` names the file (and split) in errors;
    rows are (1-based row number, row dict or DataError). jsonl is read line by line here, so a bad line is
    named; every other format goes through the `datasets` library."""
    from composer.runtime.datafiles import SourceError, kind_of, locate, rows

    from composer.runtime.paths import data_path_problem

    why = data_path_problem(name)  # a FIFO or /proc/kmsg would block, /dev/zero would fill memory
    if why:
        raise DataError(why, file=str(name))
    try:
        real = locate(str(name))
        if kind_of(real) == "jsonl":
            if split is not None and not (role == "train" and split == "train"):
                field = "data.split" if role == "train" else "data.eval_split"
                raise SourceError(f"{name}: a JSON-lines file has no split {split!r} ({field}); drop the setting")
            return str(name), _jsonl_rows(real)
        return rows(str(name), split, role)
    except SourceError as e:
        raise DataError(str(e), file=str(name)) from None


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row dict or DataError) for every row of the training split of a data source."""
    return open_source(str(path))[1]


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield i, _error(path, i, None, f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})",
                                NOT_UTF8)
                continue
            yield i, _json_row(path, i, text.lstrip("\ufeff") if i == 1 else text)


def load_examples_counted(file: str, d, split: str | None = None, role: str = "train") -> tuple[list[Example], Counter]:
    """Examples from a data source (jsonl, json, csv, parquet, a `datasets` folder, a folder of data files, a
    cached hub dataset; `split` of a source with several), and the skipped rows counted by reason."""
    where, it = open_source(file, split, role)
    out, skips = [], _Skips(d.on_bad_row)
    for i, row in it:
        try:
            if isinstance(row, DataError):
                raise row
            ex = _example(where, i, row, d)
            if out and (ex.conversation is None) != (out[0].conversation is None):  # one format a source
                raise _mixed(where, out[0], ex, d)
            out.append(ex)
        except DataError as e:
            skips.bad(e)
    skips.report(where)
    if not out:
        raise DataError(f"{where}: no usable rows" + (f" ({skips.total} skipped: {dict(skips.counts)})"
                                                      if skips.total else ""), file=str(file))
    return out, skips.counts


def _mixed(where, first: Example, ex: Example, d) -> DataError:
    """A row of the other format than the source's first row (messages rows and prompt rows in one source)."""
    from composer.conversations import BAD_CONVERSATION, FIELD

    kinds = {True: f"a conversation ('{FIELD}')", False: f"a prompt row ('{d.prompt_field}')"}
    return _error(where, ex.row, FIELD if first.conversation is not None else d.prompt_field,
                  f"{kinds[ex.conversation is not None]}, but row {first.row} is {kinds[first.conversation is not None]}:"
                  " a source holds one format\n    hint: keep messages rows and prompt rows in separate files, or "
                  "data.on_bad_row=skip to train on the rows of the first row's format", BAD_CONVERSATION)


def load_examples(file: str, d) -> tuple[list[Example], int]:
    """Examples from jsonl / parquet / a `datasets` directory; bad rows stop the run or are skipped (counted)."""
    out, counts = load_examples_counted(file, d)
    return out, sum(counts.values())


def _text(path, i, fld, value, numbers_ok: bool) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise _error(path, i, fld, "not UTF-8 text", NOT_UTF8) from None
    if isinstance(value, bool) or not isinstance(value, (str, int, float) if numbers_ok else str):
        want = "text or a number" if numbers_ok else "text"
        raise _error(path, i, fld, f"expected {want}, got {type(value).__name__}", BAD_TYPE)
    if isinstance(value, float) and not math.isfinite(value):  # parquet can hold NaN; it is no answer
        raise _error(path, i, fld, f"expected a finite number, got {value}", BAD_TYPE)
    value = str(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _error(path, i, fld, "not valid Unicode text (lone surrogate escape)", NOT_UTF8) from None
    return value


def _example(path: Path, i: int, row, d) -> Example:
    if not isinstance(row, dict):
        raise _error(path, i, None, f"expected an object with fields, got {type(row).__name__}", NOT_OBJECT)
    from composer.conversations import is_row

    if is_row(row, d):  # a `messages` row: a conversation (composer/conversations.py)
        from composer.runtime.conversations import example

        return example(path, i, row, d)
    for fld in (d.prompt_field, d.answer_field):
        if fld not in row or row[fld] is None:
            have = ", ".join(map(str, row)) or "none"
            raise _error(path, i, fld, f"missing (the row has fields: {have})", MISSING_FIELD)
    prompt = _text(path, i, d.prompt_field, row[d.prompt_field], numbers_ok=False)
    if not prompt.strip():
        raise _error(path, i, d.prompt_field, "empty prompt", EMPTY_PROMPT)
    answer = _text(path, i, d.answer_field, row[d.answer_field], numbers_ok=True)
    sol = row.get(d.solution_field)
    sol = None if sol is None else _text(path, i, d.solution_field, sol, numbers_ok=True)
    return Example(prompt=prompt, answer=answer, solution=sol, row=i, meta=dict(row) | {"file": str(path)})


# ------------------------------------------------------------------------------------------ answers


def answer_problem(ex: Example, verifier_name: str) -> Optional[str]:
    """Why `verifier_name` could not read this example's answer, or None (also for verifiers with no check):
    the verifier's registered `check` (composer.registry.register_verifier)."""
    from composer.registry import VERIFIERS, load_builtins

    load_builtins()
    info = VERIFIERS.get(verifier_name)
    return None if info is None else info.answer_problem(ex)


def validate_answers(examples: Iterable[Example], verifier_name: str, on_bad_row: str = "error",
                     file: Optional[str] = None, field: str = "answer") -> tuple[list[Example], int]:
    """Check every dataset answer is readable by the verifier: raise a DataError, or skip and count.

    Returns (the kept examples, the number skipped). Never lets a row through whose reward would be
    a silent 0 because the reference answer itself cannot be read.
    """
    skips, out = _Skips(on_bad_row), []
    for ex in examples:
        why = answer_problem(ex, verifier_name)
        if why is None:
            out.append(ex)
            continue
        src = (ex.meta or {}).get("file") or file or "<data>"
        fld = "tests" if verifier_name == "code" and "tests" in (ex.meta or {}) else field
        fld = "timeout" if verifier_name == "code" and why.startswith("timeout") else fld
        skips.bad(_error(src, ex.row, fld, f"verifier '{verifier_name}': {why}", UNPARSABLE_ANSWER))
    skips.report(file or "data")
    if not out and skips.total:
        raise DataError(f"{file or 'data'}: no usable rows ({skips.total} answers unreadable by verifier "
                        f"'{verifier_name}', e.g. {next(iter(skips.first.values()))})", file=str(file or ""))
    return out, skips.total


# ------------------------------------------------------------------------------------------ lengths


def context_length(model_or_config, default: Optional[int] = None) -> Optional[int]:
    """The policy's context: config.max_position_embeddings (or n_positions / max_seq_len / seq_length)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    for cfg_ in (cfg, getattr(cfg, "text_config", None)):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
            v = getattr(cfg_, key, None) if cfg_ is not None else None
            if isinstance(v, int) and v > 0:
                return v
    return default


def _encode_all(tokenizer, prompts: list[str]) -> list[int]:
    """Token counts, as the run encodes prompts (`encode(text, add_special_tokens=False)`)."""
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        return [len(tokenizer(p)) for p in prompts]
    try:
        ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        if len(ids) == len(prompts):
            return [len(x) for x in ids]
    except Exception:
        pass
    return [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]


def check_lengths(examples: list[Example], tokenizer, max_len: Optional[int], on_bad_row: str = "error",
                  field: str = "prompt") -> tuple[list[Example], int]:
    """Prompts longer than `max_len` tokens: a DataError naming file, row and field, or skipped and counted.

    Returns (the kept examples, the number skipped). `max_len` None: no check.
    """
    if max_len is None or not examples:
        return list(examples), 0
    counts = _encode_all(tokenizer, [ex.prompt for ex in examples])
    skips, out = _Skips(on_bad_row), []
    for ex, n in zip(examples, counts):
        if n <= max_len:
            out.append(ex)
            continue
        src = (ex.meta or {}).get("file", "<data>")
        skips.bad(_error(src, ex.row, field, f"prompt is {n} tokens, longer than the context ({max_len} tokens)",
                         TOO_LONG))
    skips.report("prompt lengths")
    return out, skips.total


def check_task_lengths(task: Task, tokenizer, max_len: Optional[int], on_bad_row: str = "error",
                       field: str = "prompt") -> int:
    """check_lengths over the task's train and eval examples, in place; adds to the task's skip counts."""
    total = 0
    task.train, n = check_lengths(task.train, tokenizer, max_len, on_bad_row, field)
    total += n
    for k in list(task.eval):
        task.eval[k], n = check_lengths(task.eval[k], tokenizer, max_len, on_bad_row, field)
        total += n
    if not task.train:
        raise DataError(f"{task.name}: no training prompt fits the context ({max_len} tokens)")
    counts = Counter(getattr(task, "skipped_by_reason", {}) or {})
    counts[TOO_LONG] += total
    _set_counts(task, counts)
    return total


def policy_format(spec):
    """The policy's prompt format (a PromptFormat) for `spec`, loading its tokenizer when the format depends on
    it (a run binds its data with this; the run context renders teachers' and judges' prompts with the same settings)."""
    d = spec.data
    if d.train is None:
        return TASK_FORMAT
    policy = getattr(spec, "policy", None)  # a spec without one: the toy student
    name = getattr(policy, "tokenizer", None) or getattr(policy, "model", None) or "toy:student"
    if name.startswith("toy:"):  # the toy tokenizer (character level) has no chat template: no need to load it
        return prompt_format(d, None, name)
    from composer.runtime.models import load_tokenizer

    tok = load_tokenizer(name, trust_remote_code=bool(getattr(policy, "trust_remote_code", False)))
    return prompt_format(d, tok, name)
