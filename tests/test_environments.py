"""Rollout environments (issue 55): the tools environment's parsing and calculator, the episode program on a scripted
policy (turns cut at </tool_call>, the environment's tokens, the counts), environment tokens never trained, the
validation rules, and a real toy run of specs/methods/tool-grpo.yaml refereed by `composer check`.

Every expected number is worked out by hand in the comments: the toy tokenizer is one token per character."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.environments.tools import ToolEnvironment, calculate, parse_call, reference_calculate
from composer.episodes import answer_span, episode_row, facts
from composer.protocol import Generation, Sample, drive

ROOT = Path(__file__).resolve().parent.parent
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "(7+3-5+9)%10"}}</tool_call>'


# ------------------------------------------------------------------------------------------ parsing, calculator


def test_parse_call_well_formed_and_malformed():
    assert parse_call("no call here, #4") is None
    assert parse_call("x " + CALL) == ("calculator", {"expression": "(7+3-5+9)%10"}, None)
    name, args, why = parse_call('<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>')
    assert (name, args) == (None, None) and why == "malformed tool call (not JSON)"
    assert parse_call('<tool_call>["calculator"]</tool_call>')[2].startswith("malformed tool call (expected")
    assert parse_call('<tool_call>{"name": 3}</tool_call>')[2].startswith("malformed tool call (expected")
    assert parse_call('<tool_call>{"name": "c", "arguments": [1]}</tool_call>')[2].startswith("malformed")


CASES = [  # expression, the answer worked out by hand
    ("(7+3-5+9)%10", "4"),  # 14 % 10
    ("7/2", "3.5"), ("7//2", "3"), ("-7//2", "-4"), ("2**10", "1024"), ("-2**2", "-4"), ("2**-1", "0.5"),
    ("(1+2)*3-4", "5"), ("10%3", "1"), ("1.5*2", "3"), (" 3 ", "3"),
    ("1/0", "error: division by zero"), ("5%0", "error: division by zero"),
    ("2**65", "error: exponent above 64"), ("10**19", "error: number too large"),
    ("__import__('os')", "error: only numbers, + - * / // % ** and parentheses"),
    ("abs(3)", "error: only numbers, + - * / // % ** and parentheses"),
    ("1+", "error: not an arithmetic expression"), ("(1+2", "error: not an arithmetic expression"),
    ("1" * 201, "error: expression longer than 200 characters"),
]


@pytest.mark.parametrize("expr,want", CASES)
def test_calculator_by_hand_and_its_reference(expr, want):
    assert calculate(expr) == want
    assert reference_calculate(expr) == want  # the referee's parser, written apart, agrees


def test_tool_session_counts_calls_and_errors():
    env = ToolEnvironment()
    s = env.session()
    assert s.reset(None) == ""
    assert s.step("Q " + CALL) == ("4", None, False)
    assert s.step('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')[0] == \
        "error: unknown tool 'python' (tools: calculator)"  # declared tools only
    assert s.step("<tool_call>{oops}</tool_call>")[0] == "error: malformed tool call (not JSON)"
    assert s.step("#4") == ("", None, True)  # no call: the policy answered
    assert env.facts(s) == {"tool_calls": 3, "tool_errors": 2}


def test_python_tool_runs_in_the_sandbox():
    pytest.importorskip("components.tasks.code_verifier")
    from components.tasks.code_verifier import SandboxUnavailable, ensure_sandbox

    try:
        ensure_sandbox()
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")
    s = ToolEnvironment(tools=["python"]).session()
    call = {"name": "python", "arguments": {"code": "print(sum(range(5)))"}}
    assert s.step(f"<tool_call>{json.dumps(call)}</tool_call>") == ("10", None, False)  # 0+1+2+3+4
    call["arguments"]["code"] = "raise ValueError('no')"
    assert s.step(f"<tool_call>{json.dumps(call)}</tool_call>")[0] == "error: ValueError: no"


# ------------------------------------------------------------------------------------------ the episode program


class ScriptedCtx:
    """What episode_row reads of a run context: the toy tokenizer, plain prompts, a response budget."""

    def __init__(self, budget: int = 200):
        from components.tasks.tokenizer import char_tokenizer

        self.tokenizer = char_tokenizer()
        self.max_new_tokens = budget

    def prompt_ids(self, example):
        return self.encode(example.prompt)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_format(self):
        from composer.prompts import PromptFormat

        return PromptFormat("task")


def scripted(ctx, turns: list[str]):
    """A serve that answers the policy's k-th request with turns[k] (+ eos when it ends in '<eos>'), log-prob -0.5
    per token."""
    eos = ctx.tokenizer.eos_token_id
    said = []

    def serve(key, requests):
        out = []
        for r in requests:
            text = turns[len(said)]
            said.append(r.tokens)
            finished = text.endswith("<eos>")
            ids = ctx.encode(text.removesuffix("<eos>")) + ([eos] if finished else [])
            ids = ids[: r.max_tokens]
            out.append([Generation(ids, finished and len(ids) and ids[-1] == eos, [-0.5] * len(ids))])
        return out

    return serve, said


def example():
    from components.tasks.toy import make_example

    return make_example("7+3-5+9")


def test_episode_on_a_scripted_policy():
    ctx, env = ScriptedCtx(), ToolEnvironment(max_turns=4, max_env_tokens=64)
    # turn 1 writes the call and keeps going ("junk" is what a sampler writes after the stop string: dropped)
    serve, said = scripted(ctx, [CALL + "junk", "#4<eos>"])
    [trace] = drive([episode_row(ctx, example(), env)], serve)
    pieces = [(p.origin, ctx.tokenizer.decode(p.tokens)) for p in trace.pieces]
    assert pieces == [("policy", CALL), ("environment", "\n<tool_response>4</tool_response>\n"),
                      ("policy", "#4<eos>")]
    assert [len(p.logprobs) if p.logprobs is not None else None for p in trace.pieces] == [len(CALL), None, 3]
    # the second request continues exactly prompt + call + the environment's answer
    assert said[1] == ctx.encode("Q:7+3-5+9\nA:" + CALL + "\n<tool_response>4</tool_response>\n")
    n_env = len("\n<tool_response>4</tool_response>\n")  # 34 characters = tokens
    assert trace.notes["env"] == {"turns": 2, "env_tokens": n_env, "env_turns": 1, "ended": "answered",
                                  "rewards": [], "cut": False, "tool_calls": 1, "tool_errors": 0}


def test_episode_budgets_and_turns():
    ctx = ScriptedCtx()
    # max_turns 2: the second turn's call is never executed
    env = ToolEnvironment(max_turns=2, max_env_tokens=64)
    [t] = drive([episode_row(ctx, example(), env)], scripted(ctx, [CALL, CALL])[0])
    assert [p.origin for p in t.pieces] == ["policy", "environment", "policy"]
    assert t.notes["env"]["ended"] == "turns" and t.notes["env"]["tool_calls"] == 1
    # an answer that does not fit max_env_tokens (34 > 20) ends the episode with no environment token
    env = ToolEnvironment(max_env_tokens=20)
    [t] = drive([episode_row(ctx, example(), env)], scripted(ctx, [CALL])[0])
    assert [p.origin for p in t.pieces] == ["policy"] and t.notes["env"]["ended"] == "env_budget"
    # the policy's budget spans the episode: 100 tokens, the call takes len(CALL) = 90, the answer gets 10 (cut)
    ctx = ScriptedCtx(budget=100)
    [t] = drive([episode_row(ctx, example(), ToolEnvironment())], scripted(ctx, [CALL, "#4 and more text<eos>"])[0])
    assert len(CALL) == 90 and len(t.pieces[-1].tokens) == 10
    assert t.notes["env"]["ended"] == "budget"


def test_answer_span_and_facts():
    P, E = "policy", "environment"
    assert answer_span([P, P, P]) == (0, 3)  # no environment: the whole response
    assert answer_span([P, P, E, E, P, P]) == (4, 6)
    assert answer_span([P, E, P, E]) == (2, 3)  # ends on the environment: the turn before it
    notes = [{"env": {"turns": 2, "tool_calls": 1, "tool_errors": 0, "env_tokens": 33, "ended": "answered",
                      "rewards": [0.5]}},
             {"env": {"turns": 1, "tool_calls": 0, "tool_errors": 0, "env_tokens": 0, "ended": "answered",
                      "rewards": []}}]
    f = facts(notes)
    assert f["env/turns"] == 1.5 and f["env/tool_calls"] == 0.5 and f["env/env_tokens"] == 16.5
    assert f["env/turn_reward"] == 0.25 and f["env/ended_answered"] == 1.0
    assert facts([{}, {}]) == {}  # no episode: no env/* metric


def test_environment_tokens_get_no_loss_and_no_gradient():
    """A batch of two scripted episodes through assemble, the verifier's text, grpo's loss: the environment's
    positions get gradient 0 and carry no behaviour log-prob; the verifier reads '#4' (the final answer)."""
    import torch

    from components.objectives.grpo import Grpo
    from composer.batch import PolicyView
    from composer.origins import CODE
    from composer.trajectory import assemble, response_texts

    ctx = ScriptedCtx()
    env = ToolEnvironment()
    [a] = drive([episode_row(ctx, example(), env)], scripted(ctx, [CALL, "#4<eos>"])[0])
    [b] = drive([episode_row(ctx, example(), env)], scripted(ctx, ["#3<eos>"])[0])
    batch = assemble([a, b], [example(), example()], [0, 0], ctx.tokenizer.pad_token_id)
    envm = batch.origin == CODE["environment"]
    # "\n<tool_response>" 16 + "4" 1 + "</tool_response>\n" 17 = 34 environment tokens, none with a log-prob
    assert int(envm.sum()) == 34 and not bool(batch.known_mask[envm].any())
    assert response_texts(batch, ctx.tokenizer) == ["#4", "#3"]
    batch.rewards = torch.tensor([1.0, 0.0])
    obj = Grpo(kl_coef=0.0)
    lp = batch.behavior_logprobs.clone().requires_grad_(True)
    adv = obj.advantages(batch)
    loss, _m = obj.loss(batch, PolicyView(logprobs=lp), adv)
    (g,) = torch.autograd.grad(loss, lp)
    assert bool((g[envm] == 0).all()) and bool((g[batch.policy_mask] != 0).any())


def test_an_episode_is_truncated_only_when_its_policy_was_cut_mid_turn():
    """`truncated` (rollout.filter.truncated, the samples' flag, OpenRLHF's) for episodes: a row the environment
    ended, or whose last call the turn limit left unanswered, ends on no stop token and was not cut; one whose
    policy ran out of budget in the middle of a turn was. The implementation (notes), the OpenRLHF agent's flag and
    the referee's reading of the tokens alone agree; without the episode the stop-token rule would flag three."""
    from composer.backends.openrlhf.agent import truncated as agent_truncated
    from composer.filters import truncated_rows
    from composer.referee.checks import truncated as referee_truncated
    from composer.trajectory import assemble

    ctx = ScriptedCtx()
    stops = [ctx.tokenizer.eos_token_id]
    rows = [  # (environment, the policy's turns, cut?)
        (ToolEnvironment(), [CALL, "#4<eos>"], False),  # answered after a call
        (ToolEnvironment(max_turns=2), [CALL, CALL], False),  # the turn limit: the second call never answered
        (_Ending(), [CALL], False),  # the environment ended the episode on its answer
        (ToolEnvironment(max_env_tokens=20), [CALL], False),  # the answer did not fit max_env_tokens
    ]
    traces = [drive([episode_row(ctx, example(), env)], scripted(ctx, turns)[0])[0] for env, turns, _ in rows]
    short = ScriptedCtx(budget=100)  # the call takes 90, the answer gets 10 of its 20 tokens: cut mid-turn
    traces += drive([episode_row(short, example(), ToolEnvironment())], scripted(short, [CALL, "#4 and more text<eos>"])[0])
    want = [c for _e, _t, c in rows] + [True]
    assert [t.notes["env"]["ended"] for t in traces] == ["answered", "turns", "environment", "env_budget", "budget"]
    batch = assemble(traces, [example()] * len(traces), [0] * len(traces), ctx.tokenizer.pad_token_id)
    assert truncated_rows(batch, stops).tolist() == want
    assert [agent_truncated(t, stops) for t in traces] == want
    def decode(ids):
        return ctx.tokenizer.decode(ids, skip_special_tokens=True)

    assert referee_truncated(batch, stops[0], decode, ToolEnvironment().stop_strings()) == want
    assert referee_truncated(batch, stops[0]) == [False, True, True, True, True]  # the stop-token rule alone


class _Ending(ToolEnvironment):
    """The tools environment that ends the episode with its first answer."""

    def session(self):
        session = super().session()
        step = session.step

        def ending(text):
            answer, reward, _done = step(text)
            return answer, reward, True

        session.step = ending
        return session


# ------------------------------------------------------------------------------------------ validation


def _validate(text: str, tmp_path):
    from composer.checks.validate import validate_file

    p = tmp_path / "s.yaml"
    p.write_text(text)
    return validate_file(p, [])


BASE = """name: t
sources: {verifier: {kind: outcome_reward}}
rollout: {samples_per_prompt: 4, environment: {kind: tools}}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
"""


def _errors(tmp_path, text):
    from composer.errors import SpecError

    with pytest.raises(SpecError) as e:
        _validate(text, tmp_path)
    return str(e.value)


def test_validation_refuses_what_cannot_work(tmp_path):
    _validate(BASE, tmp_path)  # the base is fine
    msg = _errors(tmp_path, BASE.replace("{kind: grpo}", "{kind: grpo, loss_tokens: [policy, environment]}"))
    assert "the environment wrote them" in msg and "loss_tokens: [policy]" in msg
    msg = _errors(tmp_path, BASE.replace("{kind: tools}", "{kind: tools, tools: [calculater]}"))
    assert "unknown tool 'calculater'" in msg and "did you mean 'calculator'" in msg
    msg = _errors(tmp_path, BASE.replace("{kind: tools}", "{kind: toolz}"))
    assert "tools" in msg
    sft = """name: t
sources: {ref: {kind: reference_solution}}
rollout: {environment: {kind: tools}}
signal: {kind: sft, target: ref}
objective: {kind: cross_entropy, loss_tokens: [demonstration]}
"""
    msg = _errors(tmp_path, sft)
    assert "samples no rollouts" in msg and "no episode ever runs" in msg
    pope = BASE.replace("rollout: {samples_per_prompt: 4, environment: {kind: tools}}",
                        "sources: {verifier: {kind: outcome_reward}, ref: {kind: reference_solution}}\n"
                        "rollout: {samples_per_prompt: 4, environment: {kind: tools}, guide: {kind: prefix, "
                        "reference: ref}}").replace("sources: {verifier: {kind: outcome_reward}}\n", "", 1)
    msg = _errors(tmp_path, pope)
    assert "guide prefix" in msg and "do not compose" in msg


def test_openrlhf_maps_episodes(tmp_path):
    from composer.backends.openrlhf.flags import LACKS

    assert "episodes" not in LACKS  # issue 55 item 5: the agent function runs them (tests/test_openrlhf_episodes.py)


# ------------------------------------------------------------------------------------------ a real run, refereed


def test_tool_grpo_runs_and_passes_the_referee(tmp_path):
    """specs/methods/tool-grpo.yaml (toy:tools on the toy's tool task) for a short recorded run: the referee's episode
    checks hold (no environment token trained, each answer the declared calculator's, verdicts on the final answer),
    and the policy did call the tool."""
    from composer.referee import referee

    rep = referee(ROOT / "specs" / "methods" / "tool-grpo.yaml", tmp_path, [])
    assert rep.ok, "\n".join(rep.failures()) + "\n" + rep.table()
    assert rep.checks["environment tokens never trained"].passed > 0
    assert rep.checks["environment answers as declared"].passed > 0, rep.table()  # toy:tools called the calculator


def test_feedback_reads_the_environment_messages(tmp_path):
    """The feedback source's `detail: environment` text of a row: its environment turns decoded, one per line; a spec
    without an environment is refused."""
    from components.sources.feedback import environment_text
    from composer.trajectory import assemble

    ctx = ScriptedCtx()
    env = ToolEnvironment()
    [a] = drive([episode_row(ctx, example(), env)], scripted(ctx, [CALL, CALL, "#4<eos>"])[0])
    [b] = drive([episode_row(ctx, example(), env)], scripted(ctx, ["#3<eos>"])[0])
    batch = assemble([a, b], [example(), example()], [0, 0], ctx.tokenizer.pad_token_id)
    assert environment_text(ctx, batch, 0) == "<tool_response>4</tool_response>\n<tool_response>4</tool_response>"
    assert environment_text(ctx, batch, 1) is None  # never answered
    spec = BASE.replace("rollout: {samples_per_prompt: 4, environment: {kind: tools}}", "rollout: {samples_per_prompt: 4}")
    spec = spec.replace("sources: {verifier: {kind: outcome_reward}}",
                        "sources: {verifier: {kind: outcome_reward}, fb: {kind: feedback, from: verifier, "
                        "detail: environment}}")
    assert "it would never have a text" in _errors(tmp_path, spec)


QWEN_LIKE = (  # Qwen2.5's rendering of a tool message: a user turn holding <tool_response> lines
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_prompts_render_the_tool_message_with_the_template():
    """Under chat prompts the answer is what the template writes after the assistant's turn: its end of turn, the
    tool message as the template renders it (here Qwen2.5's user turn with <tool_response> lines), the next generation
    prompt; the episode then continues after it."""
    from composer.episodes import chat_suffix
    from composer.prompts import PromptFormat

    ctx = ScriptedCtx()
    ctx.tokenizer.chat_template = QWEN_LIKE
    want = "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert chat_suffix(ctx.tokenizer, "tool", "4") == want
    ctx.prompt_format = lambda: PromptFormat("chat", ctx.tokenizer)
    [t] = drive([episode_row(ctx, example(), ToolEnvironment())], scripted(ctx, [CALL, "#4<eos>"])[0])
    assert [(p.origin, ctx.tokenizer.decode(p.tokens)) for p in t.pieces] == [
        ("policy", CALL), ("environment", want), ("policy", "#4<eos>")]


def test_evaluation_runs_episodes_and_reads_the_final_answer():
    """Evaluation under an environment: each answer is an episode (the scripted policy calls the tool, then answers),
    and what the verifier gets is the final answer '#4<eos>' (finished)."""
    from composer.episodes import episode_generations

    ctx = ScriptedCtx()
    ctx.stop_ids = (ctx.tokenizer.eos_token_id,)
    serve, _said = scripted(ctx, [CALL, "#4<eos>"])

    def generate(prompts, cap):  # the scripted policy as `generate`
        return [g for [g] in serve(("sample",), [Sample(p, cap) for p in prompts])]

    [g] = episode_generations(ctx, ToolEnvironment(), [example()], 1, generate)
    assert ctx.tokenizer.decode(g.tokens) == "#4<eos>" and g.finished


def test_cut_at_stop_keeps_the_shortest_prefix_with_the_stop_string():
    """The turn is cut right after the token that completes '</tool_call>' (its log-probs kept with it); a turn without
    it is kept whole."""
    from composer.episodes import cut_at_stop

    ctx = ScriptedCtx()
    ids = ctx.encode("a</tool_call>bc")
    toks, lps, hit = cut_at_stop(ctx.decode, ids, list(range(len(ids))), ("</tool_call>",))
    assert ctx.decode(toks) == "a</tool_call>" and lps == list(range(13)) and hit  # 1 + 12 characters
    assert cut_at_stop(ctx.decode, ids[:5], None, ("</tool_call>",)) == (ids[:5], None, False)
    assert cut_at_stop(ctx.decode, ids, None, ()) == (ids, None, False)


def test_the_referee_catches_an_answer_the_environment_did_not_give(tmp_path):
    """The referee's replay of a recorded episode: the calculator's answer as the run wrote it passes; the same
    episode with its environment tokens saying 5 instead of 4 fails 'environment answers as declared'."""
    from types import SimpleNamespace

    from composer.origins import CODE
    from composer.referee.checks import Report
    from composer.referee.episodes import check_episodes
    from composer.trajectory import assemble

    v = _validate(BASE, tmp_path)
    ctx = ScriptedCtx()
    [t] = drive([episode_row(ctx, example(), ToolEnvironment())], scripted(ctx, [CALL, "#4<eos>"])[0])
    batch = assemble([t], [example()], [0], ctx.tokenizer.pad_token_id)
    events = [("rollout", {"batch": batch, "segment": v.segments[0].name, "step": 0})]
    rec = SimpleNamespace(tokenizer=ctx.tokenizer)
    rep = Report()
    check_episodes(rep, v, {}, rec, events, [])
    assert rep.ok, rep.table()
    four = ((batch.origin[0] == CODE["environment"]) & (batch.tokens[0] == ctx.encode("4")[0])).nonzero().flatten()
    assert len(four) == 1  # the answer's one digit
    batch.tokens[0, four[0]] = ctx.encode("5")[0]
    rep = Report()
    check_episodes(rep, v, {}, rec, events, [])
    assert [f.partition(":")[0] for f in rep.failures()] == ["environment answers as declared"]


def test_samples_show_the_environment():
    """`composer samples`: the environment's spans between << and >> (bold yellow on a terminal), and each episode's
    counts under the row."""
    from composer.runtime.samples import guide_lines, marked

    row = {"spans": [{"origin": "policy", "text": CALL}, {"origin": "environment", "text": "\n<tool_response>4"
                                                                                          "</tool_response>\n"},
                     {"origin": "policy", "text": "#4"}],
           "environment": {"turns": 2, "tool_calls": 1, "tool_errors": 0, "env_tokens": 34, "ended": "answered",
                           "rewards": []}}
    assert marked(row) == CALL + "<<\n<tool_response>4</tool_response>\n>>#4"
    assert guide_lines(row) == ["environment: env_tokens 34, tool_calls 1, tool_errors 0, turns 2; ended: answered"]
