"""Issue 27's defects of the OpenRLHF backend, each checked on its own (fast; the real jobs that found them
are tests/test_openrlhf_real.py)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from composer.backends.openrlhf import hooks
from composer.backends.openrlhf.__main__ import cluster_fit

ROOT = Path(__file__).resolve().parent.parent
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None


# ------------------------------------------------------------------------------- resume and the schedule

def _schedule_of(monkeypatch, every: int, steps: int = 12):
    """hooks' schedule and segments from a real compiled Plan of GRPO with `sync.every`."""
    from composer.plan.plan import Plan
    from composer.plan.compile import compile_plan
    from composer.checks.validate import validate_file

    lag = ["sync.off_policy_ok=true"] if every > 1 else []  # with a sync every step there is no lag to allow
    v = validate_file(ROOT / "specs" / "grpo.yaml", [f"sync.every={every}", *lag, f"train.steps={steps}"])
    plan = json.loads(json.dumps(compile_plan(v)))  # as plan.json
    monkeypatch.setattr(hooks, "_plan", lambda: Plan(plan, list(range(len(plan["segments"])))))


@pytest.mark.parametrize("every,step,want", [(2, 0, True), (2, 2, True), (2, 4, True), (3, 1, False), (3, 2, False),
                                             (3, 3, True), (3, 6, True), (1, 5, True)])
def test_resume_broadcasts_only_where_the_schedule_synced(monkeypatch, every, step, want):
    """fit()'s broadcast on resuming after `step` finished steps: allowed when the Plan synced after step; before
    the first sync the engine keeps the initial weights, as scheduled."""
    _schedule_of(monkeypatch, every)
    assert hooks.resume_sync(step) is want


def test_resume_between_two_later_syncs_is_refused(monkeypatch):
    _schedule_of(monkeypatch, 3)
    with pytest.raises(RuntimeError, match=r"resume after step 4: .* sync after step 3, .*checkpoint at a sync step"):
        hooks.resume_sync(4)


def _exp(prompt: str, label: str, tokens: list[int]):
    import torch

    return SimpleNamespace(prompts=[prompt], labels=[label], sequences=torch.tensor([tokens]))


def test_rollouts_are_put_in_dispatch_order_group_by_group():
    """OpenRLHF collects each prompt's group in the order the engines finish; the step trains them in the order
    the prompts were sent, each group's samples kept in their order, one (prompt, label) sent twice ordered by
    tokens; rows that do not split into groups of n are left as collected."""
    sent = [("p0", "l0"), ("p1", "l1"), ("p0", "l0")]
    a = [_exp("p1", "l1", [5, 1]), _exp("p1", "l1", [5, 2])]
    b = [_exp("p0", "l0", [9, 9]), _exp("p0", "l0", [9, 8])]  # the second send of p0 (larger tokens)
    c = [_exp("p0", "l0", [3, 7]), _exp("p0", "l0", [3, 6])]
    out = hooks.dispatch_order(a + b + c, sent, 2)
    assert [e.sequences[0].tolist() for e in out] == [[3, 7], [3, 6], [9, 9], [9, 8], [5, 1], [5, 2]]
    assert [e.sequences[0].tolist() for e in hooks.dispatch_order(c + a + b, sent, 2)] == \
        [e.sequences[0].tolist() for e in out]  # whatever order they finished in
    assert hooks.dispatch_order(a + b[:1], sent, 2) == a + b[:1]


# ---------------------------------------------------------------------------------- the import hook

class Delegating(importlib.abc.MetaPathFinder):
    """Another import hook that, like ours, asks every other finder (without a guard of its own)."""

    def __init__(self):
        self.calls = 0

    def find_spec(self, name, path, target=None):
        if not name.startswith("composer_fix_probe"):
            return None
        self.calls += 1
        return next((s for f in list(sys.meta_path) if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)


@pytest.fixture
def probe(tmp_path, monkeypatch):
    name = f"composer_fix_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = list(sys.meta_path)
    yield name
    sys.meta_path[:] = saved
    sys.modules.pop(name, None)


def test_import_hook_is_reentrant_beside_a_delegating_hook(probe):
    seen = []
    hooks.when_imported(probe, lambda m: seen.append(m.VALUE))
    other = Delegating()
    sys.meta_path.insert(0, other)
    mod = importlib.import_module(probe)
    assert mod.VALUE == 1 and seen == [1] and other.calls >= 1


def test_a_bare_find_spec_does_not_use_up_the_hook(probe):
    """transformers' availability checks call importlib.util.find_spec on modules before importing them."""
    seen = []
    hooks.when_imported(probe, lambda m: seen.append(m.VALUE))
    assert importlib.util.find_spec(probe) is not None
    importlib.import_module(probe)
    assert seen == [1]


# ---------------------------------------------------------------------------------- launch.sh --check

def _node(gpus, alive=True):
    return {"Alive": alive, "Resources": {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})}}


def test_cluster_check_names_the_missing_nodes_and_gpus():
    have, missing = cluster_fit({"nodes": 2, "gpus_per_node": 8}, [_node(8), _node(4), _node(8, alive=False)])
    assert have == {"nodes": 2, "gpus_per_node": [8, 4], "gpus": 12}
    assert len(missing) == 1 and "2 node(s) x 8 GPU(s)" in missing[0] and "missing 1 node(s) with 8 GPU(s)" in missing[0]
    assert "--gpus-per-node" in missing[0]
    assert cluster_fit({"nodes": 1, "gpus_per_node": 1}, [_node(0)])[1]  # a CPU-only head
    assert cluster_fit({"nodes": 2, "gpus_per_node": 8}, [_node(8), _node(8)])[1] == []


# ------------------------------------------------------------------------------- toy bundles travel

@pytest.mark.skipif(not HAVE_OPENRLHF, reason="pip install --no-deps openrlhf==0.11.2")
def test_toy_bundle_carries_its_checkpoints_and_lists_every_node_path(tmp_path):
    from components.tasks.bootstrap import cache_folder
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout
    from composer.checks.validate import validate_file

    v = validate_file(ROOT / "specs/opd.yaml", ["train.steps=2"])
    out = tmp_path / "b"
    compile_bundle(v, out, Layout(nodes=1, gpus_per_node=1, cluster_dir="/cluster/runs"))
    cache = str(Path(cache_folder()).resolve())
    for f in out.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".md", ".txt", ".sh", ".py", ".jsonl"):
            assert cache not in f.read_text(errors="replace"), f
    plan = json.loads((out / "plan.json").read_text())
    argv = plan["openrlhf"]["runs"][0]["argv"]
    policy = argv[argv.index("--actor.model_name_or_path") + 1]
    assert policy == "models/student" and (out / policy / "config.json").is_file()
    teacher = plan["openrlhf"]["source_paths"]["teacher"]
    assert teacher == "models/teacher" and (out / teacher / "config.json").is_file()
    readme = (out / "README.md").read_text()
    for path in ("models/student", "models/teacher", "data/train.jsonl", "/cluster/runs"):
        assert f"`{path}`" in readme, path
    for i, a in enumerate(argv[:-1]):  # every path-valued argument is listed
        if a in ("--ckpt.path", "--ckpt.output_dir", "--logger.tensorboard_dir", "--data.prompt_dataset"):
            assert f"`{argv[i + 1]}`" in readme, a
