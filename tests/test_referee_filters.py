"""The referee (composer check) on rollout filters and gates after them (issue 52): which prompts and rows the step's
rollout.filter keeps, recomputed by the filter's own `reference_rows` (composer/filters.py); a gate over the rows the
filter kept; a filter part that never acted is "not exercised"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer.filters import RolloutFilter
from composer.referee import referee

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "specs" / "grpo.yaml"

# GRPO with an entropy gate (the upper half of the step's rows by mean surprisal) and DAPO's dynamic sampling: on the
# toy's 6-step chains most prompts' rollouts all fail, so steps take several sampling rounds
GATED = """\
name: grpo_entropy_gate_filter
summary: GRPO on the high-surprisal half of the rows DAPO's filter keeps.
sources:
  verifier: {kind: outcome_reward}
rollout: {samples_per_prompt: 8, temperature: 1.0, filter: {equal_groups: drop}}
terms:
  - name: rl
    signal: {kind: reward, source: verifier}
    objective: {kind: grpo}
    gate: {entropy_above_quantile: 0.5}
train: {steps: 60, prompts_per_step: 8, lr: 1.0e-4}
"""
# some rows of a group cut at 27 tokens (the toy's 6-step answers are 27 tokens with EOS; at temperature 1.5 some run on)
SOME_CUT = ["rollout.filter.truncated=drop", "rollout.max_new_tokens=27", "rollout.temperature=1.5"]


def _failed(rep) -> dict:
    return {c.name: c.first for c in rep.checks.values() if c.failed}


def test_reference_rows_by_hand():
    """Two rounds of 2 prompts x 2 rows, prompts_per_step 2: round 0 keeps prompt 1 (rewards 0/1) and drops prompt 0
    (1/1); round 1 keeps prompt 0 (0/1), so the step is [round 0 prompt 1, round 1 prompt 0]; truncated: drop then
    removes row 1 of round 1 (cut), its group keeping one row; `mask` keeps it and masks it; when every row is cut,
    `drop` masks them all; with max_rounds 1 and round 1's prompts all-equal, the step tops up with the first
    dropped prompt (round 0's prompt 0)."""
    rewards = [[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    cut = [[False, False, False, False], [False, True, False, False]]
    flt = RolloutFilter(equal_groups="drop", truncated="drop")
    ref = flt.reference_rows(lambda k: rewards[k], cut, 2, 2)
    assert ref["rounds"] == 2 and ref["mixed"] == [1, 1] and ref["topped_up"] == 0 and ref["cut"] == 1
    assert ref["rows"] == [(0, 2), (0, 3), (1, 0)] and ref["prompt"] == [0, 0, 1] and all(ref["trained"])
    ref = RolloutFilter(equal_groups="drop", truncated="mask").reference_rows(lambda k: rewards[k], cut, 2, 2)
    assert ref["rows"] == [(0, 2), (0, 3), (1, 0), (1, 1)] and ref["trained"] == [True, True, True, False]
    every = [[True] * 4, [True] * 4]
    ref = flt.reference_rows(lambda k: rewards[k], every, 2, 2)
    assert len(ref["rows"]) == 4 and not any(ref["trained"])
    equal_later = [rewards[0], [1.0, 1.0, 0.0, 0.0]]
    ref = RolloutFilter(equal_groups="drop", max_rounds=1).reference_rows(lambda k: equal_later[k], cut, 2, 2)
    assert ref["rounds"] == 2 and ref["rows"] == [(0, 2), (0, 3), (0, 0), (0, 1)] and ref["topped_up"] == 1
    assert RolloutFilter(equal_groups="drop").reference_rows(lambda k: None, cut, 2, 2) is None


def test_entropy_gate_after_equal_groups_filter(tmp_path):
    """An entropy gate with `equal_groups: drop` ended `composer check` in a TypeError (the kept groups come from
    several sampling rounds, so no one recorded rollout held the trained rows, and the referee took the batch for one
    its signal built, with no surprisal): the gate is now recomputed over the rows the filter kept."""
    spec = tmp_path / "gated.yaml"
    spec.write_text(GATED)
    rep = referee(spec, tmp_path / "out")
    assert rep.ok, "\n".join(rep.failures()) + "\n" + rep.table()
    assert rep.checks["gate rows recomputed"].passed and rep.checks["filter rows recomputed"].passed
    assert rep.checks["filter rounds recomputed"].passed and rep.checks["filter equal_groups exercised"].passed


def test_entropy_gate_after_filter_catches_inverted_surprisal(tmp_path, monkeypatch):
    """The same run with the gate's surprisal negated (it trains the low-surprisal half) fails the gate's rows."""
    import composer.gates as gates

    real = gates.row_surprisal
    monkeypatch.setattr(gates, "row_surprisal", lambda lp, m: -real(lp, m))
    spec = tmp_path / "gated.yaml"
    spec.write_text(GATED)
    rep = referee(spec, tmp_path / "out")
    assert "gate rows recomputed" in _failed(rep), rep.table()


def test_truncated_drop_rows_recomputed(tmp_path):
    """`truncated: drop` with some rows of a group cut: the referee recomputes which rows the step keeps (the cut ones
    dropped, their groups keeping the others) and passes clean code, the filter exercised."""
    rep = referee(GRPO, tmp_path, SOME_CUT)
    assert rep.ok, "\n".join(rep.failures()) + "\n" + rep.table()
    assert rep.checks["filter rows recomputed"].passed and rep.checks["filter truncated exercised"].passed
    assert rep.checks["advantages recomputed"].passed and rep.checks["saw mixed groups"].passed


def test_truncated_drop_catches_a_wrong_row(tmp_path, monkeypatch):
    """A filter that also drops each step's first row (as if cut) fails the recomputation of the kept rows."""
    import composer.filters as filters

    real = filters.truncated_rows

    def first_row_too(batch, eos_id):
        out = real(batch, eos_id).clone()
        out[0] = True
        return out

    monkeypatch.setattr(filters, "truncated_rows", first_row_too)
    rep = referee(GRPO, tmp_path, SOME_CUT)
    assert "filter rows recomputed" in _failed(rep), rep.table()


def test_truncated_filter_not_exercised(tmp_path):
    """`truncated: drop` where no response is cut (the short run's 48 tokens fit the toy's answers): "not exercised",
    never a silent pass."""
    rep = referee(GRPO, tmp_path, ["rollout.filter.truncated=drop"])
    failed = _failed(rep)
    assert set(failed) == {"filter truncated exercised"}, rep.table()
    assert "not exercised" in failed["filter truncated exercised"]


def test_truncated_drop_of_every_row(tmp_path):
    """Every response cut (6-step chains only, whose answers are 27 tokens, at 26): `drop` masks them all (a step
    needs rows). The referee models it: no false "gate rows" or gradient failure; it fails because the filter left
    nothing to train on."""
    rep = referee(GRPO, tmp_path, ["rollout.filter.truncated=drop", "rollout.max_new_tokens=26",
                                   "data.train_tiers=[6]"])
    failed = _failed(rep)
    assert "filter kept rows" in failed and "no row to train on" in failed["filter kept rows"], rep.table()
    assert not any(name.startswith(("gate rows", "loss gradient", "loss value")) for name in failed), rep.table()


class _Guide:
    """Rows of `n` tokens each: [prompt id, sample j, round, 5 response tokens], the last EOS (1) unless cut."""

    def __init__(self, rng, cut_p):
        self.rng, self.cut_p, self.rounds = rng, cut_p, 0

    def rollout(self, ctx, examples, n):
        from composer.batch import TrajectoryBatch
        from composer.origins import CODE

        rows = len(examples) * n
        tokens = torch.randint(2, 50, (rows, 8), generator=self.rng)
        for i in range(rows):
            tokens[i, :3] = torch.tensor([100 + examples[i // n], 200 + i % n, 300 + self.rounds])
            if float(torch.rand(1, generator=self.rng)) >= self.cut_p:
                tokens[i, -1] = 1
        origin = torch.full((rows, 8), CODE["policy"], dtype=torch.uint8)
        origin[:, :3] = CODE["prompt"]
        idx = torch.arange(rows) // n
        first = torch.randint(0, 2, (rows,), generator=self.rng)  # a row's reward: mostly its prompt's first one's
        same = torch.rand(rows, generator=self.rng) < 0.8
        ctx.rewards.update({tuple(tokens[i].tolist()): float(first[i - i % n] if same[i] else first[i])
                            for i in range(rows)})
        ctx.rounds.append(tokens)
        self.rounds += 1
        return TrajectoryBatch(tokens=tokens, origin=origin, behavior_logprobs=torch.zeros(rows, 8), group=idx.clone(),
                               control=torch.ones(rows, dtype=torch.bool), examples=[examples[i] for i in idx.tolist()],
                               prompt_index=idx)


@pytest.mark.parametrize("seed", range(36))
def test_reference_rows_matches_filtered_rollout(seed):
    """The filter's `reference_rows` against the run's `filtered_rollout` on random rounds (random rewards, rows cut
    at random, each configuration of the filter): the same rows in the same order, and the same row mask."""
    from types import SimpleNamespace

    from composer import filters

    rng = torch.Generator().manual_seed(seed)
    eq = ["keep", "drop"][seed % 2]
    trunc = ["keep", "mask", "drop"][seed // 2 % 3]
    flt = RolloutFilter(equal_groups=eq, truncated=trunc, max_rounds=[None, 1, 2][seed // 6 % 3], source="v")
    n, P = 4, 3
    cut_p = [0.3, 1.0, 0.0, 0.6][seed // 6 % 4]
    guide = _Guide(rng, cut_p)
    src = SimpleNamespace(rewards=lambda ctx, b: torch.tensor([ctx.rewards[tuple(t.tolist())] for t in b.tokens]))
    counter = iter(range(P, 10_000))
    ctx = SimpleNamespace(spec=SimpleNamespace(rollout=SimpleNamespace(filter=flt, guide=guide)), costs={"policy_tokens": 0},
                          source=lambda name: src, next_prompts=lambda k: [next(counter) for _ in range(k)],
                          data=SimpleNamespace(world=1), pad_id=0, stop_ids=[1], log=lambda **kw: None, rewards={}, rounds=[])
    out, _examples = filters.filtered_rollout(ctx, list(range(P)), n)
    cut = [[int(t[-1]) != 1 for t in r] for r in ctx.rounds]
    ref = flt.reference_rows(lambda k: [ctx.rewards[tuple(t.tolist())] for t in ctx.rounds[k]], cut, n, P)
    assert ref["rounds"] == len(ctx.rounds)
    assert [tuple(ctx.rounds[k][i].tolist()) for k, i in ref["rows"]] == [tuple(t.tolist()) for t in out.tokens]
    mask = [True] * out.size if out.row_mask is None else out.row_mask.tolist()
    assert ref["trained"] == mask
    groups = out.group.tolist()
    assert all((groups[a] == groups[b]) == (ref["prompt"][a] == ref["prompt"][b])
               for a in range(out.size) for b in range(out.size))
