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
from torch.nn.attention.bias import causal_lower_right

from .attention import PAGED_ATTENTION, _check_paged_args
from .dispatch import Candidate


class _Plan:
    """Everything but the K/V values: the same for every layer of one forward pass."""

    def __init__(self, t, s, page, length, qmax, max_q_len, block_table, cu_seqlens_q, seq_lens_k, window, dev):
        cu = cu_seqlens_q.to(dev)
        qlen = cu[1:] - cu[:-1]                                        # (S,)
        if max_q_len is not None:
            torch._assert_async((qlen <= qmax).all())                 # a wrong hint would drop rows
        rows = torch.arange(t, device=dev)
        seq = torch.searchsorted(cu[1:], rows, right=True)             # sequence of each row
        self.dest = seq * qmax + (rows - cu[seq])                      # its slot in (S, Qmax)
        self.pages = block_table.to(device=dev, dtype=torch.int64).clamp(min=0)
        lens = seq_lens_k.to(dev)
        kpos1 = torch.arange(length, device=dev)
        # slots never written (past the end, released pages read as page 0) may hold anything, NaN
        # included; a masked score does not stop NaN * 0 in the value sum, so they are zeroed first
        written = (kpos1[None, :] < lens[:, None]) & (block_table.to(dev) >= 0).repeat_interleave(page, dim=1)
        self.unwritten = ~written[:, None, :, None]
        j = torch.arange(qmax, device=dev)
        qpos = lens[:, None] - qlen[:, None] + j[None, :]             # (S, Qmax) absolute positions
        kpos = kpos1[None, None, :]
        allowed = kpos <= qpos[:, :, None]
        if window:
            allowed &= kpos > qpos[:, :, None] - window
        pad = (j[None, :] >= qlen[:, None])[:, :, None]
        self.mask = ((allowed & ~pad) | (pad & (kpos == 0)))[:, None]  # (S, 1, Qmax, L)


# One plan per forward: the layers of a pass share the context's tensors (the same objects), so
# the index/mask kernels run once per pass, not once per layer. The key holds the tensors
# themselves: a later pass's new tensors never match, even at a reused address. A context that
# rewrites its tensors in place between passes (cuda_graphs.StaticDecodeContext) calls
# forget_plan(); inference tensors carry no version counter to detect that.
_last: tuple = (None, None, None)


def forget_plan() -> None:
    global _last
    _last = (None, None, None)


def _plan(t, s, page, length, qmax, max_q_len, block_table, cu_seqlens_q, seq_lens_k, window, dev) -> _Plan:
    global _last
    key = (block_table, cu_seqlens_q, seq_lens_k)
    shape = (t, s, page, length, qmax, max_q_len, window, dev)
    held, held_shape, plan = _last
    if held is not None and held_shape == shape and all(a is b for a, b in zip(held, key)):
        return plan
    plan = _Plan(t, s, page, length, qmax, max_q_len, block_table, cu_seqlens_q, seq_lens_k, window, dev)
    _last = (key, shape, plan)
    return plan


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
    p = _plan(t, s, page, length, qmax, max_q_len, block_table, cu_seqlens_q, seq_lens_k, window or None, q.device)
    qp = q.new_zeros(s * qmax, hq, d).index_copy_(0, p.dest, q).view(s, qmax, hq, d).transpose(1, 2)
    kg = k_cache[p.pages].view(s, length, hkv, d).transpose(1, 2).to(q.dtype).masked_fill(p.unwritten, 0)
    vg = v_cache[p.pages].view(s, length, hkv, d).transpose(1, 2).to(q.dtype).masked_fill(p.unwritten, 0)
    out = F.scaled_dot_product_attention(qp, kg, vg, attn_mask=p.mask, scale=scale,
                                         enable_gqa=hq != hkv)               # (S, Hq, Qmax, D)
    return out.transpose(1, 2).reshape(s * qmax, hq, d).index_select(0, p.dest)


def sequence_causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """Attention of one sequence's last T rows over all its L >= T keys and values, read back from their cache slots
    (`slots`: int64 [L], positions 0..L-1 in order; no window narrower than L): SDPA's own causal mask -- is_causal
    for a fresh sequence (L == T), the lower-right aligned causal bias (torch.nn.attention.bias) when earlier
    positions are cached (a later prefill chunk, a reused prefix) --, on CUDA a fused kernel where torch has one for
    the dtype and shape, where paged_attention_gathered would gather every page, zero the unwritten slots and pass an
    explicit (T, L) mask. The caller knows on the host that the batch is this one sequence (PagedContext.single).
    (T, Hq, D)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    kf = k_cache.reshape(-1, hkv, d).index_select(0, slots).to(q.dtype).transpose(0, 1)[None]    # (1, Hkv, L, D)
    vf = v_cache.reshape(-1, hkv, d).index_select(0, slots).to(q.dtype).transpose(0, 1)[None]
    qf = q.transpose(0, 1)[None]                                                                   # (1, Hq, T, D)
    if slots.shape[0] == t:
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale, enable_gqa=hq != hkv)
    else:
        if hq != hkv:        # the causal bias's fused paths take equal head counts: the KV heads repeated
            kf, vf = kf.repeat_interleave(hq // hkv, dim=1), vf.repeat_interleave(hq // hkv, dim=1)
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=causal_lower_right(t, slots.shape[0]), scale=scale)
    return out[0].transpose(0, 1)


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
