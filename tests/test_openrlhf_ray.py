"""OpenRLHF bundles against a real Ray 2.55 and OpenRLHF 0.11.2's real trainer module, on CPU (issue 14).

- D1 launch.sh gives `ray job submit --` the entry point as separate words: checked fast with a recording
  `ray` and `sh` run as Ray's job supervisor runs the line, and (slow) by submitting the bundle's own
  launch.sh --check to a local Ray head, where the entry point starts and a Ray worker runs the setup hook.
- D2 the trainer patch reaches the class Ray instantiates for the PPOTrainer actor: OpenRLHF's own
  train_step runs on that class (after Ray's pickling; slow: in a Ray worker) and broadcasts at sync steps only.
- D5 a bundle moved to another folder holds no path of this checkout and runs from its own code copy.
- D6 data.max_len holds the longest judge prompt plus its answer; a judge that cannot fit is refused.
- D7 compile without OpenRLHF says what to install and exits 2.
The CPU stand-ins for vLLM / flash-attn (tests/openrlhf_cpu_stubs) only ever go on a subprocess's path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "tests" / "openrlhf_cpu_stubs"
HELPERS = ROOT / "tests" / "openrlhf_ray"
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
HAVE_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("deepspeed") is not None
needs_openrlhf = pytest.mark.skipif(not HAVE_OPENRLHF, reason="pip install --no-deps openrlhf==0.11.2")
needs_ray = pytest.mark.skipif(not (HAVE_OPENRLHF and HAVE_RAY), reason="needs ray[default]==2.55.0 and deepspeed "
                               "(the project's openrlhf-cpu extra, installed by make setup)")


def _compile(spec: str, out: Path, *overrides) -> Path:
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout

    v = validate_file(ROOT / spec)
    compile_bundle(v, out, Layout(nodes=1, gpus_per_node=8, cluster_dir=f"/tmp/composer-runs/{v.spec.name}"))
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    if not HAVE_OPENRLHF:
        pytest.skip("openrlhf is not installed")
    return {name: _compile(f"specs/{name}.yaml", tmp_path_factory.mktemp(name) / "bundle") for name in ("oapl", "int", "sft")}


def _plain_env(**extra) -> dict:
    """This machine's environment without PYTHONPATH (nothing of the checkout on the path), the venv first."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    if "RAY_TMP" in extra:  # every Ray process of the test (head, job driver, workers) keeps out of /tmp/ray
        env["RAY_TMPDIR"] = extra["RAY_TMP"]
    return env


def _recorder(folder: Path, name: str) -> None:
    """An executable `name` that appends its argv (as JSON) to calls.jsonl in `folder`."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(folder / 'calls.jsonl')!r}, 'a')"
                    ".write(json.dumps(sys.argv) + '\\n')\n")
    path.chmod(0o755)


def _calls(folder: Path) -> list[list[str]]:
    f = folder / "calls.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


# ------------------------------------------------------------------------------------------------- D1

@needs_openrlhf
@pytest.mark.parametrize("check", [False, True])
def test_launch_passes_the_entry_point_as_words_that_sh_runs(bundles, tmp_path, check):
    """launch.sh -> `ray` (recorded) -> Ray's join (subprocess.list2cmdline) -> `sh -c`, as Ray's CLI and job
    supervisor do: each run's entry point starts with the argv the plan names, runs chained in order."""
    d = bundles["int"]
    fake = tmp_path / "bin"
    fake.mkdir()
    _recorder(fake, "ray")
    env = _plain_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", str(d / "launch.sh"), *(["--check"] if check else []), "http://127.0.0.1:1",
                        "--no-wait"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (argv,) = _calls(fake)
    i = argv.index("--")
    assert argv[1:6] + argv[7:i] == ["job", "submit", "--address", "http://127.0.0.1:1", "--runtime-env-json",
                                     "--no-wait"]
    assert json.loads(argv[6]) == json.loads((d / "runtime_env.json").read_text())
    words = argv[i + 1:]
    runs = [r["name"] for r in json.loads((d / "plan.json").read_text())["openrlhf"]["runs"]]
    assert runs == ["sft", "rl"]
    tail = ["--check"] if check else []
    assert words == ["python", "-m", "composer.backends.openrlhf", "--plan", "plan.json", "--run", "sft", *tail, "&&",
                     "python", "-m", "composer.backends.openrlhf", "--plan", "plan.json", "--run", "rl", *tail]
    # what the job supervisor does with them: one line, through sh; `python` is recorded here
    _recorder(fake, "python")
    (fake / "calls.jsonl").unlink()
    line = subprocess.list2cmdline(words)
    r = subprocess.run(line, shell=True, cwd=d, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [c[1:] for c in _calls(fake)] == [words[1:words.index("&&")], words[words.index("&&") + 2:]]


@needs_openrlhf
def test_check_mode_of_an_sft_run_parses_its_arguments(bundles):
    """--check of a train_sft run (no Ray): the entry point reads the plan's argv, OpenRLHF's parser accepts it."""
    d = bundles["sft"]
    r = subprocess.run([sys.executable, "-m", "composer.backends.openrlhf", "--plan", "plan.json", "--run", "main",
                        "--check"], cwd=d, env=_plain_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.split("composer-check: ", 1)[1])
    plan = json.loads((d / "plan.json").read_text())
    assert report["argv"] == plan["openrlhf"]["runs"][0]["argv"] and report["trainer"] == "sft"
    assert Path(report["composer"]).resolve() == (d / "composer").resolve()  # the bundle's own copy
    assert report["openrlhf_parser"] == "accepted" and report["problems"] == []


# ------------------------------------------------------------------------------------------------- D5

@needs_openrlhf
def test_bundle_is_self_contained_after_a_move(bundles, tmp_path):
    moved = tmp_path / "elsewhere" / "oapl"
    shutil.copytree(bundles["oapl"], moved)
    env = json.loads((moved / "runtime_env.json").read_text())
    assert env["working_dir"] == "." and "py_modules" not in env
    for f in moved.rglob("*"):
        if f.is_file():
            text = f.read_bytes().decode("utf-8", "replace")
            assert str(ROOT) not in text and str(bundles["oapl"]) not in text, f
    code = ("import json, composer; from composer.backends.openrlhf import hooks, parser; plan, run = "
            "hooks.load('plan.json', None); parser.check(run['trainer'], run['argv']); print(composer.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=moved, env=_plain_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == (moved / "composer" / "__init__.py").resolve()


# ------------------------------------------------------------------------------------------------- D6

@needs_openrlhf
def test_max_len_holds_the_longest_judge_call(bundles):
    """int's stage 1 judge (the policy itself) generates on the rollout engine: a judge prompt built with the
    toy template from the longest problem and a response made of one-character steps (the most numbering)
    plus the judge's answer budget fits in data.max_len."""
    from components.tasks.toy import TEMPLATES

    d = bundles["int"]
    run = json.loads((d / "plan.json").read_text())["openrlhf"]["runs"][0]
    argv = run["argv"]
    max_len = int(argv[argv.index("--data.max_len") + 1])
    lengths = run["plugin"]["lengths"]
    assert lengths["max_len"] == max_len and lengths["rollout"] < max_len
    rows = [json.loads(x) for x in (d / "data" / "train.jsonl").read_text().splitlines()]
    problem = max((json.loads(r["label"]).get("problem") or r["prompt"] for r in rows), key=len)
    response = lengths["rollout"] - len(max((r["prompt"] for r in rows), key=len))
    steps = ["x"] * (response // 2)
    solution = max((json.loads(r["label"]).get("solution") or "" for r in rows), key=len)
    # InT's proposal (specs/int.yaml): the reference line, then the judge template over the numbered attempt
    prompt = TEMPLATES["context:reference_solution"].format(text=solution) + TEMPLATES["judge"].format(
        problem=problem, accepted="", steps="\n".join(f"{i + 1}:{s}" for i, s in enumerate(steps)))
    answer = 24  # one proposal answer: proposal_tokens in specs/int.yaml
    assert answer == lengths["judge_answer"]
    assert len(prompt) + answer <= max_len


@needs_openrlhf
def test_a_judge_that_cannot_fit_the_context_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "composer.cli.main", "compile", "specs/int.yaml",
                        "rollout.guide.max_correction_tokens=400", "--out", str(tmp_path / "b")], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr
    assert "judge's prompt" in r.stderr and "context of 512 tokens" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------- D7

HIDE = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "openrlhf" or name.startswith("openrlhf."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = ["composer", "compile", "specs/grpo.yaml", "--out", sys.argv[1]]
from composer.cli.main import main
main()
"""


def test_compile_without_openrlhf_says_what_to_install(tmp_path):
    out = tmp_path / "bundle"
    r = subprocess.run([sys.executable, "-c", HIDE, str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "pip install --no-deps openrlhf==0.11.2" in r.stderr and "--no-deps is enough for compiling" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


# ------------------------------------------------------------------------------------------------- D2

def _probe(bundle: Path, *args, timeout=600) -> dict:
    env = _plain_env(PYTHONPATH=f"{STUBS}{os.pathsep}{bundle}", RAY_TMP=tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    try:
        r = subprocess.run([sys.executable, str(HELPERS / "actor_probe.py"), *args], cwd=bundle, env=env,
                           capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(env["RAY_TMP"], ignore_errors=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.split("probe: ", 1)[1].splitlines()[0])


def _assert_synced_every_ten(out: dict) -> None:
    w = out["worker"]
    assert out["driver_train_step"].startswith("_patch_trainer") and w["train_step"].startswith("_patch_trainer")
    assert w["broadcast_steps"] == [9]  # specs/oapl.yaml sync.every 10: only after the 10th step
    assert w["synced"] == [float(s == 9) for s in range(12)]
    assert w["carried_step"] == list(range(1, 13))  # the step the labels carry (phases) advances


@needs_ray
def test_trainer_patch_reaches_the_class_ray_ships_for_the_actor(bundles):
    """Real openrlhf.trainer.ppo_trainer (its @ray.remote PPOTrainer built at import), hooks installed as the
    entry point installs them, the actor class through Ray's pickling, OpenRLHF's own train_step on it."""
    _assert_synced_every_ten(_probe(bundles["oapl"], "--local", "--steps", "12"))


@needs_ray
@pytest.mark.slow
def test_trainer_patch_runs_inside_a_ray_worker(bundles):
    """The same in a worker of a local Ray: the bundle as working_dir, its setup hook run there."""
    out = _probe(bundles["oapl"], "--steps", "12")
    _assert_synced_every_ten(out)
    w = out["worker"]
    assert w["setup_hook_ran"] and "working_dir_files" in w["composer"] and str(ROOT) not in w["composer"]


# ------------------------------------------------------------------------------------------ D1 on Ray

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_ray
@pytest.mark.slow
def test_launch_sh_starts_the_entry_point_on_a_real_ray_head(bundles, tmp_path):
    """A bundle copied to another folder, submitted with its own launch.sh --check to a local Ray 2.55 head:
    the job succeeds, its entry point ran with the plan's argv from the uploaded copy, and a Ray worker of the
    job ran the setup hook, which installed the run."""
    moved = tmp_path / "head-node" / "oapl"
    shutil.copytree(bundles["oapl"], moved)
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = _plain_env(RAY_TMP=ray_tmp)
    head = subprocess.Popen([sys.executable, str(HELPERS / "head.py"), str(_free_port())], env=env, cwd=tmp_path,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = head.stdout.readline()
        assert line.startswith("head: "), line
        address = json.loads(line[len("head: "):])["address"]
        r = subprocess.run(["bash", str(moved / "launch.sh"), "--check", address], env=env, capture_output=True,
                           text=True, timeout=400)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        assert "not found" not in r.stdout
        report = json.loads(r.stdout.split("composer-check: ", 1)[1].splitlines()[0])
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    plan = json.loads((moved / "plan.json").read_text())
    assert report["argv"] == plan["openrlhf"]["runs"][0]["argv"] and report["problems"] == []
    assert report["openrlhf_parser"] == "accepted"
    assert "working_dir_files" in report["composer"] and str(ROOT) not in report["composer"]
    assert report["worker"]["setup_hook_ran"] and report["worker"]["run"] == "main"
