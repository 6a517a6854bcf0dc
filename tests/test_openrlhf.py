"""The OpenRLHF backend without a GPU: bundles checked against OpenRLHF's real parser, and the plugin's
adapters (Experience <-> TrajectoryBatch, the loss replacement, the agent executor, the hooks) on CPU.

The loss tests reuse the hand-computed numbers of tests/test_objectives.py (the Lightning backend's
objective tests): the same batch gives the same loss through OpenRLHF's Experience layout, split into
micro-batches as OpenRLHF trains them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from composer.backends.openrlhf import batch as ob
from composer.backends.openrlhf import hooks
from components.sources.policy_model import score_responses as context_scores
from composer.backends.openrlhf.loss import ComposerLoss, prepare_step, step_batch, step_inputs, take_step_inputs
from composer.plan.plan import Plan
from composer.origins import CODE
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
needs_openrlhf = pytest.mark.skipif(not HAVE_OPENRLHF, reason="openrlhf is not installed "
                                    "(pip install --no-deps openrlhf==0.11.2): no real parser to check against")
# hybrids that the Lightning backend runs and OpenRLHF cannot express: refused with the reason (tested below)
LIGHTNING_ONLY = {"specs/hybrids/fkl-plus-sft.yaml": ("terms[1].signal", "cannot be mixed with rollout terms"),
                  # the composer's loss in the plugin (sequence ratio, CISPO bound) with mini-batches
                  "specs/methods/gspo.yaml": ("train.mini_batches", "mini-batches run only with OpenRLHF's own PolicyLoss"),
                  "specs/methods/cispo.yaml": ("train.mini_batches", "mini-batches run only with OpenRLHF's own PolicyLoss"),
                  "specs/methods/sapo.yaml": ("train.mini_batches", "mini-batches run only with OpenRLHF's own PolicyLoss"),
                  # sequences the policy did not write (GKD), an SFT term gated by the same step's rollouts (HPT)
                  "specs/methods/gkd.yaml": ("signal.off_policy", "are not samples of the step"),
                  "specs/methods/hpt.yaml": ("terms[1].signal", "cannot be mixed with rollout terms"),
                  # a periodic reference and optimizer reset inside a run (ProRL): one stage per reset there
                  "specs/methods/prorl.yaml": ("train.reset_every", "cannot be expressed"),
                  # a step-wide per-token selection (KL-Cov, Clip-Cov): the plugin has no per-token carrier to the loss
                  "specs/methods/kl-cov.yaml": ("objective.token_selection", "a per-token mask has no carrier there"),
                  "specs/methods/clip-cov.yaml": ("objective.token_selection", "a per-token mask has no carrier there"),
                  # the same for a selection by the old policy's entropy (the 80/20 update, Archer's classes)
                  "specs/methods/entropy-8020.yaml": ("objective.token_selection",
                                                      "a per-token mask has no carrier there"),
                  "specs/methods/archer.yaml": ("objective.token_selection", "a per-token mask has no carrier there"),
                  # PPO with a second (gated) term: OpenRLHF's critic runs with its own PolicyLoss alone (VAPO)
                  "specs/methods/vapo.yaml": ("terms[0].objective", "one objective: other terms"),
                  # a term over pairs of rows (online DPO): OpenRLHF's micro-batches are shuffled rows
                  "specs/methods/grpo-dpo.yaml": ("terms[1].objective", "has no pairwise loss")}
# the teacher whose generations give PrefixRL its prefixes takes a GPU of its own: 4 + 1 per node
GPUS_PER_NODE = {"specs/methods/prefixrl.yaml": 5}
SPECS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("specs/*.yaml"), *ROOT.glob("specs/hybrids/*.yaml"),
                                                   *ROOT.glob("specs/methods/*.yaml")]
               if str(p.relative_to(ROOT)) not in LIGHTNING_ONLY)
# what a spec needs to compile for OpenRLHF, said by the refusal: DAPO's capped refill rounds have no OpenRLHF flag
OPENRLHF_OVERRIDES = {"specs/methods/dapo.yaml": ["rollout.filter.max_rounds=null"]}
# a Lightning-only spec refused first for another setting: with it answered, the refusal LIGHTNING_ONLY names
REFUSED_AFTER = {"specs/methods/entropy-8020.yaml": ["rollout.filter.max_rounds=null"]}  # DAPO's capped refill
PR, POL, GI, PAD = CODE["prompt"], CODE["policy"], CODE["guide_intervention"], CODE["pad"]
L2 = math.log(2.0)


def approx(x, y, tol=1e-5):
    return abs(float(x) - float(y)) <= tol


# ------------------------------------------------------------------------------------------- bundles

@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Every spec and hybrid compiled once (toy checkpoints resolved, bootstrapped if missing)."""
    if not HAVE_OPENRLHF:
        pytest.skip("openrlhf is not installed: no real parser to check against")
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout

    out = {}
    for spec in SPECS:
        v = validate_file(ROOT / spec, OPENRLHF_OVERRIDES.get(spec, []))
        d = tmp_path_factory.mktemp(Path(spec).stem)
        compile_bundle(v, d, Layout(nodes=1, gpus_per_node=GPUS_PER_NODE.get(spec, 8),
                                    cluster_dir=f"/tmp/composer-runs/{v.spec.name}"))
        out[spec] = d
    return out


@needs_openrlhf
@pytest.mark.parametrize("spec", SPECS)
def test_bundle_compiles_and_parses_with_openrlhf(spec, bundles):
    from composer.backends.openrlhf import parser

    d = bundles[spec]
    for name in ("plan.json", "args.json", "command.txt", "launch.sh", "README.md", "runtime_env.json",
                 "data/train.jsonl"):
        assert (d / name).exists(), name
    plan = json.loads((d / "plan.json").read_text())
    args = json.loads((d / "args.json").read_text())
    runs = plan["openrlhf"]["runs"]
    assert [r["name"] for r in runs] == list(args)
    commands = (d / "command.txt").read_text().splitlines()
    for run, line in zip(runs, commands):
        parsed, _ = parser.check(run["trainer"], args[run["name"]])  # OpenRLHF's parser + post-parse asserts
        assert line.startswith(f"python -m composer.backends.openrlhf --plan plan.json --run {run['name']} -- ")
        if run["trainer"] == "ppo":
            critic = any(m["role"].startswith("critic:") for s in plan["segments"] for m in s["models"])
            assert (parsed.algo.advantage.estimator == "gae") == critic  # a critic exactly where the spec has one
            assert bool(parsed.critic.model_name_or_path) == critic  # (OpenRLHF's default gae silently adds one)
            if parsed.reward.model_name_or_path:  # a reward_model source: OpenRLHF's reward model, no reward function
                assert not parsed.reward.remote_url and (d / parsed.reward.model_name_or_path).is_dir()
                continue
            assert (d / ("agent.py" if run["plugin"]["agent"] else "reward.py")).exists()
            uses = parsed.train.agent_func_path or parsed.reward.remote_url[0]
            assert (d / uses).exists()
        else:
            assert parsed.model.model_name_or_path and parsed.data.output_key == "target"
    assert subprocess.run(["bash", "-n", str(d / "launch.sh")]).returncode == 0
    env = json.loads((d / "runtime_env.json").read_text())
    assert env["worker_process_setup_hook"] == hooks.__name__ + ".setup_worker"
    assert env["working_dir"] == "." and "py_modules" not in env  # the bundle ships its own copy (D5)
    assert (d / "composer" / "backends" / "openrlhf" / "hooks.py").exists() and (d / "components").is_dir()
    readme = (d / "README.md").read_text()
    assert "OpenRLHF 0.11.2" in readme and "vLLM, DeepSpeed, flash-attn" in readme and "Native OpenRLHF flags" in readme
    for f in ("reward.py", "agent.py"):
        if (d / f).exists():
            compile((d / f).read_text(), f, "exec")


@needs_openrlhf
def test_routes_follow_component_kinds(bundles):
    def run(spec, i=0):
        return json.loads((bundles[spec] / "plan.json").read_text())["openrlhf"]["runs"][i]

    def argv(spec, i=0):
        return " ".join(run(spec, i)["argv"])

    assert run("specs/sft.yaml")["trainer"] == "sft"
    g = argv("specs/grpo.yaml")
    assert "--algo.advantage.estimator group_norm" in g and "--rollout.n_samples_per_prompt 8" in g
    assert "--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001" in g
    assert "--reward.remote_url reward.py" in g and not run("specs/grpo.yaml")["plugin"]["loss"]
    assert "from composer.backends.openrlhf.reward import" in (bundles["specs/grpo.yaml"] / "reward.py").read_text()
    o = run("specs/oapl.yaml")
    assert o["plugin"]["loss"] and o["plugin"]["sync"] and "--algo.advantage.is_correction_level token" in argv("specs/oapl.yaml")
    m = run("specs/mintrl.yaml")
    assert m["plugin"]["agent"] and "--train.agent_func_path agent.py" in argv("specs/mintrl.yaml")
    assert run("specs/opd.yaml")["plugin"]["ref"] == "teacher"
    assert "--train.enable_ema --train.ema_beta 1.0" in argv("specs/opsd.yaml")  # frozen initial self-teacher
    assert "--train.ema_beta 0.95" in argv("specs/sdpo.yaml")
    i0, i1 = run("specs/int.yaml", 0), run("specs/int.yaml", 1)
    assert (i0["name"], i1["name"]) == ("sft", "rl") and i0["plugin"]["agent"] and not i1["plugin"]["loss"]
    assert f"--actor.model_name_or_path {i0['output_dir']}/model" in argv("specs/int.yaml", 1)


@needs_openrlhf
def test_stale_flags_and_broken_post_parse_checks_are_rejected():
    from composer.backends.openrlhf import parser

    with pytest.raises(parser.ArgsError, match="unrecognized"):
        parser.check("ppo", ["--pretrain", "x"])  # the README's flat flags are gone since 0.10.2
    with pytest.raises(parser.ArgsError, match="unrecognized"):
        parser.check("ppo", ["--actor.model_name", "x"])  # no abbreviations
    with pytest.raises(parser.ArgsError, match="n_samples_per_prompt > 1"):
        parser.check("ppo", ["--algo.advantage.estimator", "group_norm", "--reward.remote_url", "r.py"])
    args, _ = parser.check("ppo", ["--train.agent_func_path", "a.py", "--algo.advantage.estimator", "reinforce"])
    assert args.reward.remote_url == ["agent"]  # OpenRLHF's own post-parse rewrite ran


def _spec_file(tmp_path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


@needs_openrlhf
@pytest.mark.parametrize("text,path,reason", [
    ("name: x\nsources: {verifier: {kind: outcome_reward}}\nrollout: {samples_per_prompt: 4}\n"
     "signal: {kind: reward, source: verifier}\nobjective: {kind: advantage_regression}\n"
     "sync: {every: 4, reuse: true}\n", "sync.reuse", "samples new rollouts every step"),
    ("name: x\nsources:\n  ref: {kind: reference_solution}\n  teacher: {kind: policy_model, model: 'toy:teacher', "
     "context: [ref]}\nsignal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence}\n",
     "sources.teacher.context", "reference slot"),
    ("name: x\nsources: {teacher: {kind: policy_model, model: 'toy:teacher'}}\n"
     "signal: {kind: distillation, teacher: teacher}\nobjective: {kind: divergence, measure: jsd, estimator: full}\n",
     "objective.estimator", "full logits"),
    ("name: x\nsources: {verifier: {kind: outcome_reward}}\nsignal: {kind: reward, source: verifier}\n"
     "objective: {kind: grpo}\nphases:\n  - {until: 5}\n  - {until: 10, rollout: {temperature: 0.5}}\n"
     "train: {steps: 10}\n", "phases[1]", "--rollout.temperature"),
])
def test_inexpressible_specs_fail_with_the_component_and_the_reason(text, path, reason, tmp_path, cli):
    r = cli("compile", _spec_file(tmp_path, text), "--backend", "openrlhf", "--out", tmp_path / "b")
    assert r.exit_code == 2, r.output
    assert path in r.stderr and reason in r.stderr and "OpenRLHF cannot express" in r.stderr
    assert not (tmp_path / "b" / "launch.sh").exists()


@needs_openrlhf
@pytest.mark.parametrize("spec", sorted(LIGHTNING_ONLY))
def test_lightning_only_hybrids_are_refused_with_the_reason(spec, tmp_path, cli):
    path, reason = LIGHTNING_ONLY[spec]
    r = cli("compile", ROOT / spec, *REFUSED_AFTER.get(spec, []), "--backend", "openrlhf", "--out", tmp_path / "b")
    assert r.exit_code == 2, r.output
    assert path in r.stderr and reason in r.stderr and "OpenRLHF cannot express" in r.stderr


@needs_openrlhf
def test_cluster_layout_options(tmp_path, cli):
    r = cli("compile", ROOT / "specs/grpo.yaml", "--out", tmp_path / "b", "--nodes", "2", "--gpus-per-node", "4",
            "--no-colocate", "--vllm-engines", "4", "--wandb-project", "p")
    assert r.exit_code == 0, r.output
    a = " ".join(json.loads((tmp_path / "b" / "args.json").read_text())["main"])
    assert "--actor.num_nodes 1 --actor.num_gpus_per_node 4" in a and "--vllm.num_engines 4" in a
    assert "--train.colocate_all" not in a and "--logger.wandb.key env:WANDB_API_KEY" in a
    r = cli("compile", ROOT / "specs/grpo.yaml", "--out", tmp_path / "c", "--gpus-per-node", "3")
    assert r.exit_code == 2 and "do not split over 3" in r.stderr  # 8 x 8 samples over 3 GPUs
    # an external judge model: a named vLLM actor on a GPU of its own, the rest for OpenRLHF
    spec = _spec_file(tmp_path, f"name: j\nextends: {ROOT / 'specs/mintrl.yaml'}\n"
                                "sources: {judge: {kind: policy_model, model: 'toy:teacher'}}\n")
    r = cli("compile", spec, "--out", tmp_path / "d", "--gpus-per-node", "5")
    assert r.exit_code == 0, r.output
    run = json.loads((tmp_path / "d" / "plan.json").read_text())["openrlhf"]["runs"][0]
    assert list(run["plugin"]["judges"]) == ["judge"] and "--actor.num_gpus_per_node 4" in " ".join(run["argv"])


def test_imports_stay_light():
    code = ("import sys, composer.cli.main, composer.backends.openrlhf; "
            "assert 'compile' in composer.cli.main.main.commands; "
            "assert not {'torch', 'openrlhf', 'ray'} & set(sys.modules), sorted({'torch', 'openrlhf', 'ray'} & set(sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ------------------------------------------------------------------------------------- the adapters

@dataclass
class Exp:
    """The Experience fields the plugin reads (OpenRLHF 0.11.2 layout: per-action tensors are [B, T-1])."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    rewards: torch.Tensor | None
    prompts: list
    labels: list
    base_action_log_probs: torch.Tensor | None = None
    info: dict = field(default_factory=dict)


def experience(origin, beh, prompts, rewards=None, control=None, base=None, **label_extra) -> Exp:
    """An Experience from composer-layout rows: origin codes [B, T] and behaviour log-probs [B, T]."""
    o = torch.tensor(origin)
    att = o != PAD
    act = (o == POL) | (o == GI)
    labels = []
    for i in range(o.shape[0]):
        meta = {"answer": "5", "spans": ob.spans_of(o[i].tolist()), "control": True if control is None else control[i],
                "step": 0, **label_extra}
        labels.append(ob.encode_label(meta))
    seq = torch.where(att, 3 + torch.arange(o.numel()).reshape(o.shape) % 7, torch.zeros_like(o))
    return Exp(seq, att.long(), ob.unshift(act), ob.unshift(torch.as_tensor(beh, dtype=torch.float32)) * ob.unshift(act),
               None if rewards is None else torch.tensor(rewards), list(prompts), labels,
               None if base is None else ob.unshift(torch.as_tensor(base, dtype=torch.float32)))


def gather(exps: list[Exp], rows: list[int]) -> Exp:
    """Rows of a step regrouped into a training micro-batch (the replay buffer shuffles)."""
    flat = [(e, i) for e in exps for i in range(len(e.prompts))]
    pick = [flat[r] for r in rows]

    def cat(name):
        xs = [getattr(e, name) for e, _ in pick]
        return None if xs[0] is None else torch.stack([x[i] for x, (_, i) in zip(xs, pick)])

    info = {k: torch.stack([e.info[k][i] for e, i in pick]) for k in pick[0][0].info}
    return Exp(cat("sequences"), cat("attention_mask"), cat("action_mask"), cat("rollout_log_probs"), cat("rewards"),
               [e.prompts[i] for e, i in pick], [e.labels[i] for e, i in pick], cat("base_action_log_probs"), info)


def plan_for(spec_data: dict) -> dict:
    return {"segments": [{"name": "main", "start": 0, "end": 100, "spec": {"name": "t", **spec_data}}]}


def loss_over(plan: dict, plugin: dict, micro: list[Exp], cur_logp, global_rows: int, ctx_extra=None):
    """Sum of ComposerLoss over OpenRLHF micro-batches (dp 1); cur_logp(exp) -> current log-probs [b, T-1]."""
    fn = ComposerLoss(Plan(plan, [0]), plugin)
    total = 0.0
    for e in micro:
        lp = cur_logp(e) * e.action_mask
        advs, norms = take_step_inputs(dict(e.info))  # as the training-step hook does
        fn.ctx = {"experience": e, "advantages": advs, "norms": norms, **(ctx_extra or {})}
        loss, *_ = fn(lp, lp.detach(), torch.zeros_like(lp), action_mask=e.action_mask,
                      rollout_log_probs=e.rollout_log_probs, dp_size=1, global_batch_size=torch.tensor(float(global_rows)))
        total = total + loss
    return total


class _Tok:
    pad_token_id = 0


def test_experience_to_batch_and_back():
    q = math.log(0.25)
    e = experience([[PR, POL, GI, POL], [PR, PR, POL, PAD]], [[0, q, -1.0, q], [0, 0, q, 0]], ["a", "b"],
                   rewards=[1.0, 0.0], control=[False, True])
    b = ob.to_batch(e.sequences, e.attention_mask, e.action_mask, e.prompts, e.labels,
                    rollout_log_probs=e.rollout_log_probs, rewards=e.rewards)
    assert b.origin.tolist() == [[PR, POL, GI, POL], [PR, PR, POL, PAD]]
    assert torch.allclose(b.behavior_logprobs, torch.tensor([[0, q, -1.0, q], [0, 0, q, 0]]))
    assert b.control.tolist() == [False, True] and b.rewards.tolist() == [1.0, 0.0]
    assert b.examples[0].answer == "5"
    back = ob.from_batch(b, trainable=("policy", "guide_intervention"))
    assert torch.equal(back["action_mask"], e.action_mask.bool()) and torch.equal(back["sequences"], e.sequences)
    assert torch.allclose(back["rollout_log_probs"], e.rollout_log_probs)
    again = ob.to_batch(back["sequences"], back["attention_mask"], back["action_mask"], ["a", "b"], back["labels"],
                        rollout_log_probs=back["rollout_log_probs"])
    assert torch.equal(again.origin, b.origin) and again.control.tolist() == [False, True]
    # the loss view: tokens OpenRLHF computes no log-prob for (outside the action mask) never get loss
    only = ob.to_batch(e.sequences, e.attention_mask, torch.zeros_like(e.action_mask), e.prompts, e.labels,
                       trainable_only=True)
    assert set(only.origin.unique().tolist()) <= {PR, PAD}
    assert ob.decode_label("7") == {"answer": "7"} and ob.action_ranges([[3, 5, "policy"], [5, 6, "guide_prefix"]],
                                                                        {"policy"}) == [(3, 5)]



def test_teacher_weight_weighs_only_its_distillation_term():
    """SDPO's s_i = 0 (no sibling success, no feedback) silences the distillation term on that row, not
    a reward term sharing the rollout."""
    q = math.log(0.25)
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}, "teacher": {"kind": "policy_model", "model": "t"}},
                     "terms": [{"name": "d", "signal": {"kind": "distillation", "teacher": "teacher"},
                                "objective": {"kind": "divergence"}},
                               {"name": "r", "signal": {"kind": "reward", "source": "verifier"},
                                "objective": {"kind": "advantage_regression"}}]})
    e = experience([[PR, POL, POL], [PR, POL, POL]], [[0, q, q]] * 2, ["p", "p"], rewards=[1.0, 0.0],
                   base=[[0, q, q]] * 2)
    metas = [ob.decode_label(x) for x in e.labels]
    metas[0]["teacher_weight"] = {"teacher": 0.0}
    metas[1]["teacher_weight"] = {"teacher": 1.0}
    e.labels = [ob.encode_label(m) for m in metas]
    fn = ComposerLoss(Plan(plan, [0]), {"teachers": {}})
    fn.ctx = {"experience": e}
    at = fn.plan.at(0)
    (d, r) = fn.batches(at, None, e.action_mask, e.rollout_log_probs)
    assert d.weights().tolist() == [0.0, 1.0] and r.weights().tolist() == [1.0, 1.0]
    assert d.teacher_logprobs is not None and r.teacher_logprobs is None

# MInTRL numbers of tests/test_objectives.py::test_advantage_regression_*_by_hand
MINTRL_ORIGIN = [[PR, POL, POL, POL], [PR, POL, GI, POL], [PR, POL, GI, POL], [PR, POL, POL, PAD]]
ADV = [0.0, 1.0, 0.5, -0.5]


def mintrl_step(anchor):
    q = math.log(0.25)
    beh = [[0.0, q, q, q]] * 3 + [[0.0, q, q, 0.0]]
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}}, "signal": {"kind": "reward", "source": "verifier"},
                     "objective": {"kind": "advantage_regression", "beta1": math.inf, "beta2": 0.1, "baseline": "control",
                                   "anchor": {"guide_intervention": anchor}, "loss_tokens": ["policy", "guide_intervention"]}})
    full = experience(MINTRL_ORIGIN, beh, ["p0", "p0", "p1", "p1"], rewards=[0.0, 1.0, 1.0, 0.0],
                      control=[True, False, False, False])
    step = [gather([full], [0, 1]), gather([full], [2, 3])]  # the experience maker's micro-batches
    prepare_step(step, Plan(plan, [0]), {"teachers": {}}, _Tok(), None)
    return plan, step


@pytest.mark.parametrize("anchor", [-0.2, "policy"])
def test_advantage_regression_loss_matches_the_lightning_numbers(anchor):
    plan, step = mintrl_step(anchor)
    adv = torch.cat([e.info["composer/adv0"] for e in step])
    assert adv.tolist() == ADV  # V-hat over the control rollouts of the whole step, group 1 falls back to all rows
    if anchor == -0.2:  # Const: intervention token ln .5 - (-0.2)
        lr = [3 * L2, 2 * L2 + (-L2 + 0.2), 2 * L2 + (-L2 + 0.2), 2 * L2]
        expected = 0.362275
    else:  # Proxy: anchored at the rollout weights' log-prob of the intervention token (scored by the agent)
        lr = [3 * L2, 3 * L2, 3 * L2, 2 * L2]
        expected = sum((0.1 * x - a) ** 2 for x, a in zip(lr, ADV)) / 4
    assert approx(sum((0.1 * x - a) ** 2 for x, a in zip(lr, ADV)) / 4, expected)
    half = lambda e: torch.full(e.action_mask.shape, math.log(0.5))
    for micro in (step, [gather(step, [0, 3]), gather(step, [1, 2])], [gather(step, [0, 1, 2, 3])]):
        assert approx(loss_over(plan, {"ref": "initial"}, micro, half, 4), expected)


def grpo_exps(kl_coef, base=None):
    lh = math.log(0.5)
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}}, "signal": {"kind": "reward", "source": "verifier"},
                     "objective": {"kind": "grpo", "kl_coef": kl_coef}})
    full = experience([[PR, POL, POL]] * 4, [[0.0, lh, lh]] * 4, ["a", "a", "b", "b"], rewards=[1.0, 0.0, 0.0, 0.0],
                      base=base)
    step = [gather([full], [0, 1]), gather([full], [2, 3])]
    prepare_step(step, Plan(plan, [0]), {"teachers": {}}, _Tok(), None)
    return plan, step


def grpo_logp(e):
    return torch.tensor([[math.log(0.75), math.log(0.25)]]).expand(e.action_mask.shape[0], 2)


def test_grpo_term_through_the_plugin_matches_the_lightning_numbers():
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # test_objectives.A_G0
    plan, step = grpo_exps(0.0)
    assert approx(loss_over(plan, {"ref": "initial"}, [gather(step, [0, 2]), gather(step, [1, 3])], grpo_logp, 4),
                  0.6 * a / 8)
    lh = math.log(0.5)
    plan, step = grpo_exps(0.1, base=[[0.0, lh, lh]] * 4)  # the reference slot holds the initial policy
    k3 = ((1 / 1.5 + math.log(1.5) - 1) + (2 + math.log(0.5) - 1)) / 2
    assert approx(loss_over(plan, {"ref": "initial"}, step, grpo_logp, 4), 0.6 * a / 8 + 0.1 * k3)


OPD_PLAN = plan_for({"sources": {"teacher": {"kind": "policy_model", "model": "toy:teacher"}},
                     "signal": {"kind": "distillation", "teacher": "teacher"},
                     "objective": {"kind": "divergence", "kl_coef": 2.0}})


def test_sampled_distillation_from_the_reference_slot_teacher():
    # test_objectives.test_sampled_reverse_kl_by_hand: behaviour [ln .5, ln .25], teacher [ln .25, ln .5] -> 0.5 ln 2
    e = experience([[PR, POL, POL]], [[0.0, math.log(0.5), math.log(0.25)]], ["a"],
                   base=[[0.0, math.log(0.25), math.log(0.5)]])
    cur = lambda e: torch.tensor([[math.log(0.75), math.log(0.25)]])
    plugin = {"ref": "teacher", "teachers": {"teacher": {"self": False}}}
    assert approx(loss_over(OPD_PLAN, plugin, [e], cur, 1), 0.5 * L2)


S = [0.5, 0.2, 0.1, 0.1, 0.1]
T = [0.25, 0.25, 0.25, 0.125, 0.125]
REV = 0.5 * math.log(2) + 0.2 * math.log(0.8) + 0.1 * math.log(0.4) + 0.2 * math.log(0.8)


def test_full_divergence_with_captured_student_logits_and_self_teacher():
    # test_objectives.test_divergence_full_by_hand (reverse KL): position 1 S vs T, position 2 identical -> REV / 2
    plan = plan_for({"sources": {"ref": {"kind": "reference_solution"},
                                 "teacher": {"kind": "policy_model", "model": "self", "context": ["ref"]}},
                     "signal": {"kind": "distillation", "teacher": "teacher"},
                     "objective": {"kind": "divergence", "estimator": "full"}})
    h = math.log(0.5)
    e = experience([[PR, POL, POL]], [[0.0, h, h]], ["a"])
    student_raw = torch.tensor([[S, T, [0.2] * 5]]).log()  # Actor output: position j predicts token j + 1
    teacher = torch.tensor([[[0.2] * 5, T, T]]).log()  # composer layout: position t predicts token t
    ctx = {"logits": student_raw, "teachers": {"teacher": (torch.zeros(1, 3), teacher)}}
    loss = loss_over(plan, {"ref": "initial", "teachers": {"teacher": {"self": True}}}, [e],
                     lambda e: torch.tensor([[h, h]]), 1, ctx)
    assert approx(loss, REV / 2)


def test_cross_entropy_on_guided_targets_skips_untrained_rows():
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}}, "rollout": {"guide": {"kind": "intervention",
                     "judge": "j"}}, "signal": {"kind": "sft", "target": "guided"},
                     "objective": {"kind": "cross_entropy", "loss_tokens": ["policy", "guide_intervention"]}})
    plan["segments"][0]["spec"]["sources"]["j"] = {"kind": "oracle"}
    e = experience([[PR, POL, GI], [PR, POL, POL]], [[0.0, -1.0, -1.0]] * 2, ["a", "b"])
    e.action_mask[1] = 0  # a rollout without an intervention (or one whose continuations all failed): no target
    cur = lambda e: torch.tensor([[math.log(0.5), math.log(0.25)]] * 2)
    assert approx(loss_over(plan, {"ref": "initial"}, [e], cur, 1), (L2 + 2 * L2) / 2)


def test_context_scores_realign_teacher_positions():
    """Teacher prompt of a different length: student position t reads teacher position t + Q - P."""
    V = 6
    emb = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    forward = lambda ids, mask: emb[ids]
    tokens = torch.tensor([[1, 2, 3, 4, 0], [1, 5, 2, 0, 0]])
    att = (tokens != 0).long()
    lp, logits = context_scores(forward, tokens, att, [2, 1], [[5, 5, 5, 1, 2], None], 2.0, 0, True)
    ref = torch.log_softmax(emb / 2.0, -1)
    # row 0 response tokens 3, 4 follow 2, 3 (the teacher prompt ends with 2 like the student's)
    assert torch.allclose(lp[0], torch.tensor([0, 0, ref[2, 3], ref[3, 4], 0]))
    assert torch.allclose(lp[1], torch.tensor([0, ref[1, 5], ref[5, 2], 0, 0]))  # own prompt (None)
    assert torch.allclose(logits[0, 2], emb[2] / 2.0) and logits[0, 0].abs().sum() == 0


def test_prepare_step_builds_the_opsd_teacher_prompt():
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    v = validate_file(ROOT / "specs/opsd.yaml")
    from composer.plan.compile import compile_plan

    plan = compile_plan(v)
    ex = toy.make_example("7+3-5")
    ids = tok.encode(ex.prompt + "7+3=0\n#0", add_special_tokens=False)
    P = len(tok.encode(ex.prompt, add_special_tokens=False))
    o = torch.tensor([[PR] * P + [POL] * (len(ids) - P)])
    e = Exp(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), ob.unshift(o == POL), None,
            torch.tensor([0.0]), [ex.prompt], [ob.encode_label(ob.label_of(ex, step=0))])
    plugin = {"teachers": {"teacher": {"self": True, "context": ["reference"]}}}
    prepare_step([e], Plan(plan, [0]), plugin, tok, hooks_task(toy))
    meta = ob.decode_label(e.labels[0])
    want = toy.TEMPLATES["reference"].format(solution=ex.solution, problem=ex.problem)
    assert tok.decode(meta["teacher"]["teacher"]) == want and meta["teacher_weight"] == {"teacher": 1.0}


def test_prepare_step_sdpo_contexts_span_micro_batches():
    """SDPO's self-teacher prompt of a row reads its siblings, which sit in other micro-batches of the step."""
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer
    from composer.plan.compile import compile_plan

    tok = char_tokenizer()
    plan = compile_plan(validate_file(ROOT / "specs/sdpo.yaml"))
    ex = toy.make_example("7+3-5")
    P = len(tok.encode(ex.prompt, add_special_tokens=False))
    responses = [ex.solution, "7+3=0\n0-5=1\n#1", "7+3=1\n#1", "#2"]  # only row 0 succeeds

    def exp(resp):
        ids = tok.encode(ex.prompt + resp, add_special_tokens=False)
        o = torch.tensor([[PR] * P + [POL] * (len(ids) - P)])
        return Exp(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), ob.unshift(o == POL), None,
                   torch.tensor([float(resp == ex.solution)]), [ex.prompt], [ob.encode_label(ob.label_of(ex, step=0))])

    def cat(a, b):
        T = max(a.sequences.shape[1], b.sequences.shape[1])
        pad = lambda x, w: torch.nn.functional.pad(x, (0, w - x.shape[1]))
        return Exp(torch.cat([pad(a.sequences, T), pad(b.sequences, T)]),
                   torch.cat([pad(a.attention_mask, T), pad(b.attention_mask, T)]),
                   torch.cat([pad(a.action_mask, T - 1), pad(b.action_mask, T - 1)]), None,
                   torch.cat([a.rewards, b.rewards]), a.prompts + b.prompts, a.labels + b.labels)

    step = [cat(exp(responses[0]), exp(responses[2])), cat(exp(responses[1]), exp(responses[3]))]
    plugin = {"teachers": {"teacher": {"self": True, "context": ["sibling", "feedback"]}}}
    prepare_step(step, Plan(plan, [0]), plugin, tok, hooks_task(toy))
    metas = [ob.decode_label(x) for e in step for x in e.labels]  # rows 0, 2, 1, 3
    assert metas[0]["teacher_weight"]["teacher"] == 0.0  # the only success: no sibling, no feedback -> no signal
    assert all(m.get("weight") is None for m in metas)  # other terms keep weight 1
    sib = toy.TEMPLATES["sibling"].format(sibling=ex.solution, problem=ex.problem)
    for m in metas[1:]:  # failures see the successful sibling from the other micro-batch
        assert m["teacher_weight"]["teacher"] == 1.0 and tok.decode(m["teacher"]["teacher"]) == sib


def hooks_task(toy):
    from composer.data import Task

    return Task("toy", [], {}, "toy", toy.ToyStepChecker(), templates={k: v for k, v in toy.TEMPLATES.items() if k != "prompt"})


# -------------------------------------------------------------------------------------- the agent

class _LP:
    def __init__(self, v):
        self.logprob = v


class Params:
    """Stand-in for vllm.SamplingParams (the fields the agent reads and writes)."""

    def __init__(self, max_tokens=None, temperature=1.0, top_p=1.0, top_k=-1, logprobs=None, prompt_logprobs=None):
        self.max_tokens, self.temperature, self.top_p, self.top_k = max_tokens, temperature, top_p, top_k
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs


class FakeEngine:
    """An async policy engine: continues the response along the first script it is a prefix of."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.calls = tok, scripts, 0

    async def generate(self, ids, params, multi_modal_data=None):
        self.calls += 1
        text = self.tok.decode(ids, skip_special_tokens=True)
        prompt_lp = [None] + [{t: _LP(-1.0)} for t in ids[1:]] if params.prompt_logprobs is not None else None
        cont = "<eos>"
        body = text.rsplit("V:" if text.endswith("V:") else "A:", 1)[-1]  # a judge prompt ends with V:
        for script in self.scripts(text):
            if script.startswith(body):
                cont = script[len(body):] + "<eos>"
                break
        out = self.tok.encode(cont, add_special_tokens=False)
        n = params.max_tokens
        toks, finish = (out[:n], "length") if len(out) > n else (out, "stop")
        lps = [{t: _LP(-0.5)} for t in toks] if params.logprobs is not None else None
        o = types.SimpleNamespace(token_ids=toks, text=self.tok.decode(toks, skip_special_tokens=True), logprobs=lps,
                                  finish_reason=finish)
        return types.SimpleNamespace(outputs=[o], prompt_logprobs=prompt_lp)


def agent_for(spec: str, overrides=(), segments=None):
    from composer.backends.openrlhf.agent import ComposerAgent
    from composer.plan.compile import compile_plan

    v = validate_file(ROOT / spec, list(overrides))
    plan = compile_plan(v)
    segments = list(range(len(plan["segments"]))) if segments is None else segments
    plan["openrlhf"] = {"toy": True, "runs": [{"name": "main", "segments": segments,
                                               "plugin": {"agent": True, "verifier": "toy"}}]}
    return ComposerAgent(plan, "main")


def run_agent(agent, engine, tok, prompt, label, n, max_length=64):
    async def go():
        return await asyncio.gather(*[agent.execute(prompt, label, Params(max_tokens=40, logprobs=1), max_length, tok,
                                                    engine)
                                      for _ in range(n)])

    return asyncio.run(go())


def as_experience(out) -> Exp:
    """OpenRLHF's SamplesGenerator._process_response_into_experience, for the fields the plugin reads."""
    seq = torch.tensor([out["observation_tokens"]])
    act = torch.zeros(seq.shape, dtype=torch.long)
    for s, e in out["action_ranges"]:
        act[0, s:e] = 1
    return Exp(seq, torch.ones_like(seq), act[:, 1:], torch.tensor([out["rollout_log_probs"][1:]]),
               torch.tensor([out["reward"]]), [out["prompt"]], [out["label"]])


def test_agent_runs_mintrl_judge_interventions_with_a_fake_engine():
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    ex = toy.make_example("7+3-5")  # 7+3=0, 0-5=5, #5
    bad, good = "7+3=0\n0-5=1\n#1", ex.solution
    engine = FakeEngine(tok, lambda text: [bad, good])
    agent = agent_for("specs/mintrl.yaml")
    label = ob.encode_label(ob.label_of(ex, step=0))
    outs = run_agent(agent, engine, tok, ex.prompt, label, 16)
    control, guided = outs[:8], outs[8:]  # control_samples: 8 of 16, never guided
    P = len(tok.encode(ex.prompt, add_special_tokens=False))
    for out in control:
        meta = ob.decode_label(out["label"])
        assert out["reward"] == 0.0 and meta["control"] and not meta["guided"]
        assert meta["spans"] == [[P, len(out["observation_tokens"]), "policy"]]
    for out in guided:
        meta = ob.decode_label(out["label"])
        text = tok.decode(out["observation_tokens"][P:], skip_special_tokens=True)
        assert text == good and out["reward"] == 1.0 and not meta["control"] and meta["guided"]
        # the oracle judge rejected step 2 of the first chunk: 7+3=0\n kept, 0-5=5\n written by the judge
        s = meta["spans"]
        assert [o for _, _, o in s] == ["policy", "guide_intervention", "policy"]
        assert tok.decode(out["observation_tokens"][s[1][0]:s[1][1]]) == "0-5=5\n"
        assert out["action_ranges"] == [tuple(x[:2]) for x in s]  # mintrl trains intervention tokens too
        lps = out["rollout_log_probs"]
        assert len(lps) == len(out["observation_tokens"])
        # sampled tokens carry the sampler's log-probs; the Const anchor reads none of the intervention's,
        # so they are not scored (a Proxy anchor's are: below)
        assert set(lps[s[1][0]:s[1][1]]) == {0.0} and set(lps[s[0][0]:s[0][1]]) == {-0.5}
        b = ob.to_batch(*[getattr(as_experience(out), k) for k in ("sequences", "attention_mask", "action_mask")],
                        [out["prompt"]], [out["label"]])
        assert b.origin[0, s[1][0]:s[1][1]].tolist() == [GI] * 6
    assert 0 < guided[0]["extra_logs"]["composer_offpolicy_frac"] < 1
    proxy = agent_for("specs/mintrl.yaml", ["objective.anchor.guide_intervention=policy"])
    out = run_agent(proxy, engine, tok, ex.prompt, label, 16)[-1]
    s = ob.decode_label(out["label"])["spans"]
    assert set(out["rollout_log_probs"][s[1][0]:s[1][1]]) == {-1.0}  # scored by the rollout weights
    # the phase after step 200 switches the guide off: every rollout is a plain control rollout
    late = run_agent(agent, engine, tok, ex.prompt, ob.encode_label(ob.label_of(ex, step=300)), 16)
    assert all(ob.decode_label(o["label"])["control"] and o["reward"] == 0.0 for o in late)


def test_agent_pope_prefix_in_the_prompt_with_minimal_search():
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    ex = toy.make_example("7+3-5+9")
    lines = ex.solution.split("\n")

    def scripts(text):  # solves only when the prompt carries at least one reference line
        return ["\n".join(lines[1:])] if "\nP:" in text else ["7+3=0\n0-5=1\n#1"]

    agent = agent_for("specs/pope.yaml", ["rollout.guide.guided_fraction=1.0"])
    outs = run_agent(agent, FakeEngine(tok, scripts), tok, ex.prompt, ob.encode_label(ob.label_of(ex, step=0)), 8)
    guided_prompt = toy.prefix_prompt(ex, 1)[0]
    for out in outs:
        meta = ob.decode_label(out["label"])
        assert meta["guided"] and meta["tag"] == "guided" and out["reward"] == 1.0
        assert tok.decode(out["observation_tokens"][: len(guided_prompt)]) == guided_prompt
        assert out["prompt"] == ex.prompt  # grouping and the label keep the original prompt
    # k = 0 (the plain prompt) failed, one reference line suffices: searched once, with the initial weights
    assert agent.memo.prefixes[agent.steps.at(0).spec.rollout.guide.model_dump_json()][ex.prompt] == 1


def test_agent_pope_searches_every_run_problem_at_every_step_before_the_first_broadcast(tmp_path, monkeypatch):
    """POPE draws its guided prompts per step, and its minimal search reads the initial policy, which the
    rollout engine holds only until the first broadcast (sync every step here: step 1 samples with updated
    weights). The agent's first call searches every training problem of the run (the bundle's train rows) that
    any step of the run guides; a problem guided only at step 1 is then served from that search, where the
    agent used to search it at step 1 and refuse ("initial policy after the first broadcast")."""
    from types import SimpleNamespace

    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    agent = agent_for("specs/pope.yaml", ["train.steps=2", "train.prompts_per_step=1"])
    spec, guide = agent.steps.at(0).spec, agent.steps.at(0).spec.rollout.guide
    pool = [toy.make_example(p) for p in ("7+3-5+9", "2+2-1+4", "5-3+8-2", "9-4+1+6", "3+3+3-7", "8-1-2+5")]
    at = lambda s, ex: guide.chosen(SimpleNamespace(step=s, spec=spec), ex)  # noqa: E731
    late = next(ex for ex in pool if at(1, ex) and not at(0, ex))  # guided at step 1 only
    first = next(ex for ex in pool if ex is not late)
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": ex.prompt, "label": ob.encode_label(ob.label_of(ex))}) + "\n"
                            for ex in (first, late)))
    agent.run["plugin"].update(train_file=str(rows), train_rows=2)
    assert agent.steps.at(0).sampler_is_initial and not agent.steps.at(1).sampler_is_initial

    engine = FakeEngine(tok, lambda text: ["7+3=0\n#1"])  # never solves: the search ends at the largest k
    run_agent(agent, engine, tok, first.prompt, ob.encode_label(ob.label_of(first, step=0)), 2)
    cache = agent.memo.prefixes[guide.model_dump_json()]
    assert late.prompt in cache  # searched on the first call, with the initial weights
    calls = engine.calls
    outs = run_agent(agent, engine, tok, late.prompt, ob.encode_label(ob.label_of(late, step=1)), 2)
    assert engine.calls == calls + 2  # the two rollouts only: no search after the broadcast
    k = cache[late.prompt]
    assert all(ob.decode_label(o["label"])["guided"] == (k > 0) for o in outs)


def test_agent_prepares_the_run_problems_not_the_whole_task(tmp_path, monkeypatch):
    """A guide that prepares per problem without the initial policy (PrefixRL: 8 teacher generations per problem,
    the first correct one its trace) prepares, on the agent's first call, the run's training problems (the
    bundle's train rows), then the problem at hand; not the task's whole training set (the real-job tier's
    PrefixRL job spent minutes writing teacher traces for every toy problem before a 2-step job could start)."""
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    agent = agent_for("specs/methods/prefixrl.yaml")
    spec = agent.steps.at(0).spec
    guide = spec.rollout.guide
    run_rows = [toy.make_example(p) for p in ("7+3-5+9", "2+2-1+4")]
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": ex.prompt, "label": ob.encode_label(ob.label_of(ex))}) + "\n"
                            for ex in run_rows))
    agent.run["plugin"].update(train_file=str(rows), train_rows=2)
    seen = []
    monkeypatch.setattr(type(guide), "prepare", lambda self, ctx, examples: seen.extend(e.prompt for e in examples) or [])
    ctx = agent.context(spec, char_tokenizer())
    assert len(ctx.task.train) > 10 * len(run_rows)  # what the agent used to prepare
    other = toy.make_example("5-3+8-2")
    asyncio.run(agent._prepare(ctx, guide, other, serve=None))
    assert seen == [ex.prompt for ex in run_rows] + [other.prompt]
    asyncio.run(agent._prepare(ctx, guide, run_rows[0], serve=None))  # later calls: the problem at hand only
    assert seen[3:] == [run_rows[0].prompt]


def test_agent_int_stage_one_self_judge_and_sft_filter():
    """InT's first stage: a failed rollout gets one review by the policy itself (greedy, the toy judge
    template; the verdict, then the correction from the reference and the kept steps only), the target is
    prefix + intervention, kept because a continuation from it succeeds."""
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    ex = toy.make_example("7+3-5+1")  # the intervention (step 2) does not contain the gold answer (6): no leak
    bad, good = "7+3=0\n0-5=1\n1+1=2\n#2", ex.solution

    def scripts(text):  # the proposal (verification, first error and the right step in one answer); the policy
        return ["REVISE 2\n0-5=5"] if text.endswith("V:") else [good] if text.startswith("R:") else [bad, good]

    agent = agent_for("specs/int.yaml", ["stages.0.signal.targets=online"], segments=[0])  # the sft stage, online
    outs = run_agent(agent, FakeEngine(tok, scripts), tok, ex.prompt, ob.encode_label(ob.label_of(ex, step=0)), 4,
                     128)  # room for the proposal prompt (the whole attempt, numbered, and the reference)
    P = len(tok.encode(ex.prompt, add_special_tokens=False))
    for out in outs:
        meta = ob.decode_label(out["label"])
        assert meta["guided"] and meta["weight"] == 1.0, {k: meta.get(k) for k in ("guided", "weight", "spans")}  # a continuation from the target succeeds
        assert tok.decode(out["observation_tokens"][P:]) == "7+3=0\n0-5=5\n"  # cut right after the intervention
        assert [o for _, _, o in meta["spans"]] == ["policy", "guide_intervention"]
        assert out["action_ranges"] == [(P, P + 6), (P + 6, P + 12)]


def test_agent_int_offline_targets_are_built_once_for_the_training_problems():
    """InT as published on OpenRLHF: the first sample of the stage builds every training problem's targets
    (the same attempt programs as the Lightning backend), later samples only read them; a problem with fewer
    kept targets than samples returns its prompt at weight 0 for the rest; a leaking intervention is dropped."""
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    fixable, leaky = toy.make_example("7+3-5+1"), toy.make_example("4+4")  # 7+3=0, 0-5=5, 5+1=6, #6
    bad = {fixable.prompt: "7+3=0\n0-5=1\n1+1=2\n#2", leaky.prompt: "4+4=8\n#0"}

    def scripts(text):  # InT's proposal (first error and intervention in one answer); else the policy's attempt
        if text.endswith("V:"):  # the right step (the leaky problem's is its final answer line)
            return ["REVISE 2\n0-5=5" if "7+3" in text else "REVISE 2\n#8"]
        return [bad.get(p, "") for p in bad if text.startswith(p)] + [fixable.solution, "4+4=8\n#8"]

    agent = agent_for("specs/int.yaml", segments=[0])
    spec = agent.steps.at(0).spec
    agent.context(spec, tok).task.train = [fixable, leaky]  # this run's training problems
    engine = FakeEngine(tok, scripts)
    outs = run_agent(agent, engine, tok, fixable.prompt, ob.encode_label(ob.label_of(fixable, step=0)), 4, 128)
    (targets, counts), = agent.built.values()
    assert counts["problems"] == 2 and counts["attempts"] == 8 and counts["leaks"] == 4 and counts["kept"] == 4
    assert set(targets) == {fixable.prompt}
    assert all(ob.decode_label(o["label"])["weight"] == 1.0 for o in outs)
    calls = engine.calls
    again = run_agent(agent, engine, tok, leaky.prompt, ob.encode_label(ob.label_of(leaky, step=0)), 4, 128)
    assert engine.calls == calls  # built once: nothing generated for later samples
    assert all(ob.decode_label(o["label"])["weight"] == 0.0 for o in again)


def test_reward_func_reads_the_response_with_the_verifier():
    from components.tasks import toy
    from composer.backends.openrlhf.reward import make_reward_func

    ex = toy.make_example("7+3-5")
    f = make_reward_func("toy")
    out = f([ex.prompt + ex.solution], [ex.prompt], [ob.encode_label(ob.label_of(ex))])
    assert out["rewards"] == 1.0 and out["scores"] == 1.0
    assert make_reward_func("toy")([ex.prompt + "#4"], [ex.prompt], [ob.encode_label(ob.label_of(ex))])["rewards"] == 0.0
    assert make_reward_func("none")(["x"], ["x"], ["{}"])["rewards"] == 0.0


# -------------------------------------------------------------------------------------- the hooks

@pytest.fixture
def installed():
    saved = dict(hooks._STATE)
    hooks._plan.cache_clear()
    yield hooks._STATE
    hooks._STATE.clear()
    hooks._STATE.update(saved)
    hooks._plan.cache_clear()


def test_post_import_hook_patches_a_module_when_it_is_imported(tmp_path, monkeypatch):
    (tmp_path / "composer_fake_mod.py").write_text("class C:\n    def f(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks.when_imported("composer_fake_mod", lambda m: (seen.append(m.__name__), setattr(m.C, "f", lambda self: 2)))
    import composer_fake_mod

    assert seen == ["composer_fake_mod"] and composer_fake_mod.C().f() == 2
    del sys.modules["composer_fake_mod"]


def test_dispatch_and_sync_patches_on_fake_openrlhf_classes(installed):
    v = validate_file(ROOT / "specs/oapl.yaml")
    from composer.plan.compile import compile_plan

    plan = compile_plan(v)
    installed.update(plan=plan, run={"name": "main", "segments": [0], "plugin": {"top_k": 20}})

    class SamplesGenerator:
        def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **kw):
            return labels, kw

        def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **kw):
            return [], 0, True

        def generate_samples(self):
            return [], None, 0, True

    class BasePPOTrainer:
        broadcasts = 0

        def train_step(self, rollout_samples, global_step):
            self.broadcast_to_vllm()
            return {}, global_step + 1

        def broadcast_to_vllm(self):
            BasePPOTrainer.broadcasts += 1

        def init_checkpoint_states(self):
            return {"global_step": 0}

        def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
            pass

    hooks._patch_dispatch(types.SimpleNamespace(SamplesGenerator=SamplesGenerator))
    hooks._patch_trainer(types.SimpleNamespace(BasePPOTrainer=BasePPOTrainer, prepare_datasets=lambda s, t: None))
    t = BasePPOTrainer()
    t.samples_generator = SamplesGenerator()
    t.init_checkpoint_states()
    synced = []
    for step in range(20):
        labels, kw = t.samples_generator._dispatch_prompts_to_vllm(["p"], ['{"answer":"1"}'])
        assert ob.decode_label(labels[0])["step"] == step and kw["top_k"] == 20
        status, _ = t.train_step([], step)
        synced.append(status["composer/synced"])
    assert BasePPOTrainer.broadcasts == 2 and [i for i, s in enumerate(synced) if s] == [9, 19]  # sync.every 10


def test_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "composer.backends.openrlhf", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "--plan" in r.stdout


def test_cluster_smoke_script_is_ready():
    d = ROOT / "examples" / "cluster"
    assert subprocess.run(["bash", "-n", str(d / "smoke.sh")]).returncode == 0
    compile((d / "smoke.py").read_text(), "smoke.py", "exec")


# ------------------------------------------ micro-batches add up to the whole step (issue 14, D3 and D4)

UNEVEN = [[PR, POL, POL, POL, POL, POL], [PR, PR, POL, PAD, PAD, PAD], [PR, POL, POL, POL, PAD, PAD],
          [PR, POL, POL, POL, POL, PAD]]  # responses of 5, 1, 3 and 4 tokens


def token_logp(e):
    """Current log-probs that depend on the token ids only, so any regrouping or padding sees the same values."""
    return -0.3 - 0.05 * e.sequences[:, 1:].float()


def whole_step_loss(plan, step, plugin):
    """The Lightning backend's figure: one batch of the whole step, the objective's own advantages over its
    groups, then `loss` once (composer/step.py)."""
    from composer.batch import PolicyView
    from composer.checks.terms import terms

    spec = Plan(plan, [0]).at(0).spec
    (_n, _s, obj, _w), = terms(spec)
    full = step_batch(step, 0, trainable_only=True)
    if step[0].base_action_log_probs is not None and plugin.get("ref") != "initial":
        full.teacher_logprobs = ob.shift(torch.cat([e.base_action_log_probs for e in step]).float())
    adv = obj.advantages(step_batch(step, 0))
    seqs = torch.cat([e.sequences for e in step])
    view = PolicyView(ob.shift(-0.3 - 0.05 * seqs[:, 1:].float()))
    value, _ = obj.loss(full, view, adv)
    return float(value)


OBJECTIVES = {
    "grpo token-mean": ({"kind": "grpo", "kl_coef": 0.0}, {"ref": "initial"}),
    "grpo seq-mean-token-mean": ({"kind": "grpo", "kl_coef": 0.0, "loss_agg": "seq-mean-token-mean"}, {"ref": "initial"}),
    "grpo seq-mean-token-sum-norm": ({"kind": "grpo", "kl_coef": 0.0, "loss_agg": "seq-mean-token-sum-norm",
                                      "norm_const": 8.0}, {"ref": "initial"}),
    "grpo sapo seq-mean-token-mean": ({"kind": "grpo", "kl_coef": 0.0, "bound": "sapo", "loss_agg": "seq-mean-token-mean"},
                                      {"ref": "initial"}),
    "grpo sign_weighted": ({"kind": "grpo", "kl_coef": 0.0, "bound": "none",
                            "estimator": {"kind": "sign_weighted", "positive_weight": 0.1}}, {"ref": "initial"}),
    "advantage regression": ({"kind": "advantage_regression", "beta2": 0.1}, {"ref": "initial"}),
    "sampled reverse KL": ({"kind": "divergence", "kl_coef": 1.0}, {"ref": "teacher", "teachers": {"teacher": {"self": False}}}),
}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_micro_batches_of_uneven_length_add_up_to_the_whole_step(name):
    """Whatever the split into micro-batches, the sum of ComposerLoss equals the loss of the whole step as
    one batch (each term scales by its own normaliser: tokens for token-mean, rows for the seq-means)."""
    obj, plugin = OBJECTIVES[name]
    distill = obj["kind"] == "divergence"
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"},
                                 "teacher": {"kind": "policy_model", "model": "toy:teacher"}},
                     "signal": {"kind": "distillation", "teacher": "teacher"} if distill else
                     {"kind": "reward", "source": "verifier"}, "objective": obj})
    beh = [[0.0] + [math.log(0.4)] * 5] * 4
    base = [[0.0] + [math.log(0.3)] * 5] * 4 if distill else None
    full = experience(UNEVEN, beh, ["a", "a", "b", "b"], rewards=[1.0, 0.0, 1.0, 0.25], base=base)
    step = [gather([full], [0, 1]), gather([full], [2, 3])]
    prepare_step(step, Plan(plan, [0]), plugin, _Tok(), None)
    want = whole_step_loss(plan, step, plugin)
    assert abs(want) > 1e-3  # a figure that can tell a wrong normaliser
    for split in ([[0], [1], [2], [3]], [[0, 3], [1, 2]], [[1], [0, 2, 3]], [[0, 1, 2, 3]]):
        got = loss_over(plan, plugin, [gather(step, rows) for rows in split], token_logp, 4)
        assert approx(float(got), want), (split, float(got), want)


def test_a_row_with_nothing_to_train_adds_no_loss_and_no_gradient():
    """D3: the agent keeps one action token at weight 0 in a row without an SFT target (so that OpenRLHF's
    token count is never 0); that token gets neither loss nor gradient, alone or next to trained rows."""
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}, "j": {"kind": "oracle"}},
                     "rollout": {"guide": {"kind": "intervention", "judge": "j"}},
                     "signal": {"kind": "sft", "target": "guided"},
                     "objective": {"kind": "cross_entropy", "loss_tokens": ["policy", "guide_intervention"]}})
    e = experience([[PR, POL, GI], [PR, PR, POL]], [[0.0, -1.0, -1.0]] * 2, ["a", "b"])
    metas = [ob.decode_label(x) for x in e.labels]
    metas[1]["weight"] = 0.0  # the placeholder row
    e.labels = [ob.encode_label(m) for m in metas]
    prepare_step([e], Plan(plan, [0]), {"ref": "initial"}, _Tok(), None)
    alone = gather([e], [1])
    lp = torch.full(alone.action_mask.shape, math.log(0.5), requires_grad=True)
    loss = loss_over(plan, {"ref": "initial"}, [alone], lambda x: lp, 1)
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    assert float(loss) == 0.0 and (grad is None or not grad.any())
    both = loss_over(plan, {"ref": "initial"}, [gather([e], [0, 1])], lambda x: torch.full(x.action_mask.shape,
                                                                                       math.log(0.5)), 2)
    assert approx(float(both), L2)  # the trained row's two tokens at ln 2 each, token mean: the placeholder is not counted


@needs_openrlhf
@pytest.mark.parametrize("spec,over,want", [
    ("specs/methods/dapo.yaml", ["rollout.filter.max_rounds=null"], {"--train.max_epochs": "1", "--train.batch_size": "32",
                                     "--algo.advantage.estimator": "group_norm"}),
    ("specs/grpo.yaml", ["train.epochs=2"], {"--train.max_epochs": "2", "--train.batch_size": "64"}),
    ("specs/grpo.yaml", ["objective.estimator={kind: leave_one_out}"], {"--algo.advantage.estimator": "rloo"}),
    ("specs/methods/kdrl.yaml", ["train.epochs=2", "sync.off_policy_ok=true"],
     {"--train.max_epochs": "2", "--algo.advantage.estimator": "reinforce"}),
])
def test_updates_and_estimators_map_to_openrlhf_flags(spec, over, want, tmp_path, cli):
    """train.epochs -> --train.max_epochs, train.mini_batches -> --train.batch_size = rollouts / mini_batches, the
    estimators OpenRLHF has natively -> --algo.advantage.estimator; the rest runs in the plugin's loss."""
    r = cli("compile", ROOT / spec, *over, "--backend", "openrlhf", "--out", tmp_path / "b")
    assert r.exit_code == 0, r.output
    argv = json.loads((tmp_path / "b" / "args.json").read_text())["main"]
    for flag, value in want.items():
        assert argv[argv.index(flag) + 1] == value, flag


@needs_openrlhf
def test_a_scheduled_entropy_coef_is_refused_on_openrlhf(tmp_path, cli):
    r = cli("compile", ROOT / "specs/grpo.yaml", "train.entropy_coef={kind: linear, start: 0.01, end: 0, steps: 10}",
            "--backend", "openrlhf", "--out", tmp_path / "b")
    assert r.exit_code == 2 and "train.entropy_coef" in r.stderr and "no schedule" in r.stderr


def test_plugin_loss_reads_old_logprobs_with_several_epochs():
    """With train.epochs 2 the composer's loss in the plugin takes OpenRLHF's old actor log-probs as the ratio's
    denominator (not vLLM's behaviour log-probs); with one epoch it keeps the behaviour log-probs, as before.
    By hand: GSPO, one sequence of 2 tokens, A = +-0.5/(std + eps) of rewards [1, 0]; no clip (clip 10)."""
    q = math.log(0.25)
    spec = {"sources": {"verifier": {"kind": "outcome_reward"}}, "signal": {"kind": "reward", "source": "verifier"},
            "objective": {"kind": "grpo", "ratio": "sequence", "clip": 10.0, "kl_coef": 0.0,
                          "loss_agg": "seq-mean-token-mean"}}
    e = experience([[PR, POL, POL], [PR, POL, POL]], [[0, q, q]] * 2, ["p", "p"], rewards=[1.0, 0.0])
    prepare_step([e], Plan(plan_for(spec), [0]), {"teachers": {}}, _Tok(), None)
    cur = ob.unshift(torch.tensor([[0, -1.0, -1.2], [0, -1.5, -1.1]])) * e.action_mask  # [2, T-1]
    old = ob.unshift(torch.tensor([[0, -1.1, -1.4], [0, -1.3, -1.3]])) * e.action_mask
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # (r - mean) / (unbiased std + eps)

    def loss(epochs):
        fn = ComposerLoss(Plan(plan_for({**spec, "train": {"epochs": epochs}}), [0]), {"teachers": {}})
        advs, norms = step_inputs(e)  # as the training-step hook does, in every pass
        fn.ctx = {"experience": e, "advantages": advs, "norms": norms}
        out, *_ = fn(cur, old, torch.zeros_like(cur), action_mask=e.action_mask,
                     rollout_log_probs=e.rollout_log_probs, dp_size=1)
        return float(out)

    s_old = [math.exp(((-1.0 + 1.1) + (-1.2 + 1.4)) / 2), math.exp(((-1.5 + 1.3) + (-1.1 + 1.3)) / 2)]
    s_beh = [math.exp(((-1.0 - q) + (-1.2 - q)) / 2), math.exp(((-1.5 - q) + (-1.1 - q)) / 2)]
    assert loss(2) == pytest.approx(-(s_old[0] * a - s_old[1] * a) / 2, rel=1e-5)
    assert loss(2) == pytest.approx(-(s_old[0] * a - s_old[1] * a) / 2, rel=1e-5)  # a second pass, same inputs
    assert loss(1) == pytest.approx(-(s_beh[0] * a - s_beh[1] * a) / 2, rel=1e-5)


# ------------------------------------------------------------------------------ traces inside groups (LUFFY)

def test_agent_runs_luffy_traces_and_the_plugin_trains_the_mixed_group():
    """The agent runs the traces guide one sample at a time: draw 0 of each prompt is the reference + EOS as
    demonstration tokens (trainable, no sampler log-prob, reward by the same verifier), draws 1-7 the policy's. The
    advantage step groups all 8 (one group per prompt and tag), and the plugin's loss is LUFFY's on that step:
    rewards [1, 0 x 7]: mean 1/8, unbiased std sqrt(1/8); A = 7/8 / sqrt(1/8) on the trace, -1/8 / sqrt(1/8) on
    the rollouts. With the current log-prob ln 0.5 on every token: the trace's tokens -A_t 0.5 / 0.6 (shaping),
    the rollouts' -A_p exp(ln 0.5 + 0.5) (the fake sampler's log-prob -0.5; inside the clip), token-mean."""
    from components.tasks import toy
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    ex = toy.make_example("7+3-5")
    bad = "7+3=0\n0-5=1\n#1"
    agent = agent_for("specs/methods/luffy.yaml")
    label = ob.encode_label(ob.label_of(ex, step=0))
    outs = run_agent(agent, FakeEngine(tok, lambda text: [bad]), tok, ex.prompt, label, 8)
    P = len(tok.encode(ex.prompt, add_special_tokens=False))
    trace = outs[0]
    meta = ob.decode_label(trace["label"])
    want = tok.encode(ex.solution, add_special_tokens=False) + [tok.eos_token_id]
    assert trace["observation_tokens"][P:] == want and trace["reward"] == 1.0
    assert meta["spans"] == [[P, P + len(want), "demonstration"]] and trace["action_ranges"] == [(P, P + len(want))]
    assert not meta["control"] and meta["guided"] and meta["tag"] == ""
    assert set(trace["rollout_log_probs"][P:]) == {0.0}  # no sampler log-prob: the weight form reads none
    for out in outs[1:]:
        m = ob.decode_label(out["label"])
        assert m["control"] and out["reward"] == 0.0 and [o for _, _, o in m["spans"]] == ["policy"]
    step = [as_experience(o) for o in outs]
    prepare_step(step, Plan(agent.plan, [0]), {"teachers": {}}, _Tok(), None)
    adv = torch.cat([e.info["composer/adv0"] for e in step])
    s = math.sqrt(1 / 8)
    a_t, a_p = (7 / 8) / (s + 1e-6), -(1 / 8) / (s + 1e-6)
    assert approx(adv[0], a_t) and all(approx(x, a_p) for x in adv[1:].tolist())
    n_t = len(want)
    n_p = len(tok.encode(bad, add_special_tokens=False)) + 1  # + EOS
    rho = math.exp(math.log(0.5) + 0.5)
    expected = (-a_t * n_t * 0.5 / 0.6 - a_p * rho * 7 * n_p) / (n_t + 7 * n_p)
    half = lambda e: torch.full(e.action_mask.shape, math.log(0.5))
    for micro in ([gather(step, list(range(8)))], [gather(step, [0, 3, 5]), gather(step, [1, 2, 4, 6, 7])]):
        assert approx(float(loss_over(agent.plan, {"ref": "initial"}, micro, half, 8)), expected)


@needs_openrlhf
def test_a_teacher_sampling_traces_away_from_temperature_one_is_refused(tmp_path, cli):
    """A policy_model source writing the traces samples at the rollout's settings on Lightning; OpenRLHF's engine for
    an external model samples at temperature 1: refused with the reason, and accepted at temperature 1."""
    over = ["sources.teacher={kind: policy_model, model: 'toy:teacher'}", "rollout.guide.source=teacher",
            "rollout.max_new_tokens=256"]  # the toy teacher's context: 512 tokens
    r = cli("compile", ROOT / "specs/methods/luffy.yaml", *over, "rollout.temperature=0.9", "--backend", "openrlhf",
            "--out", tmp_path / "a", "--gpus-per-node", "5")
    assert r.exit_code == 2 and "rollout.temperature" in r.stderr and "temperature 1" in r.stderr, r.output
    r = cli("compile", ROOT / "specs/methods/luffy.yaml", *over, "--backend", "openrlhf", "--out", tmp_path / "b",
            "--gpus-per-node", "5")
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert "teacher" in plan["openrlhf"]["runs"][0]["plugin"]["judges"]  # its own vLLM actor writes the traces


@needs_openrlhf
def test_the_sft_plus_rl_refusal_points_at_traces_not_at_stages(tmp_path, cli):
    """The refusal of an SFT term next to rollout terms names the part that keeps demonstrations inside the RL run
    (the traces guide), not `stages`, which would turn the method into SFT-then-RL (issue 46)."""
    text = ("name: x\nsources:\n  verifier: {kind: outcome_reward}\n  reference: {kind: reference_solution}\nterms:\n"
            "  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}}\n"
            "  - {signal: {kind: sft, target: reference}, objective: {kind: cross_entropy, loss_tokens: [demonstration]}}\n")
    r = cli("compile", _spec_file(tmp_path, text), "--backend", "openrlhf", "--out", tmp_path / "b")
    assert r.exit_code == 2 and "cannot be mixed with rollout terms" in r.stderr, r.output
    assert "{kind: traces" in r.stderr and "off_policy_weight" in r.stderr and "another method" in r.stderr


@needs_openrlhf
def test_guide_tokens_scored_away_from_temperature_one_are_refused(tmp_path, cli):
    """An objective that reads the behaviour log-probs of a guide's tokens (MInTRL's interventions): the agent scores
    them with vLLM's prompt log-probs, which vLLM 0.32 never tempers and OpenRLHF's engines return one per position:
    away from temperature 1 refused with the reason, accepted at 1."""
    spec = ROOT / "specs/hybrids/mintrl-self-proxy.yaml"
    r = cli("compile", spec, "rollout.temperature=0.7", "--backend", "openrlhf", "--out", tmp_path / "a")
    assert r.exit_code == 2, r.output
    assert "rollout.temperature" in r.stderr and "untempered" in r.stderr and "guide_intervention" in r.stderr
    assert cli("compile", spec, "--backend", "openrlhf", "--out", tmp_path / "b").exit_code == 0
