"""Gradients through frozen quantized / dense layers (ops/input_grad.py): dL/dx against autograd on the float64
dequantised weight, the weight itself frozen; and dtype casts of a model leave the packed scales bit for bit."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from exl_core.model.linear import QuantLinear
from exl_core.ops.dispatch import has_op

from test_qmatmul import rand_packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["packed", "dense"])
def test_input_gradient_is_dy_times_w_transposed(kind, dtype):
    rng = random.Random(11)
    pw = rand_packed(160, 48, rng)
    w64 = dequantize_reference(pw, torch.float64)                    # [K, N] in x's order
    layer = QuantLinear.from_packed(pw) if kind == "packed" else \
        QuantLinear.from_dense(w64.t().float(), pw.bias.float())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 160, generator=g).to(dtype).requires_grad_()
    up = torch.randn(2, 3, 48, generator=g, dtype=torch.float64)       # a loss that weighs every output
    y = layer(x)
    (y.double() * up).sum().backward()
    x64 = x.detach().double().requires_grad_()
    ((x64 @ w64 + pw.bias.double()) * up).sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype and x.grad.shape == x.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol * float(x64.grad.abs().max()))
    assert float(x64.grad.abs().max()) > 1e-2                         # a gradient that can show a wrong one
    assert not any(t.requires_grad for t in layer.buffers())          # the weight stays frozen


def test_no_graph_where_autograd_does_not_record():
    rng = random.Random(12)
    layer = QuantLinear.from_packed(rand_packed(64, 16, rng))
    x = torch.randn(1, 64, requires_grad=True)
    with torch.no_grad():
        assert layer(x).grad_fn is None
    assert layer(x.detach()).grad_fn is None
    assert layer(x).grad_fn is not None


@pytest.mark.skipif(not has_op("qmatmul"), reason="exl_core._C not built")
def test_lora_adapter_trains_over_a_quantized_layer():
    """A trainable LoRA-style pair after a frozen quantized layer gets gradients through the layer after it."""
    rng = random.Random(13)
    first, second = (QuantLinear.from_packed(rand_packed(64, 64, rng)) for _ in range(2))
    a = torch.nn.Parameter(torch.randn(64, 4) * 0.1)
    x = torch.randn(5, 64)
    h = first(x)
    out = second(h + h @ a @ torch.ones(4, 64) * 0.01)
    out.square().sum().backward()
    assert a.grad is not None and float(a.grad.abs().max()) > 0


def test_dtype_cast_keeps_packed_scales_bit_for_bit():
    """model.to(torch.bfloat16) / .half() move a packed layer's scale and zero (fp32, the kernels' dtype) without
    rounding them; float payloads (a bias, a dense weight) follow the cast."""
    rng = random.Random(14)
    layer = QuantLinear.from_packed(rand_packed(64, 16, rng, bias=False))
    scale, zero = layer.packed.scale.clone(), layer.packed.zero.clone()
    x = torch.randn(2, 64)
    ref = layer(x)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        cast(layer)
        assert layer.packed.scale.dtype == torch.float32 and torch.equal(layer.packed.scale, scale)
        assert torch.equal(layer.packed.zero, zero)
    assert torch.equal(layer(x), ref)
    dense = QuantLinear.from_dense(torch.randn(16, 64))
    dense.to(torch.bfloat16)
    assert dense.w_t.dtype == torch.bfloat16
