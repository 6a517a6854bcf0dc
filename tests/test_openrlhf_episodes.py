"""Episodes on the OpenRLHF backend (issue 55, item 5): rollout.environment through OpenRLHF's agent function.

The bundle's agent.py runs composer/episodes.py's program with the spec's own environment part (the same code as on
Lightning). Checked here: tool-grpo compiles for OpenRLHF onto the agent (no reward function), with a context that
holds the environment's tokens; and the agent, loaded by OpenRLHF 0.11.2's own `_load_agent_executor` from the
bundle (an `AgentExecutorBase` subclass, the bundle's copy of the composer on the path, as in a vLLM engine actor),
runs episodes against a scripted stand-in for the vLLM engine (no GPU here: the engine is the one thing replaced;
it answers the agent's token-in/token-out `generate` calls with fixed turns). Its result goes through OpenRLHF's
own `SamplesGenerator._process_response_into_experience` (the Experience the trainer gets: action_mask from the
agent's action_ranges) and OpenRLHF's own `PolicyLoss`: environment tokens have action_mask 0 and no gradient, the
policy's tokens have both; the reward is the toy verifier's over the final answer plus the per-turn rewards times
turn_reward_weight; env/* counts reach extra_logs. The real-job tier (tests/test_openrlhf_real.py) runs tool-grpo
and the plugin environment `retry` as real OpenRLHF jobs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer.checks.validate import validate_file

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "tests" / "openrlhf_cpu_stubs"
PLUGIN_SRC = ROOT / "examples" / "custom_component" / "src"
HAVE = all(importlib.util.find_spec(m) is not None for m in ("openrlhf", "ray", "deepspeed"))
needs_openrlhf = pytest.mark.skipif(not HAVE, reason="needs openrlhf==0.11.2 (--no-deps), ray and deepspeed")


def compile_spec(spec: str, overrides: list[str], out: Path, plugins: bool = False) -> Path:
    from composer import registry
    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout

    if plugins:
        sys.path.insert(0, str(PLUGIN_SRC))
        registry.allow_spec_plugins(True)
    try:
        v = validate_file(ROOT / spec, overrides)
        compile_bundle(v, out, Layout(nodes=1, gpus_per_node=1, cluster_dir=str(out.parent / "cluster")))
    finally:
        if plugins:
            registry.allow_spec_plugins(None)
            sys.path.remove(str(PLUGIN_SRC))
    return out


def argv(bundle: Path) -> list[str]:
    return json.loads((bundle / "plan.json").read_text())["openrlhf"]["runs"][0]["argv"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@needs_openrlhf
def test_tool_grpo_compiles_onto_the_agent(tmp_path):
    """tool-grpo compiles (no refusal): the run uses agent.py (--train.agent_func_path; no reward function, the agent
    returns the reward), its args pass OpenRLHF's own parser, the README says how episodes run, and data.max_len (what
    OpenRLHF cuts every sequence at) grows by exactly the environment's max_env_tokens (64 against 16: 48 more)."""
    from composer.backends.openrlhf import parser

    a = compile_spec("specs/methods/tool-grpo.yaml", [], tmp_path / "a")
    b = compile_spec("specs/methods/tool-grpo.yaml", ["rollout.environment.max_env_tokens=16"], tmp_path / "b")
    run = json.loads((a / "plan.json").read_text())["openrlhf"]["runs"][0]
    assert run["plugin"]["agent"] and run["plugin"]["verifier"] == "toy"
    args = argv(a)
    assert flag(args, "--train.agent_func_path") == "agent.py" and "--reward.remote_url" not in args
    assert (a / "agent.py").exists() and not (a / "reward.py").exists()
    parser.check("ppo", json.loads((a / "args.json").read_text())[run["name"]])
    assert int(flag(args, "--data.max_len")) - int(flag(argv(b), "--data.max_len")) == 64 - 16
    readme = (a / "README.md").read_text()
    assert "environment: agent.py runs each rollout as an episode" in readme and "action_mask 0" in readme


# the check run in a subprocess (the stand-ins for vLLM / flash-attn only ever go on a subprocess's path), in the
# bundle's folder with the bundle first on the path: OpenRLHF's loader, the composer's copy in the bundle
CHECK = r'''
import asyncio, json, sys, types
import torch
from transformers import AutoTokenizer
from vllm import SamplingParams
from openrlhf.trainer.ray.vllm_engine import _load_agent_executor
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.models.loss import PolicyLoss
from openrlhf.utils.agent import AgentExecutorBase
from composer.backends.openrlhf.batch import decode_label, encode_label, label_of
from components.tasks import toy

turns, problem, max_new = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
plan = json.load(open("plan.json"))
tok = AutoTokenizer.from_pretrained(plan["openrlhf"]["policy_path"])
agent = _load_agent_executor("agent.py")  # OpenRLHF's own loader: AgentExecutor() from the bundle's agent.py
assert isinstance(agent, AgentExecutorBase)
if problem == "row":  # the bundle's first training row (its prompt as the bundle rendered it), else a toy chain
    from composer.backends.openrlhf.batch import example_of
    row = json.loads(open("data/train.jsonl").readline())
    ex = example_of(row["prompt"], decode_label(row["label"]))
else:
    ex = toy.make_example(problem)
requests = []


class Engine:  # the stand-in for vLLM's engine: turn k of the script after k environment answers
    async def generate(self, ids, sp, multi_modal_data=None):
        text = tok.decode(ids, skip_special_tokens=True)[len(ex.prompt):]
        k = sum(text.count(m) for m in ("<tool_response>", "try again"))
        requests.append({"k": k, "max_tokens": sp.max_tokens, "seed": sp.seed, "stop": getattr(sp, "stop", None),
                         "include_stop": getattr(sp, "include_stop_str_in_output", None)})
        out = tok.encode(turns[min(k, len(turns) - 1)], add_special_tokens=False)
        toks = out[: sp.max_tokens]
        lps = [{t: types.SimpleNamespace(logprob=-0.25)} for t in toks]
        o = types.SimpleNamespace(token_ids=toks, text=tok.decode(toks), logprobs=lps,
                                  finish_reason="length" if len(out) > sp.max_tokens else "stop")
        return types.SimpleNamespace(outputs=[o])


max_len = int(plan["openrlhf"]["runs"][0]["argv"][plan["openrlhf"]["runs"][0]["argv"].index("--data.max_len") + 1])
label = encode_label(label_of(ex, step=0))
res = asyncio.run(agent.execute(ex.prompt, label, SamplingParams(max_tokens=max_new, logprobs=1), max_len, tok,
                                Engine()))
exp = SamplesGenerator._process_response_into_experience(None, res, max_len=max_len)  # OpenRLHF's own
seq, act = exp.sequences[0].tolist(), exp.action_mask[0].tolist()  # act[j]: token j + 1
P = len(tok.encode(ex.prompt, add_special_tokens=False))
trained = [seq[j + 1] for j, a in enumerate(act) if a]
context = [seq[j + 1] for j, a in enumerate(act) if not a and j + 1 >= P]
# OpenRLHF's PolicyLoss on this Experience: d loss / d log-prob, token by token
lp = torch.full((1, len(act)), -0.25, requires_grad=True)
loss = PolicyLoss()(lp, lp.detach(), torch.ones(1, len(act)), action_mask=exp.action_mask)[0]
loss.backward()
grad = lp.grad[0].tolist()
meta = decode_label(res["label"])
print("RESULT " + json.dumps({
    "reward": res["reward"], "logs": res["extra_logs"], "spans": meta["spans"], "prompt_len": P,
    "trained": tok.decode(trained), "context": tok.decode(context),
    "env_grads": [grad[s - 1 + i] for s, e, o in meta["spans"] if o == "environment" for i in range(e - s)],
    "policy_grads": [grad[s - 1 + i] for s, e, o in meta["spans"] if o == "policy" for i in range(e - s)],
    "env_mask": [act[s - 1 + i] for s, e, o in meta["spans"] if o == "environment" for i in range(e - s)],
    "info_reward": float(exp.info["reward"][0]), "score": float(exp.scores[0]), "requests": requests,
    "answer": ex.answer,
    "solution": ex.solution}))
'''


def run_agent(bundle: Path, turns: list[str], problem: str = "7+3-5", max_new: int = 256) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=f"{bundle}{os.pathsep}{STUBS}", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHECK, json.dumps(turns), problem, str(max_new)], cwd=bundle, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7+3"}}</tool_call>'


@needs_openrlhf
def test_agent_runs_a_tool_episode_on_openrlhf_classes(tmp_path):
    """tool-grpo's agent on a scripted engine: turn 1 calls the calculator (and runs on past </tool_call>, which the
    agent passes to vLLM as a stop string: cut there), the environment answers
    `\\n<tool_response>10</tool_response>\\n`, turn 2 writes the solution. In OpenRLHF's Experience the trained tokens are exactly the two policy turns, the context after the
    prompt exactly the tool's answer, whose tokens get action_mask 0 and zero gradient in OpenRLHF's PolicyLoss
    (the policy's tokens non-zero); the reward is the toy verifier's (1: the final answer is right); env/* counts:
    2 policy turns, 1 tool call, 0 errors, the answer's token count, ended by an answer. A final answer that is wrong
    scores 0 with the same call."""
    # tier-16 chains: the toy's response budget (6 tokens a step line) then holds a 73-token call and an answer
    bundle = compile_spec("specs/methods/tool-grpo.yaml", ["data.tiers=[16]", "data.train_tiers=[16]"],
                          tmp_path / "tools")
    from components.tasks import toy

    sol = toy.make_example("7+3-5").solution
    out = run_agent(bundle, [CALL + "junk\n#9<eos>", sol + "<eos>"])
    answer = "\n<tool_response>10</tool_response>\n"
    assert out["trained"] == CALL + sol + "<eos>", out["trained"]
    assert out["context"] == answer
    assert [o for _, _, o in out["spans"]] == ["policy", "environment", "policy"]
    assert out["env_mask"] == [0] * len(answer) and set(out["env_grads"]) == {0.0}
    assert len(out["policy_grads"]) == len(CALL) + len(sol) + 1 and 0.0 not in out["policy_grads"]
    assert out["reward"] == out["info_reward"] == 1.0
    logs = out["logs"]
    assert logs["env/turns"] == 2 and logs["env/tool_calls"] == 1 and logs["env/tool_errors"] == 0
    assert logs["env/env_tokens"] == len(answer) and logs["env/ended_answered"] == 1.0
    # the second turn's budget is what the policy has left of max_new_tokens (the environment's tokens not counted)
    first, second = [r["max_tokens"] for r in out["requests"]]
    assert second == first - len(CALL)
    # each policy turn asks vLLM to stop at the environment's stop string, kept in the output (the episode cuts at
    # the token that completes it: the scripted engine above runs past it, as an engine without stop strings would)
    assert [(r["stop"], r["include_stop"]) for r in out["requests"]] == [(["</tool_call>"], True)] * 2
    wrong = run_agent(bundle, [CALL, sol.replace("#5", "#6") + "<eos>"])
    assert wrong["reward"] == 0.0 and wrong["trained"] == CALL + sol.replace("#5", "#6") + "<eos>"


@needs_openrlhf
def test_agent_runs_a_plugin_environment_with_turn_rewards(tmp_path):
    """The plugin environment `retry` (examples/custom_component, shipped in the bundle): a wrong '#3' is answered
    'F:line 2 is wrong, try again\\nA:' (environment tokens: action_mask 0, no gradient), the second attempt is right;
    the reward is the verifier's 1 on the final answer plus turn_reward_weight 1 x the turn's -0.1 = 0.9, as
    Lightning's RewardSignal sums them; the score OpenRLHF filters groups by is the verifier's 1."""
    spec = "examples/custom_component/retry-env.yaml"
    bundle = compile_spec(spec, ["rollout.max_new_tokens=64"], tmp_path / "retry", plugins=True)
    assert (bundle / "length_penalty" / "retry_env.py").exists()
    from components.tasks import toy

    sol = toy.make_example("7+3-5").solution
    first = "7+3=0\n0-5=3\n#3<eos>"
    out = run_agent(bundle, [first, sol + "<eos>"], max_new=64)
    assert out["trained"] == first + sol + "<eos>"
    assert out["context"] == "\nF:line 2 is wrong, try again\nA:", out["context"]
    assert set(out["env_mask"]) == {0} and set(out["env_grads"]) == {0.0} and 0.0 not in out["policy_grads"]
    assert out["reward"] == pytest.approx(1.0 - 0.1) and out["info_reward"] == pytest.approx(0.9)
    # Experience.scores (what OpenRLHF's dynamic filtering reads) is the verifier's alone, as Lightning's filter reads
    # the source's rewards without the turn rewards
    assert out["score"] == 1.0
    assert out["logs"]["env/turn_reward"] == pytest.approx(-0.1) and out["logs"]["env/env_turns"] == 1


def test_final_answer_is_the_turn_before_the_last_environment_answer():
    """The agent's reward text (agent.final_answer) is Lightning's (episodes.answer_span): an episode that ends on the
    environment's answer (the policy's budget spent) is verified on the policy's last turn, not on the environment's
    text; a response with no environment token is read whole."""
    from components.tasks.tokenizer import char_tokenizer
    from composer.backends.openrlhf.agent import final_answer
    from composer.protocol import Trace

    tok = char_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    t = Trace(enc("Q:1+2\nA:"))
    t.add(enc("#4"), "policy")
    t.add(enc("\n#3\n"), "environment")
    assert tok.decode(final_answer(t)) == "#4"
    t.add(enc("1+2=3\n#3"), "policy")
    assert tok.decode(final_answer(t)) == "1+2=3\n#3"
    plain = Trace(enc("Q:1+2\nA:"))
    plain.add(enc("#3"), "policy")
    assert tok.decode(final_answer(plain)) == "#3"


def test_length_penalty_with_an_environment_is_refused(tmp_path):
    """DAPO's overlong penalty on an episode: OpenRLHF's flag measures first to last action token, the composer's
    part every response token; compile refuses it, naming the part in `plus` and why."""
    from composer.backends.openrlhf.flags import Unsupported

    with pytest.raises(Unsupported) as e:
        compile_spec("specs/methods/tool-grpo.yaml", ["sources.overlong={kind: overlong_penalty, buffer: 4}",
                                                      "signal.plus={overlong: 1.0}"], tmp_path / "b")
    assert e.value.path[-3:] == ("signal", "plus", "overlong"), e.value.path
    assert "first to its last action token" in e.value.reason and "lightning" in e.value.hint


@needs_openrlhf
def test_agent_renders_the_tool_message_with_the_chat_template(tmp_path):
    """Chat prompts on a data file (the toy student with a Qwen2.5-like template, test_environments.QWEN_LIKE): the
    agent, in the bundle's worker, renders the calculator's answer with the policy's chat template, as Lightning does
    (test_environments.test_chat_prompts_render_the_tool_message_with_the_template): the assistant's end of turn, the
    tool message as a user turn of <tool_response> lines, the next generation prompt; all of it action_mask 0 with no
    gradient; the final answer '#3' after it is verified right (every row's answer is 3). The environment's off-policy
    share is not counted as a guide's (composer_offpolicy_frac 0, Lightning's offpolicy_token_frac)."""
    import shutil

    from test_environments import QWEN_LIKE
    from transformers import AutoTokenizer

    from composer.registry import part

    model = tmp_path / "model"
    shutil.copytree(part("toy.checkpoints")()["student"], model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = QWEN_LIKE
    tok.save_pretrained(model)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{3 - a}", "answer": "3"}) + "\n" for a in range(4)))
    spec = tmp_path / "tool-grpo-on-a-file.yaml"  # the shipped spec without its toy task (a data file instead)
    spec.write_text((ROOT / "specs/methods/tool-grpo.yaml").read_text().replace("data: {toy_task: tools}\n", ""))
    bundle = compile_spec(str(spec), [f"policy.model={model}", f"data.train={data}",
                                                           "rollout.max_new_tokens=128",
                                                           "rollout.environment.max_env_tokens=256"], tmp_path / "b")
    first = json.loads((bundle / "data" / "train.jsonl").read_text().splitlines()[0])
    problem = json.loads(first["label"])["problem"]
    assert first["prompt"] == f"<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"  # the bundle's
    out = run_agent(bundle, [CALL, "#3<eos>"], problem="row", max_new=128)
    want = "<|im_end|>\n<|im_start|>user\n<tool_response>\n10\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert out["context"] == want and out["trained"] == CALL + "#3<eos>"
    assert set(out["env_mask"]) == {0} and set(out["env_grads"]) == {0.0} and len(out["env_mask"]) == len(want)
    assert out["reward"] == 1.0 and out["logs"]["env/env_tokens"] == len(want)
    assert out["logs"]["composer_offpolicy_frac"] == 0.0


PY_CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(7*3)"}}</tool_call>'


@needs_openrlhf
def test_agent_runs_the_python_tool_in_the_sandbox(tmp_path):
    """The python tool from the bundle's agent: the program runs in the code sandbox (checked by the environment's
    preflight when the agent builds its context) and its stdout is the environment's answer, action_mask 0."""
    bundle = compile_spec("specs/methods/tool-grpo.yaml", ["data.tiers=[16]", "data.train_tiers=[16]",
                                                           "rollout.environment.tools=[calculator,python]"],
                          tmp_path / "py")
    out = run_agent(bundle, [PY_CALL, "#5<eos>"])
    assert out["context"] == "\n<tool_response>21</tool_response>\n" and set(out["env_mask"]) == {0}
    assert out["logs"]["env/tool_calls"] == 1 and out["logs"]["env/tool_errors"] == 0 and out["reward"] == 1.0


def test_agent_stops_with_the_reason_where_the_sandbox_is_missing(monkeypatch):
    """A worker without the sandbox: the agent's first context (before any episode) raises the sandbox's reason; the
    calculator alone needs none."""
    from components.tasks import code_verifier
    from components.tasks.tokenizer import char_tokenizer
    from composer.backends.openrlhf.agent import ComposerAgent
    from composer.plan.compile import compile_plan

    def missing():
        raise code_verifier.SandboxUnavailable("unshare: operation not permitted")

    monkeypatch.setattr(code_verifier, "ensure_sandbox", missing)
    for tools, fails in (("[calculator,python]", True), ("[calculator]", False)):
        v = validate_file(ROOT / "specs/methods/tool-grpo.yaml", [f"rollout.environment.tools={tools}"])
        plan = compile_plan(v)
        plan["openrlhf"] = {"toy": True, "runs": [{"name": "main", "segments": [0],
                                                   "plugin": {"agent": True, "verifier": "toy"}}]}
        agent = ComposerAgent(plan, "main")
        spec = agent.steps.at(0).spec
        if fails:
            with pytest.raises(code_verifier.SandboxUnavailable, match="operation not permitted"):
                agent.context(spec, char_tokenizer())
        else:
            agent.context(spec, char_tokenizer())


def test_gate_with_turn_rewards_is_refused(tmp_path):
    """A term gate (KDRL's distillation on failed rollouts) over episodes with per-turn rewards: OpenRLHF's advantage
    step reads success from the sample's reward, which then holds the turn rewards too; refused naming the gate. With
    turn_reward_weight 0 the spec compiles."""
    from composer.backends.openrlhf.flags import Unsupported

    env = "rollout.environment={kind: tools, tools: [calculator], turn_reward_weight: 1.0}"
    with pytest.raises(Unsupported) as e:
        compile_spec("specs/methods/kdrl-mask.yaml", [env], tmp_path / "a")
    assert e.value.path[-3:] == ("terms", 1, "gate") and "per-turn rewards" in e.value.reason, e.value.path
    compile_spec("specs/methods/kdrl-mask.yaml", [env.replace("1.0", "0.0")], tmp_path / "b")
