"""The plugin gate: a spec's `plugins:` are imported only when the user asks (--allow-plugins or
COMPOSER_ALLOW_PLUGINS), never by `validate` or `explain` on their own, and a standard-library or already
imported module never passes as a plugin (found by the red-team passes of issues 17 and 29).

What a plugin may change once imported (never a built-in kind) is in tests/test_trust_boundary.py; plugins
found through entry points in tests/test_plugins.py.
"""

from __future__ import annotations

import pytest
from _helpers import HEAD, REPO, cli, composer

# ----------------------------------------------------- a spec's plugins are imported only when the user asks (issue 17)


def test_validate_and_explain_never_import_a_spec_named_module(tmp_path):
    marker = tmp_path / "PWNED"
    (tmp_path / "evil_plugin_mod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "plugins: [evil_plugin_mod, venv.__main__]\n")
    for command in (["validate", spec], ["explain", spec, "--format", "dot"]):
        r = composer(*command, cwd=tmp_path)  # `python -m composer` puts the current folder on the path
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "plugins[0]: the spec asks to import module 'evil_plugin_mod'; not imported" in r.stderr
        assert "plugins[1]: 'venv.__main__' is a standard-library module, not a plugin" in r.stderr
        assert "--allow-plugins" in r.stderr
    assert not marker.exists()
    r = composer("validate", "--allow-plugins", spec, cwd=tmp_path)  # the user's explicit choice
    assert marker.exists() and "the spec asks to import module 'evil_plugin_mod'" not in r.stderr
    assert "'venv.__main__' is a standard-library module" in r.stderr  # never a plugin, allowed or not


def test_allow_plugins_by_environment_and_a_refusal_is_printed(tmp_path):
    (tmp_path / "shadow_grpo_mod.py").write_text(
        "from typing import Literal\nfrom pydantic import Field\nfrom composer.registry import register\n"
        "from components.objectives.grpo import Grpo\n\n@register('objective')\nclass Shadow(Grpo):\n"
        "    '''Replaces grpo.'''\n    kind: Literal['grpo'] = Field('grpo', description='Component kind.')\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "plugins: [shadow_grpo_mod]\n")
    r = composer("validate", spec, cwd=tmp_path, env={"COMPOSER_ALLOW_PLUGINS": "1"})
    assert r.returncode == 2, r.stderr  # imported (the environment allowed it), and refused (tests/test_trust_boundary.py)
    assert "error: plugins[0]: plugin module 'shadow_grpo_mod' registers kind 'grpo' of objective" in r.stderr
    assert "which is built in; a plugin adds names, choose another kind name" in r.stderr


def test_a_module_name_that_is_not_one_is_refused(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(HEAD + "plugins: ['..os', 'a b']\n")
    r = cli("validate", "--allow-plugins", spec)
    assert r.exit_code == 2 and "is not a module name" in r.stderr


# ---------------------------------------------------------------- no standard-library module passes the gate (issue 29)


@pytest.mark.parametrize("module", ["logging", "json", "yaml", "os.path"])
def test_an_imported_module_does_not_pass_the_plugin_gate(tmp_path, module):
    spec = tmp_path / "s.yaml"
    spec.write_text(HEAD + f"plugins: [{module}]\n")
    r = cli("validate", spec)
    assert r.exit_code == 2, r.output
    assert ("standard-library module" in r.stderr) or ("--allow-plugins" in r.stderr), r.stderr


def test_compile_ships_no_stdlib_module(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {REPO / 'specs' / 'grpo.yaml'}\nplugins: [json]\n")
    r = composer("compile", spec, "--backend", "openrlhf", "--out", tmp_path / "b", "--allow-plugins")
    assert r.returncode == 2 and "standard-library module" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "b" / "json").exists()
