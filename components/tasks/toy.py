"""The toy testbed: mod-10 arithmetic chains written one step per line (DESIGN.md section 6).

    prompt    Q:7+3-5+9\\nA:
    solution  7+3=0\\n0-5=5\\n5+9=4\\n#4
    answer    4            tier = 3 (number of steps)

Train and eval are split by a hash of the problem text, so they never overlap. No torch at import.

The tool task (`TASKS`, issue 55): the same chains, the prompt announcing a calculator tool; a policy may
answer through one tool call (Hermes / Qwen JSON inside <tool_call> tags; its turn stops at </tool_call>),
the environment appends the tool's answer, and the policy states it:

    prompt    Tools: calculator\nQ:7+3-5+9\nA:
    policy    <tool_call>{"name": "calculator", "arguments": {"expression": "(7+3-5+9)%10"}}</tool_call>
    env       \n<tool_response>4</tool_response>\n
    policy    #4

Variants (`VARIANTS`): the default `mod10` above, and held-out ones with another modulus (`mod7`: digits
0-6, arithmetic mod 7), chosen by the environment variable COMPOSER_TOY_VARIANT (unset: mod10, exactly
the testbed above). A variant has its own bootstrapped checkpoints (components/tasks/bootstrap.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random

from composer.data import Example, Task
from composer.files import atomic_path

EVAL_BUCKETS = 5  # 1 in 5 problems (by hash) belongs to the eval split

# Toy variants: the modulus of the arithmetic (operands are its digits) and the operations. `mod10` is the
# default testbed; the others are held out (composer bench runs a suite on one to check that conclusions
# drawn on mod10 were not tuned to it). Select one with COMPOSER_TOY_VARIANT=<name>.
VARIANTS = {
    "mod10": {"modulus": 10, "ops": "+-"},
    "mod7": {"modulus": 7, "ops": "+-"},
}
DEFAULT_VARIANT = "mod10"
VARIANT_ENV = "COMPOSER_TOY_VARIANT"


def variant() -> str:
    """The active toy variant: $COMPOSER_TOY_VARIANT, else `mod10` (the default testbed)."""
    name = os.environ.get(VARIANT_ENV) or DEFAULT_VARIANT
    if name not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={name!r}: the toy variants are {', '.join(VARIANTS)}")
    return name


def modulus() -> int:
    """The active variant's modulus (10 for the default testbed)."""
    return VARIANTS[variant()]["modulus"]


def _apply(acc: int, op: str, b: int, m: int) -> int:
    if op == "+":
        return (acc + b) % m
    if op == "-":
        return (acc - b) % m
    if op == "*":
        return (acc * b) % m
    raise ValueError(f"unknown toy operation {op!r}")

# Prompt formats. Fields are filled with str.format; every format ends with "A:" and the response
# is the solution lines (for `prefix`: the lines after the prefix), then "#N".
TEMPLATES = {
    "prompt": "Q:{problem}\nA:",
    # Privileged context: one line per kind before the question (composer/prompts.py places
    # every context a source declares; teachers and judges see the same lines).
    "context:reference_solution": "R:{text}\n",  # OPSD-style self-teacher sees the reference
    "context:feedback": "F:{text}\n",  # verifier feedback on a failed attempt
    "context:sibling_success": "S:{text}\n",  # a successful sibling rollout (SDPO)
    "question": "Q:{problem}\nA:",
    # The bootstrap's teacher formats, which the lines above compose to.
    "reference": "R:{solution}\nQ:{problem}\nA:",
    "feedback": "F:{feedback}\nQ:{problem}\nA:",
    "sibling": "S:{sibling}\nQ:{problem}\nA:",
    "prefix": "Q:{problem}\nP:{prefix}\nA:",  # POPE: first k reference lines; response = the rest
    # judge: {accepted} = accepted lines ("\n"-joined), {steps} = new lines numbered "1:..\n2:.."
    # from 1; the judge answers "KEEP" or "REVISE <k>\n<right line k>" (k = number within {steps}).
    "judge": "J:{problem}\nC:{accepted}\nN:\n{steps}\nV:",
    # the tool task's prompt (TASKS["tools"]): the calculator is announced, the question as in `prompt`
    "tools": "Tools: calculator\nQ:{problem}\nA:",
}

# The toy tasks a spec names (data.toy_task): their prompt format. `chains` is the testbed above; `tools` the same
# chains with a calculator tool announced (a rollout environment answers the call: components/environments/).
TASKS = {"chains": "prompt", "tools": "tools"}
DEFAULT_TASK = "chains"
TOOL = "calculator"  # the tool's name in a call
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE = "\n<tool_response>{result}</tool_response>\n"  # what the environment appends after a call


# ---------------------------------------------------------------------------------------- problems


def solve(problem: str) -> tuple[list[str], str]:
    """The step lines and the answer of a chain like '7+3-5+9' (mod the active variant's modulus)."""
    m = modulus()
    acc, steps = int(problem[0]), []
    for i in range(1, len(problem), 2):
        op, b = problem[i], int(problem[i + 1])
        new = _apply(acc, op, b, m)
        steps.append(f"{acc}{op}{b}={new}")
        acc = new
    return steps, str(acc)


def split_of(problem: str) -> str:
    """'eval' or 'train': a stable hash partition of the problem text."""
    h = int(hashlib.sha256(problem.encode()).hexdigest()[:8], 16)
    return "eval" if h % EVAL_BUCKETS == 0 else "train"


def make_example(problem: str, task: str = DEFAULT_TASK) -> Example:
    """The Example of one chain, prompted in `task`'s format (TASKS: `chains` or `tools`)."""
    steps, answer = solve(problem)
    solution = "\n".join(steps) + f"\n#{answer}"
    return Example(
        prompt=TEMPLATES[TASKS[task]].format(problem=problem),
        answer=answer,
        solution=solution,
        problem=problem,
        tier=len(steps),
    )


def random_problem(rng: random.Random, tier: int, split: str) -> str:
    """A random chain of `tier` steps from `split` (rejection sampling over the hash partition)."""
    cfg = VARIANTS[variant()]
    m, ops = cfg["modulus"], cfg["ops"]  # mod10: exactly the draws of the original testbed
    while True:
        p = str(rng.randrange(m)) + "".join(rng.choice(ops) + str(rng.randrange(m)) for _ in range(tier))
        if split_of(p) == split:
            return p


def _stream() -> str:
    """The name of the random streams of the active variant ('toy' for the default: unchanged draws)."""
    name = variant()
    return "toy" if name == DEFAULT_VARIANT else f"toy-{name}"


def make_examples(tier: int, n: int, seed: int, split: str, task: str = DEFAULT_TASK) -> list[Example]:
    """`n` deterministic examples of `tier` steps from `split` ('train' or 'eval'), distinct when possible, prompted
    in `task`'s format (the problems do not depend on it)."""
    assert split in ("train", "eval"), split
    rng = random.Random(f"{_stream()}/{seed}/{tier}/{split}")
    seen, out = set(), []
    for _ in range(50 * n):  # dedupe, but small tiers (tier 1: 200 problems) may run out
        if len(out) == n:
            break
        p = random_problem(rng, tier, split)
        if p not in seen:
            seen.add(p)
            out.append(make_example(p, task))
    while len(out) < n:
        out.append(make_example(random_problem(rng, tier, split), task))
    return out


def sample_train_fn(train_tiers, task: str = DEFAULT_TASK):
    """A `sample_train(rng, n)` that draws fresh train-split problems from `train_tiers` (prompts in `task`'s format)."""
    tiers = tuple(train_tiers)

    def sample_train(rng: random.Random, n: int) -> list[Example]:
        return [make_example(random_problem(rng, rng.choice(tiers), "train"), task) for _ in range(n)]

    return sample_train


def max_new_tokens_for(tier: int, task: str = DEFAULT_TASK) -> int:
    """Response budget in characters (= tokens): 6 per step line, '#N', eos, and a margin. The tool task's covers an
    episode of either kind: the step lines, or a tool call on a chain of `tier` steps, the tool's answer (environment
    tokens) and '#N', eos."""
    plain = 6 * tier + 2 + 1 + 8
    if task == DEFAULT_TASK:
        return plain
    longest = str(modulus() - 1) + "+9" * tier  # every operand one digit: the longest chain of `tier` steps
    episode = "".join(text for _, text in tool_demonstration(longest))
    return max(plain, len(episode) + 1 + 8)


# ------------------------------------------------------------------------------------------ the tool task


def tool_expression(problem: str) -> str:
    """The calculator expression that answers a chain: '(7+3-5+9)%10' (the active variant's modulus)."""
    return f"({problem})%{modulus()}"


def tool_call_text(expression: str, name: str = TOOL) -> str:
    """A policy's tool call in the Hermes / Qwen format: <tool_call>{"name": .., "arguments": {"expression": ..}}
    </tool_call> (json.dumps: ', ' and ': ' separators)."""
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": {"expression": expression}}) + TOOL_CALL_CLOSE


def tool_response_text(result: str) -> str:
    """What the environment appends after a call: '\\n<tool_response>4</tool_response>\\n'."""
    return TOOL_RESPONSE.format(result=result)


def tool_demonstration(problem: str) -> list[tuple[str, str]]:
    """The episode that answers `problem` with the calculator, as [(origin, text)]: the policy's call, the
    environment's answer, the policy's '#N' (its eos follows). Joined, the texts are the whole response."""
    _, answer = solve(problem)
    return [("policy", tool_call_text(tool_expression(problem))), ("environment", tool_response_text(answer)),
            ("policy", f"#{answer}")]


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """(name, arguments) of the first complete <tool_call>..</tool_call> in `text`; None when there is none or its
    body is not a JSON object with a string `name` and an object `arguments`."""
    start = text.find(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN)) if start >= 0 else -1
    if end < 0:
        return None
    try:
        body = json.loads(text[start + len(TOOL_CALL_OPEN) : end])
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not isinstance(body.get("arguments"), dict):
        return None
    return body["name"], body["arguments"]


def calculate(expression: str) -> str:
    """A plain calculator for the toy's own checks (the bootstrap's, the tests'): integers, + - * % and parentheses,
    Python's semantics (a % m is in [0, m) for m > 0). Raises ValueError on anything else."""
    import ast

    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Mod: lambda a, b: a % b}

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not a calculator expression: {expression!r}")

    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError(f"not a calculator expression: {expression!r}")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ZeroDivisionError, RecursionError) as e:
        raise ValueError(f"not a calculator expression: {expression!r} ({type(e).__name__})") from None


# ------------------------------------------------------------------------------- privileged texts


def step_lines(text: str) -> list[str]:
    """A response split into steps (lines), trailing empty lines dropped."""
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def prefix_prompt(example: Example, k: int) -> tuple[str, str]:
    """(prompt, target): the POPE prompt showing the first k reference lines, and the rest of the solution."""
    lines = example.solution.split("\n")
    return TEMPLATES["prefix"].format(problem=example.problem, prefix="\n".join(lines[:k])), "\n".join(lines[k:])


def judge_prompt(example: Example, accepted: list[str], new: list[str]) -> str:
    """The judge prompt for accepted step lines and the new step lines under review."""
    steps = "\n".join(f"{i + 1}:{s}" for i, s in enumerate(new))
    return TEMPLATES["judge"].format(problem=example.problem, accepted="\n".join(accepted), steps=steps)


def judge_target(example: Example, accepted: list[str], new: list[str]) -> str:
    """What a perfect judge answers: 'KEEP' or 'REVISE k\\n<right line>' (k 1-based within `new`)."""
    checker = ToyStepChecker()
    bad = checker.first_wrong_step(example, accepted + new)
    if bad is None or bad < len(accepted) or bad >= len(accepted) + len(new):
        return "KEEP"
    return f"REVISE {bad - len(accepted) + 1}\n{checker.correct_step(example, accepted + new, bad)}"


def proposal_prompt(example: Example, steps: list[str]) -> str:
    """InT's proposal prompt as the composer renders it for the toy (composer/prompts.py `proposal_prompt`
    with a proposer whose context is the reference solution): the reference line, then the judge template
    with nothing accepted and every step of the failed attempt numbered from 1."""
    solution = example.solution or make_example(example.problem).solution
    return TEMPLATES["context:reference_solution"].format(text=solution) + judge_prompt(example, [], steps)


def proposal_target(example: Example, steps: list[str]) -> str:
    """What a perfect InT proposer answers for a failed attempt's `steps`: 'REVISE k\\n<right line k>', k the
    first wrong step (1-based; a missing line counts: an attempt that stops early is wrong at the line after
    its last right one), the right line its reference line (the '#N' line when only the answer is wrong)."""
    return judge_target(example, [], steps)


def parse_judge(text: str) -> tuple[int, str] | None:
    """None for KEEP (or unreadable text); else (k 1-based within the new steps, correction line)."""
    lines = text.strip().split("\n")
    head = lines[0].split()
    if len(head) == 2 and head[0] == "REVISE" and head[1].isdigit() and len(lines) > 1:
        return int(head[1]), lines[1].strip()
    return None


class ToyStepChecker:
    """Programmatic step checker (composer.data.StepChecker): a step is right iff it equals the reference line."""

    def reference_lines(self, example: Example) -> list[str]:
        """The reference step lines followed by the '#N' line."""
        return (example.solution or make_example(example.problem).solution).split("\n")

    def first_wrong_step(self, example: Example, steps: list[str]) -> int | None:
        """Index of the first step differing from the reference (missing or extra lines count); None if all right."""
        ref = self.reference_lines(example)
        steps = [s.strip() for s in steps]
        while steps and not steps[-1]:
            steps.pop()
        for i in range(max(len(ref), len(steps))):
            if i >= len(steps) or i >= len(ref) or steps[i] != ref[i]:
                return i
        return None

    def correct_step(self, example: Example, steps: list[str], index: int) -> str:
        """The reference line at `index` (the '#N' line at the end); '' past the end."""
        ref = self.reference_lines(example)
        return ref[index] if index < len(ref) else ""

    def feedback_text(self, example: Example, response: str, detail: str = "step") -> str:
        """Verifier feedback: 'the final answer is wrong', plus '; step k is wrong' (1-based) when detail='step'."""
        text = "the final answer is wrong"
        if detail == "step":
            bad = self.first_wrong_step(example, step_lines(response))
            if bad is not None:
                text += f"; step {bad + 1} is wrong"
        return text


# ------------------------------------------------------------------------------------- the task


def toy_checkpoints(cache_dir: str | None = None, instruct: bool = False) -> dict:
    """Directories of the bootstrapped checkpoints {tokenizer, student, teacher, instruct}; builds them on first use
    (instruct only when asked for)."""
    from components.tasks.bootstrap import ensure_checkpoints

    return ensure_checkpoints(cache_dir, instruct)


def toy_task(
    tiers=(1, 2, 4, 6, 8), train_tiers=(2, 4, 6), eval_per_tier=64, seed=0, train_per_tier=256, with_models=False,
    task: str = DEFAULT_TASK,
) -> Task:
    """The toy Task of the active variant. Eval keys are 'tier<k>'. with_models=True bootstraps (or loads) student/teacher.
    `task`: `chains` (the testbed) or `tools` (the same problems, the prompt announcing the calculator; teachers'
    and judges' question line too)."""
    if task not in TASKS:
        raise ValueError(f"toy task {task!r}: the toy tasks are {', '.join(TASKS)}")
    train = [ex for t in train_tiers for ex in make_examples(t, train_per_tier, seed, "train", task)]
    evals = {f"tier{t}": make_examples(t, eval_per_tier, seed, "eval", task) for t in tiers}
    ckpt = toy_checkpoints() if with_models else {}
    templates = {k: v for k, v in TEMPLATES.items() if k not in ("prompt", "tools")}
    templates["question"] = TEMPLATES[TASKS[task]]
    return Task(
        name="toy" if variant() == DEFAULT_VARIANT else f"toy-{variant()}",
        train=train,
        eval=evals,
        verifier="toy",
        step_checker=ToyStepChecker(),
        student=ckpt.get("student"),
        teacher=ckpt.get("teacher"),
        max_new_tokens=max_new_tokens_for(max(tuple(tiers) + tuple(train_tiers)), task),
        step_split="\n",
        templates=templates,
        sample_train=sample_train_fn(train_tiers, task),
    )


def _record(ex: Example) -> dict:
    return {"prompt": ex.prompt, "problem": ex.problem, "answer": ex.answer, "solution": ex.solution, "tier": ex.tier}


def write_jsonl(out_dir: str, task_or_params=None) -> dict:
    """Write train.jsonl and eval_<tier>.jsonl (prompt/problem/answer/solution/tier); returns {name: path}.

    `task_or_params` is a Task, a dict of toy_task keyword arguments, or None (defaults).
    """
    task = task_or_params if isinstance(task_or_params, Task) else toy_task(**(task_or_params or {}))
    os.makedirs(out_dir, exist_ok=True)
    files = {"train": task.train, **{f"eval_{k.removeprefix('tier')}": v for k, v in task.eval.items()}}
    paths = {}
    for name, exs in files.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with atomic_path(paths[name]) as tmp, open(tmp, "w") as f:  # whole files only, even on a full disk
            f.writelines(json.dumps(_record(ex)) + "\n" for ex in exs)
    return paths
