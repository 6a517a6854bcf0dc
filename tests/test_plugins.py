"""Third-party components: examples/custom_component, found through an entry point or a spec's `plugins:`.

Nothing is pip-installed into the shared venv: each test runs the CLI in a fresh process with the
package's src/ on PYTHONPATH and, for the entry-point route, a hand-made `*.dist-info` folder whose
entry_points.txt importlib.metadata reads exactly like an installed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "custom_component"
SRC = EXAMPLE / "src"
SPEC = EXAMPLE / "spec.yaml"


def composer(*args, path=(), cwd=REPO):
    env = {**os.environ, "COLUMNS": "250", "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    return subprocess.run([sys.executable, "-m", "composer.cli.main", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd)


def fake_install(site: Path, name: str, entry_points: dict[str, str]) -> Path:
    """What `pip install` leaves behind for importlib.metadata: NAME-VERSION.dist-info with METADATA and entry points."""
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[composer.components]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return site


def spec_without_plugins_line(tmp_path: Path) -> Path:
    text = "\n".join(line for line in SPEC.read_text().splitlines() if not line.startswith("plugins:")) + "\n"
    out = tmp_path / "spec.yaml"
    out.write_text(text)
    return out


def test_example_package_is_complete():
    assert (EXAMPLE / "README.md").exists()
    pyproject = (EXAMPLE / "pyproject.toml").read_text()
    assert '[project.entry-points."composer.components"]' in pyproject
    assert 'length_penalty = "length_penalty"' in pyproject
    assert (SRC / "length_penalty" / "__init__.py").exists()


def test_entry_point_route(tmp_path):
    site = fake_install(tmp_path / "site", "composer-length-penalty", {"length_penalty": "length_penalty"})
    spec = spec_without_plugins_line(tmp_path)
    r = composer("validate", spec, path=[site, SRC])
    assert r.returncode == 0, r.stderr
    assert f"{spec}: ok" in r.stdout
    r = composer("list", "--section", "objective", path=[site, SRC])
    assert r.returncode == 0
    assert "length_penalized_grpo" in r.stdout and "composer-length-penalty" in r.stdout
    r = composer("explain", spec, "--format", "json", path=[site, SRC])
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["segments"][0]["terms"][0]["objective"] == {
        **plan["segments"][0]["terms"][0]["objective"], "kind": "length_penalized_grpo", "penalty": 0.01,
        "free_tokens": 8}


def test_without_the_plugin_the_kind_is_unknown(tmp_path):
    spec = spec_without_plugins_line(tmp_path)
    r = composer("validate", spec)
    assert r.returncode == 2
    assert "unknown kind 'length_penalized_grpo'" in r.stderr and f"{spec}:" in r.stderr


def test_plugins_list_route():
    r = composer("validate", "--allow-plugins", SPEC, path=[SRC])
    assert r.returncode == 0, r.stderr
    r = composer("explain", "--allow-plugins", SPEC, path=[SRC])
    assert r.returncode == 0, r.stderr
    assert "length_penalized_grpo loss" in r.stdout


def test_missing_plugin_module_is_a_located_error():
    r = composer("validate", "--allow-plugins", SPEC)  # length_penalty is not importable without its src/
    assert r.returncode == 2
    line = next(i for i, x in enumerate(SPEC.read_text().splitlines(), 1) if x.startswith("plugins:"))
    assert f"{SPEC}:{line}:" in r.stderr and "plugins[0]: plugin module 'length_penalty' cannot be imported" in r.stderr
    assert "hint:" in r.stderr and "Traceback" not in r.stderr


def test_nonexistent_and_broken_plugin_modules(tmp_path, cli):
    (tmp_path / "broken_plugin_mod.py").write_text("raise RuntimeError('boom at import')\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: p\nplugins:\n  - no_such_plugin_module_anywhere\n  - broken_plugin_mod\n"
                    "sources: {verifier: {kind: outcome_reward}}\n"
                    "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    r = composer("validate", "--allow-plugins", spec, path=[tmp_path])
    assert r.returncode == 2
    assert f"{spec}:3:5: error: plugins[0]: plugin module 'no_such_plugin_module_anywhere' cannot be imported" \
        in r.stderr
    assert f"{spec}:4:5: error: plugins[1]:" in r.stderr and "RuntimeError: boom at import" in r.stderr
    assert "Traceback" not in r.stderr
    # in-process too (nothing gets registered by a module that does not exist)
    r = cli("validate", "--allow-plugins", spec)
    assert r.exit_code == 2 and f"{spec}:3:5:" in r.stderr


def test_broken_entry_point_does_not_break_validation(tmp_path):
    site = fake_install(tmp_path / "site", "composer-broken", {"broken": "no_such_module_for_entry_point"})
    r = composer("validate", REPO / "specs" / "grpo.yaml", path=[site])
    assert r.returncode == 0, r.stderr
    r = composer("list", path=[site])
    assert r.returncode == 0
    assert "plugin broken (no_such_module_for_entry_point) failed to load" in r.stdout


def test_unknown_key_in_a_plugin_component(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.read_text().replace("penalty: 0.01", "penalti: 0.01"))
    r = composer("validate", "--allow-plugins", spec, path=[SRC])
    assert r.returncode == 2
    assert "objective.penalti: unknown key 'penalti' in the length_penalized_grpo objective" in r.stderr
    assert "did you mean 'penalty'?" in r.stderr


def test_plugin_kinds_follow_the_builtin_rules(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.read_text().replace("train:", "sync: {every: 4}\ntrain:"))
    r = composer("validate", "--allow-plugins", spec, path=[SRC])
    assert r.returncode == 2 and "length_penalized_grpo assumes on-policy data" in r.stderr


def test_schema_with_plugins(tmp_path):
    site = fake_install(tmp_path / "site", "composer-length-penalty", {"length_penalty": "length_penalty"})
    out = tmp_path / "with.json"
    r = composer("schema", "--with-plugins", "--out", out, path=[site, SRC])
    assert r.returncode == 0, r.stderr
    assert '"length_penalized_grpo"' in out.read_text()
    assert '"length_penalized_grpo"' not in (REPO / "schemas" / "spec.schema.json").read_text()


CONFIG_PROBE = r"""
import json
import length_penalty
from composer import registry
cls = registry.lookup("objective", "length_penalized_grpo")
f = cls.model_fields
print(json.dumps({
    "is": cls is length_penalty.LengthPenalizedGrpo,
    "extra": cls.model_config.get("extra"),
    "kind_literal": str(f["kind"].annotation),
    "described": all(bool(x.description) for x in f.values()),
    "plugin": cls.plugin,
    "summary": cls.summary(),
}))
import torch
r = length_penalty.shaped_rewards(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([4, 12, 20]), 0.01, 8)
print(json.dumps([round(x, 6) for x in r.tolist()]))
"""


def test_plugin_config_and_reward_shaping():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run([sys.executable, "-c", CONFIG_PROBE], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    info, shaped = (json.loads(x) for x in r.stdout.strip().splitlines()[-2:])
    assert info["is"] and info["extra"] == "forbid" and info["described"]
    assert "length_penalized_grpo" in info["kind_literal"] and "Literal" in info["kind_literal"]
    assert info["plugin"] == "composer-length-penalty" and info["summary"]
    assert shaped == pytest.approx([1.0, 0.96, -0.12])
