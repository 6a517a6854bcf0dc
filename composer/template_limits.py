"""Chat templates are code from a model folder (or a spec): rendered with limits on time and output size.

A template is Jinja run in transformers' sandbox, which stops attribute escapes but not cost: a nested
`range` loop runs for hours, `'x' * 10**10` takes gigabytes. Here every render
  * stops after `SECONDS` of wall-clock time (a trace function checks the deadline while Python runs the
    compiled template, which is Python code);
  * refuses an operation whose result would exceed `MAX_CHARS` before it is computed (`*`, `**`, `%`, `+`,
    and calls given a number above the limit, such as `'x'.center(10**9)`), and any output above it.
`chat_template_kwargs` may only set variables the template reads (never `chat_template`, `tools` or any other
argument of `apply_chat_template`): a key the template does not read would be silently ignored or, worse,
replace the template.
"""

from __future__ import annotations

import re
import sys
import threading
import time

SECONDS = 10.0  # one prompt's render
MAX_CHARS = 1 << 20  # one prompt's text, and any string or list a template builds
# apply_chat_template's own arguments and what the renderer passes itself: never a spec's template variable
RESERVED = frozenset({"chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools", "documents",
                      "conversation", "messages", "add_generation_prompt", "continue_final_message"})
_WIDE = re.compile(r"\d{7,}")  # a width or precision in a format string large enough to allocate megabytes
_INSTALLED = {"done": False}
_LOCK = threading.Lock()


class TemplateLimitError(ValueError):
    """A chat template that exceeds its time or size limit, or a variable it does not read."""


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


def _guard_int(n) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_CHARS:
        raise TemplateLimitError(f"the chat template uses the number {n} (above the limit of {MAX_CHARS})")


def _safe_env_class(base):
    class LimitedEnvironment(base):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int) and _size(seq) * max(n, 0) > MAX_CHARS:
                        raise TemplateLimitError("the chat template builds a text above the size limit")
            elif operator == "**":
                if isinstance(right, int) and isinstance(left, (int, float)) and abs(right) > 64 and abs(left) > 1:
                    raise TemplateLimitError("the chat template computes a number too large")
            elif operator == "%":
                if isinstance(left, str) and _WIDE.search(left):
                    raise TemplateLimitError("the chat template formats a text above the size limit")
            elif operator == "+":
                if _size(left) + _size(right) > MAX_CHARS:
                    raise TemplateLimitError("the chat template builds a text above the size limit")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            for a in (*args, *kwargs.values()):
                _guard_int(a)
            if getattr(__obj, "__name__", "") in ("format", "format_map") and isinstance(
                    getattr(__obj, "__self__", None), str) and _WIDE.search(__obj.__self__):
                raise TemplateLimitError("the chat template formats a text above the size limit")
            out = super().call(__context, __obj, *args, **kwargs)
            if _size(out) > MAX_CHARS:
                raise TemplateLimitError("the chat template builds a text above the size limit")
            return out

    return LimitedEnvironment


def install() -> None:
    """transformers' chat-template environment becomes the limited one (compiled templates are recompiled)."""
    with _LOCK:
        if _INSTALLED["done"]:
            return
        from transformers.utils import chat_template_utils as ctu

        base = ctu.ImmutableSandboxedEnvironment
        ctu.ImmutableSandboxedEnvironment = _safe_env_class(base)
        ctu._compile_jinja_template.cache_clear()
        _INSTALLED["done"] = True


def template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), "")
    return t if isinstance(t, str) else ""


def template_variables(template: str) -> set[str]:
    """The variables a template reads (undeclared names, Jinja's own analysis)."""
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = _safe_env_class(ImmutableSandboxedEnvironment)()  # the analysis folds constants: never `'x' * 10**10`
    try:
        return set(meta.find_undeclared_variables(env.parse(template)))
    except (jinja2.TemplateError, TemplateLimitError):
        return set()


def kwargs_problem(tokenizer, kwargs: dict) -> str | None:
    """Why `data.chat_template_kwargs` cannot be used with this tokenizer's template (None: fine)."""
    reserved = sorted(k for k in kwargs if k in RESERVED)
    if reserved:
        return (f"data.chat_template_kwargs sets {', '.join(reserved)}, an argument of apply_chat_template, not "
                "a template variable")
    readable = template_variables(template_text(tokenizer)) - RESERVED
    unread = sorted(k for k in kwargs if k not in readable)
    if unread:
        return (f"data.chat_template_kwargs sets {', '.join(unread)}, which the chat template does not read "
                f"(its variables: {', '.join(sorted(readable)) or 'none'})")
    return None


class _Limits:
    """The time limit of one render (a trace function checks the deadline while the compiled template runs)."""

    def __enter__(self):
        install()
        deadline = time.monotonic() + SECONDS
        count = [0]

        def tracer(frame, event, arg):
            count[0] += 1
            if count[0] & 255 == 0 and time.monotonic() > deadline:
                raise TemplateLimitError(f"the chat template took more than {SECONDS:g}s to render one prompt")
            return tracer

        self.old = sys.gettrace()
        sys.settrace(tracer)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.old)
        return False


def render(tokenizer, messages: list, kwargs: dict, add_generation_prompt: bool = True) -> str:
    """apply_chat_template(messages, add_generation_prompt) under the time and size limits (a finished conversation,
    e.g. a reward model's input: add_generation_prompt False)."""
    with _Limits():
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    if isinstance(text, str) and len(text) > MAX_CHARS:
        raise TemplateLimitError(f"the chat template rendered {len(text)} characters (limit {MAX_CHARS})")
    return text


def assistant_mask(tokenizer, messages: list, kwargs: dict) -> tuple[list[int], list[int]]:
    """(ids, mask) of a finished conversation under the time and size limits: transformers' apply_chat_template with
    return_assistant_tokens_mask (1 on the tokens the template's {% generation %} blocks render), for a template
    that has such blocks (composer/conversations.py)."""
    with _Limits():
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
        if isinstance(text, str) and len(text) > MAX_CHARS:
            raise TemplateLimitError(f"the chat template rendered {len(text)} characters (limit {MAX_CHARS})")
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=False,
                                            return_assistant_tokens_mask=True, **kwargs)
    return list(out["input_ids"]), list(out["assistant_masks"])
