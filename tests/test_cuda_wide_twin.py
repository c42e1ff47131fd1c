"""qgemm_wide's TWIN instances (csrc/cuda/qgemm_wide_kernel.cuh): the extra rows of an EXL2 weight rewritten as
uniform 4-bit rows (formats/uniform4.py) folded into their main chunks, on the layer's x already in its act-order
(the permuted norm's output, as Prepermuted layers read it).  Against float64 references of the original weights,
and against the same launch with the extra rows as K rows of their own."""
from __future__ import annotations

import pytest
import torch

from exl_core.formats.packed import PackedWeight, dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err

pytestmark = pytest.mark.cuda

TWIN_LAYOUTS = [
    [(5, 128), (4, 128), (4, 128), (3, 128)] * 2,                # the H200 bench's widths (5/4/3 bits)
    [(8, 128), (4, 128), (6, 128), (5, 128), (2, 128), (4, 128)],  # every width that splits, and 2-bit
]


def unpermuted(u: PackedWeight) -> PackedWeight:
    """u read by an x already in its order (model/linear.py _without_perm)."""
    return PackedWeight(u.qweight, u.groups, u.scale, u.zero, None, u.k_rows, u.out_features, u.bias, u.meta, None)


def rewritten(layout, Ns, seed):
    """[(weight, its uniform 4-bit rewrite)] of one layout and one act-order (loader.share_input_perms: q/k/v or
    gate/up), N columns each."""
    from exl_core.formats.uniform4 import as_uniform4
    first = random_packed(layout, Ns[0], perm=True, seed=seed)
    out = []
    for i, n in enumerate(Ns):
        w = first if i == 0 else random_packed(layout, n, perm=False, seed=seed + i)
        pw = PackedWeight(w.qweight, w.groups, w.scale, w.zero, first.perm, first.in_features, n, None).validate()
        u = as_uniform4(pw, max_growth=10.0)
        assert u is not None and u.rows > u.in_features and torch.equal(u.perm, out[0][1].perm if out else u.perm)
        out.append((pw, u))
    return out


@pytest.mark.parametrize("layout", range(len(TWIN_LAYOUTS)))
@pytest.mark.parametrize("M", [17, 24, 32])
@pytest.mark.parametrize("N", [256, 4608])
@pytest.mark.parametrize("splits", [0, 1, 3])   # 1: a block walks every stage (slot reuse, refills); 3: partial stages
def test_twins_fold_into_the_main_chunks(layout, M, N, splits, monkeypatch):
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import qmatmul as qm
    monkeypatch.setattr(cc, "WIDE_TWIN_ON", True)          # off by default until measured (cuda_candidates)
    pairs = rewritten(TWIN_LAYOUTS[layout], (N, 128, N), seed=M * 100 + N)
    pws = [p for p, _u in pairs]
    views = [unpermuted(u).to("cuda") for _p, u in pairs]
    x = torch.randn(M, pws[0].in_features, dtype=torch.float16)
    xp = x.cuda()[:, pairs[0][1].perm.cuda()].contiguous()    # the permuted norm's output: the rows' columns
    refs = [x.double() @ dequantize_reference(pw) for pw in pws]
    for ws, rs in (([views[0]], refs[:1]), (views, refs)):     # one weight; q/k/v-style, one launch
        twins, k_main = cc._wide_twins(M, ws, xp.device)
        assert twins is not None and k_main == pws[0].in_features
        args = (xp, *cc._weights_args(ws, xp.device, xp.dtype), True, splits)
        kw = dict(min_group=min(cc._min_group(v) for v in ws), group_shift=cc._pws_group_shift(ws))
        poison_allocator()
        got = torch.ops.exl_core.qgemm_wide_multi(*args, **kw, twins=twins, k_main=k_main)
        plain = torch.ops.exl_core.qgemm_wide_multi(*args, **kw)
        for g, p, r in zip(got, plain, rs):
            assert rel_err(g, r) < 2e-3 and rel_err(p, r) < 2e-3 and rel_err(g, p.double().cpu()) < 2e-3
        # the twins are read: without them (a table of -1) the 5..8-bit groups lose their high halves
        none = torch.full_like(twins, -1)
        lost = torch.ops.exl_core.qgemm_wide_multi(*args, **kw, twins=none, k_main=k_main)
        assert all(rel_err(y, r) > 1e-2 for y, r in zip(lost, rs))
    # the dispatcher's route for Prepermuted layers takes the twins where qgemm_wide runs (73 column tiles at N 4608)
    assert cc._wide_ok(M, views, xp.device) == (N == 4608)
    if N == 4608:
        for y, r in zip(qm.qmatmul_many(xp, views), refs):
            assert rel_err(y, r) < 2e-3


@pytest.mark.parametrize("M", [17, 32])
@pytest.mark.parametrize("tails", [False, True])
def test_twins_in_the_swiglu_pair(M, tails, monkeypatch):
    """gate and up sharing one act-order (their extra rows alike), as the rewritten MLP runs them at batch 17..32."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    monkeypatch.setattr(cc, "WIDE_TWIN_ON", True)
    layout, N = TWIN_LAYOUTS[0], 1024
    (gate, ug), (up, uu) = rewritten(layout, (N, N), seed=M)
    views = [unpermuted(u).to("cuda") for u in (ug, uu)]
    x = torch.randn(M, gate.in_features, dtype=torch.float16)
    xp = x.cuda()[:, ug.perm.cuda()].contiguous()
    twins, k_main = cc._wide_twins(M, views, xp.device)
    assert twins is not None
    qweight, chunks, scale, zero, _p, bias = cc._weights_args(views, xp.device, xp.dtype)
    kw = dict(min_group=min(cc._min_group(v) for v in views), group_shift=cc._pws_group_shift(views))
    t, cols = None, 0
    if tails:                                     # every other 32-column chunk stored again after the N columns
        t = torch.full((N // 32,), -1, dtype=torch.int32)
        t[::2] = N + 32 * torch.arange(N // 64, dtype=torch.int32)
        t, cols = t.cuda(), N + N // 2
    poison_allocator()
    got = torch.ops.exl_core.qgemm_wide_swiglu(xp, qweight, chunks, scale, zero, bias, **kw, tails=t, out_cols=cols,
                                               twins=twins, k_main=k_main)
    plain = torch.ops.exl_core.qgemm_wide_swiglu(xp, qweight, chunks, scale, zero, bias, **kw, tails=t,
                                                 out_cols=cols)
    g64, u64 = x.double() @ dequantize_reference(gate), x.double() @ dequantize_reference(up)
    ref = torch.nn.functional.silu(g64) * u64
    assert rel_err(got[:, :N], ref) < 3e-3 and rel_err(plain[:, :N], ref) < 3e-3
    assert rel_err(got, plain.double().cpu()) < 3e-3
    if tails:
        sel = torch.nonzero(t.cpu() >= 0).flatten().tolist()
        for c in sel:
            d = int(t[c])
            assert torch.equal(got[:, d:d + 32], got[:, 32 * c:32 * c + 32])


def test_twins_refused_where_the_layout_differs(monkeypatch):
    """Weights whose extra rows lie differently cannot share one table: the launch runs them as K rows."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    monkeypatch.setattr(cc, "WIDE_TWIN_ON", True)
    (_a, ua), = rewritten(TWIN_LAYOUTS[0], (256,), seed=1)
    (_b, ub), = rewritten([(4, 128), (5, 128), (4, 128), (3, 128)] * 2, (256,), seed=2)
    va, vb = unpermuted(ua).to("cuda"), unpermuted(ub).to("cuda")
    assert cc._wide_twins(20, [va, vb], torch.device("cuda"))[0] is None
    assert cc._wide_twins(20, [va], torch.device("cuda"))[0] is not None
