"""ops/norm_fold.py off the GPU: the reference of qmatmul_many_normed is the norm then qmatmul_many (float64 check),
and qmatmul_add_ss_ declines (nothing done) where no kernel folds the add.  On the CPU the folds never run; the model's
split Block path that asks for them is covered by tests/test_model_vs_hf.py.  The CUDA kernels:
tests/test_cuda_norm_fold.py."""
from __future__ import annotations

import random

import torch

from exl_core.formats.packed import dequantize_reference
from exl_core.ops import norm_fold
from test_qmatmul import rand_packed


def test_many_normed_reference_is_norm_then_matmul():
    rng = random.Random(3)
    pws = [rand_packed(96, n, rng) for n in (40, 24)]
    res = torch.randn(5, 96) * 2
    w = torch.rand(96) + 0.5
    ys = norm_fold.qmatmul_many_normed(res, w, 1e-6, None, pws)
    x = res.double() * torch.rsqrt(res.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    for pw, y in zip(pws, ys):
        ref = x @ dequantize_reference(pw) + pw.bias.double()
        assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4)
    # off the GPU the CUDA candidate refuses (a CPU residual), so the float64 check above is the reference's
    assert norm_fold.DISPATCH_MANY_NORMED.choose(residual=res, weight=w, eps=1e-6, ss=None, pws=pws).name == "torch"


def test_add_ss_declines_off_the_gpu():
    rng = random.Random(4)
    pw = rand_packed(64, 32, rng)
    res = torch.randn(3, 32)
    before = res.clone()
    assert norm_fold.qmatmul_add_ss_(res, torch.randn(3, 64), pw) is None
    assert not norm_fold.adds_ss(res, torch.randn(3, 64), pw)
    assert torch.equal(res, before)                    # nothing done: the caller adds its own way
