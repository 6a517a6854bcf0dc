"""Hostile and careless input, third round (issue 29): each finding kept fixed.

Builtin-shadowing code rewards are in tests/test_sandbox.py (test_a_program_cannot_shadow_what_the_tests_call).
Here: the trust boundary (remote code and plugins need the user's command line or environment), files a
command must never lose, inputs that used to hang, silently wrong results and tracebacks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer.cli.main import main

REPO = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
        "train.eval_every=0", "train.eval_samples=2"]
HEAD = "name: x\nsources:\n  verifier: {kind: outcome_reward}\nsignal: {kind: reward, source: verifier}\n" \
       "objective: {kind: grpo}\n"
NO_TRUST = {"COMPOSER_TRUST_REMOTE_CODE": "", "COMPOSER_ALLOW_PLUGINS": ""}


def cli(*args, env=None):
    return CliRunner(env={**NO_TRUST, **(env or {})}).invoke(main, [str(a) for a in args], catch_exceptions=False)


def composer(*args, cwd=REPO, env=None, timeout=300, input=None):
    full = {**os.environ, "PYTHONPATH": str(REPO), **NO_TRUST, **(env or {})}
    return subprocess.run([sys.executable, "-m", "composer", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=timeout, input=input)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


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


@pytest.fixture(scope="module")
def finished_run(tiny, tmp_path_factory) -> Path:
    """A one-step run on the tiny model: a checkpoint and model/ to export, tamper with and resume."""
    out = tmp_path_factory.mktemp("run") / "run"
    r = cli("run", "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
            "train.eval_every=0", "train.eval_samples=2", "--no-progress", "--out", out)
    assert r.exit_code == 0, r.output
    return out


# ------------------------------------------------------------------------------ 2. one trust boundary


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


# ------------------------------------------------------------------------------ 3. files never lost


def test_export_never_replaces_a_folder_that_is_not_an_export(finished_run, tmp_path, tiny):
    base = tmp_path / "base"
    shutil.copytree(tiny, base)
    (base / "README.md").write_text("my notes")
    (base / "extra-00002.safetensors").write_bytes(b"x")
    before = sorted(p.name for p in base.iterdir())
    r = cli("export", finished_run, "--out", base)
    assert r.exit_code == 2 and "not an earlier export" in r.stderr, r.output
    assert sorted(p.name for p in base.iterdir()) == before and (base / "README.md").read_text() == "my notes"
    # an earlier export's files are replaced, a file the user put beside them is kept (tests/test_output_folders.py)
    assert cli("export", finished_run, "--out", tmp_path / "e").exit_code == 0
    (tmp_path / "e" / "stale.txt").write_text("old")
    assert cli("export", finished_run, "--out", tmp_path / "e").exit_code == 0
    assert (tmp_path / "e" / "stale.txt").read_text() == "old" and (tmp_path / "e" / "config.json").is_file()


def test_a_lock_symlink_never_truncates_its_target(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    r = cli("run", "specs/sft.yaml", "train.steps=1", "--out", out, "--no-progress")
    assert r.exit_code == 2 and "symbolic link" in r.stderr, r.output
    assert victim.read_text() == "keep me"


@pytest.mark.slow
def test_the_environment_never_hands_over_another_runs_folder(finished_run, tiny, tmp_path):
    """COMPOSER_RUN_DIR + LOCAL_RANK set by hand: the run keeps its own --out and lock."""
    before = (finished_run / "checkpoints" / "last.ckpt").read_bytes()
    out = tmp_path / "mine"
    for env in ({"COMPOSER_RUN_DIR": str(finished_run), "LOCAL_RANK": "0"},
                {"COMPOSER_RUN_DIR": str(finished_run), "LOCAL_RANK": "1", "RANK": "1"}):
        shutil.rmtree(out, ignore_errors=True)
        r = composer("run", "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
                     "train.eval_every=0", "train.eval_samples=2", "--no-progress", "--out", out, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert (out / "checkpoints" / "last.ckpt").is_file()
        assert (finished_run / "checkpoints" / "last.ckpt").read_bytes() == before


# ------------------------------------------------------------------------------ 5. hangs: chat templates


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    import realmodel

    return realmodel.built(tmp_path_factory)


def _bind_with_template(real, tmp_path, template: str, **data):
    import realmodel
    from transformers import AutoTokenizer

    from composer.lang.loader import load_text
    from composer.runtime.binding import bind_task
    from composer.checks.validate import validate_loaded

    tok = AutoTokenizer.from_pretrained(real["tokenizer"])
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    text = (f"name: t\npolicy: {json.dumps({'model': real['model'], 'tokenizer': str(tmp_path / 'tok')})}\n"
            + realmodel.data_block(real, **data) + "sources: {verifier: {kind: outcome_reward}}\n"
            "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    return bind_task(validate_loaded(load_text(text)).spec)


HOSTILE_TEMPLATES = {
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                    "{{ messages[-1]['content'] }}",
    "huge_repeat": "{{ 'x' * 10000000000 }}{{ messages[-1]['content'] }}",
    "huge_center": "{{ 'x'.center(1000000000) }}{{ messages[-1]['content'] }}",
    "huge_format": "{{ '%2000000000d' % 1 }}{{ messages[-1]['content'] }}",
    "huge_power": "{{ 10 ** 100000000 }}{{ messages[-1]['content'] }}",
}


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])  # with kwargs: the variables are analysed
@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_chat_template_is_rendered_with_time_and_size_limits(real, tmp_path, monkeypatch, name, kwargs):
    from composer import template_limits
    from composer.runtime.binding import DataError

    monkeypatch.setattr(template_limits, "SECONDS", 2.0)
    with pytest.raises(DataError, match="chat template"):
        _bind_with_template(real, tmp_path, HOSTILE_TEMPLATES[name],
                            **({"chat_template_kwargs": kwargs} if kwargs else {}))


def test_chat_template_kwargs_only_set_variables_the_template_reads(real, tmp_path):
    from composer.runtime.binding import DataError

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}<assistant>")
    task = _bind_with_template(real, tmp_path, template, chat_template_kwargs={"enable_thinking": False})
    assert task.train[0].prompt.endswith("<nothink><assistant>")
    with pytest.raises(DataError, match="chat_template, an argument of apply_chat_template"):
        _bind_with_template(real, tmp_path, template, chat_template_kwargs={"chat_template": "{{ 'pwned' }}"})
    with pytest.raises(DataError, match="sets thinking_budget, which the chat template does not read"):
        _bind_with_template(real, tmp_path, template, chat_template_kwargs={"thinking_budget": 3})


# ------------------------------------------------------------------------------ 5. hangs: data paths


@pytest.mark.parametrize("path", ["/proc/kmsg", "/proc/self/status", "/sys/kernel/notes", "/dev/zero", "fifo",
                                  "link_to_proc"])
def test_data_paths_are_regular_files_outside_proc_and_sys(tmp_path, path):
    from composer.runtime.paths import data_path_problem
    from composer.runtime.binding import DataError, bind_task
    from composer.checks.validate import validate_file

    if path == "fifo":
        path = tmp_path / "f.jsonl"
        os.mkfifo(path)
    elif path == "link_to_proc":
        path = tmp_path / "l.jsonl"
        path.symlink_to("/proc/self/status")
    assert "not a regular file" in data_path_problem(path)
    from composer.errors import SpecError

    spec = tmp_path / "s.yaml"
    spec.write_text(HEAD.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: exact}")
                    + f"data: {{train: {json.dumps(str(path))}, prompt_field: q, answer_field: a}}\n")
    with pytest.raises(SpecError, match="data.train: .*not a regular file"):  # validate refuses it (issue 56)
        validate_file(spec)
    good = tmp_path / "good.jsonl"  # and binding on its own, should the path change after validation
    good.write_text('{"q": "1+1", "a": "2"}\n')
    v = validate_file(spec, [f"data.train={good}"]).spec
    with pytest.raises(DataError, match="not a regular file"):
        bind_task(v.model_copy(update={"data": v.data.model_copy(update={"train": str(path)})}))
    r = composer("run", spec, "--out", tmp_path / "o", "--no-progress", timeout=120)
    assert r.returncode == 2 and "not a regular file" in r.stderr and not (tmp_path / "o").exists()


def test_a_jsonl_row_with_a_duplicate_key_is_refused(tmp_path):
    from composer.runtime.binding import DataError, bind_task
    from composer.checks.validate import validate_file

    train = tmp_path / "train.jsonl"
    train.write_text('{"q": "1+1", "a": "2"}\n{"q": "2+2", "a": "5", "a": "4"}\n')
    spec = tmp_path / "s.yaml"
    spec.write_text(HEAD.replace("{kind: outcome_reward}", "{kind: outcome_reward, verifier: exact}")
                    + f"data: {{train: {json.dumps(str(train))}, prompt_field: q, answer_field: a}}\n")
    with pytest.raises(DataError, match="row 2: .*the key 'a' appears twice"):
        bind_task(validate_file(spec).spec)


# ------------------------------------------------------------------------------ 5./6. composer samples


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_samples_on_a_fifo_or_dev_zero_does_not_hang(tmp_path, kind):
    target = tmp_path / "samples.jsonl"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    r = composer("samples", tmp_path, timeout=60)
    assert r.returncode == 2 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


GOOD = {"step": 1, "row": 1, "prompt": "p", "spans": [{"text": "a", "origin": "policy"}], "reward": 1.0}
MALFORMED = [
    {**GOOD, "spans": "text"},
    {**GOOD, "spans": [1, 2]},
    {**GOOD, "spans": [{"text": 5}]},
    {**GOOD, "reward": "high"},
    {**GOOD, "guide": [1]},
    {**GOOD, "verifier": "ok"},
    {**GOOD, "guide": {"verdicts": 3, "reviews": 1}},
    {**GOOD, "step": True},
    {**GOOD, "spans": [{"text": "x", "origin": {"a": 1}}]},
]


@pytest.mark.parametrize("i", range(len(MALFORMED)))
def test_samples_skips_malformed_rows_without_a_traceback(tmp_path, i):
    (tmp_path / "samples.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(MALFORMED[i]) + "\n")
    r = cli("samples", tmp_path)
    assert r.exit_code == 0 and "1 unreadable line skipped" in r.stderr, r.output


def test_samples_never_sends_escape_bytes_to_the_terminal(tmp_path):
    row = {**GOOD, "prompt": "\x1b]0;pwned\x07\x1b[2J", "spans": [{"text": "\x1b[31mred\x9b", "origin": "policy"}]}
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n")
    r = cli("samples", tmp_path)
    assert r.exit_code == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout and "\x9b" not in r.stdout
    assert "\\x1b[31mred" in r.stdout


# ------------------------------------------------------------------------------ 5. hangs: MLflow at a closed port


def test_mlflow_at_a_closed_port_is_a_clear_error(tmp_path):
    pytest.importorskip("mlflow")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = composer("run", "specs/sft.yaml", "train.steps=1", "train.loggers=[csv,mlflow]", "--out", tmp_path / "o",
                 "--no-progress", env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}, timeout=120)
    assert r.returncode == 2 and "tracking server" in r.stderr and "does not answer" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ 4. overrides and extends


@pytest.mark.parametrize("override, path, expected", [
    ("train.steps=010", ("train", "steps"), 10),  # YAML 1.1 would read octal 8
    ("train.seed=0o17", ("train", "seed"), 15),
    ("train.lr=1e-3", ("train", "lr"), 0.001),  # YAML 1.1 would read the string '1e-3'
    ("data.system_prompt=yes", ("data", "system_prompt"), "yes"),  # YAML 1.1 would read True
    ("name=on", ("name",), "on"),
])
def test_overrides_read_values_as_files_do(override, path, expected):
    from composer.lang.loader import load_spec

    data = load_spec(REPO / "specs" / "grpo.yaml", [override]).data
    for p in path:
        data = data[p]
    assert data == expected and type(data) is type(expected)


def test_a_base_60_override_is_refused_like_in_a_file(tmp_path):
    r = cli("validate", REPO / "specs" / "grpo.yaml", "train.steps=1:30")  # YAML 1.1 would read 90
    assert r.exit_code == 2 and "'1:30'" in r.stderr
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {REPO / 'specs' / 'grpo.yaml'}\ntrain: {{steps: 1:30}}\n")
    assert cli("validate", spec).exit_code == 2


def test_a_brace_override_without_spaces_says_so():
    """`{kind:linear,...}` is YAML for one key `kind:linear` with no value: the error says where the space goes
    (it was `objective.kl_coef.Schedule: missing required field 'Schedule'`)."""
    r = cli("validate", REPO / "specs" / "grpo.yaml", "objective.kl_coef={kind:linear,start:0.01,end:0,steps:10}")
    assert r.exit_code == 2 and "`kind:linear` is read as one key" in r.stderr and "write `kind: linear`" in r.stderr
    assert cli("validate", REPO / "specs" / "grpo.yaml",
               "objective.kl_coef={kind: linear, start: 0.01, end: 0, steps: 10}").exit_code == 0
    assert cli("validate", REPO / "specs" / "grpo.yaml", "summary=a:b").exit_code == 0  # a plain value keeps its colon


def test_extends_is_not_an_override():
    r = cli("validate", REPO / "specs" / "grpo.yaml", "extends=sft.yaml")
    assert r.exit_code == 2 and "`extends` cannot be overridden" in r.stderr


def test_extends_through_a_link_is_relative_to_the_real_file(tmp_path):
    from composer.lang.loader import load_spec

    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere"
    real.mkdir()
    elsewhere.mkdir()
    (real / "base.yaml").write_text(HEAD + "train: {steps: 7}\n")
    (elsewhere / "base.yaml").write_text(HEAD + "train: {steps: 99}\n")  # next to the link: not the author's base
    (real / "child.yaml").write_text("extends: base.yaml\nname: child\n")
    (elsewhere / "child.yaml").symlink_to(real / "child.yaml")
    assert load_spec(elsewhere / "child.yaml").data["train"]["steps"] == 7


# ------------------------------------------------------------------------------ 4. LoRA on a tied lm_head


def test_lora_on_a_tied_lm_head_exports_the_trained_model(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from composer.runtime.models import load_model, merged, prepare_policy
    from composer.lang.spec import Policy

    base = load_model(tiny)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # tied
    embed_before = base.get_input_embeddings().weight.detach().clone()
    policy = prepare_policy(base, Policy(lora={"r": 4, "target_modules": ["q_proj", "lm_head"]}))
    torch.manual_seed(0)
    with torch.no_grad():  # "training": every adapter moves
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.05)
    tokens = torch.randint(0, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        trained = policy(input_ids=tokens).logits
    plain = merged(policy)
    plain.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        exported = loaded(input_ids=tokens).logits
    assert torch.allclose(exported, trained, atol=1e-4), (exported - trained).abs().max()
    assert torch.equal(loaded.get_input_embeddings().weight, embed_before)


# ------------------------------------------------------------------------------ 4. bundles and exports


@pytest.mark.skipif(__import__("importlib").util.find_spec("openrlhf") is None, reason="openrlhf is not installed")
def test_a_relative_model_path_is_absolute_in_the_bundle(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "mymodel")
    r = composer("compile", REPO / "specs" / "grpo.yaml", "policy.model=mymodel", "--backend", "openrlhf", "--out",
                 "b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    args = json.loads((tmp_path / "b" / "args.json").read_text())
    text = json.dumps(args) + (tmp_path / "b" / "plan.json").read_text()
    assert str(tmp_path / "mymodel") in text and '"mymodel"' not in text


def test_export_refuses_non_finite_weights(finished_run, tmp_path):
    import torch

    from composer.runtime import checkpoint as ckpt_format

    state = ckpt_format.load(finished_run / "checkpoints" / "last.ckpt")
    key = next(k for k, v in state["state_dict"].items() if k.startswith("policy.") and v.is_floating_point())
    state["state_dict"][key] = torch.full_like(state["state_dict"][key], float("nan"))
    bad = tmp_path / "bad.ckpt"
    torch.save(state, bad)
    r = cli("export", bad, "--out", tmp_path / "e")
    assert r.exit_code == 2 and "NaN or inf" in r.stderr and not (tmp_path / "e").exists(), r.output


# ------------------------------------------------------------------------------ 4. InT's int_targets cache


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


# ------------------------------------------------------------------------------ 6. tracebacks


def _copy_run(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out, ignore=shutil.ignore_patterns(".lock"))
    return out


def test_resume_with_a_bad_step_cell_in_metrics_csv(finished_run, tmp_path):
    import csv

    out = _copy_run(finished_run, tmp_path)
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    with open(out / "metrics.csv", "a", newline="") as f:
        csv.DictWriter(f, header).writerow({k: "not-a-step" if k == "step" else "" for k in header})
    r = cli("run", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 0, r.output[-2000:]
    assert "not-a-step" not in (out / "metrics.csv").read_text()


def test_resume_with_a_damaged_rng_entry(finished_run, tmp_path):
    import torch

    from composer.runtime import checkpoint as ckpt_format

    out = _copy_run(finished_run, tmp_path)
    ckpt = out / "checkpoints" / "last.ckpt"
    state = ckpt_format.load(ckpt)
    state["composer"]["rng"] = "not a random state"
    torch.save(state, ckpt)
    r = cli("run", "--resume", out, "train.steps=2", "--no-progress")
    assert r.exit_code == 2 and "training state is damaged" in r.stderr, r.output[-2000:]
    assert "internal error" not in r.stderr


@pytest.mark.parametrize("override, message", [
    ("train.strategy=fsdp", "Lightning cannot run this here"),
    ("train.devices=[0,1]", "Lightning cannot run this here"),
    ("policy.lora.target_modules=[nope_proj]", "the model's linear modules are"),
    ("policy.lora.target_modules=[]", "at least 1 item"),
])
def test_settings_this_machine_or_model_cannot_honour(tiny, tmp_path, override, message):
    import torch

    if "strategy" in override or "devices" in override:
        if torch.cuda.is_available():
            pytest.skip("a GPU machine can honour it")
    r = cli("run", "specs/sft.yaml", f"policy.model={tiny}", "train.steps=1", "train.prompts_per_step=2",
            "train.eval_every=0", "train.eval_samples=2", override, "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and message in r.stderr and "internal error" not in r.stderr, r.output[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_full_disk_inside_torchs_zip_writer_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch

    from composer.backends.lightning import callbacks
    from composer.runtime.checkpoint import CheckpointError

    path = tmp_path / "last.ckpt"
    path.write_bytes(b"previous")

    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match="the previous checkpoint is kept"):
        callbacks.AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, path)
    assert path.read_bytes() == b"previous" and not (tmp_path / "last.ckpt.tmp").exists()


def test_a_full_disk_during_export_is_a_message_and_keeps_the_folder(finished_run, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    assert cli("export", finished_run, "--out", tmp_path / "e").exit_code == 0
    before = sorted(p.name for p in (tmp_path / "e").iterdir())

    class SafetensorError(Exception):  # what safetensors raises for ENOSPC (not an OSError)
        pass

    def full(self, *a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    r = cli("export", finished_run, "--out", tmp_path / "e")
    assert r.exit_code == 2 and "cannot write the model" in r.stderr and "internal error" not in r.stderr, r.output
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


# ------------------------------------------------------------------------------ 5. hangs: a node that never comes


@pytest.mark.slow
def test_sigterm_stops_a_run_waiting_for_a_second_node(tiny, tmp_path):
    import signal
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "PYTHONPATH": str(REPO), **NO_TRUST, "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    p = subprocess.Popen([sys.executable, "-m", "composer", "run", "specs/sft.yaml", f"policy.model={tiny}",
                          "train.steps=1", "train.prompts_per_step=2", "train.eval_every=0", "train.eval_samples=2",
                          "train.num_nodes=2", "train.accelerator=cpu", "--out", str(tmp_path / "o"),
                          "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:  # rank 0 listens: it waits for node 1 now
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)  # before: waited forever, SIGTERM ignored
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and "Traceback" not in err, err[-2000:]
