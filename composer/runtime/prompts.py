"""Prompts of models that read privileged context: teachers, judges and the judge's correction.

Every context a policy_model source declares is placed in the text it is given, or the run stops
before training naming the source, the template and the context (`check_placement`). Templates, in
order of precedence: the source's own `template`; the task's (toy testbed: one line per context kind
before the question); the published ones (OPSD with a reference solution, SDPO with a sibling success
and/or feedback); a generic composition of all of them. No torch at import.
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
TEMPLATE_FIELDS = {"teacher": ("problem", "prompt"), "judge": ("problem", "prompt", "accepted", "steps")}


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


def teacher_prompt(task, cfg, kinds: dict[str, str], example, texts: dict[str, str | None]) -> str | None:
    """The prompt a teacher scores the student's response under; None when no privileged text is present
    for this row (the teacher then sees the student's own prompt)."""
    present = {n: t for n, t in texts.items() if t is not None}
    if not present:
        return None
    if cfg.template is not None:
        return _format(cfg.template, problem=example.problem, prompt=example.prompt,
                       **{n: (t or "") for n, t in texts.items()})
    if "question" in task.templates:  # the task's own format (toy)
        return context_block(task, kinds, texts) + task.templates["question"].format(problem=example.problem)
    by_kind = {kinds[n]: t for n, t in present.items()}
    if set(by_kind) == {"reference_solution"} and len(present) == 1:  # OPSD
        return OPSD_TEMPLATE.format(problem=example.problem, solution=by_kind["reference_solution"])
    if set(by_kind) <= {"sibling_success", "feedback"} and len(present) == len(by_kind):  # SDPO
        sol, fb = by_kind.get("sibling_success"), by_kind.get("feedback")
        return SDPO_TEMPLATE.format(prompt=example.prompt, solution=SDPO_SOLUTION.format(text=sol) if sol else "",
                                    feedback=SDPO_FEEDBACK.format(text=fb) if fb else "")
    return context_block(task, kinds, texts) + example.prompt


def judge_prompt(task, cfg, kinds: dict[str, str], example, accepted: list[str], new: list[str], step_split: str,
                 texts: dict[str, str | None]) -> str:
    """The verdict prompt: the problem, the accepted steps and the new steps numbered from 1, with context."""
    steps = "\n".join(f"{i + 1}:{s}" for i, s in enumerate(new))
    acc = step_split.join(accepted)
    if cfg.template is not None:
        return _format(cfg.template, problem=example.problem, prompt=example.prompt, accepted=acc, steps=steps,
                       **{n: (t or "") for n, t in texts.items()})
    block = context_block(task, kinds, texts)
    if "judge" in task.templates:
        return block + task.templates["judge"].format(problem=example.problem, accepted=acc, steps=steps)
    return JUDGE_TEMPLATE.format(context=block, problem=example.problem, accepted=acc or "(none)", steps=steps)


def correction_prompt(task, cfg, kinds: dict[str, str], example, kept: list[str], step_split: str,
                      texts: dict[str, str | None]) -> str:
    """The prompt the judge's correction continues: its context prompt (or the policy's prompt without
    context) followed by the kept steps only; the rejected step and what followed are never shown."""
    base = teacher_prompt(task, cfg.model_copy(update={"template": None}), kinds, example, texts) or example.prompt
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
    if "question" in task.templates:
        return f"the {task.name} task's context template"
    kinds_present = set(kinds.values())
    if kinds_present == {"reference_solution"}:
        return "the OPSD template"
    if kinds_present and kinds_present <= {"sibling_success", "feedback"}:
        return "the SDPO template"
    return "the generic context template"
