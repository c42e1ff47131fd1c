"""Paged attention for devices without a paged kernel (CUDA today): gather pages, one SDPA call.

The torch reference (attention.paged_attention_ref) walks sequences on the host and reads the
block table back (three device->host syncs per layer, fp32 math): correct, but on a GPU it
stalls every layer and cannot be captured in a CUDA graph. This candidate needs no host value:

  keys     k_cache[block_table] -> (S, Hkv, L, D), L = max_pages * page_size; slots never written
           (past a sequence's end, -1 pages read as page 0) are zeroed, then masked off
  queries  scattered into (S, Hq, Qmax, D), Qmax = the caller's max_q_len (PagedContext knows it
           on the host; checked on the device, no sync), else T
  mask     key position <= query position, inside the window; padding rows see key 0 only
           (their output is dropped) so no row is fully masked
  one scaled_dot_product_attention call (GQA native), rows gathered back to (T, Hq, D).

Cost: it reads max_pages pages for every sequence (shorter sequences pad), and Qmax pads the
query side when a batch mixes a long prefill chunk with decode rows; both are bounded by the
scheduler's token budget. Math in q's dtype (fp16/bf16 on GPUs), fp32 softmax inside SDPA.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .attention import PAGED_ATTENTION, _check_paged_args
from .dispatch import Candidate


def paged_attention_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                             scale: float, window: Optional[int] = None,
                             max_q_len: Optional[int] = None) -> torch.Tensor:
    _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    t, hq, d = q.shape
    s = seq_lens_k.shape[0]
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    length = block_table.shape[1] * page
    qmax = max(min(max_q_len, t) if max_q_len is not None else t, 1)
    dev = q.device
    cu = cu_seqlens_q.to(dev)
    qlen = cu[1:] - cu[:-1]                                            # (S,)
    if max_q_len is not None:
        torch._assert_async((qlen <= qmax).all())                     # a wrong hint would drop rows
    rows = torch.arange(t, device=dev)
    seq = torch.searchsorted(cu[1:], rows, right=True)                 # sequence of each row
    dest = seq * qmax + (rows - cu[seq])                               # its slot in (S, Qmax)
    qp = q.new_zeros(s * qmax, hq, d).index_copy_(0, dest, q).view(s, qmax, hq, d).transpose(1, 2)
    pages = block_table.to(device=dev, dtype=torch.int64).clamp(min=0)
    lens = seq_lens_k.to(dev)
    kpos1 = torch.arange(length, device=dev)
    # slots never written (past the end, released pages read as page 0) may hold anything, NaN
    # included; a masked score does not stop NaN * 0 in the value sum, so they are zeroed first
    written = ((kpos1[None, :] < lens[:, None]) & (block_table.to(dev) >= 0).repeat_interleave(page, dim=1))
    unwritten = ~written[:, None, :, None]
    kg = k_cache[pages].view(s, length, hkv, d).transpose(1, 2).to(q.dtype).masked_fill(unwritten, 0)
    vg = v_cache[pages].view(s, length, hkv, d).transpose(1, 2).to(q.dtype).masked_fill(unwritten, 0)
    j = torch.arange(qmax, device=dev)
    qpos = lens[:, None] - qlen[:, None] + j[None, :]                 # (S, Qmax) absolute positions
    kpos = kpos1[None, None, :]
    allowed = kpos <= qpos[:, :, None]
    if window:
        allowed &= kpos > qpos[:, :, None] - window
    pad = (j[None, :] >= qlen[:, None])[:, :, None]
    allowed = (allowed & ~pad) | (pad & (kpos == 0))
    out = F.scaled_dot_product_attention(qp, kg, vg, attn_mask=allowed[:, None], scale=scale,
                                         enable_gqa=hq != hkv)               # (S, Hq, Qmax, D)
    return out.transpose(1, 2).reshape(s * qmax, hq, d).index_select(0, dest)


def _check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window, max_q_len=None) -> Optional[str]:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"q dtype {q.dtype} not supported"
    if q.shape[1] % k_cache.shape[2]:
        return f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
    return None


def _run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window, max_q_len=None):
    return paged_attention_gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window,
                                    max_q_len)


def register() -> None:
    """Insert before the host-walking reference (the CPU kernel, where it serves, stays first)."""
    names = [c.name for c in PAGED_ATTENTION.candidates]
    if "gathered_sdpa" not in names:
        PAGED_ATTENTION.candidates.insert(names.index("torch_ref"), Candidate("gathered_sdpa", _check, _run))
