"""Issue 42 on the OpenRLHF backend, without a cluster: a run trains exactly its declared steps (dynamic
filtering's prompt pool covers the refills; a short step or a short run fails naming why), the prompt loader is
built under a seeded RNG (the real torchdata 0.11 draws its sampler's seed at build), the logged loss is the
back-propagated one, checkpoints only where a resume keeps the sync schedule, the resource preflight by
default, names that would read as options refused at validate. The real jobs: tests/test_openrlhf_real.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from composer.backends.openrlhf import hooks

ROOT = Path(__file__).resolve().parent.parent


def _plan(overrides: list[str], spec: str = "specs/grpo.yaml") -> dict:
    from composer.checks.validate import validate_file
    from composer.plan.compile import compile_plan

    return json.loads(json.dumps(compile_plan(validate_file(ROOT / spec, overrides))))


def _use(monkeypatch, plan: dict, plugin: dict | None = None) -> None:
    from composer.plan.plan import Plan

    monkeypatch.setattr(hooks, "_plan", lambda: Plan(plan, list(range(len(plan["segments"])))))
    monkeypatch.setattr(hooks, "_STATE", {"run": {"name": "main", "plugin": plugin or {}}, "plan": plan})


# ------------------------------------------------------------------------------- checkpoints and syncs

@pytest.mark.parametrize("every", [1, 2, 3])
def test_checkpoints_fall_only_where_a_resume_keeps_the_schedule(monkeypatch, every):
    """checkpoint_every 1 under sync.every N: a checkpoint after step s is written when s is a sync step or
    comes before the first sync (the engine still holds the initial weights), never between two later syncs;
    every written one is one resume_sync accepts."""
    steps = 8
    lag = ["sync.off_policy_ok=true"] if every > 1 else []  # with a sync every step it is inert, and refused
    _use(monkeypatch, _plan([f"sync.every={every}", *lag, f"train.steps={steps}", "train.checkpoint_every=1"]))
    saved = []

    class Base:
        def __init__(self):
            self.args = SimpleNamespace(ckpt=SimpleNamespace(save_steps=1))

        def train_step(self, rollout, step):
            return {}, step + 1

        def broadcast_to_vllm(self):
            pass

        def init_checkpoint_states(self):
            return {}

        def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
            if global_step % self.args.ckpt.save_steps == 0:  # as OpenRLHF's
                saved.append(global_step)

    mod = SimpleNamespace(BasePPOTrainer=Base, prepare_datasets=lambda s, t: (None, None, 1))
    monkeypatch.setattr(hooks, "when_imported", lambda name, hook: None)
    hooks._patch_trainer(mod)
    trainer = Base()
    for s in range(1, steps + 1):
        trainer.save_logs_and_checkpoints(s, {})
    assert trainer.args.ckpt.save_steps == 1
    want = [s for s in range(1, steps + 1) if s % every == 0 or s < every]
    assert saved == want
    for s in saved:
        hooks.resume_sync(s)  # none refused


# ------------------------------------------------------------------------------- declared steps

class _Generator:
    """OpenRLHF's SamplesGenerator as the patch sees it: generate_samples returns `batches` in turn."""

    def __init__(self, batches, args):
        self.batches, self.args, self.calls = list(batches), args, 0

    def _dispatch_prompts_to_vllm(self, prompts, labels, **kw):
        return []

    def _generate_vllm(self, it, n, dyn, **kw):
        return [], 0, True

    def generate_samples(self, **kw):
        self.calls += 1
        rows = self.batches.pop(0) if self.batches else []
        return rows, None, len(rows), not self.batches


def _args(dynamic: bool, pool: int = 20):
    return SimpleNamespace(rollout=SimpleNamespace(batch_size=2, n_samples_per_prompt=4),
                           algo=SimpleNamespace(dynamic_filtering_enable=dynamic), data=SimpleNamespace(max_samples=pool))


def test_a_run_stops_at_its_declared_steps(monkeypatch):
    """A pool larger than the steps use (dynamic filtering's refills): after the declared steps the episode
    ends (no rollout, exhausted) without asking OpenRLHF for more."""
    _use(monkeypatch, _plan(["train.steps=2"]))
    hooks._patch_dispatch(SimpleNamespace(SamplesGenerator=_Generator))
    gen = _Generator([[0] * 8] * 5, _args(True))
    for step in range(2):
        gen.composer_step = step
        assert len(gen.generate_samples()[0]) == 8
    gen.composer_step = 2
    assert gen.generate_samples() == ([], None, 0, True) and gen.calls == 2


def test_a_step_the_filter_cannot_fill_fails_naming_it(monkeypatch):
    _use(monkeypatch, _plan(["train.steps=3"]))
    hooks._patch_dispatch(SimpleNamespace(SamplesGenerator=_Generator))
    gen = _Generator([[0] * 8, [0] * 4], _args(True, pool=12))
    gen.composer_step = 0
    gen.generate_samples()
    gen.composer_step = 1
    with pytest.raises(RuntimeError, match=r"step 2 of 3: only 4 of the 8 rollouts .*rollout.filter \(equal_groups: "
                                           r"drop.*pool of 12 rows ran out"):
        gen.generate_samples()


def _actor_module(base, fit_steps: int):
    """A module holding a Ray-style actor class (as `@ray.remote` leaves it): its shipped class and user class."""

    class Trainer(base):
        def fit(self):
            self.samples_generator.composer_step = fit_steps  # as train_step_ leaves it
            return "fitted"

    shipped = type("Shipped", (Trainer,), {"__ray_actor_class__": Trainer})
    actor = SimpleNamespace(__ray_metadata__=SimpleNamespace(modified_class=shipped))
    return SimpleNamespace(PPOTrainer=actor), shipped


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_run_that_trained_fewer_steps_fails(monkeypatch, dynamic):
    _use(monkeypatch, _plan(["train.steps=2"]))

    class Base:
        pass

    mod, shipped = _actor_module(Base, 1)
    assert hooks.wrap_fit(mod, Base) == ["Trainer.fit"]
    t = shipped()
    t.args, t.samples_generator = _args(dynamic), SimpleNamespace()
    reason = "rollout.filter" if dynamic else "the prompt pool ran out"
    with pytest.raises(RuntimeError, match=rf"run 'main' trained 1 of its 2 declared steps: .*{reason}"):
        t.fit()
    mod, shipped = _actor_module(Base, 2)
    hooks.wrap_fit(mod, Base)
    t = shipped()
    t.args, t.samples_generator = _args(dynamic), SimpleNamespace()
    assert t.fit() == "fitted"


def test_dynamic_filtering_pool_covers_the_refills(tmp_path):
    """DAPO's bundle: a prompt pool of (1 + the filter's default round cap) x steps x prompts rows, and the
    LR schedule's length divided back by that factor (plugin pool_factor); plain GRPO: exactly steps x prompts."""
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout
    from composer.checks.validate import validate_file
    from composer.filters import RolloutFilter

    factor = 1 + RolloutFilter().max_rounds
    for spec, over, want in (("specs/methods/dapo.yaml", ["rollout.filter.max_rounds=null", "train.mini_batches=1"],
                              3 * 2 * factor), ("specs/grpo.yaml", [], 3 * 2)):
        v = validate_file(ROOT / spec, ["train.steps=3", "train.prompts_per_step=2", "rollout.samples_per_prompt=4",
                                        *over])
        out = tmp_path / Path(spec).stem
        compile_bundle(v, out, Layout(nodes=1, gpus_per_node=1, cluster_dir=str(tmp_path / "c")))
        run = json.loads((out / "plan.json").read_text())["openrlhf"]["runs"][0]
        argv = run["argv"]
        assert int(argv[argv.index("--data.max_samples") + 1]) == want
        assert len((out / "data" / "train.jsonl").read_text().splitlines()) == want
        assert run["plugin"]["pool_factor"] == want // 6


@pytest.mark.skipif(importlib.util.find_spec("torchdata") is None, reason="needs torchdata (openrlhf-cpu extra)")
def test_prompt_loader_built_under_the_run_seed(monkeypatch):
    """The real torchdata StatefulDataLoader (shuffle) built in prepare_datasets: two builds (two jobs) give
    the same order whatever the global RNG held before; a resumed loader (its state_dict) continues it; the
    schedule's max_steps is divided by the pool factor."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    _use(monkeypatch, _plan(["train.steps=2"]), {"pool_factor": 5})

    def prepare(strategy, tokenizer):
        return StatefulDataLoader(list(range(50)), batch_size=2, shuffle=True), None, 100

    mod = SimpleNamespace(prepare_datasets=prepare)
    hooks._seeded_prepare_datasets(mod)
    orders, states = [], []
    for junk in (1, 2):
        torch.manual_seed(junk)
        loader, _e, max_steps = mod.prepare_datasets(None, None)
        assert max_steps == 20
        it = iter(loader)
        first = [next(it).tolist() for _ in range(3)]
        states.append(loader.state_dict())
        orders.append(first + [b.tolist() for b in it])
    assert orders[0] == orders[1]
    torch.manual_seed(3)
    loader, _e, _m = mod.prepare_datasets(None, None)
    loader.load_state_dict(states[0])
    assert [b.tolist() for b in loader] == orders[0][3:]
    torch.manual_seed(1)
    plain = [b.tolist() for b in prepare(None, None)[0]]
    assert plain != orders[0]  # the seed made the difference (the unpatched build follows the global RNG)


def test_logged_loss_is_the_back_propagated_one():
    """Two optimizer steps of two micro-batches each (gas 2): the mean over optimizer steps of what DeepSpeed
    back-propagated per step, sum of its micro-batch losses / gas."""
    strategy = SimpleNamespace(accumulated_gradient=2, all_reduce=lambda x: x)
    losses = [0.1, 0.3, 0.2, 0.6]
    steps = [(0.1 + 0.3) / 2, (0.2 + 0.6) / 2]
    assert hooks.trained_loss(strategy, losses) == pytest.approx(sum(steps) / len(steps))


# ------------------------------------------------------------------------------- launch

def test_preflight_fails_naming_the_missing_gpus(monkeypatch, capsys):
    pytest.importorskip("ray")
    import ray

    from composer.backends.openrlhf.__main__ import preflight

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 8}}])
    with pytest.raises(SystemExit) as e:
        preflight({"openrlhf": {"layout": {"nodes": 1, "gpus_per_node": 8}}})
    assert e.value.code == 1
    out = capsys.readouterr()
    assert json.loads(out.out.split("composer-preflight: ")[1])["problems"]
    assert "missing 1 node(s) with 8 GPU(s)" in out.err and "--no-preflight" in out.err
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 8}}])
    preflight({"openrlhf": {"layout": {"nodes": 1, "gpus_per_node": 8}}})


@pytest.mark.parametrize("flags,tail", [([], []), (["--no-preflight"], ["--no-preflight"]),
                                        (["--check"], ["--check"]),
                                        (["--no-preflight", "--check"], ["--check", "--no-preflight"])])
def test_launch_sh_preflight_by_default(tmp_path, flags, tail):
    """launch.sh's entry words: the preflight runs unless --no-preflight (a fake `ray` records the words)."""
    from composer.backends.openrlhf.bundle import launch_script

    (tmp_path / "launch.sh").write_text(launch_script("x", [["python", "-m", "m", "--run", "main"]],
                                                      SimpleNamespace(wandb_project=None)))
    (tmp_path / "runtime_env.json").write_text("{}")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    os.chmod(fake / "ray", 0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(tmp_path / "launch.sh"), *flags, "http://h:1"], env=env, capture_output=True,
                       text=True, check=True)
    words = r.stdout.split("\n")[:-1]
    assert words[words.index("--") + 1:] == ["python", "-m", "m", "--run", "main", *tail]
    assert words[words.index("--address") + 1] == "http://h:1"


def test_names_that_read_as_options_are_refused(tmp_path):
    from composer.checks.validate import validate_file
    from composer.errors import SpecError

    text = (ROOT / "specs" / "int.yaml").read_text()
    import re

    first = re.search(r"- name: ([a-z0-9_-]+)", text).group(1)
    bad = tmp_path / "s.yaml"
    bad.write_text(text.replace(f"- name: {first}", f"- name: -{first}", 1))
    with pytest.raises(SpecError) as e:
        validate_file(bad, [])
    found = [d for d in e.value.diagnostics if d.rule == "names_are_words"]
    assert [d.path for d in found] == [("stages", 0, "name")], e.value.diagnostics
    validate_file(ROOT / "specs" / "int.yaml", [])
