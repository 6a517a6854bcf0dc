"""`composer bench` on a tiny random model: equal budgets, the files it writes, sweeps."""

from __future__ import annotations

import csv
from pathlib import Path

from composer import bench as b

ROOT = Path(__file__).resolve().parent.parent


def test_budget_is_equal_across_methods_and_stages():
    for spec in ("specs/grpo.yaml", "specs/sft.yaml", "specs/int.yaml", "specs/mintrl.yaml"):
        v = b.Variant(spec, str(ROOT / spec))
        over = b.budget_overrides(v, 512)
        from composer.validate import validate_file

        val = validate_file(v.spec, over)
        used = sum((s.end - s.start) * b.samples_per_step(s) for s in val.segments)
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
    assert len(rows) == 3 and {"pass@1/tier6", "pass@2/tier8", "judge_tokens"} <= set(rows[0])
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
    assert "| opd | 0.350 ± 0.098 |" in text  # mean of 0.3 and 0.4; 1.96 * stdev 0.0707 / sqrt(2) = 0.098
    assert "pass@4/tier8" in text and "](docs/bench/methods.png)" in text
    assert (tmp_path / "docs" / "bench" / "methods.png").exists()


def test_cli_overrides_apply_to_every_variant_before_the_sweep(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from composer.cli import main

    seen = []
    monkeypatch.setattr(b, "bench", lambda variants, *a, **kw: seen.extend(variants) or [])
    res = CliRunner().invoke(main, ["bench", "specs/int.yaml", "specs/grpo.yaml", "sources.oracle.kind=oracle",
                                    "--sweep", "train.lr=1e-4,3e-4", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert [v.spec for v in seen] == ["specs/int.yaml"] * 2 + ["specs/grpo.yaml"] * 2
    assert seen[1].overrides == ["sources.oracle.kind=oracle", "train.lr=3e-4"]


def test_readme_from_a_folder_without_results_fails_cleanly(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from composer.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("# T\n")
    res = CliRunner().invoke(main, ["bench", "--readme", str(tmp_path)])
    assert res.exit_code == 2 and "cannot write the README section" in res.output
    assert (tmp_path / "README.md").read_text() == "# T\n"
