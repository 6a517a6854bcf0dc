"""Teachers (policy_model sources) and the distillation signal, on tiny random checkpoints.

Expected values are computed by hand: a direct forward pass on the teacher prompt for alignment,
explicit EMA arithmetic for `ema`.
"""

from __future__ import annotations

import pytest
import torch

from components.objectives.divergence import Divergence
from components.tasks import toy
from composer.batch import PolicyView
from composer.lang.loader import load_text
from composer.runtime.context import RunContext
from composer.runtime.models import load_model, load_tokenizer
from composer.runtime.models import policy_view
from components.objectives.base import whole_batch_loss
from composer.protocol import Trace
from composer.trajectory import assemble
from composer.checks.validate import validate_loaded

OPSD = """
name: t
sources:
  reference: {kind: reference_solution}
  teacher: {kind: policy_model, model: self, weights: WEIGHTS, context: [reference], temperature: 1.1}
rollout: {samples_per_prompt: 1, temperature: 1.1}
signal: {kind: distillation, teacher: teacher}
objective: {kind: divergence, measure: jsd, estimator: full}
"""

SDPO = """
name: t
sources:
  verifier: {kind: outcome_reward}
  sibling: {kind: sibling_success, from: verifier}
  feedback: {kind: feedback, from: verifier, detail: step}
  teacher: {kind: policy_model, model: self, weights: ema, ema_rate: 0.25, context: CONTEXT}
rollout: {samples_per_prompt: 3}
signal: {kind: distillation, teacher: teacher}
objective: {kind: divergence, measure: jsd, estimator: top_k, k: 5}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from components.tasks.bootstrap import tiny_random_checkpoint

    return tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def make_ctx(tiny: str, spec_text: str) -> RunContext:
    torch.manual_seed(0)
    spec = validate_loaded(load_text(spec_text)).spec
    tok = load_tokenizer(tiny)
    policy = load_model(tiny)
    return RunContext(task=toy.toy_task(eval_per_tier=2, train_per_tier=4), tokenizer=tok, policy=policy, engine=None,
                      spec=spec)


def make_batch(ctx, items, group=None):
    """items: (problem, response text) pairs; one row each, response tokens are 'policy' + eos."""
    traces, exs = [], []
    for problem, response in items:
        ex = toy.make_example(problem)
        trace = Trace(ctx.encode(ex.prompt))
        trace.add(ctx.encode(response) + [ctx.eos_id], "policy")
        traces.append(trace)
        exs.append(ex)
    # one advantage group per prompt index: rows given the same group share a prompt index
    return assemble(traces, exs, list(group) if group else list(range(len(items))), ctx.pad_id)


def wrong(problem: str) -> str:
    """The reference solution with the first step's result digit changed (and so a wrong answer)."""
    lines = toy.make_example(problem).solution.split("\n")
    bad = lines[0][:-1] + str((int(lines[0][-1]) + 1) % 10)
    return "\n".join([bad] + lines[1:-1] + ["#" + str((int(lines[-1][1:]) + 1) % 10)])


def nudge(policy, scale=0.05):
    """An optimiser-like in-place change of every parameter."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(scale * torch.randn_like(p))


def test_teacher_logprobs_align_with_the_student_response(tiny):
    ctx = make_ctx(tiny, OPSD.replace("WEIGHTS", "current"))
    problems = ["7+3-5", "2-9+1-4+8"]  # different prompt and response lengths: different shifts
    batch = make_batch(ctx, [(p, toy.make_example(p).solution) for p in problems])
    batch = ctx.spec.signal.apply(ctx, batch)
    assert batch.teacher_logits is not None  # estimator full wants logits
    for i, p in enumerate(problems):
        ex = toy.make_example(p)
        teacher_prompt = ctx.encode(f"R:{ex.solution}\nQ:{p}\nA:")  # the toy 'reference' template, by hand
        prompt, response = ctx.encode(ex.prompt), ctx.encode(ex.solution) + [ctx.eos_id]
        with torch.no_grad():
            logits = ctx.policy(input_ids=torch.tensor([teacher_prompt + response])).logits[0] / 1.1  # [L, V]
        logp = torch.log_softmax(logits, -1)
        Q, P = len(teacher_prompt), len(prompt)
        for j, tok in enumerate(response):
            # teacher predicts response[j] from position Q + j - 1; the student holds it at P + j
            assert batch.tokens[i, P + j] == tok
            assert torch.allclose(batch.teacher_logprobs[i, P + j], logp[Q + j - 1, tok], atol=1e-5)
            assert torch.allclose(batch.teacher_logits[i, P + j], logits[Q + j - 1], atol=1e-4)
        assert torch.all(batch.teacher_logprobs[i, :P] == 0)
        assert torch.all(batch.teacher_logprobs[i, P + len(response):] == 0)
    assert torch.all(batch.seq_weight == 1)
    assert {"teacher_kl_estimate", "teacher_student_gap", "no_signal_frac"} <= set(ctx.metrics)
    tiers = [e.tier for e in batch.examples]
    assert len(set(tiers)) == 2  # one row per tier: each tier's gap is its row's mean |log pi_beh - log pi_T|
    for i, tier in enumerate(tiers):
        m = batch.policy_mask[i]
        want = (batch.behavior_logprobs[i] - batch.teacher_logprobs[i])[m].abs().mean()
        assert ctx.metrics[f"teacher_student_gap/tier{tier}"] == pytest.approx(float(want), rel=1e-5)


def test_sampled_objective_gets_no_logits_and_no_context_uses_the_student_prompt(tiny, tmp_path):
    from components.tasks.bootstrap import tiny_random_checkpoint

    other = tiny_random_checkpoint(str(tmp_path / "t2"), layers=1, hidden=32)
    spec = f"""
name: t
sources: {{teacher: {{kind: policy_model, model: "{other}"}}}}
signal: {{kind: distillation, teacher: teacher}}
objective: {{kind: divergence, estimator: sampled}}
"""
    ctx = make_ctx(tiny, spec)
    batch = make_batch(ctx, [("1+2", "1+2=3\n#3"), ("4-5+6", "x")])
    batch = ctx.spec.signal.apply(ctx, batch)
    assert batch.teacher_logits is None
    teacher = ctx.source("teacher").net
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    with torch.no_grad():  # no context: the teacher scores the student's own sequence
        lp = torch.log_softmax(teacher(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits, -1)
    want = lp[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1) * batch.response_mask[:, 1:]
    assert torch.allclose(batch.teacher_logprobs[:, 1:], want, atol=1e-5)


def test_initial_teacher_stays_fixed_while_the_policy_moves(tiny):
    ctx = make_ctx(tiny, OPSD.replace("WEIGHTS", "initial"))
    batch = make_batch(ctx, [("3+4-1", toy.make_example("3+4-1").solution)])
    teacher = ctx.source("teacher")
    before, _, _ = teacher.score(ctx, batch)
    nudge(ctx.policy)
    teacher.after_optimizer_step(ctx)
    after, _, _ = teacher.score(ctx, batch)
    assert torch.equal(before, after)
    # the same source with the live weights does move
    ctx2 = make_ctx(tiny, OPSD.replace("WEIGHTS", "current"))
    live = ctx2.source("teacher")
    a, _, _ = live.score(ctx2, batch)
    nudge(ctx2.policy)
    b, _, _ = live.score(ctx2, batch)
    assert not torch.allclose(a, b)


def test_ema_teacher_follows_its_rate(tiny):
    ctx = make_ctx(tiny, SDPO.replace("CONTEXT", "[sibling, feedback]"))
    teacher = ctx.source("teacher")
    name = "model.layers.0.mlp.up_proj.weight"
    w = lambda m: dict(m.named_parameters())[name].detach().clone()
    theta0 = w(ctx.policy)
    assert torch.equal(w(teacher.net), theta0)  # starts at the initial weights
    nudge(ctx.policy)
    theta1 = w(ctx.policy)
    teacher.after_optimizer_step(ctx)
    assert torch.allclose(w(teacher.net), 0.75 * theta0 + 0.25 * theta1, atol=1e-7)
    nudge(ctx.policy)
    theta2 = w(ctx.policy)
    teacher.after_optimizer_step(ctx)
    expect = 0.75 * (0.75 * theta0 + 0.25 * theta1) + 0.25 * theta2  # = .5625 t0 + .1875 t1 + .25 t2
    assert torch.allclose(w(teacher.net), expect, atol=1e-7)
    # one element by hand
    k = (0, 0)
    hand = 0.5625 * float(theta0[k]) + 0.1875 * float(theta1[k]) + 0.25 * float(theta2[k])
    assert abs(float(w(teacher.net)[k]) - hand) < 1e-6
    # the distance metric and the checkpoint round trip
    with torch.no_grad():
        dist = sum(float(((a - b) ** 2).sum()) for a, b in zip(teacher.net.parameters(), ctx.policy.parameters())) ** 0.5
    assert abs(teacher.param_distance(ctx) - dist) < 1e-4 and dist > 0
    state = {k: v.clone() for k, v in teacher.state_dict()["ema"].items()}
    nudge(teacher.net)
    teacher.load_state_dict({"ema": state})
    assert torch.equal(w(teacher.net), state[name])


def test_sdpo_sibling_never_self_then_feedback_then_nothing(tiny):
    ctx = make_ctx(tiny, SDPO.replace("CONTEXT", "[sibling, feedback]"))
    p, q = "5+5-2", "8-1+3+3"
    right_p, right_q = toy.make_example(p).solution, toy.make_example(q).solution
    # group 0: one success and one failure; group 1: two successes, one failure
    batch = make_batch(ctx, [(p, right_p), (p, wrong(p)), (q, right_q), (q, wrong(q)), (q, right_q)],
                       group=[0, 0, 1, 1, 1])
    teacher = ctx.source("teacher")
    texts = [teacher.context_texts(ctx, batch, i) for i in range(batch.size)]
    assert texts[0] == {"sibling": None, "feedback": None}  # the only success: never paired with itself
    assert texts[1] == {"sibling": right_p, "feedback": None}  # a sibling exists: no feedback
    assert texts[2]["sibling"] == right_q and texts[4]["sibling"] == right_q  # each other's success
    assert texts[3] == {"sibling": right_q, "feedback": None}
    # a failed group: feedback from the step checker
    batch2 = make_batch(ctx, [(p, wrong(p)), (p, wrong(p))], group=[0, 0])
    fb = teacher.context_texts(ctx, batch2, 0)
    assert fb == {"sibling": None, "feedback": "the final answer is wrong; step 1 is wrong"}
    assert teacher.render(ctx, batch2.examples[0])(fb) == f"F:{fb['feedback']}\nQ:{p}\nA:"
    batch = ctx.spec.signal.apply(ctx, batch)
    assert batch.seq_weight.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert ctx.metrics["no_signal_frac"] == pytest.approx(0.2)
    assert ctx.metrics["ema_param_distance"] == 0.0


def test_sdpo_group_without_success_or_feedback_gets_zero_weight_and_zero_loss(tiny):
    ctx = make_ctx(tiny, SDPO.replace("CONTEXT", "[sibling]"))  # no feedback source
    p, q = "6-2+9", "1+1+1"
    batch = make_batch(ctx, [(p, wrong(p)), (p, wrong(p)), (q, toy.make_example(q).solution), (q, wrong(q))],
                       group=[0, 0, 1, 1])
    batch = ctx.spec.signal.apply(ctx, batch)
    assert batch.seq_weight.tolist() == [0.0, 0.0, 0.0, 1.0]  # failed group: nothing; row 2: no other success
    obj: Divergence = ctx.spec.objective
    view = policy_view(ctx.policy, batch, want_logits=True)
    loss, m = whole_batch_loss(obj, batch, view)
    assert m["no_signal_frac"] == 0.75
    loss.backward()
    # zero loss from the failed group: the loss of the weighted row alone is the same number
    only = batch.select([3])
    loss_only, _ = whole_batch_loss(obj, only, policy_view(ctx.policy, only, want_logits=True))
    assert torch.allclose(loss, loss_only, atol=1e-6)
    # and an all-failed batch without feedback gives exactly zero loss and zero gradient
    ctx.policy.zero_grad()
    dead = batch.select([0, 1])
    view = policy_view(ctx.policy, dead, want_logits=True)
    loss_dead, _ = whole_batch_loss(obj, dead, PolicyView(view.logprobs, view.logits, view.entropy))
    assert float(loss_dead.detach()) == 0.0
    loss_dead.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in ctx.policy.parameters())


SDPO_PLUS_AR = """
name: t
sources:
  verifier: {kind: outcome_reward}
  sibling: {kind: sibling_success, from: verifier}
  teacher: {kind: policy_model, model: self, weights: current, context: [sibling]}
rollout: {samples_per_prompt: 2, max_new_tokens: 8}
terms:
  - {name: distill, signal: {kind: distillation, teacher: teacher}, objective: {kind: divergence, estimator: full}}
  - {name: reward, signal: {kind: reward, source: verifier}, objective: {kind: advantage_regression, beta1: 1.0}}
"""


def test_terms_sharing_a_rollout_keep_their_own_weights_and_share_one_forward(tiny, monkeypatch):
    """The SDPO term's zero weights (no sibling success) must not silence the reward term on the same
    rollout; the two terms still cost one policy forward."""
    from composer import step
    from composer.plan.plan import spec_at
    from composer.runtime.engine import make_engine

    ctx = make_ctx(tiny, SDPO_PLUS_AR)
    ctx.models.engine = make_engine("hf", ctx.policy, ctx.tokenizer, ctx.spec.rollout)
    examples = [toy.make_example("6-2+9+4-1"), toy.make_example("1+8-3+2-7")]
    distill, reward = step.sample(ctx, spec_at(ctx.spec), examples)
    assert distill.tokens is reward.tokens  # one rollout
    assert distill.rewards is None and reward.teacher_logprobs is None  # each term's signal wrote its own view
    assert distill.seq_weight.tolist() == [0.0] * 4  # random model: nothing succeeds, no sibling, no signal
    assert reward.seq_weight is None
    nudge(ctx.policy)  # so that the regression term is not zero at the initial weights
    forwards = []
    real_view = policy_view
    total, m = step.loss(spec_at(ctx.spec), [distill, reward],
                         lambda b, want, read: forwards.append(1) or real_view(ctx.policy, b, want, read))
    assert len(forwards) == 1
    assert m["distill/loss"] == 0.0 and m["reward/loss"] > 0.0
    alone, _ = whole_batch_loss(ctx.spec.terms[1].objective, reward, real_view(ctx.policy, reward, False))
    assert m["reward/loss"] == pytest.approx(float(alone.detach()), rel=1e-6)
    assert float(total.detach()) == pytest.approx(m["reward/loss"], rel=1e-6)


def test_initial_policy_log_probs_are_computed_once_per_shared_rollout(tiny, monkeypatch):
    from composer import step
    from composer.plan.plan import spec_at
    from composer.runtime.engine import make_engine

    two_kl = SDPO_PLUS_AR.replace("objective: {kind: advantage_regression, beta1: 1.0}", "objective: {kind: grpo, kl_coef: 0.1}")
    ctx = make_ctx(tiny, two_kl + "  - {name: pg, signal: {kind: reward, source: verifier}, objective: {kind: grpo, kl_coef: 0.1}}\n")
    ctx.models.engine = make_engine("hf", ctx.policy, ctx.tokenizer, ctx.spec.rollout)
    calls = []
    real = ctx.initial_logprobs
    monkeypatch.setattr(ctx, "initial_logprobs", lambda b: calls.append(1) or real(b))
    _distill, reward, pg = step.sample(ctx, spec_at(ctx.spec), [toy.make_example("6-2+9+4-1")])
    assert len(calls) == 1 and reward.initial_logprobs is pg.initial_logprobs is not None


def test_feedback_is_none_for_successes(tiny):
    ctx = make_ctx(tiny, SDPO.replace("CONTEXT", "[sibling, feedback]"))
    p = "9-3-3"
    batch = make_batch(ctx, [(p, toy.make_example(p).solution), (p, "#0")], group=[0, 0])
    fb = ctx.source("feedback")
    assert fb.text(ctx, batch, 0) is None
    assert fb.text(ctx, batch, 1) == "the final answer is wrong; step 1 is wrong"


def test_non_toy_templates_follow_opsd_and_sdpo(tiny):
    from composer.data import Example, Task

    ctx = make_ctx(tiny, SDPO.replace("CONTEXT", "[sibling, feedback]"))
    ctx.data.task = Task(name="m", train=[], eval={}, verifier="exact")
    teacher = ctx.source("teacher")
    ex = Example(prompt="What is 2+2?", answer="4")
    got = teacher.render(ctx, ex)({"sibling": "It is \\boxed{4}", "feedback": None})
    assert got == "What is 2+2?\nCorrect solution:\n\nIt is \\boxed{4}\n\n\nCorrectly solve the original question."
    got = teacher.render(ctx, ex)({"sibling": None, "feedback": "wrong answer"})
    assert got == ("What is 2+2?\nThe following is feedback from your unsuccessful earlier attempt:\n\nwrong answer\n"
                   "\n\nCorrectly solve the original question.")
    ctx2 = make_ctx(tiny, OPSD.replace("WEIGHTS", "initial"))
    ctx2.data.task = ctx.task
    got = ctx2.source("teacher").render(ctx2, ex)({"reference": "2+2=4"})
    assert got.startswith("What is 2+2?\n\nHere is a reference solution to this problem:\n2+2=4\n\n\nAfter")
    assert got.endswith("put your final answer within \\boxed{}.")


def test_template_fields_are_checked_at_validation():
    from composer.errors import SpecError

    bad = OPSD.replace("WEIGHTS", "initial").replace("temperature: 1.1}", 'temperature: 1.1, template: "{problem} {solution}"}', 1)
    with pytest.raises(SpecError, match="solution"):
        validate_loaded(load_text(bad))
    good = OPSD.replace("WEIGHTS", "initial").replace("temperature: 1.1}", 'temperature: 1.1, template: "X:{reference}|{problem}"}', 1)
    validate_loaded(load_text(good))


def test_tokenizer_mismatch_fails_before_training_naming_both(tiny, tmp_path):
    from components.tasks.bootstrap import other_vocab_checkpoint
    from composer.backends.lightning.run import train

    other = other_vocab_checkpoint(str(tmp_path / "other"))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"""
name: t
policy: {{model: "{tiny}"}}
sources: {{teacher: {{kind: policy_model, model: "{other}"}}}}
signal: {{kind: distillation, teacher: teacher}}
objective: {{kind: divergence}}
train: {{steps: 2, prompts_per_step: 2, eval_every: 0, eval_samples: 2}}
""")
    from composer.runtime.models import ModelLoadError
    from composer.checks.validate import validate_file

    with pytest.raises(ModelLoadError) as e:  # the input's fault: a message and exit 2, not an internal error
        train(validate_file(spec), tmp_path / "run", progress=False)
    assert other in str(e.value) and tiny in str(e.value)
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    metrics = tmp_path / "run" / "metrics.csv"
    assert not metrics.exists() or "teacher_kl_estimate" not in metrics.read_text()
