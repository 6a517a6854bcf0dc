"""Prompts: the one place prompt text is rendered, for the policy and for the models that read privileged
context (teachers, judges and the judge's correction).

Rendering (`PromptFormat`, from the spec's `data` settings and a tokenizer): a data row's text is put into
`data.prompt_template` (the user message), then, with `data.prompt_format` chat (auto: when the tokenizer
has a chat template), into the tokenizer's chat template with `data.system_prompt` as the system message and
add_generation_prompt; plain: the user message as it is, after the system prompt and a blank line. The
result is tokenized once, with no special tokens added (`RunContext.encode`), and the response tokens are
appended to those ids, so the response starts right after the generation prompt. The policy's prompts are
rendered once when the data is bound (`render_task`: `Example.prompt`; evaluation, samples.jsonl and the
OpenRLHF bundle's data read that text); a teacher's or judge's prompt puts its privileged context and the
question into the user message and is rendered the same way (`PromptFormat.wrap`). The toy testbed keeps
its own prompts (mode `task`: nothing is added).

Every context a policy_model source declares is placed in the text it is given, or the run stops
before training naming the source, the template and the context (`check_placement`). Templates, in
order of precedence: the source's own `template`; the task's (toy testbed: one line per context kind
before the question); the published ones (OPSD with a reference solution, SDPO with a sibling success
and/or feedback); a generic composition of all of them. No torch at import, nothing from the runtime (`runtime/binding.policy_format` loads a
tokenizer).
"""

from __future__ import annotations

# The published teacher prompts (ALGORITHMS.md sections 4 and 5).
OPSD_TEMPLATE = (
    "{problem}\n\nHere is a reference solution to this problem:\n{solution}\n\n\nAfter understanding the reference "
    "solution and the rationale behind each step, now articulate your own step-by-step reasoning that derives the "
    "same final answer to the problem below:\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
)
SDPO_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."
SDPO_SOLUTION = "\nCorrect solution:\n\n{text}\n"
SDPO_FEEDBACK = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{text}\n"
# Generic blocks for combinations no paper wrote a prompt for, placed before the problem.
GENERIC_CONTEXT = {
    "reference_solution": "Here is a reference solution to this problem:\n{text}\n\n",
    "sibling_success": "Here is a correct solution to this problem:\n{text}\n\n",
    "feedback": "The following is feedback on an earlier, unsuccessful attempt:\n{text}\n\n",
}
# The judge's verdict prompt for tasks without their own: it answers KEEP or REVISE k (first line).
JUDGE_TEMPLATE = (
    "{context}Problem:\n{problem}\n\nSteps accepted so far:\n{accepted}\n\nNew steps to review:\n{steps}\n\n"
    "If every new step is correct, answer KEEP. Otherwise answer REVISE k, where k is the number of the first "
    "wrong new step. Answer on one line.\n"
)
# InT's proposal prompt for tasks without their own (Yang et al. 2026, arXiv 2601.14209, pipeline step 2): the
# failed attempt in numbered steps, the reference (context) and the gold answer; one answer holds the
# verification, the first critical error and the intervention (components/guides/judges.py parse_proposal).
PROPOSAL_TEMPLATE = (
    "{context}Problem:\n{problem}\n\nThe correct final answer: {answer}\n\nAn incorrect attempt, in numbered "
    "steps:\n{steps}\n\nVerify the attempt step by step. Find its first critical error: a factual or logical "
    "error that is never recovered from later. Then write one intervention step, from the student's "
    "perspective, to replace that step; it must not reveal the final answer. Write your verification first, "
    "then a line REVISE k (k: the number of the step with the first critical error), then the intervention.\n"
)
TEMPLATE_FIELDS = {"teacher": ("problem", "prompt"), "judge": ("problem", "prompt", "accepted", "steps")}


# ------------------------------------------------------------------------------------------- rendering


class PromptFormatError(ValueError):
    """The spec's prompt format cannot be rendered with this tokenizer (raised when the tokenizer loads)."""


class PromptFormat:
    """How a problem becomes the text a model is prompted with (see the module docstring).

    mode: `task` (the toy testbed: the task's own prompt, nothing added), `plain` or `chat`. bos (plain only):
    the BOS token's text, put first in every prompt, when the tokenizer adds one on its own (prompts are
    tokenised with no special tokens added; a chat template writes its own BOS, as `apply_chat_template` has
    it). controls: the tokenizer's control-token strings,
    which a row's text may not hold (composer/checks/data.py `screen_task`)."""

    def __init__(self, mode: str = "task", tokenizer=None, system: str | None = None, template: str = "{prompt}",
                 kwargs: dict | None = None, asked: str = "auto", tokenizer_name: str = "", bos: str = "",
                 controls: tuple[str, ...] = ()):
        self.mode, self.tokenizer, self.system, self.template = mode, tokenizer, system, template
        self.kwargs, self.asked, self.tokenizer_name = dict(kwargs or {}), asked, tokenizer_name
        self.bos, self.controls = bos, tuple(controls)

    def user(self, example) -> str:
        """The policy's user message for `example`: the prompt template filled with its problem text (task
        mode: the task's own prompt)."""
        if self.mode == "task":
            return example.prompt
        return _format(self.template, prompt=example.problem)

    def wrap(self, user: str) -> str:
        """The full prompt text around a user message (chat: system turn, user turn, generation prompt)."""
        if self.mode == "task":
            return user
        if self.mode == "plain":
            return self._with_bos((f"{self.system}\n\n" if self.system is not None else "") + user)
        messages = ([{"role": "system", "content": self.system}] if self.system is not None else []) + \
            [{"role": "user", "content": user}]
        from composer.template_limits import TemplateLimitError, render

        try:  # the template is code from a model folder: rendered with time and size limits
            text = render(self.tokenizer, messages, self.kwargs)
        except TemplateLimitError as e:
            raise PromptFormatError(f"{self.tokenizer_name or 'the policy tokenizer'}: {e}; use data.prompt_format: "
                                    "plain, or a tokenizer with another chat template") from None
        if not isinstance(text, str):
            raise PromptFormatError(f"the chat template of {self.tokenizer_name or 'the tokenizer'} did not render "
                                    f"text (apply_chat_template returned {type(text).__name__})")
        return text

    def _with_bos(self, text: str) -> str:
        """`text` with the BOS first, as the tokenizer would add it (once)."""
        return text if not self.bos or text.startswith(self.bos) else self.bos + text

    def prompt(self, example) -> str:
        """The policy's prompt text for `example`."""
        return self.wrap(self.user(example))

    def check(self) -> PromptFormat:
        """Render a probe now, so that a template that fails (a system turn it refuses, a variable it needs)
        stops the run before training, naming the setting."""
        probe = "\u27e6the problem\u27e7"
        where = f"the chat template of {self.tokenizer_name or 'the policy tokenizer'}"
        from composer.template_limits import kwargs_problem

        why = kwargs_problem(self.tokenizer, self.kwargs) if self.kwargs else None
        if why:
            raise PromptFormatError(f"{why}; {where} would ignore it or be replaced by it")
        try:
            text = self.wrap(probe)
        except PromptFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors, a template raising on a role
            first = (str(e).strip().splitlines() or [""])[0]
            what = " with data.system_prompt" if self.system is not None else ""
            raise PromptFormatError(f"data.prompt_format {self.asked}: {where} does not render a prompt{what} "
                                    f"({type(e).__name__}: {first}); set data.prompt_format: plain, drop "
                                    "data.system_prompt, or give policy.tokenizer one whose template does") from None
        if probe not in text:
            raise PromptFormatError(f"data.prompt_format {self.asked}: {where} leaves out the user message")
        if self.system is not None and self.system not in text:
            raise PromptFormatError(f"data.prompt_format {self.asked}: {where} leaves out data.system_prompt (the "
                                    "template has no system turn); drop it, or use prompt_format: plain")
        return self

    def describe(self) -> str:
        """One line for explain and the bundle's README."""
        if self.mode == "task":
            return "the toy testbed's own prompts: no chat template, nothing added"
        how = (f"chat: the chat template of {self.tokenizer_name or 'the policy tokenizer'}, add_generation_prompt"
               + (f", {self.kwargs}" if self.kwargs else "")) if self.mode == "chat" else \
            "plain: the text as it is, no chat template"
        asked = f"data.prompt_format {self.asked} -> " if self.asked == "auto" else "data.prompt_format "
        sys_ = "none" if self.system is None else repr(self.system)
        bos = f"; BOS {self.bos!r} first, as the tokenizer adds it" if self.bos else ""
        return f"{asked}{how}; system prompt: {sys_}; user message: {self.template!r}{bos}"

    def to_json(self) -> dict:
        return {"mode": self.mode, "asked": self.asked, "tokenizer": self.tokenizer_name, "system_prompt": self.system,
                "prompt_template": self.template, "chat_template_kwargs": self.kwargs, "bos": self.bos}


TASK_FORMAT = PromptFormat("task")


def prompt_format(data, tokenizer, tokenizer_name: str = "") -> PromptFormat:
    """The format `data` (a spec's data section) asks for, with `tokenizer`; PromptFormatError when it cannot
    render (chat without a chat template, a template that fails on the system prompt)."""
    if data is None or data.train is None:
        return TASK_FORMAT
    has_template = bool(getattr(tokenizer, "chat_template", None)) if tokenizer is not None else False
    mode = data.prompt_format
    if mode == "auto":
        mode = "chat" if has_template else "plain"
    if mode == "chat" and not has_template:
        raise PromptFormatError(f"data.prompt_format is chat, but the tokenizer {tokenizer_name or '(policy)'} has no "
                                "chat template; use prompt_format: plain (or auto), or give policy.tokenizer a "
                                "tokenizer that has one")
    fmt = PromptFormat(mode, tokenizer if mode == "chat" else None, data.system_prompt, data.prompt_template,
                       data.chat_template_kwargs, data.prompt_format, tokenizer_name,
                       added_bos(tokenizer) if mode == "plain" else "", control_tokens(tokenizer, tokenizer_name))
    return fmt.check() if mode == "chat" else fmt


def added_bos(tokenizer) -> str:
    """The BOS token's text when `tokenizer` puts a BOS first on its own (`add_special_tokens=True`) and that
    text encodes to it; "" otherwise (no tokenizer, no BOS, or one the tokenizer does not add)."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None or not hasattr(tokenizer, "encode"):
        return ""
    try:
        with_, without = (tokenizer.encode("x", add_special_tokens=on)[:1] for on in (True, False))
        adds = with_ == [bos_id] and without != [bos_id]
        return bos if adds and tokenizer.encode(bos, add_special_tokens=False) == [bos_id] else ""
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode a probe: nothing added
        return ""


def control_tokens(tokenizer, name: str = "") -> tuple[str, ...]:
    """The strings `tokenizer` reads as one control token inside text: its special tokens, and its added
    tokens written as markup (`<think>`, `[INST]`); the toy tokenizer's (`name` toy:..., never loaded for
    prompts); () without a tokenizer."""
    if tokenizer is None and name.startswith("toy:"):
        from composer.registry import part

        return tuple(part("toy.specials"))
    if tokenizer is None:
        return ()
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if is_control(getattr(tok, "content", ""), getattr(tok, "special", False)):
            found.add(tok.content)
    return tuple(sorted(t for t in found if is_control(t, True)))


def is_control(text, special: bool) -> bool:
    """Whether an added token `text` is a control token: a special one, or one written as markup (`<think>`);
    a one-character or blank token is never counted (it would refuse ordinary text)."""
    if not isinstance(text, str) or len(text.strip()) < 2:
        return False
    return special or (text[:1] in "<[" and text[-1:] in ">]")


def render_task(task, fmt: PromptFormat) -> None:
    """Every example's `prompt` becomes the rendered prompt of its `problem` (the row's text), in place; the
    task keeps the format (`task.prompt_format`)."""
    task.prompt_format = fmt
    if fmt.mode == "task":
        return
    for ex in list(task.train) + [e for exs in task.eval.values() for e in exs]:
        if getattr(ex, "conversation", None) is None:  # a conversation's prompt: composer/conversations.py `bind`
            ex.prompt = fmt.prompt(ex)


def _sentinel(name: str) -> str:
    return f"\u27e6context:{name}\u27e7"


def _format(template: str, **fields) -> str:
    """str.format with plain fields only (validation refuses format specs and conversions)."""
    return template.format(**fields)


def context_block(task, kinds: dict[str, str], texts: dict[str, str | None]) -> str:
    """The privileged texts that are present, in `context` order: the task's line per kind, else generic."""
    out = []
    for name, text in texts.items():
        if text is None:
            continue
        line = task.templates.get(f"context:{kinds[name]}") or GENERIC_CONTEXT[kinds[name]]
        out.append(line.format(text=text))
    return "".join(out)


def teacher_prompt(task, cfg, kinds: dict[str, str], example, texts: dict[str, str | None],
                   fmt: PromptFormat = TASK_FORMAT) -> str | None:
    """The prompt a teacher scores the student's response under; None when no privileged text is present
    for this row (the teacher then sees the student's own prompt). The privileged context and the question
    make up the user message, which `fmt` renders as it renders the policy's (chat: the chat template);
    a `template`'s {prompt} is the policy's user message, {problem} the row's text."""
    present = {n: t for n, t in texts.items() if t is not None}
    if not present:
        return None
    user = fmt.user(example)
    if cfg.template is not None:
        return fmt.wrap(_format(cfg.template, problem=example.problem, prompt=user,
                                **{n: (t or "") for n, t in texts.items()}))
    if "question" in task.templates:  # the task's own format (toy)
        return fmt.wrap(context_block(task, kinds, texts) + task.templates["question"].format(problem=example.problem))
    by_kind = {kinds[n]: t for n, t in present.items()}
    if set(by_kind) == {"reference_solution"} and len(present) == 1:  # OPSD
        return fmt.wrap(OPSD_TEMPLATE.format(problem=example.problem, solution=by_kind["reference_solution"]))
    if set(by_kind) <= {"sibling_success", "feedback"} and len(present) == len(by_kind):  # SDPO
        sol, fb = by_kind.get("sibling_success"), by_kind.get("feedback")
        return fmt.wrap(SDPO_TEMPLATE.format(prompt=user, solution=SDPO_SOLUTION.format(text=sol) if sol else "",
                                             feedback=SDPO_FEEDBACK.format(text=fb) if fb else ""))
    return fmt.wrap(context_block(task, kinds, texts) + user)


def judge_prompt(task, cfg, kinds: dict[str, str], example, accepted: list[str], new: list[str], step_split: str,
                 texts: dict[str, str | None], fmt: PromptFormat = TASK_FORMAT) -> str:
    """The verdict prompt: the problem, the accepted steps and the new steps numbered from 1, with context,
    as the user message that `fmt` renders."""
    steps = "\n".join(f"{i + 1}:{s}" for i, s in enumerate(new))
    acc = step_split.join(accepted)
    if cfg.template is not None:
        return fmt.wrap(_format(cfg.template, problem=example.problem, prompt=fmt.user(example), accepted=acc,
                                steps=steps, **{n: (t or "") for n, t in texts.items()}))
    block = context_block(task, kinds, texts)
    if "judge" in task.templates:
        return fmt.wrap(block + task.templates["judge"].format(problem=example.problem, accepted=acc, steps=steps))
    return fmt.wrap(JUDGE_TEMPLATE.format(context=block, problem=example.problem, accepted=acc or "(none)",
                                          steps=steps))


def proposal_prompt(task, cfg, kinds: dict[str, str], example, steps: list[str], texts: dict[str, str | None],
                    fmt: PromptFormat = TASK_FORMAT) -> str:
    """InT's proposal prompt: the failed attempt's steps numbered from 1, the declared context and the gold
    answer. A source `template` renders it (accepted empty); a task's `proposal` template, else its `judge`
    template (the toy's judge answers 'REVISE k' and the right step in one answer; its reference line ends
    with the answer), else PROPOSAL_TEMPLATE."""
    numbered = "\n".join(f"{i + 1}:{s}" for i, s in enumerate(steps))
    if cfg.template is not None:
        return fmt.wrap(_format(cfg.template, problem=example.problem, prompt=fmt.user(example), accepted="",
                                steps=numbered, **{n: (t or "") for n, t in texts.items()}))
    block = context_block(task, kinds, texts)
    for name in ("proposal", "judge"):
        if name in task.templates:
            return fmt.wrap(block + task.templates[name].format(problem=example.problem, accepted="", steps=numbered,
                                                                answer=example.answer or ""))
    return fmt.wrap(PROPOSAL_TEMPLATE.format(context=block, problem=example.problem, answer=example.answer or "",
                                             steps=numbered))


def correction_prompt(task, cfg, kinds: dict[str, str], example, kept: list[str], step_split: str,
                      texts: dict[str, str | None], fmt: PromptFormat = TASK_FORMAT) -> str:
    """The prompt the judge's correction continues: its context prompt (or the policy's prompt without
    context) followed by the kept steps only; the rejected step and what followed are never shown. The kept
    steps follow the rendered prompt (chat: after the generation prompt, as the start of the answer)."""
    base = teacher_prompt(task, cfg.model_copy(update={"template": None}), kinds, example, texts, fmt) \
        or fmt.prompt(example)
    return base + "".join(s + step_split for s in kept)


def check_placement(name: str, usage: str, render) -> None:
    """Raise ValueError unless render(texts) shows every declared context; render takes {name: text}."""
    contexts = render.contexts
    shown = render({c: _sentinel(c) for c in contexts})
    missing = [c for c in contexts if _sentinel(c) not in shown]
    if missing:
        raise ValueError(f"sources.{name}: the {usage} prompt ({render.template}) has no place for the declared "
                         f"context {', '.join(repr(m) for m in missing)}; give the source a `template` with "
                         f"{', '.join('{' + m + '}' for m in missing)}, or remove it from `context`")


class Render:
    """A prompt function of the context texts, for `check_placement` and for recording what a model saw."""

    def __init__(self, fn, contexts: list[str], template: str):
        self.fn, self.contexts, self.template = fn, contexts, template

    def __call__(self, texts: dict[str, str | None]) -> str:
        return self.fn(texts)


def which_template(task, cfg, usage: str, kinds: dict[str, str]) -> str:
    """A name for the template a usage renders with (for error messages)."""
    if cfg.template is not None and usage != "correction":
        return "the source's own template"
    if usage == "judge" and "judge" in task.templates:
        return f"the {task.name} task's judge template"
    if usage == "proposal":
        return next((f"the {task.name} task's {n} template" for n in ("proposal", "judge") if n in task.templates),
                    "InT's proposal template")
    if "question" in task.templates:
        return f"the {task.name} task's context template"
    kinds_present = set(kinds.values())
    if kinds_present == {"reference_solution"}:
        return "the OPSD template"
    if kinds_present and kinds_present <= {"sibling_success", "feedback"}:
        return "the SDPO template"
    return "the generic context template"
