"""Issue 46 (c): what a new user finds from `composer list`, the plugin guide and the error messages."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from composer.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def test_list_gate_and_terms_show_the_gate_fields():
    from composer.gates import Gate

    r = _cli("list", "gate")
    assert r.exit_code == 0, r.output
    terms = _cli("list", "terms").output
    for name in Gate.model_fields:
        assert name in r.output
        assert f"gate.{name}" in terms
    ref = (ROOT / "docs" / "reference.md").read_text()
    assert all(f"`gate.{name}`" in ref for name in Gate.model_fields)


def test_the_plugin_guide_lists_every_batch_and_view_field():
    from composer.batch import PolicyView, TrajectoryBatch

    guide = (ROOT / "examples" / "custom_component" / "README.md").read_text()
    for cls in (TrajectoryBatch, PolicyView):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in guide, f.name
    assert "Capabilities(exact_origins" in guide and "torch.Generator" in guide


def test_a_refused_top_level_setting_is_named_where_the_file_writes_it(tmp_path):
    spec = tmp_path / "st.yaml"
    spec.write_text("name: st\nsources:\n  verifier: {kind: outcome_reward}\n"
                    "rollout: {samples_per_prompt: 4, filter: {equal_groups: drop, max_rounds: 4}}\n"
                    "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n"
                    "stages:\n  - {name: a, train: {steps: 2}}\n  - {name: b, train: {steps: 2}}\n")
    r = subprocess.run([sys.executable, "-m", "composer", "compile", str(spec), "--backend", "openrlhf", "--out",
                        str(tmp_path / "b")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert f"{spec}:4:" in r.stderr and "error: rollout.filter.max_rounds:" in r.stderr, r.stderr
    assert "stages[0]" not in r.stderr


def test_explain_prints_the_group_advantage_with_parentheses():
    r = _cli("explain", str(ROOT / "specs" / "grpo.yaml"))
    assert "A = (r - mean_group(r)) / (group std + 1e-06)" in r.output


def test_a_single_gated_term_logs_its_gate_under_its_name():
    import torch

    from composer.gates import gate_metrics

    assert gate_metrics("sft", torch.tensor([True, False, False, True]), False) == {"sft/gate_frac": 0.5}


def test_the_plugin_guide_names_every_run_context_name_a_component_reads():
    """docs/plugins.md's run context paragraph is the declared interface of `ctx`: every `ctx.<name>` a built-in
    component reads (components/) is named there (issue 52 item 5: 39 names were undocumented)."""
    import re

    root = Path(__file__).resolve().parent.parent
    used = {m for f in (root / "components").rglob("*.py") for m in re.findall(r"\bctx\.([a-z_]+)", f.read_text())}
    guide = (root / "docs" / "plugins.md").read_text()
    para = guide[guide.index("**The run context**"):]
    para = para[:para.index("\n\n")]
    named = set(re.findall(r"`ctx\.([a-z_]+)", para))
    assert used and not used - named, f"read by components, not in docs/plugins.md's run context: {sorted(used - named)}"
