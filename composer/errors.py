"""Diagnostics: every problem found in a spec, located and with a hint."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class Location:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass
class Diagnostic:
    layer: str  # yaml | schema | graph | semantics
    message: str
    path: tuple = ()
    location: Location | None = None
    hint: str = ""
    severity: str = "error"  # error | warning
    rule: str = ""

    @property
    def dotted(self) -> str:
        return dotted(self.path)

    def format(self) -> str:
        where = str(self.location) if self.location else "<spec>"
        head = f"{where}: {self.severity}: "
        if self.path:
            head += f"{self.dotted}: "
        text = head + self.message
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return printable(text)


def printable(text: str) -> str:
    """`text` with every control character but newline and tab escaped as Python writes it (`\\r`, `\\x07`,
    `\\x1b`): spec-provided strings (a summary, a key, a file name) reach the terminal through validate's and
    explain's output, where a carriage return, a bell or an escape sequence would rewrite a line, ring, recolour."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


@dataclass
class SpecError(Exception):
    """Raised when a spec cannot be loaded or validated; carries all diagnostics of the failing layer."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(d.format() for d in self.diagnostics)


def dotted(path: Iterable) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    choices = sorted(set(map(str, choices)))
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if choices:
        shown = choices[:15]
        return "expected one of: " + ", ".join(shown) + (f", ... ({len(choices) - 15} more)" if len(choices) > 15 else "")
    return ""


class DataError(Exception):
    """Bad input data: names the file, the row and the field."""

    def __init__(self, message: str, file: str = "", row: int = -1, field: str = "", reason: str = ""):
        super().__init__(message)
        self.file, self.row, self.field, self.reason = file, row, field, reason


class ModelLoadError(Exception):
    """A model or tokenizer directory that does not load: names the path and the reason."""


class MachineUnavailable(RuntimeError):
    """This machine lacks what a component needs to run safely (a verifier's sandbox): the run stops before
    training with the reason, exit 2."""
