"""The stop tokens of a model: the token ids that end a response (issue 56).

Many instruct models end a turn with a token that is not their tokenizer's eos, and list both in
`generation_config.eos_token_id` (Llama-3-Instruct: `<|end_of_text|>` and `<|eot_id|>`; Gemma-IT: `<eos>` and
`<end_of_turn>`). The stop tokens are the union of

  * the tokenizer's eos,
  * `eos_token_id` of generation_config.json in the model folder (an int or a list),
  * the chat template's end of turn, when prompts are rendered with the chat template: the special token the
    template writes right after an assistant message (`end_of_turn`).

Every engine stops a response at the first of them, which is kept as its last token (tokens after it are never
scored, trained or decoded); a response that ends in one of them is finished. A target the run writes itself (an
SFT demonstration) ends with `end`: the template's end of turn under chat prompts, else the tokenizer's eos.

Computed once per tokenizer: a run `bind`s its policy's (model folder and prompt format known); `of` returns the
bound ones, or for a tokenizer nothing bound (a judge's, a test's) computes them from its own folder, the chat
template counting when it has one. No torch at import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ATTR = "composer_stop_tokens"  # where `bind` keeps a tokenizer's stop tokens
PROBE = "Zq7ProbeOfTheEndOfTurn"  # an assistant message's text, found again in the rendered conversation


@dataclass(frozen=True)
class StopTokens:
    """ids: every id that ends a response (tokenizer eos first); end: the id a written target ends with;
    names: each id's text; why: where each id comes from."""

    ids: tuple[int, ...]
    end: int | None
    names: tuple[str, ...] = ()
    why: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for explain and a run's log: every stop token with its text and origin, and the end token."""
        if not self.ids:
            return "none (the tokenizer has no eos): responses end at max_new_tokens"
        each = ", ".join(f"{i} {n!r} ({w})" for i, n, w in zip(self.ids, self.names, self.why))
        return f"{each}; targets end with {self.end}"

    def first(self, tokens) -> int | None:
        """The index of the first stop token in `tokens`, or None."""
        stops = set(self.ids)
        return next((k for k, t in enumerate(tokens) if t in stops), None)

    def cut(self, tokens) -> tuple[list[int], bool]:
        """(`tokens` up to and including their first stop token, whether there was one)."""
        k = self.first(tokens)
        return (list(tokens), False) if k is None else (list(tokens[: k + 1]), True)


def _generation_config(model) -> Path | None:
    """generation_config.json of `model`: in its folder, or a hub id's copy already in the local cache."""
    if not model:
        return None
    path = Path(str(model)) / "generation_config.json"
    if path.is_file() or Path(str(model)).is_dir():
        return path if path.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), "generation_config.json")
    except Exception:  # noqa: BLE001 - not a hub id, no hub client: no generation_config
        return None
    return Path(cached) if isinstance(cached, str) else None


def generation_eos(model) -> list[int]:
    """`eos_token_id` of `model`'s generation_config.json (an int or a list; [] when absent or unreadable)."""
    path = _generation_config(model)
    try:
        value = json.loads(path.read_text()).get("eos_token_id") if path is not None else None
    except (OSError, ValueError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: the named ones and every added token marked special."""
    out = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out |= {i for i, t in added.items() if getattr(t, "special", False)}
    return out


def end_of_turn(tokenizer, kwargs: dict | None = None) -> int | None:
    """The special token the chat template writes after an assistant message: a one-turn conversation is rendered
    with a probe as the assistant's text, and the first token after the probe is read, past whitespace. None when
    the tokenizer has no chat template, the template fails or drops the probe, or plain text follows it."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    from composer.template_limits import render

    messages = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": PROBE}]
    try:
        text = render(tokenizer, messages, dict(kwargs or {}), add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template refusing this conversation: no end of turn known
        return None
    if not isinstance(text, str) or PROBE not in text:
        return None
    special = _special_ids(tokenizer)
    for i in tokenizer.encode(text[text.rindex(PROBE) + len(PROBE):], add_special_tokens=False):
        if i in special:
            return i
        if tokenizer.decode([i]).strip():  # text before any special token: the turn ends in plain text
            return None
    return None


def stop_tokens(tokenizer, model_dir=None, chat: bool = False, kwargs: dict | None = None) -> StopTokens:
    """The stop tokens of `tokenizer` with the model in `model_dir` (its generation_config; without one there, the
    tokenizer folder's); `chat`:
    prompts are rendered with the chat template (`kwargs`: data.chat_template_kwargs), so its end of turn is one."""
    generation = (generation_eos(model_dir) if model_dir is not None else []) or \
        generation_eos(getattr(tokenizer, "name_or_path", None))  # no model folder here: the tokenizer's
    eos = getattr(tokenizer, "eos_token_id", None)
    turn = end_of_turn(tokenizer, kwargs) if chat else None
    found: dict[int, list[str]] = {}
    for i, why in ([(eos, "tokenizer eos")] + [(g, "generation_config") for g in generation]
                   + [(turn, "chat template end of turn")]):
        if i is not None:
            found.setdefault(int(i), []).append(why)
    ids = tuple(found)
    names = tuple(_name(tokenizer, i) for i in ids)
    return StopTokens(ids, turn if turn is not None else eos, names, tuple(", ".join(w) for w in found.values()))


def _name(tokenizer, i: int) -> str:
    """The token's text ('?' for an id the tokenizer does not have)."""
    try:
        return tokenizer.convert_ids_to_tokens(i) or "?"
    except (AttributeError, IndexError, OverflowError, TypeError, ValueError):
        return "?"


def bind(tokenizer, model_dir=None, chat: bool = False, kwargs: dict | None = None) -> StopTokens:
    """Compute `tokenizer`'s stop tokens for a run (its policy's model folder, its prompt format) and keep them on
    the tokenizer, where every engine and component reads them (`of`)."""
    stops = stop_tokens(tokenizer, model_dir, chat, kwargs)
    try:
        setattr(tokenizer, ATTR, stops)
    except (AttributeError, TypeError):  # a tokenizer object that takes no attributes: computed again next time
        pass
    return stops


def for_spec(tokenizer, spec, again: bool = True) -> StopTokens:
    """`bind` for a run of `spec`: its policy's model folder (when it is one; else the tokenizer's own), and its
    prompts' format (chat: data.prompt_format chat, or auto with a chat template). `again` False: keep stop tokens
    a run bound already (a RunContext built after the run's start)."""
    if not again and isinstance(getattr(tokenizer, ATTR, None), StopTokens):
        return getattr(tokenizer, ATTR)
    d = getattr(spec, "data", None)
    chat = (d is not None and getattr(d, "train", None) is not None and getattr(d, "prompt_format", "auto") != "plain"
            and bool(getattr(tokenizer, "chat_template", None)))
    model = getattr(getattr(spec, "policy", None), "model", None)
    folder = model if model and not str(model).startswith("toy:") else None
    return bind(tokenizer, folder, chat, getattr(d, "chat_template_kwargs", None) if chat else None)


def of(tokenizer) -> StopTokens:
    """The stop tokens `bind` kept on `tokenizer`; for one nothing bound, computed (once) from its own folder, its
    chat template counting when it has one."""
    if tokenizer is None:
        return StopTokens((), None)
    stops = getattr(tokenizer, ATTR, None)
    if not isinstance(stops, StopTokens):
        stops = bind(tokenizer, None, bool(getattr(tokenizer, "chat_template", None)))
    return stops
