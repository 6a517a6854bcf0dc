"""Term gates (composer/gates.py): the rows a gate takes, worked out by hand; a gated term's loss and
normaliser count only those rows; validation and explain; one real step of each gated spec recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from components.objectives.cross_entropy import CrossEntropy
from components.objectives.grpo import Grpo
from composer.batch import PolicyView, TrajectoryBatch
from composer.gates import Gate, gate_by_prompt, gate_rows, row_surprisal
from composer.origins import CODE
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
GATED = ["specs/methods/srpo.yaml", "specs/methods/hpt.yaml", "specs/methods/kdrl-mask.yaml"]

# two groups of three rows: group 0 rewards (1, 0, 0), group 1 rewards (0, 0, 0)
SUCCESS = torch.tensor([True, False, False, False, False, False])
GROUP = torch.tensor([0, 0, 0, 1, 1, 1])


@pytest.mark.parametrize("gate, rows", [
    ({"outcome": "success"}, [1, 0, 0, 0, 0, 0]),
    ({"outcome": "failure"}, [0, 1, 1, 1, 1, 1]),
    # group success rates: 1/3 and 0
    ({"group_success_at_most": 0.0}, [0, 0, 0, 1, 1, 1]),
    ({"group_success_above": 0.0}, [1, 1, 1, 0, 0, 0]),
    ({"group_success_at_most": 0.5}, [1, 1, 1, 1, 1, 1]),
    ({"group_success_above": 0.4}, [0, 0, 0, 0, 0, 0]),
    # a sibling: another row of the group succeeded (row 0's only success is itself)
    ({"sibling_success": True}, [0, 1, 1, 0, 0, 0]),
    ({"sibling_success": False}, [1, 0, 0, 1, 1, 1]),
    ({"outcome": "failure", "sibling_success": True}, [0, 1, 1, 0, 0, 0]),
])
def test_gate_rows_by_hand(gate, rows):
    got = gate_rows(Gate(**gate), SUCCESS, GROUP)
    assert got.tolist() == [bool(r) for r in rows]
    # the referee's rows, the gate's reference in its own file: the same hand numbers
    assert Gate(**gate).reference_rows(SUCCESS.tolist(), GROUP.tolist(), None) == [bool(r) for r in rows]


def test_entropy_quantile_gate_by_hand():
    # surprisal of each row = mean over its policy tokens of -log p: rows 0..3 -> 1, 2, 3, 4
    beh = -torch.tensor([[0.0, 1.0, 1.0], [0.0, 2.0, 2.0], [0.0, 3.0, 3.0], [0.0, 4.0, 0.0]])
    pol = torch.tensor([[False, True, True], [False, True, True], [False, True, True], [False, True, False]])
    s = row_surprisal(beh, pol)
    assert s.tolist() == [1.0, 2.0, 3.0, 4.0]
    ok = torch.tensor([True] * 4)
    grp = torch.arange(4)
    # torch.quantile with linear interpolation: q=0.5 over (1,2,3,4) is 2.5
    assert gate_rows(Gate(entropy_above_quantile=0.5), ok, grp, s).tolist() == [False, False, True, True]
    assert gate_rows(Gate(entropy_below_quantile=0.5), ok, grp, s).tolist() == [True, True, False, False]
    assert Gate(entropy_above_quantile=0.5).reference_rows([True] * 4, list(range(4)), [1.0, 2.0, 3.0, 4.0]) == \
        [False, False, True, True]
    assert Gate(entropy_below_quantile=0.75).reference_rows([True] * 4, list(range(4)), [1.0, 2.0, 3.0, 4.0]) == \
        [True, True, True, False]  # q = 0.75: 3.25


def test_gate_by_prompt_takes_each_rows_prompt():
    # rollouts of prompts 0 (one success of three) and 1 (none); the gated batch has one row per prompt
    prompt_index = torch.tensor([0, 0, 0, 1, 1, 1])
    rows = gate_by_prompt(Gate(group_success_at_most=0.0), SUCCESS, prompt_index, torch.tensor([0, 1]))
    assert rows.tolist() == [False, True]


def _batch(rows_mask=None) -> TrajectoryBatch:
    """Four rows [prompt, p1, p2, pad?] in two groups; rewards (1, 0) and (1, 0)."""
    P, O, D = CODE["prompt"], CODE["policy"], CODE["pad"]
    origin = torch.tensor([[P, O, O], [P, O, D], [P, O, O], [P, O, O]], dtype=torch.uint8)
    return TrajectoryBatch(tokens=torch.ones(4, 3, dtype=torch.long), origin=origin,
                           behavior_logprobs=torch.full((4, 3), -1.0), group=torch.tensor([0, 0, 1, 1]),
                           control=torch.ones(4, dtype=torch.bool), rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                           row_mask=rows_mask)


def test_gated_grpo_loss_and_normaliser_count_only_the_gated_rows():
    obj = Grpo(kl_coef=0.0)
    b = _batch(torch.tensor([True, False, True, False]))
    adv = obj.advantages(b)  # over whole groups: (r - mean) / (std + eps), std = sqrt(0.5)
    a = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert torch.allclose(adv, torch.tensor([a, -a, a, -a]))
    logp = torch.full((4, 3), -1.0)
    logp[:, 1] = -0.9  # ratio exp(0.1) on token 1 (clipped at 1.2 no: 1.105 < 1.2), 1 on token 2
    logp.requires_grad_(True)
    value, _ = obj.loss(b, PolicyView(logp), adv)
    # kept rows 0 and 2, both with advantage +a; their loss tokens: row 0 t1, t2; row 2 t1, t2 (4 tokens).
    # token-mean: -(1/4) sum rho_t a = -(a/4) (2 e^0.1 + 2)
    want = -(a / 4) * (2 * torch.exp(torch.tensor(0.1)) + 2)
    assert torch.allclose(value, want, atol=1e-6)
    assert float(obj.normalizer(b)) == 4.0  # the gated-out rows' 3 tokens do not count


def test_gated_cross_entropy_is_the_mean_over_the_gated_rows_only():
    P, Dm, D = CODE["prompt"], CODE["demonstration"], CODE["pad"]
    origin = torch.tensor([[P, Dm, Dm], [P, Dm, D]], dtype=torch.uint8)
    b = TrajectoryBatch(tokens=torch.ones(2, 3, dtype=torch.long), origin=origin,
                        behavior_logprobs=torch.zeros(2, 3), group=torch.tensor([0, 1]),
                        control=torch.ones(2, dtype=torch.bool), row_mask=torch.tensor([False, True]))
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -5.0, 0.0]])
    value, _ = CrossEntropy(loss_tokens=["demonstration"]).loss(b, PolicyView(logp))
    assert float(value) == 5.0  # row 1 only: -(-5) / 1


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


BASE = """
name: g
sources:
  verifier: {kind: outcome_reward}
  reference: {kind: reference_solution}
terms:
  - signal: {kind: reward, source: verifier}
    objective: {kind: grpo}
  - signal: {kind: sft, target: reference}
    objective: {kind: cross_entropy, loss_tokens: [demonstration]}
    gate: GATE
"""


def _errors(tmp_path, text):
    from composer.errors import SpecError

    try:
        validate_file(_write(tmp_path, text))
    except SpecError as e:
        return str(e)
    return ""


def test_a_row_fact_on_a_batch_the_signal_builds_is_refused_with_a_fix(tmp_path):
    err = _errors(tmp_path, BASE.replace("GATE", "{outcome: failure}"))
    assert "outcome test a rollout's own row" in err and "group_success_at_most" in err
    assert "terms[1].gate" in err or "terms.1.gate" in err


def test_an_empty_gate_and_a_gate_without_a_verifier_are_refused(tmp_path):
    assert "at least one condition" in _errors(tmp_path, BASE.replace("GATE", "{}"))
    text = BASE.replace("GATE", "{group_success_at_most: 0}").replace("  verifier: {kind: outcome_reward}\n", "")
    text = text.replace("signal: {kind: reward, source: verifier}", "signal: {kind: sft, target: reference}")
    text = text.replace("objective: {kind: grpo}", "objective: {kind: cross_entropy}")
    err = _errors(tmp_path, text)
    assert "no term of this segment samples rollouts" in err and "has none" in err


def test_a_gate_with_an_unknown_key_gets_did_you_mean(tmp_path):
    err = _errors(tmp_path, BASE.replace("GATE", "{outcom: failure}"))
    assert "outcom" in err and "outcome" in err


@pytest.mark.parametrize("spec", GATED)
def test_explain_states_each_gate(spec):
    from composer.plan.explain import text
    from composer.plan.compile import compile_plan

    v = validate_file(ROOT / spec)
    out = text(compile_plan(v))
    for t in v.spec.terms:
        if t.gate is not None:
            assert f"trains only on rows where {t.gate.describe()}" in out


def test_explain_says_a_sibling_is_never_the_row_itself():
    from composer.plan.compile import compile_plan

    plan = compile_plan(validate_file(ROOT / "specs/methods/srpo.yaml"))
    assert "never the row itself" in plan["sources"]["sibling"]["pi"]


def test_a_gate_through_the_openrlhf_plugin_matches_the_hand_numbers():
    """The advantage step computes the gate over the whole step and puts it into the labels; the loss of any
    split into micro-batches is the gated token mean: rows 0 and 3 succeed (A = +a), rows 1 and 2 are out.
    Current log-probs (.75, .25) against behaviour .5: rho = 1.5 (clipped to 1.2 for A > 0) and 0.5, so
    L = -(1/4) * 2 * (1.2 a + 0.5 a) = -0.85 a; the normaliser counts the 4 tokens of the gated rows only."""
    import math

    from test_openrlhf import POL, PR, Plan, _Tok, experience, gather, loss_over, plan_for, prepare_step

    lh = math.log(0.5)
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}},
                     "terms": [{"signal": {"kind": "reward", "source": "verifier"}, "objective": {"kind": "grpo", "kl_coef": 0},
                                "gate": {"outcome": "success"}}]})
    full = experience([[PR, POL, POL]] * 4, [[0.0, lh, lh]] * 4, ["a", "a", "b", "b"], rewards=[1.0, 0.0, 0.0, 1.0])
    step = [gather([full], [0, 1]), gather([full], [2, 3])]
    prepare_step(step, Plan(plan, [0]), {"teachers": {}, "reward_source": "verifier"}, _Tok(), None)
    assert [float(e.info["composer/norm0"][0]) for e in step] == [4.0, 4.0]
    a = 0.5 / (math.sqrt(0.5) + 1e-6)

    def logp(e):
        return torch.tensor([[math.log(0.75), math.log(0.25)]]).expand(e.action_mask.shape[0], 2)

    for micro in (step, [gather(step, [0, 2]), gather(step, [1, 3])], [gather(step, [0, 1, 2, 3])]):
        assert abs(float(loss_over(plan, {"ref": "initial"}, micro, logp, 4)) - (-0.85 * a)) < 1e-5


def test_truncated_rows_are_masked_in_the_openrlhf_loss_as_on_lightning():
    """rollout.filter.truncated: mask on OpenRLHF: the advantage step marks rows whose response does not end in
    EOS, and every term's loss and normaliser leave them out (the same composer/filters.py rule)."""
    import math

    from test_openrlhf import POL, PR, Plan, experience, gather, loss_over, plan_for, prepare_step

    lh = math.log(0.5)
    plan = plan_for({"sources": {"verifier": {"kind": "outcome_reward"}}, "rollout": {"filter": {"truncated": "mask"}},
                     "signal": {"kind": "reward", "source": "verifier"}, "objective": {"kind": "grpo", "kl_coef": 0}})
    full = experience([[PR, POL, POL]] * 4, [[0.0, lh, lh]] * 4, ["a", "a", "b", "b"], rewards=[1.0, 0.0, 0.0, 1.0])

    class Tok:
        pad_token_id = 0
        eos_token_id = int(full.sequences[0, -1])  # row 0 ends in EOS; the others end in other tokens

    assert [int(x) for x in full.sequences[:, -1]].count(Tok.eos_token_id) == 1
    step = [gather([full], [0, 1]), gather([full], [2, 3])]
    prepare_step(step, Plan(plan, [0]), {"teachers": {}, "reward_source": "verifier", "mask_truncated": True},
                 Tok(), None)
    assert [float(e.info["composer/norm0"][0]) for e in step] == [2.0, 2.0]  # row 0's two tokens only
    a = 0.5 / (math.sqrt(0.5) + 1e-6)

    def logp(e):
        return torch.tensor([[math.log(0.75), math.log(0.25)]]).expand(e.action_mask.shape[0], 2)

    # row 0 alone, A = +a: -(1/2)(1.2 a + 0.5 a) = -0.85 a
    assert abs(float(loss_over(plan, {"ref": "initial"}, step, logp, 4)) - (-0.85 * a)) < 1e-5


GATED_SFT = """name: gf
sources:
  verifier: {kind: outcome_reward}
  ref: {kind: reference_solution}
rollout: {filter: {equal_groups: drop%s}}
terms:
  - {signal: {kind: reward, source: verifier}, objective: {kind: grpo}}
  - %s
"""
SFT_TERM = "{signal: {kind: sft, target: ref}, objective: {kind: cross_entropy, loss_tokens: [demonstration]}, gate: %s}"
RL_TERM = "{name: second, signal: {kind: reward, source: verifier}, objective: {kind: grpo}, gate: %s}"


@pytest.mark.parametrize("term,warned", [
    (SFT_TERM % "{group_success_at_most: 0}", True),            # HPT's SFT branch: the groups the filter drops
    (RL_TERM % "{outcome: failure, sibling_success: false}", True),  # the same groups, row by row
    (RL_TERM % "{outcome: failure}", False),                    # failed rows of mixed groups: kept
    (SFT_TERM % "{group_success_at_most: 0.5}", False),
])
def test_a_gate_the_filter_empties_is_warned(tmp_path, term, warned):
    spec = tmp_path / "s.yaml"
    for cap, says in (("", "refill round(s) run out"), (", max_rounds: null", "trains on nothing")):
        spec.write_text(GATED_SFT % (cap, term))
        msgs = [d.message for d in validate_file(spec, []).warnings if d.rule == "gate_under_filter"]
        assert bool(msgs) == warned, msgs
        assert not warned or says in msgs[0]
    spec.write_text((GATED_SFT % ("", term)).replace("equal_groups: drop", "equal_groups: keep"))
    assert not [d for d in validate_file(spec, []).warnings if d.rule == "gate_under_filter"]
