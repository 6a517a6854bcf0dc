"""Conversations (`messages` rows) where the runtime binds data: each row's Example, the binding that renders and
tokenizes every conversation before training, and explain's count (the format itself: composer/conversations.py)."""

from __future__ import annotations

from collections import Counter

from composer.conversations import BAD_CONVERSATION, FIELD, FORMAT, Conversation, Problem, check, is_row


def example(path, i: int, row: dict, d):
    """The Example of a conversation row (composer/data.py), or a DataError naming file, row and field."""
    from composer.data import Example
    from composer.runtime.binding import MISSING_FIELD, _error

    if FIELD not in row or row[FIELD] is None:
        have = ", ".join(map(str, row)) or "none"
        raise _error(path, i, FIELD, f"missing (the row has fields: {have})", MISSING_FIELD)
    try:
        messages = check(row[FIELD])
    except Problem as p:
        raise _error(path, i, FIELD, f"{p.what}\n    hint: {p.hint}", BAD_CONVERSATION) from None
    last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
    users = [m["content"] for m in messages[:last] if m["role"] == "user"]
    answer = messages[last]["content"]
    return Example(prompt=users[-1] if users else messages[0]["content"], answer=answer, solution=answer,
                   problem=users[-1] if users else "", row=i, meta=dict(row) | {"file": str(path)},
                   conversation=Conversation(messages))


def bind(task, spec, fmt) -> Counter:
    """Render every conversation of `task` (train and eval, in place): its tokens and assistant spans, and its
    prompt (the conversation before its last assistant turn, with the generation prompt). A row the template cannot
    render, or longer than the policy's declared context, is refused (or skipped and counted). Returns the skipped
    counts by reason; DataError when the tokenizer has no chat template or every training row is refused."""
    from composer.checks.data import declared_context
    from composer.errors import DataError
    from composer.runtime.binding import TOO_LONG, _error, _Skips
    from composer.stops import for_spec
    from composer.template_limits import TemplateLimitError, render

    exs = list(task.train) + [e for v in task.eval.values() for e in v]
    if not any(e.conversation is not None for e in exs):
        return Counter()
    d = spec.data
    if fmt.mode != "chat":
        why = no_template(fmt, d)
        raise DataError(why, file=str(d.train), row=1, field="prompt_format", reason=BAD_CONVERSATION)
    tok, kwargs = fmt.tokenizer, dict(fmt.kwargs)
    stops = for_spec(tok, spec).ids
    context, where = declared_context(getattr(getattr(spec, "policy", None), "model", None))
    counts: Counter = Counter()
    for name, examples in [("train", task.train)] + list(task.eval.items()):
        skips, kept = _Skips(d.on_bad_row), []
        for ex in examples:
            conv = ex.conversation
            if conv is None:
                kept.append(ex)
                continue
            src = (ex.meta or {}).get("file", "<data>")
            try:
                conv.tokenize(tok, kwargs, stops)
                last = max(k for k, m in enumerate(conv.messages) if m["role"] == "assistant")
                ex.prompt = render(tok, conv.messages[:last], kwargs, add_generation_prompt=True)
            except Problem as p:
                skips.bad(_error(src, ex.row, FIELD, f"{p.what}\n    hint: {p.hint}", BAD_CONVERSATION))
                continue
            except TemplateLimitError as e:
                skips.bad(_error(src, ex.row, FIELD, f"the chat template of {fmt.tokenizer_name}: {e}\n    hint: "
                                 "shorten the conversation, or give policy.tokenizer another chat template; or "
                                 "data.on_bad_row=skip to train on the other rows", BAD_CONVERSATION))
                continue
            except Exception as e:  # noqa: BLE001 - jinja errors, a template raising on a role order
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                skips.bad(_error(src, ex.row, FIELD, f"the chat template of {fmt.tokenizer_name or 'the policy'} "
                                 f"does not render this conversation ({type(e).__name__}: {first})\n    hint: fix the "
                                 "row (many templates want system first, then user and assistant alternating), or "
                                 "data.on_bad_row=skip to train on the other rows", BAD_CONVERSATION))
                continue
            if context is not None and len(conv.ids) > context:
                skips.bad(_error(src, ex.row, FIELD, f"the conversation is {len(conv.ids)} tokens, longer than the "
                                 f"policy's context ({context} tokens, {where})\n    hint: shorten or split it, or "
                                 "data.on_bad_row=skip to train on the other rows", TOO_LONG))
                continue
            kept.append(ex)
        skips.report(f"{name} conversations")
        counts += skips.counts
        if name == "train":
            task.train = kept
        else:
            task.eval[name] = kept
    if not task.train:
        raise DataError(f"{d.train}: no usable conversation (every row refused: {dict(counts)})", file=str(d.train))
    return counts


def no_template(fmt, d) -> str:
    """Why conversations cannot be rendered under this prompt format (chat template missing, or plain asked)."""
    name = getattr(fmt, "tokenizer_name", "") or "the policy tokenizer"
    if getattr(d, "prompt_format", "auto") == "plain":
        return (f"{d.train}: row 1: field 'messages': data.prompt_format is plain, but messages rows are rendered "
                f"with the chat template\n    hint: drop data.prompt_format (auto) or set it to chat")
    return (f"{d.train}: row 1: field 'messages': the tokenizer {name} has no chat template, and messages rows "
            "(conversations) are rendered with it: SFT trains each assistant turn as the template writes it\n    hint: "
            "give policy.tokenizer (or policy.model) a tokenizer whose tokenizer_config.json has a chat_template (an "
            "instruct model's), or write the rows as prompt and solution fields")


def summary(name: str, split: str | None, d, role: str = "train") -> str | None:
    """`messages: N conversations (M assistant turns), assistant turns trained` for a source of messages rows (the
    rows are read and checked, not rendered); None when its first row is not a conversation."""
    from composer.errors import DataError
    from composer.runtime.binding import open_source

    try:
        _where, rows = open_source(name, split, role)
        n = turns = bad = 0
        first_bad = ""
        for i, row in rows:
            if isinstance(row, DataError) or not isinstance(row, dict):
                bad += 1
                first_bad = first_bad or f"row {i}"
                continue
            if n == 0 and bad == 0 and not is_row(row, d):
                return None
            try:
                turns += sum(m["role"] == "assistant" for m in check(row.get(FIELD)))
                n += 1
            except Problem as p:
                bad += 1
                first_bad = first_bad or f"row {i}: {p.what}"
    except DataError:
        return None
    if n == 0 and bad == 0:
        return None
    refused = f"; {bad} row(s) refused (first: {first_bad})" if bad else ""
    return (f"{FORMAT}: {n} conversations ({turns} assistant turns), assistant turns trained (each through its end "
            f"of turn; system, user and tool turns are prompt tokens, no loss){refused}")
