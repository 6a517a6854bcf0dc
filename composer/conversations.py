"""Conversational data: `messages` rows (DESIGN.md section 11: "a data format: SFT trains assistant turns only").

A data row is a conversation when it has a `messages` field and not the spec's `data.prompt_field` (or when
`data.prompt_field` is `messages`): a list of {role, content} objects, the roles system, user, assistant and tool,
the format of most SFT sets. Each row is checked when the data loads (`check`): a role outside the four, a message
without content (or with content that is not text), an empty assistant turn, a conversation without an assistant
turn or one that opens with it are refused with the file, the row, the field and the fix (or skipped and counted,
`data.on_bad_row: skip`). Keys beside role and content (`name`, `tool_call_id`) reach the template as they are.

What trains. The conversation is rendered by the policy tokenizer's chat template and tokenized once, with no
special tokens added (as every prompt is). Every assistant turn's tokens are loss tokens of origin `demonstration`
(what SFT targets are), through the end-of-turn token the template writes after it (a stop token, composer/stops.py;
an SFT run trains on the end of turn); system, user and tool tokens, the assistant header (`<|im_start|>assistant\\n`)
and whatever the template writes after an end of turn (ChatML's newline) are prompt tokens, with no loss. The
assistant tokens are found in one of two ways (`how`):

  * `generation`: the template marks the assistant's text with `{% generation %}` ... `{% endgeneration %}`;
    transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` returns the mask of those tokens
    (needs a fast tokenizer), and a run of masked tokens that stops right before the end-of-turn token takes it too;
  * `prefixes` (any other template): the character span of assistant turn k is from the end of the conversation up
    to it rendered with add_generation_prompt (messages[:k]) to the end of the conversation up to and including it
    (messages[:k + 1]); both must be the beginning of the whole rendered conversation (a template that renders earlier
    turns differently, e.g. drops their reasoning, is refused for this row: give it `{% generation %}` blocks).
    The tokens of the whole text that overlap a span are the turn's (offsets of a fast tokenizer; a slow one
    encodes the text between span boundaries piece by piece), cut after the first stop token.

Both give each turn's tokens from the first token of its text through its end of turn; the count of turns found
must be the count of assistant messages. The conversation's tokens are computed when the data is bound
(composer/runtime/conversations.py `bind`; the rows' Examples and explain's count are there too), so a template
that fails on a row, or a conversation longer than the policy's context, stops the run before training with the
row named. A conversation's `Example.prompt` (evaluation, samples, lengths) is the conversation before its last
assistant turn with the generation prompt, its answer (and solution) that turn's text.

No torch at import, nothing from the runtime (components/signals/sft.py builds its rows with `trace`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FIELD = "messages"
ROLES = ("system", "user", "assistant", "tool")
BAD_CONVERSATION = "bad_conversation"  # skip reason (task.skipped_by_reason)
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
RENAMES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant",
           "chatgpt": "assistant", "function": "tool", "ipython": "tool", "observation": "tool", "developer": "system"}
FORMAT = "messages"  # the data format's name (explain, plan.json)


class Problem(ValueError):
    """What is wrong with one conversation, and the fix."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.what, self.hint = what, hint


@dataclass
class Conversation:
    """A checked conversation; `ids` and `spans` once tokenized (`tokenize`): the whole conversation's token ids and
    [start, end) of each assistant turn's trained tokens; `how`: generation or prefixes (see the module)."""

    messages: list[dict]
    ids: list[int] | None = None
    spans: list[tuple[int, int]] | None = None
    how: str = ""

    @property
    def assistant_turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)

    def tokenize(self, tokenizer, kwargs: dict | None = None, stop_ids=()) -> Conversation:
        if self.ids is None:
            self.ids, self.spans, self.how = assistant_tokens(tokenizer, self.messages, kwargs or {}, stop_ids)
        return self


# ------------------------------------------------------------------------------------------ rows


def is_row(row, d) -> bool:
    """Whether a data row is a conversation: a `messages` field and no data.prompt_field (or prompt_field messages)."""
    return isinstance(row, dict) and (d.prompt_field == FIELD or (FIELD in row and d.prompt_field not in row))


def are_columns(columns, d) -> bool:
    """Whether a source with these columns holds conversations (validation reads the columns only)."""
    return d.prompt_field == FIELD or (FIELD in columns and d.prompt_field not in columns)


def _role_hint(role) -> str:
    known = RENAMES.get(str(role).strip().lower()) if isinstance(role, str) else None
    rename = f"rename it '{known}'" if known else "use one of them"
    return (f"{rename} (roles are system, user, assistant and tool; human -> user, gpt / model -> assistant), or "
            "data.on_bad_row=skip to train on the other rows")


def check(value) -> list[dict]:
    """The messages of a conversation, checked (Problem: what is wrong and the fix). A JSON text holding the list (a
    csv cell) is read; keys whose value is null are dropped (as transformers does), others kept."""
    skip = "or data.on_bad_row=skip to train on the other rows (the skipped ones are counted)"
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError:
            raise Problem("expected a list of messages, got text that is not a JSON list",
                          'write the conversation as a list: [{"role": "user", "content": "..."}, {"role": '
                          '"assistant", "content": "..."}], ' + skip) from None
    if not isinstance(value, (list, tuple)):
        raise Problem(f"expected a list of messages ({{role, content}} objects), got {type(value).__name__}",
                      f'write it as [{{"role": "user", "content": "..."}}, {{"role": "assistant", "content": '
                      f'"..."}}], {skip}')
    if not value:
        raise Problem("an empty conversation (no messages)", f"remove the row, {skip}")
    out = []
    for j, m in enumerate(value, start=1):
        if not isinstance(m, dict):
            raise Problem(f"message {j} is {type(m).__name__}, not an object with role and content",
                          f'each message is {{"role": ..., "content": ...}}; {skip}')
        if "role" not in m and "from" in m:
            raise Problem(f"message {j} has 'from' and 'value' (the ShareGPT format), not 'role' and 'content'",
                          "convert the rows: from -> role, value -> content, human -> user, gpt -> assistant, "
                          "system -> system")
        role = m.get("role")
        if role is None:
            raise Problem(f"message {j} has no role", f"give every message a role (system, user, assistant, tool), {skip}")
        if not isinstance(role, str) or role not in ROLES:
            raise Problem(f"message {j} has the role {role!r}, not one of {', '.join(ROLES)}", _role_hint(role))
        content = m.get("content")
        if content is None:
            calls = " (tool calls without text are not read)" if m.get("tool_calls") else ""
            raise Problem(f"message {j} ({role}) has no content{calls}",
                          f"give every message its text in 'content', or remove the message; {skip}")
        if isinstance(content, (list, dict)):
            raise Problem(f"message {j} ({role}): its content is a {type(content).__name__} (content parts), not "
                          "text", f"write the message's text as one string, {skip}")
        if isinstance(content, bool) or not isinstance(content, str):
            raise Problem(f"message {j} ({role}): expected text as its content, got {type(content).__name__}",
                          f"write the content as text, {skip}")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise Problem(f"message {j} ({role}): not valid Unicode text (lone surrogate escape)",
                          f"save the text as UTF-8, {skip}") from None
        if role == "assistant" and not content.strip():
            raise Problem(f"message {j} (assistant) is empty: it would train its end of turn only",
                          f"remove the empty turn (or the row), {skip}")
        if role == "assistant" and not out:
            raise Problem("the conversation opens with the assistant (message 1): there is no prompt before it",
                          f"start the conversation with a system or user message, {skip}")
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        roles = ", ".join(m["role"] for m in out)
        raise Problem(f"no assistant turn (roles: {roles}): nothing to train, SFT trains the assistant turns",
                      f"add the assistant's reply, or remove the row; {skip}")
    return out


# ------------------------------------------------------------------------------------------ tokens


def template_generation(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks the assistant's text with {% generation %} blocks."""
    from composer.template_limits import template_text

    return bool(GENERATION.search(template_text(tokenizer)))


def assistant_tokens(tokenizer, messages: list[dict], kwargs: dict, stop_ids=()) -> tuple[list[int], list, str]:
    """(ids of the whole conversation, [start, end) of each assistant turn's trained tokens, how) under the chat
    template (see the module docstring); Problem when the turns cannot be located."""
    from composer.template_limits import assistant_mask, render

    stops = set(stop_ids)
    if template_generation(tokenizer) and getattr(tokenizer, "is_fast", False):
        # the template marks the assistant's text itself: transformers' return_assistant_tokens_mask
        how = "generation"
        ids, mask = assistant_mask(tokenizer, messages, kwargs)
    else:
        # no {% generation %} blocks: each assistant turn's characters, by rendering the conversation's prefixes
        how = "prefixes"
        full = render(tokenizer, messages, kwargs, add_generation_prompt=False)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(tokenizer, messages[:k], kwargs, add_generation_prompt=True)
            upto = render(tokenizer, messages[: k + 1], kwargs, add_generation_prompt=False)
            if not (upto.startswith(before) and full.startswith(upto) and len(upto) > len(before)):
                raise Problem(f"the chat template does not render the conversation up to message {k + 1} (assistant) "
                              "as the beginning of the whole conversation (it renders earlier turns differently), so "
                              "that turn's tokens cannot be located by rendering prefixes",
                              "give the template {% generation %} ... {% endgeneration %} around the assistant's "
                              "text (transformers' return_assistant_tokens_mask), or use another policy.tokenizer")
            spans.append((len(before), len(upto)))
        ids, mask = _char_mask(tokenizer, full, spans)
    runs, start = [], None
    for t, on in enumerate(list(mask) + [0]):
        if on and start is None:
            start = t
        elif not on and start is not None:
            runs.append((start, t))
            start = None
    out = []
    for s, e in runs:
        stop = next((t for t in range(s, e) if ids[t] in stops), None)
        if stop is not None:  # the turn's text and its end of turn; what the template writes after it is prompt
            e = stop + 1
        elif e < len(ids) and ids[e] in stops:  # a block that stops right before the end-of-turn token
            e += 1
        out.append((s, e))
    want = sum(m["role"] == "assistant" for m in messages)
    if len(out) != want:
        raise Problem(f"{want} assistant turn(s), but the chat template's rendering has {len(out)} run(s) of "
                      f"assistant tokens ({how})", "a template that renders every assistant message, each apart "
                      "from the next (e.g. with an end-of-turn token), is needed")
    return list(ids), out, how


def _char_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(ids of `text`, 1 on every token overlapping one of the character spans): a fast tokenizer's offsets (the
    rule transformers' return_assistant_tokens_mask applies); a slow one has none, so the text is encoded piece by
    piece between the span boundaries (the ids then hold each piece's tokens, joined)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    except (NotImplementedError, ValueError, TypeError, KeyError):
        ids, mask, at = [], [], 0
        for a, b in spans:
            for piece, on in ((text[at:a], 0), (text[a:b], 1)):
                if piece:
                    got = tokenizer.encode(piece, add_special_tokens=False)
                    ids += got
                    mask += [on] * len(got)
            at = b
        if text[at:]:
            got = tokenizer.encode(text[at:], add_special_tokens=False)
            ids += got
            mask += [0] * len(got)
        return ids, mask
    mask, k = [0] * len(ids), 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if e > spans[k][0] and e > s:
            mask[t] = 1
    return ids, mask


def trace(ctx, example):
    """The SFT row of a conversation: a Trace whose prompt is everything before the first assistant turn, then each
    assistant turn's tokens (origin demonstration) and the tokens between turns (origin prompt, no loss); tokens
    after the last turn's end are left out (nothing after them is trained)."""
    from composer.protocol import Trace

    conv = example.conversation
    if conv.ids is None:  # bound data is tokenized already (`bind`); an example made elsewhere: now
        d = getattr(ctx.spec, "data", None)
        conv.tokenize(ctx.tokenizer, dict(getattr(d, "chat_template_kwargs", None) or {}), ctx.stop_ids)
    ids, spans = conv.ids, conv.spans
    out = Trace(list(ids[: spans[0][0]]))
    for k, (s, e) in enumerate(spans):
        out.add(ids[s:e], "demonstration")
        if k + 1 < len(spans):
            out.add(ids[e: spans[k + 1][0]], "prompt")
    return out


def describe_example(example, fmt, spec) -> str:
    """The first conversation as the run renders it, its trained tokens between \u27e6 and \u27e7 (explain)."""
    from composer.stops import for_spec

    conv = example.conversation
    conv.tokenize(fmt.tokenizer, dict(fmt.kwargs), for_spec(fmt.tokenizer, spec).ids)
    tok, ids, out, at = fmt.tokenizer, conv.ids, [], 0
    for s, e in conv.spans:
        out += [tok.decode(ids[at:s]), "\u27e6", tok.decode(ids[s:e]), "\u27e7"]
        at = e
    out.append(tok.decode(ids[at:]))
    return "".join(out)


# ------------------------------------------------------------------------------------------ what applies


def settings_problem(d) -> tuple[str, str] | None:
    """(setting, why) of a data setting that does not apply to messages rows (they carry their own turns)."""
    if d.prompt_template != "{prompt}":
        return "prompt_template", ("data.prompt_template fills a prompt row's text into a user message; messages rows "
                                   "carry their own turns")
    if d.system_prompt is not None:
        return "system_prompt", ("data.system_prompt is the system turn of prompt rows; messages rows carry their own "
                                 "(a system message in the row)")
    if d.prompt_format == "plain":
        return "prompt_format", "messages rows are rendered with the chat template; data.prompt_format plain has none"
    return None


def spec_problem(spec) -> str | None:
    """Why `spec` (one segment) cannot train on messages rows: only SFT on a reference target trains on them."""
    from composer.checks.graph import signal_objective_pairs

    for sig, _obj in signal_objective_pairs(spec):
        kind = getattr(sig, "kind", None)
        if kind != "sft" or getattr(sig, "target", None) in ("guided", "rollouts"):
            what = f"signal '{kind}'" + (f" with target {sig.target}" if kind == "sft" else "")
            return (f"messages rows (conversations) are SFT data: SFT trains their assistant turns, but this spec's "
                    f"{what} needs prompt rows (prompt, answer fields)")
    return None


# ------------------------------------------------------------------------------------------ OpenRLHF


def openrlhf_trained(tokenizer, messages: list[dict]) -> tuple[list[int], set[int]]:
    """(ids, positions of the tokens trained) of one conversation as OpenRLHF 0.11.2's multiturn SFT trains it
    (openrlhf/datasets/sft_dataset.py: `process_data` with multiturn, `__getitem__`, `get_loss_mask`; the trainer's
    shifted mask, sft_trainer.py), with no truncation: per assistant turn k, the tokens of
    render(messages[:k + 1])[len(render(messages[:k], add_generation_prompt)):], counted by tokenizing that prompt and
    that response apart; the text trained on is the whole rendering with trailing newlines stripped and ' ' + eos
    appended when it does not end with eos, whose last id is set to eos."""
    def apply(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def count(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    ranges = []
    for idx, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = apply(messages[:idx], True)
            response = apply(messages[: idx + 1])[len(prompt):]
            start = count(prompt)
            ranges.append((start, start + count(response) - 1))
    prompt = apply(messages[:-1], True)
    response = apply(messages)[len(prompt):]
    text = (prompt + response).rstrip("\n")
    eos = tokenizer.eos_token
    if not text.endswith(eos):
        text += " " + eos
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids[-1] = tokenizer.eos_token_id
    mask = [0] * len(ids)
    for s, e in ranges:
        for j in range(max(s - 1, 0), min(e, len(ids))):
            mask[j] = 1
    return ids, {j + 1 for j in range(len(ids) - 1) if mask[j]}


def openrlhf_difference(tokenizer, conv: Conversation) -> str | None:
    """How OpenRLHF's multiturn SFT would train this conversation differently from the composer (None: the same
    tokens, the same ids): its extra and missing trained tokens, shown as text."""
    ids, theirs = openrlhf_trained(tokenizer, conv.messages)
    ours = {t for s, e in conv.spans for t in range(s, e)}
    end = max(ours | theirs) + 1  # the same trained tokens after the same context: the same loss
    if theirs == ours and ids[:end] == conv.ids[:end]:
        return None
    extra = sorted(t for t in theirs - ours if t < len(ids))
    missing = sorted(ours - theirs)

    def show(ts, seq):
        return ", ".join(repr(tokenizer.decode([seq[t]])) for t in ts[:4] if t < len(seq)) + (" ..." if len(ts) > 4 else "")

    parts = []
    if extra:
        parts.append(f"it also trains {len(extra)} token(s) that are not the assistant's ({show(extra, ids)})")
    if missing:
        parts.append(f"it leaves out {len(missing)} assistant token(s) ({show(missing, conv.ids)})")
    if not parts:
        parts.append("it tokenizes the conversation differently (its text has trailing newlines stripped and an "
                     "eos appended)")
    return "; ".join(parts)
