"""qgemm_wg_decode (csrc/cuda/qgemm_wg_decode_cuda.cu, the stream-K wgmma kernel of qgemm_wg_streamk_kernel.cuh):
y_i = x W_i for 17..32 rows of uniform 4-bit weights on an sm_90 GPU, against float64 references on shapes whose
column tiles split across blocks and leave tails, outputs on NaN-poisoned memory; its workspace left zero (a second
launch agrees with the first); the dispatch switch; and its refusals.  Skips without an sm_90 GPU."""
from __future__ import annotations

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err

pytestmark = pytest.mark.cuda


def _need_wg():
    _need_kernels()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("qgemm_wg_decode needs an sm_90 GPU (wgmma)")
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not _has_cuda_kernel("qgemm_wg_decode"):
        pytest.fail("exl_core._C has CUDA kernels but no qgemm_wg_decode")


def _call(x, cs, chunks):
    return torch.ops.exl_core.qgemm_wg_decode(x, [c.qweight for c in cs], chunks, [c.scale for c in cs],
                                              [c.zero for c in cs])


# (group layout of (bits, rows), N, weights): K 640 with 128- and 64-row groups; N with a tail past 128-column tiles;
# K 4096 in 128-row groups (a 7B layer's K) over three weights, so most tiles span two blocks of the stream.
CASES = [([(4, 128), (4, 64), (4, 192), (4, 64), (4, 192)], 328, 1),
         ([(4, 128)] * 5, 1024, 2),
         ([(4, 128)] * 32, 4096, 3)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("M", [17, 24, 32])
def test_wg_decode_vs_float64(case, M):
    _need_wg()
    from exl_core.ops.cuda_candidates import chunk_table
    layout, N, n = CASES[case]
    pws = [random_packed(layout, N, perm=False, seed=100 * case + i) for i in range(n)]   # one group layout
    K = pws[0].in_features
    x = torch.randn(M, K, dtype=torch.float16)
    cs = [pw.to("cuda") for pw in pws]
    chunks = [chunk_table(pw.groups, "cuda") for pw in pws]
    poison_allocator()
    ys = _call(x.cuda(), cs, chunks)
    again = _call(x.cuda(), cs, chunks)           # the workspace and counters the first launch left zero
    for y, y2, pw in zip(ys, again, pws):
        ref = x.double() @ dequantize_reference(pw)
        assert y.shape == (M, N) and rel_err(y, ref) < 2e-3
        assert rel_err(y2, y.double().cpu()) < 1e-3


def test_wg_decode_dispatch_switch():
    """EXL_CORE_WG_DECODE picks the kernel for q/k/v-style launches ("multi") and single weights ("single") at 17..32
    rows only, and the library's path then matches the float64 reference."""
    _need_wg()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_wg_decode as wg
    from exl_core.ops import qmatmul as qm
    pws = [random_packed([(4, 128)] * 8, 256, perm=False, seed=7 + i) for i in range(3)]
    cs = [pw.to("cuda") for pw in pws]
    dev = torch.device("cuda", torch.cuda.current_device())
    old = wg.WG_DECODE
    try:
        wg.WG_DECODE = "multi"
        assert cc._wg_ok(32, cs, dev, multi=True) and not cc._wg_ok(32, cs[:1], dev, multi=False)
        assert not any(cc._wg_ok(m, cs, dev, multi=True) for m in (1, 8, 16, 33))
        wg.WG_DECODE = "single"
        assert cc._wg_ok(20, cs[:1], dev, multi=False) and not cc._wg_ok(20, cs, dev, multi=True)
        assert cc._route(20, cs[0], torch.empty(20, 1024, dtype=torch.float16, device="cuda")) == "wg"
        wg.WG_DECODE = "1"
        x = torch.randn(20, 1024, dtype=torch.float16)
        many = qm.qmatmul_many(x.cuda(), cs)
        one = qm.qmatmul(x.cuda(), cs[1])
        for y, pw in zip(many, pws):
            assert rel_err(y, x.double() @ dequantize_reference(pw)) < 2e-3
        assert rel_err(one, x.double() @ dequantize_reference(pws[1])) < 2e-3
        odd = random_packed([(4, 32)] * 8, 256, perm=False)            # 32-row groups: two scale pairs a tile
        assert not cc._wg_ok(20, [odd.to("cuda")], dev, multi=False)
        permuted = random_packed([(4, 128)] * 2, 256, perm=True).to("cuda")
        assert not cc._wg_ok(20, [permuted], dev, multi=False)
    finally:
        wg.WG_DECODE = old


@pytest.mark.parametrize("what,msg", [("rows", "rows of x"), ("k", "multiple of 64"), ("shape", "qweight 1")])
def test_wg_decode_refuses_bad_input(what, msg):
    _need_wg()
    from exl_core.ops.cuda_candidates import chunk_table
    pws = [random_packed([(4, 128)] * 2, 128, perm=False, seed=3).to("cuda"),
           random_packed([(4, 128)] * 2, 256 if what == "shape" else 128, perm=False, seed=4).to("cuda")]
    chunks = [chunk_table(pw.groups, "cuda") for pw in pws]
    x = torch.randn(33 if what == "rows" else 17, 256, dtype=torch.float16, device="cuda")
    if what == "k":
        x = x[:, :224].contiguous()
    with pytest.raises(RuntimeError, match=msg):
        _call(x, pws, chunks)
