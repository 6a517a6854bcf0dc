"""Padding-free forward passes (composer/runtime/models.py: pack_rows, packed_logits; composer/runtime/varlen.py):
right-padded rows packed into fewer rows, or flattened into one sequence with per-row attention, give the
padded forward's logits and log-probs, gradients included."""

from __future__ import annotations

import copy

import pytest
import torch


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from components.tasks.bootstrap import tiny_random_checkpoint
    from composer.runtime.models import load_model

    return load_model(tiny_random_checkpoint(str(tmp_path_factory.mktemp("tiny") / "policy")), "float32")


def batch(lens, T, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    mask = torch.arange(T)[None] < lens[:, None]  # [B, T] right-padded
    tokens = torch.randint(4, vocab, (len(lens), T), generator=g).masked_fill(~mask, 0)
    return tokens, mask


def test_pack_rows_bins_first_fit_decreasing_and_refuses_left_padding():
    from composer.runtime.models import pack_rows

    _t, mask = batch([10, 3, 6, 4, 2], 10, 50)
    bins, index = pack_rows(mask)
    assert sorted(sum(n for _, n in b) for b in bins) == [5, 10, 10]  # 10 | 6+4 | 3+2
    assert sorted(r for b in bins for r, _ in b) == [0, 1, 2, 3, 4]
    assert index.shape == (5, 10)
    left = mask.flip(1)
    assert pack_rows(left) is None  # left-padded: not a prefix, so not packed
    assert pack_rows(torch.ones((4, 8), dtype=torch.bool)) is None  # nothing to save


def test_packed_forward_equals_padded_forward(model, monkeypatch):
    from composer.runtime.models import pack_rows, packed_logits, token_logprobs

    monkeypatch.setenv("COMPOSER_VARLEN", "0")  # the bins layout (the flat one: the varlen tests below)

    V = model.config.vocab_size
    tokens, mask = batch([24, 5, 9, 13, 3, 20, 7, 11], 24, V, seed=1)
    assert pack_rows(mask) is not None  # this batch is packed
    ref = model(input_ids=tokens, attention_mask=mask.long()).logits  # [B, T, V], padded
    got = packed_logits(model, tokens, mask)
    assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    # token_logprobs: log_softmax + gather on the padded logits (its pre-packing formula), real positions
    lp_ref = torch.log_softmax(ref[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    lp, _, ent = token_logprobs(model, tokens, mask)
    real = mask[:, 1:]
    assert torch.allclose(lp[:, 1:][real], lp_ref[real], atol=1e-5, rtol=0)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    # gradients of a masked loss agree
    model.zero_grad()
    (lp_ref * real).sum().backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (token_logprobs(model, tokens, mask)[0][:, 1:] * real).sum().backward()
    for a, b in zip(g_ref, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_only_transformers_models_are_packed(model):
    """A model whose code is not transformers' (remote code, a custom module) may build its own masks and
    ignore packed position_ids: it keeps the padded forward."""
    from composer.runtime.models import _packable

    assert _packable(model)

    class Custom(torch.nn.Module):
        config = model.config

    assert not _packable(Custom())


# ------------------------------------------------------------------ shared prompts (GRPO groups)


def grouped_batch(prompt_lens, group, max_resp, vocab, seed=0):
    """Right-padded rows [prompt][response]: each prompt repeated `group` times with its own response."""
    g = torch.Generator().manual_seed(seed)
    rows, plen = [], []
    for n in prompt_lens:
        prompt = torch.randint(4, vocab, (n,), generator=g)
        for _ in range(group):
            m = int(torch.randint(1, max_resp + 1, (1,), generator=g))
            rows.append(torch.cat([prompt, torch.randint(4, vocab, (m,), generator=g)]))
            plen.append(n)
    T = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = r, True
    perm = torch.randperm(len(rows), generator=g)  # groups need not be contiguous
    return tokens[perm], mask[perm], torch.tensor(plen)[perm]


def test_shared_prompt_forward_equals_padded_forward(model):
    """Each distinct prompt runs once and its keys/values are copied to its rows: the same logits, log-probs,
    entropies and parameter gradients (to 1e-5) as the padded forward over every row."""
    from composer.runtime.models import shared_prefix_logits, shared_prefix_plan, token_logprobs

    V = model.config.vocab_size
    tokens, mask, plen = grouped_batch([5, 11, 7], 4, 9, V, seed=3)
    first, owner = shared_prefix_plan(tokens, mask, plen)
    assert first.numel() == 3 and sorted(owner.tolist()) == [0] * 4 + [1] * 4 + [2] * 4
    ref = model(input_ids=tokens, attention_mask=mask.long()).logits  # [B, T, V], padded
    got = shared_prefix_logits(model, tokens, mask, plen)
    assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    real = mask[:, 1:]
    lp_ref = torch.log_softmax(ref[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    lp, _, ent = token_logprobs(model, tokens, mask, prefix_len=plen)
    _lp0, _, ent0 = token_logprobs(model, tokens, mask)  # no prompt lengths: the padded/packed path
    assert torch.allclose(lp[:, 1:][real], lp_ref[real], atol=1e-5, rtol=0)
    assert torch.allclose(ent[:, 1:][real], ent0[:, 1:][real], atol=1e-5, rtol=0)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    # gradients of a masked loss (weights per token, so every position matters) agree
    w = torch.randn(real.shape, generator=torch.Generator().manual_seed(5)) * real
    model.zero_grad()
    (lp_ref * w).sum().backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (token_logprobs(model, tokens, mask, prefix_len=plen)[0][:, 1:] * w).sum().backward()
    moved = 0
    for a, b in zip(g_ref, (p.grad for p in model.parameters())):
        assert (a - b).abs().max() <= 1e-5 * max(1.0, float(a.abs().max())), (a - b).abs().max()
        moved += int(a.abs().sum() > 0)
    assert moved > 0


def test_shared_prompts_only_when_they_save_tokens(model):
    """Distinct prompts (SFT-like rows), left padding or a prompt length of 0: no plan (the padded or packed
    forward runs); gradient checkpointing turns the cache off in training, so it keeps the padded forward."""
    from composer.runtime.models import _shareable, shared_prefix_plan

    V = model.config.vocab_size
    tokens, mask, plen = grouped_batch([6, 8, 5, 9], 1, 9, V)
    assert shared_prefix_plan(tokens, mask, plen) is None  # nothing repeats
    tokens, mask, plen = grouped_batch([6, 8], 4, 9, V)
    assert shared_prefix_plan(tokens, mask, plen) is not None
    assert shared_prefix_plan(tokens, mask.flip(1), plen) is None  # not right-padded
    assert shared_prefix_plan(tokens, mask, torch.zeros_like(plen)) is None
    assert _shareable(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert not _shareable(model)
    finally:
        model.gradient_checkpointing_disable()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # reduced precision keeps one full pass (as OpenRLHF's actor)
        assert not _shareable(model)
    assert not _shareable(copy.deepcopy(model).to(torch.bfloat16))
    assert _shareable(model)


def test_policy_view_reads_each_rows_prompt_length(model, monkeypatch):
    """The step's policy forward passes the batch's prompt lengths (leading prompt-origin tokens), so a
    GRPO group's prompt runs once there."""
    from composer.batch import TrajectoryBatch
    from composer.origins import CODE
    from composer.runtime import models
    from composer.runtime.models import policy_view

    V = model.config.vocab_size
    tokens, mask, plen = grouped_batch([6, 8], 4, 5, V, seed=7)
    t = torch.arange(tokens.shape[1])[None]
    origin = torch.where(t < plen[:, None], CODE["prompt"], CODE["policy"]).masked_fill(~mask, CODE["pad"])
    b = TrajectoryBatch(tokens=tokens, origin=origin.to(torch.uint8), behavior_logprobs=torch.zeros(tokens.shape),
                        group=torch.zeros(len(tokens), dtype=torch.long), control=torch.ones(len(tokens), dtype=torch.bool))
    assert torch.equal(b.prompt_len, plen)
    seen = []
    real = models.shared_prefix_logits
    monkeypatch.setattr(models, "shared_prefix_logits", lambda *a, **k: seen.append(1) or real(*a, **k))
    view = policy_view(model, b, want_logits=False)
    assert seen
    ref = torch.log_softmax(model(input_ids=tokens, attention_mask=mask.long()).logits[:, :-1], -1)
    ref = ref.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(view.logprobs[:, 1:][mask[:, 1:]], ref[mask[:, 1:]], atol=1e-5, rtol=0)


def test_a_compiled_model_always_takes_the_flat_layout(model):
    """Under train.compile a batch with padding and one without must make the same call (else each switch
    recompiles): a torch.compile wrapper (`_orig_mod`) gets the flat layout even when there is no padding to
    drop, and the logits stay the padded forward's."""
    from composer.runtime.models import packed_logits

    calls = []

    class Wrapper(torch.nn.Module):  # what torch.compile returns: the model under `_orig_mod`
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def forward(self, **kw):
            calls.append((sorted(kw), tuple(kw["input_ids"].shape)))
            return self._orig_mod(**kw)

    V = model.config.vocab_size
    flat = ["attention_mask", "composer_varlen", "input_ids", "position_ids", "use_cache"]
    for lens in ([12, 12, 12, 12], [12, 11, 12, 10]):  # no padding at all, then some
        tokens, mask = batch(lens, 12, V, seed=2)
        ref = model(input_ids=tokens, attention_mask=mask.long()).logits
        calls.clear()
        got = packed_logits(Wrapper(model), tokens, mask)
        assert calls == [(flat, (1, sum(lens)))]
        assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    from composer.runtime import varlen

    tokens, mask = batch([12, 12, 12, 12], 12, V, seed=2)
    assert varlen.logits(model, tokens, mask) is None  # uncompiled: no padding, the padded forward


def test_compiled_flat_forward_is_one_graph_with_the_padded_gradients(model):
    """torch.compile (train.compile's dynamic=True) of the flat layout: batches of other row counts, widths
    and token counts reuse one graph (the sizes are symbolic), every attention layer honours the layout
    inside it, and logits and gradients equal the padded forward's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from composer.runtime import varlen

    m = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, dynamic=True)
    V = m.config.vocab_size
    for lens, T, seed in (([12, 5, 9, 3], 12, 3), ([7, 7, 2, 6, 4, 1], 7, 4), ([10, 10, 10], 10, 5)):
        tokens, mask = batch(lens, T, V, seed=seed)
        seen = []
        got = _grads(m, tokens, mask, lambda t, k, seen=seen: seen.append(varlen.logits(compiled, t, k)) or seen[-1])
        assert seen[0] is not None  # the flat layout ran, compiled, and every attention layer honoured it
        want = _grads(m, tokens, mask, lambda t, k: m(input_ids=t, attention_mask=k.long()).logits)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
        ref = m(input_ids=tokens, attention_mask=mask.long()).logits  # the padded forward
        assert torch.allclose(seen[0].detach()[mask], ref.detach()[mask], atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert type(m) not in varlen._refused


# ------------------------------------------------------------------ one flat sequence, attention per row (varlen)


def _flat_inputs(model):
    """Record the input_ids shape of every forward of `model` (a pre-hook on its embeddings)."""
    shapes = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, a: shapes.append(tuple(a[0].shape)))
    return shapes


def _grads(model, tokens, mask, fn):
    model.zero_grad()
    lp = torch.log_softmax(fn(tokens, mask)[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [B, T-1]
    (lp * mask[:, 1:]).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_varlen_forward_equals_padded_forward(model):
    """Uncompiled, right-padded rows run as one flat row of their real tokens (the embeddings see [1, N]); each
    attention layer honours the layout; logits and gradients equal the padded forward's."""
    from composer.runtime import varlen
    from composer.runtime.models import packed_logits

    m = copy.deepcopy(model)
    V = m.config.vocab_size
    tokens, mask = batch([24, 5, 9, 13, 3, 20, 7, 11], 24, V, seed=1)
    shapes = _flat_inputs(m)
    seen = []
    varlen.install()
    inner = varlen._inner
    orig = varlen.attention

    def spy(module, q, k, v, attention_mask, **kw):
        seen.append((tuple(q.shape), kw.get(varlen.KEY) is not None))
        return orig(module, q, k, v, attention_mask, **kw)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        got = packed_logits(m, tokens, mask)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = orig
    assert varlen._inner is inner
    n = int(mask.sum())
    assert shapes == [(1, n)]  # one flat row, no pad token
    assert len(seen) == m.config.num_hidden_layers and all(flat for _s, flat in seen)
    assert all(s[2] == n for s, _f in seen)  # queries arrive flat: [1, H, N, D]
    ref = m(input_ids=tokens, attention_mask=mask.long()).logits
    assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    assert torch.isfinite(got).all()
    g_ref = _grads(m, tokens, mask, lambda t, k: m(input_ids=t, attention_mask=k.long()).logits)
    g = _grads(m, tokens, mask, lambda t, k: packed_logits(m, t, k))
    for a, b in zip(g_ref, g):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert any(float(a.abs().max()) > 0 for a in g)  # the check compared gradients that exist


def test_varlen_under_gradient_checkpointing(model):
    """Checkpointed layers recompute their forward in the backward pass: the layout travels with the layer's
    keyword arguments, so the recomputed attention is per row too and the gradients stay the padded ones."""
    from composer.runtime.models import packed_logits

    m = copy.deepcopy(model)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    tokens, mask = batch([16, 4, 9, 12, 2], 16, m.config.vocab_size, seed=3)
    g_ref = _grads(m, tokens, mask, lambda t, k: m(input_ids=t, attention_mask=k.long()).logits)
    shapes = _flat_inputs(m)
    g = _grads(m, tokens, mask, lambda t, k: packed_logits(m, t, k))
    assert shapes == [(1, int(mask.sum()))]  # flat, and no fallback forward
    for a, b in zip(g_ref, g):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_varlen_refused_where_a_layer_drops_the_layout(model):
    """A model whose attention does not receive the forward's keyword arguments would attend across rows:
    the layout counts the layers that honoured it, and a shortfall falls back to the bins layout (and the
    model class is not tried again)."""
    from composer.runtime import varlen
    from composer.runtime.models import packed_logits

    m = copy.deepcopy(model)
    attn = m.model.layers[1].self_attn
    forward = attn.forward
    attn.forward = lambda *a, **kw: forward(*a, **{k: v for k, v in kw.items() if k != varlen.KEY})
    tokens, mask = batch([12, 3, 7, 10], 12, m.config.vocab_size, seed=4)
    shapes = _flat_inputs(m)
    try:
        got = packed_logits(m, tokens, mask)
        assert type(m) in varlen._refused
        assert shapes[0] == (1, int(mask.sum())) and shapes[1][0] < 4  # tried flat, then bins (fewer rows)
        ref = m(input_ids=tokens, attention_mask=mask.long()).logits
        assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
    finally:
        varlen._refused.discard(type(m))


def test_varlen_layout_only_for_right_padded_rows():
    from composer.runtime.varlen import layout

    _t, mask = batch([5, 2, 0, 3], 5, 50)
    lay = layout(mask)
    assert lay.real.tolist() == [0, 1, 2, 3, 4, 5, 6, 15, 16, 17]  # grid slots of the real tokens
    assert lay.grid.view(4, 5).tolist() == [[0, 1, 2, 3, 4], [5, 6, 6, 6, 6], [6, 6, 6, 6, 6], [7, 8, 9, 9, 9]]
    assert layout(mask.flip(1)) is None  # left-padded
    assert layout(torch.ones((3, 4), dtype=torch.bool)) is None  # nothing to drop
    assert layout(torch.zeros((3, 4), dtype=torch.bool)) is None  # no token at all


def test_varlen_switch(model, monkeypatch):
    """COMPOSER_VARLEN=0 keeps the bins layout (compiled models take the flat one: see
    test_a_compiled_model_always_takes_the_flat_layout)."""
    from composer.runtime import varlen

    tokens, mask = batch([12, 3, 7, 10], 12, model.config.vocab_size, seed=5)
    assert varlen.logits(model, tokens, mask) is not None
    monkeypatch.setenv("COMPOSER_VARLEN", "0")
    assert varlen.logits(model, tokens, mask) is None


@pytest.mark.parametrize("arch, window, flat", [("llama", None, True), ("mistral", 32, True), ("mistral", 8, False)])
def test_varlen_other_architectures_and_sliding_windows(arch, window, flat):
    """Other decoders take the flat layout too; a sliding window narrower than the rows is not per-row causal
    attention, so that forward falls back to the bins layout (the window wider than every row is honoured).
    Logits equal the padded forward's either way, and so do the read positions' when only some are read."""
    import transformers

    from composer.runtime import varlen
    from composer.runtime.models import packed_logits

    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    if arch == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        m = transformers.MistralForCausalLM(transformers.MistralConfig(**kw, sliding_window=window))
    m.eval()
    tokens, mask = batch([20, 3, 11, 1, 17], 20, 64, seed=6)
    try:
        assert (varlen.logits(m, tokens, mask) is not None) == flat
        ref = m(input_ids=tokens, attention_mask=mask.long()).logits
        got = packed_logits(m, tokens, mask)
        assert torch.allclose(got[mask], ref[mask], atol=1e-5, rtol=0)
        read = _completion(mask, [8, 1, 5, 0, 6])  # positions read: the last MLP and the LM head skip the rest
        assert varlen.keep_rows(m)
        got = packed_logits(m, tokens, mask, read)
        assert torch.allclose(got[read], ref[read], atol=1e-5, rtol=0)
    finally:
        varlen._refused.discard(type(m))


# ------------------------------------------------------------------ positions nobody reads (varlen `read`)


def _rows_through(module):
    """Record how many token rows each forward of `module` (a Linear) gets."""
    rows = []
    module.register_forward_hook(lambda _m, a, _o: rows.append(a[0].numel() // a[0].shape[-1]))
    return rows


def _completion(mask, first):
    """[B, T] bool: each row's positions from `first[b]` on, real tokens only (an SFT loss's targets)."""
    return (torch.arange(mask.shape[1])[None] >= torch.tensor(first)[:, None]) & mask


def test_read_positions_skip_the_last_mlp_and_the_lm_head(model):
    """`read`: the last layer's MLP and the LM head run on the read positions only (counted at their
    products), every earlier layer on all real tokens; read logits and the gradients of a loss over them
    equal the padded forward's; the unread positions' logits are zeros."""
    from composer.runtime import varlen

    m = copy.deepcopy(model)
    V = m.config.vocab_size
    tokens, mask = batch([16, 5, 9, 12, 3], 16, V, seed=7)
    read = _completion(mask, [6, 2, 4, 3, 1])
    last = _rows_through(m.model.layers[-1].mlp.down_proj)
    first = _rows_through(m.model.layers[0].mlp.down_proj)
    head = _rows_through(m.get_output_embeddings())
    got = varlen.logits(m, tokens, mask, read)
    k = int(read.sum())
    assert 0 < k < int(mask.sum())
    assert (first, last, head) == ([int(mask.sum())], [k], [k])
    ref = m(input_ids=tokens, attention_mask=mask.long()).logits
    torch.testing.assert_close(got[read], ref[read], atol=1e-5, rtol=0)
    assert not got[mask & ~read].any()  # nobody reads them: zeros
    want = _grads(m, tokens, mask, lambda t, k_: m(input_ids=t, attention_mask=k_.long()).logits * read[..., None])
    got_g = _grads(m, tokens, mask, lambda t, k_: varlen.logits(m, t, k_, read) * read[..., None])
    for g, w in zip(got_g, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert any(float(g.abs().max()) > 0 for g in got_g)


def test_token_logprobs_read_positions_equal_and_zero_elsewhere(model):
    """token_logprobs(read=): log-probs and entropies at the read positions are those of the full forward
    (whose logits sit one position earlier), 0 elsewhere, on the flat layout and on every other path."""
    from composer.runtime.models import token_logprobs

    V = model.config.vocab_size
    tokens, mask = batch([14, 6, 10, 2], 14, V, seed=8)
    read = _completion(mask, [5, 3, 4, 1])
    with torch.no_grad():
        lp0, _, ent0 = token_logprobs(model, tokens, mask)
        lp, _, ent = token_logprobs(model, tokens, mask, read=read)
        lp_p, _, ent_p = token_logprobs(model, tokens, mask, read=read, prefix_len=torch.tensor([5, 3, 4, 1]))
    for a, e in ((lp, ent), (lp_p, ent_p)):
        torch.testing.assert_close(a[read], lp0[read], atol=1e-5, rtol=0)
        torch.testing.assert_close(e[read], ent0[read], atol=1e-5, rtol=0)
        assert not a[~read].any() and not e[~read].any()


def test_compiled_read_positions_are_one_graph_with_the_padded_gradients(model):
    """Under torch.compile (dynamic=True) the read count is one more symbolic size: three batches with other
    rows, widths and read positions share one graph, with the padded forward's gradients."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from composer.runtime import varlen

    m = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, dynamic=True)
    V = m.config.vocab_size
    for lens, first, T, seed in (([12, 5, 9, 3], [4, 2, 3, 1], 12, 3), ([7, 7, 2, 6, 4, 2], [3, 1, 1, 2, 2, 1], 7, 4),
                                 ([10, 10, 10], [6, 2, 5], 10, 5)):
        tokens, mask = batch(lens, T, V, seed=seed)
        read = _completion(mask, first)
        got = _grads(m, tokens, mask, lambda t, k: varlen.logits(compiled, t, k, read) * read[..., None])
        want = _grads(m, tokens, mask, lambda t, k: m(input_ids=t, attention_mask=k.long()).logits * read[..., None])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert varlen._HANDOFF.layout is None


def test_read_positions_keep_the_mlp_whole_where_it_is_not_position_wise_or_recomputed(model):
    """A mixture of experts (routing statistics span tokens) and gradient checkpointing (the backward
    recomputes the layer) keep the last MLP on every token; the LM head still runs on the read positions,
    and the read logits are the padded forward's."""
    import transformers

    from composer.runtime import varlen

    torch.manual_seed(0)
    moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, attn_implementation="sdpa")).eval()
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt.train()
    for m in (moe, ckpt):
        V = m.config.vocab_size
        tokens, mask = batch([12, 4, 9], 12, V, seed=9)
        read = _completion(mask, [5, 2, 3])
        assert not varlen.keep_rows(m)
        head = _rows_through(m.get_output_embeddings())
        got = varlen.logits(m, tokens, mask, read)
        assert head == [int(read.sum())]
        ref = m(input_ids=tokens, attention_mask=mask.long()).logits
        torch.testing.assert_close(got[read], ref[read], atol=1e-5, rtol=0)
        g = _grads(m, tokens, mask, lambda t, k: varlen.logits(m, t, k, read) * read[..., None])
        w = _grads(m, tokens, mask, lambda t, k: m(input_ids=t, attention_mask=k.long()).logits * read[..., None])
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_read_positions_switch(model, monkeypatch):
    """COMPOSER_READ_ONLY=0 runs every position (for comparisons): the last MLP sees all real tokens."""
    from composer.runtime import varlen

    m = copy.deepcopy(model)
    tokens, mask = batch([10, 4, 7], 10, m.config.vocab_size, seed=10)
    last = _rows_through(m.model.layers[-1].mlp.down_proj)
    monkeypatch.setenv("COMPOSER_READ_ONLY", "0")
    got = varlen.logits(m, tokens, mask, _completion(mask, [4, 2, 3]))
    assert last == [int(mask.sum())] and got[mask].abs().sum(-1).min() > 0  # every position computed
