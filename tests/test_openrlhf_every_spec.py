"""Every shipped spec as a real OpenRLHF job (issue 42, item 3): the slower tier next to tests/test_openrlhf_real.py.

    pytest -m "cluster and slow" tests/test_openrlhf_every_spec.py

Each spec under specs/ (a glob: a spec added there joins by itself) is compiled as shipped for the smallest
layout that holds it (1 node, 1 GPU to train and sample, colocated, plus one GPU per external judge or trace
writer, as the backend asks: `judges`). A spec that `compile_bundle` accepts runs as a real job of 2 steps
(more where its phases or stages need them: `small`) on the real-job tier's machinery (its Ray head, CPU
patches, recorder and `check_losses`): it starts, every run moves the weights, it trains its declared steps,
OpenRLHF logs the loss it trained on, and every step's loss equals the Lightning backend's on the same batch
and weights. A spec the backend refuses is refused with a reason that names a setting the spec holds; where the
refusal's hint is one setting (`set PATH: VALUE`), the spec with that setting applied runs as a job too (the
hint is a remedy that works). Specs the real-job tier already runs (any `specs/...yaml` its file names) are not
run again here: the tier's jobs are their rows in the closing table (tests/openrlhf_real/table.py).

Marked `cluster` and `slow`: not part of `make test` (about 15 more minutes on 2 cores).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_openrlhf import LIGHTNING_ONLY, OPENRLHF_OVERRIDES
from test_openrlhf_real import HAVE, ROOT, Head, check_losses, compile_for_cpu, job

from composer.checks.validate import validate_file

pytestmark = [pytest.mark.cluster, pytest.mark.slow,
              pytest.mark.skipif(not HAVE, reason="needs openrlhf==0.11.2 (--no-deps), ray and deepspeed")]

SPECS = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("specs/**/*.yaml"))
# the specs the real-job tier runs: every spec path its file names (each is a job it compiles)
TIER = set(re.findall(r'"(specs/[\w/.-]+\.yaml)"', (ROOT / "tests" / "test_openrlhf_real.py").read_text()))
SMALL = {"train.prompts_per_step": 2, "rollout.samples_per_prompt": 4, "rollout.temperature": 1.5}
# a short job's loss must say something (check_losses fails a job whose every loss is ~0): settings of the test
# (as the tier's own jobs have theirs; never of the backend) where a short job's rewards cannot. PrefixRL samples
# at temperature 1 (its teacher writes traces at the rollout's temperature, which OpenRLHF's engine for it keeps
# at 1), where the toy student writes the same answer in every sample of a prompt (8 samples of 2 prompts: 4
# distinct rows, every group all right or all wrong, every advantage 0): an entropy bonus (OpenRLHF's own
# --actor.entropy_coef) gives the loss a term that does not wait for the rewards
TUNING = {"specs/methods/prefixrl.yaml": ["train.entropy_coef=0.01"]}


def judge_calls(v) -> list:
    """The calls a guide makes to external models (a judge, PrefixRL's trace writer): the backend serves each
    model on a GPU of its own (flags._ppo_flags), so the smallest layout is 1 + len(judges(v)) GPUs."""
    specs = [seg.spec for seg in v.segments]
    return [c for s in specs for c in s.rollout.guide.model_calls(s) if not getattr(s.sources[c.source], "is_self", True)]


def judges(v) -> set[str]:
    return {c.source for c in judge_calls(v)}


def small(v) -> tuple[list[str], int]:
    """Overrides for a short job of the validated spec `v`, and the steps it then declares: 2 prompts x 4 samples
    at temperature 1.5 (mixed rewards on the toy; not where an external model samples what it writes at the
    rollout's temperature, PrefixRL's teacher: OpenRLHF's engine for it samples at 1, and compile refuses
    another); 2 steps, or one per phase (each phase ends one step after the previous one, so every phase runs);
    in a staged spec 2 steps per stage, with the stage's own batch settings shortened likewise."""
    s = v.spec
    short = {k: x for k, x in SMALL.items()
             if k != "rollout.temperature" or not any(c.sampled for c in judge_calls(v))}
    out = [f"{k}={x}" for k, x in short.items()]
    if s.stages:
        for i, st in enumerate(s.stages):
            out.append(f"stages[{i}].train.steps=2")
            for k, x in short.items():
                section, field = k.split(".")
                if field in (getattr(st, section) or {}):
                    out.append(f"stages[{i}].{k}={x}")
        return out, 2 * len(s.stages)
    steps = max(2, len(s.phases))
    out.append(f"train.steps={steps}")
    out += [f"phases[{i}].until={i + 1 if i < len(s.phases) - 1 else steps}" for i in range(len(s.phases))]
    return out, steps


def resolves(spec, path: tuple) -> bool:
    """The refusal's path names a setting of the spec (a field or list entry that is there and set)."""
    node = spec
    for key in path:
        try:
            node = node[key] if isinstance(key, int) or isinstance(node, dict) else getattr(node, key)
        except (AttributeError, IndexError, KeyError, TypeError):
            return False
    return node is not None


def refusal(spec: str, overrides: list[str], tmp: Path):
    """`compile_bundle` of the spec with `overrides` for its smallest layout: the Unsupported refusal, or None."""
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout, Unsupported

    v = validate_file(ROOT / spec, overrides)
    try:
        compile_bundle(v, tmp / "bundle", Layout(nodes=1, gpus_per_node=1 + len(judges(v)), cluster_dir=str(tmp / "c")))
    except Unsupported as e:
        return e
    return None


def hinted(e) -> list[str]:
    """A refusal's hint that is one setting (`set PATH: VALUE ...`) as an override; [] for any other hint."""
    m = re.match(r"set ([\w.\[\]]+): ([\w.+-]+)(?:\s|$)", e.hint or "")
    return [f"{m[1]}={m[2]}"] if m else []


@pytest.fixture(scope="module")
def head():
    h = Head(gpus=2)  # 2 logical GPUs: one trains and samples, one serves an external judge
    yield h
    h.stop()


@pytest.mark.parametrize("spec", [s for s in SPECS if s not in TIER])
def test_spec_runs_as_a_real_job(spec, head, tmp_path):
    """The spec compiles for the smallest layout and its short job passes the tier's checks, or the backend
    refuses it naming a setting the spec holds and saying why (then, where the hint is one setting, the spec
    with it runs and passes the same checks)."""
    extra = list(OPENRLHF_OVERRIDES.get(spec, []))
    refused = refusal(spec, [], tmp_path / "shipped")
    if refused is not None:
        dotted = ".".join(str(k) for k in refused.path)
        assert refused.reason.strip() and refused.path, (spec, refused)
        assert resolves(validate_file(ROOT / spec, []).spec, refused.path), f"{spec}: {dotted} is no setting of it"
        assert spec in LIGHTNING_ONLY or spec in OPENRLHF_OVERRIDES, (
            f"{spec} is refused ({dotted}: {refused.reason}); declare it in tests/test_openrlhf.py LIGHTNING_ONLY")
        extra = extra or hinted(refused)
        if not extra or refusal(spec, extra, tmp_path / "hinted") is not None:  # no hint, or a second refusal after it
            print(f"\n{spec}: refused at compile: {dotted}: {refused.reason}")
            return
    v = validate_file(ROOT / spec, extra)
    overrides, steps = small(v)
    bundle = compile_for_cpu(spec, [*extra, *overrides, *TUNING.get(spec, [])], tmp_path / "job",
                             gpus_per_node=1 + len(judges(v)))
    out = job(head, bundle)
    print(f"{spec}: {len(out['fits'])} of {steps} steps, largest |openrlhf - lightning| = {check_losses(out, steps):.3g}")


def test_every_spec_has_a_place():
    """The specs the real-job tier names and the Lightning-only ones are shipped specs (a renamed spec leaves
    neither list pointing at nothing), and the glob found the specs."""
    assert SPECS and TIER <= set(SPECS), sorted(TIER - set(SPECS))
    named = set(LIGHTNING_ONLY) | set(OPENRLHF_OVERRIDES) | set(TUNING)
    assert named <= set(SPECS), sorted(named - set(SPECS))
