"""The validate/explain/list/schema commands: message snapshots, output formats, no heavy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer import registry
from composer.cli.main import main

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
HEAVY = ("torch", "transformers", "lightning", "pytorch_lightning", "lightning_fabric", "vllm")


def invoke(*args):
    # a wide virtual terminal, so that rich tables never fold a kind name
    return CliRunner(env={"COLUMNS": "300"}).invoke(main, [str(a) for a in args], catch_exceptions=False)


# ------------------------------------------------------------------------------------------ snapshots
# Full error messages, compared exactly (with the temp folder written as <dir>), so that their quality
# cannot regress silently. Regenerate deliberately with UPDATE_SNAPSHOTS=1.

HEAD = "name: broken\nsources:\n  verifier: {kind: outcome_reward}\n"
SNAPSHOT_SPECS = {
    "unknown_key": HEAD + "signal: {kind: reward, source: verifier}\n"
                          "objective: {kind: grpo, clip_hgih: 0.28, loss_agg: token_mean}\n",
    "bad_kind": HEAD + "  reference: {kind: reference_soluton}\n"
                       "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n",
    "wrong_kind_at_edge": HEAD + "  reference: {kind: reference_solution}\n"
                                 "rollout: {guide: {kind: intervention, judge: reference}}\n"
                                 "signal: {kind: reward, source: verifer}\nobjective: {kind: advantage_regression}\n",
    "method_rules": HEAD + "  judge: {kind: oracle}\n  spare: {kind: reference_solution}\n"
                           "rollout:\n  samples_per_prompt: 4\n  guide: {kind: intervention, judge: judge}\n"
                           "signal: {kind: reward, source: verifier}\n"
                           "objective: {kind: grpo, loss_tokens: [policy, guide_intervention]}\n"
                           "sync: {every: 4}\n",
    "phase_error": HEAD + "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression}\n"
                          "train: {steps: 100}\nphases:\n  - {until: 50, rollout: {guide: {kind: prefx}}}\n"
                          "  - {until: 90}\n",
}


@pytest.mark.parametrize("name", sorted(SNAPSHOT_SPECS))
def test_error_message_snapshot(name, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SNAPSHOT_SPECS[name])
    r = invoke("validate", spec)
    assert r.exit_code == 2
    got = r.stderr.replace(str(tmp_path), "<dir>")
    snap = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snap.parent.mkdir(exist_ok=True)
        snap.write_text(got)
    assert snap.exists(), f"missing snapshot {snap}; run with UPDATE_SNAPSHOTS=1"
    assert got == snap.read_text()


# ------------------------------------------------------------------------------------------ no heavy imports

IMPORT_PROBE = """
import sys
sys.argv = ["composer"] + sys.argv[1:]
from composer.cli.main import main
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print("HEAVY:" + ",".join(heavy))
"""


@pytest.mark.parametrize("args", [
    ["validate", "specs/mintrl.yaml", "specs/opsd.yaml", "specs/hybrids/opd-plus-reward.yaml"],
    ["explain", "specs/sdpo.yaml", "--format", "json"],
    ["validate", "specs/does-not-exist.yaml"],
    ["list"],
], ids=["validate", "explain", "validate-missing", "list"])
def test_commands_never_import_torch(args):
    r = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(heavy=HEAVY), *args], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    line = [x for x in r.stdout.splitlines() if x.startswith("HEAVY:")]
    assert line, r.stdout + r.stderr
    assert line[0] == "HEAVY:", f"`composer {' '.join(args)}` imported {line[0][6:]}"


def test_validate_is_quick():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "composer.cli.main", "validate", "specs/grpo.yaml"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0
    imported = {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY)


# ------------------------------------------------------------------------------------------ explain

@pytest.mark.parametrize("spec", ["specs/mintrl.yaml", "specs/int.yaml", "specs/hybrids/opd-plus-reward.yaml"])
def test_explain_text(spec):
    r = invoke("explain", REPO / spec)
    assert r.exit_code == 0, r.stderr
    assert "segment '" in r.stdout and "dataflow:" in r.stdout and "no loss:" in r.stdout


def test_explain_mintrl_says_what_the_seed_says():
    out = invoke("explain", REPO / "specs/mintrl.yaml").stdout
    assert "steps 0-200" in out and "steps 200-500" in out
    assert "guide_intervention  loss, anchor: constant kappa=-0.2" in out
    assert "guide intervention" in out.split("segment 'phase0'")[1].split("segment 'phase1'")[0]


def test_explain_formats():
    mermaid = invoke("explain", REPO / "specs/sdpo.yaml", "--format", "mermaid")
    assert mermaid.exit_code == 0
    lines = mermaid.stdout.strip().splitlines()
    assert lines[0] == "graph LR" and all("-->" in x for x in lines[1:])
    assert any('"source:verifier"' in x and '"source:sibling"' in x for x in lines)

    dot = invoke("explain", REPO / "specs/sdpo.yaml", "--format", "dot")
    assert dot.exit_code == 0
    assert dot.stdout.startswith('digraph "sdpo" {') and dot.stdout.rstrip().endswith("}")
    assert '"source:teacher" -> "signal" [label="teacher"];' in dot.stdout

    js = invoke("explain", REPO / "specs/sdpo.yaml", "--format", "json")
    assert js.exit_code == 0
    plan = json.loads(js.stdout)
    assert plan["name"] == "sdpo" and plan["total_steps"] == 60
    assert {e["from"] for e in plan["edges"]} >= {"source:verifier", "source:sibling", "source:feedback"}
    assert plan["segments"][0]["terms"][0]["objective"]["kind"] == "divergence"


def test_explain_with_overrides_and_errors(tmp_path):
    r = invoke("explain", REPO / "specs/oapl.yaml", "sync.every=3", "--format", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["segments"][0]["sync"]["every"] == 3
    r = invoke("explain", REPO / "specs/grpo.yaml", "sync.every=3")
    assert r.exit_code == 2 and "<override 'sync.every=3'>:1:1: error: sync.every:" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nobjective: {kind: gpro}\n")
    r = invoke("explain", bad)
    assert r.exit_code == 2 and f"{bad}:2:" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------ list, schema

def test_list_shows_every_kind_and_verifier():
    r = invoke("list")
    assert r.exit_code == 0
    for section in registry.SECTIONS:
        for kind in registry.kinds(section):
            assert kind in r.stdout, f"{section} kind {kind} missing from `composer list`"
    for name in registry.VERIFIERS:
        assert name in r.stdout
    assert {"exact", "math", "code", "toy"} <= set(registry.VERIFIERS)


def test_list_one_section():
    r = invoke("list", "--section", "guide")
    assert r.exit_code == 0
    assert "intervention" in r.stdout and "prefix" in r.stdout
    assert "outcome_reward" not in r.stdout


def test_schema_command_writes_json(tmp_path):
    out = tmp_path / "s.json"
    r = invoke("schema", "--out", out)
    assert r.exit_code == 0 and json.loads(out.read_text())["$schema"].endswith("2020-12/schema")
    r = invoke("schema", "--out", tmp_path / "no" / "such" / "\0dir" / "s.json")
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = invoke("schema", "--with-plugins")
    assert r.exit_code == 2 and "--out" in r.stderr


def test_validate_overrides_as_option_and_bare(tmp_path):
    r = invoke("validate", REPO / "specs/grpo.yaml", "--set", "train.steps=5", "rollout.samples_per_prompt=4")
    assert r.exit_code == 0, r.stderr
    r = invoke("validate", REPO / "specs/grpo.yaml", "--set", "rollout.samples_per_prompt=1")
    assert r.exit_code == 2 and "every advantage is zero" in r.stderr


def test_help_lists_commands():
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("validate", "explain", "list", "schema"):
        assert cmd in r.stdout
