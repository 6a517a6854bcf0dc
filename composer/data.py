"""Examples and tasks: what a run trains on, independent of where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol


@dataclass
class Example:
    """One problem: the prompt text the policy sees, the answer the verifier checks, and privileged text."""

    prompt: str  # the full prompt string fed to the policy (already templated: data.prompt_format, at bind time)
    answer: str
    solution: Optional[str] = None  # step-by-step reference solution, one step per line / per step_split
    problem: str = ""  # the bare problem text, the row's prompt_field (teacher and judge templates); defaults to prompt
    tier: Optional[int] = None  # difficulty tier (toy: chain length)
    row: int = -1  # row number in the source file (for error messages)
    meta: dict[str, Any] = field(default_factory=dict)
    conversation: Any = None  # a `messages` row (composer/conversations.py Conversation): SFT trains its assistant turns

    def __post_init__(self):
        if not self.problem:
            self.problem = self.prompt


@dataclass
class Verdict:
    """A verifier's judgement of one response."""

    reward: float
    parsed: bool = True  # False: the verifier could not read the response or the answer
    detail: str = ""  # feedback text for a failed response
    answer: Optional[str] = None  # the final answer the verifier read from the response (None: none / not said)


class StepChecker(Protocol):
    def first_wrong_step(self, example: Example, steps: list[str]) -> Optional[int]:
        """Index of the first wrong step in `steps` (the response split into steps), None if all are right."""

    def correct_step(self, example: Example, steps: list[str], index: int) -> str:
        """The right text for step `index`, given the (correct) steps before it."""


@dataclass
class Task:
    """What a run binds: data, a verifier, optional step checker, default checkpoints and templates."""

    name: str
    train: list[Example]
    eval: dict[str, list[Example]]  # tier name -> held-out examples
    verifier: str  # registered verifier name used by `verifier: auto`
    step_checker: Optional[StepChecker] = None
    student: Optional[str] = None  # default policy checkpoint directory
    teacher: Optional[str] = None  # default teacher checkpoint directory
    max_new_tokens: Optional[int] = None  # cap: the longest response the task needs
    step_split: str = "\n"
    templates: dict[str, str] = field(default_factory=dict)  # named prompt templates (teacher contexts, judge)
    sample_train: Optional[Callable] = None  # optional generator(rng, n) -> list[Example]; else cycle `train`
    prompt_format: Any = None  # how prompts were rendered (runtime/prompts.py PromptFormat); None: the task's own
