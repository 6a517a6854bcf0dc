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


def answer_line(text: str) -> str | None:
    """The answer of a last non-empty line written `#<answer>` (not a markdown heading `## ...`), else None."""
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    m = re.fullmatch(r"#\s*([^#\s].*)", lines[-1]) if lines else None
    return m.group(1).strip() if m else None


# the number may end a sentence (`#### 18.`): a period, comma or slash after it ends the answer unless a digit
# follows (`#### 1.2.3` is no number)
GSM8K_LINE = re.compile(r"^[ \t]*####[ \t]*\$?[ \t]*([-+]?\d(?:,?\d)*(?:\.\d+)?(?:/\d+)?)(?!\d|[,./]\d)", re.MULTILINE)


def gsm8k_answer(text: str) -> str | None:
    """The number of the last line written `#### <number>` (GSM8K's answer format; thousands commas and a
    leading `$` dropped), else None. `#### Step 3` (a markdown heading) is no answer."""
    found = GSM8K_LINE.findall(text)
    return re.sub(r"(?<=\d),(?=\d)", "", found[-1]) if found else None


def reference_answer(answer: str) -> str:
    """A row's reference answer as the verifier compares it: GSM8K's own `answer` column (a worked solution
    ending `#### 46`) gives 46; any other answer is itself."""
    return gsm8k_answer(answer) or answer


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


def toy_answer_problem(example: Example) -> str | None:
    """Why a row's answer is not a toy answer (one word), or None."""
    answer = example.answer.strip()
    return None if answer and not any(c.isspace() for c in answer) else "not a toy answer"


def exact_answer_problem(example: Example) -> str | None:
    return None if normalise(example.answer) else "empty answer"


def math_answer_problem(example: Example) -> str | None:
    """Why math_verify cannot parse a row's answer (only its raw-string fallback matches), or None."""
    from math_verify import parse

    answer = reference_answer(example.answer)
    kw = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
    found = parse(f"${answer}$", **kw) or parse(answer, **kw)
    if not any(not isinstance(x, str) for x in found):  # only the raw-string fallback: nothing parsed
        return f"math_verify cannot parse the answer {answer!r}"
    return None


@register_verifier("toy", "Toy testbed: reward 1 iff the response's last non-empty line is `#<answer>`.",
                   check="toy_answer_problem")
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
    "exact", "Normalised exact match of the final answer (after '#', in \\boxed{}, or the whole response).",
    check="exact_answer_problem")
def exact_verifier(response: str, example: Example) -> Verdict:
    """Normalised string equality of the extracted final answer with `example.answer`."""
    pred = normalise(final_answer(response))
    if not pred:
        return Verdict(0.0, parsed=False, detail="empty final answer")
    ok = pred == normalise(example.answer)
    return Verdict(float(ok), detail="" if ok else "the final answer is wrong", answer=pred)


@register_verifier("math", "math-verify equivalence of the final answer with the reference answer: the last \\boxed{} "
                           "when the response has one (only that one), else GSM8K's `#### <number>` line, else a `#` answer line, else an answer math-verify "
                           "finds after an anchor (\"the final answer is ...\"); never the last number of free text.",
                   check="math_answer_problem")
def math_verifier(response: str, example: Example) -> Verdict:
    """Symbolic equivalence (math_verify) of the response's final answer with `example.answer`.

    What counts as the final answer, in order: the content of the last \\boxed{} when the response has a box
    (earlier boxes, e.g. an echo of the prompt's instruction, are ignored; an empty or unbalanced last box is
    no answer); else the number of the last GSM8K answer line `#### 46`; else the answer of a last line written `#<answer>`; else what math-verify's LaTeX and expression
    extraction finds *after an anchor* (`try_extract_without_anchor=False`: "the final answer is 12", "answer:
    12"), with no fallback. A number scattered in free text is never taken for an answer. The parsed answer
    is in `Verdict.answer` (samples.jsonl and eval_samples.jsonl show it); parsed=False when there is none.
    A reference answer that is GSM8K's worked solution (`... #### 46`) is compared by its `####` number."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math_verify's timeouts use signals, which only work in the main thread
    main = threading.current_thread() is threading.main_thread()
    kw = {} if main else {"parsing_timeout": None}
    reference = reference_answer(example.answer)
    gold = parse(f"${reference}$", **kw) or parse(reference, **kw)
    strict = [LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=0),
              ExprExtractionConfig(try_extract_without_anchor=False)]
    if "\\boxed" in response:
        boxed = last_boxed(response)
        text = None if boxed is None or not boxed.strip() else boxed
        pred = parse(f"\\boxed{{{text}}}", extraction_config=strict, fallback_mode="no_fallback", **kw) \
            if text is not None else []
        if not pred and text is not None:  # a bare expression in the box (e.g. 3/4, x+1)
            pred = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                         fallback_mode="no_fallback", **kw)
        where = "the last \\boxed{}"
    elif gsm8k_answer(response) is not None:  # GSM8K's `#### 46`, as a model trained on GSM8K writes it
        text = gsm8k_answer(response)
        pred = parse(text, extraction_config=[ExprExtractionConfig()], fallback_mode="no_fallback", **kw)
        where = "the '####' answer line"
    elif answer_line(response) is not None:
        text = answer_line(response)
        pred = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                     fallback_mode="no_fallback", **kw)
        where = "the '#' answer line"
    else:
        text = None
        pred = parse(response, extraction_config=strict, fallback_mode="no_fallback", **kw)
        where = "an answer after an anchor (\"the final answer is\")"
    pred = [p for p in pred if not isinstance(p, str)] and pred
    if not pred:
        found = "an empty or unbalanced last \\boxed{}" if "\\boxed" in response else "no \\boxed{}, no '####' or '#' line"
        return Verdict(0.0, parsed=False, detail=f"could not parse a final answer ({found}; looked for {where})")
    answer = str(pred[-1]) if text is None else text.strip()
    if not gold:
        return Verdict(0.0, parsed=False, detail=f"could not parse the reference answer {example.answer!r}",
                       answer=answer)
    ok = verify(gold, pred, **({} if main else {"timeout_seconds": None}))
    return Verdict(float(ok), detail="" if ok else f"the final answer is wrong (read {answer!r} from {where})",
                   answer=answer)
