"""The RMSNorm written in the input order of act-order weights that share one permutation.

  rms_norm_permuted(x, weight, eps, perm, residual=None)
      rms_norm(x, weight, eps, residual) with the output's last dim reordered: y[..., j] = norm[..., perm[j]], y's
      last dim perm's length P -- H for a permutation, more for weights with extra rows (formats/uniform4.py, whose
      perm reads some columns twice).  With a residual: (y, h) as rms_norm returns them (h in natural order: the
      residual stream).

Why: an act-order weight reads x[..., perm] (formats/packed.py). q/k/v share one permutation and gate/up another in
real EXL2 files (ExLlamaV2's converter quantizes k and v with q's Hessian and gate with up's), so the norm before
them can write that order once, and their kernels read x as it is: no gather launch per call at batch decode
(csrc/cuda/qmma_common.cuh permute_x_per_weight) and no block-wide copy of x with a gather per block at batch 1
(qgemm_kslice's staged gather).  The values are the norm's own, bit for bit: only their order changes.

Candidates: cuda (ops/cuda_norm_perm.py: one kernel, the norm's vector kernel with a permuted store) -> torch_ref
(rms_norm, then index_select).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..errors import InputError
from .dispatch import Candidate, Dispatcher
from .norm import check_norm_args, rms_norm


def _ref_run(x, weight, eps, perm, residual, site="mlp"):
    out = rms_norm(x, weight, eps, residual, weight_static=True)
    y, h = out if residual is not None else (out, None)
    y = y.index_select(-1, perm.to(y.device))
    return y if residual is None else (y, h)


RMS_NORM_PERM = Dispatcher("rms_norm_perm", [
    Candidate("torch_ref", lambda **_: None, _ref_run),
])


def rms_norm_permuted(x: torch.Tensor, weight: torch.Tensor, eps: float, perm: torch.Tensor,
                      residual: Optional[torch.Tensor] = None,
                      site: str = "mlp") -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """rms_norm(x, weight, eps, residual) with y's last dim in perm's order (perm: int32/int64 [P], P >= H, values
    in [0, H): a permutation, or one with repeats as PackedWeight.rows weights have; not checked on the GPU, where a
    check would sync -- the CUDA kernel clamps them, the reference's index_select raises).  The weight is a model's
    (rms_norm's weight_static).  site: "attn" before q/k/v, "mlp" before gate/up -- which launch follows, for the
    CUDA kernel's launch policy (ops/cuda_norm_perm.py); the values do not depend on it."""
    check_norm_args("rms_norm_permuted", x, weight, residual)
    H = x.shape[-1]
    if perm.dim() != 1 or perm.shape[0] < H or perm.dtype not in (torch.int32, torch.int64):
        raise InputError(f"rms_norm_permuted: perm {perm.dtype} {tuple(perm.shape)} must be int32/int64 [P], "
                         f"P >= H = {H} (x {tuple(x.shape)})")
    if site not in ("attn", "mlp"):
        raise InputError(f"rms_norm_permuted: site {site!r} is not 'attn' or 'mlp'")
    return RMS_NORM_PERM(x=x, weight=weight, eps=eps, perm=perm, residual=residual, site=site)
