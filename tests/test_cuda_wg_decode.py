"""qgemm_wg_decode and qgemm_wg_swiglu (csrc/cuda/qgemm_wg_decode_cuda.cu, the stream-K wgmma kernel of
qgemm_wg_streamk_kernel.cuh): y_i = x W_i, or silu(x W_gate) * (x W_up), for 17..32 rows of uniform 4-bit weights on
an sm_90 GPU, against float64 references on shapes whose column tiles split across blocks and leave tails, outputs on
NaN-poisoned memory; the same bits again (its counters left zero, its split tiles added in block order) and with the
weight boxes after the PDL wait; the atomics' finish; the dispatch switch and size floor; a model's decode step on
it; and its refusals.  Skips without an sm_90 GPU."""
from __future__ import annotations

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err, tiny_gptq_model

pytestmark = pytest.mark.cuda


def _need_wg():
    _need_kernels()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("qgemm_wg_decode needs an sm_90 GPU (wgmma)")
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not _has_cuda_kernel("qgemm_wg_decode"):
        pytest.fail("exl_core._C has CUDA kernels but no qgemm_wg_decode")


ATOMIC, ORDERED = 0, 1                   # split tiles' finishes (cuda_wg_decode.py FINISHES)


def _call(x, cs, chunks, finish=ORDERED):
    return torch.ops.exl_core.qgemm_wg_decode(x, [c.qweight for c in cs], chunks, [c.scale for c in cs],
                                              [c.zero for c in cs], finish)


# (group layout of (bits, rows), N, weights): K 640 with 128- and 64-row groups; N with a tail past 128-column tiles;
# K 4096 in 128-row groups (a 7B layer's K) over three weights, so most tiles span two blocks of the stream; K 16,384
# and one column tile, which the whole grid shares (each finish adds many blocks' slots).
CASES = [([(4, 128), (4, 64), (4, 192), (4, 64), (4, 192)], 328, 1),
         ([(4, 128)] * 5, 1024, 2),
         ([(4, 128)] * 32, 4096, 3),
         ([(4, 128)] * 128, 128, 1)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("M", [17, 24, 32])
def test_wg_decode_vs_float64(case, M, monkeypatch):
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
    again = _call(x.cuda(), cs, chunks)           # the counters the first launch left zero; the same sums
    atomic = _call(x.cuda(), cs, chunks, ATOMIC)          # split tiles by fp32 atomics into the zeroed sums
    atomic2 = _call(x.cuda(), cs, chunks, ATOMIC)         # which the first left zero
    monkeypatch.setenv("EXL_CORE_WG_EARLY_W", "0")
    late = _call(x.cuda(), cs, chunks)
    for y, y2, y3, ya, ya2, pw in zip(ys, again, late, atomic, atomic2, pws):
        ref = x.double() @ dequantize_reference(pw)
        assert y.shape == (M, N) and rel_err(y, ref) < 2e-3
        assert torch.equal(y2, y) and torch.equal(y3, y)
        assert rel_err(ya, ref) < 2e-3 and rel_err(ya2, ref) < 2e-3


@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("M", [17, 32])
@pytest.mark.parametrize("with_tails", [False, True])
@pytest.mark.parametrize("finish", [ORDERED, ATOMIC])
def test_wg_swiglu_vs_float64(case, M, with_tails, finish):
    """silu(x W_gate) * (x W_up) in one launch against float64, against the plain launch's two outputs through
    silu_mul (the same fp16 roundings; the sums may split differently, so up to a rounding step), the same bits
    twice (the ordered finish; by atomics close); with tails, each chunk's copy at its tail columns."""
    _need_wg()
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.cuda_candidates import chunk_table
    layout, N, _ = CASES[case]
    if with_tails and N % 32:
        pytest.skip("tails need N a multiple of 32")
    gate, up = (random_packed(layout, N, perm=False, seed=200 + i) for i in range(2))
    K = gate.in_features
    x = (torch.randn(M, K) * 0.5).half()
    cs = [pw.to("cuda") for pw in (gate, up)]
    chunks = [chunk_table(pw.groups, "cuda") for pw in (gate, up)]
    tails, cols = None, 0
    if with_tails:                                # every third chunk also at the columns past N, in reverse order
        c = N // 32
        tails = torch.full((c,), -1, dtype=torch.int32)
        picked = list(range(0, c, 3))
        for i, ci in enumerate(reversed(picked)):
            tails[ci] = N + 32 * i
        cols = N + 32 * len(picked)
        tails = tails.cuda()
    poison_allocator()
    args = (x.cuda(), [c.qweight for c in cs], chunks, [c.scale for c in cs], [c.zero for c in cs], tails, cols)
    h = torch.ops.exl_core.qgemm_wg_swiglu(*args, finish)
    again = torch.ops.exl_core.qgemm_wg_swiglu(*args, finish)   # the pair and tile counters left zero (and the sums)
    assert h.shape == (M, cols or N)
    if finish == ATOMIC:
        assert rel_err(again[:, :N], h[:, :N].double().cpu()) < 1e-3
    else:                                                        # the ordered finish: one order, the same bits
        assert torch.equal(again, h)
    xd = x.double()
    ref = torch.nn.functional.silu(xd @ dequantize_reference(gate)) * (xd @ dequantize_reference(up))
    assert rel_err(h[:, :N], ref) < 3e-3
    g, u = _call(x.cuda(), cs, chunks)
    assert (h[:, :N].float() - silu_mul(g, u).float()).abs().max().item() <= 4 * ref.abs().max().item() * 2 ** -10
    if with_tails:
        for ci in range(N // 32):
            if tails[ci] >= 0:
                t0 = int(tails[ci])
                assert torch.equal(h[:, t0:t0 + 32], h[:, 32 * ci:32 * ci + 32])


def test_wg_swiglu_through_the_dispatcher(monkeypatch):
    """ops.swiglu's pair takes qgemm_wg_swiglu where the policy allows it ("pair"), qgemm_wide_swiglu when it is
    off, and both match float64."""
    _need_wg()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_swiglu
    from exl_core.ops import cuda_wg_decode as wg
    from exl_core.ops.swiglu import qmatmul_swiglu
    monkeypatch.setattr(wg, "MIN_ELEMS", 0)
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)
    gate, up = (random_packed([(4, 128)] * 8, 512, perm=False, seed=300 + i) for i in range(2))
    cs = [pw.to("cuda") for pw in (gate, up)]
    x = (torch.randn(24, 1024) * 0.5).half()
    xd = x.double()
    ref = torch.nn.functional.silu(xd @ dequantize_reference(gate)) * (xd @ dequantize_reference(up))
    calls = []
    run = wg.run_swiglu
    monkeypatch.setattr(wg, "run_swiglu", lambda *a, **k: calls.append(1) or run(*a, **k))
    for kinds, on_wg in (("pair", True), ("multi,single", False)):
        monkeypatch.setattr(wg, "WG_DECODE", kinds)
        assert cuda_swiglu._on_wg(x.cuda(), 24, cs) == on_wg
        n = len(calls)
        h = qmatmul_swiglu(x.cuda(), *cs)
        assert (len(calls) > n) == on_wg and rel_err(h, ref) < 3e-3


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
    old = wg.WG_DECODE, wg.MIN_ELEMS
    try:
        wg.WG_DECODE = "1"
        assert not cc._wg_ok(32, cs, dev, "multi")        # 3 x 1,024 x 256 elements: below the size floor
        wg.MIN_ELEMS = 3 * 1024 * 256
        assert cc._wg_ok(32, cs, dev, "multi") and not cc._wg_ok(32, cs[:1], dev, "single")
        wg.MIN_ELEMS = 0
        wg.WG_DECODE = "multi"
        assert cc._wg_ok(32, cs, dev, "multi") and not cc._wg_ok(32, cs[:1], dev, "single")
        assert not any(cc._wg_ok(m, cs, dev, "multi") for m in (1, 8, 16, 33))
        wg.WG_DECODE = "single"
        assert cc._wg_ok(20, cs[:1], dev, "single") and not cc._wg_ok(20, cs, dev, "multi")
        assert cc._route(20, cs[0], torch.empty(20, 1024, dtype=torch.float16, device="cuda")) == "wg"
        wg.WG_DECODE = "1"
        x = torch.randn(20, 1024, dtype=torch.float16)
        many = qm.qmatmul_many(x.cuda(), cs)
        one = qm.qmatmul(x.cuda(), cs[1])
        for y, pw in zip(many, pws):
            assert rel_err(y, x.double() @ dequantize_reference(pw)) < 2e-3
        assert rel_err(one, x.double() @ dequantize_reference(pws[1])) < 2e-3
        odd = random_packed([(4, 32)] * 8, 256, perm=False)            # 32-row groups: two scale pairs a tile
        assert not cc._wg_ok(20, [odd.to("cuda")], dev, "single")
        permuted = random_packed([(4, 128)] * 2, 256, perm=True).to("cuda")
        assert not cc._wg_ok(20, [permuted], dev, "single")
    finally:
        wg.WG_DECODE, wg.MIN_ELEMS = old


@pytest.mark.parametrize("what,msg", [("rows", "rows of x"), ("k", "multiple of 64"), ("shape", "qweight 1"),
                                      ("finish", "finish must be 0")])
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
        _call(x, pws, chunks, 2 if what == "finish" else ORDERED)   # 2: a removed finish


def test_model_decode_on_wg(tiny_model_factory, tmp_path, monkeypatch):
    """A GPTQ model's 20-row decode step with the stream-K kernels taking q/k/v, o, down and the SwiGLU pair (size
    floor off: the model is tiny) against the same step without them: the same logits up to fp16 rounding."""
    _need_wg()
    from exl_core.ops import cuda_wg_decode as wg
    model = tiny_gptq_model(tiny_model_factory, tmp_path, kv_heads=4)      # q, k, v of one shape: one launch
    monkeypatch.setattr(wg, "MIN_ELEMS", 0)
    calls = {"plain": 0, "pair": 0}
    run, run_swiglu = wg.run, wg.run_swiglu
    monkeypatch.setattr(wg, "run", lambda *a, **k: calls.__setitem__("plain", calls["plain"] + 1) or run(*a, **k))
    monkeypatch.setattr(wg, "run_swiglu",
                        lambda *a, **k: calls.__setitem__("pair", calls["pair"] + 1) or run_swiglu(*a, **k))
    B, T = 20, 9
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    nxt = torch.randint(0, model.config.vocab_size, (B, 1))
    out = {}
    for on in ("1", "0"):
        monkeypatch.setattr(wg, "WG_DECODE", on)
        kv = [model.new_sequence_kv(T + 4) for _ in range(B)]
        model.forward_batch(ids.cuda(), kv)
        before = dict(calls)
        out[on] = model.forward_batch(nxt.cuda(), kv)
        L = model.config.num_hidden_layers
        if on == "1":       # q/k/v, o and down a layer, and the pair
            assert calls["plain"] - before["plain"] == 3 * L and calls["pair"] - before["pair"] == L
        else:
            assert calls == before
    assert rel_err(out["1"], out["0"].double().cpu()) < 5e-3
