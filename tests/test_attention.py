"""Paged attention and write_kv against a float64 brute force over the page pool."""
from __future__ import annotations

import math

import pytest
import torch

from exl_core.errors import InputError
from exl_core.ops import attention as A
from exl_core.ops.dispatch import has_op

# "cpu_scalar" is the C++ kernel with its vector paths switched off (portable fallback).
KERNELS = [c.name for c in A.PAGED_ATTENTION.candidates] + ["cpu_scalar"]


@pytest.fixture
def kernel(request):
    """Candidate name; for cpu_scalar the extension's ISA cap is lowered for the test."""
    name = request.param
    if name == "cpu_scalar":
        if not has_op("cpu_isa_limit"):
            pytest.skip("C++ extension not built")
        prev = torch.ops.exl_core.cpu_isa_limit(0)
        yield "cpu"
        torch.ops.exl_core.cpu_isa_limit(prev)
    else:
        yield name


def _kernel(name):
    return next(c for c in A.PAGED_ATTENTION.candidates if c.name == name)


def make_case(seqs, hq, hkv, d, page_size, window=None, dtype=torch.float32, spare_pages=3):
    """Random pool holding `seqs` = [(q_len, k_len), ...]; pages shuffled, unused pages NaN,
    pages entirely outside every query's window left out of the table (-1) and NaN too."""
    s = len(seqs)
    max_pages = max(-(-k // page_size) for _, k in seqs) + 1
    n_pages = sum(-(-k // page_size) for _, k in seqs) + spare_pages
    k_cache = torch.full((n_pages, page_size, hkv, d), math.nan, dtype=dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    table = torch.full((s, max_pages), -1, dtype=torch.int32)
    free = torch.randperm(n_pages).tolist()
    for i, (ql, kl) in enumerate(seqs):
        lo = max(0, kl - ql - window + 1) if window else 0
        for pg in range(-(-kl // page_size)):
            if (pg + 1) * page_size <= lo:
                continue                           # never visible: no page, table -1
            pid = free.pop()
            table[i, pg] = pid
            n = min(page_size, kl - pg * page_size)
            k_cache[pid, :n] = torch.randn(n, hkv, d).to(dtype)
            v_cache[pid, :n] = torch.randn(n, hkv, d).to(dtype)
    cu = torch.tensor([0] + [sum(q for q, _ in seqs[:i + 1]) for i in range(s)], dtype=torch.int64)
    q = torch.randn(int(cu[-1]), hq, d).to(dtype)
    lens = torch.tensor([k for _, k in seqs], dtype=torch.int64)
    return q, k_cache, v_cache, table, cu, lens


def brute_force(q, k_cache, v_cache, table, cu, lens, scale, window):
    """float64, one query row at a time, keys looked up position by position."""
    t, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    rep = hq // hkv
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    kf = k_cache.double().reshape(-1, hkv, d)
    vf = v_cache.double().reshape(-1, hkv, d)
    heads = torch.arange(hq) // rep                                   # kv head of each q head
    for s in range(table.shape[0]):
        a, b, kl = int(cu[s]), int(cu[s + 1]), int(lens[s])
        for j in range(b - a):
            pos = kl - (b - a) + j
            lo = max(0, pos - window + 1) if window else 0
            p = torch.arange(lo, pos + 1)
            slots = table[s].long()[p // ps] * ps + p % ps
            keys = kf[slots][:, heads]                               # (n, Hq, D)
            vals = vf[slots][:, heads]
            sc = torch.einsum("nhd,hd->hn", keys, q[a + j].double()) * scale   # (Hq, n)
            out[a + j] = torch.einsum("hn,nhd->hd", torch.softmax(sc, 1), vals)
    return out


def _run(name, *args):
    c = _kernel(name)
    kw = dict(zip(["q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k", "scale", "window"], args))
    reason = c.check(**kw)
    if reason is not None:
        pytest.skip(f"{name} refuses: {reason}")
    return c.run(**kw)


RAGGED = [(1, 1), (5, 37), (1, 300), (17, 17), (3, 130), (0, 9), (64, 200)]


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("d,hq,hkv,ps", [(64, 9, 3, 16), (128, 4, 4, 13), (64, 6, 2, 256)])
@pytest.mark.parametrize("window", [None, 40])
def test_paged_fp32_ragged(kernel, d, hq, hkv, ps, window):
    args = make_case(RAGGED, hq, hkv, d, ps, window)
    scale = d ** -0.5
    got = _run(kernel, *args, scale, window)
    ref = brute_force(*args, scale, window)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-5), (got.double() - ref).abs().max()


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_paged_bf16(kernel):
    args = make_case([(3, 50), (1, 129), (20, 20)], 9, 3, 64, 16, None, dtype=torch.bfloat16)
    got = _run(kernel, *args, 0.125, None)
    ref = brute_force(*args, 0.125, None)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of the output on top of fp32 math
    assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2), (got.double() - ref).abs().max()


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("window", [None, 7])
def test_paged_batch_invariance(kernel, window):
    """Bit-identical alone and batched, except gathered_sdpa (the GPU fallback), whose padded key
    length follows the batch: there only to rounding."""
    seqs = [(1, 233), (9, 100), (1, 5), (30, 60)]
    q, kc, vc, table, cu, lens = make_case(seqs, 9, 3, 64, 16, window)
    full = _run(kernel, q, kc, vc, table, cu, lens, 0.1, window)
    for s in range(len(seqs)):
        a, b = int(cu[s]), int(cu[s + 1])
        alone = _run(kernel, q[a:b], kc, vc, table[s:s + 1], torch.tensor([0, b - a]), lens[s:s + 1], 0.1, window)
        if kernel == "gathered_sdpa":
            assert (alone - full[a:b]).abs().max().item() < 1e-6, f"sequence {s} differs when batched"
        else:
            assert torch.equal(alone, full[a:b]), f"sequence {s} differs when batched"


def test_paged_dispatch_and_head_dim_fallback():
    # head dim 80 is refused by the C++ kernel, so the public face must still answer (gathered_sdpa)
    args = make_case([(2, 9), (1, 4)], 4, 2, 80, 8)
    reasons = dict(A.PAGED_ATTENTION.reasons(**dict(zip(
        ["q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k", "scale", "window"], (*args, 0.1, None)))))
    assert reasons["cpu"] is not None
    got = A.paged_attention(*args, 0.1)
    assert torch.allclose(got.double(), brute_force(*args, 0.1, None), rtol=1e-4, atol=1e-5)


def test_paged_dispatch_falls_back_past_16_query_heads_per_kv_head():
    """32 query heads over one kv head: the CPU kernel takes up to 16 a kv head; the paged face (the generator's
    path) raised from inside the kernel instead of falling back, as the contiguous face already did."""
    args = make_case([(3, 20), (1, 7)], 32, 1, 64, 8)
    names = ["q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k", "scale", "window"]
    reasons = dict(A.PAGED_ATTENTION.reasons(**dict(zip(names, (*args, 0.1, None)))))
    assert "per kv head" in reasons["cpu"]
    got = A.paged_attention(*args, 0.1)
    assert torch.allclose(got.double(), brute_force(*args, 0.1, None), rtol=1e-4, atol=1e-5)


def test_paged_bad_input():
    q, kc, vc, table, cu, lens = make_case([(2, 9)], 4, 2, 64, 8)
    with pytest.raises(InputError, match="multiple of kv heads"):
        A.paged_attention(q[:, :3], kc, vc, table, cu, lens, 0.1)
    with pytest.raises(InputError, match="cu_seqlens_q"):
        A.paged_attention(q, kc, vc, table, cu[:1], lens, 0.1)
    with pytest.raises(InputError, match="head dim"):
        A.paged_attention(q[..., :32], kc, vc, table, cu, lens, 0.1)


def test_write_kv_roundtrip():
    pages, ps, hkv, d = 7, 4, 3, 64
    kc = torch.full((pages, ps, hkv, d), math.nan)
    vc = torch.full_like(kc, math.nan)
    slots = torch.randperm(pages * ps)[:11]
    k, v = torch.randn(11, hkv, d), torch.randn(11, hkv, d)
    A.write_kv(kc, vc, k, v, slots)
    for i, sl in enumerate(slots.tolist()):
        assert torch.equal(kc[sl // ps, sl % ps], k[i]) and torch.equal(vc[sl // ps, sl % ps], v[i])
    written = torch.zeros(pages * ps, dtype=torch.bool)
    written[slots] = True
    assert kc.reshape(-1, hkv, d)[~written].isnan().all()          # nothing else touched
    with pytest.raises(InputError, match="slots"):
        A.write_kv(kc, vc, k, v, slots[:3])



def test_rope_write_kv_rotates_against_float64_and_stores():
    """rope_write_kv (the two ops on the CPU) returns q rotated as the float64 formula rotates it and stores k
    rotated the same way and v as it is in their slots; bad input raises as the two ops raise."""
    from exl_core.ops.rope import cos_sin_table
    pages, ps, hq, hkv, d, t = 5, 4, 6, 2, 64, 3
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    pos, slots = torch.tensor([0, 7, 19]), torch.tensor([5, 0, 13])
    cs = cos_sin_table(1.0 / (10000 ** (torch.arange(0, d, 2).double() / d)), 32)
    kc = torch.full((pages, ps, hkv, d), math.nan)
    vc = torch.full_like(kc, math.nan)
    qo = A.rope_write_kv(q, k, v, pos, cs, kc, vc, slots)

    def rot(x):                                                     # float64: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
        c, s = cs[pos].double()[:, None, :d // 2], cs[pos].double()[:, None, d // 2:]
        x1, x2 = x.double()[..., :d // 2], x.double()[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert torch.allclose(qo.double(), rot(q), atol=1e-5)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    assert torch.allclose(flat_k[slots].double(), rot(k), atol=1e-5) and torch.equal(flat_v[slots], v)
    with pytest.raises(InputError, match="slots"):
        A.rope_write_kv(q, k, v, pos, cs, kc, vc, slots[:2])


def test_rope_paged_attention_is_rope_write_then_attention():
    """rope_paged_attention (the contexts' decode attention; on the CPU its two ops): q and k rotated at their
    positions as the float64 formula rotates them, k and v stored in their slots, then attention as the torch
    reference computes it over each sequence's keys -- the argument order through to both ops; bad input raises
    InputError naming the tensor."""
    from exl_core.ops.rope import cos_sin_table
    ps, hq, hkv, d = 4, 4, 2, 64
    g = torch.Generator().manual_seed(11)
    lens = torch.tensor([6, 3])                                     # one decode row each, at position len - 1
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    kc = torch.randn(3, ps, hkv, d, generator=g)
    vc = torch.randn(3, ps, hkv, d, generator=g)
    q, k, v = (torch.randn(2, h, d, generator=g) for h in (hq, hkv, hkv))
    pos = lens - 1
    slots = torch.tensor([0 * ps + 1, 1 * ps + 2])                 # table[0][5 // 4] = 0, table[1][2 // 4] = 1
    cs = cos_sin_table(1.0 / (10000 ** (torch.arange(0, d, 2).double() / d)), 16)
    cu = torch.tensor([0, 1, 2])
    k_ref, v_ref = kc.clone(), vc.clone()
    out = A.rope_paged_attention(q, k, v, pos, cs, kc, vc, slots, table, cu, lens, 0.125, None, 1)

    def rot(x):
        c, s = cs[pos].double()[:, None, :d // 2], cs[pos].double()[:, None, d // 2:]
        x1, x2 = x.double()[..., :d // 2], x.double()[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    k_ref.view(-1, hkv, d)[slots], v_ref.view(-1, hkv, d)[slots] = rot(k).float(), v
    assert torch.allclose(kc.view(-1, hkv, d)[slots].double(), rot(k), atol=1e-5)
    assert torch.equal(vc.view(-1, hkv, d)[slots], v)
    ref = A.paged_attention_ref(rot(q).float(), k_ref, v_ref, table, cu, lens, 0.125).double()  # torch's math
    assert torch.allclose(out.double(), ref, atol=1e-5)
    with pytest.raises(InputError, match="cu_seqlens_q"):
        A.rope_paged_attention(q, k, v, pos, cs, kc, vc, slots, table, cu[:2], lens, 0.125, None, 1)

@pytest.mark.skipif(not has_op("paged_attention"), reason="C++ extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_opcheck(dtype):
    q, kc, vc, table, cu, lens = make_case([(3, 20), (1, 7)], 6, 2, 64, 8, dtype=dtype)
    torch.library.opcheck(torch.ops.exl_core.paged_attention, (q, kc, vc, table, cu, lens, 0.125, 0))
    torch.library.opcheck(torch.ops.exl_core.paged_attention, (q, kc, vc, table, cu, lens, 0.125, 5))


@pytest.mark.skipif(not has_op("paged_attention"), reason="C++ extension not built")
def test_paged_cpu_rejects_bad_table():
    # a table entry the kernel would need is -1: the C++ side must refuse instead of reading it
    q, kc, vc, table, cu, lens = make_case([(2, 20)], 4, 2, 64, 8)
    table[0, 1] = -1
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.exl_core.paged_attention(q, kc, vc, table, cu, lens, 0.1, 0)


# ---------------------------------------------------------------------------- contiguous K/V
# attention_contiguous (ContiguousContext's attention): the C++ kernel over K/V viewed as one page.

def _dense_f64(q, k, v, scale, q_start, window):
    """attention_dense's formula in float64: a reference independent of both fp32 paths."""
    tq, hq, d = q.shape
    rep = hq // k.shape[1]
    kf = k.double().transpose(0, 1).repeat_interleave(rep, 0)
    vf = v.double().transpose(0, 1).repeat_interleave(rep, 0)
    s = q.double().transpose(0, 1) @ kf.transpose(1, 2) * scale
    qpos = torch.arange(q_start, q_start + tq).unsqueeze(1)
    kpos = torch.arange(k.shape[0]).unsqueeze(0)
    mask = (kpos > qpos) | ((kpos <= qpos - window) if window else torch.zeros_like(kpos > qpos))
    return (torch.softmax(s.masked_fill(mask, -math.inf), -1) @ vf).transpose(0, 1)


@pytest.mark.skipif(not has_op("paged_attention"), reason="C++ extension not built")
@pytest.mark.parametrize("tq,q_start,window", [(37, 0, None), (512, 0, None), (5, 33, None), (41, 0, 16), (1, 70, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contiguous_uses_cpu_kernel_and_matches_float64(tq, q_start, window, dtype):
    hq, hkv, d = 9, 3, 64
    g = torch.Generator().manual_seed(tq * 1000 + q_start)
    q = torch.randn(tq, hq, d, generator=g).to(dtype)
    k = torch.randn(q_start + tq, hkv, d, generator=g).to(dtype)
    v = torch.randn(q_start + tq, hkv, d, generator=g).to(dtype)
    args = dict(q=q, k=k, v=v, scale=d ** -0.5, q_start=q_start, window=window)
    assert A.CONTIGUOUS_ATTENTION.select(**args).name == "cpu"
    poison = torch.full((tq, hq, d), float("nan"), dtype=dtype)
    del poison
    out = A.attention_contiguous(q, k, v, scale=d ** -0.5, q_start=q_start, window=window)
    ref = _dense_f64(q, k, v, d ** -0.5, q_start, window)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    # bf16: within one unit in the last place of the output (2^-7 of a value at most), relative: over 200 seeds of the
    # 37- and 512-row cases the error stayed below 2^-7 |ref| + 1e-7 (more than half a unit, the output's own
    # rounding: the kernel's sums carry their own error); a fixed 1e-2 failed once, unseeded, at 0.0136
    rel = 0.0 if dtype == torch.float32 else 2.0 ** -7
    tol = (1e-5 if dtype == torch.float32 else 1e-3) + rel * ref.abs()
    assert bool(((out.double() - ref).abs() <= tol).all())
    dense = A.attention_dense(q, k, v, scale=d ** -0.5, q_start=q_start, window=window)
    assert bool(((dense.double() - ref).abs() <= tol).all())


def test_contiguous_falls_back_with_reasons():
    q, k = torch.randn(4, 4, 96), torch.randn(4, 2, 96)     # head dim 96: no C++ instance
    reasons = dict(A.CONTIGUOUS_ATTENTION.reasons(q=q, k=k, v=k, scale=0.1, q_start=0, window=None))
    assert reasons["cpu"] is not None and reasons["torch_ref"] is None
    out = A.attention_contiguous(q, k, k, scale=0.1, q_start=0)
    assert torch.equal(out, A.attention_dense(q, k, k, scale=0.1, q_start=0))
    q, k = torch.randn(4, 4, 64), torch.randn(6, 2, 64)     # keys past the last query
    assert "keys" in dict(A.CONTIGUOUS_ATTENTION.reasons(q=q, k=k, v=k, scale=0.1, q_start=0, window=None))["cpu"]
