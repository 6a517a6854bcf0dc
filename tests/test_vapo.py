"""VAPO's parts (issue 54 item 5; Yue et al. 2025, arXiv 2504.05118): decoupled and length-adaptive GAE (ppo's
`critic_lambda`, `lambd: adaptive`, `length_alpha`), the NLL term on the policy's own correct rollouts (an `sft`
signal with `target: rollouts` under a success gate), the critic-only segment (`train.freeze_policy`) and the critic's
state across stages (`train.critic_at_stage`).

Hand-worked numbers on small batches; OpenRLHF 0.11.2's own GAE (RemoteExperienceMaker.get_advantages_and_returns,
read from the installed wheel) and TRL's PPOTrainer GAE loop on the same batch: equal at a fixed lambda; the decoupled
form equals two OpenRLHF passes (advantages at the policy's lambda, returns at the critic's); the length-adaptive
lambda equals OpenRLHF's function given one lambda per row (a [B] tensor: its recursion broadcasts), which its
command line cannot say (--algo.advantage.lambd is one float)."""

from __future__ import annotations

import importlib.util
import math
import types
from pathlib import Path

import pytest
import torch

from _helpers import openrlhf_code, openrlhf_env as _openrlhf_env
from components.objectives.ppo import Ppo, adaptive_lambda, gae
from composer.batch import TrajectoryBatch
from composer.origins import CODE
from test_ppo import _batch as ppo_batch

ROOT = Path(__file__).resolve().parent.parent
VAPO = ROOT / "specs" / "methods" / "vapo.yaml"
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
needs_openrlhf = pytest.mark.skipif(not HAVE_OPENRLHF, reason="openrlhf is not installed")


def _rows(lengths: list[int], P: int = 1, T: int | None = None):
    """mask [B, T] of P prompt positions then `lengths[i]` action positions (right padding)."""
    T = T or P + max(lengths) + 1
    mask = torch.zeros((len(lengths), T), dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, P:P + n] = True
    return mask


# --------------------------------------------------------------------------------------- hand-worked numbers

def test_adaptive_lambda_by_hand():
    """lambda = 1 - 1/(alpha l), alpha 0.05: l = 400 -> 1 - 1/20 = 0.95; l = 40 -> 1 - 1/2 = 0.5; l = 25 -> 1 - 1/1.25 =
    0.2; l = 20 -> 0; l = 10 -> 1 - 1/0.5 = -1, clamped to 0. alpha 0.5, l = 4: 1 - 1/2 = 0.5."""
    lam = adaptive_lambda(_rows([400, 40, 25, 20, 10]), 0.05)
    assert torch.allclose(lam, torch.tensor([0.95, 0.5, 0.2, 0.0, 0.0]), atol=1e-6), lam
    assert math.isclose(float(adaptive_lambda(_rows([4]), 0.5)[0]), 0.5, abs_tol=1e-7)
    assert float(adaptive_lambda(_rows([0]), 0.05)[0]) == 0.0  # a row without an action: no lambda to speak of


def _hand_batch():
    """Row 0: 4 actions, R = 1, V = [0.5, 0.2, -0.1, 0.3]; row 1: 2 actions, R = 0, V = [0.4, -0.2]."""
    origin = torch.full((2, 6), CODE["prompt"], dtype=torch.uint8)
    origin[0, 1:5] = CODE["policy"]
    origin[1, 1:3] = CODE["policy"]
    values = torch.zeros((2, 6))
    values[0, 1:5] = torch.tensor([0.5, 0.2, -0.1, 0.3])
    values[1, 1:3] = torch.tensor([0.4, -0.2])
    return TrajectoryBatch(tokens=torch.zeros((2, 6), dtype=torch.long), origin=origin,
                           behavior_logprobs=torch.zeros((2, 6)), group=torch.tensor([0, 0]),
                           control=torch.ones(2, dtype=torch.bool), rewards=torch.tensor([1.0, 0.0]), values=values)


def test_decoupled_and_adaptive_gae_by_hand():
    """gamma 1, no KL, alpha 0.5: row 0 (l = 4) lambda_policy 1 - 1/(0.5 x 4) = 0.5, row 1 (l = 2) 1 - 1/1 = 0.
    Row 0: delta = [0.2 - 0.5, -0.1 - 0.2, 0.3 + 0.1, 1 - 0.3] = [-0.3, -0.3, 0.4, 0.7];
      A (lambda 0.5) = [-0.3 + 0.5 x 0.075, -0.3 + 0.5 x 0.75, 0.4 + 0.5 x 0.7, 0.7] = [-0.2625, 0.075, 0.75, 0.7];
      critic (lambda 1): A^c = [0.5, 0.8, 1.1, 0.7], G = A^c + V = [1, 1, 1, 1] (the Monte-Carlo return R = 1).
    Row 1: delta = [-0.2 - 0.4, 0 + 0.2] = [-0.6, 0.2]; A (lambda 0) = delta; A^c = [-0.4, 0.2], G = [0, 0] (R = 0).
    With one lambda for both (critic_lambda null) G = A + V: row 0 [0.2375, 0.275, 0.65, 1.0]."""
    b = _hand_batch()
    obj = Ppo(lambd="adaptive", length_alpha=0.5, critic_lambda=1.0, kl_coef=0.0, whiten="none")
    adv = obj.advantages(b)
    assert torch.allclose(adv[0, 1:5], torch.tensor([-0.2625, 0.075, 0.75, 0.7]), atol=1e-6), adv
    assert torch.allclose(adv[1, 1:3], torch.tensor([-0.6, 0.2]), atol=1e-6)
    assert torch.allclose(b.returns[0, 1:5], torch.ones(4), atol=1e-6), b.returns
    assert torch.allclose(b.returns[1, 1:3], torch.zeros(2), atol=1e-6)
    assert math.isclose(b.info["lambda_policy"], 0.25, abs_tol=1e-7)  # the mean of 0.5 and 0
    one = _hand_batch()
    Ppo(lambd="adaptive", length_alpha=0.5, kl_coef=0.0, whiten="none").advantages(one)
    assert torch.allclose(one.returns[0, 1:5], torch.tensor([0.2375, 0.275, 0.65, 1.0]), atol=1e-6)
    # the referee's plain formula gives the same numbers
    mask = b.mask(["policy"])
    A, G = obj.reference_gae([1.0, 0.0], b.behavior_logprobs, None, b.values.double(), mask)
    assert torch.allclose(A[mask], adv[mask].double(), atol=1e-6) and torch.allclose(G[mask], b.returns[mask].double(),
                                                                                     atol=1e-6)


def _batch(B=5, P=2, T=12, seed=0):
    """test_ppo's random rows (P prompt tokens, responses of varying length), larger by default."""
    return ppo_batch(B, P, T, seed)


def test_validation_of_the_new_fields():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="length_alpha applies to `lambd: adaptive`"):
        Ppo(lambd=0.9, length_alpha=0.1)
    with pytest.raises(ValidationError):
        Ppo(lambd="adaptiv")
    with pytest.raises(ValidationError):
        Ppo(critic_lambda=1.5)
    assert not Ppo(lambd=0.9, critic_lambda=0.9).decoupled and Ppo(critic_lambda=1.0).decoupled


def test_a_fixed_lambda_is_untouched():
    """critic_lambda null, or equal to lambd, is the one GAE of before: advantages and returns bit for bit those of
    `gae` at that lambda."""
    from components.objectives.ppo import reward_kl, token_rewards, whiten

    for crit in (None, 0.9):
        b, c = _batch(seed=2), _batch(seed=2)
        adv = Ppo(lambd=0.9, critic_lambda=crit, kl_coef=0.05).advantages(b)
        mask = c.mask(["policy"])
        a, g = gae(token_rewards(c.rewards, mask, reward_kl(c.behavior_logprobs, c.initial_logprobs, "k1"), 0.05),
                   c.values, mask, 1.0, 0.9)
        assert torch.equal(b.returns, g) and torch.equal(adv, whiten(a, mask, "mean_std"))


# --------------------------------------------------------------------------------------- peers on one batch

def _openrlhf_gae():
    ns = openrlhf_code("trainer/ppo_utils/experience_maker.py", ["RemoteExperienceMaker.get_advantages_and_returns"],
                       _openrlhf_env())
    return types.MethodType(ns["RemoteExperienceMaker.get_advantages_and_returns"], types.SimpleNamespace())


def _response(b, P):
    """(per-token rewards, values, action mask) on the response positions, as OpenRLHF holds them."""
    from components.objectives.ppo import token_rewards

    mask = b.mask(["policy"])
    r = token_rewards(b.rewards, mask, None, 0.0)
    return r[:, P:], (b.values * mask)[:, P:], mask[:, P:].float(), mask


@needs_openrlhf
@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_gae_equals_openrlhf_fixed_decoupled_and_per_row(gamma):
    """On one random batch (6 rows, responses of 2-14 tokens), against OpenRLHF 0.11.2's get_advantages_and_returns:
      fixed lambda 0.9 (critic_lambda null): advantages and returns equal;
      decoupled (lambd 0.9, critic_lambda 1.0): advantages = OpenRLHF's at 0.9, returns = OpenRLHF's at 1.0;
      adaptive (length_alpha 0.5): equal to OpenRLHF's recursion given one lambda per row, a [B] tensor
      (its command line takes one float: the per-row lambda is the intended difference)."""
    P = 2
    b0 = _batch(6, P, 16, seed=5)
    fn = _openrlhf_gae()
    r, v, am, mask = _response(b0, P)
    theirs = {lam: fn(v, r, am, gamma, lam) for lam in (0.9, 1.0)}

    b = _batch(6, P, 16, seed=5)
    a_fixed = Ppo(gamma=gamma, lambd=0.9, kl_coef=0.0, whiten="none").advantages(b)
    assert torch.allclose(a_fixed[:, P:], theirs[0.9][0] * am, atol=1e-6)
    assert torch.allclose(b.returns[:, P:], theirs[0.9][1] * am, atol=1e-6)

    d = _batch(6, P, 16, seed=5)
    a_dec = Ppo(gamma=gamma, lambd=0.9, critic_lambda=1.0, kl_coef=0.0, whiten="none").advantages(d)
    assert torch.allclose(a_dec[:, P:], theirs[0.9][0] * am, atol=1e-6)
    assert torch.allclose(d.returns[:, P:], theirs[1.0][1] * am, atol=1e-6)
    assert not torch.allclose(theirs[0.9][1] * am, theirs[1.0][1] * am, atol=1e-3)  # the two targets differ here

    e = _batch(6, P, 16, seed=5)
    obj = Ppo(gamma=gamma, lambd="adaptive", length_alpha=0.5, kl_coef=0.0, whiten="none")
    a_ad = obj.advantages(e)
    lam = adaptive_lambda(mask, 0.5)
    assert len(set(lam.tolist())) > 2  # rows of several lengths, several lambdas
    ta, tr = fn(v, r, am, gamma, lam)
    assert torch.allclose(a_ad[:, P:], ta * am, atol=1e-6) and torch.allclose(e.returns[:, P:], tr * am, atol=1e-6)
    assert a_fixed[:, P:].abs().sum() > 1 and not torch.allclose(a_ad, a_fixed, atol=1e-3)


def test_adaptive_gae_equals_trl_loop_row_by_row():
    """TRL's PPOTrainer GAE loop (trl/trainer/ppo_trainer.py, `train`), written out as TRL writes it, run once per row
    at that row's lambda 1 - 1/(alpha l): equal to ours."""
    P, alpha = 2, 0.25
    b = _batch(5, P, 14, seed=9)
    _r, _v, _am, mask = _response(b, P)
    ours = Ppo(lambd="adaptive", length_alpha=alpha, kl_coef=0.0, whiten="none").advantages(b)
    from components.objectives.ppo import token_rewards

    rew = (token_rewards(b.rewards, mask, None, 0.0) * mask)[:, P:]
    val = (b.values * mask)[:, P:]
    for i in range(b.size):
        n = int(mask[i].sum())
        lam = min(1.0, max(0.0, 1 - 1 / (alpha * n)))
        lastgaelam, rev = 0, []
        gen_length = rew.shape[1]
        for t in reversed(range(gen_length)):
            nextvalues = val[i, t + 1] if t < gen_length - 1 else 0.0
            delta = rew[i, t] + 1.0 * nextvalues - val[i, t]
            lastgaelam = delta + 1.0 * lam * lastgaelam
            rev.append(lastgaelam)
        trl = torch.stack(rev[::-1]) * mask[i, P:]
        assert torch.allclose(ours[i, P:], trl, atol=1e-6), i


# --------------------------------------------------------------------------------------- the NLL term's signal

def test_sft_on_the_policys_own_rollouts():
    """`target: rollouts`: the step's rollout (no batch of its own, no reference source, no train_sft route), scored
    at the sampler's temperature (a temperature of its own is refused), the guided-target settings refused."""
    from pydantic import ValidationError

    from components.guides.none import NoGuide
    from components.signals.sft import SftSignal

    sig = SftSignal(target="rollouts")
    assert not sig.makes_batch and sig.ref_names() == {} and sig.openrlhf_trainer() is None
    assert sig.loss_temperature is None and not sig.targets_rows
    assert sig.origins(NoGuide()) == {"prompt", "policy"}
    with pytest.raises(ValidationError, match="sampler's temperature"):
        SftSignal(target="rollouts", temperature=0.5)
    with pytest.raises(ValidationError, match="the policy's own rollouts"):
        SftSignal(target="rollouts", filter_samples=4)
    assert SftSignal(target="reference").openrlhf_trainer() == "sft"  # references still go to train_sft


def test_the_nll_term_trains_only_successful_rows_with_its_own_normaliser():
    """VAPO's NLL term on a batch of 3 rows (row 1 failed, gate outcome: success -> row_mask [1, 0, 1]): the loss is
    -(sum of log pi over rows 0 and 2's policy tokens) / their token count; row 1 gets no gradient."""
    from components.objectives.cross_entropy import CrossEntropy
    from composer.batch import PolicyView

    b = _batch(3, 2, 8, seed=1)
    b.row_mask = torch.tensor([True, False, True])
    cur = b.behavior_logprobs.clone().requires_grad_(True)
    loss, _m = CrossEntropy(loss_tokens=["policy"]).loss(b, PolicyView(cur))
    m = b.mask(["policy"])
    keep = m & b.row_mask[:, None]
    want = -float(cur.detach()[keep].sum()) / int(keep.sum())
    assert math.isclose(float(loss.detach()), want, rel_tol=1e-6)
    loss.backward()
    assert (cur.grad[1] == 0).all() and (cur.grad[0][m[0]] != 0).all()


# --------------------------------------------------------------------------------------- the spec

def test_vapo_validates_and_explains_its_mechanisms():
    from composer.checks.validate import validate_file
    from composer.plan.compile import compile_plan
    from composer.plan.explain import text

    out = text(compile_plan(validate_file(VAPO)))
    for line in ("lambda_policy = 1 - 1/(0.05 l) per response", "A^c GAE at its own lambda 1 (decoupled GAE",
                 "PPO clip [1-0.2, 1+0.28]; aggregation: token-mean", "nll: sft -> cross_entropy (weight 0.1)",
                 "gate: only rows where the rollout succeeded",
                 "policy frozen (train.freeze_policy): no policy loss or update; the critic's 2 epoch(s)",
                 "policy: frozen (train.freeze_policy)", "critic: ppo: a fresh critic at the run's start",
                 "critic: ppo: carried on from the previous phase"):
        assert line in out, line


@pytest.mark.parametrize("spec,overrides,words", [
    ("grpo.yaml", ["train.freeze_policy=true"], "no term here has a critic"),
    ("methods/ppo.yaml", ["train.freeze_policy=true", "objective.critic.network=shared"], "network: shared"),
    ("methods/ppo.yaml", ["train.critic_at_stage=reset"], "this spec has no stages"),
])
def test_what_validation_refuses(spec, overrides, words):
    from composer.checks.validate import validate_file
    from composer.errors import SpecError

    with pytest.raises(SpecError, match=words):
        validate_file(ROOT / "specs" / spec, overrides)


STAGED = """\
name: ppo-staged
sources:
  verifier: {{kind: outcome_reward}}
rollout: {{samples_per_prompt: 4, temperature: 1.0}}
signal: {{kind: reward, source: verifier}}
objective: {{kind: ppo, kl_coef: 0.01, critic: {{lr: 5.0e-4}}}}
train: {{prompts_per_step: 8, lr: 1.0e-4, epochs: 2}}
stages:
  - {{name: value-pretrain, train: {{steps: 2, freeze_policy: true}}}}
  - {{name: rl, train: {{steps: 2{extra}}}}}
"""


def _staged(tmp_path, extra: str = "") -> Path:
    p = tmp_path / "staged.yaml"
    p.write_text(STAGED.format(extra=extra))
    return p


def test_explain_shows_the_critic_across_stages(tmp_path):
    from composer.checks.validate import validate_file
    from composer.plan.compile import compile_plan
    from composer.plan.explain import text

    keep = text(compile_plan(validate_file(_staged(tmp_path))))
    assert "term0: carried on from the previous stage (weights, AdamW state, update count; " \
           "train.critic_at_stage: keep)" in keep
    assert "policy: frozen (train.freeze_policy)" in keep
    reset = text(compile_plan(validate_file(_staged(tmp_path, ", critic_at_stage: reset"))))
    assert "term0: a fresh critic at this stage's start (train.critic_at_stage: reset" in reset


def test_openrlhf_maps_a_frozen_first_phase_and_refuses_the_rest(tmp_path):
    """A frozen first phase -> --critic.freezing_steps K - 1 (OpenRLHF skips the actor while global_step <= it,
    counting from 0); a frozen phase after a trained one, a kept critic in a later stage, and VAPO itself (a
    second, gated term; its lambdas) are refused with the reason."""
    from composer.backends.openrlhf.flags import Inputs, Layout, Unsupported, build_runs
    from composer.checks.validate import validate_file

    inputs = Inputs(policy_path="/models/policy", source_paths={}, train_file="data/train.jsonl",
                    train_rows={"main": 240, "value-pretrain": 240, "rl": 240}, eval_file=None, max_prompt_chars=64,
                    max_solution_chars=128)
    p = tmp_path / "phased.yaml"
    p.write_text(f"name: ppo-phased\nextends: {ROOT / 'specs' / 'methods' / 'ppo.yaml'}\n"
                 "phases:\n  - {until: 3, train: {freeze_policy: true}}\n  - {until: 60}\n")
    run, = build_runs(validate_file(p, ["policy.model=/models/policy"]), Layout(nodes=1, gpus_per_node=2), inputs)
    i = run.argv.index("--critic.freezing_steps")
    assert run.argv[i + 1] == "2" and any("freezing_steps 2" in n for n in run.native)
    p.write_text(f"name: ppo-phased\nextends: {ROOT / 'specs' / 'methods' / 'ppo.yaml'}\n"
                 "phases:\n  - {until: 3}\n  - {until: 60, train: {freeze_policy: true}}\n")
    with pytest.raises(Unsupported, match="only for the first steps of a run") as e:
        build_runs(validate_file(p, ["policy.model=/models/policy"]), Layout(nodes=1, gpus_per_node=2), inputs)
    assert e.value.path[-2:] == ("train", "freeze_policy")
    with pytest.raises(Unsupported, match="critic_at_stage: keep carries") as e:
        build_runs(validate_file(_staged(tmp_path), ["policy.model=/models/policy"]), Layout(nodes=1, gpus_per_node=2),
                   inputs)
    runs = build_runs(validate_file(_staged(tmp_path, ", critic_at_stage: reset"), ["policy.model=/models/policy"]),
                      Layout(nodes=1, gpus_per_node=2), inputs)
    assert [r.argv[r.argv.index("--critic.freezing_steps") + 1] if "--critic.freezing_steps" in r.argv else None
            for r in runs] == ["1", None]
    second = runs[1].argv
    assert second[second.index("--critic.model_name_or_path") + 1] == f"{runs[0].output_dir}/model"
    with pytest.raises(Unsupported, match="one objective: other terms"):
        build_runs(validate_file(VAPO, ["policy.model=/models/policy"]), Layout(nodes=1, gpus_per_node=2), inputs)


def test_the_frozen_check_fails_when_the_policy_moved():
    """The referee's `_check_frozen` on recorded fingerprints: a frozen segment whose weights changed fails, one whose
    weights stayed and whose critic moved passes (the check can fail)."""
    from types import SimpleNamespace

    from composer.referee import _check_frozen
    from composer.referee.checks import Report

    seg = SimpleNamespace(name="phase0", start=0, end=2, spec=SimpleNamespace(train=SimpleNamespace(freeze_policy=True)))
    v = SimpleNamespace(segments=[seg])
    a, b = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    events = [("critic_values", {"step": 0, "term": "t", "state": a}), ("critic_values", {"step": 1, "term": "t",
                                                                                          "state": b})]
    for prints, ok in (({0: "x", 1: "x", 2: "x"}, True), ({0: "x", 1: "y", 2: "y"}, False)):
        rep = Report()
        _check_frozen(v, SimpleNamespace(policy_at=prints, final=None), rep, events)
        assert rep.checks["frozen policy did not move"].passed == int(ok)
        assert rep.checks["frozen policy: the critic learned"].passed == 1
    rep = Report()
    _check_frozen(v, SimpleNamespace(policy_at={0: "x", 1: "x", 2: "x"}, final=None), rep, events[:1] * 2)
    assert rep.checks["frozen policy: the critic learned"].failed == 1


@pytest.mark.slow
def test_a_staged_value_pretraining_passes_the_referee(tmp_path):
    """ppo.yaml as two stages: value pre-training (train.freeze_policy, 3 steps), then PPO with a fresh critic
    (critic_at_stage: reset): the referee finds the policy unmoved and the critic moving in the first stage, and the
    second stage's critic started again from the policy's weights with fresh AdamW moments."""
    from composer.referee import referee

    rep = referee(_staged(tmp_path, ", critic_at_stage: reset"), tmp_path / "run")
    assert rep.ok, "\n".join(rep.failures()) + "\n" + rep.table()
    assert rep.checks["frozen policy did not move"].passed == 1
    assert rep.checks["frozen policy: the critic learned"].passed == 1
    assert rep.checks["critic starts from the policy's weights"].passed == 2  # the run's start and the reset
    assert rep.checks["critic step recomputed"].passed > 0


def test_the_rollout_targets_reference():
    """`reference_targets` writes the term's rows again from the recorded rollout: the rows it names, padding left
    out; None for reference targets (nothing of the rollout to compare)."""
    from components.signals.sft import SftSignal

    r = _batch(3, 2, 8, seed=4)  # right padding after each response (origin pad)
    got = SftSignal(target="rollouts").reference_targets(r, [2, 0])
    assert [t for t, _o in got] == [r.tokens[2][r.attention_mask[2]].tolist(), r.tokens[0][r.attention_mask[0]].tolist()]
    assert SftSignal(target="reference").reference_targets(r, [0]) is None


def test_a_critic_is_carried_across_settings_and_dropped_by_a_reset(monkeypatch):
    """RunContext.critic: the same term's critic of the same network built under other settings (a later phase or a
    kept stage that changes critic.lr) is carried on under the new settings; another network is a fresh critic;
    reset_critics (train.critic_at_stage: reset) drops every built critic and any checkpointed critic state waiting."""
    from components.objectives.critic import Critic
    from composer.runtime.context import RunContext

    built = []

    class Built:
        def __init__(self, cfg):
            self.cfg = cfg

    monkeypatch.setattr(Critic, "build", lambda self, ctx, name: built.append(self) or Built(self))
    ctx = RunContext(task=None, tokenizer=None, policy=None, engine=None)
    a = ctx.critic("ppo", Critic(lr=1e-3))
    b = ctx.critic("ppo", Critic(lr=2e-3))
    assert b is a and b.cfg.lr == 2e-3 and len(built) == 1
    assert ctx.critic("other", Critic(lr=2e-3)) is not a  # another term: its own critic
    assert ctx.critic("ppo", Critic(network="shared")) is not a and len(built) == 3
    ctx.state.pending_runtime_state["('critic', 'ppo', '{}')"] = {"weights": {}}
    ctx.state.pending_runtime_state["('source', 'verifier', '{}')"] = {}
    ctx.reset_critics()
    assert not [k for k in ctx.state.runtimes if k[0] == "critic"]
    assert list(ctx.state.pending_runtime_state) == ["('source', 'verifier', '{}')"]
    assert ctx.critic("ppo", Critic(lr=2e-3)) is not a and len(built) == 4
