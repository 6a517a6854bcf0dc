"""What an OpenRLHF bundle carries: the plugin modules its components come from (imported from the moved
bundle alone), trust_remote_code passed to every tokenizer it loads, a clear error for an unknown verifier,
and the pure parts of the GPU smoke script (examples/cluster/smoke.py) on hand-written log lines.

Plugin bundles are compiled by the CLI in a fresh process (like tests/test_plugins.py), so the example
plugin's kind never enters this process's registry.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _helpers import composer

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "custom_component"
SRC = EXAMPLE / "src"
needs_openrlhf = pytest.mark.skipif(importlib.util.find_spec("openrlhf") is None,
                                    reason="openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")


def run_py(args, path=(), cwd=REPO):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMPOSER_ALLOW_PLUGINS")}
    env.update(COLUMNS="250", PYTHONPATH=os.pathsep.join(str(p) for p in path))
    return subprocess.run([sys.executable, *map(str, args)], check=False, capture_output=True, text=True,
                          env=env, cwd=cwd)


def compile_cli(spec, out, *extra, path=()):
    return run_py(["-m", "composer.cli.main", "compile", spec, "train.steps=2", *extra, "--backend", "openrlhf",
                   "--out", out, "--gpus-per-node", 1], path=path)


def fake_install(site: Path) -> Path:
    """The dist-info `pip install examples/custom_component` leaves (entry point only; the code stays in src/)."""
    info = site / "composer_length_penalty-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: composer-length-penalty\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[composer.components]\nlength_penalty = length_penalty\n")
    return site


def spec_without_plugins_line(tmp_path: Path) -> Path:
    text = "".join(x for x in (EXAMPLE / "spec.yaml").read_text().splitlines(True) if not x.startswith("plugins:"))
    (tmp_path / "spec.yaml").write_text(text)
    return tmp_path / "spec.yaml"


def moved(bundle: Path, tmp_path: Path) -> Path:
    """The bundle moved to another folder (the compiling machine's paths are gone)."""
    dest = tmp_path / "elsewhere" / "copied-bundle"
    dest.parent.mkdir()
    shutil.move(str(bundle), dest)
    return dest


# Loads the plan as the entry point and the worker hook do (hooks.load, then the run's Plan, which
# import the modules the segment specs name), then the plugin module and the bundle's reward.py.
PROBE = r"""
import json, os, sys
from composer.backends.openrlhf import hooks
from composer.plan.plan import Plan
plan, run = hooks.load("plan.json", None)
obj = Plan(plan, run["segments"]).segments[0].spec.objective
import composer, length_penalty, reward
print(json.dumps({"plugin": os.path.abspath(length_penalty.__file__), "composer": os.path.abspath(composer.__file__),
                  "kind": obj.kind_name(), "module": type(obj).__module__, "penalty": obj.penalty,
                  "reward": callable(reward.reward_func)}))
"""


def probe(bundle: Path) -> dict:
    r = run_py(["-c", PROBE], path=[bundle], cwd=bundle)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_runs_from(bundle: Path, seen: dict) -> None:
    root = str(bundle.resolve())
    assert seen["plugin"] == os.path.join(root, "length_penalty", "__init__.py")
    assert seen["composer"].startswith(root + os.sep)
    assert (seen["kind"], seen["module"], seen["penalty"], seen["reward"]) == \
        ("length_penalized_grpo", "length_penalty", 0.01, True)


@needs_openrlhf
def test_spec_plugins_module_ships_and_imports_from_the_moved_bundle(tmp_path):
    r = compile_cli(EXAMPLE / "spec.yaml", tmp_path / "b", "--allow-plugins", path=[SRC])
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["openrlhf"]["plugins"] == {"length_penalty": "length_penalty/"}
    assert "length_penalty/" in (tmp_path / "b" / "README.md").read_text()
    bundle = moved(tmp_path / "b", tmp_path)
    assert not list(bundle.rglob("__pycache__"))
    assert_runs_from(bundle, probe(bundle))


@needs_openrlhf
def test_entry_point_plugin_ships_and_the_plan_names_it(tmp_path):
    site = fake_install(tmp_path / "site")
    r = compile_cli(spec_without_plugins_line(tmp_path), tmp_path / "b", path=[site, SRC])
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert all(s["spec"]["plugins"] == ["length_penalty"] for s in plan["segments"])  # the cluster has no entry point
    bundle = moved(tmp_path / "b", tmp_path)
    assert_runs_from(bundle, probe(bundle))


@needs_openrlhf
def test_a_plugin_that_is_no_source_file_is_refused(tmp_path):
    archive = tmp_path / "plugins.zip"
    with zipfile.ZipFile(archive, "w") as z:  # importable (zipimport), but no file the bundle could copy
        source = (SRC / "length_penalty" / "__init__.py").read_text()  # the kind alone, without the package's
        source = "\n".join(ln for ln in source.splitlines() if not ln.startswith("from length_penalty import"))
        z.writestr("zipped_lp.py", source)  # other modules (its example environment)
    spec = tmp_path / "spec.yaml"
    spec.write_text((EXAMPLE / "spec.yaml").read_text().replace("plugins: [length_penalty]", "plugins: [zipped_lp]"))
    r = compile_cli(spec, tmp_path / "b", "--allow-plugins", path=[archive])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "plugin module 'zipped_lp'" in r.stderr and "not from a .py source file" in r.stderr
    assert "the bundle cannot carry it" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()


VERIFIER_PLUGIN = """from composer.registry import register_verifier
from components.tasks.verifiers import Verdict


@register_verifier("always_right", "A test plugin's verifier: reward 1 for any response.")
def always_right(response, example):
    return Verdict(1.0)
"""


@needs_openrlhf
def test_single_file_plugin_verifier_ships_and_scores_in_reward_py(tmp_path):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "always_right_plugin.py").write_text(VERIFIER_PLUGIN)
    spec = tmp_path / "spec.yaml"
    spec.write_text((REPO / "specs" / "grpo.yaml").read_text().replace(
        "name: grpo", "name: grpo-plugin-verifier\nplugins: [always_right_plugin]").replace(
        "verifier: {kind: outcome_reward}", "verifier: {kind: outcome_reward, verifier: always_right}"))
    r = compile_cli(spec, tmp_path / "b", "--allow-plugins", path=[tmp_path / "mods"])
    assert r.returncode == 0, r.stderr
    bundle = moved(tmp_path / "b", tmp_path)
    assert (bundle / "always_right_plugin.py").is_file()
    probe_text = ("import json, reward, always_right_plugin as m\n"
                  "print(json.dumps([reward.reward_func(['pq'], ['p'], ['{}'])['rewards'], m.__file__]))")
    r = run_py(["-c", probe_text], path=[bundle], cwd=bundle)
    assert r.returncode == 0, r.stderr[-3000:]
    value, where = json.loads(r.stdout.strip().splitlines()[-1])
    assert value == 1.0 and where == str(bundle.resolve() / "always_right_plugin.py")


# ---------------------------------------------------------------------------------- trust_remote_code

class FakeTokenizer:
    eos_token = "</s>"
    all_special_tokens = ("</s>", "<pad>")


@pytest.fixture
def tokenizer_calls(monkeypatch):
    import transformers

    calls = []

    def from_pretrained(path, **kw):
        calls.append((path, kw))
        return FakeTokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(from_pretrained))
    return calls


@pytest.mark.parametrize("trust", [False, True])
def test_reward_func_passes_trust_remote_code(trust, tokenizer_calls):
    from components.tasks import toy
    from composer.backends.openrlhf import batch as ob
    from composer.backends.openrlhf.reward import make_reward_func

    ex = toy.make_example("7+3-5")
    f = make_reward_func("toy", tokenizer="/models/policy", trust_remote_code=trust)
    assert f([ex.prompt + ex.solution + "</s>"], [ex.prompt], [ob.encode_label(ob.label_of(ex))])["rewards"] == 1.0
    assert tokenizer_calls == [("/models/policy", {"trust_remote_code": trust})]


@pytest.mark.parametrize("trust", [False, True])
def test_bundle_tokenizers_get_the_spec_trust_remote_code(trust, tokenizer_calls, monkeypatch):
    from composer.backends.openrlhf import bundle
    from composer.checks.validate import validate_file

    monkeypatch.setenv("COMPOSER_TRUST_REMOTE_CODE", "1")  # the user's opt-in (a spec alone is refused)
    v = validate_file(REPO / "specs" / "sft.yaml", [f"policy.trust_remote_code={str(trust).lower()}"])
    assert bundle._eos("/models/policy", v) == "</s>"
    assert tokenizer_calls == [("/models/policy", {"trust_remote_code": trust})]
    text = bundle.reward_file("x", "toy", "/models/policy", bundle.trust_remote_code(v))
    assert f"trust_remote_code={trust}" in text
    compile(text, "reward.py", "exec")


@needs_openrlhf
def test_compiled_reward_file_carries_trust_remote_code(tmp_path):
    r = compile_cli(REPO / "specs" / "grpo.yaml", tmp_path / "b", "policy.trust_remote_code=true")
    assert r.returncode == 2 and "--trust-remote-code" in r.stderr  # the spec alone never turns it on
    r = compile_cli(REPO / "specs" / "grpo.yaml", tmp_path / "b", "policy.trust_remote_code=true",
                    "--trust-remote-code")
    assert r.returncode == 0, r.stderr
    assert "trust_remote_code=True" in (tmp_path / "b" / "reward.py").read_text()
    # the user's opt-in travels with the bundle: the cluster's loaders honour it
    env = json.loads((tmp_path / "b" / "runtime_env.json").read_text())
    assert env["env_vars"]["COMPOSER_TRUST_REMOTE_CODE"] == "1"


# ---------------------------------------------------------------------------------------- verifiers

def test_unknown_verifier_names_itself_and_the_registered_ones():
    from composer.backends.openrlhf.reward import RewardError, make_reward_func

    with pytest.raises(RewardError) as e:
        make_reward_func("no_such_verifier")
    msg = str(e.value)
    assert "verifier 'no_such_verifier' is not registered" in msg and "toy" in msg and "math" in msg
    with pytest.raises(RewardError, match="plugin module 'no_such_plugin_mod' does not import here"):
        make_reward_func("toy", plugins=["no_such_plugin_mod"])


# ------------------------------------------------------------------------------ the GPU smoke script

@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("cluster_smoke", REPO / "examples" / "cluster" / "smoke.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def step_line(n: int, **metrics) -> str:
    return f"(PPOTrainer pid=1) [INFO] ✨ Global step {n}: {metrics!r}\n"


def test_smoke_reads_openrlhf_step_lines_per_run(smoke, tmp_path):
    log = tmp_path / "job.log"
    log.write_text("noise\n" + step_line(1, **{"composer/loss": 0.5, "timing/broadcast": 1.5})
                   + step_line(2, **{"composer/loss": -1e-3}) + "Sample: ['x', 1.0]\n"
                   + step_line(1, policy_loss=2.0))
    runs = smoke.runs_of(smoke.step_rows(log.read_text()))
    assert [[s for s, _ in r] for r in runs] == [[1, 2], [1]]
    assert runs[0][0][1] == {"composer/loss": 0.5, "timing/broadcast": 1.5} and runs[0][1][1]["composer/loss"] == -1e-3


def test_smoke_sync_check_fails_when_every_step_broadcasts(smoke):
    def rows(synced, times):
        return [(i + 1, {"composer/synced": s, "timing/broadcast": t}) for i, (s, t) in enumerate(zip(synced, times))]

    good = rows([0, 0, 1, 0, 0, 1], [0.001, 0.0, 2.0, 0.0, 0.002, 1.8])
    assert smoke.check_sync(good, every=3) == []
    assert smoke.check_sync(rows([1] * 6, [2.0] * 6), every=3)  # synced at every step
    assert smoke.check_sync(rows([0, 0, 1, 0, 0, 1], [1.9, 2.0, 2.0, 2.1, 1.8, 1.8]), every=3)  # broadcast anyway
    assert smoke.check_sync(good[:2], every=3)  # no sync reached


def test_smoke_phase_check_reads_reviews_and_guided(smoke):
    def rows(reviews, guided):
        return [(i + 1, {"composer_reviews": r, "composer_guided": g}) for i, (r, g) in enumerate(zip(reviews, guided))]

    switched = rows([2.0, 1.5, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0])
    assert smoke.check_phase(switched, switch=2) == []
    assert smoke.check_phase(switched, switch=1)  # step 1 (global) still reviewed: the switch is not there
    assert smoke.check_phase(rows([2.0] * 4, [0.5] * 4), switch=2)  # never switched
    assert smoke.check_phase(rows([0.0] * 4, [0.0] * 4), switch=2)  # phase 0 never reviewed
    assert smoke.check_phase([(1, {}), (2, {}), (3, {}), (4, {})], switch=2)  # metrics not logged


def test_smoke_reads_the_check_report_and_the_reference_model_print(smoke):
    log = ('(raylet) noise\ncomposer-check: {"run": "main", "problems": []}\n'
           "(ReferenceModelActor pid=7) (layers): ModuleList(\n(ReferenceModelActor pid=7)   (0-5): 6 x Qwen3DecoderLayer(\n"
           "(PolicyModelActor pid=8)   (0-3): 4 x Qwen3DecoderLayer(\n")
    assert smoke.check_report(log) == {"run": "main", "problems": []}
    assert smoke.layers_printed(log, "ReferenceModelActor") == {6}
    assert smoke.layers_printed(log, "PolicyModelActor") == {4}
    assert smoke.check_report("nothing") is None


def test_smoke_first_step_check(smoke):
    assert smoke.check_first_step([(1, {"policy_loss": 0.3})], 0) == []
    assert smoke.check_first_step([(1, {"policy_loss": float("nan")})], 0)
    assert smoke.check_first_step([], 1)
    assert smoke.check_first_step([(1, {"composer/loss": 0.1})], 1)  # the job failed after its step


def test_smoke_without_a_gpu_says_so(smoke, monkeypatch, capsys):
    monkeypatch.setattr(smoke.shutil, "which", lambda name: None)
    assert smoke.main([]) == 2
    err = capsys.readouterr().err
    assert "smoke: error: no NVIDIA GPU" in err and "Traceback" not in err
    assert smoke.main(["--only", "bogus"]) == 2 and "--only takes start" in capsys.readouterr().err


def fake_step0(bundle: Path, folder: Path, micro: int = 2) -> list[dict]:
    """What smoke_capture.py records at step 0, written by hand from the bundle's own data: right-padded
    prompt + response rows with OpenRLHF's action mask ([B, T-1], shifted), vLLM log-probs and rewards."""
    import torch

    from composer.backends.openrlhf import batch as ob
    from composer.runtime.models import load_tokenizer

    plan = json.loads((bundle / "plan.json").read_text())
    tok = load_tokenizer(str(bundle / plan["openrlhf"]["policy_path"]))  # toy checkpoints ship in the bundle
    rows = [json.loads(x) for x in (bundle / "data" / "train.jsonl").read_text().splitlines()[:2]]
    samples = [(r, resp, float(i % 2)) for r in rows for i, resp in enumerate(["1+2=3\n#3", "9-9=0\n#7"])]
    ids = [(tok.encode(r["prompt"], add_special_tokens=False), tok.encode(resp, add_special_tokens=False)
            + [tok.eos_token_id]) for r, resp, _ in samples]
    width = max(len(p) + len(a) for p, a in ids)
    seq = torch.full((len(ids), width), tok.pad_token_id)
    att, act = torch.zeros(len(ids), width, dtype=torch.long), torch.zeros(len(ids), width - 1, dtype=torch.bool)
    for i, (p, a) in enumerate(ids):
        seq[i, :len(p) + len(a)] = torch.tensor(p + a)
        att[i, :len(p) + len(a)] = 1
        act[i, len(p) - 1:len(p) + len(a) - 1] = True
    rlp = torch.where(act, torch.full(act.shape, -1.5), torch.zeros(act.shape))
    labels = [ob.encode_label(dict(ob.decode_label(r["label"]), step=0)) for r, _, _ in samples]
    recs = []
    for k in range(0, len(ids), micro):
        sl = slice(k, k + micro)
        recs.append({"sequences": seq[sl], "attention_mask": att[sl], "action_mask": act[sl],
                     "rollout_log_probs": rlp[sl], "rewards": torch.tensor([s[2] for s in samples[sl]]),
                     "base_action_log_probs": None, "prompts": [s[0]["prompt"] for s in samples[sl]],
                     "labels": labels[sl], "loss": 0.0, "global_batch_size": len(ids), "dp_size": 1})
    folder.mkdir(parents=True)
    for i, rec in enumerate(recs):
        torch.save(rec, folder / f"step0-{i:03d}-1.pt")
    return recs


def small_bundle(spec: str, tmp_path: Path) -> Path:
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout
    from composer.checks.validate import validate_file

    bundle = tmp_path / spec
    compile_bundle(validate_file(REPO / "specs" / f"{spec}.yaml", ["train.steps=2"]), bundle,
                   Layout(nodes=1, gpus_per_node=1, cluster_dir=f"/tmp/composer-runs/{spec}"))
    return bundle


@needs_openrlhf
@pytest.mark.parametrize("spec", ["oapl", "opd"])
def test_smoke_loss_check_recomputes_the_lightning_figure(smoke, spec, tmp_path):
    import torch

    bundle = small_bundle(spec, tmp_path)
    job = smoke.Job(spec, bundle)
    recs = fake_step0(bundle, job.capture)
    ours, what = smoke.lightning_loss(smoke.read_plan(bundle), recs)
    assert ours is not None and math.isfinite(ours) and ours != 0, what
    assert "4 rows of step 0, 2 micro-batch(es)" == what
    for value, ok in ((ours, True), (ours + 1.0, False)):
        for i, f in enumerate(sorted(job.capture.glob("step0-*.pt"))):  # the micro-batches add up to the step
            torch.save({**recs[i], "loss": value / len(recs)}, f)
        assert (smoke.check_loss(job) == []) is ok
    for f in job.capture.glob("*.pt"):
        f.unlink()
    assert "recorded no step-0 micro-batch" in smoke.check_loss(job)[0]


@needs_openrlhf
def test_smoke_teacher_check_tells_the_teacher_from_the_student(smoke, tmp_path):
    import torch

    bundle = small_bundle("opd", tmp_path)
    plan = smoke.read_plan(bundle)
    job = smoke.Job("opd", bundle)
    recs = fake_step0(bundle, job.capture)
    files = sorted(job.capture.glob("step0-*.pt"))

    def slot_holds(path: str) -> None:  # the reference slot's log-probs, in OpenRLHF's [B, T-1] layout
        model = smoke._model(path, "float32", "cpu")
        for f, rec in zip(files, recs):
            lp = smoke._logprobs(model, rec["sequences"], rec["attention_mask"], 1.0)[:, 1:]
            torch.save({**rec, "base_action_log_probs": lp * rec["attention_mask"][:, 1:]}, f)

    slot_holds(plan["openrlhf"]["source_paths"]["teacher"])
    assert smoke.check_teacher(job) == []
    job.log = "(ReferenceModelActor pid=3)   (0-3): 4 x Qwen3DecoderLayer(\n"  # the student's print
    assert "printed a model of [4] layers" in smoke.check_teacher(job)[0]
    job.log = ""
    slot_holds(plan["openrlhf"]["policy_path"])
    assert "not the teacher's" in smoke.check_teacher(job)[0]


def test_smoke_capture_records_step_zero_only(tmp_path, capsys):
    """examples/cluster/smoke_capture.py's wrapper on a stand-in ComposerLoss: the value OpenRLHF gets is
    unchanged, step 0's micro-batch is written with the loss returned, other steps are not."""
    import types

    import torch

    from composer.backends.openrlhf import batch as ob

    spec = importlib.util.spec_from_file_location("smoke_capture", REPO / "examples" / "cluster" / "smoke_capture.py")
    cap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cap)

    class ComposerLoss:
        def __init__(self):
            self.ctx = {}

        def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                     batch_num_tokens=None, global_batch_size=None):
            return log_probs.sum() * 2, None, None, None, None

    mod = types.SimpleNamespace(ComposerLoss=ComposerLoss,
                                step_of=lambda labels: ob.decode_label(labels[0]).get("step", 0))
    cap.record_losses(mod, str(tmp_path / "cap"))
    cap.record_losses(mod, str(tmp_path / "cap"))  # once only
    loss = ComposerLoss()
    for step in (0, 1):
        exp = types.SimpleNamespace(sequences=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                                    rewards=torch.tensor([1.0, 0.0]), base_action_log_probs=None, prompts=["a", "b"],
                                    labels=[ob.encode_label({"step": step})] * 2)
        loss.ctx = {"experience": exp}
        out = loss(torch.full((2, 2), 0.25), None, None, action_mask=torch.ones(2, 2, dtype=torch.bool),
                   global_batch_size=2)
        assert float(out[0]) == 2.0
    files = list((tmp_path / "cap").glob("step0-*.pt"))
    assert len(files) == 1
    rec = torch.load(files[0], weights_only=False)
    assert rec["loss"] == 2.0 and rec["global_batch_size"] == 2 and rec["prompts"] == ["a", "b"]
    assert rec["rollout_log_probs"] is None and rec["action_mask"].dtype == torch.bool
    assert "composer-smoke-capture: step 0 micro-batch of 2 rows" in capsys.readouterr().out


# ------------------------------------------------------------------------------ evaluation in every bundle kind

EVAL_KINDS = ["specs/sft.yaml", "specs/grpo.yaml", "specs/methods/ppo.yaml", "specs/methods/ppo-rm.yaml",
              "specs/hybrids/sft-opd-grpo.yaml"]  # train_sft, native GRPO, a critic, a reward model, a curriculum


def compile_here(spec: str, overrides: list[str], out: Path) -> dict:
    """The bundle of `spec` compiled in this process (one GPU); returns its plan."""
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout
    from composer.checks.validate import validate_file

    return compile_bundle(validate_file(REPO / spec, overrides), out, Layout(nodes=1, gpus_per_node=1))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@needs_openrlhf
@pytest.mark.parametrize("spec", EVAL_KINDS)
def test_every_eval_setting_reaches_every_bundle_kind(spec, tmp_path):
    """Issue 56: the SFT bundle wrote data/eval.jsonl and passed no evaluation flag (the GRPO bundle did).
    train.eval_every becomes --eval.steps and train.eval_samples the rows per tier of data/eval.jsonl in every
    run of every bundle kind; a run that cannot evaluate says why in its README notes."""
    from collections import Counter

    plan = compile_here(spec, ["train.eval_every=3", "train.eval_samples=5"], tmp_path / "b")
    rows = [json.loads(x) for x in (tmp_path / "b" / "data" / "eval.jsonl").read_text().splitlines()]
    assert rows and set(Counter(r["datasource"] for r in rows).values()) == {5}
    readme = (tmp_path / "b" / "README.md").read_text()
    for run in plan["openrlhf"]["runs"]:
        argv = run["argv"]
        if run["trainer"] == "sft":  # the loss on the reference solutions, which every eval row carries
            assert all(r.get("target") for r in rows)
            assert any("train_sft's loss on the reference solutions" in x for x in run["native"]), run["native"]
        if "--eval.dataset" in argv:
            assert flag(argv, "--eval.dataset") == "data/eval.jsonl" and flag(argv, "--eval.steps") == "3", run["name"]
        else:  # only a reward model as the reward: OpenRLHF evaluates through a reward function
            assert spec.endswith("ppo-rm.yaml"), run["name"]
            assert any("no evaluation during" in x for x in run["notes"]) and "no evaluation during" in readme
    if any(r["trainer"] == "sft" for r in plan["openrlhf"]["runs"]):
        assert "`eval gpt_loss` in its logs" in readme


@needs_openrlhf
def test_eval_every_0_in_a_bundle(tmp_path):
    """Lightning's train.eval_every 0 is "only the final evaluation": train_sft does that (--eval.steps -1 is once
    per epoch, and a run is one epoch); OpenRLHF's PPO trainer never evaluates with -1, and the README says so
    (before: "greedy pass@1 evaluation every no steps")."""
    run = compile_here("specs/sft.yaml", ["train.eval_every=0"], tmp_path / "sft")["openrlhf"]["runs"][0]
    assert flag(run["argv"], "--eval.steps") == "-1"
    assert any("once, after the run's steps" in x for x in run["native"])
    run = compile_here("specs/grpo.yaml", ["train.eval_every=0"], tmp_path / "grpo")["openrlhf"]["runs"][0]
    assert not any("evaluation every" in x for x in run["native"])
    assert any("no evaluation during the run: train.eval_every is 0" in x for x in run["notes"])


@needs_openrlhf
@pytest.mark.parametrize("spec", ["specs/sft.yaml", "specs/grpo.yaml"])
@pytest.mark.parametrize("setting", ["train.eval_k=4", "train.eval_verifier=exact"])
def test_an_eval_setting_a_bundle_cannot_honour_is_refused(spec, setting, tmp_path):
    """pass@k (sampled answers) and another verifier than the reward's have no OpenRLHF evaluation: refused
    with the field and the reason, never dropped."""
    from composer.backends.openrlhf.flags import Unsupported

    with pytest.raises(Unsupported) as e:
        compile_here(spec, [setting], tmp_path / "b")
    assert e.value.path[-1] == setting.split("=")[0].split(".")[-1] and e.value.reason and e.value.hint


@needs_openrlhf
def test_sft_bundle_refuses_an_eval_verifier_on_the_cli(tmp_path):
    r = compile_cli("specs/sft.yaml", str(tmp_path / "b"), "train.eval_verifier=toy")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "eval_verifier" in r.stderr and "train_sft evaluates the loss" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ a relative model path (issue 29)


@pytest.mark.skipif(__import__("importlib").util.find_spec("openrlhf") is None, reason="openrlhf is not installed")
def test_a_relative_model_path_is_absolute_in_the_bundle(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "mymodel")
    r = composer("compile", REPO / "specs" / "grpo.yaml", "policy.model=mymodel", "--backend", "openrlhf", "--out",
                 "b", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    args = json.loads((tmp_path / "b" / "args.json").read_text())
    text = json.dumps(args) + (tmp_path / "b" / "plan.json").read_text()
    assert str(tmp_path / "mymodel") in text and '"mymodel"' not in text
