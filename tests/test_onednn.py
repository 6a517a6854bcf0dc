"""float32 linears through oneDNN on CPU (composer/runtime/onednn.py): the same numbers as F.linear up to float
rounding, forward and gradients, and the kernel that ran is oneDNN's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from composer.runtime import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this PyTorch has no oneDNN")


def kernels(fn) -> dict[str, int]:
    """How many times each kernel ran inside fn()."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_linear_equals_f_linear_forward_and_backward_and_runs_on_onednn():
    g = torch.Generator().manual_seed(0)
    # x as a non-contiguous [B, T, K] view (a transpose), as the attention output reaches o_proj
    x0 = torch.randn(40, 16, 48, generator=g).transpose(0, 1)  # [16, 40, 48]: 640 x 48 x 40 multiply-adds
    w0 = torch.randn(40, 48, generator=g) * 0.1
    b0 = torch.randn(40, generator=g)
    up = torch.randn(16, 40, 40, generator=g)  # the upstream gradient
    out = {}
    for name, fn in (("ref", F.linear), ("onednn", onednn.linear)):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = fn(x, w, b)
        (y * up).sum().backward()
        out[name] = (y.detach(), x.grad, w.grad, b.grad)
    for a, r in zip(out["onednn"], out["ref"]):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6 * float(r.abs().max()))  # float32 sums of 40-640 terms

    # a trainable bias alone (a first layer under adapters: frozen input and weight) still gets its gradient
    b = b0.clone().requires_grad_()
    (onednn.linear(x0, w0, b) * up).sum().backward()
    torch.testing.assert_close(b.grad, out["ref"][3])

    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ran = kernels(lambda: onednn.linear(x, w).sum().backward())
    assert ran.get("mkldnn::_linear_pointwise", 0) == 3  # forward, grad of x, grad of w
    assert ran.get("aten::mm", 0) == 0 and ran.get("aten::addmm", 0) == 0


def test_a_broadcast_gradient_reaches_onednn_as_memory(monkeypatch):
    """`y.sum().backward()` hands the product a stride-0 gradient, which oneDNN serves on a very slow path:
    the backward products get contiguous operands (strides > 0), and the gradients stay F.linear's."""
    seen = []
    real = onednn._raw
    monkeypatch.setattr(onednn, "_raw", lambda a, b, bias=None: seen.append(0 in a.stride() + b.stride())
                        or real(a, b, bias))
    g = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(onednn.MIN_ROWS, 128, generator=g), torch.randn(384, 128, generator=g)
    grads = {}
    for name, fn in (("ref", F.linear), ("onednn", onednn.linear)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(x, w).sum().backward()
        grads[name] = (x.grad, w.grad)
    assert seen == [False, False, False]  # forward, input gradient, weight gradient
    for a, r in zip(grads["onednn"], grads["ref"]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4)


def test_small_products_decode_rows_other_dtypes_and_a_switched_off_onednn_keep_f_linear(monkeypatch):
    x, w = torch.randn(8, 128), torch.randn(128, 128)  # a decode step of 8 rows: MKL's call is the cheaper
    assert x.numel() * w.shape[0] < onednn.MIN_MACS
    assert torch.equal(onednn.linear(x, w), F.linear(x, w))
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: onednn.linear(x, w))
    # a decode step of 64 rows on the toy's MLP: many multiply-adds, but few rows: MKL's (as measured in the loop)
    x, w = torch.randn(64, 1, 128), torch.randn(768, 128)
    assert x.numel() * w.shape[0] >= onednn.MIN_MACS and 64 < onednn.MIN_ROWS
    assert torch.equal(onednn.linear(x, w), F.linear(x, w))
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: onednn.linear(x, w))
    assert "mkldnn::_linear_pointwise" in kernels(lambda: onednn.linear(torch.randn(onednn.MIN_ROWS, 128), w))
    x, w = torch.randn(1024, 64, dtype=torch.float64), torch.randn(64, 64, dtype=torch.float64)
    assert torch.equal(onednn.linear(x, w), F.linear(x, w))
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: onednn.linear(x, w))
    monkeypatch.setattr(onednn, "_ON", False)
    x, w = x.float(), w.float()
    assert x.numel() * w.shape[0] >= onednn.MIN_MACS
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: onednn.linear(x, w))
    assert torch.equal(onednn.linear(x, w), F.linear(x, w))
    monkeypatch.setenv("COMPOSER_ONEDNN", "0")
    assert not onednn.available()


def test_a_loaded_model_computes_through_onednn_with_the_plain_models_numbers():
    from transformers import AutoModelForCausalLM

    from composer.runtime.models import load_model, resolve

    ours = load_model("toy:student")
    plain = AutoModelForCausalLM.from_pretrained(resolve("toy:student"))  # transformers' own, MKL's sgemm
    linears = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is onednn.OneDNNLinear for m in linears)
    assert not any(type(m) is onednn.OneDNNLinear for m in plain.modules())
    assert ours.state_dict().keys() == plain.state_dict().keys()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # the tie survives the class change
    assert type(copy.deepcopy(ours).lm_head) is onednn.OneDNNLinear  # the rollout copy keeps it

    ids = torch.randint(4, 100, (4, 40), generator=torch.Generator().manual_seed(1))  # 160 rows: above MIN_MACS
    grads = {}
    for name, m in (("ours", ours), ("plain", plain)):
        m.zero_grad()
        logits = m(input_ids=ids).logits
        torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()
        grads[name] = (logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(grads["ours"][0], grads["plain"][0], rtol=1e-4, atol=1e-4)
    for n, g in grads["plain"][1].items():
        torch.testing.assert_close(grads["ours"][1][n], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))
    ran = kernels(lambda: ours(input_ids=ids))
    assert ran.get("mkldnn::_linear_pointwise", 0) == len(linears)  # every projection and the head
    assert ran.get("aten::mm", 0) == 0


def test_the_operator_compiles():
    """Under torch.compile the product stays one opaque operator (inductor cannot lower oneDNN's linear
    on plain weights): the compiled function gives the eager numbers."""
    w = torch.randn(64, 32, requires_grad=True)

    def f(x):
        return F.silu(onednn.linear(x, w)).sum()

    x = torch.randn(512, 32)  # 2^20 multiply-adds
    assert "mkldnn::_linear_pointwise" in kernels(lambda: f(x))
    eager = f(x)
    (ge,) = torch.autograd.grad(eager, w)
    compiled = torch.compile(f, backend="aot_eager")(x)
    (gc,) = torch.autograd.grad(compiled, w)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(gc, ge)
