"""The CUDA paged attention kernel (csrc/cuda/paged_attention_cuda.cu) against a brute-force
reference in float64: decode rows, speculative-verify rows, GQA ratios the kernel pads (3 -> 4,
7 -> 8), head dims 64/128/256, odd page sizes, sliding windows with released pages, several key
splits (merged in-kernel through a cluster, or by the combine kernel), a CUDA graph replayed over new tables
and lengths, and the Generator on it. Cache slots no
query may read hold NaN, so a stray read shows up in the output. Also the K/V write kernel
(kv_write_cuda.cu) against index_copy."""
from __future__ import annotations

import pytest
import torch
from test_attention_gathered import _case

from exl_core.ops.attention import PAGED_ATTENTION, paged_attention

pytestmark = pytest.mark.cuda

# Rounding the fp32 result to the output dtype moves it by at most half an ulp: 2^-11 |x| (fp16), 2^-8 |x|
# (bf16). The bound allowed is twice that, plus 1e-4 for fp32 accumulation and fp16 subnormals.
RTOL = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _need_kernel():
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not _has_cuda_kernel("paged_attention"):
        pytest.fail("torch sees a GPU but exl_core._C was built without the CUDA paged_attention kernel")


def _ref64(q, kc, vc, table, cu, lens, scale, window):
    """Brute force in float64 on the CPU, row by row: the keys at positions lo..pos through the table,
    query head h on kv head h // (Hq / Hkv). Reads only visible slots (NaN elsewhere stays out)."""
    q, kc, vc = q.double(), kc.double(), vc.double()
    page, group = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.empty_like(q)
    for s in range(lens.shape[0]):
        a, b = int(cu[s]), int(cu[s + 1])
        for r in range(a, b):
            pos = int(lens[s]) - (b - a) + (r - a)
            lo = max(0, pos - window + 1) if window else 0
            ts = range(lo, pos + 1)
            keys = torch.stack([kc[int(table[s, t // page]), t % page] for t in ts])      # (L, Hkv, D)
            vals = torch.stack([vc[int(table[s, t // page]), t % page] for t in ts])
            keys = keys.repeat_interleave(group, dim=1)                                  # (L, Hq, D)
            vals = vals.repeat_interleave(group, dim=1)
            p = torch.softmax(torch.einsum("hd,lhd->hl", q[r], keys) * scale, dim=-1)
            out[r] = torch.einsum("hl,lhd->hd", p, vals)
    return out


def _run_cuda(q, kc, vc, table, cu, lens, scale, window, max_q_len):
    dev = "cuda"
    args = dict(q=q.to(dev), k_cache=kc.to(dev), v_cache=vc.to(dev), block_table=table.to(dev),
                cu_seqlens_q=cu.to(dev), seq_lens_k=lens.to(dev), scale=scale, window=window, max_q_len=max_q_len)
    assert PAGED_ATTENTION.select(**args).name == "cuda"
    return paged_attention(**args).cpu()


def _splits(rows, hkv, table, page):
    """The key splits the op launches for this call's shapes."""
    return torch.ops.exl_core.paged_attention_cuda_splits(rows, hkv, table.shape[1] * page, torch.cuda.current_device())


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN/inf: a slot outside the visible keys was read or an output not written"
    excess = ((out.double() - ref).abs() - (RTOL[dtype] * ref.abs() + 1e-4)).max().item()
    assert excess <= 0, f"error beyond output rounding by {excess}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (14, 2, 128), (8, 1, 128), (4, 2, 256)])
def test_decode_rows(dtype, hq, hkv, d):
    _need_kernel()
    q_lens, k_lens = [1, 1, 1, 1], [5, 17, 64, 130]
    q, kc, vc, table, cu, lens = _case(q_lens, k_lens, hq=hq, hkv=hkv, d=d, page=16, dtype=dtype, seed=hq + d)
    ref = _ref64(q, kc, vc, table, cu, lens, d ** -0.5, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, d ** -0.5, None, 1), ref, dtype)


@pytest.mark.parametrize("q_lens,k_lens,window,drop,page", [
    ([3, 1, 12], [20, 9, 12], None, 0, 8),        # verify rows, decode, a short fresh prefill
    ([2, 2], [16, 3], None, 0, 5),                # odd page size
    ([1, 4], [40, 30], 6, 2, 8),                  # sliding window, first pages released (-1)
    ([1, 1], [700, 3], None, 0, 16),              # long sequence: several key splits
    ([1], [1], None, 0, 256),                     # one key
    ([5, 1], [260, 257], 100, 0, 256),            # window across a page border of big pages
    ([1, 3], [900, 700], 100, 20, 16),            # window, released pages and many splits together
])
def test_mixed_rows_windows_pages(q_lens, k_lens, window, drop, page):
    _need_kernel()
    dtype = torch.float16
    q, kc, vc, table, cu, lens = _case(q_lens, k_lens, hq=8, hkv=2, d=128, page=page, dtype=dtype,
                                       drop_first_pages=drop, seed=len(q_lens) + page)
    ref = _ref64(q, kc, vc, table, cu, lens, 0.08, window)
    _check(_run_cuda(q, kc, vc, table, cu, lens, 0.08, window, max(q_lens)), ref, dtype)


def test_several_splits_are_used_and_merge():
    """Batch 1 over 2,000 keys: the launch splits the keys; the merged result equals one pass."""
    _need_kernel()
    q, kc, vc, table, cu, lens = _case([1], [2000], hq=8, hkv=2, d=128, page=256, dtype=torch.float16, seed=7)
    assert _splits(1, 2, table, 256) > 1
    ref = _ref64(q, kc, vc, table, cu, lens, 0.1, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, 0.1, None, 1), ref, torch.float16)


@pytest.mark.parametrize("rows,keys,merge", [(1, 400, "cluster"), (1, 2000, "combine kernel"),
                                             (40, 400, "combine kernel")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_merge_paths(rows, keys, merge, dtype):
    """2..8 splits of a small grid (at most 2 blocks per SM) merge inside the kernel (a thread-block cluster on
    sm_90, the combine kernel below it); more than 8 splits, or 2..8 over a larger grid, take the combine kernel.
    All equal the float64 reference. (Which path ran is not visible from here: the shapes are chosen by the rule.)"""
    _need_kernel()
    q, kc, vc, table, cu, lens = _case([1] * rows, [keys - i for i in range(rows)], hq=8, hkv=2, d=128, page=16,
                                       dtype=dtype, seed=keys + rows)
    n = _splits(rows, 2, table, 16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    small = rows * 2 * n <= 2 * sms
    assert (2 <= n <= 8 and small) if merge == "cluster" else (n > 8 or (n > 1 and not small)), (n, small)
    ref = _ref64(q, kc, vc, table, cu, lens, 0.1, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, 0.1, None, 1), ref, dtype)


@pytest.mark.parametrize("q_lens,k_lens,d,window,page", [
    ([1], [264], 128, None, 16),                   # the bench's batch 1: 5 splits of 64 keys, two iterations each
    ([1] * 16, [600 - 7 * i for i in range(16)], 64, None, 16),   # D 64: 8 splits of 80 keys, iterations of 64
    ([1, 1], [300, 90], 256, None, 8),             # of 16 keys at D 256, small pages
    ([1, 3], [500, 333], 128, 100, 16),            # a window: the first key inside a split; verify rows (fresh keys)
    ([4, 1], [37, 70], 128, None, 16),             # the row's own keys inside the staged iteration
])
def test_second_iteration_staged_before_the_wait(q_lens, k_lens, d, window, page, monkeypatch):
    """One query head per kv head (the STAGE2 instances): a split's second iteration of old keys comes from shared
    memory (cp.async before the PDL wait, stop 39). Against the float64 reference, and bit for bit against the same
    launch with that staging off (EXL_CORE_ATTN_STAGE2=0, read per call)."""
    _need_kernel()
    q, kc, vc, table, cu, lens = _case(q_lens, k_lens, hq=4, hkv=4, d=d, page=page, dtype=torch.float16,
                                       seed=sum(k_lens) + d)
    # pick_splits' chunk (keys a split) must exceed the kernel's keys an iteration (4 * 4 warps * 32 / (D / 8) =
    # 4096 / D), or nothing is staged
    n = _splits(sum(q_lens), 4, table, page)
    per_split = -(-table.shape[1] * page // n)                    # ceil, then up to a multiple of 16
    chunk = -(-per_split // 16) * 16
    assert chunk > 4096 // d and max(k_lens) > 4096 // d, (n, chunk)
    ref = _ref64(q, kc, vc, table, cu, lens, 0.09, window)
    out = _run_cuda(q, kc, vc, table, cu, lens, 0.09, window, max(q_lens))
    _check(out, ref, torch.float16)
    monkeypatch.setenv("EXL_CORE_ATTN_STAGE2", "0")       # the host reads it per call (paged_attention_cuda.cu)
    assert torch.equal(out, _run_cuda(q, kc, vc, table, cu, lens, 0.09, window, max(q_lens)))


def test_many_rows_one_split():
    """Enough (row, kv head) blocks to fill the GPU: one split, the block writes the output itself."""
    _need_kernel()
    q, kc, vc, table, cu, lens = _case([1] * 40, [1 + 3 * i for i in range(40)], hq=16, hkv=16, d=64, page=4,
                                       dtype=torch.bfloat16, seed=11)
    assert _splits(40, 16, table, 4) == 1
    ref = _ref64(q, kc, vc, table, cu, lens, 0.125, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, 0.125, None, 1), ref, torch.bfloat16)


@pytest.mark.parametrize("one_wave", ["1", "0"])
@pytest.mark.parametrize("dtype,d", [(torch.float16, 128), (torch.bfloat16, 64)])
def test_grid_of_one_wave_instance(one_wave, dtype, d, monkeypatch):
    """Just over 5 blocks per SM of (row, kv head) pairs (42 rows x 16 kv heads on 132 SMs), one split: more blocks
    than one wave of the default one-head-per-kv-head instance and at most one wave of the 8-per-SM instance, which
    the rule then picks (EXL_CORE_ATTN_ONE_WAVE=0: the default one); both equal the float64 reference. (Which
    instance ran is not visible from here: the shape is chosen by the rule.)"""
    _need_kernel()
    monkeypatch.setenv("EXL_CORE_ATTN_ONE_WAVE", one_wave)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = -(-(5 * sms + 1) // 16)                                  # just past 5 blocks per SM
    assert rows * 16 <= 8 * sms
    q, kc, vc, table, cu, lens = _case([1] * rows, [1 + (7 * i) % 200 for i in range(rows)], hq=16, hkv=16, d=d,
                                       page=16, dtype=dtype, seed=rows + d)
    assert _splits(rows, 16, table, 16) == 1
    ref = _ref64(q, kc, vc, table, cu, lens, d ** -0.5, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, d ** -0.5, None, 1), ref, dtype)


def test_tiny_pages_past_the_staged_table():
    """One split over 150 pages of 4 slots: page numbers past the 128 a block stages in shared
    memory come from the table in global memory."""
    _need_kernel()
    q, kc, vc, table, cu, lens = _case([1] * 40, [600 - 7 * i for i in range(40)], hq=16, hkv=16, d=64, page=4,
                                       dtype=torch.float16, seed=12)
    assert _splits(40, 16, table, 4) == 1 and table.shape[1] > 128
    ref = _ref64(q, kc, vc, table, cu, lens, 0.125, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, 0.125, None, 1), ref, torch.float16)


@pytest.mark.parametrize("q_lens,k_lens", [([1], [400]), ([1] * 40, [400] * 40), ([3, 1, 4], [20, 5, 300]),
                                           ([1, 2], [3, 70]), ([3, 2], [10, 6]), ([4], [4])])
def test_own_keys_written_by_the_kernel_just_before(q_lens, k_lens):
    """The kernel reads the keys older than the step's rows before its PDL wait and the rows' own keys after it:
    with those own keys written by write_kv's kernel right before it in the stream (no sync between, as a decode
    step runs them), and NaN in their slots until then, every output equals the float64 reference -- for one
    cluster-merged batch-1 row and 40 rows with the combine kernel (own key inside a split's first window), verify
    rows with own keys past the first window, inside it (q_len 3 and 2 from key 7 and 4), and a sequence that is
    all own keys (nothing read early). A race shows only when the early loads overtake the write, so a pass is
    evidence, not proof."""
    _need_kernel()
    from exl_core.ops.attention import write_kv
    dtype, hq, hkv, d, page = torch.float16, 8, 2, 128, 16
    q, kc, vc, table, cu, lens = _case(q_lens, k_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=sum(k_lens))
    ref = _ref64(q, kc, vc, table, cu, lens, 0.1, None)
    slots = [int(table[s, t // page]) * page + t % page
             for s, (ql, kl) in enumerate(zip(q_lens, k_lens)) for t in range(kl - ql, kl)]
    slots_t = torch.tensor(slots, dtype=torch.int64)
    new_k = kc.view(-1, hkv, d)[slots_t].cuda()
    new_v = vc.view(-1, hkv, d)[slots_t].cuda()
    gk, gv = kc.cuda(), vc.cuda()
    args = [t.cuda() for t in (q, table, cu, lens)]
    for _ in range(3):
        gk.view(-1, hkv, d)[slots_t.cuda()] = float("nan")      # the rows' own slots: NaN until written
        gv.view(-1, hkv, d)[slots_t.cuda()] = float("nan")
        write_kv(gk, gv, new_k, new_v, slots_t.cuda())
        out = paged_attention(args[0], gk, gv, args[1], args[2], args[3], 0.1, None, max_q_len=max(q_lens))
        _check(out.cpu(), ref, dtype)


def test_sequence_without_rows():
    _need_kernel()
    q, kc, vc, table, cu, lens = _case([3, 1], [9, 4], hq=4, hkv=2, d=64, dtype=torch.float16)
    cu = torch.tensor([0, 3, 3, 4])                                 # the middle sequence adds no rows
    table = torch.cat([table[:1], table[:1], table[1:]])
    lens = torch.tensor([9, 9, 4])
    ref = _ref64(q, kc, vc, table, cu, lens, 0.125, None)
    _check(_run_cuda(q, kc, vc, table, cu, lens, 0.125, None, 3), ref, torch.float16)


def test_long_query_runs_go_to_the_gathering_path():
    _need_kernel()
    q, kc, vc, table, cu, lens = _case([40], [40], hq=4, hkv=2, d=64, dtype=torch.float16)
    args = dict(q=q.cuda(), k_cache=kc.cuda(), v_cache=vc.cuda(), block_table=table.cuda(), cu_seqlens_q=cu.cuda(),
                seq_lens_k=lens.cuda(), scale=0.125, window=None, max_q_len=40)
    assert PAGED_ATTENTION.select(**args).name == "gathered_sdpa"
    args["max_q_len"] = None                                       # no host bound: never the per-row kernel
    assert PAGED_ATTENTION.select(**args).name == "gathered_sdpa"


def test_graph_replay_over_new_tables_and_lengths():
    """Split count and launch shape come from host-known shapes only: one recorded graph serves
    every step's tables, lengths and values."""
    _need_kernel()
    dtype, hq, hkv, d, page, width = torch.float16, 8, 2, 128, 16, 10
    steps = [_case([1, 1, 1], k, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=i)
             for i, k in enumerate(([5, 100, 37], [120, 1, 64], [17, 33, 127]))]
    num_pages = max(s[1].shape[0] for s in steps)
    q_s = torch.zeros(3, hq, d, dtype=dtype, device="cuda")
    k_s = torch.zeros(num_pages, page, hkv, d, dtype=dtype, device="cuda")
    v_s = torch.zeros_like(k_s)
    t_s = torch.full((3, width), -1, dtype=torch.int32, device="cuda")
    cu_s = torch.arange(4, dtype=torch.int64, device="cuda")
    l_s = torch.ones(3, dtype=torch.int64, device="cuda")

    def load(case):
        q, kc, vc, table, _cu, lens = case
        q_s.copy_(q)
        k_s.fill_(float("nan"))                                 # slots no query may read stay NaN
        v_s.fill_(float("nan"))
        k_s[:kc.shape[0]].copy_(kc)
        v_s[:vc.shape[0]].copy_(vc)
        t_s.fill_(-1)
        t_s[:, :table.shape[1]].copy_(table)
        l_s.copy_(lens)

    def fn():
        return paged_attention(q_s, k_s, v_s, t_s, cu_s, l_s, 0.09, None, max_q_len=1)

    load(steps[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    for case in steps:
        load(case)
        g.replay()
        q, kc, vc, table, cu, lens = case
        _check(out.cpu(), _ref64(q, kc, vc, table, cu, lens, 0.09, None), dtype)


def test_generator_decodes_through_the_kernel(tiny_model_factory, monkeypatch):
    """A fp16 model with 64-wide heads on the GPU: the Generator's decode steps (CUDA graphs) run
    this kernel, and every job's tokens match the same jobs with attention forced to the gathering
    path, up to near-ties (the two round differently)."""
    _need_kernel()
    import random

    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from exl_core.loader import load_model
    from exl_core.ops import dispatch
    from exl_core.testing import assert_same_tokens_up_to_ties
    folder = tiny_model_factory("llama", seed=5, vocab_size=500, hidden_size=256, intermediate_size=384,
                                num_attention_heads=4, num_key_value_heads=2)
    model, _ = load_model(folder, device="cuda", dtype=torch.float16, load_tokenizer=False)
    rnd = random.Random(3)
    prompts = [[rnd.randrange(3, 500) for _ in range(n)] for n in (5, 40, 19, 70)]

    def run():
        gen = Generator(model, Cache(model, max_tokens=2048, page_size=16), None, max_batch_tokens=256,
                        max_chunk_size=64)
        jobs = gen.enqueue([Job(p, max_new_tokens=m, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False,
                                return_logprobs=True) for p, m in zip(prompts, (12, 7, 20, 3))])
        while gen.has_work():
            gen.iterate()
        assert gen.graphs is not None and gen.graphs.replays > 0
        return [(j.generated, list(j.logprobs)) for j in jobs]

    PAGED_ATTENTION._chosen.clear()
    mine = run()
    assert any(c.name == "cuda" for c in PAGED_ATTENTION._chosen.values())
    monkeypatch.setitem(dispatch._FORCED, "attention", "gathered_sdpa")
    theirs = run()
    for (ta, la), (tb, lb) in zip(mine, theirs):
        assert_same_tokens_up_to_ties(ta, la, tb, lb, 2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_write_matches_index_copy(dtype):
    """write_kv on the GPU (kv_write: the one-launch kernel for 16-byte rows, index_copy inside the op for
    other layouts) against index_copy on the CPU: rows of a wider tensor (the kernel), inner dims strided
    and k of another dtype than the cache (the op's fallback), slots in any order; every other slot keeps
    its poison."""
    from exl_core.ops.attention import write_kv
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not _has_cuda_kernel("kv_write"):
        pytest.fail("torch sees a GPU but exl_core._C was built without the CUDA kv_write kernel")
    g = torch.Generator().manual_seed(1)
    pages, page, hkv, d, t = 6, 8, 2, 64, 5
    kc = torch.full((pages, page, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    rows = torch.randn(t, 3 * hkv * d, generator=g).to(dtype).cuda()
    wide = torch.randn(t, hkv, 2 * d, generator=g).to(dtype).cuda()
    k = torch.randn(t, hkv, d, generator=g).to(dtype).cuda()
    other = torch.float32 if dtype != torch.float32 else torch.float16
    cases = (("rows strided", k, rows[:, hkv * d:2 * hkv * d].view(t, hkv, d)),
             ("inner strided", k, wide[:, :, :d]),
             ("k in another dtype", k.to(other), rows[:, :hkv * d].view(t, hkv, d)))
    slots = torch.tensor([17, 3, 40, 0, 29])
    for name, kk, vv in cases:
        ref_k, ref_v = kc.clone(), vc.clone()
        ref_k.view(-1, hkv, d).index_copy_(0, slots, kk.cpu().to(dtype))
        ref_v.view(-1, hkv, d).index_copy_(0, slots, vv.cpu())
        gk, gv = kc.cuda(), vc.cuda()
        write_kv(gk, gv, kk, vv, slots.cuda())
        assert torch.equal(gk.cpu().nan_to_num(7.0), ref_k.nan_to_num(7.0)), name
        assert torch.equal(gv.cpu().nan_to_num(7.0), ref_v.nan_to_num(7.0)), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 128), (9, 3, 64)])
def test_rope_kv_write_equals_rope_then_write(dtype, hq, hkv, d):
    """rope_write_kv's one launch (exl_core::rope_kv_write) gives the rotated q and writes the rotated k and v
    into their slots bit for bit as apply_rope then write_kv: contiguous positions and a broadcast one (stride 0,
    as a graphed decode step passes it), a slot outside the cache (skipped by both), a position past the rope
    table (NaN rows from both, in q and in the k slot); every other slot keeps its poison."""
    from exl_core.ops import attention as att
    from exl_core.ops.rope import apply_rope, cos_sin_table
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not _has_cuda_kernel("rope_kv_write"):
        pytest.fail("torch sees a GPU but exl_core._C was built without the CUDA rope_kv_write kernel")
    g = torch.Generator().manual_seed(hq + d)
    pages, page, t = 6, 8, 5
    cos_sin = cos_sin_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 64).cuda()
    kc0 = torch.full((pages, page, hkv, d), 1234.0, dtype=dtype, device="cuda")      # finite: a skipped write shows
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).cuda() for h in (hq, hkv, hkv))
    slots = torch.tensor([17, 3, 400, 0, 29], device="cuda")                     # 400: outside the cache
    for name, pos in (("rows", torch.tensor([5, 0, 63, 9, 64], device="cuda")),  # 64: past the table
                      ("broadcast", torch.tensor([7], device="cuda").expand(t))):
        assert att._rope_kv_fusable(q, k, v, pos, cos_sin, kc0, kc0, slots), name
        kc, vc = kc0.clone(), kc0.clone()
        qo = att.rope_write_kv(q, k, v, pos, cos_sin, kc, vc, slots)
        rq, rk = apply_rope(q, k, pos, cos_sin)
        ref_k, ref_v = kc0.clone(), kc0.clone()
        att.write_kv(ref_k, ref_v, rk, v, slots)
        for got, want in ((qo, rq), (kc, ref_k), (vc, ref_v)):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), name


def _decode_rope_case(n_rows, k_lens, hq, hkv, d, page, dtype, seed):
    """Decode rows (one per sequence) before rope: q, k, v; the cache with every earlier key; the positions and
    slots the contexts' step_indices give (the row's position seq_lens_k - 1, its slot through the table)."""
    from exl_core.ops.rope import cos_sin_table
    q, kc, vc, table, cu, lens = _case([1] * n_rows, k_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    k, v = (torch.randn(n_rows, hkv, d, generator=g).to(dtype) for _ in range(2))
    pos = lens - 1
    slots = torch.tensor([int(table[s, int(p) // page]) * page + int(p) % page for s, p in enumerate(pos)])
    kc.view(-1, hkv, d)[slots] = float("nan")                 # the own slots: only the op's write may fill them
    vc.view(-1, hkv, d)[slots] = float("nan")
    cos_sin = cos_sin_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), max(k_lens) + 8)
    return [t.cuda() for t in (q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_lens,hq,hkv,d,page,window", [
    ([5, 17, 64, 130], 4, 4, 64, 16, None),        # one query head per kv head
    ([9, 33, 200], 9, 3, 64, 8, None),              # 3 heads padded to the 4-head instance
    ([3, 77], 8, 2, 128, 16, None),
    ([40, 300], 8, 1, 128, 16, 24),                 # 8 heads per kv head, a sliding window
    ([300], 4, 2, 256, 16, None),                   # one row: several key splits (cluster merge)
    ([150] * 24, 4, 4, 128, 16, None),              # splits merged by the combine kernel
    ([129] * 32, 32, 32, 128, 16, None),            # the bench's batch 32: the one-wave instance
    ([264], 4, 4, 128, 16, None),                   # batch 1, one head per kv head: the second iteration staged
    ([290], 4, 4, 128, 16, None),                   # the last split's second iteration: key 288 staged, 289 its own
])
def test_paged_attention_rope_equals_rope_then_attention(dtype, k_lens, hq, hkv, d, page, window):
    """rope_paged_attention's one launch (exl_core::paged_attention_rope) against rope_write_kv then paged_attention
    on the same inputs: the output and both caches bit for bit (the rows' own slots start as NaN, so a missing or
    misplaced write shows)."""
    from exl_core.ops import attention as att
    from exl_core.ops.cuda_candidates import _has_cuda_kernel
    if not _has_cuda_kernel("paged_attention_rope"):
        pytest.fail("torch sees a GPU but exl_core._C was built without the CUDA paged_attention_rope kernel")
    q, k, v, pos, cos_sin, kc0, vc0, slots, table, cu, lens = _decode_rope_case(
        len(k_lens), k_lens, hq, hkv, d, page, dtype, seed=hq * d + len(k_lens))
    scale = d ** -0.5
    assert att._rope_attn_fusable(q, k, v, pos, cos_sin, kc0, vc0, slots, table, cu, lens, scale, window, 1)
    kc, vc = kc0.clone(), vc0.clone()
    out = att.rope_paged_attention(q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens, scale, window, 1)
    rk, rv = kc0.clone(), vc0.clone()
    rq = att.rope_write_kv(q, k, v, pos, cos_sin, rk, rv, slots)
    ref = att.paged_attention(rq, rk, rv, table, cu, lens, scale, window, max_q_len=1)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref)
    assert torch.equal(kc.nan_to_num(7.0), rk.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), rv.nan_to_num(7.0))
    assert torch.isfinite(kc.view(-1, hkv, d)[slots]).all()


def test_paged_attention_rope_only_for_decode_rows(monkeypatch):
    """Rows of a sequence after its first (speculative verification) keep the two launches: the kernel takes the
    own key of one row per sequence; so does EXL_CORE_ROPE_ATTN_FUSE=0."""
    from exl_core.ops import attention as att
    q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens = _decode_rope_case(2, [20, 9], 4, 2, 64, 8,
                                                                               torch.float16, seed=5)
    args = (q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens, 0.125, None)
    assert att._rope_attn_fusable(*args, 1)
    assert not att._rope_attn_fusable(*args, 2) and not att._rope_attn_fusable(*args, None)
    monkeypatch.setattr(att, "ROPE_ATTN_FUSE", False)
    assert not att._rope_attn_fusable(*args, 1)


def test_generator_with_rope_in_attention_matches_without(tiny_model_factory, monkeypatch):
    """The Generator's decode steps (CUDA graphs, PagedContext.attend_rope) through paged_attention_rope give the
    same tokens and log-probabilities, bit for bit, as with rope and the K/V write as their own launch."""
    _need_kernel()
    import random

    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from exl_core.loader import load_model
    from exl_core.ops import attention as att
    folder = tiny_model_factory("llama", seed=7, vocab_size=500, hidden_size=256, intermediate_size=384,
                                num_attention_heads=4, num_key_value_heads=2)
    model, _ = load_model(folder, device="cuda", dtype=torch.float16, load_tokenizer=False)
    rnd = random.Random(4)
    prompts = [[rnd.randrange(3, 500) for _ in range(n)] for n in (6, 33, 17)]
    fused = []
    check = att._rope_attn_fusable
    monkeypatch.setattr(att, "_rope_attn_fusable", lambda *a: fused.append(check(*a)) or fused[-1])

    def run():
        gen = Generator(model, Cache(model, max_tokens=2048, page_size=16), None, max_batch_tokens=256,
                        max_chunk_size=64)
        jobs = gen.enqueue([Job(p, max_new_tokens=m, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False,
                                return_logprobs=True) for p, m in zip(prompts, (9, 14, 5))])
        while gen.has_work():
            gen.iterate()
        return [(j.generated, list(j.logprobs)) for j in jobs]

    mine = run()
    assert any(fused)
    monkeypatch.setattr(att, "ROPE_ATTN_FUSE", False)
    fused.clear()
    theirs = run()
    assert not any(fused)
    assert mine == theirs
