"""CUDA candidate of ops/norm_perm.py: exl_core::rms_norm_perm, the norm's vector kernel (csrc/cuda/pointwise_cuda.cu,
rms_norm_vec_kernel's PERM instances) storing the row through shared memory in perm's order, with perm's entries read
before the PDL wait.  Takes what that kernel takes: float16/bfloat16/float32 of one dtype, contiguous int32 perm on
x's GPU, 16-byte aligned buffers, H and perm's length multiples of 16 bytes' values up to 4 vectors a thread; else the torch
reference serves (rms_norm then index_select: the same values, a second launch).
EXL_CORE_NORM_PERM=0 turns the permuted norm off in the model (model/llama.py: q/k/v and gate/up then gather x
themselves, as before) -- the A/B switch; this candidate itself stays.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import cuda_candidates as cc
from . import cuda_small_ops

_NORM_THREADS, _NORM_VECS = 256, 4    # pointwise_cuda.cu kNormThreads, kNormVecs


def _check(x, weight, eps, perm, residual) -> Optional[str]:
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


def _run(x, weight, eps, perm, residual):
    out = torch.ops.exl_core.rms_norm_perm(x.contiguous(), None if residual is None else residual.contiguous(),
                                           weight, float(eps), perm)
    return out[0] if residual is None else (out[0], out[1])


def install() -> None:
    """Put the `cuda` candidate at the front of rms_norm_perm's dispatcher (idempotent)."""
    from . import norm_perm
    cc.install_candidate(norm_perm.RMS_NORM_PERM, _check, _run)


install()
