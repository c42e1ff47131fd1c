"""The SwiGLU-fused decode kernel staging x by chunk offsets (qgemm_kslice_silu's `xchunks`, ops/xchunks.py) instead
of gathering it through an act-order permutation whose chunks read runs of consecutive columns: the same staged
values, so the same bits as the permuted call, and float64 references; the batch-decode SwiGLU pair storing the
chunks a down projection reads again (qgemm_wide_swiglu's tails); and a rewritten EXL2 model's decode step with
each on and off.  Helpers from test_cuda_kernels."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err

pytestmark = pytest.mark.cuda


def _chunk_perms(K: int, rows: int, g: torch.Generator):
    """Chunk-contiguous orders of `rows` rows over K columns: the identity and whole chunks again (what a rewritten
    down projection keeps), and whole chunks shuffled with the tail's chunks drawn at random."""
    tail = torch.randint(0, K // 32, ((rows - K) // 32,), generator=g)
    return [torch.cat([torch.arange(K), _runs(tail)]), _runs(torch.cat([torch.randperm(K // 32, generator=g), tail]))]


def _runs(chunks: torch.Tensor) -> torch.Tensor:
    """The columns of these 32-column chunks, in order."""
    return torch.cat([torch.arange(0)] + [torch.arange(32 * c, 32 * c + 32) for c in chunks.tolist()])


def _cases(g: torch.Generator):
    """(weight on CUDA with a chunk-contiguous perm, the float64 W its stored rows make, uniform 4-bit?): the rewrite of
    a 5/4/3-bit weight (extra rows) under both orders of _chunk_perms, and the mixed-width weight itself under
    shuffled whole chunks (the mixed-width instances)."""
    from exl_core.formats.uniform4 import as_uniform4
    pw = random_packed([(5, 128), (4, 256), (3, 128)], 384, perm=False)
    u = as_uniform4(pw, max_growth=10.0)                           # rows: K + the 5-bit group's 128 again
    assert u is not None and u.rows == pw.in_features + 128
    for perm in _chunk_perms(pw.in_features, u.rows, g):
        yield dataclasses.replace(u.to("cuda"), perm=perm.cuda()), _rows_reference(u), True
    shuffled = _chunk_perms(pw.in_features, pw.in_features, g)[1]
    yield dataclasses.replace(pw.to("cuda"), perm=shuffled.cuda()), _rows_reference(pw), False


@pytest.mark.parametrize("M", [1, 4, 8])                          # the staged rows
def test_silu_down_by_chunk_offsets_same_bits(M):
    """qgemm_kslice_silu and qgemm_kslice_add_ (with up) at every kw: the same bits with xchunks as with the
    permutation, and float64 references."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops.xchunks import chunk_starts
    g = torch.Generator().manual_seed(M)
    ran = []
    for w, W, u4 in _cases(g):
        ran.append(0)
        K, N, rows = w.in_features, w.out_features, w.perm.numel()
        gate = torch.randn(M, K, dtype=torch.float16, generator=g).cuda()
        up = torch.randn(M, K, dtype=torch.float16, generator=g).cuda()
        act = (torch.nn.functional.silu(gate.double().cpu()).half().double() * up.double().cpu()).half().double()
        ref = act[:, w.perm.cpu()] @ W
        xc = chunk_starts(w.perm)
        assert xc is not None
        args = (w.qweight, cc._chunks_of(w), w.scale, w.zero)
        mg, gs = cc._min_group(w), cc._group_shift(w) if u4 else -1
        for kw in (4, 8, 16):
            if not torch.ops.exl_core.qgemm_kslice_fits(M, rows, (N + 31) // 32, mg, u4, 0, kw, 0):
                continue
            poison_allocator()
            y_perm = torch.ops.exl_core.qgemm_kslice_silu(gate, up, *args, w.perm, None, u4, kw, 0, mg, gs)
            poison_allocator()
            y = torch.ops.exl_core.qgemm_kslice_silu(gate, up, *args, None, None, u4, kw, 0, mg, gs, xchunks=xc)
            assert torch.equal(y, y_perm), (u4, kw)
            assert rel_err(y, ref) < 2e-3, (u4, kw)
            ran[-1] += 1
        res = torch.randn(M, N, dtype=torch.float16, generator=g).cuda()
        r_perm, r_xc = res.clone(), res.clone()
        ss_perm = torch.ops.exl_core.qgemm_kslice_add_(r_perm, gate, *args, w.perm, None, u4, mg, gs, up=up)
        ss = torch.ops.exl_core.qgemm_kslice_add_(r_xc, gate, *args, None, None, u4, mg, gs, up=up, xchunks=xc)
        assert torch.equal(r_xc, r_perm) and torch.equal(ss, ss_perm)
        assert rel_err(r_xc, res.double().cpu() + ref) < 2e-3
    assert len(ran) == 3 and min(ran) >= 1, ran


def _rows_reference(u):
    """float64 W of a weight with extra rows, one row per stored row (what x[:, perm] multiplies)."""
    from exl_core.formats.packed import PackedWeight
    plain = PackedWeight(u.qweight, u.groups, u.scale, u.zero, None, u.k_rows, u.out_features)
    return dequantize_reference(plain)


def test_rewritten_exl2_decode_same_bits_with_chunk_offsets(exl2_act_order_dir, monkeypatch):
    """A rewritten EXL2 model (the loader's CUDA default) decodes one step at batch 1 with the same logits whether its
    down projections stage x through their permutations or by chunk offsets -- and the offsets were taken."""
    _need_kernels()
    from exl_core.loader import load_model
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import xchunks
    monkeypatch.delenv("EXL_CORE_EXL2_AS_U4", raising=False)
    model = load_model(exl2_act_order_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
    assert any(b.mlp.down_proj.packed.rows is not None for b in model.layers)
    assert_decode_same_with_switch(model, monkeypatch, xchunks, "XCHUNKS_ON", cc, "staged_xchunks", seed=3)


def assert_decode_same_with_switch(model, monkeypatch, switch_mod, switch, spy_mod, spy, seed: int) -> None:
    """One batch-1 decode step after a 6-token prompt gives the same logits with switch_mod.<switch> off and on, and
    spy_mod.<spy> (the helper the switch enables) returned something other than None (or a tuple of Nones) at least
    once."""
    taken = []
    real = getattr(spy_mod, spy)
    monkeypatch.setattr(spy_mod, spy, lambda *a: taken.append(real(*a)) or taken[-1])
    g = torch.Generator().manual_seed(seed)
    prompt, nxt = torch.randint(0, 1000, (1, 6), generator=g).cuda(), torch.randint(0, 1000, (1, 1), generator=g).cuda()
    out = {}
    for on in (False, True):
        monkeypatch.setattr(switch_mod, switch, on)
        kvs = [model.new_sequence_kv(16)]
        with torch.inference_mode():
            model.forward_batch(prompt, kvs)
            out[on] = model.forward_batch(nxt, kvs)
    assert any(t is not None and not (isinstance(t, tuple) and all(v is None for v in t)) for t in taken), spy
    assert float(out[False].abs().max()) > 1e-2
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize("M", [17, 20, 32])                        # the pair kernel's rows
def test_swiglu_pair_stores_the_tails(M, monkeypatch):
    """qgemm_wide_swiglu with tails: the product in the first N columns, bit for bit as without, and each listed
    32-column chunk again at its tail columns (every column written: the output is poisoned first)."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_swiglu
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)               # these narrow weights on the batch GEMM too
    g = torch.Generator().manual_seed(M)
    gate, up = (random_packed([(4, 128), (4, 128)], 640, perm=False).to("cuda") for _ in range(2))
    x = torch.randn(M, 256, dtype=torch.float16, generator=g).cuda()
    assert cuda_swiglu._check(x, gate, up) is None
    src = [7, 0, 19]                                               # chunks read again, in their tail order
    tails = torch.full((640 // 32,), -1, dtype=torch.int32)
    for j, c in enumerate(src):
        tails[c] = 640 + 32 * j
    tails = tails.cuda()
    poison_allocator()
    plain = cuda_swiglu._run(x, gate, up)
    poison_allocator()
    wide = cuda_swiglu._run(x, gate, up, (tails, 640 + 32 * len(src)))
    assert wide.shape == (M, 640 + 32 * len(src)) and not torch.isnan(wide).any()
    assert torch.equal(wide[:, :640], plain)
    for j, c in enumerate(src):
        assert torch.equal(wide[:, 640 + 32 * j:672 + 32 * j], plain[:, 32 * c:32 * c + 32])


@pytest.mark.parametrize("rows", [20, 32])
def test_rewritten_exl2_decode_with_the_pair_storing_tails(tiny_model_factory, tmp_path, rows, monkeypatch):
    """A rewritten EXL2 model whose gate/up share their permutation (as ExLlamaV2 writes them): at the pair kernel's
    rows its down projections read the widened product (EXL_CORE_WIDE_TAILS=1) instead of an x_gather copy, and the
    decode step's logits agree with the gathering path within rounding (the two may take different kernels)."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_swiglu, swiglu, xchunks
    from test_norm_perm import rewritten_shared_exl2
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)               # the tiny model's gate/up on the pair kernel
    model = rewritten_shared_exl2(tiny_model_factory, tmp_path, device="cuda", dtype=torch.float16)
    widened = []
    run = cuda_swiglu._run

    def counted(x, gate, up, tails=None):
        widened.append(tails is not None)
        return run(x, gate, up, tails)
    monkeypatch.setattr(cuda_swiglu, "_run", counted)
    monkeypatch.setattr(swiglu.DISPATCH_SWIGLU, "candidates", list(swiglu.DISPATCH_SWIGLU.candidates))
    cuda_swiglu.install()                                      # the candidate bound to the counted run
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randint(0, 1000, (rows, 6), generator=g).cuda()
    nxt = torch.randint(0, 1000, (rows, 1), generator=g).cuda()
    out = {}
    for on in (False, True):
        monkeypatch.setattr(xchunks, "TAILS_ON", on)
        for b in model.layers:
            b.mlp.down_proj.__dict__.pop("_tails", None)
        kvs = [model.new_sequence_kv(16) for _ in range(rows)]
        with torch.inference_mode():
            model.forward_batch(prompt, kvs)
            widened.clear()
            out[on] = model.forward_batch(nxt, kvs).double()
        assert any(widened) == on
    ref = out[False]
    assert float(ref.abs().max()) > 1e-2
    assert float((out[True] - ref).norm() / ref.norm()) < 2e-3
