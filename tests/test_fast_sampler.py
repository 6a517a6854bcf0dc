"""composer.runtime.fast_sampler: with greedy sampling it yields exactly hf_generate's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from composer.runtime.engine import Sampling, hf_generate
from composer.runtime.fast_sampler import fast_generate, fast_generate_with_logprobs, supported
from composer.runtime.models import load_model, load_tokenizer, token_logprobs


def _prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """Toy prompts of mixed tiers and formats, so rows have different lengths (left padding is exercised)."""
    from components.tasks import toy

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ex = toy.make_example(toy.random_problem(rng, rng.choice((1, 2, 3, 4, 6, 8)), "eval"))
        text = ex.prompt if i % 4 else toy.TEMPLATES["reference"].format(problem=ex.problem, solution=ex.solution)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def student():
    from components.tasks.bootstrap import ensure_checkpoints

    path = ensure_checkpoints()["student"]
    return load_model(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from components.tasks.bootstrap import tiny_random_checkpoint

    path = tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny") / "ckpt"))
    return load_model(path).eval(), load_tokenizer(path)


def _same(a, b):
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.finished for g in a] == [g.finished for g in b]


def test_greedy_matches_hf_generate_on_the_toy_student(student):
    from components.tasks.toy import max_new_tokens_for

    model, tok = student
    assert supported(model)[0]
    prompts = _prompts(tok, 64)
    greedy = Sampling(greedy=True)
    ref = hf_generate(model, tok, prompts, max_new_tokens_for(8), greedy)
    out = fast_generate(model, tok, prompts, max_new_tokens_for(8), greedy)
    _same(ref, out)
    assert any(g.finished for g in out)  # the student does stop at eos: the early exit is exercised
    # small batches (several chunks) give the same rows
    _same(ref, fast_generate(model, tok, prompts, max_new_tokens_for(8), greedy, batch_size=7))


def test_greedy_matches_with_min_new_tokens_and_random_weights(tiny):
    model, tok = tiny
    prompts = _prompts(tok, 24, seed=1)
    greedy = Sampling(greedy=True)
    _same(hf_generate(model, tok, prompts, 20, greedy), fast_generate(model, tok, prompts, 20, greedy))
    model.generation_config.min_new_tokens = 12
    try:
        _same(hf_generate(model, tok, prompts, 12, greedy), fast_generate(model, tok, prompts, 12, greedy))
    finally:
        model.generation_config.min_new_tokens = None


def _forward_logprobs(model, tok, prompts, gens, temperature):
    """Each generated token's log-prob from one padded forward pass of the same weights."""
    seqs = [p + g.tokens for p, g in zip(prompts, gens)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tok.pad_token_id)
    mask = torch.zeros((len(seqs), T), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), True
    ref, _, _ = token_logprobs(model, ids, mask, temperature=temperature)
    return [ref[i, len(p): len(p) + len(g.tokens)] for i, (p, g) in enumerate(zip(prompts, gens))]


def test_sampling_respects_lengths_and_logprobs_match_a_forward_pass(tiny):
    model, tok = tiny
    prompts = _prompts(tok, 16, seed=2)
    torch.manual_seed(0)
    gens, lps = fast_generate_with_logprobs(model, tok, prompts, 10, Sampling(temperature=0.7, top_k=20, top_p=0.9))
    assert all(1 <= len(g.tokens) <= 10 for g in gens)
    assert all(g.finished == (g.tokens[-1] == tok.eos_token_id) for g in gens)
    for ref, lp in zip(_forward_logprobs(model, tok, prompts, gens, 0.7), lps):
        assert torch.allclose(ref, torch.tensor(lp), atol=1e-4)


def test_unsupported_generation_config_falls_back_to_hf_generate(tiny):
    model, tok = tiny
    prompts = _prompts(tok, 8, seed=3)
    model.generation_config.repetition_penalty = 1.3
    try:
        assert not supported(model)[0]
        greedy = Sampling(greedy=True)
        _same(hf_generate(model, tok, prompts, 8, greedy), fast_generate(model, tok, prompts, 8, greedy))
    finally:
        model.generation_config.repetition_penalty = 1.0


def test_prompts_extending_the_previous_calls_rows_are_prefilled_from_their_cache(student, monkeypatch):
    """A guided row's next chunk: prompts that extend the previous call's rows (prompt + some sampled tokens +
    tokens a guide wrote) get the same greedy tokens and log-probs (to float rounding) with the prefix cache as
    from scratch, and the cached call prefills only the new tokens; other weights drop the cache."""
    import composer.runtime.fast_sampler as fs

    model, tok = student
    prompts = _prompts(tok, 8, seed=4)
    cache = fs.PrefixCache()
    first, _ = fast_generate_with_logprobs(model, tok, prompts, 12, Sampling(greedy=True), prefixes=cache)
    extra = tok.encode("7 ", add_special_tokens=False)
    later = [p + g.tokens[: 3 + i % 4] + extra for i, (p, g) in enumerate(zip(prompts, first))]
    widths = []
    forward = fs._forward
    monkeypatch.setattr(fs, "_forward", lambda W, ids, *a: widths.append(ids.shape[1]) or forward(W, ids, *a))
    fresh, fresh_lp = fast_generate_with_logprobs(model, tok, later, 12, Sampling(greedy=True))
    P = max(len(p) for p in later)
    assert widths[0] == P
    widths.clear()
    cached, cached_lp = fast_generate_with_logprobs(model, tok, later, 12, Sampling(greedy=True), prefixes=cache)
    assert widths[0] <= len(extra) < P  # only the tokens after each row's cached prefix
    _same(fresh, cached)
    assert max(abs(a - b) for x, y in zip(fresh_lp, cached_lp) for a, b in zip(x, y)) < 1e-4
    with torch.no_grad():
        model.lm_head.weight.add_(0.0)  # an in-place write: the weights' version moves, the cache is stale
    widths.clear()
    fast_generate_with_logprobs(model, tok, later, 4, Sampling(greedy=True), prefixes=cache)
    assert widths[0] == P


def test_the_compiled_decode_step_samples_as_the_eager_one_with_one_graph_for_every_shape(student):
    """train.compile's decode step (`compiled=True`): every slot of a fixed-size cache attended, the unwritten
    ones masked; greedy rows equal the eager loop's and hf_generate's, sampled rows' log-probs equal a forward
    pass, and a batch of other rows and cache length reuses the graph (rows and slots are dynamic sizes)."""
    from torch._dynamo.utils import counters

    from components.tasks.toy import max_new_tokens_for

    model, tok = student
    prompts = _prompts(tok, 24, seed=4)
    greedy = Sampling(greedy=True)
    eager, _ = fast_generate_with_logprobs(model, tok, prompts, max_new_tokens_for(8), greedy)
    compiled, _ = fast_generate_with_logprobs(model, tok, prompts, max_new_tokens_for(8), greedy, compiled=True)
    _same(eager, compiled)
    _same(hf_generate(model, tok, prompts, max_new_tokens_for(8), greedy), compiled)
    assert any(g.finished for g in compiled) and any(len(g.tokens) > 3 for g in compiled)
    graphs = counters["stats"]["unique_graphs"]
    few = prompts[5:10]  # other rows, other prompt lengths, another budget: other sizes of every input
    _same(fast_generate_with_logprobs(model, tok, few, 7, greedy)[0],
          fast_generate_with_logprobs(model, tok, few, 7, greedy, compiled=True)[0])
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile
    torch.manual_seed(0)
    gens, lps = fast_generate_with_logprobs(model, tok, prompts, 12, Sampling(temperature=0.7), compiled=True)
    assert len({tuple(g.tokens) for g in gens}) > 1
    for ref, lp in zip(_forward_logprobs(model, tok, prompts, gens, 0.7), lps):
        torch.testing.assert_close(ref, torch.tensor(lp), atol=1e-4, rtol=1e-4)


def test_the_compiled_decode_step_continues_from_the_prefix_cache(student):
    """A guided row's next chunk (`reusing_prefixes`) prefilled from the previous call's cache, decoded by the
    compiled step: the rows equal the eager engine's."""
    from composer.runtime.engine import LocalModel

    model, tok = student
    prompts = _prompts(tok, 6, seed=5)
    greedy = Sampling(greedy=True)
    out = {}
    for compiled in (False, True):
        engine = LocalModel(model, tok, compiled=compiled)
        with engine.reusing_prefixes():
            first = engine.generate(prompts, 6, greedy)
            nxt = [p + g.tokens + tok.encode(" so", add_special_tokens=False) for p, g in zip(prompts, first)]
            out[compiled] = (first, engine.generate(nxt, 6, greedy))
    for a, b in zip(out[False], out[True]):
        _same(a, b)


def test_a_compiled_decode_step_the_sampler_cannot_take_is_said(tiny, caplog):
    """train.compile on a model the KV-cache sampler does not cover: generate samples (uncompiled), and a
    warning says so with the reason instead of dropping the setting silently."""
    import composer.runtime.fast_sampler as fs

    model, tok = tiny
    prompts = _prompts(tok, 4, seed=6)
    model.generation_config.repetition_penalty = 1.3
    try:
        fs._TOLD.clear()
        with caplog.at_level("WARNING", logger="composer"):
            gens, _ = fast_generate_with_logprobs(model, tok, prompts, 5, Sampling(greedy=True), compiled=True)
        _same(hf_generate(model, tok, prompts, 5, Sampling(greedy=True)), gens)
        said = [r.getMessage() for r in caplog.records if "decode step is not compiled" in r.getMessage()]
        assert len(said) == 1 and "logits processor" in said[0]
    finally:
        model.generation_config.repetition_penalty = 1.0
