"""The vLLM interface the real-job harness's replaced engine assumes (tests/openrlhf_real/hf_vllm.py, A1-A5),
pinned against numbers computed here from the model's own logits. The same assumptions are checked against
real vLLM on a GPU by examples/cluster/vllm_interface_check.py and against vLLM's CPU build by
tests/test_vllm_real.py; a change there must change all three."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


hf_vllm = _load("composer_test_hf_vllm", ROOT / "tests" / "openrlhf_real" / "hf_vllm.py")
SamplingParams = _load("composer_test_vllm_stub", ROOT / "tests" / "openrlhf_cpu_stubs" / "vllm" / "__init__.py").SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from components.tasks.tokenizer import build_char_tokenizer

    d = tmp_path_factory.mktemp("tiny")
    tok = build_char_tokenizer(str(d))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    return str(d)


def engine(model_dir, mode: str):
    return hf_vllm.HFEngine({"model": model_dir, "dtype": "float32", "max_model_len": 64, "seed": 0,
                             "logprobs_mode": mode})


def run(eng, ids, sp):
    async def go():
        return [x async for x in eng.generate({"prompt_token_ids": ids}, sp)][-1]

    return asyncio.run(go())


def logits_of(eng, ids):  # [T, V] the model's own next-token logits at every position
    with torch.no_grad():
        return eng.model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_engine_interface(model_dir, mode):
    eng = engine(model_dir, mode)
    ids = [eng.tok.bos_token_id or 2] + eng.tok.encode("12+7=", add_special_tokens=False)
    t = 1.7
    out = run(eng, ids, SamplingParams(max_tokens=6, temperature=t, logprobs=1, prompt_logprobs=1))
    o = out.outputs[0]
    # A2: each sampled token's log-prob, of the tempered distribution in processed mode, of the raw one else
    lg = logits_of(eng, ids + o.token_ids)
    scale = t if mode.startswith("processed") else 1.0
    want = [float(torch.log_softmax(lg[len(ids) - 1 + i] / scale, -1)[tok]) for i, tok in enumerate(o.token_ids)]
    got = [e[tok].logprob for e, tok in zip(o.logprobs, o.token_ids)]
    assert got == pytest.approx(want, abs=1e-4)
    # A3: prompt log-probs are the model's own in either mode (real vLLM never tempers them); position 0 has none
    assert out.prompt_logprobs[0] is None
    pl = [float(torch.log_softmax(lg[i], -1)[ids[i + 1]]) for i in range(len(ids) - 1)]
    assert [e[ids[i + 1]].logprob for i, e in enumerate(out.prompt_logprobs[1:])] == pytest.approx(pl, abs=1e-4)
    # A1: max_tokens reached -> "length" unless EOS came first (then "stop", EOS kept in token_ids)
    assert (o.finish_reason == "stop") == (o.token_ids[-1] == eng.tok.eos_token_id)
    assert o.finish_reason == "stop" or len(o.token_ids) == 6


def test_sampling_order_temperature_then_top_k_then_top_p():
    """A1: top-p is the nucleus of the tempered distribution after top-k."""
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    sp = SamplingParams(temperature=2.0, top_k=4, top_p=0.6)
    x = hf_vllm.process(logits, sp, n_out=5, eos=4)
    p = torch.softmax(logits[:4] / 2.0, -1)  # tempered, top-4: [0.41, 0.25, 0.15, 0.09] / their sum
    keep = int((p.cumsum(-1) - p <= 0.6).sum())  # the smallest prefix reaching 0.6
    assert torch.isfinite(x).tolist() == [i < keep for i in range(5)] and keep == 2
    assert float(x[0]) == pytest.approx(2.0)
    # min_tokens masks EOS until that many tokens are out
    assert hf_vllm.process(logits, SamplingParams(min_tokens=3), n_out=2, eos=0)[0] == float("-inf")
    assert hf_vllm.process(logits, SamplingParams(min_tokens=3), n_out=3, eos=0)[0] == 4.0


def test_greedy_at_temperature_zero(model_dir):
    eng = engine(model_dir, "processed_logprobs")
    ids = [eng.tok.bos_token_id or 2] + eng.tok.encode("3*3=", add_special_tokens=False)
    o = run(eng, ids, SamplingParams(max_tokens=4, temperature=0.0)).outputs[0]
    lg = logits_of(eng, ids + o.token_ids)
    assert o.token_ids == [int(torch.argmax(lg[len(ids) - 1 + i])) for i in range(len(o.token_ids))]


def test_seeded_request_samples_the_same_tokens_whatever_came_before(model_dir):
    """A5: a request with SamplingParams.seed samples from its own generator: the same tokens after other
    requests drew from the engine's generator; without a seed the engine's generator moves on."""
    eng = engine(model_dir, "processed_logprobs")
    ids = [eng.tok.bos_token_id or 2] + eng.tok.encode("12+7=", add_special_tokens=False)
    sp = SamplingParams(max_tokens=12, temperature=3.0, seed=7)
    first = run(eng, ids, sp).outputs[0].token_ids
    plain = [run(eng, ids, SamplingParams(max_tokens=12, temperature=3.0)).outputs[0].token_ids for _ in range(3)]
    assert run(eng, ids, sp).outputs[0].token_ids == first
    assert len({tuple(x) for x in plain + [first]}) > 1  # at temperature 3 the samples differ: the check can fail
    assert run(eng, ids, SamplingParams(max_tokens=12, temperature=3.0, seed=8)).outputs[0].token_ids != first
