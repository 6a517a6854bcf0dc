"""InT as published (issue 16): the SFT targets are built once, before the SFT stage, from the weights at
that point; cached in the run folder; counted in the cost columns; an intervention that states the final
answer is dropped (counted). The online variant (targets rebuilt every step) stays an explicit option."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from _helpers import REPO

from components.signals.sft import _load, leaks
from composer.origins import CODE
from composer.protocol import Trace
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["sources.oracle.kind=oracle", "rollout.guide.judge=oracle", "stages.0.train.steps=3", "stages.1.train.steps=1",
         "train.prompts_per_step=4", "train.eval_every=0", "train.eval_samples=2", "stages.0.signal.filter_samples=0",
         "train.checkpoint_every=1000"]


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, kind, **data):
        self.events.append((kind, data))


def run(tmp_path, extra=()):
    from composer.backends.lightning.run import train

    rec = Recorder()
    train(validate_file(ROOT / "specs" / "int.yaml", SHORT + list(extra)), tmp_path / "run", progress=False, recorder=rec)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    return rec.events, rows


def test_targets_are_built_once_before_the_sft_stage_and_cached(tmp_path):
    events, rows = run(tmp_path)
    built = [e for k, e in events if k == "int_targets"]
    assert len(built) == 1 and built[0]["step"] == 0  # once, when the stage starts
    counts = built[0]["counts"]
    assert counts["problems"] == 12 and counts["attempts"] == 48  # 3 steps x 4 prompts, 4 attempts each
    assert counts["kept"] > 0
    # no rollout during the SFT stage: its steps read the targets; the RL stage samples as usual
    assert {e["step"] for k, e in events if k == "rollout"} == {3}
    # each SFT step trains on the targets of its own problems, built from the weights at the start
    targets = built[0]["targets"]
    for k, e in events:
        if k == "term_loss" and e["step"] < 3:
            b = e["batch"]
            if b.seq_weight is None or b.seq_weight.any():
                assert all(ex.prompt in targets for ex in b.examples)
                assert not (b.origin == CODE["demonstration"]).any() and (b.origin == CODE["guide_intervention"]).any()
    # cached in the run folder: the file reads back as the same targets
    cached = _load(tmp_path / "run" / "int_targets" / "sft.jsonl")
    assert {p: [t.tokens for t in ts] for p, ts in cached.items()} == {p: [t.tokens for t in ts] for p, ts in targets.items()}
    # the attempts count in the cost columns from step 0, although no step of the stage samples
    assert float(rows[0]["cost/policy_tokens"]) > 0
    assert float(rows[0]["int_offline/kept"]) == counts["kept"]


def test_online_targets_stay_an_option(tmp_path):
    events, rows = run(tmp_path, ["stages.0.signal.targets=online"])
    assert not [e for k, e in events if k == "int_targets"]
    assert {e["step"] for k, e in events if k == "rollout"} == {0, 1, 2, 3}  # rebuilt from every step's rollouts
    assert "sft_leaks" in rows[0]


def test_an_intervention_that_states_the_final_answer_is_a_leak():
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer
    from composer.runtime.context import RunContext

    tok = char_tokenizer()
    ctx = RunContext(task=toy.toy_task(), tokenizer=tok, policy=None, engine=None,
                     spec=validate_file(ROOT / "specs" / "int.yaml").segments[0].spec)
    ex = toy.make_example("7+3-5")  # 7+3=0, 0-5=5, #5

    def trace(policy: str, intervention: str):
        t = Trace(tok.encode(ex.prompt, add_special_tokens=False))
        t.add(tok.encode(policy, add_special_tokens=False), "policy")
        t.add(tok.encode(intervention, add_special_tokens=False), "guide_intervention")
        return t

    assert leaks(ctx, ex, trace("7+3=0\n0-5=5\n", "#5"))  # the correction hands over the answer
    # InT's filter: any intervention containing the gold answer (5) is dropped, even a right step
    assert leaks(ctx, ex, trace("7+3=0\n", "0-5=5"))
    assert not leaks(ctx, ex, trace("", "7+3=0"))  # a corrected step without the answer: the policy has to finish
    ex2 = toy.make_example("7+3-5+8")  # answer 3: '13' or '3.5' do not contain it, '=3' does
    assert not leaks(ctx, ex2, trace("", "x=13")) and not leaks(ctx, ex2, trace("", "x=3.5"))
    assert leaks(ctx, ex2, trace("", "x=3"))


def test_the_first_proposal_that_survives_the_filters_is_kept():
    """InT's K proposals per failed attempt: a proposal containing the answer is dropped, one from which no
    continuation succeeds is filtered, and the first that passes both is the target (prefix + intervention)."""
    from components.signals.sft import target_program
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer
    from composer.runtime.context import RunContext
    from composer.protocol import Generation, drive

    tok = char_tokenizer()
    ctx = RunContext(task=toy.toy_task(), tokenizer=tok, policy=None, engine=None,
                     spec=validate_file(ROOT / "specs" / "int.yaml").segments[0].spec)
    ex = toy.make_example("7+3-5+1")  # 7+3=0, 0-5=5, 5+1=6, #6
    enc = lambda text: tok.encode(text, add_special_tokens=False)
    attempt = enc("7+3=0\n0-5=1\n1+1=2\n#2")
    trace = Trace(enc(ex.prompt), guided=True)
    trace.add(attempt[:6], "policy", [-0.5] * 6)  # what the rollout kept: step 1 and the first proposal
    trace.add(enc("#6\n"), "guide_intervention")
    trace.notes.update(attempt={"tokens": attempt, "logprobs": [-0.5] * len(attempt)}, proposals=[
        {"keep": 6, "correction": "#6"},  # states the answer: a leak
        {"keep": 6, "correction": "0-5=4"},  # wrong: no continuation succeeds
        {"keep": 6, "correction": "0-5=5"},  # kept
        {"keep": 0, "correction": "7+3=0"}])  # never tried

    def serve(key, requests):
        assert key[0] == "sample" and key[3] == "filter"
        out = []
        for r in requests:
            good = tok.decode(r.tokens).endswith("0-5=5\n")
            out.append([Generation(enc("5+1=6\n#6" if good else "4+1=5\n#5") + [tok.eos_token_id], True)] * r.n)
        return out

    [(status, cut)] = drive([target_program(ctx, ex, trace, filter_samples=2)], serve)
    assert status == "kept"
    assert tok.decode(cut.response) == "7+3=0\n0-5=5\n"
    assert [p.origin for p in cut.pieces] == ["policy", "guide_intervention"] and cut.pieces[0].logprobs == [-0.5] * 6
    [(status, _)] = drive([target_program(ctx, ex, trace, filter_samples=2)], lambda k, rs: [
        [Generation(enc("#0"), True)] * r.n for r in rs])
    assert status == "filtered"


def test_a_proposal_holds_verification_error_and_intervention_in_one_answer():
    from components.guides.judges import KEEP, MALFORMED, REVISE, parse_proposal

    d = parse_proposal("Step 1 checks out.\nStep 2 subtracts wrongly.\nREVISE 2\n0-5=5\n5+1=6", 4, "\n")
    assert (d.kind, d.index, d.correction) == (REVISE, 1, "0-5=5")
    d = parse_proposal("REVISE 1\nfirst\n\nREVISE 3\nWe should add 4.\n\nrest", 3, "\n\n")  # the last tag counts
    assert (d.kind, d.index, d.correction) == (REVISE, 2, "We should add 4.")
    assert parse_proposal("KEEP", 3, "\n").kind == KEEP
    assert parse_proposal("REVISE 9\nx", 3, "\n").kind == MALFORMED  # no such step
    assert parse_proposal("REVISE 2\n", 3, "\n").kind == MALFORMED  # no intervention


@pytest.mark.slow
def test_the_toy_settings_yield_targets(tmp_path):
    """int.yaml as shipped (the policy proposes, 4 sampled proposals, the leak filter, 8 continuations) builds
    SFT targets on the toy testbed: the stage trains on something (32 problems x 4 attempts here)."""
    from composer.backends.lightning.run import train

    rec = Recorder()
    v = validate_file(ROOT / "specs" / "int.yaml", ["stages.0.train.steps=1", "stages.1.train.steps=1",
                                                    "stages.0.signal.problems=32", "train.eval_every=0",
                                                    "train.eval_samples=2", "train.checkpoint_every=1000"])
    train(v, tmp_path / "run", progress=False, recorder=rec)
    [built] = [e for k, e in rec.events if k == "int_targets"]
    counts = built["counts"]
    assert counts["attempts"] == 128 and counts["interventions"] > 0, counts
    assert counts["kept"] > 0, counts


# ------------------------------------------------------------------- a tampered int_targets cache is refused (issue 29)


def _int_cache(tmp_path):
    from types import SimpleNamespace

    from components.signals.sft import _header, _line
    from composer.protocol import Trace
    from composer.checks.validate import validate_file

    sig = validate_file(REPO / "specs" / "int.yaml").segments[0].spec.signal
    ctx = SimpleNamespace(segment="sft")
    body = ""
    for prompt, toks in (("1+2", [5, 6, 7]), ("3+4", [8, 9])):
        t = Trace([1, 2, 3], control=False, guided=True)
        t.add(toks, "guide_intervention", [None] * len(toks))
        body += _line(prompt, t)
    path = tmp_path / "int_targets" / "sft.jsonl"
    path.parent.mkdir()
    path.write_text(_header(body, ctx, sig) + body)
    return path, ctx, sig


def _edit_token(text):
    return text.replace("[5, 6, 7]", "[5, 6, 9]")


TAMPER = {
    "emptied": lambda p: p.write_text(""),
    "edited": lambda p: p.write_text(_edit_token(p.read_text())),
    "duplicated": lambda p: p.write_text(p.read_text() + p.read_text().splitlines(keepends=True)[1]),
    "over_long": lambda p: p.write_text(p.read_text().replace("[5, 6, 7]", "[" + ", ".join(["5"] * 5000) + "]")),
    "no_header": lambda p: p.write_text("".join(p.read_text().splitlines(keepends=True)[1:])),
    "fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "symlink": lambda p: (p.rename(p.with_name("real.jsonl")), p.symlink_to(p.with_name("real.jsonl"))),
    "garbage_row": lambda p: p.write_text(p.read_text() + "{\"prompt\": 3}\n"),
}


@pytest.mark.parametrize("how", sorted(TAMPER))
def test_a_tampered_int_targets_cache_is_refused(tmp_path, how):
    from components.signals.sft import _load
    from composer.runtime.binding import DataError

    path, ctx, sig = _int_cache(tmp_path)
    assert sorted(_load(path, ctx, sig)) == ["1+2", "3+4"]  # as written: read back
    TAMPER[how](path)
    with pytest.raises(DataError, match="InT's cached targets"):
        _load(path, ctx, sig)


def test_an_int_targets_cache_of_another_signal_is_refused(tmp_path):
    from types import SimpleNamespace

    from components.signals.sft import _load
    from composer.runtime.binding import DataError

    path, ctx, sig = _int_cache(tmp_path)
    with pytest.raises(DataError, match="built for another segment or signal"):
        _load(path, SimpleNamespace(segment="other"), sig)
