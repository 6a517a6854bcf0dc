"""`composer bench` on a tiny random model: equal budgets, the files it writes, sweeps."""

from __future__ import annotations

import csv
from pathlib import Path

from composer.bench import methods as b

ROOT = Path(__file__).resolve().parent.parent


def test_budget_is_equal_across_methods_and_stages():
    for spec in ("specs/grpo.yaml", "specs/sft.yaml", "specs/int.yaml", "specs/mintrl.yaml"):
        v = b.Variant(spec, str(ROOT / spec))
        over = b.budget_overrides(v, 512)
        from composer.checks.validate import validate_file

        val = validate_file(v.spec, over)
        used = b.policy_samples(val)  # InT: its stage 1's attempts and its stage 2's rollouts
        per_step = max(b.samples_per_step(s) for s in val.segments)
        assert abs(used - 512) <= per_step * len(val.segments), (spec, used)
    # by hand: GRPO samples 8 prompts x 8 = 64 per step, so 512 samples are 8 steps; MInTRL 4 x 16 = 64 per
    # step over 500 steps with its guide off after 200: 8 steps, the phase boundary at 200 * 8 / 500 = 3.2 -> 3
    assert b.budget_overrides(b.Variant("g", str(ROOT / "specs/grpo.yaml")), 512) == ["train.steps=8"]
    assert b.budget_overrides(b.Variant("m", str(ROOT / "specs/mintrl.yaml")), 512) == [
        "train.steps=8", "phases.0.until=3", "phases.1.until=8"]


def test_bench_writes_results_summary_and_plots(tmp_path):
    from components.tasks.bootstrap import tiny_random_checkpoint

    tiny = tiny_random_checkpoint(str(tmp_path / "tiny"))
    fast = [f"policy.model={tiny}", "rollout.max_new_tokens=8", "rollout.samples_per_prompt=2",
            "train.prompts_per_step=2"]
    variants = [b.Variant(f"oapl every={k}", str(ROOT / "specs/oapl.yaml"), fast + [f"sync.every={k}"],
                          study="lag", sweep=("sync.every", str(k))) for k in (1, 2)]
    variants.append(b.Variant("again", variants[0].spec, list(variants[0].overrides), study="other"))  # same run
    cfg = dict(b.QUICK, budget_samples=8, eval_samples=2, pass_k_n=2, pass_k_problems=2, eval_every=1)
    results = b.bench(variants, tmp_path / "out", cfg, "test", log=lambda m: None)
    assert [r["policy_samples"] for r in results] == [8, 8, 8]
    assert results[2]["run"] == results[0]["run"] and results[2]["study"] == "other"  # reused, not rerun
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").open()))
    assert len(rows) == 3 and {"pass@1/tier6", "pass@2/tier8", "judge_tokens", "entropy_heldout"} <= set(rows[0])
    assert float(rows[0]["entropy_heldout"]) > 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "budget_samples=8" in summary and "oapl every=2" in summary and "## other" in summary
    assert (tmp_path / "out" / "lag.png").exists() and (tmp_path / "out" / "lag-sweep.png").exists()


def test_readme_section_is_written_between_markers_from_a_bench_folder(tmp_path):
    results = [{"label": m, "study": "methods", "seed": s, f"pass@1/{b.MIDDLE}": v + s / 10, f"pass@1/{b.HARD}": 0.0,
                f"pass@4/{b.HARD}": 0.5, "wall_s": 10, "policy_samples": 64, "steps": 8,
                "run": str(tmp_path / "none")} for m, v in (("grpo", 0.1), ("opd", 0.3)) for s in (0, 1)]
    out = tmp_path / "bench"
    b.write_outputs(results, out, dict(b.QUICK, seeds=2), "composer bench --suite seeds")
    (out / "results.json").write_text(__import__("json").dumps(results))
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\n\nbefore\n\n{b.BEGIN}\nold\n{b.END}\n\nafter\n")
    b.readme_section(out, readme, tmp_path / "docs" / "bench")
    text = readme.read_text()
    assert "old" not in text and text.startswith("# T\n\nbefore") and text.rstrip().endswith("after")
    assert "`composer bench --suite seeds`" in text and "budget_samples=256" in text
    assert "| opd | 2 | 0.350 ± 0.635 |" in text  # 2 seeds; mean of 0.3 and 0.4; t(1) 12.706 * stdev 0.0707 / sqrt(2)
    assert "pass@4/tier8" in text and "](docs/bench/methods.png)" in text
    assert (tmp_path / "docs" / "bench" / "methods.png").exists()


def test_cli_overrides_apply_to_every_variant_before_the_sweep(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from composer.cli.main import main

    seen = []
    monkeypatch.setattr(b, "bench", lambda variants, *a, **kw: seen.extend(variants) or [])
    res = CliRunner().invoke(main, ["bench", "specs/int.yaml", "specs/grpo.yaml", "sources.oracle.kind=oracle",
                                    "--sweep", "train.lr=1e-4,3e-4", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert [v.spec for v in seen] == ["specs/int.yaml"] * 2 + ["specs/grpo.yaml"] * 2
    assert seen[1].overrides == ["sources.oracle.kind=oracle", "train.lr=3e-4"]


def test_readme_from_a_folder_without_results_fails_cleanly(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from composer.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text("# T\n")
    res = CliRunner().invoke(main, ["bench", "--readme", str(tmp_path)])
    assert res.exit_code == 2 and "cannot write the results section" in res.output
    assert (tmp_path / "docs" / "results.md").read_text() == "# T\n"


# ------------------------------------------------------------------------ the seed studies (issue 16)


def test_suite_settings_reach_the_regimes_the_claims_are_about():
    from composer.checks.validate import validate_file

    assert b.DEFAULTS["seeds"] >= 3 and b.EXTRA_SEEDS == 5
    lags = []
    for label, spec, ov in b.SUITE["lag"]:
        v = validate_file(spec, b.run_overrides(b.Variant(label, spec, ov), 0, b.DEFAULTS))
        lag = v.spec.sync.every
        lags.append(lag)
        assert b.policy_samples(v) == b.DEFAULTS["budget_samples"]  # the same budget as every other study
        assert (v.total_steps - 1) // lag >= 4 or lag == 1, (label, v.total_steps)  # >= 4 syncs inside the run
    assert max(lags) >= 24 and min(lags) == 1
    knobs = []
    for label, spec, ov in b.SUITE["intensity"]:
        v = validate_file(spec, b.run_overrides(b.Variant(label, spec, ov), 0, b.DEFAULTS))
        assert 8 in v.spec.data.train_tiers and v.spec.train.samples_every == 1
        knobs.append(v.spec.rollout.guide.max_reviews)
    assert knobs[0] == 0 and knobs == sorted(knobs) and len(knobs) >= 4
    # every arm a verdict reads is a run of another study too: the full suite runs it once
    others = {tuple(map(str, (lab, spec, ov))) for s, items in b.SUITE.items() if s != "claims" for lab, spec, ov in items}
    assert all(tuple(map(str, item)) in others for item in b.SUITE["claims"])
    for name, c in b.CLAIMS.items():  # the seed claims' arms run in `claims` (the held-out variant too); InT's in its own
        labels = {lab for lab, _s, _o in b.SUITE["int" if name == "int" else "claims"]}
        assert set(c["arms"].values()) <= labels, name


def test_intervals_use_student_t_and_welch():
    assert b.t975(1) == 12.706 and b.t975(2) == 4.303 and b.t975(2.9) == 4.303 and b.t975(100) == 1.96
    m, h = b.ci95([0.1, 0.2, 0.3])
    assert abs(m - 0.2) < 1e-12 and abs(h - 4.303 * 0.1 / 3 ** 0.5) < 1e-9
    c = b.diff_ci((1, [1.0, 2.0, 3.0]), (-1, [0.0, 1.0, 2.0]))  # equal variances: df = 4
    assert abs(c["d"] - 1.0) < 1e-12 and abs(c["half"] - 2.776 * (2 / 3) ** 0.5) < 1e-9 and c["n"] == [3, 3]
    assert b.established(c) == 0
    assert b.established(b.diff_ci((1, [1.0, 1.0, 1.0]), (-1, [0.0, 0.0, 0.0]))) == 1  # no spread at all
    assert b.established(b.diff_ci((1, [0.0, 0.1, 0.0]), (-1, [1.0, 0.9, 1.0]))) == -1
    assert b.value({"pass@1/tier6": 0.2, "pass@1/tier8": 0.4}, "pass@1/tier6+8") == 0.30000000000000004


def _claim_rows(effect: float, noise: float = 0.0, seeds=(0, 1, 2), off16: float = 0.5, p16: float | None = None):
    """Synthetic results of every claims arm: each claim's predicted direction, `effect` strong."""
    rows = []
    jitter = {0: 0.0, 1: noise, 2: -noise, 3: noise / 2, 4: -noise / 2}

    def add(label, pass1=0.3, pass32=0.6, ent=0.05, off=float("nan")):
        for s in seeds:
            j = jitter[s]
            rows.append({"label": label, "study": "claims", "seed": s, "pass@1/tier6": pass1 + j, "pass@1/tier8": pass1 + j,
                         "pass@32/tier6": pass32 + j, "pass@32/tier8": pass32 + j, "entropy_heldout": ent + j / 10,
                         "offpolicy_guided": off, "zero_advantage_frac": 0.5, "reward_last": 0.5,
                         "policy_samples": 64, "steps": 8, "run": "/nonexistent"})

    add("grpo", pass32=0.5)
    add("mintrl", pass32=0.5 + effect)
    add("mintrl max_reviews=0", pass32=0.5)
    for r, off, p in ((0, float("nan"), 0.3), (1, 0.12, 0.3 + effect), (2, 0.22, 0.3), (4, 0.41, 0.3 - effect),
                      (16, off16, 0.3 - effect if p16 is None else p16)):
        add(f"mintrl long max_reviews={r}", pass1=p, off=off)
    for m, drop in (("oapl", 0.0), ("grpo", effect)):
        add(f"{m} sync.every=1", pass1=0.3)
        add(f"{m} sync.every=24", pass1=0.3 - drop)
    add("sft", ent=0.01)
    for m in ("opd", "opsd"):
        add(m, ent=0.01 + effect / 10)
    return rows


def test_claim_verdicts_follow_the_preregistered_rules():
    clear = {v["name"]: v for v in b.claim_verdicts(_claim_rows(0.3, noise=0.01))}
    assert set(clear) == {"coverage", "intensity", "lag", "off_policyness"}
    assert all(v["verdict"] == "reproduced" and not v["extend"] for v in clear.values()), clear
    assert "max_reviews=4, 41.0%" in clear["intensity"]["comparisons"][1][0]  # high = the arm closest to 40%
    against = {v["name"]: v["verdict"] for v in b.claim_verdicts(_claim_rows(-0.3, noise=0.01))}
    assert against == dict.fromkeys(against, "contradicted")
    noisy = {v["name"]: v for v in b.claim_verdicts(_claim_rows(0.02, noise=0.2))}
    assert all(v["verdict"] == "undecided" for v in noisy.values())
    assert set(noisy["coverage"]["extend"]) == {"grpo", "mintrl"}  # the arms to give 5 seeds
    table = "\n".join(b.claims_table(list(noisy.values())))
    assert "**undecided**" in table and "MInTRL - GRPO" in table and "| 3/3 |" in table
    missing = [r for r in _claim_rows(0.3) if r["label"] != "sft"]
    assert "off_policyness" not in {v["name"] for v in b.claim_verdicts(missing)}


def test_two_high_arms_within_two_points_both_get_a_verdict():
    """max_reviews=4 measures 41%, max_reviews=16 42.5%: both are candidates for *high*; when their pass rates
    tell different stories the verdict names each, instead of picking one after seeing the numbers."""
    assert b.high_candidates({"a": 0.41, "b": 0.395, "c": 0.2}, ["a", "b", "c"]) == ["b", "a"]  # nearest first
    assert b.high_candidates({"a": 0.41, "b": 0.37, "c": 0.2}, ["a", "b", "c"]) == ["a"]  # 4 points apart
    agree = {v["name"]: v for v in b.claim_verdicts(_claim_rows(0.3, noise=0.01, off16=0.425))}["intensity"]
    assert agree["verdict"] == "reproduced" and len(agree["comparisons"]) == 3
    assert "max_reviews=16, 42.5%" in agree["comparisons"][2][0] and "verdict is given for each" in agree["notes"][-1]
    split = {v["name"]: v for v in b.claim_verdicts(_claim_rows(0.3, noise=0.01, off16=0.425, p16=0.3 + 0.3))}
    assert split["intensity"]["verdict"] == ("reproduced (high = max_reviews=4) / "
                                             "contradicted (high = max_reviews=16)"), split["intensity"]["verdict"]


def test_heldout_entropy_is_the_mean_token_entropy_at_temperature_1(tmp_path):
    """Recomputed independently: torch.distributions.Categorical over the logits of every response position
    of the same samples (same seed), averaged over response tokens."""
    import torch

    from components.tasks.bootstrap import tiny_random_checkpoint
    from composer.runtime.engine import Sampling, hf_generate
    from composer.runtime.evaluate import heldout_entropy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_random_checkpoint(str(tmp_path / "tiny"))
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)

    class Ctx:
        tokenizer, max_new_tokens = tok, 6

        def encode(self, text):
            return tok(text, add_special_tokens=False)["input_ids"]

    class Ex:
        def __init__(self, prompt):
            self.prompt = prompt

    exs = [Ex("1+2="), Ex("3*4=")]
    got = heldout_entropy(Ctx(), model, exs, n=2, seed=5)
    prompts = [Ctx().encode(e.prompt) for e in exs for _ in range(2)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        gens = hf_generate(model, tok, prompts, 6, Sampling(temperature=1.0))
    ents = []
    with torch.no_grad():
        for p, g in zip(prompts, gens):
            logits = model(torch.tensor([p + g.tokens])).logits[0]  # [P+R, V]
            ents += torch.distributions.Categorical(logits=logits[len(p) - 1: len(p) + len(g.tokens) - 1]).entropy().tolist()
    assert sum(len(g.tokens) for g in gens) == len(ents) > 0
    assert abs(got - sum(ents) / len(ents)) < 1e-5, (got, sum(ents) / len(ents))
    assert got > 0.1  # a random tiny model is far from deterministic: the check compares something


def test_guided_offpolicy_counts_reviewable_rollouts_of_the_intervention_phase(tmp_path):
    import json

    def row(segment, control, spans, reviews):
        return {"segment": segment, "control": control, "guide": {"reviews": reviews},
                "spans": [{"origin": o, "tokens": n} for o, n in spans]}

    rows = [row("phase0", True, [("policy", 30)], 0),  # a control rollout: never reviewed, not counted
            row("phase0", False, [("policy", 24), ("guide_intervention", 6)], 2),
            row("phase0", False, [("policy", 30)], 1),
            row("phase1", False, [("policy", 40)], 0)]  # interventions off: not counted
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    assert b.guided_offpolicy(path) == 6 / 60
    assert b.guided_offpolicy(tmp_path / "none.jsonl") != b.guided_offpolicy(tmp_path / "none.jsonl")  # NaN


def test_bench_reuses_finished_runs_and_adds_seeds_in_place(monkeypatch, tmp_path):
    import json

    calls = []

    def fake(v, seed, out, cfg):
        calls.append((v.label, seed))
        out.mkdir(parents=True)
        return {"label": v.label, "study": v.study, "spec": v.spec, "seed": seed, "toy": "mod10", "steps": 1,
                "policy_samples": 8, "wall_s": 1.0, "pass@1/tier6": 0.1 * seed, "pass@1/tier8": 0.0, "run": str(out)}

    monkeypatch.setattr(b, "run_one", fake)
    monkeypatch.setattr(b, "plots", lambda results, out: [])
    out = tmp_path / "bench"
    cfg = dict(b.QUICK, seeds=2)
    va = [b.Variant("grpo", "specs/grpo.yaml", [], study="methods"), b.Variant("grpo", "specs/grpo.yaml", [], study="coverage")]
    b.bench(va, out, cfg, "first", log=lambda m: None)
    assert calls == [("grpo", 0), ("grpo", 1)]  # the coverage copy is the same run
    vb = [b.Variant("sft", "specs/sft.yaml", [], study="off_policyness")]
    b.bench(vb, out, cfg, "second", log=lambda m: None)
    results = json.loads((out / "results.json").read_text())
    assert [(r["study"], r["label"]) for r in results].count(("methods", "grpo")) == 2  # kept from the first call
    assert {r["study"] for r in results} == {"methods", "coverage", "off_policyness"}
    calls.clear()
    b.bench(va[:1], out, dict(cfg, seeds=3), "third", log=lambda m: None)
    assert calls == [("grpo", 2)]  # seeds 0 and 1 are reused from their folders
    results = json.loads((out / "results.json").read_text())
    assert sorted(r["seed"] for r in results if r["study"] == "methods") == [0, 1, 2]
    summary = (out / "summary.md").read_text()
    assert "Command: `first`, then `second`, then `third`" in summary and "| grpo | 3 |" in summary
    calls.clear()
    b.bench(va[:1], out, dict(cfg, seeds=3, eval_samples=4), "other settings", log=lambda m: None)
    assert len(calls) == 3  # other settings: nothing reused
    results = json.loads((out / "results.json").read_text())
    assert {r["study"] for r in results} == {"methods"}


def test_bench_records_the_toy_variant_and_the_cli_runs_the_claims_study(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from composer.cli.main import main

    seen = []
    monkeypatch.setattr(b, "bench", lambda variants, *a, **kw: seen.extend(variants) or [])
    res = CliRunner().invoke(main, ["bench", "--suite", "seeds", "--study", "claims", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert [v.label for v in seen] == [lab for lab, _s, _o in b.SUITE["claims"]]
    monkeypatch.undo()
    monkeypatch.setenv("COMPOSER_TOY_VARIANT", "mod7")
    monkeypatch.setattr(b, "run_one", lambda v, seed, out, cfg: (out.mkdir(parents=True), {
        "label": v.label, "study": v.study, "seed": seed, "toy": "mod7", "steps": 1, "policy_samples": 8, "wall_s": 1,
        "run": str(out)})[1])
    monkeypatch.setattr(b, "plots", lambda results, out: [])
    b.bench([b.Variant("grpo", "specs/grpo.yaml", [], study="methods")], tmp_path / "h", dict(b.QUICK), "c",
            log=lambda m: None)
    summary = (tmp_path / "h" / "summary.md").read_text()
    assert "Toy testbed `mod7`: mod-7 arithmetic chains" in summary
    key = __import__("json").loads((tmp_path / "h" / "runs" / "methods-grpo" / "seed0" / "result.json").read_text())["key"]
    assert '"toy": "mod7"' in key


def test_readme_section_says_what_moved_and_writes_both_variants_verdicts(tmp_path):
    import json

    prev = tmp_path / "docs" / "bench" / b.PREVIOUS
    prev.parent.mkdir(parents=True)
    prev.write_text("Settings: budget_samples=4096, seeds=2\n\n| variant | pass@1/tier6 | teacher_tokens | wall_s |\n"
                    "| --- | --- | --- | --- |\n| grpo | 0.100 ± 0.050 | 0 | 40 |\n| opd | 0.300 ± 0.100 | 100 | 40 |\n")
    methods = [{"label": m, "study": "methods", "seed": s, "pass@1/tier6": v + (0.1 * s if s == 2 else 0),
                "pass@1/tier8": 0.0, "teacher_tokens": t, "wall_s": 10, "policy_samples": 64, "steps": 8,
                "run": str(tmp_path / "none")} for m, v, t in (("grpo", 0.1, 0), ("opd", 0.35, 100)) for s in (0, 1, 2)]
    out = tmp_path / "bench"
    for folder, rows in ((out, methods + _claim_rows(0.3, 0.01)), (out / "heldout-mod7", _claim_rows(0.02, 0.2))):
        b.write_outputs(rows, folder, dict(b.QUICK, seeds=3, toy="mod7" if folder != out else "mod10"), "cmd " + folder.name)
        (folder / "results.json").write_text(json.dumps([dict(r, toy="mod7") for r in rows] if folder != out else rows))
    readme = tmp_path / "README.md"
    readme.write_text(f"# T\n\n{b.BEGIN}\nold\n{b.END}\n")
    b.readme_section(out, readme, tmp_path / "docs" / "bench")
    text = readme.read_text()
    # grpo: seeds 0-1 equal the previous 0.100, seed 2 adds 0.2: mean 0.167, moved +0.067 by the added seed only
    assert "| grpo | +0.067 | +0 |" in text
    assert "| opd | +0.117* | +0 |" in text  # seeds 0-1 give 0.350, not 0.300: the code moved it
    assert "reproduce every previous mean: grpo." in text
    assert text.count("**reproduced**") == 4 and text.count("**undecided**") == 4
    assert "Held-out variant `mod7`" in text and "](docs/bench/verdicts-mod7.png)" in text
    assert (tmp_path / "docs" / "bench" / "verdicts.png").exists()


def test_extend_seeds_reuses_the_runs_other_studies_made(monkeypatch, tmp_path):
    calls = []

    def fake(v, seed, out, cfg):
        calls.append((v.study, v.label, seed))
        out.mkdir(parents=True)
        return {"label": v.label, "study": v.study, "seed": seed, "toy": "mod10", "steps": 1, "policy_samples": 8,
                "wall_s": 1.0, "run": str(out)}

    monkeypatch.setattr(b, "run_one", fake)
    monkeypatch.setattr(b, "plots", lambda results, out: [])
    lab, spec, ov = b.SUITE["claims"][0]
    b.bench([b.Variant(lab, spec, list(ov), study="methods")], tmp_path, dict(b.DEFAULTS), "suite", log=lambda m: None)
    assert len(calls) == 3
    calls.clear()
    b.extend_seeds(tmp_path, [lab], log=lambda m: None)
    assert calls == [("claims", lab, 3), ("claims", lab, 4)]  # seeds 0-2 found in the methods study's folders
    results = __import__("json").loads((tmp_path / "results.json").read_text())
    assert sorted((r["study"], r["seed"]) for r in results) == [("claims", s) for s in range(5)] + [
        ("methods", s) for s in range(3)]
    import pytest

    with pytest.raises(ValueError, match="not arms"):
        b.extend_seeds(tmp_path, ["nope"])
