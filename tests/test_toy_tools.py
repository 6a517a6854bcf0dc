"""The toy testbed's tool task (issue 55, item 4): chains whose answer a calculator call gives, and toy:tools, the
student taught to call it now and then, built only when a spec names it."""

import json
import random

import pytest

from components.tasks import bootstrap, toy

EPISODE = ('<tool_call>{"name": "calculator", "arguments": {"expression": "(7+3-5+9)%10"}}</tool_call>'
           "\n<tool_response>4</tool_response>\n#4")


def test_tool_demonstration_is_the_convention():
    """Written out by hand: the policy's call (Hermes JSON between the tags), the environment's line, then '#N'."""
    demo = toy.tool_demonstration("7+3-5+9")
    assert [o for o, _ in demo] == ["policy", "environment", "policy"]
    assert "".join(t for _, t in demo) == EPISODE
    assert demo[0][1].endswith("</tool_call>") and demo[1][1] == "\n<tool_response>4</tool_response>\n"
    name, args = toy.parse_tool_call(demo[0][1])
    assert (name, args) == ("calculator", {"expression": "(7+3-5+9)%10"})
    assert toy.calculate(args["expression"]) == "4" == toy.make_example("7+3-5+9").answer


@pytest.mark.parametrize("tier", [1, 3, 6, 8])
def test_every_demonstration_parses_and_evaluates_to_the_answer(tier):
    """On eval chains of each tier: the call's JSON names the calculator, its expression evaluates (Python's own %,
    and the environment's calculator) to the verifier's answer, the policy's last line is that answer."""
    from components.tasks.verifiers import toy_verifier

    for ex in toy.make_examples(tier, 40, 0, "eval", "tools"):
        (_, call), (_, env), (_, last) = toy.tool_demonstration(ex.problem)
        body = json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert body == {"name": "calculator", "arguments": {"expression": f"({ex.problem})%10"}}
        assert str(eval(body["arguments"]["expression"], {"__builtins__": {}})) == ex.answer  # noqa: S307 (ours)
        assert toy.calculate(body["arguments"]["expression"]) == ex.answer
        assert env == f"\n<tool_response>{ex.answer}</tool_response>\n" and last == f"#{ex.answer}"
        assert toy_verifier(call + env + last, ex).reward == 1.0


def test_the_environments_calculator_agrees():
    """components/environments/tools.py (the rollout's tool environment) answers the demonstration's call with the
    text the demonstration holds."""
    tools = pytest.importorskip("components.environments.tools")
    for ex in toy.make_examples(8, 20, 0, "eval", "tools"):
        (_, call), (_, env), _ = toy.tool_demonstration(ex.problem)
        name, args, problem = tools.parse_call(call)
        assert (name, problem) == ("calculator", None)
        assert tools.calculate(args["expression"]) == ex.answer
        assert env == f"\n<tool_response>{tools.calculate(args['expression'])}</tool_response>\n"


def test_calculator_refuses_what_is_not_arithmetic():
    assert toy.calculate("(9-3)%10") == "6" and toy.calculate("(0-7)%10") == "3" and toy.calculate("-2*3") == "-6"
    for bad in ("__import__('os')", "2**3", "1/0", "x+1", "(1+", "1%0", "9" * 300):
        with pytest.raises(ValueError):
            toy.calculate(bad)
    assert toy.parse_tool_call("<tool_call>not json</tool_call>") is None
    assert toy.parse_tool_call('<tool_call>{"name": "calculator"}') is None  # never closed
    assert toy.parse_tool_call('#4') is None


def test_tools_task_examples_and_split_are_deterministic():
    """The tool task draws the chains task's problems (same seeds, same split), prompted with the calculator."""
    a = toy.make_examples(6, 30, 3, "train", "tools")
    assert [x.problem for x in a] == [x.problem for x in toy.make_examples(6, 30, 3, "train", "tools")]
    assert [x.problem for x in a] == [x.problem for x in toy.make_examples(6, 30, 3, "train")]
    assert all(x.prompt == f"Tools: calculator\nQ:{x.problem}\nA:" for x in a)
    assert toy.make_example("7+3-5+9", "tools").prompt == "Tools: calculator\nQ:7+3-5+9\nA:"
    task = toy.toy_task(tiers=(6, 8), train_tiers=(6, 7, 8), eval_per_tier=16, train_per_tier=8, task="tools")
    evals = {x.problem for xs in task.eval.values() for x in xs}
    sampled = task.sample_train(random.Random(0), 200)
    assert evals.isdisjoint({x.problem for x in task.train + sampled})
    assert all(x.prompt.startswith("Tools: calculator\nQ:") for x in task.train + sampled)
    assert all(toy.split_of(x.problem) == "train" for x in sampled) and {x.tier for x in sampled} == {6, 7, 8}


def test_tools_task_fields():
    task = toy.toy_task(task="tools")
    plain = toy.toy_task()
    assert task.templates["question"] == "Tools: calculator\nQ:{problem}\nA:"  # teachers see the tool announced too
    assert plain.templates["question"] == "Q:{problem}\nA:" and "tools" not in plain.templates
    # the budget holds the longest episode of the longest tier, eos included
    longest = "9" + "+9" * 8
    assert task.max_new_tokens >= len("".join(t for _, t in toy.tool_demonstration(longest))) + 1
    assert toy.max_new_tokens_for(8, "tools") > toy.max_new_tokens_for(8) == plain.max_new_tokens
    with pytest.raises(ValueError, match="toy tasks are chains, tools"):
        toy.toy_task(task="tool")


def test_write_jsonl_of_the_tool_task(tmp_path):
    paths = toy.write_jsonl(str(tmp_path), {"tiers": (6,), "eval_per_tier": 3, "train_per_tier": 2, "task": "tools"})
    rows = [json.loads(x) for x in open(paths["eval_6"])]
    assert rows[0]["prompt"] == f"Tools: calculator\nQ:{rows[0]['problem']}\nA:"


# -------------------------------------------------------------------------------------------- toy:tools's SFT


def test_demonstrations_train_the_policy_and_never_the_environment():
    """segment_tensors: labels are the ids of the policy's pieces (the call, '#N', eos) and -100 over the prompt and
    the environment's text."""
    from components.tasks.tokenizer import char_tokenizer

    tok = char_tokenizer()
    prompt = "Tools: calculator\nQ:7+3-5+9\nA:"
    pieces = [(prompt, False)] + [(t, o == "policy") for o, t in toy.tool_demonstration("7+3-5+9")]
    ids, lab = bootstrap.segment_tensors([pieces, [("Q:1+2\nA:", False), ("1+2=3\n#3", True)]], tok)
    call, env = toy.tool_demonstration("7+3-5+9")[0][1], toy.tool_demonstration("7+3-5+9")[1][1]
    n = len(prompt + EPISODE) + 1
    assert tok.decode(ids[0, : n - 1]) == prompt + EPISODE and int(ids[0, n - 1]) == tok.eos_token_id
    trained = [i for i in range(ids.shape[1]) if lab[0, i] != -100]
    p, c, e = len(prompt), len(call), len(env)
    assert trained == list(range(p, p + c)) + list(range(p + c + e, n))  # the call, '#4' and eos
    assert tok.decode(lab[0, p + c + e : n - 1]) == "#4" and all(lab[0, p + c : p + c + e] == -100)
    assert (lab[1] != -100).sum() == len("1+2=3\n#3") + 1


def test_the_mixture_calls_the_tool_in_its_share():
    """tools_example: deterministic in its seed. Call demonstrations train the call and '#N', never the environment's
    text, and their first token (the decision to call) in a share q such that, among the tools prompt's trained
    decisions (a call's first token or a solution's), a call is TOOLS_SFT['call']: 0.2 x 0.3 / (0.8 x 0.5) = 0.15
    with the shipped batch shares. Without a call, long chains get the student's own attempt, short ones the
    reference; the plain prompt never gets a call."""
    recipe = bootstrap.TOOLS_SFT
    assert recipe["call"] == 0.2 and recipe["batches"]["call"] == 0.5 and recipe["batches"]["tools"] == 0.3
    own = {toy.random_problem(random.Random(t), t, "train"): f"attempt {t}" for t in (5, 6, 7, 8)}

    def draw(kind, seed, n=3000):
        return [bootstrap.tools_example(random.Random(f"{seed}/{i}"), recipe, own, kind) for i in range(n)]

    calls = draw("call", 1)
    assert calls == draw("call", 1) and calls != draw("call", 2)
    decided = sum(e[1][1] for e in calls) / len(calls)
    assert abs(decided - 0.15) < 0.03
    share = decided * 0.5 / (decided * 0.5 + 0.3)
    assert abs(share - recipe["call"]) < 0.02
    # the decisions are spread over the tiers as the solutions are; half of the other calls copy a long chain
    long = lambda es: sum(len(e[0][0].split("Q:")[1]) > 12 for e in es) / len(es)  # noqa: E731 (5-8 steps)
    assert abs(long([e for e in calls if e[1][1]]) - 0.5) < 0.07
    assert abs(long([e for e in calls if not e[1][1]]) - 0.75) < 0.04
    for e in calls:
        assert e[0][0].startswith("Tools: calculator\nQ:") and e[1][0] == "<"
        assert [trained for _, trained in e][2:] == [True, False, True] and e[3][0].startswith("\n<tool_response>")
        problem = e[0][0].split("Q:")[1].removesuffix("\nA:")
        assert "".join(t for t, _ in e[1:]) == "".join(t for _, t in toy.tool_demonstration(problem))
    for kind, head in (("tools", "Tools: calculator\nQ:"), ("plain", "Q:")):
        for e in draw(kind, 3, 400):
            assert e[0][0].startswith(head) and [t for _, t in e] == [False, True]
            problem = e[0][0].split("Q:")[1].removesuffix("\nA:")
            assert e[1][0] == (own[problem] if len(problem) > 9 else toy.make_example(problem).solution)
    assert not any("<tool_call>" in t for e in draw("formats", 4, 200) for t, _ in e)


def test_episodes_run_the_way_the_environment_runs_them():
    """tool_episodes on a stand-in policy that writes the demonstration (and, after its call, text the environment
    would have cut): the episode is the call, the calculator's answer and the policy's last turn."""

    class Scripted:
        def __init__(self, texts):
            self.texts = texts

    exs = toy.make_examples(6, 3, 0, "eval", "tools")
    turns = {ex.prompt: toy.tool_demonstration(ex.problem)[0][1] + "garbage after the stop" for ex in exs}
    turns[exs[2].prompt] = toy.make_example(exs[2].problem).solution  # no call: the plain answer
    answers = {ex.prompt + "".join(t for _, t in toy.tool_demonstration(ex.problem)[:2]): f"#{ex.answer}" for ex in exs}

    def fake_sample(model, tok, prompts, max_new_tokens, temperature=1.0, batch=128):
        return [turns.get(p) or answers[p] for p in prompts]

    mp = pytest.MonkeyPatch()
    mp.setattr(bootstrap, "sample", fake_sample)
    try:
        eps = bootstrap.tool_episodes(None, None, exs)
    finally:
        mp.undo()
    assert [e["called"] for e in eps] == [True, True, False] and [e["correct_call"] for e in eps] == [True, True, False]
    assert eps[0]["text"] == "".join(t for _, t in toy.tool_demonstration(exs[0].problem))
    assert [e["reward"] for e in eps] == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------- the checkpoint


def test_toy_tools_is_built_only_when_named(tmp_path, monkeypatch):
    """The default cache key and what a run that never names toy:tools waits for do not change: with the student,
    the teacher and the tokenizer in the cache, ensure_checkpoints() builds nothing; resolving `toy:tools` asks for it
    (tools=True), and a cache that lacks it gains it then, beside what it has."""
    from composer.runtime import models

    for d in ("tokenizer", "student", "teacher"):
        (tmp_path / d).mkdir()
    monkeypatch.setattr(bootstrap, "train_tools", lambda *a: pytest.fail("toy:tools built without being named"))
    paths = bootstrap.ensure_checkpoints(str(tmp_path))
    assert paths["tools"] == str(tmp_path / bootstrap.TOOLS_DIR) and not (tmp_path / bootstrap.TOOLS_DIR).exists()
    assert bootstrap.cache_key() == "toy-v2"
    asked = []
    monkeypatch.setattr("composer.registry.part", lambda name: (lambda **kw: asked.append(kw) or paths))
    assert models.resolve("toy:tools") == paths["tools"] and asked == [{"tools": True}]
    assert models.resolve("toy:student") == paths["student"] and asked[-1] == {}


def test_a_cache_gains_toy_tools_when_asked(tmp_path, monkeypatch):
    """ensure_checkpoints(tools=True) on a cache with the student trains toy:tools from it (stubbed) and saves it
    into TOOLS_DIR, the other folders untouched."""
    from components.tasks.bootstrap import tiny_random_checkpoint

    tiny_random_checkpoint(str(tmp_path / "student"), layers=1, hidden=32)
    tiny_random_checkpoint(str(tmp_path / "tokenizer"), layers=1, hidden=32)
    (tmp_path / "teacher").mkdir()
    built = []
    monkeypatch.setattr(bootstrap, "train_tools", lambda tok, student: built.append(student) or student)
    paths = bootstrap.ensure_checkpoints(str(tmp_path), tools=True)
    assert len(built) == 1 and (tmp_path / bootstrap.TOOLS_DIR / "config.json").exists()
    assert list((tmp_path / "teacher").iterdir()) == []
    bootstrap.ensure_checkpoints(str(tmp_path), tools=True)
    assert len(built) == 1 and paths["tools"] == str(tmp_path / bootstrap.TOOLS_DIR)


def test_a_spec_names_the_tool_task(tmp_path):
    """data.toy_task: tools validates and binds the tool task's prompts; a typo is refused; with a data file it is
    refused as inert (the prompts come from the file)."""
    from composer.checks.validate import validate_file
    from composer.errors import SpecError
    from composer.lang.spec import Data
    from composer.runtime.binding import bind_task

    assert Data().toy_task == "chains" and Data(toy_task="tools").toy_task == "tools"
    with pytest.raises(Exception, match="chains|tools"):
        Data(toy_task="tool")
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\nsources: {verifier: {kind: outcome_reward}}\nsignal: {kind: reward, source: verifier}\n"
                    "objective: {kind: grpo}\ntrain: {steps: 2, eval_samples: 2}\n")
    checked = validate_file(spec, ["data.toy_task=tools", "data.train_tiers=[6,8]"])
    task = bind_task(checked.spec)
    assert all(x.prompt.startswith("Tools: calculator\nQ:") for x in task.train) and task.max_new_tokens > 100
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(SpecError) as e:
        validate_file(spec, [f"data.train={rows}", "data.toy_task=tools"])
    assert "data_settings" in {d.rule for d in e.value.diagnostics} and "toy testbed's task" in str(e.value)


@pytest.mark.slow
def test_toy_tools_calls_the_tool_sometimes_and_a_call_solves_long_chains():
    """The built checkpoint (2-3 minutes the first time): without tools it fails long chains as the student does;
    sampled at temperature 1 under the tools prompt it calls the calculator in some of its episodes (the recipe aims
    at 10-30%), and an episode with a right call ends with the right answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = bootstrap.ensure_checkpoints(tools=True)
    model, tok = AutoModelForCausalLM.from_pretrained(paths["tools"]), AutoTokenizer.from_pretrained(paths["tools"])
    r = bootstrap.tool_report(model, tok, n=32, samples=4)
    assert r["greedy_plain"] < 0.5 and r["greedy_tools_prompt"] < 0.5
    assert 0.05 <= r["tool_call_rate"] <= 0.4, r
    assert r["correct_call_rate"] >= 0.8 * r["tool_call_rate"], r
    assert r["pass_correct_call"] >= 0.9 and r["pass_correct_call"] > r["pass_no_call"] + 0.3, r
