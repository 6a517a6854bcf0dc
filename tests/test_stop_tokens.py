"""The stop tokens of a model (composer/stops.py, issue 56 item 1): a model whose tokenizer eos is not the token its
chat template ends a turn with, and whose generation_config lists both (as Llama-3-Instruct and Gemma-IT do), stops
every response at the end of its turn: the hf engine, the fast sampler, vLLM, evaluation; an SFT target ends as the
template writes it; explain and a run's first lines name the stop tokens.

The model is built here (nothing is downloaded): tests/realmodel.py's byte-level BPE and ChatML template, but the
tokenizer's eos is <|endoftext|> while the template ends a turn with <|im_end|>; its weights are set so that greedy
or sampled, it answers every prompt `\\boxed{19}<|im_end|>#26<|endoftext|>` (attention and MLP outputs are zero, so
the next token is a function of the current one, and the unembedding maps each token of that chain to the next)."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import logging
import sys
from pathlib import Path

import pytest
import realmodel
import torch
from test_engine import FakeLLM, Tok, fake_vllm, rollout_cfg  # noqa: F401 (fake_vllm: a fixture)

ANSWER, AFTER = "\\boxed{19}", "#26"  # the turn's answer; what the model writes after its end of turn
EXACT = """sources: {verifier: {kind: outcome_reward, verifier: exact}}
rollout: {samples_per_prompt: 2, max_new_tokens: 64}
signal: {kind: reward, source: verifier}
objective: {kind: grpo}
train: {steps: 1, prompts_per_step: 2, eval_every: 0, lr: 1.0e-4}
"""
SFT = """sources: {reference: {kind: reference_solution}}
signal: {kind: sft, target: reference}
objective: {kind: cross_entropy, loss_tokens: [demonstration]}
rollout: {max_new_tokens: 64}
train: {steps: 1, prompts_per_step: 2, eval_every: 0, lr: 1.0e-4, loggers: [csv]}
"""


def build(root: Path) -> dict:
    """The tokenizer and model described in the module docstring, and data whose eval rows all answer 19."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    train, evals = realmodel.rows(12, 0), [realmodel.problem_row(7, 12), realmodel.problem_row(10, 9)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(realmodel._corpus(train) + [ANSWER, AFTER], trainers.BpeTrainer(
        vocab_size=640, special_tokens=list(realmodel.SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    common = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=realmodel.CHAT_TEMPLATE, **common)
    eos, turn = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    last = tok.encode(realmodel.chat("x"), add_special_tokens=False)[-1]  # every prompt's last token
    chain = [last, *tok.encode(ANSWER, add_special_tokens=False), turn, *tok.encode(AFTER, add_special_tokens=False),
             eos]
    assert len(set(chain)) == len(chain), "the chain must not repeat a token (the next token follows the current)"
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the current token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in itertools.pairwise(chain):
            head[b] += 5.0 * emb[a] / emb[a].norm()
        model.lm_head.weight.copy_(head)
    model.generation_config.eos_token_id = [eos, turn]  # both, as an instruct model ships them
    model.generation_config.pad_token_id = eos
    path = root / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    for name, data in (("train.jsonl", train), ("eval.jsonl", evals)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in data))
    return {"model": str(path), "train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "eos": eos,
            "turn": turn, "chain": chain, "answer": chain[1: chain.index(turn) + 1]}


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> dict:
    return build(tmp_path_factory.mktemp("stopmodel"))


def spec_text(m: dict, body: str, **data) -> str:
    fields = {"train": m["train"], "eval": m["eval"], "prompt_field": "problem", **data}
    return f"name: stops\npolicy: {{model: {json.dumps(m['model'])}}}\ndata: {json.dumps(fields)}\n" + body


def make_ctx(m: dict, body: str = EXACT, **data):
    from composer.checks.validate import validate_loaded
    from composer.lang.loader import load_text
    from composer.runtime.binding import bind_task
    from composer.runtime.context import RunContext
    from composer.runtime.models import load_model, load_tokenizer

    spec = validate_loaded(load_text(spec_text(m, body, **data))).spec
    return RunContext(task=bind_task(spec), tokenizer=load_tokenizer(m["model"]), policy=load_model(m["model"]).eval(),
                      engine=None, spec=spec)


# ------------------------------------------------------------------------------------------ the union


def test_stop_tokens_are_the_union_of_eos_generation_config_and_the_end_of_turn(m, tmp_path):
    from transformers import AutoTokenizer

    from composer.stops import end_of_turn, generation_eos, stop_tokens

    tok = AutoTokenizer.from_pretrained(m["model"])
    eos, turn = m["eos"], m["turn"]
    assert end_of_turn(tok) == turn
    chat = stop_tokens(tok, m["model"], chat=True)
    assert set(chat.ids) == {eos, turn} and chat.end == turn
    assert "'<|im_end|>' (generation_config, chat template end of turn)" in chat.describe()
    plain = stop_tokens(tok, m["model"], chat=False)  # no chat template: targets end with the tokenizer's eos
    assert set(plain.ids) == {eos, turn} and plain.end == eos
    # without generation_config (a folder without the file): eos, plus the end of turn under chat prompts
    bare = tmp_path / "bare"
    tok.save_pretrained(bare)
    tok = AutoTokenizer.from_pretrained(bare)
    assert generation_eos(bare) == []
    assert stop_tokens(tok, chat=False).ids == (eos,)
    assert stop_tokens(tok, chat=True).ids == (eos, turn)
    # generation_config's eos_token_id as one int
    (bare / "generation_config.json").write_text(json.dumps({"eos_token_id": turn}))
    assert generation_eos(bare) == [turn] and stop_tokens(tok).ids == (eos, turn)
    # the first response stop wins: cut keeps it, nothing after it
    assert chat.cut([5, turn, 7, eos]) == ([5, turn], True) and chat.cut([5, 7]) == ([5, 7], False)


def test_end_of_turn_is_none_when_the_template_ends_turns_in_plain_text(m):
    from transformers import AutoTokenizer

    from composer.stops import end_of_turn

    tok = AutoTokenizer.from_pretrained(m["model"])
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    assert end_of_turn(tok) is None
    tok.chat_template = "{% for m in messages %}{{ raise_exception('no') }}{% endfor %}"
    assert end_of_turn(tok) is None
    tok.chat_template = None
    assert end_of_turn(tok) is None


# ------------------------------------------------------------------------------------------ the engines


def test_hf_engine_and_fast_sampler_stop_at_the_end_of_turn(m):
    from composer.runtime.engine import HFEngine, Sampling, hf_generate
    from composer.runtime.fast_sampler import fast_generate, fast_generate_with_logprobs

    ctx = make_ctx(m)
    assert set(ctx.stop_ids) == {m["eos"], m["turn"]} and ctx.eos_id == m["turn"]
    prompts = [ctx.prompt_ids(ex) for ex in ctx.task.train[:3]]
    greedy = Sampling(greedy=True)
    for gens in (hf_generate(ctx.policy, ctx.tokenizer, prompts, 24, greedy),
                 fast_generate(ctx.policy, ctx.tokenizer, prompts, 24, greedy),
                 fast_generate_with_logprobs(ctx.policy, ctx.tokenizer, prompts, 24, Sampling())[0],
                 HFEngine(ctx.policy, ctx.tokenizer).generate(prompts, 24, Sampling(temperature=1.0))):
        assert [g.tokens for g in gens] == [m["answer"]] * 3  # ends with <|im_end|>, nothing after it
        assert all(g.finished for g in gens)
        assert {ctx.decode(g.tokens) for g in gens} == {ANSWER}
    # a budget shorter than the turn: unfinished
    (g,) = HFEngine(ctx.policy, ctx.tokenizer).generate(prompts[:1], 2, greedy)
    assert g.tokens == m["answer"][:2] and not g.finished


def test_rollout_rows_end_at_the_end_of_turn_and_count_as_finished(m):
    from composer import filters, step
    from composer.plan.plan import spec_at
    from composer.runtime.engine import make_engine

    ctx = make_ctx(m)
    ctx.models.engine = make_engine("hf", ctx.policy, ctx.tokenizer, ctx.spec.rollout)
    [batch] = step.sample(ctx, spec_at(ctx.spec), ctx.task.train[:2])
    for i in range(batch.size):
        assert batch.tokens[i][batch.response_mask[i]].tolist() == m["answer"]
    assert not filters.truncated_rows(batch, ctx.stop_ids).any()  # ended in a stop token: not truncated
    assert filters.truncated_rows(batch, m["eos"]).all()  # what the tokenizer's eos alone would have said


@pytest.mark.usefixtures("fake_vllm")  # tests/test_engine.py's stand-in for vLLM
def test_vllm_engine_asks_for_every_stop_token_and_cuts_at_the_first(tmp_path):
    from composer.runtime.engine import Sampling
    from composer.runtime.vllm_engine import VLLMEngine
    from composer.stops import bind

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    tok = Tok()
    bind(tok, tmp_path)  # the stand-in's token 3 ends a turn too
    llm = FakeLLM()
    eng = VLLMEngine(None, tok, rollout_cfg(), model_dir="m", llm=llm)
    gens = eng.generate([[1, 2], [3], [4, 4, 4]], 3, Sampling())
    assert llm.calls[-1].stop_token_ids == [7, 3]
    assert [g.tokens for g in gens] == [[2, 7], [2, 3], [2, 3]]  # the stand-in writes 2 3 4 7: cut after 3
    assert [g.finished for g in gens] == [True, True, True]
    assert all(len(g.logprobs) == len(g.tokens) for g in gens)


# ------------------------------------------------------------------------------------------ evaluation


def test_evaluation_reads_the_answer_of_the_turn(m):
    from composer.runtime.evaluate import pass_at_1

    ctx = make_ctx(m)
    records: list = []
    assert pass_at_1(ctx, ctx.policy, ctx.task.eval["eval"], records=records) == 1.0
    assert {r["response"] for r in records} == {ANSWER}  # not "\\boxed{19}#26", whose answer reads 26


# ------------------------------------------------------------------------------------------ SFT targets


def test_sft_targets_end_with_the_end_of_turn_under_chat_prompts_else_the_eos(m):
    from composer.origins import CODE

    for data, end in (({}, m["turn"]), ({"prompt_format": "plain"}, m["eos"])):
        ctx = make_ctx(m, SFT, **data)
        exs = ctx.task.train[:2]
        batch = ctx.spec.signal.make_batch(ctx, exs)
        for i, ex in enumerate(exs):
            target = batch.tokens[i][batch.origin[i] == CODE["demonstration"]].tolist()
            assert target == ctx.encode(ex.solution) + [end]


def test_an_sft_run_trains_on_the_end_of_turn_and_says_its_stop_tokens(m, tmp_path, caplog):
    """The run's loss is the cross entropy of solution + <|im_end|> (recomputed here from the saved weights), not of
    solution + <|endoftext|>; its first lines name the stop tokens."""
    from composer.backends.lightning.run import train
    from composer.checks.validate import validate_loaded
    from composer.lang.loader import load_text
    from composer.origins import CODE
    from composer.runtime.models import load_model

    events = []
    with caplog.at_level(logging.INFO, logger="composer"):
        train(validate_loaded(load_text(spec_text(m, SFT))), tmp_path / "run", progress=False,
              recorder=lambda kind, **d: events.append(d) if kind == "term_loss" else None)
    assert "stop tokens: " in caplog.text and "'<|im_end|>' (generation_config, chat template end of turn)" in \
        caplog.text and "targets end with " + str(m["turn"]) in caplog.text
    (e,) = events
    b = e["batch"]
    model = load_model(m["model"]).eval()

    def ce(end: int) -> float:
        losses = []
        for i in range(b.size):
            demo = b.origin[i] == CODE["demonstration"]
            ids = b.tokens[i][b.attention_mask[i].bool()].tolist()
            start = int(demo.nonzero()[0])
            ids = ids[: start] + ids[start:-1] + [end]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            losses += [-float(logp[j - 1, ids[j]]) for j in range(start, len(ids))]
        return sum(losses) / len(losses)

    assert all(int(b.tokens[i][b.origin[i] == CODE["demonstration"]][-1]) == m["turn"] for i in range(b.size))
    assert float(e["loss"]) == pytest.approx(ce(m["turn"]), rel=1e-4)
    assert abs(ce(m["turn"]) - ce(m["eos"])) > 1e-3  # the test tells the two targets apart


# ------------------------------------------------------------------------------------------ explain


def test_explain_names_the_stop_tokens(m, tmp_path, cli):
    spec = tmp_path / "s.yaml"
    spec.write_text(spec_text(m, EXACT))
    r = cli("explain", spec)
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("stop tokens: "))
    assert f"{m['eos']} '<|endoftext|>' (tokenizer eos, generation_config)" in line
    assert f"{m['turn']} '<|im_end|>' (generation_config, chat template end of turn)" in line
    assert line.endswith(f"targets end with {m['turn']}")


# ------------------------------------------------------------------------------------------ OpenRLHF


def test_openrlhf_agent_asks_for_every_stop_token_and_cuts_at_the_first():
    import asyncio
    from types import SimpleNamespace as NS

    from test_engine import FakeSamplingParams

    from composer.backends.openrlhf.agent import ComposerAgent, _with_stops

    sp = FakeSamplingParams()  # OpenRLHF's own: no stop tokens
    p = _with_stops(sp, (7, 3))
    assert p.stop_token_ids == [3, 7] and sp.stop_token_ids is None
    asked = []

    class Engine:  # writes 2 3 4 7 whatever it is asked, as a vLLM that ignored the stop tokens would
        async def generate(self, ids, params):
            asked.append(params)
            return NS(outputs=[NS(token_ids=[2, 3, 4, 7], logprobs=None, finish_reason="stop")])

    g = asyncio.run(ComposerAgent.generate(None, Engine(), [1], p, 8, greedy=True))
    assert asked[0].stop_token_ids == [3, 7] and g.tokens == [2, 3] and g.finished


def test_an_openrlhf_bundle_ends_sft_targets_with_the_end_of_turn(m, tmp_path, cli):
    """Training targets and the evaluation's (train_sft's loss on data/eval.jsonl) alike."""
    spec = tmp_path / "sft.yaml"
    spec.write_text(spec_text(m, SFT.replace("eval_every: 0", "eval_every: 1")))
    out = tmp_path / "bundle"
    r = cli("compile", spec, "--out", out, "--gpus-per-node", "1")
    assert r.exit_code == 0, r.output
    for name in ("train.jsonl", "eval.jsonl"):
        rows = [json.loads(x) for x in (out / "data" / name).read_text().splitlines()]
        assert rows and all(row["target"].endswith("}.<|im_end|>") for row in rows), name  # not <|endoftext|>
    plan = json.loads((out / "plan.json").read_text())
    assert plan["stop_tokens"].endswith(f"targets end with {m['turn']}")
    assert f"Stop tokens: {plan['stop_tokens']}." in (out / "README.md").read_text()


def test_an_openrlhf_job_says_its_stop_tokens_first(m, tmp_path, cli, monkeypatch, capsys):
    """The bundle's entry point prints the stop tokens before it starts OpenRLHF (here train_sft: the exec that
    would start it is stopped)."""
    from composer.backends.openrlhf import __main__ as entry

    spec = tmp_path / "sft.yaml"
    spec.write_text(spec_text(m, SFT))
    out = tmp_path / "bundle"
    assert cli("compile", spec, "--out", out, "--gpus-per-node", "1").exit_code == 0

    class Started(Exception):
        pass

    def execvp(*_a):
        raise Started

    monkeypatch.setattr(entry.os, "execvp", execvp)
    monkeypatch.delenv("COMPOSER_JOB", raising=False)
    with pytest.raises(Started):
        entry.main(["--plan", str(out / "plan.json"), "--no-preflight"])
    plan = json.loads((out / "plan.json").read_text())
    assert capsys.readouterr().out.splitlines()[0] == f"composer: stop tokens: {plan['stop_tokens']}"


# ------------------------------------------------------------------------------------------ OpenRLHF's own rollouts


def no_turn_in_generation_config(m: dict, root: Path) -> str:
    """The model with a generation_config that lists the tokenizer's eos only: the end of turn is known from the chat
    template alone, so vLLM, asked nothing, would generate past it."""
    import shutil

    folder = root / "model-eos-only"
    shutil.copytree(m["model"], folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": m["eos"]}))
    return str(folder)


@pytest.mark.parametrize("where", ["openrlhf_fit/standins.py:CpuLLM", "openrlhf_real/hf_vllm.py:HFEngine"])
def test_the_vllm_stand_ins_stop_where_vllm_does(m, tmp_path, where, monkeypatch):
    """The CPU stand-ins of vLLM that OpenRLHF's jobs run here (the fit loop's and the real cluster tier's) stop as
    vLLM 0.32 does: at the tokenizer's eos, at generation_config's eos_token_id and at SamplingParams.stop_token_ids;
    so with generation_config listing the eos only and nothing asked, they write past the end of turn."""
    path, name = where.split(":")
    spec = importlib.util.spec_from_file_location(f"standin_{name}", Path(__file__).parent / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    engine = getattr(module, name)

    @dataclasses.dataclass
    class SP:  # vLLM's SamplingParams, the fields the stand-in reads
        max_tokens: int = 16
        temperature: float = 0.0
        min_tokens: int = 0
        stop_token_ids: list | None = None

    prompt = realmodel.chat("x")
    both = engine({"model": m["model"], "max_model_len": 512, "dtype": "float32"})
    ids = both.tok.encode(prompt, add_special_tokens=False)
    assert both._generate(ids, SP(), None).outputs[0].token_ids == m["answer"]  # generation_config names the turn
    eos_only = engine({"model": no_turn_in_generation_config(m, tmp_path), "max_model_len": 512, "dtype": "float32"})
    out = eos_only._generate(ids, SP(), None).outputs[0]
    assert out.token_ids == m["chain"][1:] and out.finish_reason == "stop"  # past <|im_end|>, to <|endoftext|>
    out = eos_only._generate(ids, SP(stop_token_ids=[m["turn"]]), None).outputs[0]
    assert out.token_ids == m["answer"] and out.finish_reason == "stop"
    out = eos_only._generate(ids, SP(stop_token_ids=[m["turn"]], min_tokens=len(m["answer"]) + 1), None).outputs[0]
    assert m["turn"] not in out.token_ids[: len(m["answer"])]  # min_tokens masks every stop token, as vLLM's


POPE = EXACT.replace("rollout: {samples_per_prompt: 2, max_new_tokens: 64}", """rollout:
  samples_per_prompt: 2
  max_new_tokens: 64
  guide: {kind: prefix, reference: reference, placement: prompt, max_fraction: 0.25, search: minimal, guided_fraction: 0.5}""").replace(
    "sources: {verifier: {kind: outcome_reward, verifier: exact}}",
    "sources: {verifier: {kind: outcome_reward, verifier: exact}, reference: {kind: reference_solution}}")


@pytest.mark.skipif(importlib.util.find_spec("openrlhf") is None, reason="needs openrlhf (make setup)")
@pytest.mark.parametrize("route", ["native", "agent"])
def test_openrlhf_rollouts_and_evaluation_stop_at_the_end_of_turn(m, tmp_path, route):
    """A GRPO bundle with a model whose generation_config lists only the tokenizer's eos, through OpenRLHF's fit loop
    (tests/openrlhf_fit/driver.py, vLLM's stand-in stopping where vLLM does), on both routes: OpenRLHF's own
    (reward.py: its SingleTurnAgentExecutor samples, the hooks ask vLLM for every stop token) and the composer's
    agent (agent.py, a POPE guide). Every training and evaluation rollout ends with <|im_end|>; the evaluation reads
    the turn's \\boxed{19} (reward 1)."""
    from test_openrlhf_fit import drive

    from composer.backends.openrlhf.bundle import compile_bundle
    from composer.backends.openrlhf.flags import Layout
    from composer.checks.validate import validate_loaded
    from composer.lang.loader import load_text

    model = no_turn_in_generation_config(m, tmp_path)
    body = (EXACT if route == "native" else POPE).replace("eval_every: 0", "eval_every: 1")
    v = validate_loaded(load_text(spec_text({**m, "model": model}, body).replace("steps: 1,", "steps: 2,")))
    assert v.spec.signal.kind == "reward"
    bundle = tmp_path / "bundle"
    compile_bundle(v, bundle, Layout(nodes=1, gpus_per_node=1, cluster_dir=str(tmp_path / "cluster")))
    assert (bundle / "agent.py").exists() == (route == "agent")  # else OpenRLHF's own executor samples
    out = drive(bundle, tmp_path)
    train = [s for r in out["rollouts"] if not r["eval"] for s in r["samples"]]
    evals = [s for r in out["rollouts"] if r["eval"] for s in r["samples"]]
    assert len(train) == 8 and evals
    for s in train + evals:
        assert s["response"] == m["answer"] and not s["truncated"], s  # ends with <|im_end|>, nothing after it
    assert all(s["reward"] == 1.0 for s in evals)  # the eval rows answer 19: read in the turn, not after it
