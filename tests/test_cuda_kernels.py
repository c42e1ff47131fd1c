"""CUDA kernels (exl_core/csrc/cuda) against float64 references on odd shapes.

Outputs are allocated by the ops, so "poisoning" fills the caching allocator's free blocks
with NaN first: an element the kernel forgets to write then reads back as NaN.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from exl_core.formats.packed import PackedWeight, dequantize_reference

pytestmark = pytest.mark.cuda


def _need_kernels():
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not all(_has_cuda_kernel(op) for op in ("qgemv_chunks", "qgemm_mma", "qgemm_skinny")):
        pytest.fail("torch sees a GPU but exl_core._C was built without CUDA kernels")


def poison_allocator(nbytes: int = 64 << 20) -> None:
    """Fill free cached device memory with NaN so unwritten outputs show up."""
    t = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del t


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double().cpu()
    assert not torch.isnan(a).any(), "NaN in output (unwritten element?)"
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def tiny_gptq_model(tiny_model_factory, tmp_path, kv_heads: int = 2):
    """A tiny random Llama (hidden 256, MLP 512, 4 heads) quantized to GPTQ 4-bit g128 and loaded on the GPU in fp16:
    the model-level decode tests' subject."""
    from exl_core.loader import load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    src = tiny_model_factory("llama", seed=random.randrange(1000), hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=kv_heads)
    d = quantize_model_rtn(src, tmp_path / "q", fmt="gptq", bits=4, group_size=128, act_order=False)
    return load_model(d, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]


def random_packed(K_groups, N, *, perm=True, bias=False, seed=None) -> PackedWeight:
    """K_groups: [(bits, k_len)] along the permuted rows. Random words cover every bit pattern."""
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    rows, groups, k, q = [], [], 0, 0
    for bits, k_len in K_groups:
        nq = k_len * bits // 32
        rows.append(torch.randint(-2**31, 2**31, (nq, N), generator=g, dtype=torch.int64).to(torch.int32))
        groups.append((bits, k, k_len, q))
        k += k_len
        q += nq
    G = len(groups)
    scale = torch.rand(G, N, generator=g) * 0.02 + 0.001
    zero = torch.tensor([[2.0 ** (b - 1)] for b, *_ in groups]) + torch.randint(-2, 3, (G, N), generator=g)
    p = torch.randperm(k, generator=g) if perm else None
    b = torch.randn(N, generator=g) * 0.1 if bias else None
    return PackedWeight(torch.cat(rows).contiguous(), torch.tensor(groups, dtype=torch.int32), scale,
                        zero.float(), p, k, N, b).validate()


LAYOUTS = [
    [(4, 128), (4, 96)],                                         # plain 4-bit
    [(8, 32), (6, 64), (5, 32), (4, 64), (3, 64), (2, 32)],      # every width, EXL2-style mix
    [(3, 96), (3, 32)],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["4bit", "mixed", "3bit"])
@pytest.mark.parametrize("N", [37, 4 * 131])                      # scalar and 16-byte column paths
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16, 45])               # GEMV buckets, both sides of GEMV_MAX_ROWS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qmatmul_vs_float64(layout, N, M, dtype):
    _need_kernels()
    from exl_core.ops import qmatmul as qm
    pw = random_packed(layout, N, perm=random.random() < 0.7, bias=random.random() < 0.5)
    W = dequantize_reference(pw)                                   # [K, N] float64
    x = torch.randn(M, pw.in_features) * 0.5
    ref = x.to(dtype).double() @ W + (pw.bias.double() if pw.bias is not None else 0)
    pwc = pw.to("cuda")
    if pwc.bias is not None:
        pwc.bias = pwc.bias.to(dtype)
    assert qm.DISPATCH.select(x=x.to(dtype).cuda(), pw=pwc).name == "cuda"
    poison_allocator()
    y = qm.qmatmul(x.to(dtype).cuda(), pwc)
    assert y.dtype == dtype and y.shape == (M, N)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    assert rel_err(y, ref) < tol


def test_qmatmul_schema_op_builds_chunks_itself():
    """The shared `exl_core::qmatmul` schema (CPU twin) also runs on CUDA with groups on the CPU."""
    _need_kernels()
    pw = random_packed(LAYOUTS[1], 64, perm=True)
    for M in (2, 20):
        x = torch.randn(M, pw.in_features, dtype=torch.float16)
        ref = x.double() @ dequantize_reference(pw)
        c = pw.to("cuda")
        poison_allocator()
        y = torch.ops.exl_core.qmatmul(x.cuda(), c.qweight, pw.groups, c.scale, c.zero, c.perm, None)
        assert rel_err(y, ref) < 2e-3


@pytest.mark.parametrize("M", [5, 16, 23])                         # 16-row template, two launches
def test_qgemv_and_dequant_ops_direct(M):
    """Both CUDA paths on the same data, whatever rows the policy (GEMV_MAX_ROWS) sends where."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import chunk_table
    pw = random_packed(LAYOUTS[1], 4 * 67, perm=True, bias=True)
    W = dequantize_reference(pw)
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    c = pw.to("cuda")
    ch = chunk_table(pw.groups, "cuda")
    poison_allocator()
    y = torch.ops.exl_core.qgemv_chunks(x.cuda(), c.qweight, ch, c.scale, c.zero, c.perm, c.bias.half())
    assert rel_err(y, x.double() @ W + pw.bias.half().double()) < 2e-3
    poison_allocator()
    w = torch.ops.exl_core.qdequant_chunks(c.qweight, ch, c.scale, c.zero, c.perm, torch.float16)
    assert rel_err(w, W) < 1e-3


MMA_CASES = [                                                     # (layout, N)
    (LAYOUTS[1], 4 * 67),                                         # every width, partial column tile
    ([(4, 32 * 96)], 4 * 33),                                     # split-K over a cluster
    ([(4, 32 * 150), (6, 32 * 40), (3, 32 * 110)], 128),          # > 32 chunks per block: two x stages
]


@pytest.mark.parametrize("case", range(len(MMA_CASES)), ids=["mixed", "split", "stages"])
@pytest.mark.parametrize("M", [1, 7, 16, 17, 32, 45])             # one / two m-tiles, two 32-row slices
def test_qgemm_mma_vs_float64(case, M):
    """The tensor-core kernel on its own, whatever rows the policy (MMA_MAX_ROWS) sends to it."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import chunk_table
    layout, N = MMA_CASES[case]
    pw = random_packed(layout, N, perm=random.random() < 0.7, bias=random.random() < 0.5)
    W = dequantize_reference(pw)
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    ref = x.double() @ W + (pw.bias.half().double() if pw.bias is not None else 0)
    c = pw.to("cuda")
    poison_allocator()
    y = torch.ops.exl_core.qgemm_mma(x.cuda(), c.qweight, chunk_table(pw.groups, "cuda"), c.scale, c.zero, c.perm,
                                     None if pw.bias is None else c.bias.half())
    assert y.dtype == torch.float16 and y.shape == (M, N)
    assert rel_err(y, ref) < 2e-3


SKINNY_CASES = MMA_CASES + [([(4, 32 * 40)], 4 * 300)]            # + uniform 4-bit (GPTQ), 3 column tiles


@pytest.mark.parametrize("case", range(len(SKINNY_CASES)), ids=["mixed", "split", "long", "uniform4"])
@pytest.mark.parametrize("M", [1, 5, 8, 9, 16, 17, 32])           # n-tiles 1 / 2 / 4, partial tiles
@pytest.mark.parametrize("splits", [0, 1, 3])                     # policy, one block per tile, forced cluster
def test_qgemm_skinny_vs_float64(case, M, splits):
    """The decode kernel (weights as the mma's A operand) on its own, for every row count it takes."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import _uniform4, chunk_table
    layout, N = SKINNY_CASES[case]
    pw = random_packed(layout, N, perm=random.random() < 0.7, bias=random.random() < 0.5)
    K = pw.in_features
    if K > torch.ops.exl_core.qgemm_skinny_max_k(M, 0):
        pytest.skip(f"K={K} beyond the kernel's limit for {M} rows on this GPU")
    W = dequantize_reference(pw)
    x = torch.randn(M, K, dtype=torch.float16)
    ref = x.double() @ W + (pw.bias.half().double() if pw.bias is not None else 0)
    c = pw.to("cuda")
    uniform4 = _uniform4(pw)                  # the callers' check: 4-bit words in K order
    assert uniform4 == all(b == 4 for b, *_ in pw.groups.tolist())   # random_packed writes K order
    ch = chunk_table(pw.groups, "cuda")
    bias = None if pw.bias is None else c.bias.half()
    for u4 in ({False, uniform4}):
        poison_allocator()
        y = torch.ops.exl_core.qgemm_skinny(x.cuda(), c.qweight, ch, c.scale, c.zero, c.perm, bias, u4, splits)
        assert y.dtype == torch.float16 and y.shape == (M, N)
        assert rel_err(y, ref) < 2e-3, (u4, splits)


KSLICE_CASES = SKINNY_CASES + [([(4, 32)] * 60 + [(4, 64)] * 10, 4 * 9),  # groups of 32 and 64 rows
                                ([(4, 128)] * 40, 4 * 40),                 # 40 groups of 128 (group_shift 2)
                                ([(4, 64)] * 37 + [(4, 32)], 4 * 21),     # groups of 64, a short last (shift 1)
                                ([(4, 32)] * 90, 4 * 7)]                   # groups of 32 (shift 0)
KSLICE_IDS = ["mixed", "split", "long", "uniform4", "g32_64", "g128", "g64", "g32"]


def _decode_case(case: int, M: int):
    """KSLICE_CASES[case] with random act-order and bias, its float64 reference for M fp16 rows, and x on the GPU
    (3 times in 10 at an 8-byte offset: the kernels' staging and realignment paths)."""
    from exl_core.ops.cuda_candidates import chunk_table
    layout, N = KSLICE_CASES[case]
    pw = random_packed(layout, N, perm=random.random() < 0.6, bias=random.random() < 0.5)
    K = pw.in_features
    x = torch.randn(M, K, dtype=torch.float16)
    ref = x.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
    c = pw.to("cuda")
    xc = x.cuda()
    if random.random() < 0.3:
        buf = torch.empty(M * K + 4, dtype=torch.float16, device="cuda")
        xc = buf[4:].view(M, K)
        xc.copy_(x)
    return pw, c, chunk_table(pw.groups, "cuda"), None if pw.bias is None else c.bias.half(), xc, ref


@pytest.mark.parametrize("case", range(len(KSLICE_CASES)), ids=KSLICE_IDS)
@pytest.mark.parametrize("M", [1, 3, 8, 9, 16, 20, 32])          # staged x (1 n-tile); x from global (2, 4)
@pytest.mark.parametrize("kw,ring", [(0, 0), (4, 0), (8, 8), (16, 4)])
def test_qgemm_kslice_vs_float64(case, M, kw, ring):
    """The decode kernel on its own: every width, act-order, warps along K, ring depths, scale slots fewer
    than the groups a warp spans (min_group larger than the real groups), unaligned x, 1..32 rows, groups from
    the chunk table and (regular groups, uniform 4-bit) from the group shift."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import _group_shift, _uniform4
    pw, c, ch, bias, xc, ref = _decode_case(case, M)
    K, N = pw.in_features, pw.out_features
    for u4 in ({False, _uniform4(pw)}):
        r = ring
        for min_group in (0, 128):
            if not torch.ops.exl_core.qgemm_kslice_fits(M, K, (N + 31) // 32, min_group, u4, 0, kw, r):
                continue                                       # shared memory or no such instance
            for gs in {-1, _group_shift(pw) if u4 else -1}:
                poison_allocator()
                y = torch.ops.exl_core.qgemm_kslice(xc, c.qweight, ch, c.scale, c.zero, c.perm, bias, u4, kw, r,
                                                    min_group, gs)
                assert y.dtype == torch.float16 and y.shape == (M, N)
                assert rel_err(y, ref) < 2e-3, (u4, min_group, gs)


@pytest.mark.parametrize("case", range(len(KSLICE_CASES)), ids=KSLICE_IDS)
@pytest.mark.parametrize("M", [9, 16, 17, 23, 32])                # 2 and 4 n-tiles, rows short of a tile
@pytest.mark.parametrize("splits", [0, 1, 3, 8])
def test_qgemm_wide_vs_float64(case, M, splits):
    """The batch decode kernel on its own: every width, act-order (x permuted by the gather), K split over a
    cluster (splits that leave the last one short; a count that would leave one empty is reduced), scale/zero
    rows beyond the staged bound (min_group larger than the real groups), unaligned x, 9..32 rows. With the
    weight's real smallest group every split count fits these shapes on sm_90 (below it: one split only)."""
    _need_kernels()
    if splits > 1 and torch.cuda.get_device_capability(0)[0] < 9:
        pytest.skip("K splits are reduced through thread-block clusters (sm_90)")
    from exl_core.ops.cuda_candidates import _group_shift, _uniform4
    pw, c, ch, bias, xc, ref = _decode_case(case, M)
    K, N = pw.in_features, pw.out_features
    tiles = (N + 127) // 128
    ran = 0
    for u4 in ({False, _uniform4(pw)}):
        for min_group in (0, 128, int(pw.groups[:, 2].min())):   # assumed 32, a bound over the real, the real
            if not torch.ops.exl_core.qgemm_wide_fits(M, K, tiles, min_group, 0, splits):
                continue                                       # one split over a long K: shared memory
            ran += 1
            for gs in {-1, _group_shift(pw) if u4 else -1}:    # groups from the table, or c >> shift
                poison_allocator()
                y = torch.ops.exl_core.qgemm_wide(xc, c.qweight, ch, c.scale, c.zero, c.perm, bias, u4, splits,
                                                  min_group, gs)
                assert y.dtype == torch.float16 and y.shape == (M, N)
                assert rel_err(y, ref) < 2e-3, (u4, min_group, gs)
    assert ran, "no configuration fits (the weight's real group bound always should)"


def test_qgemm_wide_policy_and_limits():
    """The policy sends fp16 rows to qgemm_wide: mixed widths 9..32, uniform 4-bit 17..32 from 64 tiles of 128
    columns in the launch; fewer rows go elsewhere; it refuses more rows, bad split counts and K that is not a
    multiple of 32."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import WIDE_ON, WIDE_U4_MIN_TILES, _wide_ok
    dev = torch.device("cuda", 0)
    pw = random_packed([(4, 1024)], 128 * WIDE_U4_MIN_TILES, perm=False).to("cuda")
    narrow = random_packed([(4, 1024)], 128 * WIDE_U4_MIN_TILES - 128, perm=False).to("cuda")
    mixed = random_packed([(5, 32 * 4), (4, 32 * 8)], 256, perm=True).to("cuda")
    assert all(_wide_ok(m, [pw], dev) == WIDE_ON for m in (17, 24, 32))
    assert not any(_wide_ok(m, [pw], dev) for m in (1, 8, 16, 33))
    assert all(_wide_ok(m, [mixed], dev) == WIDE_ON for m in (9, 16, 17, 32))
    assert not any(_wide_ok(m, [mixed], dev) for m in (1, 8, 33))
    assert not _wide_ok(32, [narrow], dev) and _wide_ok(32, [narrow, narrow], dev) == WIDE_ON
    fits = torch.ops.exl_core.qgemm_wide_fits
    assert fits(17, 4096, 172, 128, 0) and fits(32, 4096, 1, 128, 0, 1)
    clusters = torch.cuda.get_device_capability(0)[0] >= 9
    assert fits(32, 11008, 32, 128, 0) == clusters           # one split over K = 11008: over shared memory
    assert not fits(32, 4096, 1, 32, 0, 1)                   # 128 groups of scale/zero rows: over shared memory
    assert not fits(33, 4096, 32, 128, 0) and not fits(32, 4096 + 16, 32, 128, 0) and not fits(32, 4096, 32, 128, 0, 9)
    assert fits(32, 4096, 32, 128, 0, 2) == clusters         # no thread-block clusters: one split only


@pytest.mark.parametrize("M", [1, 8, 32])
def test_decode_kernels_on_column_tiled_words(M):
    """qweight as [N/128, Q, 128] (each 128-column strip contiguous) gives the row-major result in both
    decode kernels."""
    T = 128
    _need_kernels()
    from exl_core.ops.cuda_candidates import chunk_table
    pw = random_packed([(4, 32 * 40), (4, 32 * 8)], 256, perm=random.random() < 0.5, bias=True)
    K, N = pw.in_features, pw.out_features
    x = torch.randn(M, K, dtype=torch.float16)
    ref = x.double() @ dequantize_reference(pw) + pw.bias.half().double()
    c = pw.to("cuda")
    q = c.qweight.view(-1, N // T, T).permute(1, 0, 2).contiguous()
    ch = chunk_table(pw.groups, "cuda")
    ops = torch.ops.exl_core
    for u4 in (False, True):
        poison_allocator()
        y = ops.qgemm_skinny(x.cuda(), q, ch, c.scale, c.zero, c.perm, c.bias.half(), u4)
        assert rel_err(y, ref) < 2e-3
        poison_allocator()
        y = ops.qgemm_kslice(x.cuda(), q, ch, c.scale, c.zero, c.perm, c.bias.half(), u4)
        assert rel_err(y, ref) < 2e-3
        if M > 8:
            poison_allocator()
            y = ops.qgemm_wide(x.cuda(), q, ch, c.scale, c.zero, c.perm, c.bias.half(), u4)
            assert rel_err(y, ref) < 2e-3


@pytest.mark.parametrize("op,M", [("kslice", 12), ("kslice", 32), ("wide", 12), ("wide", 20), ("wide", 32)])
def test_decode_kernels_many_rows_act_order_unaligned_x(op, M):
    """9..32 rows (qgemm_kslice reads x from global memory there, qgemm_wide stages it per block): act-order
    weights (two sharing one permutation, one with its own, one without) get x permuted by one gather launch;
    x at an 8-byte offset is realigned first."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import chunk_table
    K = 32 * 40
    layouts = [[(4, K)], [(4, K)], [(5, 32 * 8), (4, 32 * 24), (3, 32 * 8)], [(4, K)]]
    pws = [random_packed(lay, n, perm=i < 3, bias=i == 2) for i, (lay, n) in enumerate(zip(layouts, (4 * 67, 36, 512, 64)))]
    pws[1].perm = pws[0].perm.clone()                                 # q/k-style: one permutation for both
    x = torch.randn(M, K, dtype=torch.float16)
    buf = torch.empty(M * K + 4, dtype=torch.float16, device="cuda")
    xc = buf[4:].view(M, K)
    xc.copy_(x)
    cs = [pw.to("cuda") for pw in pws]
    for u4 in (False, True):
        sel = [0, 1, 3] if u4 else [0, 1, 2, 3]                       # uniform 4-bit kernel: 4-bit weights only
        poison_allocator()
        ys = getattr(torch.ops.exl_core, f"qgemm_{op}_multi")(
            xc, [cs[i].qweight for i in sel], [chunk_table(pws[i].groups, "cuda") for i in sel],
            [cs[i].scale for i in sel], [cs[i].zero for i in sel], [cs[i].perm for i in sel],
            [None if cs[i].bias is None else cs[i].bias.half() for i in sel], u4)
        for y, i in zip(ys, sel):
            pw = pws[i]
            ref = x.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
            assert y.shape == (M, pw.out_features) and rel_err(y, ref) < 2e-3, (u4, i)


@pytest.mark.parametrize("case", [0, 3, 5], ids=["mixed", "uniform4", "g128"])
@pytest.mark.parametrize("M", [1, 3, 8])                          # the staged rows
def test_qgemm_kslice_silu_vs_float64_and_unfused(case, M):
    """The down projection with silu(gate) * up computed while x is staged: against float64 (the product rounded
    as exl_core::silu_mul rounds it), and bit-identical to silu_mul then qgemm_kslice (the same staged values)."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import _group_shift, _uniform4
    pw, c, ch, bias, xc, ref = _decode_case(case, M)
    K, N = pw.in_features, pw.out_features
    gate, up = xc, torch.randn(M, K, dtype=torch.float16, device="cuda")
    act = torch.ops.exl_core.silu_mul(gate, up)
    g64, u64 = gate.double().cpu(), up.double().cpu()
    act_ref = (torch.nn.functional.silu(g64).half().double() * u64).half().double()
    ref = act_ref @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
    ran = 0
    for u4 in ({False, _uniform4(pw)}):
        if not torch.ops.exl_core.qgemm_kslice_fits(M, K, (N + 31) // 32, 0, u4, 0, 8, 0):
            continue
        gs = _group_shift(pw) if u4 else -1
        poison_allocator()
        y = torch.ops.exl_core.qgemm_kslice_silu(gate, up, c.qweight, ch, c.scale, c.zero, c.perm, bias, u4, 8, 0,
                                                 0, gs)
        assert y.dtype == torch.float16 and y.shape == (M, N)
        assert rel_err(y, ref) < 2e-3, u4
        y2 = torch.ops.exl_core.qgemm_kslice(act, c.qweight, ch, c.scale, c.zero, c.perm, bias, u4, 8, 0, 0, gs)
        assert torch.equal(y, y2), u4
        ran += 1
    assert ran


@pytest.mark.parametrize("case", [0, 1, 3], ids=["mixed", "split", "uniform4"])   # K 288 / 3072 / 1280
@pytest.mark.parametrize("M", [1, 3, 8])                          # the staged rows
def test_qgemm_kslice_act_order_gather_paths_agree(case, M):
    """Act-order x at a 16-byte aligned address is gathered from a copy of x in shared memory (where the copy fits
    the block: every case here but `split` at 8 rows), at an unaligned one from global memory: both stage the same
    values, so the outputs are bit-identical, and both match float64 -- plain, and with silu(gate) * up staged for
    the down projection."""
    _need_kernels()
    if os.environ.get("EXL_CORE_KSLICE_SGATHER") == "0":
        pytest.skip("EXL_CORE_KSLICE_SGATHER=0: both offsets would take the global gather")
    from exl_core.ops.cuda_candidates import _group_shift, _uniform4, chunk_table
    layout, N = KSLICE_CASES[case]
    pw = random_packed(layout, N, perm=True)
    K = pw.in_features
    gate, up = torch.randn(M, K, dtype=torch.float16), torch.randn(M, K, dtype=torch.float16)
    c, ch, deq = pw.to("cuda"), chunk_table(pw.groups, "cuda"), dequantize_reference(pw)
    act_ref = (torch.nn.functional.silu(gate.double()).half().double() * up.double()).half().double()

    def placed(t: torch.Tensor, offset: int) -> torch.Tensor:   # t on the GPU, `offset` halves into an aligned buffer
        buf = torch.empty(t.numel() + 8, dtype=torch.float16, device="cuda")
        view = buf[offset:offset + t.numel()].view(t.shape)
        view.copy_(t)
        return view

    ran = 0
    for u4 in {False, _uniform4(pw)}:
        gs = _group_shift(pw) if u4 else -1
        for silu in (False, True):
            if not torch.ops.exl_core.qgemm_kslice_fits(M, K, (N + 31) // 32, 0, u4, 0, 8, 0):
                continue
            ran += 1
            ys = []
            for offset in (0, 4):                              # aligned: shared-memory gather; 8 bytes off: global
                g, u = placed(gate, offset), placed(up, offset)
                poison_allocator()
                if silu:
                    y = torch.ops.exl_core.qgemm_kslice_silu(g, u, c.qweight, ch, c.scale, c.zero, c.perm, None, u4, 8,
                                                             0, 0, gs)
                else:
                    y = torch.ops.exl_core.qgemm_kslice(g, c.qweight, ch, c.scale, c.zero, c.perm, None, u4, 8, 0, 0, gs)
                ys.append(y)
            ref = (act_ref if silu else gate.double()) @ deq
            assert torch.equal(ys[0], ys[1]), (u4, silu)
            assert rel_err(ys[0], ref) < 2e-3, (u4, silu)
    assert ran


@pytest.mark.parametrize("M", [1, 8, 12])                         # fused (staged rows), and the two-step path
def test_qmatmul_silu_dispatch_on_cuda_equals_two_steps(M):
    """ops.qmatmul_silu on the GPU (one launch where the decode kernel stages x) equals silu_mul then qmatmul."""
    _need_kernels()
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import qmatmul, qmatmul_silu
    pw = random_packed([(4, 128)] * 8, 4 * 40, perm=True, bias=True).to("cuda")
    gate = torch.randn(M, pw.in_features, dtype=torch.float16, device="cuda")
    up = torch.randn(M, pw.in_features, dtype=torch.float16, device="cuda")
    from exl_core.ops import cuda_candidates as cc
    if M <= cc.KSLICE_STAGED_ROWS and cc.KSLICE_ON and cc.SILU_FUSE_ON:   # the fused launch's precondition holds
        assert cc._kslice_ok(M, [pw], gate.device)
    assert torch.equal(qmatmul_silu(gate, up, pw), qmatmul(silu_mul(gate, up), pw))


def test_qgemm_kslice_policy_and_limits():
    """The policy sends 1..32 fp16 rows of uniform 4-bit weights (1 or 17..32 rows of mixed widths, and 2..8 where
    the launch has at most one column tile per SM) to qgemm_kslice; it refuses more rows, staged-x launches of more
    than ~3 tiles per SM (but uniform 4-bit at one row), shapes whose x does not fit shared memory and instances
    that do not exist, which then go elsewhere."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import KSLICE_MIXED_ONE_WAVE, KSLICE_ON, _kslice_ok
    pw = random_packed([(4, 4096)], 4096, perm=False).to("cuda")
    dev = torch.device("cuda", 0)
    assert all(_kslice_ok(m, [pw], dev) == KSLICE_ON for m in (1, 8, 9, 32))
    assert not _kslice_ok(33, [pw], dev)
    mixed = random_packed([(5, 32 * 4), (4, 32 * 8)], 256, perm=True).to("cuda")   # EXL2-like
    assert all(_kslice_ok(m, [mixed], dev) == KSLICE_ON for m in (1, 17, 32))
    assert all(_kslice_ok(m, [mixed], dev) == (KSLICE_ON and KSLICE_MIXED_ONE_WAVE) for m in (2, 8))   # 8 tiles
    assert not _kslice_ok(16, [mixed], dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mixed_wide = random_packed([(5, 32 * 4), (4, 32 * 8)], 32 * (sms + 1), perm=True).to("cuda")   # sms + 1 tiles
    assert _kslice_ok(1, [mixed_wide], dev) == KSLICE_ON
    assert not any(_kslice_ok(m, [mixed_wide], dev) for m in (2, 8))
    fits = torch.ops.exl_core.qgemm_kslice_fits
    assert fits(1, 11008, 128, 128, True, 0) and fits(32, 11008, 128, 128, True, 0)
    assert not fits(8, 65536, 128, 128, True, 0)
    assert not fits(33, 4096, 128, 128, True, 0)
    many = 4 * torch.cuda.get_device_properties(0).multi_processor_count   # gate/up-sized
    assert not fits(1, 4096, many, 128, False, 0) and not fits(8, 4096, many, 128, True, 0)   # staged x: skinny's
    assert fits(1, 4096, many, 128, True, 0)                # but uniform 4-bit at one row: kslice's (ring 4)
    assert fits(1, 4096, many, 128, False, 0, 8) and fits(32, 4096, many, 128, True, 0)
    assert not fits(9, 4096, 128, 128, True, 0, 16)          # no 16-warp instance above 8 rows
    assert not fits(9, 4096, 128, 128, True, 0, 0, 16) and fits(9, 4096, 128, 128, True, 0, 0, 8)


@pytest.mark.parametrize("op,M", [("mma", 1), ("mma", 20), ("skinny", 1), ("skinny", 12), ("skinny", 32), ("kslice", 1),
                                  ("kslice", 8), ("kslice", 12), ("kslice", 32), ("wide", 12), ("wide", 32)])
def test_multi_weight_kernels_vs_float64(op, M):
    """q/k/v-style: three weights (own layouts, permutations, widths, biases) on one x, one launch."""
    _need_kernels()
    from exl_core.ops.cuda_candidates import chunk_table
    K = 32 * 40
    layouts = [[(4, K)], [(5, 32 * 8), (4, 32 * 24), (3, 32 * 8)], [(8, 32 * 4), (2, 32 * 36)]]
    pws = [random_packed(lay, n, perm=i > 0, bias=i != 1) for i, (lay, n) in enumerate(zip(layouts, (4 * 67, 36, 512)))]
    x = torch.randn(M, K, dtype=torch.float16)
    cs = [pw.to("cuda") for pw in pws]
    poison_allocator()
    ys = getattr(torch.ops.exl_core, f"qgemm_{op}_multi")(
        x.cuda(), [c.qweight for c in cs], [chunk_table(pw.groups, "cuda") for pw in pws], [c.scale for c in cs],
        [c.zero for c in cs], [c.perm for c in cs], [None if c.bias is None else c.bias.half() for c in cs])
    for y, pw in zip(ys, pws):
        ref = x.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
        assert y.shape == (M, pw.out_features) and rel_err(y, ref) < 2e-3


def test_qmatmul_many_cuda_matches_single_calls():
    _need_kernels()
    from exl_core.ops import qmatmul as qm
    if not hasattr(qm, "qmatmul_many"):
        pytest.skip("ops.qmatmul has no qmatmul_many")
    pws = [random_packed([(4, 256)], n, perm=True, bias=True).to("cuda") for n in (128, 64, 64)]
    for pw in pws:
        pw.bias = pw.bias.half()
    x = torch.randn(3, 256, dtype=torch.float16, device="cuda")
    assert qm.DISPATCH_MANY.select(x=x, pws=pws).name == "cuda"
    many = qm.qmatmul_many(x, pws)
    for y, pw in zip(many, pws):                                  # split-K may differ: rounding only
        one = qm.qmatmul(x, pw)
        assert y.shape == one.shape and rel_err(y, one.double().cpu()) < 1e-3


_BAD_MMA_CALL = """
import torch, exl_core
from exl_core.ops.cuda_candidates import chunk_table
from exl_core.formats.packed import PackedWeight
K, N = 64, {N}
pw = PackedWeight(torch.zeros(K // 8, N, dtype=torch.int32), torch.tensor([(4, 0, K, 0)], dtype=torch.int32),
                  torch.ones(1, N), torch.zeros(1, N), None, K, N).to("cuda")
x = torch.randn(2, K, device="cuda").to({dtype})
try:
    torch.ops.exl_core.qgemm_mma(x, pw.qweight, chunk_table(pw.groups, "cuda"), pw.scale, pw.zero, None, None)
except RuntimeError as e:
    print("raised:", e)
"""


@pytest.mark.parametrize("N,dtype,msg", [(36, "torch.float32", "float16"), (37, "torch.float16", "multiple of 4")])
def test_qgemm_mma_refuses_bad_input(N, dtype, msg):
    """In a child process, so that a crash instead of a clean error fails this test only."""
    _need_kernels()
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _BAD_MMA_CALL.format(N=N, dtype=dtype)], capture_output=True, text=True)
    assert r.returncode == 0 and "raised:" in r.stdout and msg in r.stdout, (r.returncode, r.stdout, r.stderr[-500:])


def test_qmatmul_float32_matches_cpu_kernel():
    _need_kernels()
    from exl_core.ops.qmatmul import qmatmul
    pw = random_packed(LAYOUTS[0], 96, perm=True, bias=True)
    x = torch.randn(5, pw.in_features)
    poison_allocator()
    y = qmatmul(x.cuda(), pw.to("cuda")).cpu()
    assert torch.allclose(y, qmatmul(x, pw), rtol=1e-4, atol=1e-4)


def test_bad_input_names_the_problem():
    _need_kernels()
    from exl_core.errors import InputError
    from exl_core.ops.qmatmul import qmatmul
    pw = random_packed(LAYOUTS[0], 32, perm=False).to("cuda")
    x = torch.randn(2, pw.in_features + 32, device="cuda", dtype=torch.float16)
    with pytest.raises(InputError, match="in_features"):
        qmatmul(x, pw)
