"""The tool environment: the policy calls declared tools in the Hermes / Qwen format and reads their answers.

A policy turn that ends with a call

    <tool_call>{"name": "calculator", "arguments": {"expression": "(7+3-5+9)%10"}}</tool_call>

is answered by the tool: on plain prompts with the line `\\n<tool_response>4</tool_response>\\n` after the call, on
chat prompts as a `tool` message rendered by the model's chat template (Qwen2.5's: the assistant's end of turn, then
`<tool_response>\\n4\\n</tool_response>` in a user turn, then the next assistant turn). A turn without a call is the
policy's answer and ends the episode. The format is Hermes function calling (NousResearch, Hermes-2-Pro; the Qwen2.5
and Qwen3 chat templates' `tools` format): one JSON object with `name` and `arguments` between the tags.

Tools:
  calculator   arguments {"expression": "..."}: integers and decimals, + - * / // % ** and parentheses, unary
               minus; no names, no calls. Limits: 200 characters, integers of at most 10^18 in magnitude
               anywhere, exponents at most 64. The result as text (an integer, or a float to 12 significant
               digits); an error returns `error: ...` and counts as a tool error.
  python       arguments {"code": "..."}: run in the code sandbox (components/tasks/code_verifier.py: namespaces,
               rlimits, seccomp; never without it), answered with its stdout (stripped), or `error: ` and the last
               line of its stderr; a timeout is `error: timed out`. Counts a tool error unless it exits 0.
Malformed calls (no JSON object, no `name`, arguments not an object, an undeclared tool) answer `error: ...` and count
as tool errors. Results longer than `max_result_chars` are cut (`...` appended).
"""

from __future__ import annotations

import ast
import json
import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from composer.contract import EpisodeEnvironment
from composer.registry import register

TOOLS = ("calculator", "python")
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CHARS, MAX_INT, MAX_EXP = 200, 10 ** 18, 64
SYMBOLS = re.compile(r"[^0-9.eE+\-*/%()\s]")  # anything else (names, calls, underscores, hex) is refused


@register("environment")
class ToolEnvironment(EpisodeEnvironment):
    """Declared tools answer the policy's Hermes-format tool calls (calculator; python in the code sandbox)."""

    kind: Literal["tools"] = Field("tools", description="Component kind.")
    tools: list[str] = Field(default_factory=lambda: ["calculator"], min_length=1, description="The tools the policy may call, by name: calculator (an arithmetic evaluator), python (a program run in the code sandbox; needs Linux namespaces).")
    format: Literal["hermes"] = Field("hermes", description="How calls and answers are written: hermes (the Hermes / Qwen format: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; the answer a `tool` message through the chat template under chat prompts, else `\\n<tool_response>RESULT</tool_response>\\n`).")
    max_result_chars: int = Field(400, ge=1, le=100000, description="A tool's answer longer than this is cut (and `...` appended).")
    python_timeout: float = Field(5.0, gt=0, le=60, description="python: wall-clock seconds a program may run in the sandbox.")

    role: ClassVar[str] = "tool"
    turn_rewards: ClassVar[bool] = False  # a tool answers; it never scores

    @field_validator("tools")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        from composer.errors import did_you_mean

        for name in value:
            if name not in TOOLS:
                raise PydanticCustomError("unknown_tool", "unknown tool {name} ({hint})",
                                          {"name": ascii(name), "hint": did_you_mean(name, TOOLS)})
        if len(set(value)) != len(value):
            raise ValueError("a tool is listed twice")
        return value

    def describe(self, spec) -> str:
        chat = spec.data.train is not None and spec.data.prompt_format != "plain"
        how = ("a `tool` message through the chat template (when the tokenizer has one)" if chat else
               repr(self.render_plain("RESULT")))
        return (f"the policy may call {', '.join(self.tools)} (Hermes <tool_call> JSON; a turn stops at </tool_call>) "
                f"and reads the answer as environment tokens ({how}), up to {self.max_turns} turns and "
                f"{self.max_env_tokens} environment tokens per episode")

    def short_run_overrides(self) -> list[str]:
        """The referee's short run caps responses at 48 tokens on the toy; a call is about 100 characters."""
        return ["rollout.max_new_tokens=128"]

    def stop_strings(self) -> tuple[str, ...]:
        return (CLOSE,)

    def render_plain(self, text: str) -> str:
        return f"\n<tool_response>{text}</tool_response>\n"

    def session(self):
        return ToolSession(self)

    def facts(self, session) -> dict[str, float]:
        return {"tool_calls": session.calls, "tool_errors": session.errors}

    @property
    def runs_code(self) -> bool:
        return "python" in self.tools

    def preflight(self, ctx) -> None:
        if self.runs_code:
            from components.tasks.code_verifier import ensure_sandbox

            ensure_sandbox()  # raises SandboxUnavailable with the reason: code never runs without it

    # ---- the referee's replay (DESIGN.md section 10), written again without the session's helpers ----
    def reference_replies(self, example, turns: list[str]):
        """Each turn's answer from the spec alone: the text between the last `<tool_call>` and the `</tool_call>` the
        turn ends with, read as JSON; the calculator's value by a recursive-descent parser of its own (the session
        evaluates Python's ast); python is run again in the sandbox (what it prints is its own answer). A turn
        without a call gets ('', None, True)."""
        out = []
        for text in turns:
            end = text.rfind(CLOSE)
            start = text.rfind(OPEN, 0, end) if end >= 0 else -1
            if end < 0 or start < 0:
                out.append(("", None, True))
                continue
            body = text[start + len(OPEN): end]
            try:
                call = json.loads(body)
            except ValueError:
                out.append(("error: malformed tool call (not JSON)", None, False))
                continue
            name = call.get("name") if isinstance(call, dict) else None
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            if not isinstance(name, str) or not isinstance(args, dict):
                out.append(("error: malformed tool call (expected {\"name\": ..., \"arguments\": {...}})", None, False))
            elif name not in self.tools:
                out.append((f"error: unknown tool {name!r} (tools: {', '.join(self.tools)})", None, False))
            elif name == "calculator":
                expr = args.get("expression")
                if not isinstance(expr, str):
                    out.append(("error: calculator needs {\"expression\": \"...\"}", None, False))
                else:
                    out.append((self._cut(reference_calculate(expr)), None, False))
            else:
                out.append((self._cut(run_python(args.get("code"), self.python_timeout)), None, False))
        return out

    def _cut(self, text: str) -> str:
        return text if len(text) <= self.max_result_chars else text[: self.max_result_chars] + "..."


class ToolSession:
    """One episode's tools: `step(turn text)` answers the call the turn ends with. Counts calls and errors."""

    def __init__(self, cfg: ToolEnvironment):
        self.cfg, self.calls, self.errors = cfg, 0, 0

    def reset(self, example) -> str:
        return ""

    def step(self, text: str) -> tuple[str, float | None, bool]:
        call = parse_call(text)
        if call is None:  # no call: the policy's answer
            return "", None, True
        self.calls += 1
        name, args, problem = call
        if problem is None and name not in self.cfg.tools:
            problem = f"unknown tool {name!r} (tools: {', '.join(self.cfg.tools)})"
        if problem is not None:
            self.errors += 1
            return self.cfg._cut(f"error: {problem}"), None, False
        if name == "calculator":
            expr = args.get("expression")
            answer = calculate(expr) if isinstance(expr, str) else "error: calculator needs {\"expression\": \"...\"}"
        else:
            answer = run_python(args.get("code"), self.cfg.python_timeout)
        self.errors += answer.startswith("error:")
        return self.cfg._cut(answer), None, False


def parse_call(text: str):
    """The call a turn ends with: None when the turn holds no `<tool_call>...</tool_call>`; else (name, arguments,
    problem): problem is None for a well-formed call, else why it is malformed (name and arguments then None)."""
    found = CALL.findall(text)
    if not found:
        return None
    body = found[-1].strip()
    try:
        call = json.loads(body)
    except ValueError:
        return None, None, "malformed tool call (not JSON)"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
            or not isinstance(call.get("arguments", {}), dict):
        return None, None, "malformed tool call (expected {\"name\": ..., \"arguments\": {...}})"
    return call["name"], call.get("arguments", {}), None


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def calculate(expression: str) -> str:
    """The calculator: `expression` evaluated over numbers and + - * / // % ** ( ), as text; `error: ...` else."""
    if len(expression) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    if SYMBOLS.search(expression):
        return "error: only numbers, + - * / // % ** and parentheses"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return "error: not an arithmetic expression"
    try:
        return show(_eval(tree.body))
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, OverflowError) as e:
        return f"error: {e}"


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return _checked(-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        a, b = _eval(node.left), _eval(node.right)
        if abs(b) > MAX_EXP:
            raise ValueError(f"exponent above {MAX_EXP}")
        return _checked(a ** b)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _checked(_BINOPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise ValueError("only numbers, + - * / // % ** and parentheses")


def _checked(v):
    if isinstance(v, complex):
        raise ValueError("not a real number")
    if abs(v) > MAX_INT:
        raise ValueError("number too large")
    return v


def show(v) -> str:
    """A result as text: an integer as it is, a float to 12 significant digits."""
    return str(v) if isinstance(v, int) else f"{v:.12g}"


def reference_calculate(expression: str) -> str:
    """The calculator written again (the referee's): a recursive-descent parser over the characters, with Python's
    number semantics for each operation (int stays int; / gives a float), the same limits and error texts."""
    if len(expression) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    if re.search(r"[^0-9.eE+\-*/%()\s]", expression):
        return "error: only numbers, + - * / // % ** and parentheses"
    s = expression.strip()
    pos = [0]

    def peek(k=1):
        while pos[0] < len(s) and s[pos[0]] in " \t\n":
            pos[0] += 1
        return s[pos[0]: pos[0] + k]

    def atom():
        c = peek()
        if c == "(":
            pos[0] += 1
            v = expr()
            if peek() != ")":
                raise SyntaxError
            pos[0] += 1
            return v
        m = re.match(r"(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?", s[pos[0]:])
        if not m:
            raise SyntaxError
        pos[0] += m.end()
        text = m.group(0)
        return lim(float(text) if ("." in text or "e" in text.lower()) else int(text))

    def power():
        base = atom()
        if peek(2) == "**":
            pos[0] += 2
            exp = unary()  # right-associative, and the exponent may carry a sign
            if abs(exp) > MAX_EXP:
                raise ValueError(f"exponent above {MAX_EXP}")
            return lim(base ** exp)
        return base

    def unary():
        c = peek()
        if c in ("-", "+"):
            pos[0] += 1
            v = unary()
            return lim(-v if c == "-" else v)
        return power()

    def term():
        v = unary()
        while True:
            if peek(2) == "//":
                pos[0] += 2
                v = lim(v // unary())
            elif peek() in ("*", "/", "%") and peek(2) != "**":
                op = peek()
                pos[0] += 1
                w = unary()
                v = lim(v * w if op == "*" else v / w if op == "/" else v % w)
            else:
                return v

    def expr():
        v = term()
        while peek() in ("+", "-") and peek():
            op = peek()
            pos[0] += 1
            w = term()
            v = lim(v + w if op == "+" else v - w)
        return v

    def lim(v):
        if isinstance(v, complex):
            raise ValueError("not a real number")
        if abs(v) > MAX_INT:
            raise ValueError("number too large")
        return v

    try:
        value = expr()
        if peek():
            raise SyntaxError
    except SyntaxError:
        return "error: not an arithmetic expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, OverflowError) as e:
        return f"error: {e}"
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def run_python(code, timeout: float) -> str:
    """A program's answer from the code sandbox: its stdout (stripped), or `error: ...`."""
    if not isinstance(code, str):
        return "error: python needs {\"code\": \"...\"}"
    from dataclasses import replace

    from components.tasks.code_verifier import DEFAULT_LIMITS, run_sandboxed

    r = run_sandboxed(code, replace(DEFAULT_LIMITS, timeout=float(timeout)))
    if r.timed_out:
        return "error: timed out"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return f"error: {last}"
    return r.stdout.strip()
