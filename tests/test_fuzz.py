"""Bad specs never crash `composer validate`: hypothesis drives the mutations of examples/bench/fuzz_validate.py.

Every case must end with exit 0 or 2; exit 2 with a `file:LINE:COL: error:` message; never a traceback
or an "internal error". The standalone run (`python examples/bench/fuzz_validate.py --cases 10000`)
uses the same `mutate` with a seeded random.Random; here hypothesis supplies the Random (derandomized,
so the suite is reproducible) and shrinks any failure to a small case.

A few seeded mutants also go through `composer run` (one step) and `composer compile` as subprocesses
(`--through run,compile` of the standalone run): no traceback, no hang, no earlier run or bundle harmed.
A `composer run` costs seconds, so that test takes few mutants; the standalone run takes many.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_validate", REPO / "examples" / "bench" / "fuzz_validate.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fuzz_validate", fuzz)  # dataclasses look their module up by name
_spec.loader.exec_module(fuzz)

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def harness():
    h = fuzz.Harness()
    yield h
    h.close()


def check(harness, case: "fuzz.Case"):
    code, problem, out = harness.run(case)
    assert not problem, f"{problem}\nops: {case.ops}\ninput: {case.text[:1500]!r}\noutput:\n{out[-3000:]}"
    if code == 0:  # a valid mutant must also explain without error
        path = harness.dir / case.relpath
        r = harness.runner.invoke(harness.main, ["explain", str(path), *case.overrides, "--format", "json"])
        assert r.exit_code == 0 and "Traceback" not in r.output, r.output[-3000:]
    return code


@settings(max_examples=250, **SETTINGS)
@given(rnd=st.randoms(use_true_random=False))
def test_mutated_specs_never_crash(harness, rnd):
    check(harness, fuzz.mutate(rnd, harness.sources))


@settings(max_examples=25, **SETTINGS)
@given(raw=st.binary(max_size=400))
def test_random_bytes_never_crash(harness, raw):
    check(harness, fuzz.Case(raw, "specs/fuzz.yaml"))


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                         st.text(max_size=12))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(fuzz.SECTIONS) | st.text(max_size=8), inner,
                                                 max_size=4)), max_leaves=20)


@settings(max_examples=25, **SETTINGS)
@given(doc=st.dictionaries(st.sampled_from(fuzz.SECTIONS), yaml_values, max_size=6), text=st.text(max_size=80))
def test_arbitrary_documents_never_crash(harness, doc, text):
    import yaml

    body = yaml.safe_dump(doc, allow_unicode=True) + text
    check(harness, fuzz.Case(body.encode("utf-8", "surrogatepass"), "specs/fuzz.yaml"))


def test_every_mutation_kind_is_exercised(harness):
    import random

    rnd, seen = random.Random(0), set()
    for _ in range(400):
        seen.update(op.split()[0] for op in fuzz.mutate(rnd, harness.sources).ops)
    expected = {"drop", "retype", "rename", "kind", "ref", "deep", "huge", "nonfinite", "unicode", "bomb", "anchor",
                "bytes", "tag", "merge", "extends", "plausible", "override", "dup_line"}
    assert expected <= seen, expected - seen


@pytest.mark.parametrize("text", [
    ("a: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nname: x\n"),
    "name: x\nsummary: &s [*s]\n",
    "name: x\nobjective: {<<: [*nope]}\n",
    "name: " + "[" * 5000 + "]" * 5000 + "\n",
    "\ufeffname: x\n",
    "name: x\n\x00\n",
    "name: !!python/object/new:os.system [echo]\n",
    "%YAML 1.1\n---\nname: x\n---\nname: y\n",
])
def test_known_nasty_inputs(harness, text):
    code = check(harness, fuzz.Case(text.encode(), "specs/fuzz.yaml"))
    assert code == 2


# ---------------------------------------------------------------------------------------------- run and compile

@pytest.mark.parametrize("rc, stdout, stderr, expected", [
    (0, "run folder: x", "", "accepted"),
    (2, "", "x.yaml:1:1: error: no", "refused"),
    (130, "", "SIGINT: stopped before training", "refused"),
    (2, "", "", "traceback"),  # a refusal that says nothing is not clean
    (2, "", "x.yaml: error: internal error: KeyError: 'a' (traceback in /tmp/l.log; please report it)", "traceback"),
    (0, "Traceback (most recent call last):\n", "", "traceback"),
    (1, "", "error", "traceback"),
    (-11, "", "", "traceback"),  # killed by a signal: a crash
    (None, "", "", "hang"),
])
def test_verdicts(rc, stdout, stderr, expected):
    assert fuzz.verdict(rc, stdout, stderr) == expected


def test_a_hung_command_is_killed_at_its_limit(tmp_path):
    t0 = time.perf_counter()
    rc, _, _ = fuzz.cli([], tmp_path, 1.0, program=(sys.executable, "-c", "import time; time.sleep(60)"))
    assert rc is None and time.perf_counter() - t0 < 20


def test_an_in_process_hang_is_interrupted():
    with pytest.raises(fuzz.Hang), fuzz.deadline(0.2):
        time.sleep(5)


def test_losses_are_files_that_changed_or_vanished(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    for name in ("metrics.csv", "checkpoints/last.ckpt", fuzz.SENTINEL, ".lock"):
        (tmp_path / name).write_text(name)
    before = fuzz.snapshot(tmp_path)
    assert fuzz.losses(before, tmp_path) == []
    (tmp_path / ".lock").write_text("4242")  # every attempt rewrites the lock: not data
    (tmp_path / "new.txt").write_text("x")  # an added file loses nothing
    assert fuzz.losses(before, tmp_path) == []
    (tmp_path / "metrics.csv").write_text("step\n")
    (tmp_path / fuzz.SENTINEL).unlink()
    assert sorted(fuzz.losses(before, tmp_path)) == ["SENTINEL.txt vanished", "metrics.csv changed"]
    assert len(fuzz.losses(before, tmp_path / "gone")) == 3


@pytest.mark.parametrize("spec, expected", [
    ("specs/grpo.yaml", ["train.steps=1"]),
    ("specs/mintrl.yaml", ["train.steps=1"]),  # phased: the phases are cut at step 1, with a warning
    ("specs/hybrids/sft-opd-grpo.yaml", ["stages.0.train.steps=1", "stages.1.train.steps=1", "stages.2.train.steps=1"]),
])
def test_run_overrides_make_one_valid_step(spec, expected):
    from composer.checks.validate import validate_file

    case = fuzz.Case(b"", spec, ["rollout.temperature=0.5"])
    ov = fuzz.run_overrides(REPO / spec, case, valid=True)
    assert ov[-1] == "rollout.temperature=0.5"  # the case's own overrides come last, and win
    assert [o for o in ov if "steps=" in o] == expected
    assert validate_file(str(REPO / spec), ov).total_steps == len(expected)  # staged: one step per stage
    assert fuzz.run_overrides(REPO / spec, case, valid=False) == case.overrides  # nothing to mend an invalid case


@pytest.fixture(scope="module")
def through(harness):
    return fuzz.Through(harness, run_timeout_s=120.0, compile_timeout_s=60.0)


def seeded_cases(harness, valid: int, invalid: int, seed: int = 0) -> list:
    """The first `valid` mutants that validate accepts and the first `invalid` it refuses, from a seeded Random:
    most mutants are invalid, and only the valid ones reach training, so both kinds are picked on purpose."""
    rnd, picked, want = random.Random(seed), [], {True: valid, False: invalid}
    while any(want.values()):
        case = fuzz.mutate(rnd, harness.sources)
        ok = harness.run(case)[0] == 0
        if want[ok]:
            want[ok] -= 1
            picked.append(case)
    return picked


def test_mutants_survive_run_and_compile(harness, through):
    assert set(fuzz.MUST_SURVIVE) <= set(through.finished_snap)  # the loss check watches a real finished run
    tally, bad = fuzz.Tally(), []
    for i, case in enumerate(seeded_cases(harness, valid=1, invalid=5)):
        for o in fuzz.attack(harness, through, case, i):
            tally.add(o)
            if o.verdict in ("traceback", "hang") or o.lost:
                bad.append(f"{o.step}: {o.verdict} {o.lost}\nops {case.ops}\n{case.text[:1500]!r}\n{o.out[-3000:]}")
    assert not bad, "\n\n".join(bad)
    assert tally.verdicts["run"]["accepted"] >= 1, tally.table()  # a valid mutant really trained a step
    assert tally.verdicts["compile"]["accepted"] >= 1, tally.table()
    for step in ("run --out <finished run>", "compile --out <finished run>"):
        assert tally.verdicts[step]["refused"] == 6, tally.table()


@pytest.mark.slow
def test_env_driven_runs_and_tampered_run_folders(harness):
    """Issue 29's classes: a run with the environment aimed at another run's folder or a closed MLflow port, and
    a finished run's folder tampered with (a .lock link, bad cells, a damaged checkpoint, shipped code, FIFOs)."""
    through = fuzz.Through(harness, steps=("env", "tamper"), run_timeout_s=150.0, compile_timeout_s=60.0)
    tally, bad = fuzz.Tally(), []
    n = len(fuzz.Through.TAMPERS)
    for i, case in enumerate(seeded_cases(harness, valid=1, invalid=n - 1, seed=29)):
        for o in fuzz.attack(harness, through, case, i):
            tally.add(o)
            if o.verdict in ("traceback", "hang") or o.lost:
                bad.append(f"{o.step}: {o.verdict} {o.lost}\n{o.out[-3000:]}")
    assert not bad, "\n\n".join(bad)
    assert sum(1 for s in tally.verdicts if s.startswith("tampered")) == n, tally.table()  # every tampering tried
