"""Attention ops. `attention_dense` is the reference for one sequence with contiguous K/V."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    q_start: int, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of one sequence.

    q (Tq, Hq, D) are the tokens at positions q_start .. q_start+Tq-1; k, v (Tk, Hkv, D) hold
    positions 0 .. Tk-1 (Tk = q_start + Tq). GQA: query head h reads kv head h // (Hq/Hkv).
    `window`: a query at position p sees keys p-window+1 .. p.
    Returns (Tq, Hq, D) in q's dtype; math in fp32.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    qf = q.float().transpose(0, 1)                           # (Hq, Tq, D)
    kf = k.float().transpose(0, 1).repeat_interleave(rep, 0)  # (Hq, Tk, D)
    vf = v.float().transpose(0, 1).repeat_interleave(rep, 0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale     # (Hq, Tq, Tk)
    qpos = torch.arange(q_start, q_start + tq).unsqueeze(1)
    kpos = torch.arange(tk).unsqueeze(0)
    mask = kpos > qpos
    if window is not None:
        mask = mask | (kpos <= qpos - window)
    scores = scores.masked_fill(mask.to(scores.device), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)                              # (Hq, Tq, D)
    return out.transpose(0, 1).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Paged attention: K/V of one layer live in a page pool shared by all sequences.
#
#   k_cache (num_pages, page_size, Hkv, D)          block_table int32 [S, max_pages]
#   ┌────────┬────────┬────────┬────────┐            seq 0: [ 2, 0, -1, ...]
#   │ page 0 │ page 1 │ page 2 │ page 3 │            seq 1: [-1, 3,  1, ...]  (-1: outside the
#   └────────┴────────┴────────┴────────┘                                  window / past the end)
#   position p of sequence s -> page block_table[s, p // page_size], slot p % page_size
# ---------------------------------------------------------------------------------------------

from ..errors import InputError  # noqa: E402
from .dispatch import Candidate, Dispatcher, has_cuda_kernel, has_op  # noqa: E402
from .rope import apply_rope  # noqa: E402

SUPPORTED_HEAD_DIMS = (64, 128)   # the C++ kernel's unrolled head sizes
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store new keys/values in the page pool, in place.

    k_cache, v_cache (num_pages, page_size, Hkv, D); k, v (T, Hkv, D);
    slots int64 [T]: flat slot of each token, page * page_size + offset.
    """
    if k_cache.shape != v_cache.shape or k.shape != v.shape:
        raise InputError(f"write_kv: k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} and "
                         f"k {tuple(k.shape)} / v {tuple(v.shape)} must match pairwise")
    if k.dim() != 3 or k_cache.dim() != 4 or k.shape[1:] != k_cache.shape[2:]:
        raise InputError(f"write_kv: k {tuple(k.shape)} must be (T, Hkv, D) matching the pool's "
                         f"(num_pages, page_size, Hkv, D) = {tuple(k_cache.shape)}")
    if slots.dim() != 1 or slots.shape[0] != k.shape[0]:
        raise InputError(f"write_kv: slots {tuple(slots.shape)} must be int64 [T={k.shape[0]}]")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise InputError("write_kv: k_cache / v_cache must be contiguous (they are written through a flat view)")
    slots = slots.to(device=k_cache.device, dtype=torch.int64)
    if k_cache.device.type == "cuda" and has_cuda_kernel("kv_write"):   # it falls back to index_copy itself
        torch.ops.exl_core.kv_write(k_cache, v_cache, k, v, slots)   # both in one launch (kv_write_cuda.cu)
        return
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


# EXL_CORE_ROPE_KV_FUSE=0: rope_write_kv runs rope and the K/V write as two ops (A/B runs).
ROPE_KV_FUSE = os.environ.get("EXL_CORE_ROPE_KV_FUSE", "1") != "0"


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """apply_rope(q, k), then write_kv(k_cache, v_cache, rotated k, v, slots); returns the rotated q.

    On CUDA, where the tensors allow it, one launch (exl_core::rope_kv_write: the rope kernel writes k's
    rotated rows and v's rows into their slots) instead of two, with the two ops' results bit for bit;
    everywhere else the two ops. The fused call does not go through the rope dispatcher: EXL_CORE_FORCE_KERNEL /
    EXL_CORE_DISABLE_KERNEL settings for rope apply with EXL_CORE_ROPE_KV_FUSE=0."""
    if _rope_kv_fusable(q, k, v, positions, cos_sin, k_cache, v_cache, slots):
        return torch.ops.exl_core.rope_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    q, k = apply_rope(q, k, positions, cos_sin)
    write_kv(k_cache, v_cache, k, v, slots)
    return q


def _rope_kv_fusable(q, k, v, positions, cos_sin, k_cache, v_cache, slots) -> bool:
    """The fused kernel's conditions (anything else, bad input included, goes to the two ops, which check it)."""
    if not (ROPE_KV_FUSE and q.device.type == "cuda" and has_cuda_kernel("rope_kv_write")):
        return False
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        return False
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 8 or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        return False
    ts = (q, k, v, k_cache, v_cache)
    if any(x.dtype != q.dtype or not x.is_contiguous() or x.data_ptr() % 16 or x.device != q.device for x in ts):
        return False
    if (positions.dtype != torch.int64 or positions.dim() != 1 or positions.shape[0] != t
            or positions.device != q.device):
        return False
    if slots.dtype != torch.int64 or slots.shape != (t,) or not slots.is_contiguous() or slots.device != q.device:
        return False
    return (cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.shape[1] == d
            and cos_sin.is_contiguous() and cos_sin.data_ptr() % 16 == 0 and cos_sin.device == q.device)


# EXL_CORE_ROPE_ATTN_FUSE=0: rope_paged_attention runs rope_write_kv, then paged_attention (A/B runs).
ROPE_ATTN_FUSE = os.environ.get("EXL_CORE_ROPE_ATTN_FUSE", "1") != "0"


def rope_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                         block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                         scale: float, window: Optional[int] = None, max_q_len: Optional[int] = None) -> torch.Tensor:
    """rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots), then paged_attention of the rotated q
    (PagedContext.attend_rope's decode attention); q, k, v as the projections leave them.

    On CUDA, where every sequence has one query row (max_q_len == 1) and the tensors allow it, one launch
    (exl_core::paged_attention_rope: the attention kernel rotates q as it loads it and takes each row's own key and
    value from k and v, storing them to their slot), with the two ops' bits, instead of two launches. That kernel
    reads each row's position and slot from seq_lens_k and block_table, so it relies on what the contexts' host
    lists (cache.paged.step_indices) guarantee: positions[t] = seq_lens_k[s] - 1 for row t of sequence s, and
    slots[t] that position's slot in row s of block_table. (A context whose positions differ must not call it at
    max_q_len 1.) The fused launch runs only where the attention dispatcher picks its CUDA kernel, but it does not go
    through the rope dispatcher: EXL_CORE_FORCE_KERNEL / EXL_CORE_DISABLE_KERNEL settings for rope apply with
    EXL_CORE_ROPE_ATTN_FUSE=0."""
    _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    if _rope_attn_fusable(q, k, v, positions, cos_sin, k_cache, v_cache, slots, block_table, cu_seqlens_q,
                          seq_lens_k, scale, window, max_q_len):
        return torch.ops.exl_core.paged_attention_rope(q, k, v, cos_sin, k_cache, v_cache, block_table, cu_seqlens_q,
                                                       seq_lens_k, float(scale), int(window or 0))
    q = rope_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    return PAGED_ATTENTION(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,   # arguments checked above
                           cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, scale=scale, window=window or None,
                           max_q_len=max_q_len)


@dataclass(frozen=True)
class OutOrder:
    """Where exl_core::paged_attention_rope stores its output's columns (its out_pos / out_pos2 / out_cols): column c
    of a row (c = head * D + d) at pos[c], and at pos2[c] too where pos2[c] >= 0; `cols` columns a row.  Made by
    out_order_for, which checks what the kernel relies on (every entry inside [0, cols), every column written)."""
    pos: torch.Tensor                  # int32 [Hq * D]
    pos2: Optional[torch.Tensor]       # int32 [Hq * D], -1 where a column is stored once; None: never twice
    cols: int


def out_order_for(perm: torch.Tensor, width: int, device=None) -> Optional[OutOrder]:
    """The OutOrder whose stores give y[..., j] = x[..., perm[j]] for every j of perm (a weight's act-order over
    `width` input columns; perm's length P is its rows, more than width where extra rows read a column again, as
    formats/uniform4.py writes them), on `device` (perm's by default); None where no store map gives that: a column
    read more than twice or not at all, or an entry outside [0, width).  Checked on the host: once per weight."""
    p = perm.detach().to("cpu", torch.int64)
    cols = p.numel()
    if p.dim() != 1 or cols < width or cols >= 2 ** 31 or width == 0:
        return None
    if int(p.min()) < 0 or int(p.max()) >= width:
        return None
    counts = torch.bincount(p, minlength=width)
    if int(counts.min()) < 1 or int(counts.max()) > 2:
        return None
    by_col = torch.argsort(p, stable=True)             # positions j grouped by column, in increasing j
    first = torch.cumsum(counts, 0) - counts           # where each column's group starts in by_col
    pos = by_col[first]
    twice = counts == 2
    pos2 = torch.where(twice, by_col[(first + 1).clamp(max=cols - 1)], torch.full_like(pos, -1))
    device = perm.device if device is None else device
    to = lambda t: t.to(device=device, dtype=torch.int32).contiguous()   # noqa: E731
    return OutOrder(to(pos), to(pos2) if bool(twice.any()) else None, cols)


def rope_paged_attention_ordered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                 cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 seq_lens_k: torch.Tensor, scale: float, window: Optional[int],
                                 max_q_len: Optional[int], order: OutOrder) -> Optional[torch.Tensor]:
    """rope_paged_attention's output (T, Hq * D) with its columns where `order` stores them: (T, order.cols), the o
    projection's input in its act-order (x[..., perm] for the perm out_order_for was given), from the same single
    launch -- so o reads it without a gather.  None, doing nothing, where that launch would not serve (the caller
    then runs rope_paged_attention and o gathers)."""
    _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    width = q.shape[1] * q.shape[2]
    maps = (order.pos,) if order.pos2 is None else (order.pos, order.pos2)
    if any(m.dtype != torch.int32 or m.shape != (width,) or m.device != q.device or not m.is_contiguous()
           for m in maps) or not width <= order.cols < 2 ** 31:
        return None
    if not _rope_attn_fusable(q, k, v, positions, cos_sin, k_cache, v_cache, slots, block_table, cu_seqlens_q,
                              seq_lens_k, scale, window, max_q_len):
        return None
    return torch.ops.exl_core.paged_attention_rope(q, k, v, cos_sin, k_cache, v_cache, block_table, cu_seqlens_q,
                                                   seq_lens_k, float(scale), int(window or 0), order.pos, order.pos2,
                                                   int(order.cols))


def _rope_attn_fusable(q, k, v, positions, cos_sin, k_cache, v_cache, slots, block_table, cu_seqlens_q, seq_lens_k,
                       scale, window, max_q_len) -> bool:
    """paged_attention_rope's conditions: decode rows, the fused rope/K-V write's and the CUDA attention's."""
    if not (ROPE_ATTN_FUSE and max_q_len == 1 and has_cuda_kernel("paged_attention_rope")):
        return False
    if not _rope_kv_fusable(q, k, v, positions, cos_sin, k_cache, v_cache, slots):
        return False
    return PAGED_ATTENTION.choose(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                                  cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, scale=scale,
                                  window=window or None, max_q_len=max_q_len).name == "cuda"


def _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k) -> None:
    """Shape/dtype checks shared by every candidate; raises InputError naming the tensor."""
    if q.dim() != 3:
        raise InputError(f"paged_attention: q {tuple(q.shape)} must be (T, Hq, D)")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise InputError(f"paged_attention: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must both be (num_pages, page_size, Hkv, D)")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise InputError(f"paged_attention: head dim of q ({d}) and k_cache ({k_cache.shape[3]}) differ")
    if hkv == 0 or hq % hkv != 0:
        raise InputError(f"paged_attention: q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != v_cache.dtype:
        raise InputError(f"paged_attention: q dtype {q.dtype} must be float and k_cache/v_cache dtypes "
                         f"({k_cache.dtype}, {v_cache.dtype}) equal")
    if block_table.dim() != 2:
        raise InputError(f"paged_attention: block_table {tuple(block_table.shape)} must be int32 [S, max_pages]")
    s = block_table.shape[0]
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != s + 1:
        raise InputError(f"paged_attention: cu_seqlens_q {tuple(cu_seqlens_q.shape)} must be int64 [S+1={s + 1}]")
    if seq_lens_k.dim() != 1 or seq_lens_k.shape[0] != s:
        raise InputError(f"paged_attention: seq_lens_k {tuple(seq_lens_k.shape)} must be int64 [S={s}]")
    if s == 0 and t > 0:
        raise InputError(f"paged_attention: {t} query rows but no sequence (block_table has no rows)")


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                        scale: float, window: Optional[int] = None) -> torch.Tensor:
    """Torch reference: per sequence, gather the pages it can see and call `attention_dense`.

    Works on any device. Pages holding only keys outside every query's window are skipped,
    so -1 entries there are never read.
    """
    _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    page_size = k_cache.shape[1]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    table = block_table.tolist()
    out = torch.empty_like(q)
    window = window or None
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]
        if b == a:
            continue
        tk = lens[s]
        q_start = tk - (b - a)
        if q_start < 0:
            raise InputError(f"paged_attention: sequence {s} has {b - a} query rows but seq_lens_k={tk}")
        lo = max(0, q_start - window + 1) if window else 0   # first key any query of s can see
        first_page, last_page = lo // page_size, (tk - 1) // page_size
        pages = table[s][first_page:last_page + 1]
        if len(pages) != last_page - first_page + 1 or any(p < 0 or p >= k_cache.shape[0] for p in pages):
            raise InputError(f"paged_attention: block_table row {s} lacks a valid page for positions "
                             f"{first_page * page_size}..{tk - 1} (pages {pages})")
        idx = torch.tensor(pages, dtype=torch.int64, device=k_cache.device)
        base = first_page * page_size                      # position of the first gathered key
        keys = k_cache.index_select(0, idx).reshape(-1, hkv, d)[:tk - base]
        vals = v_cache.index_select(0, idx).reshape(-1, hkv, d)[:tk - base]
        out[a:b] = attention_dense(q[a:b], keys, vals, scale=scale, q_start=q_start - base, window=window)
    return out


def _paged_cpu_check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window,
                     max_q_len=None) -> Optional[str]:
    if not has_op("paged_attention"):
        return "C++ extension not built with exl_core::paged_attention"
    if q.device.type != "cpu":
        return f"tensors on {q.device}, kernel is CPU-only"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]} not in {SUPPORTED_HEAD_DIMS}"
    hkv = k_cache.shape[-2] if k_cache.dim() >= 3 else 0   # (pages, page size, Hkv, D); contiguous: (T, Hkv, D)
    if hkv == 0 or q.shape[1] % hkv or q.shape[1] // hkv > _MAX_REP:
        return f"{q.shape[1]} query heads over {hkv} kv heads: the kernel takes up to {_MAX_REP} per kv head"
    if q.dtype not in (torch.float32, torch.bfloat16) or k_cache.dtype not in (torch.float32, torch.bfloat16):
        return f"dtypes q={q.dtype}, cache={k_cache.dtype}; kernel takes float32/bfloat16"
    return paged_layout_problem(k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)


def paged_layout_problem(k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k) -> Optional[str]:
    """What the native paged kernels (CPU and CUDA) need of the index dtypes and cache layout, or None."""
    if block_table.dtype != torch.int32 or cu_seqlens_q.dtype != torch.int64 or seq_lens_k.dtype != torch.int64:
        return "index dtypes must be block_table int32, cu_seqlens_q/seq_lens_k int64"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "k_cache / v_cache not contiguous"
    return None


def _paged_cpu_run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window, max_q_len=None):
    return torch.ops.exl_core.paged_attention(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                                              cu_seqlens_q.contiguous(), seq_lens_k.contiguous(),
                                              float(scale), int(window or 0))


def _paged_ref_run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window, max_q_len=None):
    return paged_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window)


# Query rows per sequence up to which the CUDA kernel serves (cuda_small_ops._paged_check); longer runs
# (prefill chunks) go to gathered_sdpa, whose flash SDPA reads each key once for all rows.
PAGED_MAX_Q_ROWS = 16


def _paged_key(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window, max_q_len=None):
    # everything the candidates' checks read (cuda_small_ops._paged_check: the row bound, GQA ratio,
    # devices, cache alignment and key range too)
    return (q.device, q.dtype, q.shape[-1], q.shape[1] // max(k_cache.shape[2], 1), k_cache.dtype,
            block_table.dtype, cu_seqlens_q.dtype, seq_lens_k.dtype, k_cache.is_contiguous(),
            v_cache.is_contiguous(), max_q_len is not None and max_q_len <= PAGED_MAX_Q_ROWS,
            k_cache.device, v_cache.device, block_table.device, cu_seqlens_q.device, seq_lens_k.device,
            k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0,
            block_table.shape[1] * k_cache.shape[1] < 1 << 30)


PAGED_ATTENTION = Dispatcher("attention", [
    # cuda_small_ops.install() puts Candidate("cuda", ...) first (csrc/cuda/paged_attention_cuda.cu)
    Candidate("cpu", _paged_cpu_check, _paged_cpu_run),
    Candidate("torch_ref", lambda **_: None, _paged_ref_run),
], key=_paged_key)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                    scale: float, window: Optional[int] = None, max_q_len: Optional[int] = None) -> torch.Tensor:
    """Causal attention of T new query rows of S sequences over their paged K/V.

    q (T, Hq, D); k_cache, v_cache (num_pages, page_size, Hkv, D) already hold the new tokens;
    block_table int32 [S, max_pages]; cu_seqlens_q int64 [S+1]; seq_lens_k int64 [S] (keys
    per sequence including the new ones). Query row j of sequence s sits at position
    seq_lens_k[s] - q_len_s + j. Returns (T, Hq, D) in q's dtype (fp32 math).
    `max_q_len`: the caller's host-side bound on any sequence's query rows (lets kernels size
    their work without reading cu_seqlens_q back from the device).
    """
    _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    return PAGED_ATTENTION(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                           cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, scale=scale,
                           window=window or None, max_q_len=max_q_len)


def paged_attention_choice(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                           scale: float, window: Optional[int] = None, max_q_len: Optional[int] = None) -> str:
    """The name of the candidate paged_attention would run with these arguments (checked as it checks them; the
    EXL_CORE_FORCE_KERNEL / EXL_CORE_DISABLE_KERNEL settings apply)."""
    _check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    return PAGED_ATTENTION.choose(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                                  cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k, scale=scale,
                                  window=window or None, max_q_len=max_q_len).name


# ---------------------------------------------------------------------------------------------
# One sequence with contiguous K/V (ContiguousContext): attention_dense's contract, dispatched.
# The C++ kernel reads K/V as one page of Tk slots (a view, no copy): same kernel and bits as
# the paged path, without the (Hq, Tq, Tk) score tensor the reference builds and masks.


_MAX_REP = 16   # query heads per kv head the C++ kernel takes (MAX_REP in csrc/cpu/attention.cpp)


def _contig_cpu_check(q, k, v, scale, q_start, window) -> Optional[str]:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not (T, H, D) pairs"
    if k.shape[0] != q_start + q.shape[0]:
        return f"{k.shape[0]} keys for queries at positions {q_start}..{q_start + q.shape[0] - 1}: the kernel " \
               f"needs keys exactly up to the last query"
    if k.shape[0] == 0 or k.dtype != v.dtype:
        return f"no keys, or k/v dtypes differ ({k.dtype}, {v.dtype})"
    return _paged_cpu_check(q, k, v, torch.empty(0, 0, dtype=torch.int32), torch.empty(0, dtype=torch.int64),
                            torch.empty(0, dtype=torch.int64), scale, window)


def _contig_cpu_run(q, k, v, scale, q_start, window):
    one = lambda t: t.contiguous().unsqueeze(0)  # noqa: E731  (1 page, Tk slots, Hkv, D)
    return torch.ops.exl_core.paged_attention(q.contiguous(), one(k), one(v), torch.zeros(1, 1, dtype=torch.int32),
                                              torch.tensor([0, q.shape[0]]), torch.tensor([k.shape[0]]),
                                              float(scale), int(window or 0))


def _contig_ref_run(q, k, v, scale, q_start, window):
    return attention_dense(q, k, v, scale=scale, q_start=q_start, window=window)


CONTIGUOUS_ATTENTION = Dispatcher("attention", [    # same op name as the paged one: one force/disable switch
    Candidate("cpu", _contig_cpu_check, _contig_cpu_run),
    Candidate("torch_ref", lambda **_: None, _contig_ref_run),
])


def attention_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                         q_start: int, window: Optional[int] = None) -> torch.Tensor:
    """`attention_dense` (same arguments and result), served by the C++ kernel where it can."""
    return CONTIGUOUS_ATTENTION(q=q, k=k, v=v, scale=scale, q_start=q_start, window=window or None)


def _register_fakes() -> None:
    """Meta/fake kernels so torch.compile and opcheck can trace the C++ ops."""
    if has_op("paged_attention"):
        @torch.library.register_fake("exl_core::paged_attention")
        def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window):
            return torch.empty_like(q)
    if has_op("paged_attention_rope"):
        @torch.library.register_fake("exl_core::paged_attention_rope")
        def _(q, k, v, cos_sin, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window,
              out_pos=None, out_pos2=None, out_cols=0):
            return torch.empty_like(q) if out_pos is None else q.new_empty(q.shape[0], out_cols)


_register_fakes()
