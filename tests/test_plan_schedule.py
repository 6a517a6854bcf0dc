"""The Plan's schedule is what runs: each backend's observed syncs, segment switches and model-call weights
against plan["schedule"] (composer/plan/schedule.py), on multi-phase and multi-stage specs.

The cases are the divergences issue 22 measured before the schedule was computed once:
  - sync steps: Lightning counted sync.every from each phase's start, OpenRLHF from the run's start
    (GRPO `phases: [{until: 3}, {until: 9, sync: {every: 2}}]`: 1,2,3,5,7,9 vs 1,2,3,4,6,8);
  - the OpenRLHF agent served "initial-policy" calls (POPE's search) from updated weights after a phase
    switch: now `Schedule.sampler_is_initial`, and a bundle that cannot honour it is refused;
  - the native-GRPO route grouped a guide's tagged rows by prompt only: a guide now takes the composer loss;
  - the Trainer's max_steps and plan["total_steps"]; the LR of every step (torch's LambdaLR, the Plan's numbers).
Lightning is observed through RunContext.record (syncs, segments, rollouts, losses) and parameter snapshots;
OpenRLHF through its own fit loop on CPU (tests/openrlhf_fit, as tests/test_openrlhf_fit.py runs it).
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from composer.plan.compile import compile_plan
from composer.plan.schedule import Schedule
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "train.eval_every=0", "train.eval_samples=2", "train.checkpoint_every=1000"]
PHASED = ["train.steps=9", "phases=[{until: 3}, {until: 9, sync: {every: 2, off_policy_ok: true}}]"]


def plan_of(spec: str, overrides=()) -> dict:
    return json.loads(json.dumps(compile_plan(validate_file(ROOT / spec, list(overrides)))))  # as plan.json


# ------------------------------------------------------------------------------- the schedule's data

def test_one_sync_rule_counted_from_each_segment_start():
    s = Schedule(plan_of("specs/grpo.yaml", PHASED))
    assert s.syncs() == [1, 2, 3, 5, 7, 9]  # the issue's case: counted from the phase's start (step 3)
    assert [s.sync_after(d) for d in range(10)] == [d in (1, 2, 3, 5, 7, 9) for d in range(10)]
    assert [s.sampler_version(t) for t in range(9)] == [0, 1, 2, 3, 3, 5, 5, 7, 7]
    assert [s.at(t).name for t in (0, 2, 3, 8)] == ["phase0", "phase0", "phase1", "phase1"]


def test_stages_sync_at_their_end_and_move_the_initial_weights():
    plan = plan_of("specs/int.yaml", ["stages.0.train.steps=3", "stages.1.train.steps=4", "stages.1.sync.every=3",
                                      "stages.1.sync.off_policy_ok=true"])
    s = Schedule(plan)
    assert s.syncs() == [1, 2, 3, 6]  # stage 1 ends at 3; stage 2 starts there: 3 + 3 = 6 (the run ends at 7)
    assert [s.initial_version(t) for t in range(7)] == [0, 0, 0, 3, 3, 3, 3]  # train.reference: stage_start
    assert [s.sampler_is_initial(t) for t in range(7)] == [True, False, False, True, True, True, False]
    plan = plan_of("specs/int.yaml", ["stages.0.train.steps=3", "stages.1.train.steps=4",
                                      "stages.1.train.reference=run_start"])
    assert [Schedule(plan).initial_version(t) for t in range(7)] == [0] * 7


@pytest.mark.parametrize("overrides", [PHASED, ["train.steps=7", "sync.every=3", "sync.off_policy_ok=true"],
                                       ["train.steps=8",
                                        "phases=[{until: 5, sync: {every: 4, off_policy_ok: true}}, {until: 8}]"]])
def test_sampler_version_is_the_last_sync(overrides):
    s = Schedule(plan_of("specs/grpo.yaml", overrides))
    for t in range(s.total_steps + 2):
        assert s.sampler_version(t) == max([0] + [d for d in s.syncs() if d <= t]), t
        assert s.sync_after(t) == (t in s.syncs()), t


def test_the_schedule_records_calls_groups_and_normalisers():
    r = Schedule(plan_of("specs/pope.yaml")).ranges[0]
    assert ("guide:prefix-search", "initial") in {(c.call, c.weights) for c in r.calls}
    assert ("rollout", "sampler") in {(c.call, c.weights) for c in r.calls}
    assert [(t.groups, t.normaliser) for t in r.terms] == [("prompt x guide tag", "token-mean")]
    r = Schedule(plan_of("specs/grpo.yaml")).ranges[0]
    assert [t.groups for t in r.terms] == ["prompt"]


def test_lr_is_the_plans_per_step_number():
    s = Schedule(plan_of("specs/grpo.yaml", ["train.steps=6", "train.lr=0.001", "train.warmup_steps=2",
                                             "train.lr_schedule=cosine"]))
    # warm-up (t+1)/2 for t < 2, then 0.5 (1 + cos(pi (t-2)/4)) over the remaining 4 steps
    want = [0.0005, 0.001] + [0.001 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert [round(s.lr(t), 12) for t in range(6)] == [round(x, 12) for x in want]


def test_explain_renders_the_schedule():
    from composer.plan.explain import text

    out = text(plan_of("specs/grpo.yaml", PHASED))
    assert "sync after 1, 2, 3 step(s) done" in out and "sync after 5, 7, 9 step(s) done" in out


# ------------------------------------------------------------------------------------------ Lightning

def fingerprint(model) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Observer:
    """What the Lightning run did: syncs, segment switches, the weights behind every rollout and every
    initial-policy log-prob, and the policy's weights before each step."""

    def __init__(self):
        self.syncs, self.segments, self.rollout_at, self.initial_err = [], [], {}, {}
        self.policy = {}  # step -> state dict before that step's update
        self.model = None

    def __call__(self, kind, step=None, **data):
        if kind == "sync":
            self.syncs.append(data["after"])
        elif kind == "segment":
            self.segments.append((data["name"], step))
        elif kind == "rollout":
            pol = data["policy"]
            self.policy.setdefault(step, {k: v.detach().clone() for k, v in pol.state_dict().items()})
            self.rollout_at.setdefault(step, fingerprint(data["engine"].model))
            if self.model is None:
                self.model = copy.deepcopy(pol).eval()
        elif kind == "term_loss" and data["batch"].initial_logprobs is not None:
            self.initial_err.setdefault(step, data["batch"])

    def weights_at(self, version: int) -> str:
        self.model.load_state_dict(self.policy[version])
        return fingerprint(self.model)

    def logprobs_under(self, version: int, batch) -> torch.Tensor:
        self.model.load_state_dict(self.policy[version])
        with torch.no_grad():
            logits = self.model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits.float()
        lp = torch.log_softmax(logits / batch.info.get("temperature", 1.0), -1)
        out = torch.zeros(batch.tokens.shape)
        out[:, 1:] = lp[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """An untrained tiny policy with the toy tokenizer: the run needs no bootstrapped checkpoint, and the
    entropy bonus moves its weights at every step (so every weights check can tell versions apart)."""
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny") / "policy"))


def run_lightning(spec: str, overrides, tmp: Path, model: str):
    from composer.backends.lightning.run import train

    v = validate_file(ROOT / spec, FAST + [f"policy.model={model}", "train.entropy_coef=0.1"] + list(overrides))
    obs = Observer()
    train(v, tmp / "run", progress=False, recorder=obs)
    with open(tmp / "run" / "metrics.csv", newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}
    return json.loads((tmp / "run" / "plan.json").read_text()), obs, rows


def check_lightning(plan: dict, obs: Observer, rows: dict) -> None:
    s = Schedule(plan)
    n = plan["total_steps"]
    assert sorted(rows) == list(range(n))  # the Trainer ran plan["total_steps"] steps
    assert obs.syncs == [d for d in s.syncs() if d <= n]
    assert obs.segments == [(r.name, r.start) for r in s.ranges]
    for step, fp in obs.rollout_at.items():  # the sampler holds the weights the Plan names
        assert fp == obs.weights_at(s.sampler_version(step)), step
    for step, batch in obs.initial_err.items():  # "initial" log-probs come from the Plan's initial weights
        ref = obs.logprobs_under(s.initial_version(step), batch)
        m = batch.response_mask & batch.attention_mask
        assert float((ref - batch.initial_logprobs.cpu()).abs()[m].max()) < 2e-3, step
    for step, row in rows.items():
        assert abs(float(row["lr"]) - s.lr(step)) <= 1e-9 + 1e-6 * s.lr(step), (step, row["lr"], s.lr(step))


def test_lightning_executes_the_schedule_of_a_phased_spec(tmp_path, tiny):
    """The issue's GRPO case, shortened: phase 1 syncs every 2 steps counted from its start (step 3); the KL
    reference is the run's initial weights; warm-up and cosine LR per segment."""
    plan, obs, rows = run_lightning("specs/grpo.yaml", [
        "train.steps=6", "phases=[{until: 3}, {until: 6, sync: {every: 2, off_policy_ok: true}}]",
        "train.warmup_steps=2", "train.lr_schedule=cosine", "train.lr=0.001"], tmp_path, tiny)
    assert Schedule(plan).syncs() == [1, 2, 3, 5]
    check_lightning(plan, obs, rows)
    assert obs.initial_err  # the KL term read the initial policy: the check above ran
    # each phase runs its own program: warm-up (t+1)/2 over 2 steps, then cosine over the 1 step left
    assert [float(rows[t]["lr"]) for t in range(6)] == [0.0005, 0.001, 0.001, 0.0005, 0.001, 0.001]


@pytest.mark.slow
def test_lightning_executes_the_schedule_of_a_staged_spec(tmp_path, tiny):
    """Stages: a sync after each stage's end, and the frozen initial weights move to stage 2's start."""
    plan, obs, rows = run_lightning("specs/int.yaml", [
        "stages.0.train.steps=2", "stages.1.train.steps=3", "stages.1.sync.every=2", "stages.1.sync.off_policy_ok=true",
        "stages.0.signal.filter_samples=2"], tmp_path, tiny)
    s = Schedule(plan)
    assert s.syncs() == [1, 2, 4] and s.initial_version(3) == 2
    check_lightning(plan, obs, rows)
    assert any(step >= 2 for step in obs.initial_err)


def test_the_lightning_checks_can_fail(tmp_path, tiny):
    """A schedule that differs from the run (the OpenRLHF rule of old: counted from the run's start)."""
    plan, obs, rows = run_lightning("specs/grpo.yaml", [
        "train.steps=5", "phases=[{until: 1}, {until: 5, sync: {every: 2, off_policy_ok: true}}]"], tmp_path, tiny)
    check_lightning(plan, obs, rows)
    bad = copy.deepcopy(plan)
    bad["schedule"]["ranges"][1]["start"] = 0  # counts phase 1's syncs from step 0: 2, 4 instead of 3, 5
    with pytest.raises(AssertionError):
        check_lightning(bad, obs, rows)


# ------------------------------------------------------------------------------------------- OpenRLHF

def _bundle(spec: str, overrides, tmp: Path, model: str):
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout

    v = validate_file(ROOT / spec, [f"policy.model={model}", *overrides])
    compile_bundle(v, tmp / "bundle", Layout(nodes=1, gpus_per_node=1, cluster_dir=str(tmp / "cluster")))
    return json.loads((tmp / "bundle" / "plan.json").read_text())


def test_openrlhf_refuses_initial_calls_after_the_first_broadcast(tmp_path, tiny):
    """GRPO first, POPE's search (the initial policy) from step 3: the rollout engine no longer holds the
    initial weights then; the bundle is refused with the reason (it used to serve updated weights)."""
    from composer.backends.openrlhf.flags import Unsupported

    with pytest.raises(Unsupported, match="initial weights"):
        _bundle("specs/pope.yaml", ["train.steps=6", "phases=[{until: 3, rollout: {guide: {kind: none}}}, {until: 6}]"],
                tmp_path, tiny)


def test_openrlhf_agent_reads_initial_weights_from_the_schedule():
    from composer.backends.openrlhf.agent import ComposerAgent

    plan = plan_of("specs/pope.yaml", ["train.steps=4"])
    plan["openrlhf"] = {"runs": [{"name": "main", "segments": [0], "plugin": {"agent": True}}]}
    agent = ComposerAgent(plan)
    assert [agent.steps.at(t).sampler_is_initial for t in range(4)] == [True, False, False, False]
    with pytest.raises(RuntimeError, match="initial policy"):
        agent._engine(object(), "initial", agent.steps.at(1).sampler_is_initial)


def test_a_guide_takes_the_composer_loss_not_native_grpo(tmp_path, tiny):
    """OpenRLHF's group_norm groups by prompt only: under a guide (rows tagged guided / control, the Plan's
    `prompt x guide tag` groups) the bundle uses the composer's loss; plain GRPO stays native."""
    plan = _bundle("specs/pope.yaml", ["train.steps=2"], tmp_path / "pope", tiny)
    assert plan["schedule"]["ranges"][0]["terms"][0]["groups"] == "prompt x guide tag"
    assert plan["openrlhf"]["runs"][0]["plugin"].get("loss")
    plan = _bundle("specs/grpo.yaml", ["train.steps=2"], tmp_path / "grpo", tiny)
    assert plan["schedule"]["ranges"][0]["terms"][0]["groups"] == "prompt"
    assert not plan["openrlhf"]["runs"][0]["plugin"].get("loss")


@pytest.mark.slow
def test_openrlhf_fit_loop_syncs_on_the_plans_schedule(tmp_path, tiny):
    """OpenRLHF's own fit loop (CPU stand-ins): a phase with sync.every 2 from step 1 broadcasts after steps
    1 and 3 (the run-start count of old broadcast after 1, 2 and 4), and each rollout is sampled by the
    weights the Plan's schedule names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("openrlhf_fit_harness", ROOT / "tests" / "test_openrlhf_fit.py")
    fitmod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fitmod)  # the harness of tests/test_openrlhf_fit.py (its SPECS, its fit)
    if not fitmod.HAVE:
        pytest.skip("needs openrlhf, ray and deepspeed (the openrlhf-cpu extra)")
    fitmod.SPECS["oapl_phased"] = ("specs/oapl.yaml", [
        "train.steps=4", "train.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.temperature=1.5",
        f"policy.model={tiny}", "phases=[{until: 1, sync: {every: 1}}, {until: 4, sync: {every: 2}}]"], None, [])
    out = fitmod.fit("oapl_phased", tmp_path)
    plan = json.loads((Path(out["bundle"]) / "plan.json").read_text())
    s = Schedule(plan)
    done = [d - 1 for d in s.syncs() if d <= 4]  # the fit index after which each broadcast comes
    assert done == [0, 2]
    assert [t["synced"] for t in out["trainer_steps"]] == [float(t in done) for t in range(4)]
    assert [b["after_fit"] for b in out["broadcasts"]] == done
    fits = out["fits"]
    for r in (r for r in out["rollouts"] if not r["eval"]):
        v = s.sampler_version(r["step"])
        want = fits[0]["actor_weights_before"] if v == 0 else fits[v - 1]["actor_weights_after"]
        assert r["engine_weights"] == want, (r["step"], v)


def _hooked_trainer(monkeypatch, plan: dict, run: dict):
    """OpenRLHF's BasePPOTrainer as hooks.py patches it (a stand-in class whose train_step broadcasts after
    every step, as OpenRLHF's does), with the plan installed as the workers install it."""
    import types

    from composer.backends.openrlhf import hooks

    monkeypatch.setattr(hooks, "_STATE", {"plan": plan, "run": run})
    hooks._plan.cache_clear()
    broadcasts = []

    class BasePPOTrainer:
        def __init__(self):
            self.samples_generator = types.SimpleNamespace()

        def train_step(self, rollout_samples, global_step):
            self.broadcast_to_vllm()
            return {}, global_step + 1

        def broadcast_to_vllm(self):
            broadcasts.append(self.done)

        def init_checkpoint_states(self):
            return {}

        def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
            pass

    mod = types.ModuleType("fake_ppo_trainer")  # what hooks._patch_trainer reads of openrlhf's ppo_trainer
    mod.BasePPOTrainer = BasePPOTrainer
    mod.prepare_datasets = lambda strategy, tokenizer: None
    hooks._patch_trainer(mod)
    return BasePPOTrainer(), broadcasts, hooks


@pytest.mark.parametrize("case", ["phases", "stage2"])
def test_openrlhf_trainer_patch_syncs_on_the_plans_schedule(monkeypatch, case):
    """The issue's GRPO case through hooks.py's train_step patch: broadcasts after 1, 2, 3, 5, 7, 9 (it used
    to count from the run's start: 1, 2, 3, 4, 6, 8); a later stage's run counts from its own start."""
    if case == "phases":
        plan = plan_of("specs/grpo.yaml", PHASED)
        run = {"name": "main", "segments": [0, 1], "plugin": {}}
    else:
        plan = plan_of("specs/int.yaml", ["stages.0.train.steps=3", "stages.1.train.steps=5",
                                          "stages.1.sync.every=2", "stages.1.sync.off_policy_ok=true"])
        run = {"name": "rl", "segments": [1], "plugin": {}}
    s = Schedule(plan)
    first = plan["segments"][run["segments"][0]]["start"]
    n = plan["segments"][run["segments"][-1]]["end"] - first
    trainer, broadcasts, hooks = _hooked_trainer(monkeypatch, plan, run)
    try:
        synced = []
        for k in range(n):  # OpenRLHF's global_step counts from the run's start
            trainer.done = first + k + 1
            status, out = trainer.train_step(None, k)
            assert out == k + 1 and trainer.samples_generator.composer_step == k + 1
            synced.append(status["composer/synced"])
    finally:
        hooks._plan.cache_clear()
    want = [d for d in s.syncs() if first < d <= first + n]
    assert broadcasts == want and synced == [float(first + k + 1 in want) for k in range(n)]
    assert want == ([1, 2, 3, 5, 7, 9] if case == "phases" else [5, 7])


def test_plan_at_holds_every_number_of_the_step():
    """`Plan.at(step)` is what both backends read: the segment in force and every scheduled number resolved at the
    step (a term's weight, an objective's kl_coef, the entropy bonus), from plan.json alone."""
    from composer.plan.plan import Plan

    lin = "{kind: linear, start: 0.1, end: 0.0, steps: 4}"
    plan = Plan(plan_of("specs/methods/kdrl.yaml", ["train.steps=8", f"terms.0.objective.kl_coef={lin}",
                                                    f"train.entropy_coef={lin}"]))
    for step, want in [(0, 0.1), (2, 0.05), (6, 0.0)]:
        at = plan.at(step)
        rl, kd = at.terms
        assert at.segment.name == "main" and at.spec is at.segment.spec
        assert rl.objective.kl_coef == pytest.approx(want) and at.entropy_coef == pytest.approx(want)
        assert rl.declared.kl_coef.kind == "linear" and at.entropy_scheduled  # the spec's program, whole
        assert kd.weight == pytest.approx(5e-3 + (1e-3 - 5e-3) * min(step, 60) / 60) and kd.scheduled
        assert not rl.scheduled and rl.weight == 1.0
    phased = Plan(plan_of("specs/grpo.yaml", PHASED))
    assert [phased.at(s.start).segment.name for s in phased.segments] == ["phase0", "phase1"]
    assert [phased.at(s).spec.sync.every for s in range(9)] == [1] * 3 + [2] * 6
    assert phased.segments[1].origin == ("phases", 1)  # the validated Segment, rebuilt from plan.json
