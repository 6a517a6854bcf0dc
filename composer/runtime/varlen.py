"""Padding-free forward passes with per-row attention ("varlen"), on any device and any SDPA kernel.

Right-padded rows [B, T] become one flat sequence [1, N] of their N real tokens (positions restart at each
row), so the embeddings, norms, projections, MLPs and the LM head run on N tokens instead of B * T. Only
attention needs the rows apart: at each layer, the flat queries, keys and values are gathered back into the
padded grid [B, H, T, D], run through transformers' own SDPA attention with the causal flag (no mask, so
the fused kernels apply) and the real positions are gathered back into the flat sequence. Pad slots of the
grid hold copies of their row's last real token; causality keeps them out of every real token's attention.

This is what flash-attention's varlen kernels do on a GPU, built from parts every backend has: it is the
padding-free layout of TRL's `padding_free=True` without its flash-attention requirement. The layout
reaches the attention through the model's keyword arguments (transformers passes them down to every
attention call, gradient-checkpointed recomputation included), and every attention layer must report that
it honoured it: a model that does not pass the keywords through gets the packed-bins forward instead.

Positions nobody reads. A caller that reads only some positions' logits (`read`: an SFT loss reads the
completion's, not the prompt's) gets the LM head on those positions only (transformers' `logits_to_keep`) and,
where the last layer's MLP is position-wise, that MLP on those positions only: its output at a position
reaches nothing but that position's logits, while the keys and values every position attends to come from
the earlier layers and the last layer's attention, which still run on every token. Their logits and
gradients are the full forward's (up to float rounding); the other positions' logits are zeros.

Measured on the toy student's SFT step (one thread, 32 rows of at most 57 tokens): see the README's throughput
section; `COMPOSER_VARLEN=0` switches it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from composer.runtime.models import checkpointing, full_attention, right_padded, unwrapped

KEY = "composer_varlen"  # the keyword that carries the layout to the attention functions


@dataclass
class Layout:
    """Where the flat sequence's tokens sit in the padded grid.

    grid [B, T] long: the flat index of each (row, t) slot (a pad slot: its row's last real token).
    real [N] long: the grid slot of each flat token. used: attention calls that honoured this layout in the
    current forward. keep [K] long or None: the flat tokens whose logits are read (None: all), handed to the
    last layer's MLP by the attention calls. B, T, N and K are read from the tensors' shapes, so under
    torch.compile they are the graph's symbolic sizes (one graph for every batch), not constants.
    """

    grid: torch.Tensor
    real: torch.Tensor
    used: int = 0
    keep: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.grid.shape[0]

    @property
    def width(self) -> int:
        return self.grid.shape[1]

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, N, D] flat -> [B, H, T, D] padded (a view of a gathered [B, T, H, D])."""
        x = x[0].transpose(0, 1)  # [N, H, D]
        return x.index_select(0, self.grid.reshape(-1)).view(*self.grid.shape, *x.shape[1:]).transpose(1, 2)

    def to_flat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] padded -> [1, N, H, D] flat (real slots only)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.real)[None]


def layout(attention_mask: torch.Tensor, unpadded: bool = False) -> Layout | None:
    """The flat layout of right-padded rows (attention_mask [B, T] bool, each row a prefix of True), or None
    when a row is not right-padded, no row has a token, or (unless `unpadded`) there is no padding to drop."""
    B, T = attention_mask.shape
    if not right_padded(attention_mask):
        return None
    lens = attention_mask.sum(1)  # [B]
    t = torch.arange(T, device=attention_mask.device)
    n = int(lens.sum())
    if n == 0 or (n == B * T and not unpadded):
        return None
    real = attention_mask.reshape(-1).nonzero().squeeze(1)  # [N]
    flat_of = torch.zeros(B * T, dtype=torch.long, device=attention_mask.device)
    flat_of[real] = torch.arange(n, device=attention_mask.device)
    last = (torch.cumsum(lens, 0) - 1).clamp(min=0)  # [B] flat index of each row's last real token
    grid = torch.where(t[None] < lens[:, None], flat_of.view(B, T), last[:, None])  # [B, T]
    return Layout(grid, real)


_inner = None  # the "sdpa" attention function this module wraps
_refused: set[type] = set()  # model classes whose attention did not honour the layout


class _Handoff:
    """The layout whose `keep` the last layer's MLP applies next: set by every attention call of a layout
    with `keep` (only the last layer's MLP is hooked, so the last attention's is the one taken), taken by
    the MLP's hooks (`keep_rows`) in the same forward. The MLP is called without the model's keyword arguments,
    so the layout reaches it here; torch.compile traces this as a side effect of the forward (no guard, no
    recompile)."""

    layout: Layout | None = None


_HANDOFF = _Handoff()


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa" attention, per row when the call carries a `Layout` (query [1, H, N, D]);
    unchanged otherwise. Returns (output [1, N, H, D] or as the wrapped function, None)."""
    lay = kwargs.pop(KEY, None)
    window = kwargs.get("sliding_window")
    if lay is None or (window is not None and lay.width > window):  # a window inside a row: not ours to honour
        return _inner(module, query, key, value, attention_mask, **kwargs)
    lay.used += 1
    if lay.keep is not None:  # for the last layer's MLP, which runs on `keep` only
        _HANDOFF.layout = lay
    kwargs.pop("position_ids", None)  # flat positions; the grid's causal order is each row's
    out, _ = _inner(module, lay.to_grid(query), lay.to_grid(key), lay.to_grid(value), None, **kwargs)
    return lay.to_flat(out), None  # out: [B, T, H, D]


def install() -> None:
    """Wrap transformers' "sdpa" attention (once per process); calls without a layout are unchanged."""
    global _inner
    if _inner is not None:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention


def _take_rows(mlp, args):
    lay = _HANDOFF.layout
    return None if lay is None else (args[0].index_select(1, lay.keep),)  # [1, N, C] -> [1, K, C]


def _put_rows(mlp, args, out):
    lay, _HANDOFF.layout = _HANDOFF.layout, None
    if lay is None:
        return None
    full = out.new_zeros(out.shape[0], lay.real.shape[0], out.shape[2])  # [1, N, C]: unread rows get 0
    return full.index_copy(1, lay.keep, out)


def _last_mlp(model):
    """The last decoder layer's MLP when it is made of nn.Linear layers and parameter-free parts only (so
    position-wise), else None: a block holding other parameters (the fused experts of transformers'
    mixture-of-experts blocks, for one) is left whole."""
    layers = getattr(getattr(unwrapped(model), "model", None), "layers", None)
    mlp = getattr(layers[-1], "mlp", None) if isinstance(layers, torch.nn.ModuleList) and len(layers) else None
    if mlp is None or not all(isinstance(m, torch.nn.Linear) or not any(True for _ in m.parameters(recurse=False))
                              for m in mlp.modules()):
        return None
    return mlp


def keep_rows(model) -> bool:
    """Hook the last layer's position-wise MLP (once per model) so that a forward whose layout has `keep`
    runs it on those rows only; False where the model has no such MLP or recomputes layers in its backward
    (gradient checkpointing would recompute the MLP at another size)."""
    mlp = _last_mlp(model)
    if mlp is None or checkpointing(model):
        return False
    if not getattr(mlp, "_composer_keep_rows", False):
        mlp.register_forward_pre_hook(_take_rows)
        mlp.register_forward_hook(_put_rows)
        mlp._composer_keep_rows = True
    return True


def _keeps_logits(model) -> bool:
    """The model's forward takes transformers' `logits_to_keep` (the LM head on some positions only)."""
    import inspect

    return "logits_to_keep" in inspect.signature(type(unwrapped(model)).forward).parameters


def _attention_layers(model) -> int | None:
    """How many attention calls one forward of a plain decoder makes (its layer count), or None when the
    model is not one: sliding or mixed layer types, a non-sdpa attention, or not transformers' code. (A
    sliding window set on full-attention layers is checked per call, against the rows' width.)"""
    inner = unwrapped(model)
    cfg = getattr(inner, "config", None)
    if cfg is None or not type(inner).__module__.startswith("transformers."):
        return None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not full_attention(cfg):
        return None
    return getattr(cfg, "num_hidden_layers", None)


def logits(model, tokens: torch.Tensor, attention_mask: torch.Tensor,
           read: torch.Tensor | None = None) -> torch.Tensor | None:
    """The model's logits [B, T, V] of right-padded rows from one flat forward, or None where this layout
    does not apply (see `layout` and `_attention_layers`; `COMPOSER_VARLEN=0`). Pad positions get their
    row's last real position's logits, as `packed_logits` gives them.

    read [B, T] bool or None: the positions whose logits the caller reads. The LM head, and the last layer's
    MLP where it is position-wise (`keep_rows`), then run on those positions only; the others' logits are
    zeros (and pads copy their row's last real position, read or not). `COMPOSER_READ_ONLY=0` runs every
    position.

    A compiled model (train.compile) takes this layout for every batch, unpadded ones included: one call
    signature [1, N] whose N (and B, T) are symbolic, so one graph serves every batch."""
    if os.environ.get("COMPOSER_VARLEN", "1") == "0":
        return None
    layers = _attention_layers(model)
    compiled = hasattr(model, "_orig_mod")
    lay = layout(attention_mask, unpadded=compiled) if layers and type(unwrapped(model)) not in _refused else None
    if lay is None:
        return None
    install()
    tokens_flat = tokens.reshape(-1).index_select(0, lay.real)[None]  # [1, N]
    pos = torch.arange(lay.width, device=tokens.device).repeat(lay.rows).index_select(0, lay.real)[None]
    extra = {}
    if read is not None and os.environ.get("COMPOSER_READ_ONLY", "1") != "0" and _keeps_logits(model):
        keep = read.reshape(-1).index_select(0, lay.real).nonzero().squeeze(1)  # [K] flat tokens read
        if 0 < keep.numel() < lay.real.numel():
            extra["logits_to_keep"] = keep
            if keep_rows(model):
                lay.keep = keep
    # an all-ones mask: transformers then skips building one (SDPA's causal flag covers it); no cache
    try:
        out = model(input_ids=tokens_flat, position_ids=pos, attention_mask=torch.ones_like(tokens_flat),
                    use_cache=False, **{KEY: lay}, **extra).logits[0]  # [N, V] or [K, V]
    finally:
        _HANDOFF.layout = None  # never left for another forward, whatever happened in this one
    if lay.used != layers:  # some attention layer never saw the layout: its output mixed rows
        _refused.add(type(unwrapped(model)))
        return None
    if "logits_to_keep" in extra:
        out = out.new_zeros(lay.real.shape[0], out.shape[1]).index_copy(0, extra["logits_to_keep"], out)  # [N, V]
    return out.index_select(0, lay.grid.reshape(-1)).view(lay.rows, lay.width, -1)
