"""Rollout guides on a fake deterministic engine: provenance, truncation, limits, judges, anchors.

The fake policy writes toy chains (components/tasks/toy.py) one line at a time from whatever lines
are already there (prompt prefix + response), getting the steps in `err` wrong (result + 1): after a
correction of step j it continues correctly. Prompts that show the reference ('R:...') are answered
without errors. Judge prompts ('J:...') are answered by `judge`. Every token it writes gets the
log-prob `lp_of(token)`.
"""

from __future__ import annotations

import math
import random
import textwrap

import pytest
import torch

from components.guides.judges import parse_correction, parse_verdict
from components.objectives.base import whole_batch_loss
from components.signals.sft import guided_targets
from components.objectives.advantage_regression import AdvantageRegression
from components.objectives.cross_entropy import CrossEntropy
from components.objectives.grpo import Grpo
from components.tasks import toy
from components.tasks.tokenizer import char_tokenizer
from composer.batch import PolicyView
from composer.origins import CODE
from composer.runtime.context import RunContext
from composer.runtime.engine import Generation
from composer.protocol import INITIAL
from composer.checks.validate import validate_file

TOK = char_tokenizer()
EOS = TOK.eos_token_id


def lp_of(tok: int) -> float:
    """The fake engine's behaviour log-prob of a token."""
    return -0.1 - 0.01 * (tok % 10)


class FakeEngine:
    name, exact_logprobs = "fake", True

    def __init__(self, err=(), judge=None):
        self.err = err if callable(err) else (lambda problem, _err=frozenset(err): _err)
        self.judge = judge
        self.calls = []  # (rows, max_new_tokens) of every generate call
        self.seen = []  # every prompt text, in order

    def respond(self, text: str) -> str:
        informed = text.startswith("R:")
        if informed:  # the reference's lines, then the question
            text = text[text.index("Q:"):]
        head, so_far = text.split("A:", 1)
        problem = head.split("\n")[0][2:]
        given = [ln[2:] if i == 0 else ln for i, ln in enumerate(head.split("\n")[1:]) if ln][: 99] \
            if "\nP:" in head else []
        *done, partial = so_far.split("\n")
        lines = given + done
        steps, _ = toy.solve(problem)
        try:
            acc = int(lines[-1].split("=")[-1].lstrip("#")) if lines else int(problem[0])
        except ValueError:
            acc = 0
        out = []
        for j in range(len(lines), len(steps)):
            op, b = problem[2 * j + 1], int(problem[2 * j + 2])
            new = ((acc + b) if op == "+" else (acc - b)) % 10
            new = (new + 1) % 10 if j in self.err(problem) and not informed else new
            out.append(f"{acc}{op}{b}={new}")
            acc = new
        if len(lines) <= len(steps) and not any(ln.startswith("#") for ln in lines):
            out.append(f"#{acc}")
        rest = "\n".join(out)
        return rest[len(partial):] if rest.startswith(partial) else rest

    def generate(self, prompts, max_new_tokens, sampling):
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        self.calls.append((len(prompts), max(budgets)))
        out = []
        for p, cap in zip(prompts, budgets):
            text = TOK.decode(p, skip_special_tokens=True)
            self.seen.append(text)
            judged = "\nJ:" in text or text.startswith("J:")
            reply = self.judge(text) if judged else self.respond(text)
            ids = (TOK.encode(reply, add_special_tokens=False) + [EOS])[:cap]
            out.append(Generation(ids, len(ids) < cap or ids[-1:] == [EOS], [lp_of(t) for t in ids]))
        return out

    def score(self, sequences, temperature=1.0):
        return [[0.0] + [lp_of(t) for t in s[1:]] for s in sequences]


def oracle_reply(text: str) -> str:
    """A perfect model judge: parses the toy judge prompt and answers toy.judge_target's verdict line."""
    text = text[text.index("J:"):]  # after any context lines
    head, rest = text.split("\nC:", 1)
    accepted, steps = rest.split("\nN:\n", 1)
    new = [ln.split(":", 1)[1] for ln in steps.removesuffix("\nV:").split("\n") if ln]
    acc = [a for a in accepted.split("\n") if a]
    return toy.judge_target(toy.make_example(head[2:]), acc, new).split("\n")[0]


SPEC = """
name: t
sources:
  verifier: {{kind: outcome_reward}}
  reference: {{kind: reference_solution}}
  judge: {judge}
rollout:
  samples_per_prompt: {n}
  max_new_tokens: {cap}
  guide: {guide}
signal: {{kind: reward, source: verifier}}
objective: {{kind: advantage_regression, beta1: .inf, baseline: {baseline}, loss_tokens: {loss}{extra}}}
"""


def make_ctx(tmp_path, guide: str, engine, n=4, cap=64, judge="{kind: oracle}", baseline="control", extra="",
             loss="[policy, guide_intervention]"):
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(SPEC.format(judge=judge, n=n, cap=cap, guide=guide, baseline=baseline,
                                                extra=extra, loss=loss)))
    spec = validate_file(path).segments[0].spec
    ctx = RunContext(task=toy.toy_task(), tokenizer=TOK, policy=torch.nn.Linear(1, 1), engine=engine, spec=spec,
                     rng=random.Random(0))
    # the frozen initial policy (POPE's search, `weights: initial` judges) is the same fake
    ctx.model_server = lambda model, _own=ctx.model_server: engine if model == INITIAL else _own(model)
    return ctx


def pieces(batch, b):
    """[(text, origin)] runs of row b's non-pad tokens."""
    out = []
    for t, o in zip(batch.tokens[b].tolist(), batch.origin[b].tolist()):
        if o == CODE["pad"]:
            continue
        ch = "<eos>" if t == EOS else TOK.decode([t])
        name = [k for k, v in CODE.items() if v == o][0]
        if out and out[-1][1] == name:
            out[-1] = (out[-1][0] + ch, name)
        else:
            out.append((ch, name))
    return out


CHUNK = '{kind: intervention, judge: judge, review: chunk, chunk_tokens: 12, step_split: "\\n", max_reviews: 4, max_correction_tokens: 8, control_samples: 2}'
EX = toy.make_example("1+2+3+4")  # 1+2=3 / 3+3=6 / 6+4=0 / #0


# --------------------------------------------------------------------------------- provenance


def test_chunk_provenance_exact(tmp_path):
    eng = FakeEngine(err={1})
    ctx = make_ctx(tmp_path, CHUNK, eng)
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    prompt = ("Q:1+2+3+4\nA:", "prompt")
    control = [prompt, ("1+2=3\n3+3=7\n7+4=1\n#1<eos>", "policy")]
    guided = [prompt, ("1+2=3\n", "policy"), ("3+3=6\n", "guide_intervention"), ("6+4=0\n#0<eos>", "policy")]
    assert [pieces(batch, b) for b in range(4)] == [control, control, guided, guided]
    assert batch.control.tolist() == [True, True, False, False]
    assert batch.guided.tolist() == [False, False, True, True]
    assert batch.group.tolist() == [0, 0, 0, 0]
    # behaviour log-probs: the policy's tokens carry the sampler's, and the guide's tokens, which the
    # default `behavior` anchor reads, are scored by the rollout weights
    resp = batch.response_mask
    assert bool(batch.known_mask[resp].all()) and (batch.origin == CODE["guide_intervention"]).any()
    assert torch.allclose(batch.behavior_logprobs[resp].double(), batch.tokens.double().apply_(lp_of)[resp])
    # a Const anchor reads none of the guide's: they are not scored, and marked unknown
    ctx = make_ctx(tmp_path, CHUNK, FakeEngine(err={1}), extra=", anchor: {guide_intervention: -0.2}")
    const = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    pol, inter = const.origin == CODE["policy"], const.origin == CODE["guide_intervention"]
    assert bool(const.known_mask[pol].all()) and inter.any() and not const.known_mask[inter].any()
    proxy, resp = batch, resp
    assert torch.allclose(proxy.behavior_logprobs[resp].double(), proxy.tokens.double().apply_(lp_of)[resp])
    # loss masks: advantage regression trains policy + intervention tokens, GRPO only the policy's
    ar, gr = ctx.spec.objective, Grpo(kl_coef=0)
    assert torch.equal(ar.loss_mask(batch), batch.response_mask)
    assert torch.equal(gr.loss_mask(batch), batch.origin == CODE["policy"])
    assert len(eng.calls) == 2  # two rounds, each one generate over all 4 rows
    assert all(rows == 4 for rows, _ in eng.calls)
    assert ctx.metrics["guide/revise_rate"] == pytest.approx(2 / 4)  # 2 reviews per guided row, 1 revise
    assert ctx.metrics["guide/reviews_per_traj"] == 2
    assert ctx.metrics["guide/correction_len"] == 6


def test_truncation_at_step_boundary_drops_the_rest_of_the_chunk(tmp_path):
    """A chunk holding 3 steps, the 2nd wrong: the 3rd (built on the error) is dropped with it."""
    guide = CHUNK.replace("chunk_tokens: 12", "chunk_tokens: 20")
    ctx = make_ctx(tmp_path, guide, FakeEngine(err={1}))
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    assert pieces(batch, 3)[1:] == [("1+2=3\n", "policy"), ("3+3=6\n", "guide_intervention"),
                                    ("6+4=0\n#0<eos>", "policy")]
    assert ctx.metrics["guide/dropped_tokens"] == pytest.approx(2 * 14 / 4)  # "3+3=7\n7+4=1\n#1" per guided row


def test_limits_hold(tmp_path):
    ex = toy.make_example("1+2+3+4+5+6")  # 6 steps
    guide = CHUNK.replace("max_reviews: 4", "max_reviews: 1").replace("max_correction_tokens: 8", "max_correction_tokens: 3")
    ctx = make_ctx(tmp_path, guide.replace("chunk_tokens: 12", "chunk_tokens: 6"), FakeEngine(err={0, 3}))
    batch = ctx.spec.rollout.guide.rollout(ctx, [ex], 4)
    for b in (2, 3):
        p = pieces(batch, b)
        assert [o for _t, o in p].count("guide_intervention") == 1  # max_reviews: 1
        assert p[1] == ("1+2", "guide_intervention")  # max_correction_tokens: 3 (of "1+2=3\n")
        # the policy finishes the cut step its own way; step 3 stays wrong: no review left
        assert p[2] == ("=4\n4+3=7\n7+4=1\n1+5=7\n7+6=3\n#3<eos>", "policy")
    # max_new_tokens holds for every row
    ctx = make_ctx(tmp_path, CHUNK, FakeEngine(err={1}), cap=10)
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    assert int(batch.response_mask.sum(1).max()) <= 10
    assert pieces(batch, 3)[1:] == [("1+2=3\n", "policy"), ("3+3=", "guide_intervention")]  # cut to the 4 tokens left


def test_control_rows_never_guided(tmp_path):
    ctx = make_ctx(tmp_path, CHUNK, FakeEngine(err={0, 1, 2}), n=6)
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX, toy.make_example("9-8+7")], 6)
    ctrl = batch.control
    assert ctrl.tolist() == ([True] * 2 + [False] * 4) * 2
    assert not (batch.guided & ctrl).any()
    assert not (batch.mask(("guide_intervention", "guide_prefix"))[ctrl]).any()
    assert batch.guided[~ctrl].all()
    assert batch.group.tolist() == [0] * 6 + [1] * 6


# --------------------------------------------------------------------------------- judges


def test_parse_verdict_and_correction_are_strict():
    assert parse_verdict("KEEP", 2).kind == "keep"
    d = parse_verdict("REVISE 2\nanything after the first line is ignored", 2)
    assert (d.kind, d.index) == ("revise", 1)
    for bad in ("", "keep", "KEEP KEEP", "REVISE 3\n1+1=2", "REVISE 0\nx", "REVISE x\n1", "REVISE -1", "REVISE 1 2"):
        assert parse_verdict(bad, 2).kind == "malformed", bad
    assert parse_correction(" 3+3=6\n6+4=0", "\n") == "3+3=6" and parse_correction("\n3+3=6", "\n") == ""


def test_malformed_model_judge_counts_as_keep(tmp_path):
    eng = FakeEngine(err={1}, judge=lambda text: "REVISE 7\n???")
    ctx = make_ctx(tmp_path, CHUNK, eng, judge="{kind: policy_model, model: self}")
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    assert not batch.guided.any() and not batch.mask(("guide_intervention",)).any()
    assert pieces(batch, 3)[1] == ("1+2=3\n3+3=7\n7+4=1\n#1<eos>", "policy")
    assert ctx.metrics["guide/malformed"] == 4  # 2 reviews x 2 guided rows, all acted on as KEEP
    assert ctx.metrics["guide/revise_rate"] == 0


def test_model_judge_sees_the_judge_template_and_revises(tmp_path):
    prompts = []
    eng = FakeEngine(err={1}, judge=lambda text: prompts.append(text) or oracle_reply(text))
    ctx = make_ctx(tmp_path, CHUNK, eng, judge="{kind: policy_model, model: self, context: [reference]}")
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    assert pieces(batch, 2)[2] == ("3+3=6\n", "guide_intervention")
    ref = "R:1+2=3\n3+3=6\n6+4=0\n#0\n"  # the declared context, on the toy's context line
    assert prompts[0] == ref + "J:1+2+3+4\nC:\nN:\n1:1+2=3\n2:3+3=7\nV:"
    assert prompts[2] == ref + "J:1+2+3+4\nC:1+2=3\n3+3=6\nN:\n1:6+4=0\n2:#0\nV:"
    assert ctx.costs["judge_tokens"] > 0
    # every call batched over the rows that ask the same model the same way: the first chunk of all 4
    # rows; the control rows' rest; the 2 verdicts; the 2 corrections (from the kept prefix); the guided
    # rows' next chunk; its 2 verdicts
    assert [rows for rows, _ in eng.calls] == [4, 2, 2, 2, 2, 2]
    # the correction continues the judge's context prompt and the kept step only: the rejected step
    # ("3+3=7") and what followed it are never shown
    corrections = [t for t in eng.seen if t.startswith("R:") and "J:" not in t]
    assert corrections == [ref + "Q:1+2+3+4\nA:1+2=3\n"] * 2


# --------------------------------------------------------------------------------- InT


END = '{kind: intervention, judge: judge, review: end, max_reviews: 1, step_split: "\\n", max_correction_tokens: 8, control_samples: 1}'


def test_end_review_rewrites_first_wrong_step_of_failed_rollouts(tmp_path):
    ok, bad = toy.make_example("1+2+3+4"), toy.make_example("5-1+2")
    eng = FakeEngine(err=lambda p: {1} if p == "5-1+2" else set())
    ctx = make_ctx(tmp_path, END, eng, n=2, baseline="all")
    batch = ctx.spec.rollout.guide.rollout(ctx, [ok, bad], 2)
    assert pieces(batch, 1)[1:] == [("1+2=3\n3+3=6\n6+4=0\n#0<eos>", "policy")]  # success: untouched
    assert pieces(batch, 2)[1:] == [("5-1=4\n4+2=7\n#7<eos>", "policy")]  # control: untouched
    assert pieces(batch, 3)[1:] == [("5-1=4\n", "policy"), ("4+2=6\n", "guide_intervention"), ("#6<eos>", "policy")]
    assert batch.guided.tolist() == [False, False, False, True]
    assert ctx.metrics["guide/reviews_per_traj"] == pytest.approx(1 / 2)  # one review among 2 eligible rows
    assert len(eng.calls) == 2  # sample everything, then continue the revised rows


def test_int_proposer_sees_the_numbered_attempt_and_samples_k_proposals(tmp_path):
    """InT's proposer (a model judge with review: end): one prompt with the whole failed attempt in numbered
    steps and the reference (whose last line is the answer); 4 sampled answers, each with its verification,
    'REVISE k' and the intervention; the rollout goes on from the first readable one, and all are noted."""
    ex = toy.make_example("5-1+2")  # 5-1=4 / 4+2=6 / #6
    replies = iter(["no idea", "Step 1 holds.\nREVISE 2\n4+2=6", "REVISE 1\n5-1=4", "KEEP"])
    prompts = []
    eng = FakeEngine(err={1}, judge=lambda text: prompts.append(text) or next(replies))
    guide = END.replace("control_samples: 1", "control_samples: 1, proposals: 4, proposal_tokens: 40")
    ctx = make_ctx(tmp_path, guide, eng, n=2, baseline="all", judge="{kind: policy_model, model: self, context: [reference]}")
    batch = ctx.spec.rollout.guide.rollout(ctx, [ex], 2)
    assert prompts == ["R:5-1=4\n4+2=6\n#6\nJ:5-1+2\nC:\nN:\n1:5-1=4\n2:4+2=7\n3:#7\nV:"] * 4
    assert (4, 40) in eng.calls  # one request for 4 sampled proposals
    assert pieces(batch, 0)[1:] == [("5-1=4\n4+2=7\n#7<eos>", "policy")]  # the control row
    assert pieces(batch, 1)[1:] == [("5-1=4\n", "policy"), ("4+2=6\n", "guide_intervention"), ("#6<eos>", "policy")]
    notes = batch.notes[1]
    assert [p["correction"] for p in notes["proposals"]] == ["4+2=6", "5-1=4"]
    assert [p["keep"] for p in notes["proposals"]] == [6, 0]
    assert TOK.decode(notes["attempt"]["tokens"]) == "5-1=4\n4+2=7\n#7<eos>"
    assert ctx.metrics["guide/malformed"] == 1  # "no idea"; KEEP is no proposal


def test_sft_targets_truncate_after_intervention_and_filter(tmp_path):
    ex = toy.make_example("5-1+2+3")  # 5-1=4 / 4+2=6 / 6+3=9 / #9
    eng = FakeEngine(err={1})
    ctx = make_ctx(tmp_path, END, eng, n=3, baseline="all")
    batch = ctx.spec.rollout.guide.rollout(ctx, [ex], 3)
    batch.info["temperature"] = 1.0
    out = guided_targets(ctx, batch, 2)
    assert out.size == 2 and ctx.metrics["sft_kept"] == 2
    for b in range(2):
        assert pieces(out, b) == [("Q:5-1+2+3\nA:", "prompt"), ("5-1=4\n", "policy"), ("4+2=6\n", "guide_intervention")]
    assert eng.calls[-1] == (4, ctx.max_new_tokens - 12)  # 2 candidates x 2 filter samples, one call
    loss, m = whole_batch_loss(CrossEntropy(loss_tokens=["policy", "guide_intervention"]), out, PolicyView(torch.full(out.tokens.shape, -0.5)))
    assert m["tokens"] == 24 and float(loss) == pytest.approx(0.5)
    # no continuation from the intervention succeeds: nothing kept, zero loss, no crash
    eng.err = lambda p: {1, 2}
    batch = ctx.spec.rollout.guide.rollout(ctx, [ex], 3)
    out = guided_targets(ctx, batch, 2)
    assert ctx.metrics["sft_kept"] == 0
    logits = torch.randn(*out.tokens.shape, len(TOK), requires_grad=True)
    lp = torch.log_softmax(logits, -1).gather(-1, out.tokens[..., None]).squeeze(-1)
    loss, _ = whole_batch_loss(CrossEntropy(loss_tokens=["policy", "guide_intervention"]), out, PolicyView(lp))
    loss.backward()
    assert float(loss.detach()) == 0 and float(logits.grad.abs().sum()) == 0


# --------------------------------------------------------------------------------- POPE


def pope(placement: str, search: str, frac=1.0, max_fraction=0.5):
    return (f"{{kind: prefix, reference: reference, placement: {placement}, max_fraction: {max_fraction}, "
            f"search: {search}, search_samples: 2, guided_fraction: {frac}}}")


def test_minimal_prefix_search_picks_the_shortest_solvable_prefix(tmp_path):
    ex = toy.make_example("1+2+3+4+5+6")  # 7 reference lines -> k in 0..3
    eng = FakeEngine(err={1})  # solved only when the prefix already holds step 1 (k >= 2)
    ctx = make_ctx(tmp_path, pope("prompt", "minimal"), eng, baseline="all", loss="[policy]")
    batch = ctx.spec.rollout.guide.rollout(ctx, [ex], 4)
    assert eng.calls[0] == (4 * 2, ctx.max_new_tokens)  # k = 0..3 x 2 samples in one call
    assert TOK.decode(batch.tokens[0][batch.origin[0] == CODE["prompt"]].tolist()) == "Q:1+2+3+4+5+6\nP:1+2=3\n3+3=6\nA:"
    assert pieces(batch, 0)[1] == ("6+4=0\n0+5=5\n5+6=1\n#1<eos>", "policy")
    assert ctx.metrics["guide/prefix_steps"] == 2 and ctx.metrics["guide/prefix_k2_frac"] == 1
    assert batch.guided.all() and not batch.control.any() and (batch.group == batch.group[0]).all()
    ctx.spec.rollout.guide.rollout(ctx, [ex], 4)  # cached: no new search
    assert len(eng.calls) == 3


def test_pope_groups_and_fixed_prefix(tmp_path):
    exs = [toy.make_example(p) for p in ("1+2+3+4+5+6", "2+2+2+2", "3-1-1-1", "4+4+4+4")]
    ctx = make_ctx(tmp_path, pope("prompt", "fixed", frac=0.5), FakeEngine(), baseline="all", loss="[policy]")
    batch = ctx.spec.rollout.guide.rollout(ctx, exs, 2)
    g = batch.guided.view(4, 2)[:, 0]
    assert 0 < int(g.sum()) < 4  # ctx.rng picked some prompts
    groups = batch.group.view(4, 2)
    assert (groups[:, 0] == groups[:, 1]).all() and len(set(groups[:, 0].tolist())) == 4  # one group per prompt
    assert torch.equal(batch.control, ~batch.guided)
    assert not batch.mask(("guide_prefix",)).any()  # placement prompt: all prefix tokens are prompt tokens


def test_pope_response_prefix_gets_no_gradient(tmp_path):
    ex = toy.make_example("1+2+3+4+5+6")
    ctx = make_ctx(tmp_path, pope("response", "fixed"), FakeEngine(err={4}), baseline="all", loss="[policy]")
    batch = ctx.spec.rollout.guide.rollout(ctx, [ex], 4)
    assert pieces(batch, 0)[1:] == [("1+2=3\n3+3=6\n6+4=0\n", "guide_prefix"), ("0+5=5\n5+6=2\n#2<eos>", "policy")]
    logits = torch.randn(*batch.tokens.shape, len(TOK), requires_grad=True)  # [B, T, V]
    lp = torch.log_softmax(logits, -1).gather(-1, batch.tokens[..., None]).squeeze(-1)  # [B, T]
    batch.behavior_logprobs = lp.detach()  # ratio 1: nothing clipped
    batch.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    loss, _ = whole_batch_loss(Grpo(kl_coef=0), batch, PolicyView(lp))
    loss.backward()
    gnorm = logits.grad.abs().sum(-1)  # [B, T]
    assert float(gnorm[batch.mask(("guide_prefix",))].sum()) == 0
    assert float(gnorm[batch.mask(("prompt",))].sum()) == 0
    assert float(gnorm[batch.origin == CODE["policy"]].min()) > 0


# --------------------------------------------------------------------------------- anchors


@pytest.mark.parametrize("anchor", [-0.2, "policy"])
def test_mintrl_anchor_losses_by_hand(tmp_path, anchor):
    """L = mean_i (beta2 * sum_t [log pi_theta - anchor_t] - (r_i - mean r_control))^2 on a guide-made batch."""
    ctx = make_ctx(tmp_path, CHUNK, FakeEngine(err={1}))
    batch = ctx.spec.rollout.guide.rollout(ctx, [EX], 4)
    batch.rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])  # control rows: 0 and 1 -> V_hat = 0.5
    gen = torch.Generator().manual_seed(0)
    cur = -torch.rand(batch.tokens.shape, generator=gen)  # [B, T] current policy log-probs
    beta2 = 0.1
    obj = AdvantageRegression(beta1=math.inf, beta2=beta2, baseline="control", anchor={"guide_intervention": anchor},
                              loss_tokens=["policy", "guide_intervention"])
    loss, _ = whole_batch_loss(obj, batch, PolicyView(cur))
    want = 0.0
    for b in range(4):
        s = 0.0
        for t in range(batch.tokens.shape[1]):
            o, tok = int(batch.origin[b, t]), int(batch.tokens[b, t])
            if o == CODE["policy"] or (o == CODE["guide_intervention"] and anchor == "policy"):
                s += float(cur[b, t]) - lp_of(tok)
            elif o == CODE["guide_intervention"]:
                s += float(cur[b, t]) - (-0.2)
        want += (beta2 * s - (float(batch.rewards[b]) - 0.5)) ** 2
    assert float(loss) == pytest.approx(want / 4, rel=1e-5)
