"""CUDA candidate of ops/swiglu.py: gate/up and SwiGLU's product in one qgemm_wide launch (exl_core::qgemm_wide_swiglu)
where the plain call would run qgemm_wide (batch decode, 17..32 rows) on uniform 4-bit weights with regular groups
and no permutation (GPTQ 4-bit): each block takes 64 columns of gate and the same 64 of up, and its epilogue writes
silu(gate) * up rounded as the two launches round it.
Why: bench/decode_timeline.py put the silu_mul launch at 65.8 us of a traced 3,897.9 us GPTQ batch-32 step on the H200
(stop 28 call 1: ~2 us a layer on the critical path), and the gate/up launch wrote both products (1.4 MB a layer).
Same call (stop 28 call 3): batch 32 8,253.1 against 8,105.9 tok/s with it off (1.0181x).
Since stop 58 the pair can run on qgemm_wg_swiglu (the stream-K wgmma kernel, ops/cuda_wg_decode.py, an sm_90 GPU)
where that kernel takes the two weights and EXL_CORE_WG_DECODE turns its kind "pair" on -- off by default: it lost to
qgemm_wide_swiglu (stop 58 call 3, 36.07 against 30.52 us a layer) --, else on qgemm_wide_swiglu.
EXL_CORE_WIDE_SWIGLU=0: off, either kernel (A/B). The dispatcher's op is "qmatmul_swiglu": EXL_CORE_FORCE_KERNEL /
EXL_CORE_DISABLE_KERNEL settings for qmatmul_many do not reach it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import cuda_candidates as cc
from . import cuda_wg_decode as wg

WIDE_SWIGLU_ON = os.environ.get("EXL_CORE_WIDE_SWIGLU", "1") != "0"


def _check(x, gate, up, tails=None) -> Optional[str]:
    if not WIDE_SWIGLU_ON:
        return "EXL_CORE_WIDE_SWIGLU=0"
    if x.device.type != "cuda":
        return f"x is on {x.device}, not CUDA"
    rows = x.numel() // max(1, gate.in_features)
    if not cc.WIDE_MIN_ROWS <= rows <= cc.WIDE_MAX_ROWS:          # the cheap test first: every MLP call asks
        return f"{rows} rows: the batch-decode kernel takes {cc.WIDE_MIN_ROWS}..{cc.WIDE_MAX_ROWS}"
    why = cc._many_check(x, [gate, up])
    if why is not None:
        return why
    pws = [gate, up]
    if any(pw.perm is not None or pw.rows is not None or not cc._uniform4(pw) for pw in pws):
        return "the pair kernel takes uniform 4-bit weights without a permutation"
    if tails is not None:
        t, cols = tails
        N = gate.out_features
        if (t.device != x.device or N % 32 or t.dtype != torch.int32 or t.numel() != N // 32 or cols < N + 32 or
                cols % 4):
            return f"tails {t.dtype} {tuple(t.shape)} on {t.device} with {cols} columns do not fit N = {N}"
    if _on_wg(x, rows, pws):
        return None
    return _wide_why(x, rows, pws)


def _wide_why(x, rows: int, pws) -> Optional[str]:
    """Why qgemm_wide_swiglu does not take these rows, or None."""
    if not cc._has_cuda_kernel("qgemm_wide_swiglu"):
        return "extension built without qgemm_wide_swiglu"
    if cc._pws_group_shift(pws) < 0:
        return "the pair kernel takes regular groups (one group shift for both weights)"
    if not cc._wide_ok(rows, pws, x.device):     # the pair launches with the plan of this check (the two launches')
        return "these rows do not run qgemm_wide"
    return None


def _on_wg(x, rows: int, pws) -> bool:
    return x.dtype == torch.float16 and cc._wg_ok(rows, pws, x.device, "pair") and wg.has_swiglu()


def _run(x, gate, up, tails=None):
    x2 = x.reshape(-1, gate.in_features).contiguous()
    pws = [gate, up]
    t, cols = tails if tails is not None else (None, 0)
    if _on_wg(x, x2.shape[0], pws):             # _check's choice (nothing it reads changes between the two)
        y = wg.run_swiglu(x2, gate, up, [cc._chunks_of(pw) for pw in pws], t, cols)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    qweight, chunks, scale, zero, _perm, bias = cc._weights_args(pws, x.device, x.dtype)   # no permutations (the check)
    twins, k_main = cc._wide_twins(x2.shape[0], pws, x.device)
    y = torch.ops.exl_core.qgemm_wide_swiglu(x2, qweight, chunks, scale, zero, bias,
                                             min_group=min(cc._min_group(pw) for pw in pws),
                                             group_shift=cc._pws_group_shift(pws), tails=t, out_cols=cols,
                                             twins=twins, k_main=k_main)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def install() -> None:
    """Put the `cuda` candidate at the front of swiglu's dispatcher (idempotent)."""
    from . import swiglu
    cc.install_candidate(swiglu.DISPATCH_SWIGLU, _check, _run)


install()
