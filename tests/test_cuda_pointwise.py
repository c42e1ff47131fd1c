"""The small CUDA ops between the projections (csrc/cuda/pointwise_cuda.cu and the dense linear): RMSNorm with
the residual add, silu * mul, rope (both launches), against float64 references on odd shapes; rope's NaN rows
for positions outside the table.  Helpers from test_cuda_kernels."""
from __future__ import annotations

import pytest
import torch
from test_cuda_kernels import _need_kernels, poison_allocator, rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [576, 4096, 77, 8200], ids=["vec576", "vec4096", "scalar77", "scalar-wide"])
def test_rms_norm_residual_vs_float64(dtype, H):
    _need_kernels()
    from exl_core.ops.norm import RMS_NORM, rms_norm
    x, r = torch.randn(13, H).to(dtype), torch.randn(13, H).to(dtype)
    w = (torch.rand(H) + 0.5).to(dtype)
    h64 = x.double() + r.double()
    ref = w.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref0 = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    xc, rc, wc = x.cuda(), r.cuda(), w.cuda()
    assert RMS_NORM.select(x=xc, weight=wc, eps=1e-5, residual=rc).name == "cuda"
    poison_allocator()
    y, h = rms_norm(xc, wc, 1e-5, rc)
    y0 = rms_norm(xc, wc, 1e-5)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(h, h64) < tol and rel_err(y, ref) < tol and rel_err(y0, ref0) < tol
    # a model's weight (weight_static: read before the PDL wait) gives the same bits, x made by the kernel just before
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    assert _has_cuda_kernel("rms_norm_static")
    ys, hs = torch.ops.exl_core.rms_norm_static(xc * 1, rc * 1, wc, 1e-5)      # the op itself, not a fallback
    assert torch.equal(ys, y) and torch.equal(hs, h)
    assert torch.equal(torch.ops.exl_core.rms_norm_static(xc * 1, None, wc, 1e-5)[0], y0)
    ys, hs = rms_norm(xc * 1, wc, 1e-5, rc * 1, weight_static=True)             # and the dispatcher's route to it
    assert torch.equal(ys, y) and torch.equal(hs, h)


@pytest.mark.parametrize("shape", [(7, 333), (5, 256)], ids=["scalar", "16-byte"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_mul_vs_float64(dtype, shape):
    _need_kernels()
    from exl_core.ops.activation import silu_mul
    g, u = torch.randn(*shape).to(dtype) * 3, torch.randn(*shape).to(dtype)
    ref = torch.nn.functional.silu(g.double()) * u.double()
    poison_allocator()
    y = silu_mul(g.cuda(), u.cuda())
    assert rel_err(y, ref) < (2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 12], ids=["vec64", "vec128", "scalar12"])
def test_rope_vs_float64(D, dtype):
    """D % 8 == 0 runs q and k in one vectorised launch, other D the per-pair kernel."""
    _need_kernels()
    from exl_core.ops.rope import apply_rope, cos_sin_table
    T, Hq, Hkv = 11, 9, 3
    q, k = torch.randn(T, Hq, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype)
    pos = torch.randint(0, 300, (T,))
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    cs = cos_sin_table(inv.float(), 512)
    ang = pos.double()[:, None] * inv[None]                                  # (T, D/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def ref(x):
        x = x.double()
        a, b = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    poison_allocator()
    qo, ko = apply_rope(q.cuda(), k.cuda(), pos.cuda(), cs.cuda())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(qo, ref(q)) < tol and rel_err(ko, ref(k)) < tol


def test_dense_linear_cuda_vs_float64():
    _need_kernels()
    from exl_core.ops.linear import dense_linear
    x, w, b = torch.randn(5, 96).half(), torch.randn(96, 41).half(), torch.randn(41).half()
    ref = x.double() @ w.double() + b.double()
    poison_allocator()
    assert rel_err(dense_linear(x.cuda(), w.cuda(), b.cuda()), ref) < 2e-3


def test_rope_position_outside_table_gives_nan_rows():
    """On CUDA apply_rope skips the host range check (2 syncs per layer); the kernel marks the rows."""
    _need_kernels()
    from exl_core.ops.rope import apply_rope, cos_sin_table
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cs = cos_sin_table(inv, 16).cuda()
    q, k = torch.randn(3, 2, 64, device="cuda").half(), torch.randn(3, 1, 64, device="cuda").half()
    qo, ko = apply_rope(q, k, torch.tensor([0, 16, 5], device="cuda"), cs)
    assert torch.isnan(qo[1]).all() and torch.isnan(ko[1]).all()
    assert not torch.isnan(qo[[0, 2]]).any() and not torch.isnan(ko[[0, 2]]).any()

