"""Judges for the intervention guide: who reviews a policy's steps and writes the correction.

A judge reviews a batch of items at once. Each item is (example, accepted steps, new steps); the
answer per item is a `Decision`: KEEP, or REVISE at index j (0-based within the new steps) with a
correction text (one step), or MALFORMED (an unreadable model answer, acted on as KEEP and counted).

  oracle         the task's step checker (toy: ToyStepChecker): the first wrong step and its right
                 text; interventions are correct by construction.
  policy_model   a language model prompted with the task's 'judge' template (or the source's own
                 `template`): "KEEP" or "REVISE <k>\\n<correction>", k 1-based within the new steps.
                 `model: self` generates with the rollout engine (weights: current) or the frozen
                 initial policy (weights: initial); another model is loaded once from its directory.

No torch at import: validation imports the guides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEEP, REVISE, MALFORMED = "keep", "revise", "malformed"


@dataclass
class Decision:
    kind: str  # keep | revise | malformed
    index: int = -1  # revise: first wrong step, 0-based within the new steps
    correction: str = ""  # revise: the right text of that step (without separator)


def parse_decision(text: str, n_new: int, step_split: str) -> Decision:
    """Strict parse of a judge answer: exactly 'KEEP', or 'REVISE k' (1 <= k <= n_new) then the correction.

    The correction is the text after the first line up to the first `step_split` (one step).
    Anything else is MALFORMED.
    """
    text = text.strip()
    if text == "KEEP":
        return Decision(KEEP)
    head, _, rest = text.partition("\n")
    m = re.fullmatch(r"REVISE (\d+)", head.strip())
    correction = rest.split(step_split)[0]
    if m and 1 <= int(m.group(1)) <= n_new and correction.strip():
        return Decision(REVISE, int(m.group(1)) - 1, correction.strip())
    return Decision(MALFORMED)


class OracleJudge:
    """The task's programmatic step checker as a judge (no model, no tokens)."""

    def __init__(self, checker):
        self.checker = checker

    def review(self, ctx, items: list[tuple], step_split: str) -> list[Decision]:
        out = []
        for ex, accepted, new in items:
            steps = accepted + new
            bad = self.checker.first_wrong_step(ex, steps)
            if bad is None or not len(accepted) <= bad < len(steps):
                out.append(Decision(KEEP))
                continue
            out.append(Decision(REVISE, bad - len(accepted), self.checker.correct_step(ex, steps[:bad], bad)))
        return out


class ModelJudge:
    """A policy_model source as a judge: one batched greedy generate call per review round."""

    def __init__(self, ctx, name: str, cfg, max_correction_tokens: int):
        self.name, self.cfg = name, cfg
        self.template = cfg.template or ctx.task.templates.get("judge")
        if not self.template:
            raise ValueError(f"judge '{name}': the task has no 'judge' template; give the source a `template` "
                             "with {problem}, {accepted}, {steps}")
        self.max_tokens = 16 + 2 * max_correction_tokens  # "REVISE k" head + the correction (+ slack for EOS)
        self.model, self.tok = None, ctx.tokenizer
        if cfg.model != "self":
            from composer.runtime.models import load_model, load_tokenizer, resolve

            self.model = load_model(resolve(cfg.model)).eval().requires_grad_(False)
            if not cfg.shares_tokenizer:
                self.tok = load_tokenizer(resolve(cfg.model))

    def prompt(self, ctx, ex, accepted: list[str], new: list[str], step_split: str) -> str:
        """The judge template filled with the problem, the accepted steps, the numbered new steps and context."""
        fields = {"problem": ex.problem, "accepted": step_split.join(accepted),
                  "steps": "\n".join(f"{i + 1}:{s}" for i, s in enumerate(new))}
        for src in self.cfg.context:  # privileged context the template may show ({reference}, ...)
            rt = ctx.source(src)
            if hasattr(rt, "text"):
                fields[src] = rt.text(ex)
        return self.template.format_map(_Blank(fields))

    def generate(self, ctx, prompts: list[list[int]]):
        from composer.runtime.engine import Sampling, hf_generate

        greedy = Sampling(greedy=True)
        if self.model is not None:
            return hf_generate(self.model, self.tok, prompts, self.max_tokens, greedy)
        if self.cfg.weights == "initial":
            return hf_generate(ctx.initial_policy(), self.tok, prompts, self.max_tokens, greedy)
        return ctx.engine.generate(prompts, self.max_tokens, greedy)  # the rollout weights

    def review(self, ctx, items: list[tuple], step_split: str) -> list[Decision]:
        if not items:
            return []
        prompts = [self.tok.encode(self.prompt(ctx, ex, acc, new, step_split), add_special_tokens=False)
                   for ex, acc, new in items]
        gens = self.generate(ctx, prompts)
        ctx.costs["judge_tokens"] += sum(len(p) for p in prompts) + sum(len(g.tokens) for g in gens)
        texts = [self.tok.decode(g.tokens, skip_special_tokens=True) for g in gens]
        return [parse_decision(t, len(new), step_split) for t, (_ex, _acc, new) in zip(texts, items)]


class _Blank(dict):
    """format_map dict that leaves unknown {fields} empty instead of raising."""

    def __missing__(self, key):
        return ""


def make_judge(ctx, name: str, max_correction_tokens: int):
    """The judge runtime for source `name`, built once per run and config."""
    cfg = ctx.spec.sources[name]
    key = ("judge", name, cfg.model_dump_json(), max_correction_tokens)
    if key not in ctx.runtimes:
        if cfg.kind == "oracle":
            if ctx.task.step_checker is None:
                raise ValueError(f"judge '{name}' is an oracle, but the task '{ctx.task.name}' has no step checker")
            ctx.runtimes[key] = OracleJudge(ctx.task.step_checker)
        else:
            ctx.runtimes[key] = ModelJudge(ctx, name, cfg, max_correction_tokens)
    return ctx.runtimes[key]
