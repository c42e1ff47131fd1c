"""exl_core::dense_matmul (CPU kernel) and exl_core.ops.linear.dense_linear against float64
matmul on fresh random data, batch invariance, ISA paths, opcheck and the dispatcher."""
from __future__ import annotations

import pytest
import torch

from exl_core.errors import InputError
from exl_core.ops import linear as lin
from exl_core.ops.dispatch import has_op

needs_op = pytest.mark.skipif(not has_op("dense_matmul"), reason="exl_core._C not built with dense_matmul")


def reference(x, w_t, bias):
    y = x.double() @ w_t.double()
    return y if bias is None else y + bias.double()


def rel_err(y, ref) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_op(x, w_t, bias):
    poison = torch.full((x.shape[0], w_t.shape[1]), float("nan"), dtype=x.dtype)
    del poison  # NaN in the allocator's free list: unwritten outputs would show
    return torch.ops.exl_core.dense_matmul(x, w_t, bias)


@needs_op
@pytest.mark.parametrize("M", [1, 3, 8, 37, 512])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_576x1536(M, wdt):
    w_t = (torch.randn(576, 1536) * 0.05).to(wdt)
    bias = torch.randn(1536) if M % 2 else None
    x = torch.randn(M, 576)
    y = run_op(x, w_t, bias)
    assert y.shape == (M, 1536) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert rel_err(y, reference(x, w_t, bias)) < 1e-3


@needs_op
@pytest.mark.parametrize("K,N", [(1, 1), (7, 13), (96, 37), (33, 95), (577, 50)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 13, 26])
def test_odd_shapes(K, N, M):
    w_t = torch.randn(K, N)
    x = torch.randn(M, K)
    bias = torch.randn(N)
    y = run_op(x, w_t, bias)
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(x, w_t, bias)) < 1e-3


@needs_op
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_bf16_input(wdt):
    x = torch.randn(19, 200).to(torch.bfloat16)
    w_t = torch.randn(200, 70).to(wdt)
    y = run_op(x, w_t, None)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference(x, w_t, None)) < 1e-2
    assert torch.equal(y, run_op(x.float(), w_t, None).to(torch.bfloat16))


@needs_op
def test_empty_k_gives_bias():
    bias = torch.randn(5)
    y = run_op(torch.randn(3, 0), torch.randn(0, 5), bias)
    assert torch.equal(y, bias.expand(3, 5))


@needs_op
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])   # the direct path's two instances
def test_batch_invariance(dtype):
    K, N = 576, 1000
    w_t = torch.randn(K, N).to(dtype)
    bias = torch.randn(N)
    x = torch.randn(512, K)
    full = run_op(x, w_t, bias)
    for M in (1, 2, 3, 4, 7, 64):       # 1-4: the direct path's row blocks
        for start in (0, 100, 512 - M):
            assert torch.equal(run_op(x[start:start + M].contiguous(), w_t, bias), full[start:start + M])
    order = torch.randperm(512)
    assert torch.equal(run_op(x[order].contiguous(), w_t, bias), full[order])


@needs_op
@pytest.mark.parametrize("M", [3, 4, 6])          # 3-4: the small-M direct path's narrower AVX2 blocks, N 45 a tail
def test_isa_paths_bit_identical(M):
    x, w_t, bias = torch.randn(M, 100), torch.randn(100, 45), torch.randn(45)
    outs = []
    try:
        for level in (2, 1, 0):
            torch.ops.exl_core.matmul_isa(level)
            outs.append(run_op(x, w_t, bias))
    finally:
        torch.ops.exl_core.matmul_isa(2)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_op
def test_bad_arguments():
    op = torch.ops.exl_core.dense_matmul
    with pytest.raises(RuntimeError, match="K = 8"):
        op(torch.randn(2, 8), torch.randn(9, 4), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(2, 8), torch.randn(4, 8).t(), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 8), torch.randn(8, 4).half(), None)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 8), torch.randn(8, 4), torch.randn(5))
    with pytest.raises(InputError, match="pre-transposed"):
        lin.dense_linear(torch.randn(2, 8), torch.randn(4, 8))


@needs_op
def test_opcheck():
    torch.library.opcheck(torch.ops.exl_core.dense_matmul.default,
                          (torch.randn(3, 40), torch.randn(40, 20), torch.randn(20)))
    torch.library.opcheck(torch.ops.exl_core.dense_matmul.default,
                          (torch.randn(2, 40).to(torch.bfloat16), torch.randn(40, 20).to(torch.bfloat16), None))


def test_dense_linear_dispatch():
    x = torch.randn(2, 3, 64)
    w_t = torch.randn(64, 24)
    bias = torch.randn(24)
    y = lin.dense_linear(x, w_t, bias)
    assert y.shape == (2, 3, 24)
    assert rel_err(y.reshape(6, 24), reference(x.reshape(6, 64), w_t, bias)) < 1e-3
    if has_op("dense_matmul"):
        assert lin.DISPATCH.select(x=x, w_t=w_t, bias=bias).name == "cpu_fused"
    reasons = dict(lin.DISPATCH.reasons(x=x.half(), w_t=w_t.half(), bias=None))
    assert reasons["cpu_fused"] is not None and reasons["torch_ref"] is None
    assert lin.dense_linear(x.half(), w_t.half()).dtype == torch.float16
    # non-contiguous w_t falls back to the reference rather than failing
    wt_nc = torch.randn(24, 64).t()
    assert rel_err(lin.dense_linear(x, wt_nc).reshape(6, 24), reference(x.reshape(6, 64), wt_nc, None)) < 1e-3
