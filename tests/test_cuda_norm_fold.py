"""The residual add and the RMSNorm folded into the decode GEMMs (ops/norm_fold.py, csrc/cuda/norm_fold_device.cuh):
the producer's add and sums of squares, and the consumers' normalised x, against float64 references and against the
unfused path (norm kernel, then the plain kernels).  Helpers from test_cuda_kernels."""
from __future__ import annotations

import os
import random

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err, tiny_gptq_model

pytestmark = pytest.mark.cuda

U4 = [(4, 128)] * 4                                   # GPTQ-like 4-bit g128, K = 512
MIXED = [(5, 128), (4, 256), (3, 128)]                # EXL2-like


def _args(c, xc):
    from exl_core.ops import cuda_candidates as cc
    return (c.qweight, cc._chunks_of(c), c.scale, c.zero, cc._perm_of(c, xc.device),
            None if c.bias is None else c.bias.half().contiguous(), cc._uniform4(c))


def _tile_ss(res: torch.Tensor) -> torch.Tensor:
    """float64 [ceil(N / 32), M] sums of squares of res's values per 32-column tile."""
    r = res.double().cpu()
    M, N = r.shape
    pad = torch.zeros(M, (N + 31) // 32 * 32, dtype=torch.float64)
    pad[:, :N] = r * r
    return pad.view(M, -1, 32).sum(-1).t().contiguous()


@pytest.mark.parametrize("layout", [U4, MIXED], ids=["u4", "mixed"])
@pytest.mark.parametrize("N", [4 * 131, 1024])                    # a partial last tile; whole tiles
@pytest.mark.parametrize("M", [1, 3, 8, 17, 32])                  # staged x; x from global memory
@pytest.mark.parametrize("perm", [False, True])
def test_add_ss_vs_float64(layout, N, M, perm):
    _need_kernels()
    pw = random_packed(layout, N, perm=perm, bias=random.random() < 0.5)
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    res = torch.randn(M, N, dtype=torch.float16)
    ref = res.double() + x.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
    c, xc, rc = pw.to("cuda"), x.cuda(), res.cuda()
    poison_allocator()
    q, ch, s, z, p, b, u4 = _args(c, xc)
    ss = torch.ops.exl_core.qgemm_kslice_add_(rc, xc, q, ch, s, z, p, b, u4)
    assert ss.shape == ((N + 31) // 32, M) and ss.dtype == torch.float32
    assert rel_err(rc, ref) < 2e-3                                # the residual, added in place
    torch.testing.assert_close(ss.double().cpu(), _tile_ss(rc), rtol=1e-5, atol=1e-6)   # of the values stored


@pytest.mark.parametrize("layout", [U4, MIXED], ids=["u4", "mixed"])
@pytest.mark.parametrize("M", [1, 4, 8])
def test_add_ss_silu_vs_float64(layout, M):
    """The down projection: silu(gate) * up staged, then the add and the sums (qgemm_kslice_add_ with up)."""
    _need_kernels()
    import torch.nn.functional as F
    pw = random_packed(layout, 4 * 67, perm=random.random() < 0.5)
    gate = torch.randn(M, pw.in_features, dtype=torch.float16)
    up = torch.randn(M, pw.in_features, dtype=torch.float16)
    h = (F.silu(gate.float()).half().float() * up.float()).half()       # silu_mul's roundings
    res = torch.randn(M, pw.out_features, dtype=torch.float16)
    ref = res.double() + h.double() @ dequantize_reference(pw)
    c, gc, rc = pw.to("cuda"), gate.cuda(), res.cuda()
    q, ch, s, z, p, b, u4 = _args(c, gc)
    ss = torch.ops.exl_core.qgemm_kslice_add_(rc, gc, q, ch, s, z, p, b, u4, up=up.cuda())
    assert rel_err(rc, ref) < 2e-3
    torch.testing.assert_close(ss.double().cpu(), _tile_ss(rc), rtol=1e-5, atol=1e-6)


def _normed_ref(res: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm's roundings in fp16: w * fp16(x * r), rounded (r from float64 sums)."""
    r = torch.rsqrt(res.double().pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * (res.double() * r).half().float()).half()


# K 512 (g128), 4096 (128 tiles of sums: all of them in a lane's 4 early loads, FoldSums0), 5120 (160 tiles: past
# them, fold_rms's loop) and 1440 (g32, 45 chunks: uneven warp splits)
NORMED_LAYOUTS = {"k512": U4, "k4096": [(4, 128)] * 32, "k5120": [(4, 128)] * 40, "k1440": [(4, 32)] * 45}


@pytest.mark.parametrize("M", [1, 5, 8, 17, 32])                  # qgemm_kslice staged rows; qgemm_wide
@pytest.mark.parametrize("layout", list(NORMED_LAYOUTS))
@pytest.mark.parametrize("widths", [(512, 128, 384), (4096, 1024, 1024), (11008, 11008)],
                         ids=["24tiles", "192tiles", "688tiles"])
def test_many_normed_vs_float64_and_unfused(M, layout, widths, monkeypatch):
    """192 column tiles of 32 (more than an H200's 132 SMs) run qgemm_kslice's kw 8 fold instance, as a 7B's q/k/v
    (384 tiles) does at batch 1; 688 (a 7B's gate/up: more than three 8-warp blocks an SM, at most six 4-warp ones on
    an H200) the kw 4 one, in one wave (wave_kw); 24 tiles run the kw 16 one."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import norm_fold
    from exl_core.ops.norm import rms_norm
    from exl_core.ops.qmatmul import qmatmul_many
    from exl_core.ops import cuda_norm_fold as nf
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)                 # qgemm_wide on these narrow launches too
    monkeypatch.setattr(nf, "NORM_FOLD_WIDE", True)                 # (off by default: slower end to end)
    if widths[0] > 512 and layout != "k512":
        pytest.skip("the wide launch once, at K 512, is enough")
    pws = [random_packed(NORMED_LAYOUTS[layout], n, perm=False, bias=random.random() < 0.3) for n in widths]
    K, eps = pws[0].in_features, 1e-5
    res = (torch.randn(M, K) * 3).half()
    w = (torch.rand(K) + 0.5).half()
    ss = _tile_ss(res).float()                                      # a producer's sums, computed independently
    pc = [pw.to("cuda") for pw in pws]
    rc, wc, sc = res.cuda(), w.cuda(), ss.cuda()
    # at 2..8 rows a launch of more than 3 tiles an SM runs qgemm_skinny (qgemm_kslice_fits; lifted by
    # EXL_CORE_KSLICE_U4_ONE_ROW=0), which does not fold: the reference (norm, then qmatmul_many) takes it, and the
    # values are checked alike
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one_row = os.environ.get("EXL_CORE_KSLICE_U4_ONE_ROW", "1") != "0"
    folds = not (one_row and 1 < M <= 8 and sum((n + 31) // 32 for n in widths) > 3 * sms)
    assert norm_fold.DISPATCH_MANY_NORMED.choose(residual=rc, weight=wc, eps=eps, ss=sc, pws=pc).name == \
        ("cuda" if folds else "torch")
    poison_allocator()
    ys = norm_fold.qmatmul_many_normed(rc, wc, eps, sc, pc)
    xn = _normed_ref(res, w, eps)
    unfused = qmatmul_many(rms_norm(rc, wc, eps), pc)
    for pw, y, u in zip(pws, ys, unfused):
        ref = xn.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
        assert y.shape == (M, pw.out_features) and rel_err(y, ref) < 2e-3
        assert rel_err(y, u.double().cpu()) < 2e-3


def test_many_normed_refuses_what_it_cannot_fold():
    """Act-order weights and missing sums go to the reference (norm, then qmatmul_many).  (A refused op call
    itself is not tried: a failing TORCH_CHECK kills the process on the device image, csrc/cuda/NOTES.md.)"""
    _need_kernels()
    from exl_core.ops import norm_fold
    pw = random_packed(U4, 256, perm=True).to("cuda")
    res = torch.randn(1, pw.in_features, dtype=torch.float16, device="cuda")
    w = torch.ones(pw.in_features, dtype=torch.float16, device="cuda")
    ss = _tile_ss(res).float().cuda()
    mixed = random_packed(MIXED, 256, perm=False).to("cuda")
    for s, p in ((ss, pw), (None, pw), (ss, mixed)):
        c = norm_fold.DISPATCH_MANY_NORMED.choose(residual=res, weight=w, eps=1e-6, ss=s, pws=[p])
        assert c.name == "torch"
        y = norm_fold.qmatmul_many_normed(res, w, 1e-6, s, [p])[0]
        ref = _normed_ref(res.cpu(), w.cpu(), 1e-6).double() @ dequantize_reference(p.to("cpu"))
        assert rel_err(y, ref) < 2e-3


@pytest.mark.parametrize("B", [1, 2, 20])
def test_model_decode_folded_matches_unfused(tiny_model_factory, tmp_path, B, monkeypatch):
    """A GPTQ model's decode step with the folds on (counted) and off: the same logits up to fp16 rounding."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_norm_fold as nf
    model = tiny_gptq_model(tiny_model_factory, tmp_path)
    wide_ok = cc._wide_ok

    def multi_wide(rows, pws, device, any_rows=False):
        """q/k/v and gate/up on qgemm_wide (as a 7B model's 96 and 172 tiles), o and down not (32 tiles)."""
        saved = cc.WIDE_U4_MIN_TILES
        cc.WIDE_U4_MIN_TILES = 1 if len(pws) > 1 else saved
        try:
            return wide_ok(rows, pws, device, any_rows)
        finally:
            cc.WIDE_U4_MIN_TILES = saved
    monkeypatch.setattr(cc, "_wide_ok", multi_wide)
    monkeypatch.setattr(nf, "NORM_FOLD_WIDE", True)
    T = 9
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    nxt = torch.randint(0, model.config.vocab_size, (B, 1))
    calls = {"add": 0, "normed": 0}
    from exl_core.ops import norm_fold
    for disp in (norm_fold.DISPATCH_ADD_SS, norm_fold.DISPATCH_MANY_NORMED):
        monkeypatch.setattr(disp, "candidates", list(disp.candidates))   # install() below edits the copies
    add_run, normed_run = nf._add_ss_run, nf._normed_run

    def counted(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run
    out = {}
    for on in (True, False):
        monkeypatch.setattr(nf, "NORM_FOLD_ON", on)
        monkeypatch.setattr(nf, "_add_ss_run", counted("add", add_run))
        monkeypatch.setattr(nf, "_normed_run", counted("normed", normed_run))
        nf.install()                                              # candidates bound to the counted runs
        kv = [model.new_sequence_kv(T + 4) for _ in range(B)]
        model.forward_batch(ids.cuda(), kv)
        before = dict(calls)
        out[on] = model.forward_batch(nxt.cuda(), kv)
        if on:
            L = model.config.num_hidden_layers
            assert calls["add"] - before["add"] == 2 * L          # o and down of every layer
            assert calls["normed"] - before["normed"] == 2 * L - 1   # every norm but the first layer's input norm
    assert rel_err(out[True], out[False].double().cpu()) < 5e-3
