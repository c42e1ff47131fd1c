"""CUDA candidate of ops/norm_perm.py: exl_core::rms_norm_perm, the norm's vector kernel (csrc/cuda/pointwise_cuda.cu,
rms_norm_vec_kernel's PERM instances) storing the row through shared memory in perm's order, with perm's entries read
before the PDL wait (into registers, or by cp.async into shared memory: the LEAN instance).  Takes what that kernel
takes: float16/bfloat16/float32 of one dtype, contiguous int32 perm on x's GPU, 16-byte aligned buffers, H and
perm's length multiples of 16 bytes' values up to 4 vectors a thread; else the torch reference serves (rms_norm then
index_select: the same values, a second launch).
EXL_CORE_NORM_PERM=0 turns the permuted norm off in the model (model/llama.py: q/k/v and gate/up then gather x
themselves, as before) -- the A/B switch; this candidate itself stays.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import cuda_candidates as cc
from . import cuda_small_ops

_NORM_THREADS, _NORM_VECS = 256, 4    # pointwise_cuda.cu kNormThreads, kNormVecs

# Launch policy: the kernel's `late` and `lean` arguments (A/B switches, read at import: EXL_CORE_NORM_PERM_LEAN "0"
# never / "1" always; EXL_CORE_NORM_PERM_LATE=n late from n rows -- 17 with LEAN=0 is stops 32-35's policy).
# From cc.WIDE_MIN_ROWS rows (the rows qgemm_wide takes after the norm, up to 4 blocks an SM): the lean instance (perm
# staged in shared memory by cp.async, 48 registers a thread against 88) with the early trigger; below, the regular
# instance with the early trigger.  History: launched early while the regular instance's blocks still sat on their
# SMs, the rewritten EXL2's batch-32 gate/up added 41.75 us against 34.91 after a plain norm and a gather (stop 32
# call 3, bench/decode_timeline.py), so stops 32-35 triggered late from 17 rows (late everywhere against early: batch
# 1 / 8 / 32 / prompt 0.9675x / 0.9678x / 1.0373x / 1.0015x, stop 32 call 4).  Stop 36 (EXL2 batch 32, tok/s, separate
# processes, truncated; bench/results/gpu_h200_permlean_stop36_call{2,3}_*.json): call 3, lean early 7,610.5 / 7,616.7
# against regular late 7,593.1 / 7,595.1 (lean late 7,345.2; at batch 1 lean early 442.3 / 442.8 against regular early
# 446.8 / 446.2); call 2, regular early 7,343.2, and a first lean instance that read perm from global memory after the
# row's values 7,537.4 early / 7,331.8 late.
_LATE_ENV = os.environ.get("EXL_CORE_NORM_PERM_LATE", "")
_LATE_FROM = int(_LATE_ENV) if _LATE_ENV.isdigit() and int(_LATE_ENV) > 0 else None   # anything else: never late
_LEAN = os.environ.get("EXL_CORE_NORM_PERM_LEAN")
# The norm before q/k/v (site "attn") sits between two launches of the batch-32 stream-K kernel, whose 96-register
# blocks leave no room beside them for either instance's; there the regular instance added 2.61 us against the lean
# one's 4.35 (bench/norm_probe.py --between-wg, stop 64 call 3), while before gate/up (site "mlp") the lean one's
# registers let qgemm_wide's blocks start beside it.  So the attention site takes the regular instance at every row
# count: EXL2 batch 32 1.0148x / 1.0164x against lean at both sites, EXL2 batch 1 / 8 and the prompt 0.9955x-1.0036x,
# GPTQ (no permuted norm) 0.9943x-1.0034x (stop 64 call 4, bench/results/gpu_h200_build_*_stop64_call4_*.json).  EXL_CORE_NORM_PERM_ATTN=lean
# puts the lean instance back there from WIDE_MIN_ROWS rows (the A/B).
_ATTN = os.environ.get("EXL_CORE_NORM_PERM_ATTN", "regular")


def _late(rows: int) -> bool:
    return _LATE_FROM is not None and rows >= _LATE_FROM


def _lean(rows: int, site: str) -> bool:
    """Whether to ask for the lean instance (the kernel's host side takes the regular one where the lean one's shared
    memory, the row and perm's P int32, would not fit a launch: H 8192 in 16-bit dtypes with P 8192)."""
    if _LEAN in ("0", "1"):
        return _LEAN == "1"
    return rows >= cc.WIDE_MIN_ROWS and not (site == "attn" and _ATTN == "regular")


def _check(x, weight, eps, perm, residual, site="mlp") -> Optional[str]:
    # one GPU, one dtype
    why = cuda_small_ops._same_cuda("rms_norm", x, weight, *(() if residual is None else (residual,)))
    if why is not None:
        return why
    if not cc._has_cuda_kernel("rms_norm_perm"):
        return "extension built without rms_norm_perm"
    H, P, per_vec = x.shape[-1], perm.shape[0], 16 // x.element_size()
    lim = _NORM_THREADS * _NORM_VECS * per_vec
    if H % per_vec or H > lim or P % per_vec or P > lim:
        return f"H = {H}, perm's length {P}: the kernel takes multiples of {per_vec} up to {lim}"
    if perm.dtype != torch.int32 or perm.device != x.device or not perm.is_contiguous():
        return f"perm {perm.dtype} on {perm.device}: the kernel takes contiguous int32 on x's GPU"
    ts = (x, weight, perm) + (() if residual is None else (residual,))
    if any(t.data_ptr() % 16 for t in ts) or not weight.is_contiguous():
        return "buffers not 16-byte aligned or weight not contiguous"
    return None


def _run(x, weight, eps, perm, residual, site="mlp"):
    rows = x.numel() // max(1, x.shape[-1])
    out = torch.ops.exl_core.rms_norm_perm(x.contiguous(), None if residual is None else residual.contiguous(),
                                           weight, float(eps), perm, _late(rows), _lean(rows, site))
    return out[0] if residual is None else (out[0], out[1])


def install() -> None:
    """Put the `cuda` candidate at the front of rms_norm_perm's dispatcher (idempotent)."""
    from . import norm_perm
    cc.install_candidate(norm_perm.RMS_NORM_PERM, _check, _run)


install()
