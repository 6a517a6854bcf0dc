"""InT trains, as published, on the toy testbed (issue 41): specs/int.yaml's policy is toy:instruct, the student
taught InT's proposer task (components/tasks/bootstrap.py INSTRUCT_SFT), so stage 1 keeps targets that pass the
paper's filters (leak filter, a successful continuation, K = 4 proposals) and both stages move the weights."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["stages.0.train.steps=3", "stages.1.train.steps=1", "train.eval_every=0",
         "train.eval_samples=2", "train.samples_every=0", "train.checkpoint_every=1000", "train.loggers=[csv]"]


def test_the_toy_proposal_prompt_is_the_one_the_composer_renders():
    """bootstrap trains the proposer on toy.proposal_prompt: the text composer/prompts.py renders for InT's
    proposer (context: the reference solution) on the toy task."""
    from components.tasks import bootstrap, toy
    from composer.prompts import TASK_FORMAT, proposal_prompt

    spec = validate_file(ROOT / "specs" / "int.yaml").spec
    cfg = spec.sources[spec.rollout.guide.judge]
    kinds = {c: spec.sources[c].kind for c in cfg.context}
    task = toy.toy_task(train_per_tier=2, eval_per_tier=1)
    rng = random.Random(0)
    for ex in task.train:
        steps = bootstrap.failed_attempt(rng, ex)
        texts = {c: ex.solution for c in cfg.context}
        assert proposal_prompt(task, cfg, kinds, ex, steps, texts, TASK_FORMAT) == toy.proposal_prompt(ex, steps)
        target = toy.proposal_target(ex, steps)
        assert target.startswith("REVISE ")


def test_failed_attempts_fail_and_never_come_from_the_eval_split():
    from components.tasks import bootstrap, toy
    from components.tasks.verifiers import toy_verifier

    rng = random.Random(1)
    for _ in range(300):
        prompt, target = bootstrap.proposal_pair(rng, bootstrap.PROPOSAL_TIERS)
        problem = prompt.split("J:", 1)[1].split("\n", 1)[0]
        assert toy.split_of(problem) == "train"
        steps = [line.split(":", 1)[1] for line in prompt.split("N:\n", 1)[1].split("\nV:")[0].split("\n")]
        assert toy_verifier("\n".join(steps), toy.make_example(problem)).reward == 0.0
        k, line = toy.parse_judge(target)
        assert 1 <= k <= len(steps) and steps[k - 1] != line


def _instruct_proposals():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from components.tasks import bootstrap, toy

    path = bootstrap.ensure_checkpoints()["instruct"]
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    rng = random.Random(7)
    attempts = [(ex, bootstrap.failed_attempt(rng, ex)) for t in (3, 4, 5, 6) for ex in toy.make_examples(t, 4, 7, "eval")]
    return model, tok, attempts


def test_the_instruct_checkpoint_answers_in_the_proposal_format():
    """toy:instruct's greedy proposals on held-out failed attempts (eval-split chains: never trained on) are all
    readable 'REVISE k' + a line, as the InT guide parses them (the student's were unreadable or KEEP)."""
    from components.guides.judges import REVISE, parse_proposal
    from components.tasks import bootstrap, toy

    model, tok, attempts = _instruct_proposals()
    outs = bootstrap.generate_greedy(model, tok, [toy.proposal_prompt(ex, steps) for ex, steps in attempts], 24)
    assert all(parse_proposal(o, len(steps), "\n").kind == REVISE for (_, steps), o in zip(attempts, outs)), outs


@pytest.mark.xfail(strict=True, reason="issue 41, open: toy:instruct (INSTRUCT_SFT, 800 updates) names the first "
                   "wrong step and its right line on 3-15% of held-out failed attempts, not a majority")
def test_the_instruct_checkpoint_finds_the_first_error_of_most_held_out_attempts():
    from components.tasks import bootstrap

    model, tok, attempts = _instruct_proposals()
    assert bootstrap.proposal_accuracy(model, tok, attempts) > 0.5


def test_int_stage_one_keeps_targets_and_both_stages_move_the_weights(tmp_path, monkeypatch):
    """specs/int.yaml cut short (stage 1: 3 steps; stage 2: 1 step): the offline targets keep at least one
    proposal, stage 1's loss is not zero, and each stage changes the weights (the run's own per-segment
    fingerprints, composer/runtime/vacuous.py; --strict would stop a segment that trained on nothing)."""
    from composer.backends.lightning.run import train
    from composer.runtime import vacuous

    prints = []
    real = vacuous.fingerprint

    def fingerprint(model):
        prints.append(real(model))
        return prints[-1]

    monkeypatch.setattr(vacuous, "fingerprint", fingerprint)
    events = []
    train(validate_file(ROOT / "specs" / "int.yaml", SHORT), tmp_path, progress=False, strict=True,
          recorder=lambda kind, **data: events.append((kind, data)) if kind == "int_targets" else None)
    [(_, built)] = events
    assert built["counts"]["kept"] >= 1, built["counts"]
    assert (tmp_path / "int_targets" / "sft.jsonl").exists()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    stage1 = [float(r["loss"]) for r in rows if int(r["step"]) < 3]
    assert len(stage1) == 3 and any(x > 0 for x in stage1), stage1
    assert len(prints) == 4 and prints[0] != prints[1] and prints[2] != prints[3]
