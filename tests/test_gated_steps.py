"""One real training step of each new spec (SRPO, HPT, KDRL's mask, DAPO), recomputed by hand from what ran.

The policy is a tiny random checkpoint on the toy testbed's prompts, so that the steps are fast; its answers
are never right, so the verifier is replaced by a rule that makes groups mixed: reward 1 when the response
text has an even number of characters. Everything else is the real run (rollout, signals, gates, filters,
losses); a recorder receives each term's batch, the policy's view and the loss value it produced.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer.data import Verdict
from composer.origins import CODE
from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
FAST = ["train.prompts_per_step=3", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=10",
        "train.eval_every=0", "train.eval_samples=2", "train.checkpoint_every=1000", "train.samples_every=0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> str:
    """A second tiny checkpoint with other random weights: a teacher that disagrees with the policy."""
    from components.tasks.bootstrap import tiny_random_checkpoint

    torch.manual_seed(1234)
    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("other")))


def parity(text: str, example) -> Verdict:
    return Verdict(float(len(text) % 2 == 0))


def run(spec: str, tmp_path, overrides, monkeypatch) -> list[dict]:
    """Train `spec` with the parity verifier; the recorder's term_loss and rollout events."""
    from composer.backends.lightning.run import train
    from composer.runtime.context import RunContext

    monkeypatch.setattr(RunContext, "verifier", lambda self, name: parity)
    events = []
    v = validate_file(ROOT / spec, overrides + FAST)
    train(v, tmp_path / "run", progress=False, recorder=lambda kind, **d: events.append({"kind": kind, **d}))
    return events


def losses(events, step: int) -> dict[str, dict]:
    return {e["term"]: e for e in events if e["kind"] == "term_loss" and e["step"] == step}


def hand_success(texts) -> torch.Tensor:
    return torch.tensor([len(t) % 2 == 0 for t in texts])


def groups_of(group: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        out.setdefault(g, []).append(i)
    return out


def hand_grpo(b, logp, adv_rows, clip_low, clip_high, kl_coef, rows) -> torch.Tensor:
    """-(1/N) sum_{i in rows, t policy} min(rho A_i, clip(rho, 1-lo, 1+hi) A_i) + kl_coef (1/N) sum k3,
    token-mean over the policy tokens of the gated rows (N of them), rho = exp(logp - beh)."""
    num, kl, n = 0.0, 0.0, 0
    for i in rows:
        for t in range(b.tokens.shape[1]):
            if b.origin[i, t] != CODE["policy"]:
                continue
            rho = float(torch.exp(logp[i, t] - b.behavior_logprobs[i, t]))
            a = adv_rows[i]
            num += min(rho * a, min(max(rho, 1 - clip_low), 1 + clip_high) * a)
            if kl_coef:
                d = float(logp[i, t] - b.initial_logprobs[i, t])
                kl += float(torch.exp(torch.tensor(-d))) + d - 1
            n += 1
    return torch.tensor((-num + kl_coef * kl) / max(n, 1))


def hand_advantages(rewards: list[float], group: torch.Tensor, std_norm: bool = True) -> list[float]:
    """A_i = (r_i - mean_g) / (std_g + 1e-6), unbiased std; 0 in an all-equal group."""
    out = [0.0] * len(rewards)
    for rows in groups_of(group).values():
        r = [rewards[i] for i in rows]
        m = sum(r) / len(r)
        if max(r) == min(r):
            continue
        sd = (sum((x - m) ** 2 for x in r) / (len(r) - 1)) ** 0.5
        for i in rows:
            out[i] = (rewards[i] - m) / (sd + 1e-6) if std_norm else rewards[i] - m
    return out


def test_srpo_routes_successes_to_grpo_and_failures_with_a_sibling_to_distillation(tiny, tmp_path, monkeypatch):
    events = run("specs/methods/srpo.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=1"], monkeypatch)
    t = losses(events, 0)
    rl, dist = t["rl"], t["distill"]
    b = rl["batch"]
    ok = b.rewards >= 0.5
    # which rows each gate took: rl = successes; distill = failures with another success in the group
    sib = torch.tensor([any(ok[j] for j in groups_of(b.group)[int(b.group[i])] if j != i) for i in range(b.size)])
    assert b.row_mask.tolist() == ok.tolist()
    assert dist["batch"].row_mask.tolist() == ((~ok) & sib).tolist()
    assert 0 < int(ok.sum()) < b.size, "the parity verifier should give mixed groups"
    import csv

    row = next(r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r.get("loss"))
    assert float(row["rl/gate_frac"]) == pytest.approx(float(ok.float().mean()))  # each term logs its fraction
    assert float(row["distill/gate_frac"]) == pytest.approx(float(((~ok) & sib).float().mean()))
    # the GRPO loss by hand over the successful rows only (defaults: clip 0.2, kl 0.001 k3, token-mean)
    adv = hand_advantages(b.rewards.tolist(), b.group)
    want = hand_grpo(b, rl["view"].logprobs.detach(), adv, 0.2, 0.2, 0.001, ok.nonzero().flatten().tolist())
    assert torch.allclose(rl["loss"].detach().float(), want.float(), atol=1e-5)
    # the distillation term equals the same objective on its gated rows alone (its normaliser counts only them)
    rows = dist["batch"].row_mask.nonzero().flatten().tolist()
    if rows:
        from composer.batch import PolicyView

        sub = dist["batch"].select(rows)
        sub.row_mask = None
        v = dist["view"]
        value, _ = dist["objective"].loss(sub, PolicyView(v.logprobs[rows], v.logits[rows]), None)
        assert torch.allclose(dist["loss"].detach(), value.detach(), atol=1e-5)


def test_hpt_trains_sft_where_no_rollout_succeeded_and_grpo_elsewhere(tiny, tmp_path, monkeypatch):
    events = run("specs/methods/hpt.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=1"], monkeypatch)
    t = losses(events, 0)
    rl, sft = t["rl"], t["sft"]
    b = rl["batch"]
    ok = b.rewards >= 0.5
    rate = {p: float(ok[b.prompt_index == p].float().mean()) for p in set(b.prompt_index.tolist())}
    assert b.row_mask.tolist() == [rate[int(p)] > 0 for p in b.prompt_index]
    s = sft["batch"]
    assert s.row_mask.tolist() == [rate[int(p)] == 0 for p in s.prompt_index]
    # SFT by hand: -(1/N) sum of log pi over the demonstration tokens of the gated prompts' rows
    logp = sft["view"].logprobs.detach()
    toks = [(i, t) for i in range(s.size) if s.row_mask[i] for t in range(s.tokens.shape[1]) if s.origin[i, t] == CODE["demonstration"]]
    want = -sum(float(logp[i, t]) for i, t in toks) / max(len(toks), 1) if toks else 0.0
    assert abs(float(sft["loss"]) - want) < 1e-5
    adv = hand_advantages(b.rewards.tolist(), b.group)
    want_rl = hand_grpo(b, rl["view"].logprobs.detach(), adv, 0.2, 0.2, 0.0, b.row_mask.nonzero().flatten().tolist())
    assert torch.allclose(rl["loss"].detach().float(), want_rl.float(), atol=1e-5)


def test_kdrl_mask_distils_only_rollouts_the_reward_did_not_credit(tiny, other, tmp_path, monkeypatch):
    events = run("specs/methods/kdrl-mask.yaml", tmp_path,
                 [f"policy.model={tiny}", f"sources.teacher.model={other}", "train.steps=1"], monkeypatch)
    t = losses(events, 0)
    rl, kd = t["rl"], t["kd"]
    ok = rl["batch"].rewards >= 0.5
    b = kd["batch"]
    assert 0 < int(ok.sum()) < b.size, "the parity verifier should give mixed rewards"
    assert rl["batch"].row_mask is None and b.row_mask.tolist() == (~ok).tolist()
    # sampled reverse KL by hand: l_t = -exp(logp - beh) * (-(beh - teacher)), token-mean over failed rows
    logp = kd["view"].logprobs.detach()
    num, n = 0.0, 0
    for i in range(b.size):
        for tt in range(b.tokens.shape[1]):
            if b.row_mask[i] and b.origin[i, tt] == CODE["policy"]:
                beh, te = float(b.behavior_logprobs[i, tt]), float(b.teacher_logprobs[i, tt])
                num += -float(torch.exp(logp[i, tt] - beh)) * (-(beh - te))
                n += 1
    assert abs(float(kd["loss"]) - num / max(n, 1)) < 1e-5
    assert kd["weight"] == 0.1
    assert (b.behavior_logprobs - b.teacher_logprobs)[b.policy_mask].abs().max() > 1e-3  # a teacher that disagrees


def test_dapo_dynamic_sampling_keeps_only_mixed_prompts_and_counts_the_extra_cost(tiny, tmp_path, monkeypatch):
    events = run("specs/methods/dapo.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=2", "train.mini_batches=1",
                                                       "rollout.filter.max_rounds=20"], monkeypatch)
    import csv

    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    for step in (0, 1):
        e = losses(events, step)["term0"]
        b = e["batch"]
        # the step holds its declared prompts, none of them all-equal in the verifier's reward
        assert sorted(set(b.prompt_index.tolist())) == [0, 1, 2]
        verifier = hand_success(b.info["texts"]).float()  # the parity rule on the decoded responses
        for p in range(3):
            r = verifier[b.prompt_index == p]
            assert r.min() != r.max(), f"prompt {p} kept with all-equal rewards"
        # shaped reward = verifier + overlong penalty: buffer 4 before max_new_tokens 10, -(|o| - 6) / 4 clamped
        lengths = b.response_mask.sum(-1).float()
        pen = -(lengths - 6).clamp(min=0, max=4) / 4
        assert torch.allclose(b.rewards, verifier + pen)
    by_step = {int(r["step"]): r for r in rows if r.get("loss")}
    extra = [float(by_step[s]["filter/extra_prompts"]) for s in (0, 1)]
    kept = [float(by_step[s]["filter/kept_frac"]) for s in (0, 1)]
    assert all(0 < k <= 1 for k in kept)
    # extra prompts sampled are counted cumulatively in the cost columns
    assert float(by_step[1]["cost/filter_extra_prompts"]) == sum(extra)
    if sum(extra):
        assert float(by_step[1]["cost/filter_extra_tokens"]) > 0
    assert "reward/verifier" in by_step[0] and "reward/overlong" in by_step[0]


def test_two_distillation_terms_log_their_teacher_gaps_each(tiny, other, tmp_path, monkeypatch):
    """Each term's teacher_kl_estimate under its own name; no top-level value that is only the last term's."""
    import csv

    spec = tmp_path / "two.yaml"
    spec.write_text(f"""
name: two-teachers
sources:
  a: {{kind: policy_model, model: {tiny}}}
  b: {{kind: policy_model, model: {other}}}
terms:
  - {{name: near, signal: {{kind: distillation, teacher: a}}, objective: {{kind: divergence}}}}
  - {{name: far, signal: {{kind: distillation, teacher: b}}, objective: {{kind: divergence}}}}
train: {{steps: 1}}
""")
    from composer.backends.lightning.run import train

    train(validate_file(spec, [f"policy.model={tiny}"] + FAST), tmp_path / "run", progress=False)
    row = next(r for r in csv.DictReader(open(tmp_path / "run" / "metrics.csv")) if r.get("loss"))
    near, far = float(row["near/teacher_kl_estimate"]), float(row["far/teacher_kl_estimate"])
    assert abs(near) < 1e-4 < abs(far)  # the policy is its own teacher 'a'; 'b' has other weights
    assert not row.get("teacher_kl_estimate")


def test_gkd_mixes_reference_sequences_and_rollouts_with_an_exact_jsd(tiny, other, tmp_path, monkeypatch):
    """lambda 0.5 per prompt: each prompt keeps its rollouts or gets its reference solution (+ EOS) as one row of
    demonstration tokens; the loss is the token mean of JSD_0.5(teacher, student) over the full vocabulary,
    weighted min(pi/pi_beh, 2) on the policy's tokens and 1 on the reference's."""
    events = run("specs/methods/gkd.yaml", tmp_path, [f"policy.model={tiny}", f"sources.teacher.model={other}",
                                                      "train.steps=2", "train.prompts_per_step=6"], monkeypatch)
    import math

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    seen_off = seen_on = 0
    for step in (0, 1):
        e = losses(events, step)["term0"]
        b, v = e["batch"], e["view"]
        demo = b.mask(["demonstration"])
        for i in range(b.size):
            if demo[i].any():  # an off-policy row: exactly the reference solution and EOS
                seen_off += 1
                assert not b.policy_mask[i].any()
                ids = b.tokens[i][demo[i]].tolist()
                assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == b.examples[i].solution
            else:
                seen_on += 1
        num, n = 0.0, 0
        for i in range(b.size):
            for t in range(b.tokens.shape[1]):
                if not (b.policy_mask[i, t] or demo[i, t]):
                    continue
                ls = torch.log_softmax(v.logits[i, t].detach().double(), -1)
                lt = torch.log_softmax(b.teacher_logits[i, t].double(), -1)
                lm = torch.log(0.5 * ls.exp() + 0.5 * lt.exp())
                jsd = 0.5 * float((lt.exp() * (lt - lm)).sum()) + 0.5 * float((ls.exp() * (ls - lm)).sum())
                w = 1.0 if demo[i, t] else min(math.exp(float(v.logprobs[i, t] - b.behavior_logprobs[i, t])), 2.0)
                num += w * jsd
                n += 1
        assert abs(float(e["loss"]) - num / n) < 1e-4
    assert seen_off and seen_on, "lambda 0.5 over 12 prompts should give both kinds of rows"


def test_prefixrl_samples_each_prompts_prefix_length_from_an_accepted_teacher_trace(tiny, other, tmp_path, monkeypatch):
    """Guided rows start with the first k tokens of the teacher's first accepted trace (parity verifier), as
    guide_prefix tokens with no loss; k = kmin + floor(u (kmax - kmin + 1)) with u from the hash of (prompt,
    step, seed, 'k'), kmin = ceil(0 n) = 0, kmax = min(floor(0.75 n), n - 1), n the trace's token count."""
    import hashlib
    import math

    from transformers import AutoTokenizer

    events = run("specs/methods/prefixrl.yaml", tmp_path, [f"policy.model={tiny}", f"sources.teacher.model={other}",
                                                           "train.steps=1", "rollout.guide.guided_fraction=1.0",
                                                           "rollout.max_new_tokens=12"], monkeypatch)
    tok = AutoTokenizer.from_pretrained(tiny)
    e = losses(events, 0)["term0"]
    b = e["batch"]
    pre = b.mask(["guide_prefix"])
    rollout = next(x for x in events if x["kind"] == "rollout")
    guided = 0
    for i, tr in enumerate(rollout["traces"]):
        k = tr.notes["prefix_steps"]
        n = tr.notes["ref_steps"]
        if n == 0:  # no trace accepted for this prompt: unguided
            assert k == 0 and not pre[i].any()
            continue
        kmax = max(0, min(math.floor(0.75 * n), n - 1))
        key = f"{b.examples[i].prompt}|0|0|k".encode()
        u = int(hashlib.sha256(key).hexdigest()[:8], 16) / 16 ** 8
        assert k == min(int(u * (kmax + 1)), kmax)
        assert int(pre[i].sum()) == k
        guided += k > 0
        ids = b.tokens[i][pre[i]].tolist()
        assert ids == tr.pieces[0].tokens and tok.decode(ids)  # the trace's first k tokens, as guide_prefix
    assert guided, "some prompt should have an accepted trace and a non-empty prefix"
    mask = e["objective"].loss_mask(b)
    assert not (mask & pre).any()  # prefix tokens get no loss


def test_truncated_responses_are_masked_on_lightning(tiny, tmp_path, monkeypatch):
    """rollout.filter.truncated: mask: a row whose last response token is not EOS gets no loss."""
    from transformers import AutoTokenizer

    events = run("specs/grpo.yaml", tmp_path, [f"policy.model={tiny}", "train.steps=1", "rollout.filter.truncated=mask",
                                               "rollout.max_new_tokens=6"], monkeypatch)
    eos = AutoTokenizer.from_pretrained(tiny).eos_token_id
    b = losses(events, 0)["term0"]["batch"]
    last = [b.tokens[i][b.response_mask[i]].tolist()[-1] for i in range(b.size)]
    assert b.row_mask.tolist() == [t == eos for t in last]
    assert not b.row_mask.all()  # 6 tokens of a random model: most responses are cut
