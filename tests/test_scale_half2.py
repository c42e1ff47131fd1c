"""Half2 scale/zero for the SwiGLU-fused decode down projection (ops/cuda_scale_half2.py, qgemm_kslice's H2 instances):
the split is exact in float64 or refused (CPU); on a GPU the kernels give the same bits with it as with the float32
scale and zero, and float64 references; a quantized model decodes the same logits with it on and off."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from exl_core.ops.cuda_scale_half2 import split_half2


def _unsplit(packed: torch.Tensor, mul: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k * mul, zero) as float64 from split_half2's output (half2 (k, zero) little-endian, k the low half), the
    product in float32 as the kernel takes it."""
    G, N = packed.shape
    pairs = packed.contiguous().view(torch.float16).view(G, N, 2).float()
    return (pairs[..., 0] * mul[:, None]).double(), pairs[..., 1].double()


def _exl2_scales(G: int, N: int, g: torch.Generator, top: int = 16) -> torch.Tensor:
    """EXL2's float32 scales as the loader makes them (formats/exl2.py): (c + 1)^2 * fp16 max / 256, codes c < top."""
    codes = torch.randint(0, top, (G, N), generator=g).double()
    smax = (torch.rand(G, 1, generator=g) * 0.03 + 1e-4).half().double()
    return ((codes + 1) ** 2 * smax / 256).float()


def test_split_exact_for_gptq_scales():
    g = torch.Generator().manual_seed(0)
    s = (torch.rand(6, 40, generator=g) * 0.02 + 1e-3).half().float()
    z = torch.randint(0, 16, (6, 40), generator=g).float()
    packed, mul = split_half2(s, z)
    assert packed.dtype == torch.int32 and packed.shape == (6, 40) and mul.shape == (6,)
    back_s, back_z = _unsplit(packed, mul)
    assert torch.equal(back_s, s.double()) and torch.equal(back_z, z.double())
    assert torch.equal(mul, torch.ones(6))                       # fp16 scales need no multiplier


@pytest.mark.parametrize("top", [16, 11, 8, 3, 1])               # the group's largest code: 15 or any other
def test_split_exact_for_exl2_scales(top):
    g = torch.Generator().manual_seed(top)
    s = _exl2_scales(7, 64, g, top)
    z = torch.full((7, 64), 4.0)
    packed, mul = split_half2(s, z)
    back_s, back_z = _unsplit(packed, mul)
    assert torch.equal(back_s, s.double()) and torch.equal(back_z, z.double())


def test_split_exact_for_the_uniform4_rewrite():
    """An EXL2 layer with 6- and 5-bit groups rewritten as uniform 4-bit rows (extra rows: 16 x scale, fractional
    zeros): every group splits, and the rewrite's float64 weights come back from the split."""
    from exl_core.formats.uniform4 import as_uniform4
    from test_cuda_kernels import random_packed
    g = torch.Generator().manual_seed(5)
    pw = random_packed([(6, 64), (4, 128), (5, 64)], 96, perm=True, seed=5)
    pw = dataclasses.replace(pw, scale=_exl2_scales(3, 96, g), zero=pw.zero.round())
    u = as_uniform4(pw, max_growth=10.0)
    assert u is not None and u.rows is not None
    split = split_half2(u.scale, u.zero)
    assert split is not None
    back_s, back_z = _unsplit(*split)
    rebuilt = dataclasses.replace(u, scale=back_s.float(), zero=back_z.float())
    assert torch.equal(dequantize_reference(rebuilt), dequantize_reference(u))


def test_split_refused():
    g = torch.Generator().manual_seed(1)
    s, z = _exl2_scales(4, 32, g), torch.full((4, 32), 8.0)
    assert split_half2(s, z) is not None
    assert split_half2(torch.rand(4, 32, generator=g) * 0.02 + 1e-3, z) is None     # arbitrary float32 scales
    bad = s.clone()
    bad[2, 5] = 0.0123456789                                     # one value in one group
    assert split_half2(bad, z) is None
    zz = z.clone()
    zz[1, 3] = 8.3                                               # a zero fp16 cannot hold
    assert split_half2(s, zz) is None
    tiny = s.clone()
    tiny[0, 0] = 1e-39                                           # a float32 denormal (the kernels flush them)
    assert split_half2(tiny, z) is None
    assert split_half2(s[:, :0], z[:, :0]) is None
    assert split_half2(s, z[:, :5]) is None


def test_launch_policy(monkeypatch):
    """Which staged launches take half2 (cuda_candidates._half2_lists): none by default (GPTQ lost in stop 46 call 3,
    EXL2's rewrite did not gain in stop 47 call 1); under KSLICE_H2_ALL every one whose weights all split exactly,
    within the staged rows, with the split of each weight; none with half2 off."""
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_scale_half2 as h2mod
    from test_cuda_kernels import random_packed
    g = torch.Generator().manual_seed(9)
    pw = random_packed([(6, 64), (4, 128), (5, 64)], 96, perm=True, seed=9)
    pw = dataclasses.replace(pw, scale=_exl2_scales(3, 96, g), zero=pw.zero.round())
    rew = as_uniform4(pw, max_growth=10.0)
    gq = random_packed([(4, 128)] * 2, 96, perm=False)
    gq = dataclasses.replace(gq, scale=gq.scale.half().float())
    cpu = torch.device("cpu")
    monkeypatch.setattr(h2mod, "KSLICE_H2_ON", True)
    monkeypatch.setattr(h2mod, "KSLICE_H2_ALL", False)
    assert cc._half2_lists([rew, gq], cpu, 1) == (None, None)
    monkeypatch.setattr(h2mod, "KSLICE_H2_ALL", True)
    h2, mul = cc._half2_lists([rew, gq], cpu, 1)
    for w, h, m in zip((rew, gq), h2, mul):
        want = split_half2(w.scale, w.zero)
        assert torch.equal(h, want[0]) and torch.equal(m, want[1])
    assert cc._half2_lists([rew], cpu, cc.KSLICE_STAGED_ROWS + 1) == (None, None)
    unsplit = dataclasses.replace(rew, scale=rew.scale + 1e-7)             # float32 scales with no exact split
    assert cc._half2_lists([gq, unsplit], cpu, 1) == (None, None)          # one launch, one kind of scale/zero
    monkeypatch.setattr(h2mod, "KSLICE_H2_ON", False)
    assert cc._half2_lists([rew], cpu, 1) == (None, None)


# ---------------------------------------------------------------------------- CUDA

def _half2_cases(g: torch.Generator):
    """(weight on CUDA with split-able scales, float64 W of its stored rows, xchunks or None): GPTQ-like 4-bit g128 /
    g32, and an EXL2 layer rewritten as uniform 4-bit rows read by chunk offsets (test_cuda_xchunks' orders)."""
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops.xchunks import chunk_starts
    from test_cuda_kernels import random_packed
    from test_cuda_xchunks import _chunk_perms, _rows_reference
    for layout, N in (([(4, 128)] * 4, 4 * 67), ([(4, 32)] * 24, 1024)):
        pw = random_packed(layout, N, perm=False)
        pw = dataclasses.replace(pw, scale=pw.scale.half().float())
        yield pw.to("cuda"), dequantize_reference(pw), None
    pw = random_packed([(5, 128), (4, 256), (3, 128)], 384, perm=False)
    pw = dataclasses.replace(pw, scale=_exl2_scales(3, 384, g), zero=pw.zero.round())
    u = as_uniform4(pw, max_growth=10.0)
    perm = _chunk_perms(pw.in_features, u.rows, g)[0]
    w = dataclasses.replace(u.to("cuda"), perm=perm.cuda())
    yield w, _rows_reference(u), chunk_starts(w.perm)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 5, 8])                          # the staged rows
def test_silu_down_half2_same_bits(M):
    """qgemm_kslice_silu at every kw and qgemm_kslice_add_ with up: with sz_half2 / sz_mul the same bits as with the
    float32 scale and zero (the split is exact), every output written, and float64 references."""
    from test_cuda_kernels import _need_kernels, poison_allocator, rel_err
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    g = torch.Generator().manual_seed(M)
    ran = []
    for w, W, xc in _half2_cases(g):
        ran.append(0)
        K, N = w.in_features, w.out_features
        h2, mul = split_half2(w.scale, w.zero)
        assert h2.is_cuda
        gate = torch.randn(M, K, dtype=torch.float16, generator=g).cuda()
        up = torch.randn(M, K, dtype=torch.float16, generator=g).cuda()
        act = (torch.nn.functional.silu(gate.double().cpu()).half().double() * up.double().cpu()).half().double()
        ref = (act if w.perm is None else act[:, w.perm.cpu()]) @ W
        perm = None if xc is not None else w.perm
        args = (w.qweight, cc._chunks_of(w), w.scale, w.zero, perm, None, True)
        mg, gs = cc._min_group(w), cc._group_shift(w)
        rows = K if w.perm is None else w.perm.numel()
        for kw in (4, 8, 16):
            if not torch.ops.exl_core.qgemm_kslice_fits(M, rows, (N + 31) // 32, mg, True, 0, kw, 0):
                continue
            poison_allocator()
            y32 = torch.ops.exl_core.qgemm_kslice_silu(gate, up, *args, kw, 0, mg, gs, xchunks=xc)
            poison_allocator()
            y16 = torch.ops.exl_core.qgemm_kslice_silu(gate, up, *args, kw, 0, mg, gs, xchunks=xc, sz_half2=h2,
                                                       sz_mul=mul)
            assert torch.equal(y16, y32), kw
            assert rel_err(y16, ref) < 2e-3, kw
            ran[-1] += 1
        res = torch.randn(M, N, dtype=torch.float16, generator=g).cuda()
        r32, r16 = res.clone(), res.clone()
        ss32 = torch.ops.exl_core.qgemm_kslice_add_(r32, gate, *args, mg, gs, up=up, xchunks=xc)
        ss16 = torch.ops.exl_core.qgemm_kslice_add_(r16, gate, *args, mg, gs, up=up, xchunks=xc, sz_half2=h2,
                                                    sz_mul=mul)
        assert torch.equal(r16, r32) and torch.equal(ss16, ss32)
        assert rel_err(r16, res.double().cpu() + ref) < 2e-3
    assert len(ran) == 3 and min(ran) >= 1, ran


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 4, 8])
def test_multi_half2_permuted_rewrite_same_bits(M):
    """EXL2's q/k/v under EXL_CORE_KSLICE_H2_ALL=1: rewritten weights (extra rows, a permutation over them, x gathered
    in shared memory) through qgemm_kslice_multi with half2 give the same bits as with float32, and float64
    references."""
    from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err
    from test_cuda_xchunks import _rows_reference
    _need_kernels()
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops import cuda_candidates as cc
    g = torch.Generator().manual_seed(20 + M)
    pw = random_packed([(6, 128), (4, 256), (5, 128)], 384, perm=True, seed=20 + M)
    pw = dataclasses.replace(pw, scale=_exl2_scales(3, 384, g), zero=pw.zero.round())
    u = as_uniform4(pw, max_growth=10.0)
    assert u is not None and u.rows is not None and u.perm is not None
    w = u.to("cuda")
    ws = [w, w, w]                                                 # one launch of three weights on one permutation
    splits = [split_half2(x.scale, x.zero) for x in ws]
    assert all(sp is not None for sp in splits)
    args = cc._weights_args(ws, torch.device("cuda"), torch.float16)
    x = torch.randn(M, pw.in_features, dtype=torch.float16, generator=g).cuda()
    kw = {"min_group": cc._min_group(w), "group_shift": cc._group_shift(w)}
    assert torch.ops.exl_core.qgemm_kslice_fits(M, w.rows, 3 * 12, kw["min_group"], True, 0)
    poison_allocator()
    y32 = torch.ops.exl_core.qgemm_kslice_multi(x, *args, True, **kw)
    poison_allocator()
    y16 = torch.ops.exl_core.qgemm_kslice_multi(x, *args, True, **kw, sz_half2=[h for h, _ in splits],
                                                sz_mul=[m for _, m in splits])
    ref = x.double().cpu()[:, u.perm] @ _rows_reference(u)
    for a, b in zip(y16, y32):
        assert torch.equal(a, b)
        assert rel_err(a, ref) < 2e-3


@pytest.mark.cuda
def test_half2_bad_arguments_raise():
    from test_cuda_kernels import _need_kernels, random_packed
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    pw = random_packed([(4, 128)] * 2, 64, perm=False)
    w = dataclasses.replace(pw, scale=pw.scale.half().float()).to("cuda")
    h2, mul = split_half2(w.scale, w.zero)
    gate = torch.randn(1, 256, dtype=torch.float16, device="cuda")
    args = (w.qweight, cc._chunks_of(w), w.scale, w.zero, None, None, True)
    with pytest.raises(RuntimeError, match="sz_half2 and sz_mul go together"):
        torch.ops.exl_core.qgemm_kslice_silu(gate, gate, *args, sz_half2=h2)
    with pytest.raises(RuntimeError, match="half2 scale/zero need"):
        torch.ops.exl_core.qgemm_kslice_silu(gate, gate, *args, sz_half2=h2[:, :32].contiguous(), sz_mul=mul)
    with pytest.raises(RuntimeError, match="half2 scale/zero need"):
        torch.ops.exl_core.qgemm_kslice_silu(gate, gate, *args, sz_half2=h2, sz_mul=mul.double())
    x9 = torch.randn(9, 256, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="at most 8 rows"):                     # rows from global memory
        torch.ops.exl_core.qgemm_kslice_silu(x9, x9, *args, sz_half2=h2, sz_mul=mul)
    with pytest.raises(RuntimeError, match="one pair a weight"):
        torch.ops.exl_core.qgemm_kslice_multi(gate, [w.qweight] * 2, [cc._chunks_of(w)] * 2, [w.scale] * 2,
                                              [w.zero] * 2, [None] * 2, [None] * 2, True, sz_half2=[h2], sz_mul=[mul])


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("normed", [False, True])
def test_multi_half2_same_bits(M, normed):
    """qgemm_kslice_multi on three weights (q/k/v-like; with the folded RMSNorm or not) and qgemm_kslice_add_ without up
    (o): with half2 scale/zero (EXL_CORE_KSLICE_H2_ALL's launches) the same bits as with float32, and float64
    references."""
    from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    g = torch.Generator().manual_seed(M)
    ws = []
    for N in (256, 128, 128):
        pw = random_packed([(4, 128)] * 4, N, perm=False)
        ws.append(dataclasses.replace(pw, scale=pw.scale.half().float()).to("cuda"))
    splits = [split_half2(w.scale, w.zero) for w in ws]
    lists = ([w.qweight for w in ws], [cc._chunks_of(w) for w in ws], [w.scale for w in ws], [w.zero for w in ws],
             [None] * 3, [None] * 3, True)
    x = torch.randn(M, 512, dtype=torch.float16, generator=g).cuda()
    kw = {"min_group": 128, "group_shift": cc._group_shift(ws[0])}
    xin = x.double().cpu()
    if normed:
        nw = (torch.rand(512, generator=g) + 0.5).half().cuda()
        ss = (x.float() ** 2).view(M, 16, 32).sum(-1).t().contiguous()       # the producer's sums per 32 columns
        kw.update(norm_weight=nw, norm_ss=ss, norm_eps=1e-5)
        r = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
        xin = (nw.double() * (x.double() * r).half().double()).cpu()
    poison_allocator()
    y32 = torch.ops.exl_core.qgemm_kslice_multi(x, *lists, **kw)
    poison_allocator()
    y16 = torch.ops.exl_core.qgemm_kslice_multi(x, *lists, **kw, sz_half2=[h for h, _ in splits],
                                                sz_mul=[m for _, m in splits])
    for a, b, w in zip(y16, y32, ws):
        assert torch.equal(a, b)
        assert rel_err(a, xin @ dequantize_reference(w.to("cpu"))) < 2e-3
    res = torch.randn(M, 256, dtype=torch.float16, generator=g).cuda()
    r32, r16 = res.clone(), res.clone()
    o = (ws[0].qweight, cc._chunks_of(ws[0]), ws[0].scale, ws[0].zero, None, None, True)
    ss32 = torch.ops.exl_core.qgemm_kslice_add_(r32, x, *o, min_group=128)
    ss16 = torch.ops.exl_core.qgemm_kslice_add_(r16, x, *o, min_group=128, sz_half2=splits[0][0], sz_mul=splits[0][1])
    assert torch.equal(r16, r32) and torch.equal(ss16, ss32)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_model_decode_same_logits_with_half2(fmt, tiny_model_factory, tmp_path, monkeypatch):
    """A quantized tiny Llama decodes at batch 1 with the same logits with half2 scale/zero on and off, and the split
    was taken: the down projection (GPTQ: qgemm_kslice_add_ with up; EXL2: by chunk offsets), then every staged
    launch under KSLICE_H2_ALL.  The EXL2 model has act-order and mixed 6 / 4 / 3-bit groups, and every projection
    is rewritten as uniform 4-bit rows with extra rows (growth 1.125 / 1.1236, under the loader's 1.15): its q/k/v,
    gate/up and o take half2 through the permuted x."""
    from test_cuda_kernels import _need_kernels
    from test_cuda_xchunks import assert_decode_same_with_switch
    _need_kernels()
    from exl_core.loader import load_model
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_scale_half2
    from exl_core.quantize.rtn import quantize_model_rtn
    monkeypatch.delenv("EXL_CORE_EXL2_AS_U4", raising=False)
    src = tiny_model_factory("llama", seed=random.randrange(1000), hidden_size=256, intermediate_size=704,
                             num_attention_heads=4, num_key_value_heads=2)
    if fmt == "exl2":
        qdir = quantize_model_rtn(src, tmp_path / "q", fmt=fmt, bits=[(6, 0.125), (4, 0.625), (3, 0.25)],
                                  group_size=32, act_order=True)
    else:
        qdir = quantize_model_rtn(src, tmp_path / "q", fmt=fmt, bits=4, group_size=32)
    model = load_model(qdir, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
    if fmt == "exl2":                                             # the rewrite (only uniform 4-bit takes half2)
        assert all(mod.packed.rows is not None for b in model.layers for mod in b.modules()
                   if getattr(mod, "packed", None) is not None)
    monkeypatch.setattr(cuda_scale_half2, "KSLICE_H2_ALL", False)
    assert_decode_same_with_switch(model, monkeypatch, cuda_scale_half2, "KSLICE_H2_ON", cc, "half2_of", seed=11)
    monkeypatch.setattr(cuda_scale_half2, "KSLICE_H2_ON", True)
    assert_decode_same_with_switch(model, monkeypatch, cuda_scale_half2, "KSLICE_H2_ALL", cc, "_half2_lists",
                                   seed=12)
