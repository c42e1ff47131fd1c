"""ops/norm_fold.py off the GPU: the reference of qmatmul_many_normed is the norm then qmatmul_many (float64 check),
and qmatmul_add_ss_ declines (nothing done) where no kernel folds the add.  On the CPU the folds never run; the model's
split Block path that asks for them is covered by tests/test_model_vs_hf.py.  The CUDA kernels:
tests/test_cuda_norm_fold.py."""
from __future__ import annotations

import random

import torch

from exl_core.formats.packed import dequantize_reference
from exl_core.ops import norm_fold
from test_cuda_attn_out_order import _perm
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


def test_ext_places_maps_every_column_to_its_places():
    H, extra = 96, 20
    perm = _perm(H, extra, seed=11)
    places = norm_fold.ext_places(perm, H)
    assert places.dtype == torch.int32 and places.shape == (H, 2)
    for n in range(H):
        want = sorted(int(j) for j in torch.nonzero(perm == n).flatten())
        got = [int(j) for j in places[n] if j >= 0]
        assert got == want and (len(want) == 2) == bool(places[n, 1] >= 0)
    x = torch.randn(3, H)
    copy = torch.full((3, perm.numel()), float("nan"))
    for i in range(2):                                  # what the producer's epilogue does, scattered per column
        ok = places[:, i] >= 0
        copy[:, places[ok, i].long()] = x[:, ok]
    assert torch.equal(copy, x[:, perm])
    # a column read three times, one never read, or an entry outside [0, H): no places
    assert norm_fold.ext_places(torch.tensor([0, 1, 1, 1]), 2) is None
    assert norm_fold.ext_places(torch.tensor([0, 0]), 2) is None
    assert norm_fold.ext_places(torch.tensor([0, 2]), 2) is None


def test_many_normed_reference_on_an_extended_copy():
    """count: the copy repeats columns, so r comes from the producer's sums over the residual's own columns; the
    result is the plain norm's, gathered (float64 check)."""
    rng = random.Random(5)
    H, extra = 64, 32
    perm = _perm(H, extra, seed=5)
    pw = rand_packed(H + extra, 24, rng)
    res = (torch.randn(4, H) * 2).half()
    w = (torch.rand(H) + 0.5).half()
    ss = (res.float() ** 2).view(4, -1, 32).sum(-1).t().contiguous()     # [H / 32, rows], a producer's sums
    y = norm_fold.qmatmul_many_normed(res[:, perm].float(), w[perm].float(), 1e-6, ss, [pw], count=H)[0]
    xn = res.double() * torch.rsqrt(res.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    ref = xn[:, perm] @ dequantize_reference(pw) + pw.bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4)
    wrong = norm_fold.qmatmul_many_normed(res[:, perm].float(), w[perm].float(), 1e-6, ss, [pw], count=H + extra)[0]
    assert not torch.allclose(wrong.double(), ref, rtol=1e-2, atol=1e-2)   # the copy's own width would be wrong
    # without the sums an extended copy cannot be normalised: the reference says so rather than guess
    try:
        norm_fold.qmatmul_many_normed(res[:, perm].float(), w[perm].float(), 1e-6, None, [pw], count=H)
    except ValueError as e:
        assert "sums of squares" in str(e)
    else:
        raise AssertionError("an extended copy without sums was normalised")
