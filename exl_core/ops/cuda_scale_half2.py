"""A weight's scale and zero as one half2 per group and column, by default for the SwiGLU-fused decode down projection
only (qgemm_kslice's H2 instances: 4 bytes a group and column instead of fp32's 8; KSLICE_H2_ALL below: the other
staged-row launches too).

The split is exact or not made: scale[g, n] = float(k[g, n]) * mul[g] in float32 with k an fp16, and every zero an
fp16.  mul is 1 where the scales are fp16 already (GPTQ's), or max|scale[g]| / j^2 for some j in 1..16: EXL2's
scales are (c + 1)^2 * max / 256 (its uniform 4-bit rewrite's extra rows 16 times that), so with j the group's
largest c + 1, mul is max / 256 (times 16) and k the integer (c + 1)^2.  "Exact" is the kernel's arithmetic: the
float32 product, correctly rounded, equals the scale (a larger j can pass that way where k * mul is not exact in
float64).  A weight with any group that splits no way keeps its float32 scale and zero (the plain instances).

Why (H200, bench/gemv_probe.cu mode h2, stop 45 call 5): a 7B layer's batch-1 decode launches ran as a PDL chain at
45.74 us with half2 on down against 46.84 with fp32 (2.34 % less, lower in all 5 rounds); half2 on the other launches
too lost (46.98).  In the model (stop 46 call 2, bench/gpu_bench.py --quick, 4 rounds in turn, medians): batch-1
decode GPTQ 516.31 tok/s against 513.15 off (1.0061x), EXL2 458.65 against 451.72 (1.0153x), higher in every round;
batch 32 and the prompt unchanged (they do not run this kernel).  EXL_CORE_KSLICE_H2=0 turns it off (A/B).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

KSLICE_H2_ON = os.environ.get("EXL_CORE_KSLICE_H2", "1") != "0"
# 1: the other staged-row qgemm_kslice launches take half2 too (q/k/v, gate/up, with or without the folded norm; o
# adding into the residual).  Off: GPTQ lost, in the probe (q/k/v 2.66 %, gate/up 2.74 %) and in the model (stop 46
# call 3: batch 1 0.9692x); EXL2 (the rewrite: every 7B weight has extra rows) gained in stop 46 call 3 (batch 1
# 1.0071x, batch 8 1.0199x) but not in stop 47 call 1 (these launches on half2 for weights with extra rows only, on
# against off: 0.9997x, 0.9987x; 3 rounds in turn each).  gpu.sh phase h2all measures the switch.
KSLICE_H2_ALL = os.environ.get("EXL_CORE_KSLICE_H2_ALL", "0") == "1"
# (Stop 68 measured half2 at 2..8 rows for weights with extra rows only, EXL_CORE_KSLICE_H2_REWRITE=1, on an H100:
# EXL2 batch 8 0.9969x / 1.0001x against off, two rounds in turn -- none of stop 67's H2_ALL batch-8 gain; removed.)
_TINY = torch.finfo(torch.float32).tiny   # the kernels flush float32 denormals (--use_fast_math): none may occur


def split_half2(scale: torch.Tensor, zero: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(int32 [G, N]: half2 (k, zero) per group and column, float32 [G]: mul) with float(k) * mul == scale exactly
    in float32 and zero exact in fp16; None where some group has no such split.  scale, zero: float [G, N] on any
    device (a host sync on a GPU)."""
    if scale.dim() != 2 or scale.shape != zero.shape or scale.numel() == 0:
        return None
    s, z = scale.float(), zero.float()
    zh = z.half()
    if not torch.equal(zh.float(), z):
        return None
    amax = s.abs().amax(dim=1)
    one = torch.ones_like(amax)
    cands = [one] + [torch.where(amax >= _TINY * j * j, amax / (j * j), one) for j in range(1, 17)]
    mul = torch.zeros_like(amax)
    for m in cands:                                       # per group, the first multiplier that splits exactly
        k = (s / m[:, None]).half()
        kf = k.float()
        back = kf * m[:, None]
        ok = (back == s).all(dim=1) & ((kf == 0) | (back.abs() >= _TINY)).all(dim=1) & (mul == 0)
        mul = torch.where(ok, m, mul)
    if bool((mul == 0).any()):
        return None
    k = (s / mul[:, None]).half()
    packed = torch.stack((k, zh), dim=-1).contiguous().view(torch.int32).squeeze(-1)
    return packed.contiguous(), mul.contiguous()


def half2_of(pw, device: torch.device) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """split_half2 of pw's scale and zero on `device`, made once per scale/zero tensor and cached in pw's meta; None
    where EXL_CORE_KSLICE_H2 is off, the split is not exact, or a CUDA graph is being captured with none made yet (the
    caller then passes scale and zero)."""
    if not KSLICE_H2_ON:
        return None
    held = pw.meta.get("_cuda_half2")
    if (held is None or held[0] is not pw.scale or held[1] is not pw.zero or held[2] != device
            or held[3] != (pw.scale._version, pw.zero._version)):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        split = split_half2(pw.scale.to(device), pw.zero.to(device))
        held = pw.meta["_cuda_half2"] = (pw.scale, pw.zero, device, (pw.scale._version, pw.zero._version), split)
    return held[4]
