"""Chat templates, system prompts and prompt templates (data.prompt_format), on a real-format checkpoint.

The model, tokenizer and data are built by the test (tests/realmodel.py: a byte-level BPE with a ChatML
template, a random Qwen3 model, small-sum word problems with \\boxed{} solutions); nothing is downloaded.
Expected prompts are written out by hand (`realmodel.chat`), so a change in rendering shows here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import realmodel
import torch
from realmodel import CHAT_TEMPLATE, INSTRUCTION, SYSTEM, chat, data_block

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "{prompt}\n\n" + INSTRUCTION.replace("{}", "{{}}")  # the user message: problem + instruction
PROMPTS = {"system_prompt": SYSTEM, "prompt_template": TEMPLATE}
FAST = ("train: {steps: 2, prompts_per_step: 2, eval_every: 0, eval_samples: 2, lr: 1.0e-4, loggers: [csv], "
        "samples_every: 1}\n")
JUDGE_TEMPLATE = ("Problem:\n{problem}\n\nSteps accepted so far:\n{accepted}\n\nNew steps to review:\n{steps}\n\n"
                  "Answer KEEP or REVISE k.")
OPSD_REFERENCE = "\n\nHere is a reference solution to this problem:\n"


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    return realmodel.built(tmp_path_factory)


def user(problem: str) -> str:
    return f"{problem}\n\n{INSTRUCTION}"


def spec_text(real, body: str, name: str = "t", policy: str | None = None, **data) -> str:
    data = {**PROMPTS, **data}
    pol = {"model": real["model"], **({"tokenizer": policy} if policy else {})}
    return (f"name: {name}\npolicy: {json.dumps(pol)}\n"
            + data_block(real, **{k: v for k, v in data.items() if v is not None}) + body)


GRPO = """sources: {verifier: {kind: outcome_reward}}
rollout: {samples_per_prompt: 2, max_new_tokens: 24}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
""" + FAST
OPSD = """sources:
  reference: {kind: reference_solution}
  teacher: {kind: policy_model, model: self, weights: WEIGHTS, context: [reference]}
rollout: {samples_per_prompt: 2, max_new_tokens: 24}
signal: {kind: distillation, teacher: teacher}
objective: {kind: divergence, measure: jsd, estimator: full}
""" + FAST
MINTRL = f"""sources:
  verifier: {{kind: outcome_reward}}
  judge: {{kind: policy_model, model: self, template: {json.dumps(JUDGE_TEMPLATE)}}}
rollout:
  samples_per_prompt: 2
  max_new_tokens: 24
  guide: {{kind: intervention, judge: judge, review: chunk, chunk_tokens: 12, step_split: "\\n", max_reviews: 2,
          max_correction_tokens: 8, control_samples: 1}}
signal: {{kind: reward, source: verifier}}
objective: {{kind: advantage_regression, baseline: control, anchor: {{guide_intervention: -0.2}},
            loss_tokens: [policy, guide_intervention]}}
""" + FAST


def validated(text: str):
    from composer.lang.loader import load_text
    from composer.checks.validate import validate_loaded

    return validate_loaded(load_text(text))


def bound(real, body=GRPO, **kw):
    from composer.runtime.binding import bind_task

    v = validated(spec_text(real, body, **kw))
    return v, bind_task(v.spec)


def make_ctx(real, text: str):
    from composer.runtime.binding import bind_task
    from composer.runtime.context import RunContext
    from composer.runtime.models import load_model, load_tokenizer

    torch.manual_seed(0)
    spec = validated(text).spec
    return RunContext(task=bind_task(spec), tokenizer=load_tokenizer(real["model"]), policy=load_model(real["model"]),
                      engine=None, spec=spec)


# ------------------------------------------------------------------------------------------ validation


def test_prompt_settings_validate_without_torch(tmp_path):
    for name in ("train.jsonl", "eval.jsonl"):  # validate checks the files and their columns (issue 56)
        (tmp_path / name).write_text(json.dumps(realmodel.problem_row(1, 2)) + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\npolicy: {model: /no/such/model}\n"
                    + data_block({"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl")},
                                 prompt_format="chat", system_prompt=SYSTEM, prompt_template=TEMPLATE,
                                 chat_template_kwargs={"enable_thinking": False}) + GRPO)
    probe = ("import sys; from composer.checks.validate import validate_file; v = validate_file(sys.argv[1]); "
             "print(v.spec.data.prompt_format, v.spec.data.chat_template_kwargs); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'tokenizers')))")
    r = subprocess.run([sys.executable, "-c", probe, str(spec)], capture_output=True, text=True, cwd=ROOT,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["chat {'enable_thinking': False}", "[]"]


@pytest.mark.parametrize("data, message", [
    ({"prompt_template": "{problem}"}, "the only field is {prompt}"),
    ({"prompt_template": "no field"}, "the template has no {prompt}"),
    ({"prompt_template": "{prompt} {"}, "a literal brace is written {{ or }}"),
    ({"prompt_format": "chat", "train": None}, "data.prompt_format: the toy testbed"),
    ({"system_prompt": "hi", "train": None}, "data.system_prompt: the toy testbed"),
], ids=["other-field", "no-field", "lone-brace", "toy-chat", "toy-system"])
def test_bad_prompt_settings_are_refused_at_validation(data, message):
    from composer.errors import SpecError

    fields = {"train": "x.jsonl", **data}
    text = "name: t\ndata: " + json.dumps({k: v for k, v in fields.items() if v is not None}) + "\n" + GRPO
    with pytest.raises(SpecError, match=message.replace("{", r"\{").replace("}", r"\}")):
        validated(text)


# ------------------------------------------------------------------------------------------ rendering


def test_auto_renders_the_chat_template_with_system_prompt_and_template(real):
    from composer.runtime.models import load_tokenizer

    _v, task = bound(real)
    rows = {r["problem"]: r for r in real["rows"]}
    tok = load_tokenizer(real["model"])
    assert {ex.problem for ex in task.train} <= set(rows)  # problem: the row's own text
    for ex in task.train + task.eval["eval"]:
        assert ex.prompt == chat(user(ex.problem))
        ids = tok.encode(ex.prompt, add_special_tokens=False)  # tokenized once, after the template
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's BOS, not doubled
        assert tok.decode(ids, skip_special_tokens=False) == ex.prompt  # reward.py strips the prompt by its text
    assert task.prompt_format.mode == "chat" and "add_generation_prompt" in task.prompt_format.describe()


def test_plain_format_and_a_tokenizer_without_template(real):
    from composer.runtime.binding import DataError

    _v, task = bound(real, prompt_format="plain")
    ex = task.train[0]
    assert ex.prompt == f"{SYSTEM}\n\n{user(ex.problem)}"
    _v, task = bound(real, policy=real["plain"], system_prompt=None, prompt_template=None)  # auto, no template
    assert task.prompt_format.mode == "plain" and task.train[0].prompt == task.train[0].problem
    with pytest.raises(DataError, match="data.prompt_format is chat, but the tokenizer .* has no chat template"):
        bound(real, policy=real["plain"], prompt_format="chat")


def test_a_template_that_refuses_the_system_prompt_stops_at_bind_time(real, tmp_path):
    from transformers import AutoTokenizer

    from composer.runtime.binding import DataError

    tok = AutoTokenizer.from_pretrained(real["tokenizer"])
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}" + CHAT_TEMPLATE)
    tok.save_pretrained(tmp_path / "nosys")
    with pytest.raises(DataError, match="with data.system_prompt .*System role not supported"):
        bound(real, policy=str(tmp_path / "nosys"))
    _v, task = bound(real, policy=str(tmp_path / "nosys"), system_prompt=None)
    assert task.train[0].prompt == chat(user(task.train[0].problem), system=None)


def test_the_toy_testbed_keeps_its_own_prompts():
    from composer.runtime.binding import bind_task
    from composer.prompts import TASK_FORMAT, prompt_format

    spec = validated("name: t\n" + GRPO).spec
    task = bind_task(spec)
    assert task.prompt_format is None
    assert all(ex.prompt == f"Q:{ex.problem}\nA:" for ex in task.eval["tier2"])
    assert prompt_format(spec.data, None) is TASK_FORMAT and TASK_FORMAT.prompt(task.eval["tier2"][0]) == \
        task.eval["tier2"][0].prompt


# ------------------------------------------------------------------------------------------ token boundaries


def test_rollout_tokens_follow_the_rendered_prompt_and_behaviour_logprobs_are_exact(real):
    from composer.origins import CODE
    from composer import step
    from composer.plan.plan import spec_at
    from composer.runtime.engine import make_engine
    from composer.runtime.models import token_logprobs

    ctx = make_ctx(real, spec_text(real, GRPO))
    ctx.models.engine = make_engine("hf", ctx.policy, ctx.tokenizer, ctx.spec.rollout)
    examples = ctx.task.train[:2]  # different prompt lengths
    [batch] = step.sample(ctx, spec_at(ctx.spec), examples)
    with torch.no_grad():
        lp, _, _ = token_logprobs(ctx.policy, batch.tokens, batch.attention_mask)
    for i, ex in enumerate(batch.examples):
        prompt = ctx.encode(chat(user(ex.problem)))
        P = len(prompt)
        assert batch.tokens[i, :P].tolist() == prompt and (batch.origin[i, :P] == CODE["prompt"]).all()
        assert batch.origin[i, P] == CODE["policy"]  # the response starts right after the generation prompt
        resp = batch.response_mask[i]
        assert torch.allclose(batch.behavior_logprobs[i][resp], lp[i][resp], atol=1e-4)


def test_opsd_teacher_scores_under_the_chat_template_with_the_reference(real):
    from composer.prompts import OPSD_TEMPLATE
    from composer.protocol import Trace
    from composer.trajectory import assemble

    ctx = make_ctx(real, spec_text(real, OPSD.replace("WEIGHTS", "current")))
    seen = []
    ctx.sink.recorder = lambda kind, **d: seen.append(d) if kind == "prompt" else None
    exs = ctx.task.train[:2]
    traces = []
    for ex in exs:
        t = Trace(ctx.prompt_ids(ex))
        t.add(ctx.encode(ex.solution) + [ctx.eos_id], "policy")
        traces.append(t)
    batch = ctx.spec.signal.apply(ctx, assemble(traces, exs, [0, 1], ctx.pad_id))
    for i, ex in enumerate(exs):
        text = chat(OPSD_TEMPLATE.format(problem=ex.problem, solution=ex.solution))
        assert seen[i]["text"] == text and seen[i]["usage"] == "teacher"
        assert f"<|im_start|>user\n{ex.problem}{OPSD_REFERENCE}{ex.solution}" in text  # context in the user turn
        teacher, prompt = ctx.encode(text), ctx.prompt_ids(ex)
        response = ctx.encode(ex.solution) + [ctx.eos_id]
        with torch.no_grad():
            logp = torch.log_softmax(ctx.policy(input_ids=torch.tensor([teacher + response])).logits[0], -1)
        Q, P = len(teacher), len(prompt)
        for j, tok in enumerate(response):
            assert batch.tokens[i, P + j] == tok
            assert torch.allclose(batch.teacher_logprobs[i, P + j], logp[Q + j - 1, tok], atol=1e-5)


def test_judge_verdict_and_correction_prompts_are_rendered_like_the_policy(real):
    from components.guides.judges import make_judge

    ctx = make_ctx(real, spec_text(real, MINTRL))
    ex = ctx.task.train[0]
    judge = make_judge(ctx, "judge", ctx.spec.rollout.guide)
    verdict, correction = judge.renders(ctx, ex, ["He starts."], ["He buys.", "So 3."], ["He starts."])
    assert verdict({}) == chat(JUDGE_TEMPLATE.format(problem=ex.problem, accepted="He starts.",
                                                     steps="1:He buys.\n2:So 3."))
    assert correction({}) == ex.prompt + "He starts.\n"  # the kept steps start the assistant's answer


# ------------------------------------------------------------------------------------------ runs


@pytest.mark.parametrize("method", ["grpo", "opsd", "mintrl"])
def test_runs_on_the_real_format_model(real, tmp_path, method):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer.backends.lightning.run import train
    from composer.origins import CODE

    body = {"grpo": GRPO, "opsd": OPSD.replace("WEIGHTS", "initial"), "mintrl": MINTRL}[method]
    events = []
    out = tmp_path / "run"
    train(validated(spec_text(real, body, name=method)), out, progress=False,
          recorder=lambda kind, **d: events.append((kind, d)))
    tok = AutoTokenizer.from_pretrained(real["model"])
    rollouts = [d for k, d in events if k == "rollout"]
    assert rollouts
    for d in rollouts:
        b = d["batch"]
        for i, ex in enumerate(b.examples):
            assert ex.prompt == chat(user(ex.problem))
            P = int((b.origin[i] == CODE["prompt"]).sum())
            assert b.tokens[i, :P].tolist() == tok.encode(ex.prompt, add_special_tokens=False)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith(f"<|endoftext|><|im_start|>system\n{SYSTEM}<|im_end|>\n")
                           and s["prompt"].endswith(f"{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
                           for s in samples)
    prompts = [d for k, d in events if k == "prompt"]
    if method == "opsd":
        assert prompts and all(p["usage"] == "teacher" and OPSD_REFERENCE in p["text"]
                               and p["text"].endswith("<|im_end|>\n<|im_start|>assistant\n") for p in prompts)
    if method == "mintrl":
        verdicts = [p for p in prompts if p["usage"] == "judge_verdict"]
        assert verdicts, "the judge reviewed nothing"
        for p in verdicts:
            assert p["text"].startswith(f"<|endoftext|><|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
                                        "Problem:\n")
            assert p["text"].endswith("Answer KEEP or REVISE k.<|im_end|>\n<|im_start|>assistant\n")
    model = out / "model"
    assert AutoTokenizer.from_pretrained(model).chat_template == CHAT_TEMPLATE
    assert AutoModelForCausalLM.from_pretrained(model).num_parameters() == real["params"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["prompts"]["policy"] == chat(user(real["rows"][0]["problem"]))


# ------------------------------------------------------------------------------------------ explain


def test_explain_shows_the_rendered_prompt_and_the_teachers(real, tmp_path, cli):
    spec = tmp_path / "opsd.yaml"
    spec.write_text(spec_text(real, OPSD.replace("WEIGHTS", "initial"), name="opsd"))
    r = cli("explain", spec)
    assert r.exit_code == 0, r.output
    first = real["rows"][0]
    assert "prompts (data.prompt_format auto -> chat: the chat template of" in r.stdout
    assert f"  the policy's, for row 1 of {real['train']}:\n    | <|endoftext|><|im_start|>system\n" in r.stdout
    assert f"    | {INSTRUCTION}<|im_end|>\n    | <|im_start|>assistant\n    |\n" in r.stdout
    assert "  teacher 'teacher' (the OPSD template; context: reference):\n" in r.stdout
    assert f"    | {first['problem']}\n    |\n    | Here is a reference solution to this problem:\n" in r.stdout
    r = cli("explain", spec, "--format", "json")
    prompts = json.loads(r.stdout)["prompts"]
    assert prompts["policy"] == chat(user(first["problem"]))
    assert prompts["sources"]["teacher"]["teacher"].startswith(chat("")[:-len("<|im_end|>\n<|im_start|>assistant\n")]
                                                               + first["problem"] + OPSD_REFERENCE)


# ------------------------------------------------------------------------------------------ OpenRLHF


def _compile(cli, real, tmp_path, body, name):
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(spec_text(real, body, name=name))
    out = tmp_path / f"bundle-{name}"
    r = cli("compile", spec, "--out", out, "--gpus-per-node", "2")
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    return out, json.loads((out / "plan.json").read_text()), rows


def test_bundle_data_holds_the_rendered_prompts_and_reward_strips_them(real, tmp_path, cli):
    from transformers import AutoTokenizer

    from composer.backends.openrlhf.batch import decode_label
    from composer.backends.openrlhf.reward import make_reward_func

    out, plan, rows = _compile(cli, real, tmp_path, GRPO, "grpo")
    for row in rows:
        label = decode_label(row["label"])
        assert row["prompt"] == chat(user(label["problem"]))  # the label keeps the row's own text
    argv = [a for r in plan["openrlhf"]["runs"] for a in r["argv"]]
    assert not any("apply_chat_template" in a for a in argv)
    assert all(seg["spec"]["data"]["prompt_format"] == "chat" for seg in plan["segments"])  # auto, pinned
    readme = (out / "README.md").read_text()
    assert "## Prompts" in readme and rows[0]["prompt"] in readme and "`--data.apply_chat_template` stays off" in readme
    # OpenRLHF's reward call: the query is prompt + response ids decoded with special tokens
    tok = AutoTokenizer.from_pretrained(real["model"])
    reward = make_reward_func("math", tokenizer=real["model"])
    answer = decode_label(rows[0]["label"])["answer"]
    for response, want in ((f"So it is \\boxed{{{answer}}}.", 1.0), ("I do not know.", 0.0)):
        ids = tok.encode(rows[0]["prompt"], add_special_tokens=False) + tok.encode(response, add_special_tokens=False) \
            + [tok.eos_token_id]
        got = reward([tok.decode(ids, skip_special_tokens=False)], [rows[0]["prompt"]], [rows[0]["label"]])
        assert got["rewards"] == want  # the prompt's \boxed{} instruction is never read as the answer


def test_cluster_side_teacher_and_judge_prompts_match_the_lightning_ones(real, tmp_path, cli):
    from transformers import AutoTokenizer

    from components.guides.judges import make_judge
    from composer.backends.openrlhf.agent import ComposerAgent
    from composer.backends.openrlhf.batch import decode_label, example_of
    from composer.backends.openrlhf.hooks import task_of
    from composer.backends.openrlhf.loss import teacher_prompts as cluster_teacher_prompts
    from composer.prompts import OPSD_TEMPLATE
    from composer.protocol import Trace
    from composer.trajectory import assemble
    from composer.plan.plan import segments_of

    tok = AutoTokenizer.from_pretrained(real["model"])
    # OPSD: the teacher prompts the plugin builds over a step (loss.teacher_prompts -> policy_model.teacher_prompts)
    _out, plan, rows = _compile(cli, real, tmp_path, OPSD.replace("WEIGHTS", "initial"), "opsd")
    spec = segments_of(plan)[0].spec
    ex = example_of(rows[0]["prompt"], decode_label(rows[0]["label"]))
    trace = Trace(tok.encode(ex.prompt, add_special_tokens=False))
    trace.add(tok.encode(ex.solution, add_special_tokens=False) + [tok.eos_token_id], "policy")
    batch = assemble([trace], [ex], [0], tok.pad_token_id)
    [(ids, w)] = cluster_teacher_prompts(spec, "teacher", batch, tok, task_of(plan, plan["openrlhf"]["runs"][0], spec))
    assert w == 1.0 and ids == tok.encode(chat(OPSD_TEMPLATE.format(problem=ex.problem, solution=ex.solution)),
                                          add_special_tokens=False)
    # MInTRL: the agent's judge renders its verdict prompt as the Lightning backend's judge does
    _out, plan, rows = _compile(cli, real, tmp_path, MINTRL, "mintrl")
    agent = ComposerAgent(plan)
    spec = agent.steps.segments[0].spec
    ctx = agent.context(spec, tok)
    ex = example_of(rows[0]["prompt"], decode_label(rows[0]["label"]))
    verdict, correction = make_judge(ctx, "judge", spec.rollout.guide).renders(ctx, ex, ["a"], ["b"], ["a"])
    assert verdict({}) == chat(JUDGE_TEMPLATE.format(problem=ex.problem, accepted="a", steps="1:b"))
    assert correction({}) == rows[0]["prompt"] + "a\n"


def test_the_readme_section_spec_lines_validate_and_render_as_shown(real, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from composer.runtime.models import load_tokenizer
    from composer.prompts import prompt_format

    page = (ROOT / "docs" / "own-model-and-data.md").read_text()  # the README's "Read on" links it
    start = page.index("# Your own model and data")
    section = page[start:page.index("\n## ", start + 1)]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)  # the block's data files, there: validate checks they exist (issue 56)
    (tmp_path / "data").mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / "data" / name).write_text(json.dumps(realmodel.problem_row(1, 2)) + "\n")
    spec = validated("name: mine\n" + block + GRPO).spec
    assert spec.data.system_prompt == SYSTEM and spec.data.prompt_template == TEMPLATE
    shown = section.split("For a ChatML template:\n\n```\n", 1)[1].split("```", 1)[0]
    fmt = prompt_format(spec.data, load_tokenizer(real["tokenizer"]))
    problem = "Tom has 13 apples and buys 14 more. How many apples does he have?"
    assert "<|endoftext|>" + shown == fmt.prompt(SimpleNamespace(problem=problem))  # the template's BOS aside


POPE = """sources:
  verifier: {kind: outcome_reward}
  reference: {kind: reference_solution}
rollout:
  samples_per_prompt: 2
  max_new_tokens: 24
  guide: {kind: prefix, reference: reference, placement: prompt, search: fixed, max_fraction: 0.5}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
""" + FAST


def test_pope_prefix_is_part_of_the_user_message(real):
    """POPE's reference prefix (placement: prompt) goes into the user turn, before the generation prompt."""
    ctx = make_ctx(real, spec_text(real, POPE))
    ex = next(e for e in ctx.task.train if len(e.solution.split(ctx.task.step_split)) >= 2)
    guide = ctx.spec.rollout.guide
    steps = guide.ref_steps(ctx, ex)
    prompt, response = guide.conditioned(ctx, ex, 1)
    sep = ctx.task.step_split
    assert response == []
    assert prompt == ctx.encode(chat(user(ex.problem) + guide.instruction + steps[0] + sep))


# ----------------------------------------------------- chat templates are rendered with time and size limits (issue 29)


def _bind_with_template(real, tmp_path, template: str, **data):
    import realmodel
    from transformers import AutoTokenizer

    from composer.lang.loader import load_text
    from composer.runtime.binding import bind_task
    from composer.checks.validate import validate_loaded

    tok = AutoTokenizer.from_pretrained(real["tokenizer"])
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    text = (f"name: t\npolicy: {json.dumps({'model': real['model'], 'tokenizer': str(tmp_path / 'tok')})}\n"
            + realmodel.data_block(real, **data) + "sources: {verifier: {kind: outcome_reward}}\n"
            "signal: {kind: reward, source: verifier}\nobjective: {kind: grpo}\n")
    return bind_task(validate_loaded(load_text(text)).spec)


HOSTILE_TEMPLATES = {
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                    "{{ messages[-1]['content'] }}",
    "huge_repeat": "{{ 'x' * 10000000000 }}{{ messages[-1]['content'] }}",
    "huge_center": "{{ 'x'.center(1000000000) }}{{ messages[-1]['content'] }}",
    "huge_format": "{{ '%2000000000d' % 1 }}{{ messages[-1]['content'] }}",
    "huge_power": "{{ 10 ** 100000000 }}{{ messages[-1]['content'] }}",
}


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])  # with kwargs: the variables are analysed
@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_chat_template_is_rendered_with_time_and_size_limits(real, tmp_path, monkeypatch, name, kwargs):
    from composer import template_limits
    from composer.runtime.binding import DataError

    monkeypatch.setattr(template_limits, "SECONDS", 2.0)
    with pytest.raises(DataError, match="chat template"):
        _bind_with_template(real, tmp_path, HOSTILE_TEMPLATES[name],
                            **({"chat_template_kwargs": kwargs} if kwargs else {}))


def test_chat_template_kwargs_only_set_variables_the_template_reads(real, tmp_path):
    from composer.runtime.binding import DataError

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}<assistant>")
    task = _bind_with_template(real, tmp_path, template, chat_template_kwargs={"enable_thinking": False})
    assert task.train[0].prompt.endswith("<nothink><assistant>")
    with pytest.raises(DataError, match="chat_template, an argument of apply_chat_template"):
        _bind_with_template(real, tmp_path, template, chat_template_kwargs={"chat_template": "{{ 'pwned' }}"})
    with pytest.raises(DataError, match="sets thinking_budget, which the chat template does not read"):
        _bind_with_template(real, tmp_path, template, chat_template_kwargs={"thinking_budget": 3})
