"""The stop tokens of a model (composer/stops.py, issue 56 item 1) on the real vLLM engine: vLLM 0.32's CPU build in
.venv-vllm (`make setup-vllm`; `make test` runs this module there):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_stop_tokens_vllm.py

The model is tests/test_stop_tokens.py's (its tokenizer eos <|endoftext|>, its chat template ending a turn with
<|im_end|>, its weights answering every prompt `\\boxed{19}<|im_end|>#26<|endoftext|>`), saved with a
generation_config that lists the eos only, so that nothing but the chat template names the end of turn. Pinned:
vLLM asked nothing writes past the end of turn (and stops at it unasked when generation_config lists it: what the
CPU stand-ins assume, tests/openrlhf_real/hf_vllm.py A1); the composer's vLLM engine stops at it; a run on it
(`rollout.engine: vllm`) trains and evaluates responses that end there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - not installed (.venv), or broken
    pytest.skip(f"the real vLLM engine is not importable here ({type(e).__name__}); build its environment with "
                "`make setup-vllm` and run `.venv-vllm/bin/python -m pytest -m vllm tests/test_stop_tokens_vllm.py`",
                allow_module_level=True)

import test_stop_tokens as stops_model

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    root = tmp_path_factory.mktemp("stopmodel-vllm")
    m = stops_model.build(root)
    return {**m, "both": m["model"], "model": stops_model.no_turn_in_generation_config(m, root)}


def start(model: str):
    """The composer's vLLM engine on `model`, its stop tokens bound as a chat run binds them; (engine, tokenizer)."""
    from types import SimpleNamespace

    from composer.runtime.engine import make_engine
    from composer.runtime.models import load_model, load_tokenizer
    from composer.stops import bind

    os.environ.setdefault("COMPOSER_VLLM_EAGER", "1")
    tok = load_tokenizer(model)
    bind(tok, model, chat=True)
    cfg = SimpleNamespace(engine="vllm", temperature=1.0, top_p=1.0, top_k=0, gpu_memory_utilization=0.5,
                          tensor_parallel_size=1)
    return make_engine("vllm", load_model(model).eval(), tok, cfg), tok


def raw_greedy(eng, ids: list[int]) -> list[int]:
    """vLLM's own greedy answer, asked for no stop token."""
    from vllm import SamplingParams

    out = eng.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                       detokenize=False), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def test_vllm_asked_nothing_writes_past_the_end_of_turn_and_the_engine_stops_there(m):
    from composer.runtime.engine import Sampling

    eng, tok = start(m["model"])
    try:
        ids = tok.encode(stops_model.realmodel.chat("x"), add_special_tokens=False)
        assert raw_greedy(eng, ids) == m["chain"][1:]  # past <|im_end|>, to the eos
        for sampling in (Sampling(greedy=True), Sampling(temperature=1.0)):
            (g,) = eng.generate([ids], 16, sampling)
            assert g.tokens == m["answer"] and g.finished  # ends with <|im_end|>, nothing after it
    finally:
        eng.close()


def test_vllm_stops_unasked_at_what_generation_config_lists(m):
    """The assumption of the CPU stand-ins (hf_vllm.py A1): with generation_config listing <|im_end|>, vLLM stops
    there though asked for no stop token."""
    eng, tok = start(m["both"])
    try:
        assert raw_greedy(eng, tok.encode(stops_model.realmodel.chat("x"), add_special_tokens=False)) == m["answer"]
    finally:
        eng.close()


def test_a_run_on_vllm_trains_and_evaluates_responses_that_end_at_the_end_of_turn(m, tmp_path):
    spec = tmp_path / "stops.yaml"
    body = stops_model.EXACT.replace("eval_every: 0", "eval_every: 1").replace("rollout: {", "rollout: {engine: vllm, ")
    spec.write_text(stops_model.spec_text(m, body))
    out = tmp_path / "run"
    env = {**os.environ, "COMPOSER_VLLM_EAGER": "1"}
    r = subprocess.run([sys.executable, "-m", "composer", "run", str(spec), "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    assert "rollout engine: vllm" in log and f"{m['turn']} '<|im_end|>' (chat template end of turn)" in log, log[-3000:]
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["response"] == stops_model.ANSWER and not r["truncated"] for r in rows), rows[:2]
    evals = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert evals and all(e["response"] == stops_model.ANSWER and e["reward"] == 1.0 for e in evals), evals[:2]


def test_the_agent_passes_an_environments_stop_string_to_vllm(m):
    """An episode's policy turn ends at its environment's stop string (`</tool_call>`, composer/episodes.py): the
    OpenRLHF agent passes it to vLLM (`stop`, kept in the output), so vLLM 0.32 stops at the token that completes
    it instead of sampling on. Here the model's greedy answer `\\boxed{19}<|im_end|>` with the stop string `19}`:
    the continuation ends at the token completing it, shorter than the answer, its text holding the stop string;
    without one the same call runs to the end of turn."""
    import asyncio

    from vllm import SamplingParams

    from composer.backends.openrlhf.agent import ComposerAgent

    eng, tok = start(m["model"])

    class Async:  # OpenRLHF's engine interface over the composer's vLLM engine's LLM
        async def generate(self, ids, p):
            return eng.llm.generate([{"prompt_token_ids": list(ids)}], p, use_tqdm=False)[0]

    try:
        ids = tok.encode(stops_model.realmodel.chat("x"), add_special_tokens=False)
        sp = SamplingParams(max_tokens=16)

        def turn(stop):
            return asyncio.run(ComposerAgent.generate(None, Async(), ids, sp, 16, True, 0, stop))

        cut, whole = turn(("19}",)), turn(())
        text = tok.decode(cut.tokens, skip_special_tokens=True)
        assert "19}" in text and not tok.decode(cut.tokens[:-1], skip_special_tokens=True).count("19}"), text
        assert cut.finished and len(cut.tokens) < len(whole.tokens)
        assert whole.tokens[: len(cut.tokens)] == cut.tokens  # the same greedy tokens, stopped earlier
    finally:
        eng.close()
