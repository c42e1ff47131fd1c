"""The prompt's path on CUDA (rows past the decode kernels): dequantise to W in x's dtype (qdequant_chunks, the
16-byte and the per-column kernel, column slices), x @ W through cuBLAS in slices (qdequant_mm, one call), and the
residual stream's add inside that GEMM (qmatmul_add_), against float64 references.  Helpers from test_cuda_kernels."""
from __future__ import annotations

import pytest
import torch
from test_cuda_kernels import LAYOUTS, _need_kernels, poison_allocator, random_packed, rel_err

from exl_core.formats.packed import dequantize_reference

pytestmark = pytest.mark.cuda


def test_dequant_column_slices_and_sliced_matmul(monkeypatch):
    """qdequant_chunks(col0, cols) gives exactly those columns of the whole dequantisation; the large-M path
    takes weights wider than two slices slice by slice (each GEMM writing y's columns in place) and matches
    the float64 reference, with and without bias."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_dequant as cd
    pw = random_packed(LAYOUTS[1], 4 * 67, perm=True, bias=True)      # every width, N = 268
    W = dequantize_reference(pw)
    c = pw.to("cuda")
    ch = cc.chunk_table(pw.groups, "cuda")
    ops = torch.ops.exl_core
    for dt in (torch.float16, torch.bfloat16):                       # N = 268: the whole weight takes 1 column
        full = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dt)    # per thread, slices 0/64 and
        assert rel_err(full, W) < (1e-3 if dt == torch.float16 else 4e-3)         # 100/-1 take 8 (16-byte stores)
        for col0, cols in ((0, 64), (64, 100), (200, 68), (267, 1), (100, -1)):
            poison_allocator()
            part = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dt, col0, cols)
            assert torch.equal(part, full[:, col0:col0 + cols] if cols >= 0 else full[:, col0:]), (dt, col0)
    monkeypatch.setattr(cd, "DEQUANT_SLICE", 64)                     # slices of 64, 64, 64, 64, 12 columns
    x = torch.randn(40, pw.in_features, dtype=torch.float16)
    for bias in (None, c.bias.half()):
        poison_allocator()
        y = cd.dequant_mm(x.cuda(), c, ch, c.perm, bias)
        ref = x.double() @ W + (0 if bias is None else pw.bias.half().double())
        assert y.shape == (40, 268) and rel_err(y, ref) < 2e-3



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequant_mm_slices_bias_add_to(dtype, monkeypatch):
    """qdequant_mm, the prompt's dequantise + cuBLAS in one call: one W (N <= two slices) and slices of 64 or 100 with
    a narrower last one, without and with bias, and add_to (added in place and returned), against float64;
    dequant_mm passes DEQUANT_SLICE, DEQUANT_U4 (uniform 4-bit weights only)
    and DEQUANT_L2."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_dequant as cd
    pw = random_packed(LAYOUTS[1], 4 * 67, perm=True, bias=True)      # every width, act-order, N = 268
    W = dequantize_reference(pw)
    c = pw.to("cuda")
    ch = cc.chunk_table(pw.groups, "cuda")
    ops = torch.ops.exl_core
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}[dtype]
    x = torch.randn(40, pw.in_features).to(dtype)
    xc, bias = x.cuda(), c.bias.to(dtype)
    for slice_cols in (4096, 64, 100):                               # 268 / 64 x 4 + 12 / 100, 100, 68
        for b in (None, bias):
            poison_allocator()
            y = ops.qdequant_mm(xc, c.qweight, ch, c.scale, c.zero, c.perm, None, b, None, slice_cols, False, True)
            ref = x.double() @ W + (0 if b is None else b.double().cpu())
            assert y.shape == (40, 268) and rel_err(y, ref) < tol, (slice_cols, b is None)
        res = torch.randn(40, 268).to(dtype)
        got = res.cuda()
        out = ops.qdequant_mm(xc, c.qweight, ch, c.scale, c.zero, c.perm, None, None, got, slice_cols, False, False)
        assert out.data_ptr() == got.data_ptr() and rel_err(got, res.double() + x.double() @ W) < tol
    seen, real = [], ops.qdequant_mm

    def spy(*args):
        seen.append(args[9:])           # slice, uniform4, l2
        return real(*args)
    monkeypatch.setattr(ops, "qdequant_mm", spy)
    u4 = random_packed(LAYOUTS[0] * 3, 64, perm=True).to("cuda")
    for w, flag in ((c, False), (u4, True)):
        for l2 in (True, False):
            monkeypatch.setattr(cd, "DEQUANT_L2", l2)
            cd.dequant_mm(torch.randn(40, w.in_features, dtype=dtype, device="cuda"), w,
                           cc.chunk_table(w.groups, "cuda"), cc._perm_of(w, torch.device("cuda")), None)
            assert seen[-1] == (cd.DEQUANT_SLICE, flag and cd.DEQUANT_U4, l2)


_BAD_DEQUANT_MM = """
import torch, exl_core
from exl_core.ops.cuda_candidates import chunk_table
from test_cuda_kernels import LAYOUTS, random_packed
c = random_packed(LAYOUTS[1], 268, perm=True).to("cuda")
x = torch.randn(40, c.in_features, dtype=torch.float16, device="cuda")
bad = {"x must be contiguous": (x[:, :-32].contiguous(), None, None, 64),
       "not with add_to": (x, torch.zeros(268, dtype=x.dtype, device="cuda"), torch.zeros_like(x[:, :1]), 64),
       "add_to must be": (x, None, torch.zeros(39, 268, dtype=x.dtype, device="cuda"), 64),
       "slice must be positive": (x, None, None, 0)}
for msg, (xa, b, add, sl) in bad.items():
    try:
        torch.ops.exl_core.qdequant_mm(xa, c.qweight, chunk_table(c.groups, "cuda"), c.scale, c.zero, c.perm, None,
                                       b, add, sl)
    except RuntimeError as e:
        print("raised:", msg in str(e) and "qdequant_mm" in str(e))
"""


def test_dequant_mm_refuses_bad_input():
    """qdequant_mm refuses x of the wrong K, bias with add_to, add_to of the wrong shape and a slice of 0 with an error
    naming the op and the problem (in a child process, so that a crash fails this test only)."""
    _need_kernels()
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-c", _BAD_DEQUANT_MM], capture_output=True, text=True,
                       cwd=Path(__file__).parent)
    assert r.returncode == 0 and r.stdout.split() == ["raised:", "True"] * 4, (r.returncode, r.stdout,
                                                                               r.stderr[-800:])


@pytest.mark.parametrize("perm", [True, False], ids=["act_order", "in_order"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_vectorised_equals_per_column_and_float64(perm, dtype):
    """The 16-byte dequantise (8 columns a thread, 512 a block) writes exactly what the per-column kernel writes,
    and both match float64, for every width: N = 536 is one full block and 24 columns; the slice from column 1 is
    misaligned, so it takes the per-column kernel."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import chunk_table
    pw = random_packed(LAYOUTS[1] + [(5, 64), (6, 32), (8, 64), (2, 64)], 8 * 67, perm=perm)
    W = dequantize_reference(pw)
    c = pw.to("cuda")
    ch = chunk_table(pw.groups, "cuda")
    ops = torch.ops.exl_core
    poison_allocator()
    full = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype)
    assert rel_err(full, W) < (1e-3 if dtype == torch.float16 else 4e-3)
    poison_allocator()
    part = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype, 1, -1)
    assert torch.equal(part, full[:, 1:])


@pytest.mark.parametrize("perm", [True, False], ids=["act_order", "in_order"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_uniform4_instance_equals_width_switch(perm, dtype, monkeypatch):
    """qdequant_chunks(uniform4=True), the instance without the width switch that dequant_w takes for uniform 4-bit
    weights (GPTQ 4-bit), writes exactly what the width switch's instance writes, 16-byte and per-column (a
    misaligned slice), whole and sliced, and matches float64; dequant_w passes the flag only where every chunk is
    4-bit (EXL_CORE_DEQUANT_U4=0: never)."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_dequant as cd
    pw = random_packed(LAYOUTS[0] * 3, 8 * 67, perm=perm)
    W = dequantize_reference(pw)
    c = pw.to("cuda")
    ch = cc.chunk_table(pw.groups, "cuda")
    ops = torch.ops.exl_core
    for col0, cols in ((0, -1), (1, -1), (64, 200)):
        poison_allocator()
        switch = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype, col0, cols, None, False)
        poison_allocator()
        u4 = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype, col0, cols, None, True)
        assert torch.equal(u4, switch), (col0, cols)
    assert rel_err(u4, W[:, 64:264]) < (1e-3 if dtype == torch.float16 else 4e-3)
    seen, real = [], ops.qdequant_chunks

    def spy(*args):
        seen.append(args[9])            # uniform4
        return real(*args)
    monkeypatch.setattr(ops, "qdequant_chunks", spy)
    mixed = random_packed(LAYOUTS[1], 64, perm=perm).to("cuda")
    for w, flag in ((c, True), (mixed, False)):
        cd.dequant_w(w, cc.chunk_table(w.groups, "cuda"), cc._perm_of(w, torch.device("cuda")), dtype)
        assert seen[-1] is flag
    monkeypatch.setattr(cd, "DEQUANT_U4", False)
    cd.dequant_w(c, ch, cc._perm_of(c, torch.device("cuda")), dtype)
    assert seen[-1] is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequant_l2_window_writes_the_same(dtype, monkeypatch):
    """qdequant_chunks(l2=True), the launch with W's lines persisting in L2 (l2_persist.cuh), writes exactly what the
    launch without the window writes (16-byte, per-column and fp32 instances, a twin-free act-order weight, whole and
    sliced, past the window's hitRatio on a W larger than the set-aside; again after l2_reset put the set-aside back to
    0); dequant_w passes DEQUANT_L2."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_dequant as cd
    ops = torch.ops.exl_core
    for pw in (random_packed(LAYOUTS[1], 8 * 67, perm=True), random_packed(LAYOUTS[0] * 8, 8192, perm=False)):
        c = pw.to("cuda")
        ch = cc.chunk_table(pw.groups, "cuda")
        for col0, cols in ((0, -1), (1, 100), (64, -1)):
            poison_allocator()
            plain = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype, col0, cols, None, False, False)
            poison_allocator()
            held = ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype, col0, cols, None, False, True)
            assert torch.equal(held, plain), (pw.in_features, col0, cols)
            ops.l2_reset()                  # set-aside back to 0: the next window raises it again
            assert torch.equal(ops.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, dtype, col0, cols, None,
                                                   False, True), plain)
    ops.l2_reset()                          # the tests after this one run with all of L2
    seen, real = [], ops.qdequant_chunks

    def spy(*args):
        seen.append(args[10])           # l2
        return real(*args)
    monkeypatch.setattr(ops, "qdequant_chunks", spy)
    p = cc._perm_of(c, torch.device("cuda"))
    for flag in (True, False):
        monkeypatch.setattr(cd, "DEQUANT_L2", flag)
        cd.dequant_w(c, ch, p, dtype)
        assert seen[-1] is flag


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qmatmul_add_into_residual(monkeypatch, dtype):
    """qmatmul_add_ on the prompt path adds x @ W into the residual in place (the GEMM's beta = 1), in one piece
    and in column slices, within the output rounding of the float64 sum; decode-sized rows and a weight with a
    bias are refused, with the residual untouched."""
    _need_kernels()
    from exl_core.ops import cuda_dequant as cd
    from exl_core.ops.qmatmul import adds_in_place, qmatmul_add_
    pw = random_packed(LAYOUTS[1], 8 * 67, perm=True)                 # every width, act-order, N = 536
    W = dequantize_reference(pw)
    c = pw.to("cuda")
    for slice_cols in (cd.DEQUANT_SLICE, 128):                        # one GEMM; slices 128 x 4 + 24
        monkeypatch.setattr(cd, "DEQUANT_SLICE", slice_cols)
        x = torch.randn(48, pw.in_features).to(dtype)
        res = torch.randn(48, pw.out_features).to(dtype)
        want = res.double() + x.double() @ W
        got = res.cuda()
        ptr = got.data_ptr()
        assert adds_in_place(got, x.cuda(), c) and qmatmul_add_(got, x.cuda(), c)
        assert got.data_ptr() == ptr and rel_err(got, want) < (2e-3 if dtype == torch.float16 else 1e-2)
    small = torch.randn(32, pw.in_features).to(dtype).cuda()
    res = torch.randn(32, pw.out_features).to(dtype).cuda()
    before = res.clone()
    assert not qmatmul_add_(res, small, c) and torch.equal(res, before)
    c.bias = torch.randn(pw.out_features).to(dtype).cuda()
    big = torch.randn(48, pw.in_features).to(dtype).cuda()
    res = torch.randn(48, pw.out_features).to(dtype).cuda()
    before = res.clone()
    assert not qmatmul_add_(res, big, c) and torch.equal(res, before)
