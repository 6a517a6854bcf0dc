"""Padding-free forward passes (composer/runtime/models.py: pack_rows, packed_logits): right-padded rows
packed into fewer rows give the padded forward's logits and log-probs, gradients included."""

from __future__ import annotations

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


def test_packed_forward_equals_padded_forward(model):
    from composer.runtime.models import pack_rows, packed_logits, token_logprobs

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
