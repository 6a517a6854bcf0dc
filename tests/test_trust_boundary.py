"""The trust boundary (issue 57): what a plugin or a model folder may change about a run.

A plugin adds names; it never replaces a built-in kind (of any section) or a built-in verifier, even with a
class or function of the same name: refused with exit 2 wherever it loads (a spec's `plugins:` entry, an
installed entry point for every command). A model folder whose config.json names its own Python (`auto_map`)
is refused (exit 2, the file and its classes named) unless the user opts in (`trust_remote_code: true` in the
spec and --trust-remote-code); transformers would otherwise train its built-in class for a known model_type.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import FAST as RUN_FAST
from _helpers import clean, cli
from pydantic import create_model

from composer import registry

REPO = Path(__file__).resolve().parent.parent
HEAD = ("name: x\nsources:\n  verifier: {kind: outcome_reward, verifier: math}\n"
        "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
NO_TRUST = {"COMPOSER_TRUST_REMOTE_CODE": "", "COMPOSER_ALLOW_PLUGINS": ""}
FAST = ["train.steps=1", "train.prompts_per_step=2", "train.eval_every=0", "train.eval_samples=2", "--no-progress"]

SHADOW_GRPO = """from typing import Literal
from pydantic import Field
from composer.registry import register
from components.objectives import grpo

@register('objective')
class Grpo(grpo.Grpo):
    '''The same class name as the built-in: used to replace `objective: grpo` silently.'''
    kind: Literal['grpo'] = Field('grpo', description='Component kind.')
"""

SHADOW_VERIFIER = """import hashlib
from composer.registry import register_verifier

@register_verifier('{name}', 'A hash of the response, not a check of the answer.')
def {name}(response, example):
    return float(hashlib.sha256(response.encode()).digest()[0] % 2)
"""

NEW_NAMES = """from typing import Literal
from pydantic import Field
from composer.registry import register, register_verifier
from components.objectives import grpo

@register('objective')
class MyGrpo(grpo.Grpo):
    '''GRPO under a new name.'''
    kind: Literal['my_grpo_tb'] = Field('my_grpo_tb', description='Component kind.')

@register_verifier('always_right_tb', 'Reward 1 for any response.')
def always_right_tb(response, example):
    return 1.0
"""


def composer(*args, path=(), cwd=REPO, env=None, timeout=300):
    """The real CLI in a fresh process (a plugin imported in one test must not stay registered for the next)."""
    full = {**os.environ, **NO_TRUST, "PYTHONPATH": os.pathsep.join(map(str, [*path, REPO])), **(env or {})}
    return subprocess.run([sys.executable, "-m", "composer", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=timeout, check=False)


def plugin_spec(tmp_path: Path, module: str, code: str, head: str = HEAD) -> Path:
    (tmp_path / f"{module}.py").write_text(code)
    spec = tmp_path / "spec.yaml"
    spec.write_text(head + f"plugins: [{module}]\n")
    return spec


def fake_install(site: Path, name: str, entry_points: dict[str, str]) -> Path:
    """What `pip install` leaves for importlib.metadata (as tests/test_plugins.py does)."""
    info = site / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[composer.components]\n" +
                                           "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return site


# ------------------------------------------------------------------------------ plugins add names only


def test_a_plugin_class_named_like_the_builtin_cannot_replace_its_kind(tmp_path):
    spec = plugin_spec(tmp_path, "shadow_grpo_tb", SHADOW_GRPO)
    for command in (["validate"], ["explain"], ["check"]):
        r = composer(*command, "--allow-plugins", spec, path=[tmp_path])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert (f"{spec}:6:11: error: plugins[0]: plugin module 'shadow_grpo_tb' registers kind 'grpo' of "
                "objective, which is built in; a plugin adds names, choose another kind name") in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["math", "code"])
def test_a_plugin_cannot_replace_a_builtin_verifier(tmp_path, name):
    spec = plugin_spec(tmp_path, "shadow_verifier_tb", SHADOW_VERIFIER.format(name=name))
    r = composer("validate", "--allow-plugins", spec, path=[tmp_path])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"plugins[0]: plugin module 'shadow_verifier_tb' registers verifier '{name}', which is built in; "
            "a plugin adds names, choose another verifier name") in r.stderr, r.stderr


@pytest.mark.parametrize("section", registry.SECTIONS)
def test_no_section_lets_a_plugin_replace_a_builtin_kind(section, monkeypatch):
    monkeypatch.setattr(registry, "REFUSED", {})
    # a built-in kind: earlier tests in this process may have registered plugin kinds beside them
    kind, builtin = min((k, c) for k, c in registry.kinds(section).items() if not c.plugin)
    same_name = create_model(builtin.__name__, __base__=builtin, __module__="evil_plugin_tb")
    registry.register(section)(same_name)
    assert registry.lookup(section, kind) is builtin
    assert registry.refusals("evil_plugin_tb") == [
        (f"plugin module 'evil_plugin_tb' registers kind '{kind}' of {section}, which is built in; a plugin adds "
         f"names, choose another kind name (class {builtin.__name__} of evil_plugin_tb was not registered)")]


def test_an_installed_plugin_that_replaces_a_builtin_stops_every_command(tmp_path):
    (tmp_path / "shadow_ep_tb.py").write_text(SHADOW_GRPO + SHADOW_VERIFIER.format(name="math"))
    site = fake_install(tmp_path / "site", "shadow-ep", {"shadow": "shadow_ep_tb"})
    want = "plugin shadow (entry point shadow = shadow_ep_tb) registers kind 'grpo' of objective, which is built in"
    for command in (["validate", REPO / "specs" / "grpo.yaml"], ["list"], ["schema", "--out", tmp_path / "s.json"]):
        r = composer(*command, path=[site, tmp_path])
        assert r.returncode == 2 and "Traceback" not in r.stderr, (command, r.stderr[-2000:])
        assert want in r.stderr and "registers verifier 'math'" in r.stderr, (command, r.stderr)
    assert not (tmp_path / "s.json").exists()


def test_a_plugin_adding_new_names_still_works(tmp_path):
    head = HEAD.replace("verifier: math", "verifier: always_right_tb").replace("kind: grpo", "kind: my_grpo_tb")
    spec = plugin_spec(tmp_path, "new_names_tb", NEW_NAMES, head)
    r = composer("validate", "--allow-plugins", spec, path=[tmp_path])
    assert r.returncode == 0, r.stderr
    assert f"{spec}: ok" in r.stdout and "warning" not in r.stderr
    site = fake_install(tmp_path / "site", "new-names", {"new": "new_names_tb"})
    r = composer("validate", REPO / "specs" / "grpo.yaml", path=[site, tmp_path])  # installed: no effect on others
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------ model folders with their own code


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def known_type_with_code(tiny: str, folder: Path, marker: Path) -> Path:
    """A copy of `tiny` that keeps its known model_type (qwen3) and names its own Python in `auto_map`: without a
    check, transformers builds Qwen3ForCausalLM and the folder's code is silently not what trains."""
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "custom_code.CustomModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import Qwen3ForCausalLM\n"
        "class CustomModel(Qwen3ForCausalLM):\n    pass\n")
    return folder


def test_a_model_folder_with_auto_map_is_refused_before_the_run(tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = known_type_with_code(tiny, tmp_path / "custom", marker)
    out = tmp_path / "run"
    r = composer("run", "specs/sft.yaml", f"policy.model={folder}", *FAST, "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{folder / 'config.json'} names the folder's own Python code" in r.stderr, r.stderr
    assert "AutoModelForCausalLM = custom_code.CustomModel" in r.stderr and "--trust-remote-code" in r.stderr
    assert "policy.trust_remote_code: true" in r.stderr
    assert not out.exists() and not marker.exists()
    bundle = tmp_path / "bundle"  # OpenRLHF on the cluster would load the built-in class just the same
    r = composer("compile", "specs/grpo.yaml", f"policy.model={folder}", "--backend", "openrlhf", "--out", bundle)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"policy.model: {folder / 'config.json'} names the folder's own Python code" in r.stderr, r.stderr
    assert not bundle.exists() and not marker.exists()


def test_a_reward_model_folder_with_auto_map_is_refused_before_the_run(tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = known_type_with_code(tiny, tmp_path / "custom", marker)
    out = tmp_path / "run"
    r = composer("run", "specs/methods/ppo-rm.yaml", f"sources.rm.model={folder}", *FAST, "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"sources.rm.model: {folder / 'config.json'} names the folder's own Python code" in r.stderr, r.stderr
    assert "sources.rm.trust_remote_code: true" in r.stderr and not out.exists() and not marker.exists()


def test_every_model_loader_refuses_auto_map_without_trust(tiny, tmp_path, monkeypatch):
    """The loaders themselves (policy, reward model, critic): the check holds for sources a run's pre-check skips."""
    from composer.errors import ModelLoadError
    from composer.runtime.models import load_model, load_scorer, load_value_model

    monkeypatch.delenv("COMPOSER_TRUST_REMOTE_CODE", raising=False)
    marker = tmp_path / "RAN"
    folder = known_type_with_code(tiny, tmp_path / "custom", marker)
    for load in (load_model, load_scorer, load_value_model):
        with pytest.raises(ModelLoadError, match="auto_map: AutoModelForCausalLM = custom_code.CustomModel"):
            load(str(folder))
    assert not marker.exists()
    assert type(load_model(tiny)).__name__ == "Qwen3ForCausalLM"  # a folder without code loads as before


def test_with_the_opt_in_the_folder_trains_with_its_code_and_export_needs_it_too(tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = known_type_with_code(tiny, tmp_path / "custom", marker)
    out = tmp_path / "run"
    r = composer("run", "specs/sft.yaml", f"policy.model={folder}", "policy.trust_remote_code=true", *FAST,
                 "--out", out, "--trust-remote-code")
    assert r.returncode == 0, r.stderr[-2000:]
    assert marker.exists()  # its own class trained
    marker.unlink()
    r = composer("export", out, "--out", tmp_path / "exp")  # the checkpoint's trust is not this command's user's
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "config.json names the folder's own Python code" in r.stderr and not marker.exists(), r.stderr
    assert not (tmp_path / "exp").exists()
    r = composer("export", out, "--out", tmp_path / "exp", "--trust-remote-code")
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------ model folders with custom code: never run unasked (issues 17, 29, 43)


def custom_code_folder(tiny: str, folder: Path, marker: Path) -> Path:
    """A copy of `tiny` whose config names its own Python, which writes `marker` when imported."""
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="composer_custom", auto_map={"AutoConfig": "custom_code.CustomConfig",
                                                       "AutoModelForCausalLM": "custom_code.CustomModel"})
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import Qwen3Config, Qwen3ForCausalLM\n"
        "class CustomConfig(Qwen3Config):\n    model_type = 'composer_custom'\n"
        "class CustomModel(Qwen3ForCausalLM):\n    config_class = CustomConfig\n")
    return folder


def test_a_model_folder_with_custom_code_is_refused_without_asking(tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = custom_code_folder(tiny, tmp_path / "custom", marker)
    r = subprocess.run([sys.executable, "-m", "composer", "run", "specs/grpo.yaml", f"policy.model={folder}",
                        "train.steps=1", *RUN_FAST, "--out", tmp_path / "o", "--no-progress"],
                       input="y\n", capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})  # a `y` on stdin must not be read
    assert r.returncode == 2 and "policy.trust_remote_code: true" in r.stderr, r.stderr[-2000:]
    assert not marker.exists() and "[y/N]" not in r.stdout + r.stderr


def test_trust_remote_code_is_passed_through(tiny, tmp_path, monkeypatch):
    from composer.runtime.models import load_model

    monkeypatch.setenv("COMPOSER_TRUST_REMOTE_CODE", "1")  # the user's opt-in
    marker = tmp_path / "RAN"
    folder = custom_code_folder(tiny, tmp_path / "custom", marker)
    assert type(load_model(str(folder), trust_remote_code=True)).__name__ == "CustomModel"
    assert marker.exists()


@pytest.mark.parametrize("command", ["validate", "explain", "compile"])
def test_a_spec_alone_cannot_turn_on_remote_code(tiny, tmp_path, command):
    marker = tmp_path / "RAN"
    folder = custom_code_folder(tiny, tmp_path / "custom", marker)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {REPO / 'specs' / 'grpo.yaml'}\npolicy:\n  model: {folder}\n  trust_remote_code: true\n")
    extra = {"compile": ["--backend", "openrlhf", "--out", tmp_path / "b"]}.get(command, [])
    r = composer(command, spec, *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "policy.trust_remote_code" in r.stderr and "--trust-remote-code" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()
    assert composer("validate", spec, "--trust-remote-code").returncode == 0  # the user's explicit choice
    assert composer("validate", spec, env={"COMPOSER_TRUST_REMOTE_CODE": "1"}).returncode == 0


@pytest.mark.slow
def test_export_takes_no_trust_from_the_checkpoint_or_the_run_folder(tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = custom_code_folder(tiny, tmp_path / "custom", marker)
    out = tmp_path / "run"
    r = composer("run", "specs/sft.yaml", f"policy.model={folder}", "policy.trust_remote_code=true", "train.steps=1",
                 "train.prompts_per_step=2", "train.eval_every=0", "train.eval_samples=2", "--no-progress",
                 "--out", out, env={"COMPOSER_TRUST_REMOTE_CODE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    marker.unlink()
    r = composer("export", out, "--out", tmp_path / "exp")  # the checkpoint says trust: not this command's user
    assert r.returncode == 2 and "Traceback" not in r.stderr and not marker.exists(), r.stderr[-2000:]
    # the run folder's own model/, swapped for a folder with code, never runs either
    shutil.rmtree(folder)
    shutil.rmtree(out / "model")
    custom_code_folder(tiny, out / "model", marker)
    r = composer("export", out, "--out", tmp_path / "exp2")
    assert r.returncode == 2 and not marker.exists(), r.stderr[-2000:]


def test_export_from_a_folder_with_an_unknown_model_type_and_auto_map(finished_run, tiny, tmp_path):
    marker = tmp_path / "RAN"
    folder = custom_code_folder(tiny, tmp_path / "custom", marker)
    r = cli("export", finished_run, "--base", folder, "--out", tmp_path / "e")
    clean(r, codes=(2,))
    assert "auto_map" in r.stderr and "--trust-remote-code" in r.stderr, r.stderr
    assert not marker.exists() and not (tmp_path / "e").exists()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("auto_map")
    (folder / "config.json").write_text(json.dumps(cfg))
    r = cli("export", finished_run, "--base", folder, "--out", tmp_path / "e")
    clean(r, codes=(2,))
    assert "model_type 'composer_custom' is not one this transformers knows" in r.stderr, r.stderr
