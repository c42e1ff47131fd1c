"""The prompt's quantized matmul on CUDA: W dequantised to x's dtype (exl_core::qdequant_chunks) and multiplied by
cuBLAS, in column slices through one scratch (exl_core::qdequant_mm).  cuda_candidates routes rows past every decode
kernel here (and the residual-stream add of o and down); this module holds that path's switches and its handling of
weights rewritten as uniform 4-bit rows (formats/uniform4.py), whose extra rows the dequantise adds into W's K rows.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

DEQUANT_SLICE = 4096        # dequantise + cuBLAS: columns per slice of weights wider than two slices (dequant_mm)
# Prompts of weights with extra rows (formats/uniform4.py): the dequantise adds them into W's K rows in the same
# thread (qdequant_chunks' twin table, dequant_w) and the norm before q/k/v and gate/up writes x in its natural order
# (prompt_adds_extra_rows), so every prompt GEMM runs over K, not over all rows.  EXL_CORE_PROMPT_NATURAL_X=0: the
# norm writes the extended order at every row count and o/down add their extra rows by an index_add (A/B).
PROMPT_NATURAL_X = os.environ.get("EXL_CORE_PROMPT_NATURAL_X", "1") != "0"
# Uniform 4-bit weights (GPTQ 4-bit, rewritten EXL2) dequantise in an instance without the width switch (qdequant_chunks
# uniform4); EXL_CORE_DEQUANT_U4=0: the width switch's instance for every weight without a twin table (A/B; twinned
# weights, PROMPT_NATURAL_X, keep their own 4-bit instance).
DEQUANT_U4 = os.environ.get("EXL_CORE_DEQUANT_U4", "1") != "0"
# EXL_CORE_DEQUANT_L2=1: the prompt's W persists in L2 from its dequantise to its GEMM (qdequant_chunks l2: an
# access-policy window, the device's persisting set-aside raised to its maximum on first use).  Off: no faster in
# the bench's prompt, and decode slower after it (csrc/cuda/l2_persist.cuh).
DEQUANT_L2 = os.environ.get("EXL_CORE_DEQUANT_L2", "0") == "1"


def uniform4(pw) -> bool:
    """Every chunk 4-bit with its words in K order (GPTQ 4-bit: chunk c in qweight rows 4c..4c+3): the
    kernel variant without the per-chunk width switch, which computes word rows instead of reading them."""
    cached = pw.meta.get("_cuda_uniform4")
    if cached is None:
        g = pw.groups
        cached = pw.meta["_cuda_uniform4"] = bool((g[:, 0] == 4).all() and (g[:, 3] * 8 == g[:, 1]).all())
    return cached


def dequant_mm(x2, pw, chunks, perm, bias, add_to=None):
    """x2 @ W (+ bias), W dequantised to x2's dtype for cuBLAS, in one call (qdequant_mm: no Python a slice; the
    prompt's host time is its ~27 launches a layer). Weights wider than 2 x DEQUANT_SLICE go in slices of
    DEQUANT_SLICE columns through one L2-sized scratch, the GEMMs writing y's columns in place.
    bench/prompt_probe.py (H200, x [2048, 4096], 8 distinct weights per graph): 4096x11008 312.6 -> 284.6 us per
    weight in slices of 4096; slices of 2048 lost on 4096x4096 (108.4 vs 103.2) and 11008x4096 (275.5 vs 267.3),
    where the narrower GEMMs cost more than the scratch saves.
    add_to (no bias): add_to += x2 @ W in place, the GEMM's beta = 1 (the residual stream: no separate add).
    Extra rows without a twin table (dequant_form) are index_add-ed into a whole W, one GEMM."""
    form = dequant_form(pw, chunks, perm)
    if form is None:
        w = dequant_w(pw, chunks, perm, x2.dtype)                              # [K, N]
        if add_to is not None:
            return add_to.addmm_(x2, w)
        return torch.addmm(bias, x2, w) if bias is not None else x2 @ w
    return torch.ops.exl_core.qdequant_mm(x2, pw.qweight, chunks, pw.scale, pw.zero, form[0], form[1], bias, add_to,
                                          DEQUANT_SLICE, DEQUANT_U4 and uniform4(pw), DEQUANT_L2)


def twins_of(pw, chunks, perm) -> Optional[torch.Tensor]:
    """int32 [K / 32] on pw's device for qdequant_chunks' twin argument: for each of W's K rows' chunks (the first K
    rows of a weight rewritten as uniform 4-bit rows, formats/uniform4.py) the chunk-table row of the extra chunk
    that reads the same 32 x columns in the same order, or -1.  Extra chunks of zero scale (pad_rows' padding) add
    nothing and are left out.  None where pw is not of that form (a chunk not 4-bit, an extra chunk matching no main
    chunk, a main chunk with two, a twin whose scale is not exactly 16x its chunk's: the kernel dequantises r + 16 h
    with the chunk's scale) or a CUDA graph is being captured with none made yet.  Made once per permutation tensor
    (a host sync) and kept in pw's meta."""
    held = pw.meta.get("_cuda_twins")
    if held is not None and held[0] is perm and held[1] is chunks:
        return held[2]
    if perm.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    k, twins = pw.in_features, None
    main, extra = perm[:k].long(), perm[k:].long().view(-1, 32)
    if uniform4(pw) and torch.equal(main.sort().values, torch.arange(k, device=perm.device)):
        pos = torch.empty_like(main)
        pos[main] = torch.arange(k, device=perm.device)              # x column -> its main row
        first = pos[extra[:, 0]]                                     # each extra chunk's first row's main row
        live = pw.scale[chunks[k // 32:, 1].long()].ne(0).any(dim=1)
        same = torch.equal(main.view(-1, 32)[first // 32][live], extra[live]) and bool((first[live] % 32 == 0).all())
        if same:
            owner = (first // 32)[live]
            tw = live.nonzero().flatten() + k // 32                  # the twin chunks' rows of the chunk table
            scaled = torch.equal(pw.scale[chunks[tw, 1].long()], pw.scale[chunks[owner, 1].long()] * 16)
            if owner.unique().numel() == owner.numel() and scaled:
                twins = torch.full((k // 32,), -1, dtype=torch.int32, device=perm.device)
                twins[owner] = tw.to(torch.int32)
    pw.meta["_cuda_twins"] = (perm, chunks, twins)
    return twins


def dequant_form(pw, chunks, perm) -> Optional[tuple]:
    """(perm, twins) for qdequant_*: pw's own perm where it has no extra rows (formats.uniform4: its first
    in_features rows are a permutation of x's columns, the rest repeat some); else the first in_features entries and
    the twin table, each chunk adding its twin's values in the same thread (twins_of; PROMPT_NATURAL_X); None where
    the extra rows must be dequantised apart and index_add-ed."""
    if pw.rows is None:
        return perm, None
    twins = twins_of(pw, chunks, perm) if PROMPT_NATURAL_X else None
    return None if twins is None else (perm[:pw.in_features], twins)


def dequant_w(pw, chunks, perm, dtype, n0: int = 0, cols: int = -1) -> torch.Tensor:
    """W [in_features, cols] in x's row order (qdequant_chunks), extra rows added in (dequant_form).  Prompts: o and
    down come through dequant_mm, and q/k/v and gate/up where prompt_adds_extra_rows (else they run as
    _without_perm views over all rows)."""
    u4 = DEQUANT_U4 and uniform4(pw)

    def deq(chunks_, perm_, twins=None):
        return torch.ops.exl_core.qdequant_chunks(pw.qweight, chunks_, pw.scale, pw.zero, perm_, dtype, n0, cols,
                                                  twins, u4, DEQUANT_L2)
    form = dequant_form(pw, chunks, perm)
    if form is not None:
        return deq(chunks, *form)
    k = pw.in_features
    return deq(chunks[:k // 32], perm[:k]).index_add_(0, perm[k:], deq(chunks[k // 32:], None))
