"""Chunk offsets for act-order weights whose 32-row chunks each read a run of 32 consecutive x columns, and the tails
that let the MLP's batch-decode SwiGLU kernel store such a down projection's input whole.

Why: loader.fold_down_perms moves each down_proj's permutation into gate/up's output columns, so a down_proj
rewritten as uniform 4-bit rows (formats/uniform4.py) keeps a permutation only for its extra rows: the identity over
x's columns, then whole chunks read again.  The SwiGLU-fused decode kernel (qgemm_kslice_silu, qgemm_kslice_add_ with
`up`, 1..8 rows) stages such x with 16-byte loads from each chunk's first column (its `xchunks` argument) instead of
gathering it through the permutation: on the H200 the rewritten EXL2 down projection at batch 1 added 16.51 us a
layer against GPTQ's 11.45 for 8.1 % more rows (stop 32 call 3, bench/decode_timeline.py).
On by default since stop 33 (H200, EXL2 7B-shaped, same call: batch 1 1.0680x; EXL_CORE_KSLICE_XCHUNKS=0 turns it off).
At 17..32 rows the product comes from qgemm_wide_swiglu and the down projection read it through an x_gather launch
(4.38 us a layer of the rewritten EXL2's batch-32 step, stop 32 call 3): with tails (`tails_of`; model.linear
down_tails caches them on the layer) the pair kernel also stores the chunks the extra rows read again, at the
columns they take, and down runs on that without a permutation (on by default since stop 33: batch 32 1.0583x in
the same call; EXL_CORE_WIDE_TAILS=0 turns it off).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

XCHUNKS_ON = os.environ.get("EXL_CORE_KSLICE_XCHUNKS", "1") != "0"    # as every EXL_CORE_ switch: "0" turns it off
TAILS_ON = os.environ.get("EXL_CORE_WIDE_TAILS", "1") != "0"


def chunk_starts(perm: torch.Tensor) -> Optional[torch.Tensor]:
    """int64 [R / 32]: each 32-row chunk's first x column, where every chunk of perm (int64 [R]) reads 32
    consecutive columns from a multiple of 8 (16-byte loads); else None.  Reads perm's values (a host sync on a GPU)."""
    if perm.dim() != 1 or perm.numel() == 0 or perm.numel() % 32:
        return None
    p = perm.to(torch.int64).view(-1, 32)
    starts = p[:, 0]
    runs = bool(torch.equal(p - starts[:, None], torch.arange(32, device=p.device).expand_as(p)))
    return starts.contiguous() if runs and bool((starts % 8 == 0).all()) else None


def xchunks_of(pw, device: torch.device) -> Optional[torch.Tensor]:
    """chunk_starts of pw's permutation on `device`, made once per permutation tensor and cached in pw's meta;
    None where EXL_CORE_KSLICE_XCHUNKS is off, pw has no permutation or one not of that form, or a CUDA graph is
    being captured with none made yet (the caller then passes the permutation)."""
    if not XCHUNKS_ON or pw.perm is None:
        return None
    held = pw.meta.get("_cuda_xchunks")
    if held is None or held[0] is not pw.perm or held[1] != device:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        starts = chunk_starts(pw.perm)
        held = pw.meta["_cuda_xchunks"] = (pw.perm, device, None if starts is None else starts.to(device))
    return held[2]


def staged_xchunks(pw, *xs: torch.Tensor) -> Optional[torch.Tensor]:
    """xchunks_of for a SwiGLU-fused launch (staged rows: the caller checks) whose gate and up (`xs`, contiguous)
    start 16-byte aligned, as the kernel's 16-byte loads need; else None."""
    if not XCHUNKS_ON or any(t.data_ptr() % 16 for t in xs):      # off: no work on the decode path
        return None
    return xchunks_of(pw, xs[0].device)


def tails_of(perm: torch.Tensor, K: int) -> Optional[torch.Tensor]:
    """int32 [K / 32] where perm (int64 [R], R > K) is the identity over K columns followed by whole 32-column chunks
    read once more: entry c is the column (>= K) where chunk c's second copy starts, -1 for chunks read once; else
    None (another order, or a chunk read three times)."""
    starts = chunk_starts(perm)
    if starts is None or K % 32 or perm.numel() <= K:
        return None
    main, extra = starts[:K // 32], starts[K // 32:]
    if not torch.equal(main, torch.arange(0, K, 32, device=main.device)) or bool((extra % 32 != 0).any()):
        return None
    src = (extra // 32).long()
    if src.unique().numel() != src.numel() or bool((src >= K // 32).any()):
        return None
    tails = torch.full((K // 32,), -1, dtype=torch.int32, device=perm.device)
    tails[src] = (K + 32 * torch.arange(src.numel(), device=perm.device)).to(torch.int32)
    return tails
