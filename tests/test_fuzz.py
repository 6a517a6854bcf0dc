"""Bad specs never crash `composer validate`: hypothesis drives the mutations of examples/bench/fuzz_validate.py.

Every case must end with exit 0 or 2; exit 2 with a `file:LINE:COL: error:` message; never a traceback
or an "internal error". The standalone run (`python examples/bench/fuzz_validate.py --cases 10000`)
uses the same `mutate` with a seeded random.Random; here hypothesis supplies the Random (derandomized,
so the suite is reproducible) and shrinks any failure to a small case.
"""

from __future__ import annotations

import importlib.util
import sys
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
