"""float32 matrix products on CPU through oneDNN instead of MKL's sgemm.

PyTorch's CPU `mm` / `linear` in float32 call MKL's sgemm. On an AMD CPU, MKL takes its AVX2 path even when
the core has AVX-512 (MKL dispatches on the vendor), so it reaches about half of the core's float32 peak. The
oneDNN library that ships inside PyTorch (`torch.ops.mkldnn._linear_pointwise`, the kernel inductor uses for
frozen linears) dispatches on the instruction set, in float32, with the same IEEE arithmetic: only the order of
the K-sums can differ (float rounding, ~1e-6 relative). On the development machine (AMD EPYC with AVX-512,
one thread) the toy step's products ([2048, 128] x [128, 384] and the like) run at 73-96 GFLOPS through MKL,
and through oneDNN at 165-227 forward and for the input gradient, 118-194 for the weight gradient (whose
transposed operand oneDNN copies). `composer bench --throughput --matmul` prints the table for the machine
at hand.

    use_onednn(model)      # every nn.Linear of the model computes through `linear` below on CPU float32
    linear(x, w, b)        # y = x w^T + b, differentiable (x [..., K], w [N, K], b [N] or None)

On anything else (a GPU, a reduced dtype, autocast, a PyTorch built without oneDNN, COMPOSER_ONEDNN=0) the
layers call `torch.nn.functional.linear` as before. Under torch.compile the product stays one opaque operator
(`onednn_mm`) between inductor's fused kernels.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def available() -> bool:
    """oneDNN is built in and not switched off (COMPOSER_ONEDNN=0)."""
    return (os.environ.get("COMPOSER_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _raw(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] times w^T (w [N, K]; strided views allowed) plus b: [M, N]."""
    return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")


@torch.library.custom_op("composer::onednn_mm", mutates_args=())
def onednn_mm(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] @ w^T (w [N, K]) through oneDNN: [M, N]. An operator of its own so that autograd and
    torch.compile see one opaque product (inductor cannot lower oneDNN's linear on plain weights)."""
    return _raw(x2, w)


@onednn_mm.register_fake
def _(x2, w):
    return x2.new_empty(x2.shape[0], w.shape[0])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    x2, w = ctx.saved_tensors
    # a broadcast gradient (stride 0, e.g. from `y.sum()`) sends oneDNN's weight-gradient product to a
    # reference path ~600x slower (92 ms instead of 0.14 ms at [64, 384], one thread): give it memory
    g = g.contiguous()
    gx = gw = None
    if ctx.needs_input_grad[0]:
        gx = onednn_mm(g, w.t())  # g w: [M, K]
    if ctx.needs_input_grad[1]:
        # g^T x: [N, K]. oneDNN copies a transposed first operand, so the narrower of g and x goes first
        # (as x^T g, transposed back when N > K); with the copy it is still ~1.6-2x MKL's time
        gw = onednn_mm(x2.t(), g.t()).t() if g.shape[1] > x2.shape[1] else onednn_mm(g.t(), x2.t())
    return gx, gw


onednn_mm.register_autograd(_backward, setup_context=_setup)


# oneDNN's call costs ~12 us more than MKL's; below ~2^20 multiply-adds MKL's sgemm is the faster of the two.
# A decode step's products (one row per sequence) stay with MKL too: inside the sampler's loop, 64 rows on the
# toy student, MKL's were ~15% faster over a whole generation (one thread, AMD EPYC Zen 4, 2026-12-03), and
# under torch.compile they are plain `mm` calls where oneDNN's would be an opaque custom operator.
MIN_MACS = 1 << 20
MIN_ROWS = 128


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this product goes through oneDNN: CPU float32 tensors, no autocast, oneDNN available, at least
    MIN_ROWS rows and MIN_MACS multiply-adds."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (_ON and x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and rows >= MIN_ROWS and rows * x.shape[-1] * w.shape[0] >= MIN_MACS)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)` (x [..., K], w [N, K], b [N]), through oneDNN where `applies`."""
    if not applies(x, w):
        return F.linear(x, w, b)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    grads = x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and grads):
        y = onednn_mm(x2, w)
        y = y if b is None else y + b
    else:  # inference (the sampler's decode step): the bare kernel, without the operator's dispatch
        y = _raw(x2, w, b)
    return y.view(*x.shape[:-1], w.shape[0])  # [..., N]


class OneDNNLinear(torch.nn.Linear):
    """An nn.Linear whose forward is `linear` (the same parameters, state dict and repr)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn(model: torch.nn.Module) -> torch.nn.Module:
    """Turn every plain nn.Linear of `model` into a OneDNNLinear (in place; the class only, nothing is copied).
    A no-op where oneDNN is not available. Returns the model."""
    if not available():
        return model
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = OneDNNLinear
    return model


_ON = available()
