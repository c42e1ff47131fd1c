"""The page-gathering SDPA paged attention against the host-walking torch reference."""
from __future__ import annotations

import pytest
import torch

from exl_core.ops.attention import PAGED_ATTENTION, paged_attention_ref
from exl_core.ops.attention_gathered import paged_attention_gathered


def _case(q_lens, k_lens, hq=4, hkv=2, d=64, page=8, dtype=torch.float32, drop_first_pages=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = len(q_lens)
    width = max(-(-k // page) for k in k_lens) + 1                       # one spare column of -1
    num_pages = s * width + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((s, width), -1, dtype=torch.int32)
    for i, k in enumerate(k_lens):
        for p in range(drop_first_pages, -(-k // page)):                # released window pages stay -1
            table[i, p] = perm.pop()
    kc = torch.full((num_pages, page, hkv, d), float("nan"), dtype=dtype)     # only written slots may count
    vc = torch.full((num_pages, page, hkv, d), float("nan"), dtype=dtype)
    for i, k in enumerate(k_lens):
        for p in range(k):
            pg = int(table[i, p // page])
            if pg >= 0:
                kc[pg, p % page] = torch.randn(hkv, d, generator=g).to(dtype)
                vc[pg, p % page] = torch.randn(hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int64)
    return q, kc, vc, table, cu, torch.tensor(k_lens, dtype=torch.int64)


@pytest.mark.parametrize("q_lens,k_lens,window,drop", [
    ([1, 1, 1], [5, 17, 9], None, 0),            # decode rows
    ([7], [7], None, 0),                         # one prefill
    ([3, 1, 12], [20, 9, 12], None, 0),          # mixed: continuation, decode, fresh prefill
    ([1, 4], [40, 30], 6, 2),                    # sliding window, first pages released (-1)
    ([2, 2], [16, 3], None, 0),                  # speculative verify rows
])
def test_matches_reference(q_lens, k_lens, window, drop):
    q, kc, vc, table, cu, lens = _case(q_lens, k_lens, drop_first_pages=drop)
    ref = paged_attention_ref(q, kc, vc, table, cu, lens, 0.125, window)
    out = paged_attention_gathered(q, kc, vc, table, cu, lens, 0.125, window, max_q_len=max(q_lens))
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < 1e-5


def test_bf16_and_grouped_heads():
    q, kc, vc, table, cu, lens = _case([2, 1, 5], [9, 33, 5], hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=3)
    ref = paged_attention_ref(q, kc, vc, table, cu, lens, 0.09, None).float()
    out = paged_attention_gathered(q, kc, vc, table, cu, lens, 0.09, None).float()
    assert (out - ref).abs().max().item() < 3e-2


@pytest.mark.parametrize("hint", [None, 3])
def test_sequence_without_new_rows(hint):
    q, kc, vc, table, cu, lens = _case([3, 1], [9, 4])
    cu = torch.tensor([0, 3, 3, 4])                         # the middle sequence contributes no rows
    table = torch.cat([table[:1], table[:1], table[1:]])
    lens = torch.tensor([9, 9, 4])
    ref = paged_attention_ref(q, kc, vc, table, cu, lens, 0.125, None)
    out = paged_attention_gathered(q, kc, vc, table, cu, lens, 0.125, None, max_q_len=hint)
    assert (out - ref).abs().max().item() < 1e-5


def test_wrong_row_hint_is_refused():
    q, kc, vc, table, cu, lens = _case([2, 1], [4, 3])
    with pytest.raises(RuntimeError):
        paged_attention_gathered(q, kc, vc, table, cu, lens, 0.125, None, max_q_len=1)


def test_serves_where_the_cpu_kernel_refuses():
    q, kc, vc, table, cu, lens = _case([1, 2], [6, 11], d=32)      # head dim 32: no C++ kernel
    names = [c.name for c in PAGED_ATTENTION.candidates]
    assert names.index("gathered_sdpa") < names.index("torch_ref")
    assert PAGED_ATTENTION.select(q=q, k_cache=kc, v_cache=vc, block_table=table, cu_seqlens_q=cu,
                                  seq_lens_k=lens, scale=0.2, window=None).name == "gathered_sdpa"


@pytest.mark.parametrize("dtype,hq,tol", [(torch.float32, 4, 1e-5), (torch.bfloat16, 8, 3e-2)])
def test_sequence_causal_attention_matches_reference(dtype, hq, tol):
    """One sequence's first rows over their own slots (pages out of order, the rest of the cache NaN) by SDPA's
    causal mask: as the host-walking reference."""
    from exl_core.ops.attention_gathered import sequence_causal_attention
    n, page = 21, 8
    q, kc, vc, table, cu, lens = _case([n], [n], hq=hq, hkv=2, d=64, dtype=dtype, seed=5)
    slots = torch.tensor([int(table[0, p // page]) * page + p % page for p in range(n)])
    ref = paged_attention_ref(q, kc, vc, table, cu, lens, 0.2, None).float()     # not SDPA's default 1 / sqrt(d)
    out = sequence_causal_attention(q, kc, vc, slots, 0.2)
    assert out.shape == (n, hq, 64) and out.dtype == dtype and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype,hq,tol", [(torch.float32, 4, 1e-5), (torch.float32, 2, 1e-5), (torch.bfloat16, 8, 3e-2)])
@pytest.mark.parametrize("cached", [1, 9, 30])
def test_sequence_causal_attention_after_cached_positions(dtype, hq, tol, cached):
    """One sequence's last rows over all its keys (the earlier ones cached: a later prefill chunk, a reused prefix),
    pages out of order and the rest of the cache NaN, by the lower-right causal bias: as the host-walking reference;
    GQA (its KV heads repeated) and equal head counts."""
    from exl_core.ops.attention_gathered import sequence_causal_attention
    n, page = 21, 8
    L = cached + n
    q, kc, vc, table, cu, lens = _case([n], [L], hq=hq, hkv=2, d=64, dtype=dtype, seed=6 + cached)
    slots = torch.tensor([int(table[0, p // page]) * page + p % page for p in range(L)])
    ref = paged_attention_ref(q, kc, vc, table, cu, lens, 0.2, None).float()
    out = sequence_causal_attention(q, kc, vc, slots, 0.2)
    assert out.shape == (n, hq, 64) and out.dtype == dtype and torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() < tol
