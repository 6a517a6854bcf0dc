"""Judges for the intervention guide: who reviews a policy's steps and writes the correction.

A judge decides about one row at a time as a protocol program (composer/protocol.py):
`decide(ctx, example, accepted, new, trace)` returns a `Decision`: KEEP, REVISE at index j (0-based
within the new steps) with a correction (one step), or MALFORMED (an unreadable answer, acted on as
KEEP and counted).

  oracle         the task's step checker (toy: ToyStepChecker): the first wrong step and its right
                 text; no model, no request.
  policy_model   review end (InT): `propose`, K sampled answers to one prompt (the attempt's steps numbered,
                 the declared context, the gold answer), each with its verification, the first error and
                 the intervention (`parse_proposal`). review chunk (MInTRL):
                 two greedy calls, as MInTRL's notes describe (Chen et al. 2026, Algorithm 1): a verdict
                 on the judge prompt (problem, accepted steps, the new steps numbered, declared context;
                 the user message of the policy's prompt format, e.g. its chat template)
                 whose first line is exactly "KEEP" or "REVISE k"; after REVISE k, the correction,
                 generated from the judge's context prompt followed by the kept steps only (the wrong step
                 and what came after it are never shown), cut at the first step separator. `model: self`
                 runs on the rollout weights (weights: current) or the frozen initial policy (initial); an
                 external model on its own weights.

No torch at import: validation imports the guides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from composer.protocol import Sample

KEEP, REVISE, MALFORMED = "keep", "revise", "malformed"
VERDICT_TOKENS = 16  # "REVISE 12" and an end of line, with room to spare


@dataclass
class Decision:
    kind: str  # keep | revise | malformed
    index: int = -1  # revise: first wrong step, 0-based within the new steps
    correction: str = ""  # revise: the right text of that step (without separator)


def parse_verdict(text: str, n_new: int) -> Decision:
    """Strict parse of a verdict's first line: exactly 'KEEP', or 'REVISE k' with 1 <= k <= n_new."""
    head = text.strip().split("\n", 1)[0].strip()
    if head == "KEEP":
        return Decision(KEEP)
    m = re.fullmatch(r"REVISE (\d+)", head)
    if m and 1 <= int(m.group(1)) <= n_new:
        return Decision(REVISE, int(m.group(1)) - 1)
    return Decision(MALFORMED)


def parse_correction(text: str, step_split: str) -> str:
    """The correction: the text up to the first step separator, stripped ('' when there is none)."""
    return text.split(step_split)[0].strip()


def parse_proposal(text: str, n_steps: int, step_split: str) -> Decision:
    """InT's one-answer proposal (Yang et al. 2026, arXiv 2601.14209): any verification text, then a line
    'REVISE k' (the first critical error, 1 <= k <= n_steps; the last such line counts, as InT takes the last
    tag), then the intervention: the text after it up to the step separator. 'KEEP' alone on the first line:
    no error found. Anything else, or an empty intervention, is MALFORMED."""
    lines = text.split("\n")
    for j in range(len(lines) - 1, -1, -1):
        m = re.fullmatch(r"REVISE (\d+)", lines[j].strip())
        if m and 1 <= int(m.group(1)) <= n_steps:
            correction = parse_correction("\n".join(lines[j + 1:]).lstrip("\n"), step_split)
            return Decision(REVISE, int(m.group(1)) - 1, correction) if correction else Decision(MALFORMED)
    return Decision(KEEP) if text.strip().split("\n", 1)[0].strip() == "KEEP" else Decision(MALFORMED)


class OracleJudge:
    """The task's programmatic step checker as a judge (no model, no tokens)."""

    def __init__(self, checker):
        self.checker = checker

    def decide(self, ctx, example, accepted: list[str], new: list[str], trace):
        steps = accepted + new
        bad = self.checker.first_wrong_step(example, steps)
        if bad is None or not len(accepted) <= bad < len(steps):
            return Decision(KEEP)
        return Decision(REVISE, bad - len(accepted), self.checker.correct_step(example, steps[:bad], bad))
        yield  # noqa: unreachable - a program that asks for nothing

    def propose(self, ctx, example, steps: list[str], trace, n: int, max_tokens: int):
        """The checker's one proposal for a finished attempt (deterministic: n copies would be equal)."""
        d = yield from self.decide(ctx, example, [], steps, trace)
        return [d]


class ModelJudge:
    """A policy_model source as a judge: a verdict call, then a correction call on the kept prefix."""

    def __init__(self, ctx, name: str, guide):
        from composer.protocol import INITIAL, POLICY

        self.name, self.cfg, self.guide = name, ctx.spec.sources[name], guide
        self.model = (POLICY if self.cfg.weights == "current" else INITIAL) if self.cfg.is_self else name
        self.tok = ctx.tokenizer if self.cfg.is_self or self.cfg.shares_tokenizer else ctx.source(name).tokenizer
        self.kinds = {c: ctx.spec.sources[c].kind for c in self.cfg.context}
        self.fmt = ctx.prompt_format(self.tok)  # the judge's prompts rendered like the policy's, with its tokenizer

    def texts(self, ctx, example) -> dict[str, str | None]:
        """The judge's context texts for a problem (judges read per-problem sources only)."""
        return {c: ctx.source(c).example_text(example) for c in self.cfg.context}

    def renders(self, ctx, example, accepted: list[str], new: list[str], kept: list[str]):
        """(verdict, correction) prompt functions of the context texts (placement checks use them too)."""
        from composer.prompts import Render, correction_prompt, judge_prompt, which_template

        task, cfg, split, fmt = ctx.task, self.cfg, self.guide.step_split, self.fmt
        verdict = Render(lambda t: judge_prompt(task, cfg, self.kinds, example, accepted, new, split, t, fmt),
                         list(cfg.context), which_template(task, cfg, "judge", self.kinds))
        correction = Render(lambda t: correction_prompt(task, cfg, self.kinds, example, kept, split, t, fmt),
                            list(cfg.context), which_template(task, cfg, "correction", self.kinds))
        return verdict, correction

    def ask(self, ctx, text: str, max_tokens: int, trace, usage: str, texts):
        """One greedy call of the judge model; the prompt it saw is recorded on the trace."""
        ids = self.tok.encode(text, add_special_tokens=False)
        trace.note(f"judge_{usage}_prompt", text)
        ctx.record("prompt", source=self.name, usage=f"judge_{usage}", text=text, context=texts)
        [gen] = yield Sample(ids, max_tokens, model=self.model, greedy=True, purpose="judge")
        return self.tok.decode(gen.tokens, skip_special_tokens=True)

    def proposal_render(self, ctx, example, steps: list[str]):
        """The proposal prompt function of the context texts (InT): the failed attempt's steps numbered."""
        from composer.prompts import Render, proposal_prompt, which_template

        task, cfg, fmt = ctx.task, self.cfg, self.fmt
        return Render(lambda t: proposal_prompt(task, cfg, self.kinds, example, steps, t, fmt),
                      list(cfg.context), which_template(task, cfg, "proposal", self.kinds))

    def propose(self, ctx, example, steps: list[str], trace, n: int, max_tokens: int):
        """InT's proposer: n sampled answers to one prompt showing the problem, the declared context (the
        reference solution), the gold answer and the failed attempt in numbered steps; each answer writes
        its verification, the first error and the intervention (`parse_proposal`). -> n Decisions."""
        texts = self.texts(ctx, example)
        text = self.proposal_render(ctx, example, steps)(texts)
        ids = self.tok.encode(text, add_special_tokens=False)
        trace.note("judge_proposal_prompt", text)
        ctx.record("prompt", source=self.name, usage="judge_proposal", text=text, context=texts)
        gens = yield Sample(ids, max_tokens, n=n, model=self.model, greedy=False, purpose="judge")
        answers = [self.tok.decode(g.tokens, skip_special_tokens=True) for g in gens]
        out = [parse_proposal(a, len(steps), self.guide.step_split) for a in answers]
        trace.note("verdicts", f"{sum(d.kind == REVISE for d in out)}/{n} proposals")
        return out

    def decide(self, ctx, example, accepted: list[str], new: list[str], trace):
        texts = self.texts(ctx, example)
        verdict_of, _ = self.renders(ctx, example, accepted, new, [])
        answer = yield from self.ask(ctx, verdict_of(texts), VERDICT_TOKENS, trace, "verdict", texts)
        d = parse_verdict(answer, len(new))
        trace.note("verdicts", answer.strip().split("\n", 1)[0])
        if d.kind != REVISE:
            return d
        _, correction_of = self.renders(ctx, example, accepted, new, accepted + new[: d.index])
        text = yield from self.ask(ctx, correction_of(texts), self.guide.max_correction_tokens, trace, "correction",
                                   texts)
        d.correction = parse_correction(text, self.guide.step_split)
        return d if d.correction else Decision(MALFORMED)


def make_judge(ctx, name: str, guide):
    """The judge of source `name` for `guide`, built once per run and configuration."""
    cfg = ctx.spec.sources[name]
    key = (name, cfg.model_dump_json(), guide.model_dump_json())
    judges = ctx.memo.judges
    if key not in judges:
        if cfg.kind == "oracle":
            if ctx.task.step_checker is None:
                raise ValueError(f"judge '{name}' is an oracle, but the task '{ctx.task.name}' has no step checker")
            judges[key] = OracleJudge(ctx.task.step_checker)
        else:
            judges[key] = ModelJudge(ctx, name, guide)
    return judges[key]


def check_judge_placement(ctx, name: str, guide) -> None:
    """Before training: the judge's verdict and correction prompts place every declared context."""
    from composer.data import Example
    from composer.prompts import check_placement

    if ctx.spec.sources[name].kind == "oracle":
        return
    judge = make_judge(ctx, name, guide)
    ex = ctx.task.train[0] if ctx.task.train else Example(prompt="?", answer="?")
    verdict, correction = judge.renders(ctx, ex, ["a"], ["b"], ["a"])
    if guide.review == "end":  # InT: one proposal prompt instead of a verdict and a correction
        check_placement(name, "proposal", judge.proposal_render(ctx, ex, ["a", "b"]))
        return
    check_placement(name, "judge verdict", verdict)
    check_placement(name, "judge correction", correction)
