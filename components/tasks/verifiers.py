"""Built-in verifiers: `toy`, `exact`, `math`. Light imports only (validation imports this file)."""

from __future__ import annotations

import re
import threading

from composer.data import Example, Verdict
from composer.registry import register_verifier


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced


def after_hash(text: str) -> str | None:
    """The rest of the line after the last '#', None if there is no '#'."""
    k = text.rfind("#")
    return None if k < 0 else text[k + 1 :].split("\n")[0]


def final_answer(text: str) -> str:
    """The response's final answer: after the last '#', else the last \\boxed{}, else the whole text."""
    for extract in (after_hash, last_boxed):
        found = extract(text)
        if found is not None:
            return found
    return text


def normalise(s: str) -> str:
    """Strip, collapse whitespace, lowercase, drop trailing periods."""
    return " ".join(s.split()).lower().rstrip(".").strip()


@register_verifier("toy", "Toy testbed: reward 1 iff the response's last non-empty line is `#<answer>`.")
def toy_verifier(response: str, example: Example) -> Verdict:
    """Reward 1.0 iff the last non-empty line is `#<answer>`; parsed=False without any `#N` line."""
    lines = [ln.strip() for ln in response.split("\n") if ln.strip()]
    if not any(re.fullmatch(r"#\s*\S+", ln) for ln in lines):
        return Verdict(0.0, parsed=False, detail="no final answer line (#N)")
    if lines[-1] == f"#{example.answer.strip()}":
        return Verdict(1.0)
    if not lines[-1].startswith("#"):
        return Verdict(0.0, detail="the response does not end with the final answer line")
    return Verdict(0.0, detail="the final answer is wrong")


@register_verifier(
    "exact", "Normalised exact match of the final answer (after '#', in \\boxed{}, or the whole response)."
)
def exact_verifier(response: str, example: Example) -> Verdict:
    """Normalised string equality of the extracted final answer with `example.answer`."""
    pred = normalise(final_answer(response))
    if not pred:
        return Verdict(0.0, parsed=False, detail="empty final answer")
    ok = pred == normalise(example.answer)
    return Verdict(float(ok), detail="" if ok else "the final answer is wrong")


@register_verifier("math", "math-verify equivalence of the final (\\boxed{}) answer with the reference answer.")
def math_verifier(response: str, example: Example) -> Verdict:
    """Symbolic equivalence via math_verify; parsed=False when the answer cannot be parsed."""
    from math_verify import parse, verify

    # math_verify's timeouts use signals, which only work in the main thread
    main = threading.current_thread() is threading.main_thread()
    kw = {} if main else {"parsing_timeout": None}
    gold = parse(f"${example.answer}$", **kw) or parse(example.answer, **kw)
    pred = parse(response, **kw)
    if not pred and after_hash(response) is not None:
        pred = parse(after_hash(response), **kw)
    if not pred:
        return Verdict(0.0, parsed=False, detail="could not parse a final answer")
    if not gold:
        return Verdict(0.0, parsed=False, detail=f"could not parse the reference answer {example.answer!r}")
    ok = verify(gold, pred, **({} if main else {"timeout_seconds": None}))
    return Verdict(float(ok), detail="" if ok else "the final answer is wrong")
