"""InT against GRPO alone on the bench (issue 41, item 3): the policy samples InT's stage 1 spends (attempts,
proposals, filter continuations) are counted, the GRPO arm is InT's stage 2 alone from the same start and gets
what InT used, seed by seed, and InT's stage-1 counts reach the results. Numbers worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer.bench import methods as b
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent


def test_the_budget_counts_int_attempts_and_no_demonstrations_for_its_sft_steps():
    """int.yaml: stage 1 builds its targets from 30 steps x 8 prompts = 240 problems x 4 attempts = 960 rollouts
    and its steps sample nothing; stage 2 samples 60 x 8 x 8 = 3840. An SFT on references still counts its
    demonstrations (8 per step), GRPO its rollouts."""
    v = validate_file(ROOT / "specs/int.yaml")
    assert [b.samples_per_step(s) for s in v.segments] == [0, 64]
    assert [b.samples_ahead(s) for s in v.segments] == [960, 0]
    assert b.policy_samples(v) == 960 + 3840
    assert b.policy_samples(validate_file(ROOT / "specs/sft.yaml")) == 240 * 8
    assert b.policy_samples(validate_file(ROOT / "specs/grpo.yaml")) == 60 * 64
    # `problems` set on the signal: its attempts no longer follow the steps
    v = validate_file(ROOT / "specs/int.yaml", ["stages.0.signal.problems=10"])
    assert b.samples_ahead(v.segments[0]) == 40
    # the budget scales both stages: 4800 -> 2400 halves them
    assert b.budget_overrides(b.Variant("int", str(ROOT / "specs/int.yaml")), 2400) == [
        "stages.0.train.steps=15", "stages.1.train.steps=30"]


def test_the_grpo_arm_is_int_stage_two_alone_from_the_same_start():
    """'From the same start': the GRPO arm starts from InT's policy (toy:instruct) on InT's training tiers and
    samples, trains and evaluates as InT's stage 2 does."""
    label, spec, ov = b.INT_GRPO
    g = validate_file(ROOT / spec, ov).spec
    i = validate_file(ROOT / "specs/int.yaml").segments[1].spec
    assert b.SUITE["int"] == [("int", "specs/int.yaml", []), b.INT_GRPO] and b.MATCHED == {"int": "int"}
    assert g.policy.model == i.policy.model == "toy:instruct"
    assert list(g.data.train_tiers) == list(i.data.train_tiers)
    for part in ("rollout", "objective", "signal"):
        ours, theirs = getattr(g, part).model_dump(), getattr(i, part).model_dump()
        if part == "rollout":
            ours.pop("guide"), theirs.pop("guide")
            assert i.rollout.guide.kind == g.rollout.guide.kind == "none"
        assert ours == theirs, part
    for key in ("prompts_per_step", "lr", "eval_every", "eval_samples"):
        assert getattr(g.train, key) == getattr(i.train, key), key
    assert b.CLAIMS["int"]["arms"] == {"int": "int", "grpo": label}


def _fake_runs(monkeypatch, used):
    calls = []

    def fake(v, seed, out, cfg):
        calls.append((v.label, seed, cfg["budget_samples"]))
        out.mkdir(parents=True)
        r = {"label": v.label, "study": v.study, "spec": v.spec, "seed": seed, "toy": "mod10", "steps": 1,
             "policy_samples": cfg["budget_samples"], "wall_s": 1.0, "pass@1/tier6": 0.5, "pass@1/tier8": 0.5,
             "run": str(out)}
        r["policy_samples_used"] = used[seed] if v.label == "int" else cfg["budget_samples"]
        return r

    monkeypatch.setattr(b, "run_one", fake)
    monkeypatch.setattr(b, "plots", lambda results, out: [])
    return calls


def test_the_grpo_arm_gets_what_int_used_seed_by_seed(monkeypatch, tmp_path):
    calls = _fake_runs(monkeypatch, {0: 8148.4, 1: 7000})
    variants = [b.Variant(lab, spec, list(ov), study="int") for lab, spec, ov in reversed(b.SUITE["int"])]
    cfg = dict(b.QUICK, seeds=2, budget_samples=4800)
    b.bench(variants, tmp_path, cfg, "cmd", log=lambda m: None)
    grpo = b.INT_GRPO[0]
    # InT first (the others need what it used), at the bench's budget; GRPO at InT's measured samples
    assert calls == [("int", 0, 4800), ("int", 1, 4800), (grpo, 0, 8148), (grpo, 1, 7000)]
    results = json.loads((tmp_path / "results.json").read_text())
    g = [r for r in results if r["label"] == grpo]
    assert [r["budget_samples"] for r in g] == [8148, 7000] and {r["matched_to"] for r in g} == {"int"}
    assert all(r["settings"]["budget_samples"] == 4800 for r in results)  # one bench setting for the study
    calls.clear()
    b.bench(variants, tmp_path, cfg, "again", log=lambda m: None)
    assert calls == []  # every run reused, the matched ones too
    # GRPO alone cannot be run without the arm it is matched to
    with pytest.raises(ValueError, match="matched to 'int'"):
        b.bench(variants[:1], tmp_path / "alone", cfg, "cmd", log=lambda m: None)


def test_a_matched_arm_refuses_a_run_that_counted_no_samples(monkeypatch, tmp_path):
    _fake_runs(monkeypatch, {0: float("nan")})
    variants = [b.Variant(lab, spec, list(ov), study="int") for lab, spec, ov in b.SUITE["int"]]
    with pytest.raises(ValueError, match="counted no policy samples"):
        b.bench(variants, tmp_path, dict(b.QUICK, seeds=1), "cmd", log=lambda m: None)


def test_int_facts_and_token_share_from_a_metrics_log():
    """From hand-made metrics rows: stage 1 trained 40 tokens at 50% and 60 at 10% interventions (26 of 100),
    stage 2 300 tokens of its own (26 of 400 over the run)."""
    rows = [{"step": "0", "offpolicy_token_frac": "0.5", "response_tokens": "40", "int_offline/attempts": "960",
             "int_offline/continuations": "2800", "int_offline/continuation_successes": "267",
             "int_offline/kept_continuations": "440", "int_offline/kept_continuation_successes": "267",
             "int_offline/target_tokens": "642", "int_offline/intervention_tokens": "330"},
            {"step": "1", "offpolicy_token_frac": "0.1", "response_tokens": "60"},
            {"step": "2", "offpolicy_token_frac": "0.0", "response_tokens": "300"},
            {"step": "3", "pass_at_1/tier6": "0.5"}]  # an evaluation-only row
    assert b.token_share(rows) == pytest.approx(26 / 400)
    assert b.token_share(rows[2:]) == 0.0 and b.token_share(rows[3:]) != b.token_share(rows[3:])  # NaN: no tokens
    last = {k: v for r in rows for k, v in r.items() if v not in (None, "")}
    f = b.int_facts(last)
    assert f["int_offline/attempts"] == 960
    assert f["intervention_share_sft"] == pytest.approx(330 / 642)
    assert f["continuation_success"] == pytest.approx(267 / 2800)
    assert f["kept_continuation_success"] == pytest.approx(267 / 440)
    assert b.int_facts({"step": "0", "loss": "1"}) == {}  # GRPO: no stage 1


def test_the_int_verdict_and_its_tables():
    def rows(d_int, noise):
        out = []
        for s, j in enumerate((0.0, noise, -noise)):
            for label, p in (("int", 0.3 + d_int), (b.INT_GRPO[0], 0.3)):
                r = {"label": label, "study": "int", "seed": s, "pass@1/tier6": p + j, "pass@1/tier8": p + j,
                     "pass@32/tier6": 0.6, "pass@32/tier8": 0.6, "policy_samples_used": 8000 + s, "steps": 60,
                     "run": "/nonexistent"}
                if label == "int":
                    r.update({"int_offline/attempts": 960, "int_offline/kept": 55 + s, "intervention_share_sft": 0.5,
                              "continuation_success": 0.1, "kept_continuation_success": 0.6})
                out.append(r)
        return out

    def verdict(rs):
        [v] = b.claim_verdicts(rs)
        return v

    assert verdict(rows(0.2, 0.01))["verdict"] == "reproduced"
    assert verdict(rows(-0.2, 0.01))["verdict"] == "contradicted"
    v = verdict(rows(0.01, 0.2))
    assert v["verdict"] == "undecided" and set(v["extend"]) == {"int", b.INT_GRPO[0]}
    assert v["comparisons"][0][0] == "InT - GRPO" and "InT's kept_continuation_success: 0.600" in v["notes"][-1]
    table = "\n".join(b.study_table(rows(0.2, 0.01), "int"))
    assert "| int | 3 | 0.500 ± 0.025 |" in table  # pass@1/tier6+8 first: 0.5 + (0, 0.01, -0.01)
    assert "| int | 3 | 960.0 ± 0.0 | n/a | n/a | n/a | n/a | 56.0 ± 2.5 |" in table  # kept 55-57: t(2) 4.303
    assert f"| {b.INT_GRPO[0]} | 3 |" in table and table.count("| int | 3 |") == 2


def test_the_int_section_has_its_own_markers(tmp_path):
    """`--readme DIR --study int` writes between the int markers and leaves the methods section as it was."""
    rs = [{"label": lab, "study": "int", "seed": s, "pass@1/tier6": 0.1 * s, "pass@1/tier8": 0.0, "wall_s": 1,
           "policy_samples": 64, "steps": 1, "run": str(tmp_path / "none")}
          for lab in ("int", b.INT_GRPO[0]) for s in (0, 1)]
    out = tmp_path / "bench"
    b.write_outputs(rs, out, dict(b.QUICK, seeds=2), "composer bench --suite seeds --study int")
    (out / "results.json").write_text(json.dumps(rs))
    begin, end = b.markers("int")
    readme = tmp_path / "results.md"
    readme.write_text(f"# R\n\n{b.BEGIN}\nmethods\n{b.END}\n\n{begin}\nold\n{end}\n")
    b.readme_section(out, readme, tmp_path / "docs" / "bench", "int")
    text = readme.read_text()
    assert "methods" in text and "old" not in text and "--study int`" in text and "**" in text
    assert "](docs/bench/int/int.png)" in text and (tmp_path / "docs" / "bench" / "int" / "verdicts.png").exists()


# ------------------------------------------------------------------------------- what the run counts


def test_int_offline_build_counts_each_filter_and_every_policy_sample(tmp_path):
    """Two attempts at 5-1+2+3 (5-1=4 / 4+2=6 / 6+3=9 / #9), both wrong at step 2; the policy proposes 4 answers
    per failed attempt: one states the answer (a leak), one is wrong (no continuation succeeds), one is right
    (both continuations succeed), one is unreadable. Per attempt: 3 readable proposals, 1 leaked, 2 tested, 4
    continuations of which 2 succeed, all from the kept one. Policy samples: 2 attempts + 8 proposals + 8
    continuations = 18."""
    from test_guides import END, FakeEngine, make_ctx

    from components.signals.sft import SftSignal, attempt_program, collect_targets
    from components.tasks import toy

    ex = toy.make_example("5-1+2+3")
    replies = ["REVISE 3\n#9", "REVISE 2\n4+2=5", "REVISE 2\n4+2=6", "no idea"]
    k = iter(range(10 ** 6))
    eng = FakeEngine(err={1}, judge=lambda text: replies[next(k) % 4])
    guide = END.replace("control_samples: 1", "control_samples: 0, proposals: 4, proposal_tokens: 40")
    ctx = make_ctx(tmp_path, guide, eng, n=2, baseline="all", judge="{kind: policy_model, model: self, context: [reference]}")
    sig = SftSignal(target="guided", filter_samples=2)
    ctx.costs["policy_samples"] += 2  # as offline_targets counts its attempts
    statuses = ctx.run([attempt_program(ctx, sig, ex, i, 2) for i in range(2)])
    targets, counts = collect_targets([ex], statuses, 2)
    assert [s for s, _c, _f in statuses] == ["kept", "kept"]
    assert {k: counts[k] for k in ("attempts", "failed", "interventions", "leaks", "filtered", "kept", "proposals",
                                   "leaked_proposals", "tested_proposals", "continuations", "continuation_successes",
                                   "kept_continuations", "kept_continuation_successes")} == {
        "attempts": 2, "failed": 2, "interventions": 2, "leaks": 0, "filtered": 0, "kept": 2, "proposals": 6,
        "leaked_proposals": 2, "tested_proposals": 4, "continuations": 8, "continuation_successes": 4,
        "kept_continuations": 4, "kept_continuation_successes": 4}
    # the kept target: the right step 1 (6 tokens) + the intervention "4+2=6\n" (6 tokens), twice
    assert counts["target_tokens"] == 24 and counts["intervention_tokens"] == 12
    assert len(targets[ex.prompt]) == 2
    assert ctx.costs["policy_samples"] == 2 + 8 + 8


def test_a_rollout_counts_one_sample_per_row_however_many_calls_it_takes(tmp_path):
    """A chunked guide asks the engine twice per row (tests/test_guides.py CHUNK): 4 rows are 4 samples."""
    from test_guides import CHUNK, EX, FakeEngine, make_ctx

    eng = FakeEngine(err={1})
    ctx = make_ctx(tmp_path, CHUNK, eng)
    ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    assert len(eng.calls) == 2 and ctx.costs["policy_samples"] == 4  # the oracle judge writes nothing


def test_batch_metrics_count_response_tokens():
    from components.tasks import toy
    from composer.origins import CODE
    from composer.protocol import Trace
    from composer.step import batch_facts
    from composer.trajectory import assemble

    ex = toy.make_example("1+2")
    a, b_ = Trace([1, 2]), Trace([1, 2])
    a.add([5, 6, 7], "policy")
    b_.add([5], "policy")
    b_.add([8, 9], "guide_intervention")
    batch = assemble([a, b_], [ex, ex], [0, 0], 0)
    m = batch_facts(batch)
    assert m["response_tokens"] == 6 and m["offpolicy_token_frac"] == pytest.approx(2 / 6)
    assert int((batch.origin == CODE["guide_intervention"]).sum()) == 2


def test_the_plots_put_an_evaluation_at_the_samples_drawn_before_it():
    """Row s's evaluation is of the weights before step s's update; cost/policy_samples is logged after step s's
    rollout. InT: step 0 builds its targets (4308 samples) and evaluates the start; the final row only evaluates."""
    rows = [{"step": "0", "cost/policy_samples": "4308", "pass_at_1/tier8": "0.1"},
            {"step": "1", "cost/policy_samples": "4308"},
            {"step": "2", "cost/policy_samples": "4372"},
            {"step": "3", "pass_at_1/tier8": "0.2"}]
    assert b.samples_before(rows) == {0: 0.0, 1: 4308.0, 2: 4308.0, 3: 4372.0}
    assert b.samples_before([{"step": "0", "loss": "1"}]) == {}  # an older log: the plot falls back to steps
