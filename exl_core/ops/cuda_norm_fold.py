"""CUDA candidates of ops/norm_fold.py: the residual add and the RMSNorm inside the decode GEMMs
(csrc/cuda/norm_fold_device.cuh).

  qmatmul_add_ss_   qgemm_kslice_add_ where the plain call would run qgemm_kslice (o and down at 1..32 rows; down
                    with `up` at the SwiGLU-fused kernel's 1..8 rows), any weight qgemm_kslice takes.
  qmatmul_many_normed
                    where the plain qmatmul_many would run the staged rows of qgemm_kslice (1..8; or qgemm_wide at
                    17..32 rows under EXL_CORE_NORM_FOLD_WIDE=1), on uniform 4-bit weights without a permutation:
                    the same launch with norm_weight / norm_ss. Elsewhere (qgemm_skinny's batch-8 launches, act-order
                    or mixed-width weights) the reference runs: the norm kernel, then qmatmul_many. (The model asks
                    first, folds_norm, and lets the producer add only where the consumer folds.)
Why: bench/decode_timeline.py put the norm launches at 250.4 us of a 2,010.3 us GPTQ batch-1 step on the H200 and
302.2 of 3,905.9 at batch 32 (3.85 / 4.64 us each on average on the step's critical path). Measured (bench/gpu_bench.py --quick, same
call, stop 27 call 5): GPTQ batch 1 507.9 tok/s against 492.1 with EXL_CORE_NORM_FOLD=0 (1.0321x). EXL_CORE_NORM_FOLD=0:
off (A/B).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import cuda_candidates as cc

NORM_FOLD_ON = os.environ.get("EXL_CORE_NORM_FOLD", "1") != "0"
# qgemm_wide's fold (batch 17..32) is built and tested but off: every column-tile block repeats the work on the same x,
# on the path between a stage landing and its mma. GPTQ batch-32 decode on the H200, same call and machine: with the
# norm kernel's roundings per piece 5,959.0 tok/s against 7,748.8 unfolded (stop 27 call 5); with x times the norm
# weight and r on the outputs (the kernel now) 7,264.3 against the default's 7,757.0 (call 6: 0.9364x).
# EXL_CORE_NORM_FOLD_WIDE=1 turns it on (A/B).
NORM_FOLD_WIDE = os.environ.get("EXL_CORE_NORM_FOLD_WIDE", "0") == "1"
_FITS: dict = {}


def _route(rows: int, pws, device) -> Optional[str]:
    """The kernel the plain call gives these rows ("wide", "kslice") when it is one the fold runs in, else None."""
    if cc._wide_ok(rows, pws, device):
        return "wide"
    if cc._kslice_ok(rows, pws, device):
        return "kslice"
    return None


def _add_ss_check(residual, x, pw, up) -> Optional[str]:
    if not NORM_FOLD_ON:
        return "EXL_CORE_NORM_FOLD=0"
    why = cc._qmatmul_check(x, pw)
    if why is not None:
        return why
    if x.dtype != torch.float16 or not cc._mma_ok(pw) or pw.rows is not None:
        return "fp16 x and a weight the decode kernels take (no PackedWeight.rows)"
    rows = x.numel() // pw.in_features
    if residual.dtype != x.dtype or residual.device != x.device or not residual.is_contiguous() or \
            residual.shape != (rows, pw.out_features):
        return f"residual {residual.dtype} {tuple(residual.shape)} is not a contiguous [rows, N] tensor in x's dtype"
    if not cc._has_cuda_kernel("qgemm_kslice_add_"):
        return "extension built without qgemm_kslice_add_"
    if up is not None:
        if up.shape != x.shape or up.dtype != x.dtype or up.device != x.device:
            return "up must be like gate"
        if not (cc.SILU_FUSE_ON and rows <= cc.KSLICE_STAGED_ROWS and cc._kslice_ok(rows, [pw], x.device,
                                                                                     one_wave=False)):
            return "the SwiGLU-fused decode kernel does not take these rows"
        return None
    if _route(rows, [pw], x.device) != "kslice":
        return "these rows do not run qgemm_kslice"
    return None


def _add_ss_run(residual, x, pw, up):
    x2 = x.reshape(-1, pw.in_features).contiguous()
    bias = pw.bias if pw.bias is None or pw.bias.dtype == x.dtype else pw.bias.to(x.dtype)
    if up is not None:
        h2, mul = cc._half2_args(pw, x.device)
    else:                                                        # o: only under _half2_lists' switches
        lists = cc._half2_lists([pw], x.device, x2.shape[0])
        h2, mul = (lists[0][0], lists[1][0]) if lists[0] is not None else (None, None)
    return torch.ops.exl_core.qgemm_kslice_add_(
        residual, x2, pw.qweight, cc._chunks_of(pw), pw.scale, pw.zero, cc._perm_of(pw, x.device),
        None if bias is None else bias.contiguous(), cc._uniform4(pw), min_group=cc._min_group(pw),
        group_shift=cc._group_shift(pw), up=None if up is None else up.reshape(x2.shape).contiguous(),
        sz_half2=h2, sz_mul=mul)


def _fits(kind: str, rows: int, pws, device) -> bool:
    """qgemm_{kind}_fits with the norm weight's shared memory (cached)."""
    K, mg = pws[0].in_features, min(cc._min_group(pw) for pw in pws)
    u4 = all(cc._uniform4(pw) for pw in pws)
    key = (kind, rows, K, len(pws), tuple(pw.out_features for pw in pws), mg, u4, device.index or 0)
    if key not in _FITS:
        if kind == "wide":
            tiles = sum((pw.out_features + 127) // 128 for pw in pws)
            _FITS[key] = bool(torch.ops.exl_core.qgemm_wide_fits(rows, K, tiles, mg, device.index or 0, fold=True))
        else:
            tiles = sum((pw.out_features + 31) // 32 for pw in pws)
            _FITS[key] = bool(torch.ops.exl_core.qgemm_kslice_fits(rows, K, tiles, mg, u4, device.index or 0,
                                                                   fold=True))
    return _FITS[key]


def _normed_route(residual, weight, eps, ss, pws) -> tuple[Optional[str], Optional[str]]:
    """(kernel, None) or (None, why not)."""
    if not NORM_FOLD_ON:
        return None, "EXL_CORE_NORM_FOLD=0"
    from .norm_fold import FOLD_QUERY
    if ss is None:
        return None, "no sums of squares from the producer"
    K = pws[0].in_features if pws else 0
    rows = residual.numel() // max(1, K)
    if rows > cc.KSLICE_STAGED_ROWS and not (NORM_FOLD_WIDE and cc.WIDE_MIN_ROWS <= rows <= cc.WIDE_MAX_ROWS):
        # the cheap refusal first (a prompt's layers ask twice each): the rows below say the same after the checks
        return None, f"{rows} rows: the folded norm runs at the staged rows of qgemm_kslice (or qgemm_wide's, when on)"
    why = cc._many_check(residual, pws)
    if why is not None:
        return None, why
    dev = residual.device
    if residual.dim() != 2 or residual.shape[1] != K or not residual.is_contiguous() or residual.data_ptr() % 16:
        return None, "residual must be a contiguous, 16-byte aligned [rows, K] tensor"
    if not eps >= 0:
        return None, f"eps {eps} must be >= 0"
    if (weight.device != dev or weight.dtype != torch.float16 or weight.shape != (K,) or not weight.is_contiguous()
            or weight.data_ptr() % 16):
        return None, f"norm weight {weight.dtype} {tuple(weight.shape)}: contiguous, aligned float16 [K] on x's GPU"
    if ss is not FOLD_QUERY and (ss.device != dev or ss.dtype != torch.float32 or not ss.is_contiguous()
                                 or ss.shape != ((K + 31) // 32, rows)):
        return None, f"sums of squares {ss.dtype} {tuple(ss.shape)}, expected float32 [{(K + 31) // 32}, {rows}]"
    if any(pw.perm is not None or pw.rows is not None or pw.in_features != K for pw in pws):
        return None, "a weight with a permutation (the kernels gather x; the fold stages it in order)"
    kind = _route(rows, pws, dev)
    if not all(cc._uniform4(pw) for pw in pws):
        return None, "the folded norm's kernels take uniform 4-bit weights only"
    if kind == "wide" and not NORM_FOLD_WIDE:
        return None, "qgemm_wide's fold is off (EXL_CORE_NORM_FOLD_WIDE=1 turns it on)"
    if kind == "kslice" and rows > cc.KSLICE_STAGED_ROWS:
        return None, "qgemm_kslice folds the norm for staged rows only"
    if kind is None or not _fits(kind, rows, pws, dev):
        return None, "these rows do not run qgemm_wide or qgemm_kslice's staged rows (or the norm weight does not fit)"
    return kind, None


def _normed_check(residual, weight, eps, ss, pws) -> Optional[str]:
    return _normed_route(residual, weight, eps, ss, pws)[1]


def _normed_run(residual, weight, eps, ss, pws):
    # the check has passed: only the kernel's name is needed (the plain path's cached choice, not the whole check again)
    kind = "wide" if cc._wide_ok(residual.shape[0], pws, residual.device) else "kslice"
    args = (residual, *cc._weights_args(pws, residual.device, residual.dtype))   # no permutations (the check)
    u4 = all(cc._uniform4(pw) for pw in pws)
    mg = min(cc._min_group(pw) for pw in pws)
    if kind == "wide":
        return list(torch.ops.exl_core.qgemm_wide_multi(*args, u4, min_group=mg, group_shift=cc._pws_group_shift(pws),
                                                        norm_weight=weight, norm_ss=ss, norm_eps=float(eps)))
    h2, mul = cc._half2_lists(pws, residual.device, residual.shape[0])
    return list(torch.ops.exl_core.qgemm_kslice_multi(*args, u4, min_group=mg, group_shift=cc._pws_group_shift(pws),
                                                      norm_weight=weight, norm_ss=ss, norm_eps=float(eps),
                                                      sz_half2=h2, sz_mul=mul))


def install() -> None:
    """Put the `cuda` candidates at the front of norm_fold's dispatchers (idempotent)."""
    from . import norm_fold
    cc.install_candidate(norm_fold.DISPATCH_ADD_SS, _add_ss_check, _add_ss_run)
    cc.install_candidate(norm_fold.DISPATCH_MANY_NORMED, _normed_check, _normed_run)


install()
