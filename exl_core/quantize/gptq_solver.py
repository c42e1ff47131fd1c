"""GPTQ: quantize one linear layer column by column with Hessian-based error compensation.

Weights are (N=out, K=in) as in HF. For every input column k (in act-order when asked), the
rounding error of column k is spread over the not-yet-quantized columns through the upper
Cholesky factor U of H⁻¹ (Frantar et al. 2022):

    err_k   = (w_k - q(w_k)) / U[k, k]
    w_{k+1:} -= err_k ⊗ U[k, k+1:]

Columns are processed in blocks (lazy batch updates); every block holds whole quantization
groups, so a group's scale is computed from weights that already received all earlier updates.

Two group quantizers:
  "exl2": symmetric, zero = 2^(bits-1); per-column scale stored as a 4-bit code s with a per-
          group fp16 maximum: scale = (s+1)² · smax / 256 (the EXL2 file format).
  "gptq": fp16 scale per column per group, integer zero point (asym) or 2^(bits-1) (sym).
Both search a few scale candidates per column (clipping) and keep the least squared error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import InputError

EXL2_BITS = (2, 3, 4, 5, 6, 8)
GPTQ_BITS = (2, 3, 4, 8)
# smallest fp16 > 0, the floor of a scale after fp16 rounding (a smaller floor applied before it rounds
# to 0): an all-zero group keeps a scale > 0 and quantizes to exactly 0 instead of 0/0 = NaN
_FP16_MIN = 2.0 ** -24


@dataclass(frozen=True)
class LayerPlan:
    """How one matrix is quantized: groups along K in act-order, each (bits, k_len)."""
    mode: str                              # "exl2" | "gptq"
    groups: tuple[tuple[int, int], ...]    # (bits, k_len) in permuted order, covering K
    sym: bool = True
    act_order: bool = True
    group_size: int = 128                  # nominal size (last group may be shorter)

    @property
    def in_features(self) -> int:
        return sum(n for _, n in self.groups)


def plan_groups(k: int, group_size: int, mix: list[tuple[int, float]], mode: str = "exl2",
                sym: bool = True, act_order: bool = True) -> LayerPlan:
    """Split K rows into groups of `group_size` (last one shorter) and give the first groups
    (most important channels after act-order) the widest bits.

    mix: [(bits, fraction), ...] widest first, fractions summing to 1. group_size -1 = one group.
    """
    gs = k if group_size in (-1, 0) or group_size >= k else group_size
    sizes = [min(gs, k - a) for a in range(0, k, gs)]
    if any(s % 32 for s in sizes):
        raise InputError(f"in_features {k} with group size {gs} gives groups not a multiple of 32 rows")
    mix = sorted(mix, key=lambda t: -t[0])
    n_groups = len(sizes)
    counts, acc = [], 0.0
    for i, (_, frac) in enumerate(mix):
        acc += frac
        counts.append(round(acc * n_groups))
    counts[-1] = n_groups
    bits_of = []
    prev = 0
    for (b, _), c in zip(mix, counts):
        bits_of += [b] * max(0, c - prev)
        prev = max(prev, c)
    groups = tuple((b, s) for b, s in zip(bits_of, sizes))
    return LayerPlan(mode, groups, sym, act_order, gs)


@dataclass
class QuantResult:
    """GPTQ output, rows in permuted (act-order) order: row j of `qint` is input channel perm[j]."""
    qint: torch.Tensor          # int32 [K, N] quantized values in [0, 2^bits)
    scale: torch.Tensor         # float32 [G, N] (exactly what dequantisation multiplies by)
    zero: torch.Tensor          # float32 [G, N]
    groups: list[tuple[int, int, int]]  # (bits, k_start, k_len) per group, permuted order
    perm: Optional[torch.Tensor]        # int64 [K] or None
    w_hat: torch.Tensor         # float32 [N, K] dequantized weight in ORIGINAL order
    scale_code: Optional[torch.Tensor] = None   # exl2: int32 [G, N] 4-bit codes s
    scale_max: Optional[torch.Tensor] = None    # exl2: float16 [G]
    stats: dict = field(default_factory=dict)


def _round_fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def _best_of(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, maxq: int):
    """w (N, L); scales/zeros (C, N) candidates -> index (N,) of the least squared error."""
    s = scales.unsqueeze(-1)
    z = zeros.unsqueeze(-1)
    q = torch.clamp(torch.round(w.unsqueeze(0) / s) + z, 0, maxq)
    err = ((q - z) * s - w.unsqueeze(0)).pow(2).sum(-1)     # (C, N)
    return err.argmin(0)


def _group_params_exl2(w: torch.Tensor, bits: int):
    """w (N, L) -> scale (N,), zero (N,), code (N,) int, smax fp16 scalar."""
    half = 2 ** (bits - 1)
    maxq = 2 ** bits - 1
    ideal = w.abs().amax(1) / half                              # (N,)
    smax = ideal.max().to(torch.float16).clamp_min(_FP16_MIN)
    if not torch.isfinite(smax):
        smax = torch.tensor(65504.0, dtype=torch.float16)
    smax_f = smax.float()
    r = torch.sqrt(ideal / smax_f * 256.0)                      # ideal code + 1
    base = torch.clamp(torch.ceil(r) - 1, 0, 15)
    # candidates: the code that covers absmax, and up to three smaller (clipping) codes
    codes = torch.stack([torch.clamp(base - d, 0, 15) for d in range(4)])   # (4, N)
    scales = (codes + 1).pow(2) * smax_f / 256.0
    zeros = torch.full_like(scales, float(half))
    best = _best_of(w, scales, zeros, maxq)
    idx = torch.arange(w.shape[0])
    code = codes[best, idx]
    return scales[best, idx], zeros[0], code.to(torch.int32), smax


def _group_params_gptq(w: torch.Tensor, bits: int, sym: bool):
    """w (N, L) -> scale (N,) fp16-exact, zero (N,) integer-valued."""
    maxq = 2 ** bits - 1
    xmin = w.amin(1).clamp(max=0)
    xmax = w.amax(1).clamp(min=0)
    shrink = torch.tensor([1.0, 0.95, 0.9, 0.85, 0.8, 0.75]).unsqueeze(1)   # (C, 1)
    if sym:
        amax = torch.maximum(-xmin, xmax)
        scales = 2 * amax * shrink / maxq
        scales = _round_fp16(scales).clamp_min(_FP16_MIN)
        zeros = torch.full_like(scales, float((maxq + 1) // 2))
    else:
        lo, hi = xmin * shrink, xmax * shrink
        scales = _round_fp16((hi - lo) / maxq).clamp_min(_FP16_MIN)
        # zero ≥ 1: GPTQ v1 checkpoints store zero-1 and cannot hold -1
        zeros = torch.clamp(torch.round(-lo / scales), 1, maxq)
    best = _best_of(w, scales, zeros, maxq)
    idx = torch.arange(w.shape[0])
    return scales[best, idx], zeros[best, idx]


def _inverse_cholesky(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹, raising λ until H is positive definite."""
    k = h.shape[0]
    mean_diag = torch.diag(h).mean().item()
    unit = mean_diag if mean_diag > 0 else 1.0
    lam = damp * unit
    eye = torch.eye(k, dtype=h.dtype)
    for _ in range(8):
        chol, info = torch.linalg.cholesky_ex(h + lam * eye)
        if info.item() == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info2 = torch.linalg.cholesky_ex(hinv, upper=True)
            if info2.item() == 0:
                return u
        last = lam
        lam = max(lam * 10, 1e-6 * unit)     # damp 0 on a singular H: ×10 alone would stay at 0
    raise InputError(f"{name}: Hessian is not positive definite even with dampening {last:g} (of a mean diagonal "
                     f"{mean_diag:g}); more calibration rows (--rows) or a larger --damp may help")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, plan: LayerPlan, damp: float = 0.01,
                  block_cols: int = 32, name: str = "layer") -> QuantResult:
    """Quantize w (N, K) against input Hessian h (K, K) following `plan`."""
    return gptq_quantize_multi(w, h, [plan], damp, block_cols, name)[0]


def _check_plan(plan: LayerPlan, k: int, name: str) -> None:
    if plan.in_features != k:
        raise InputError(f"{name}: plan covers {plan.in_features} input rows, weight has {k}")
    allowed = EXL2_BITS if plan.mode == "exl2" else GPTQ_BITS
    for b, _ in plan.groups:
        if b not in allowed:
            raise InputError(f"{name}: {plan.mode} cannot store {b}-bit weights (allowed {allowed})")


def _starts(plan: LayerPlan) -> list[int]:
    out, a = [], 0
    for _, ln in plan.groups:
        out.append(a)
        a += ln
    return out


def _blocks(plans: list[LayerPlan], k: int, block_cols: int) -> list[tuple[int, int]]:
    """Column blocks [i1, i2), at most block_cols wide, starting at every group start of every
    plan (so a group's scale is computed once all earlier columns' errors were applied to it)."""
    bounds = sorted(set().union(*[set(_starts(p)) for p in plans]) | set(range(0, k, block_cols)) | {k})
    return list(zip(bounds[:-1], bounds[1:]))


def gptq_quantize_multi(w: torch.Tensor, h: torch.Tensor, plans: list[LayerPlan], damp: float = 0.01,
                        block_cols: int = 32, name: str = "layer") -> list[QuantResult]:
    """GPTQ of one weight under several plans at once (the measurement pass).

    The plans share H⁻¹ and the act-order permutation, so their weights are stacked into one
    (C·N, K) matrix and every column step is a single vector operation for all plans; each
    row carries the scale/zero/max of its own plan's current group.
    """
    n, k = w.shape
    if h.shape != (k, k):
        raise InputError(f"{name}: Hessian {tuple(h.shape)} does not match in_features {k}")
    if not plans:
        return []
    for p in plans:
        _check_plan(p, k, name)
    if len({p.act_order for p in plans}) != 1:
        raise InputError(f"{name}: plans measured together must agree on act_order")
    C = len(plans)
    W = w.detach().to(torch.float32).clone()
    H = h.detach().to(torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if plans[0].act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    U = _inverse_cholesky(H, damp, name).to(torch.float32)     # (K, K) upper

    # Transposed, column-major work matrices: row j holds input column j of every plan's copy,
    # so each step reads/writes contiguous memory.  (K, C·N), plan c in columns c·N..(c+1)·N
    WT = W.T.contiguous().repeat(1, C)
    QT = torch.zeros_like(WT)                                   # dequantized, permuted order
    qT = torch.zeros(k, C * n, dtype=torch.int32)
    S = torch.ones(C * n)
    Z = torch.zeros(C * n)
    M = torch.zeros(C * n)                                      # maxq of the row's current group
    starts = [_starts(p) for p in plans]
    begins = {}                                                 # column -> [(plan, group)]
    for c, st in enumerate(starts):
        for gi, a in enumerate(st):
            begins.setdefault(a, []).append((c, gi))
    res_scale = [torch.zeros(len(p.groups), n) for p in plans]
    res_zero = [torch.zeros(len(p.groups), n) for p in plans]
    res_code = [torch.zeros(len(p.groups), n, dtype=torch.int32) if p.mode == "exl2" else None for p in plans]
    res_smax = [torch.zeros(len(p.groups), dtype=torch.float16) if p.mode == "exl2" else None for p in plans]

    for i1, i2 in _blocks(plans, k, block_cols):
        # group starts are block starts: WT[i1:] has every earlier column's update here
        for c, gi in begins.get(i1, ()):
            bits, ln = plans[c].groups[gi]
            cols = slice(c * n, (c + 1) * n)
            wg = WT[i1:i1 + ln, cols].T                         # (N, ln)
            if plans[c].mode == "exl2":
                sc, zc, code, sm = _group_params_exl2(wg, bits)
                res_code[c][gi], res_smax[c][gi] = code, sm
            else:
                sc, zc = _group_params_gptq(wg, bits, plans[c].sym)
            res_scale[c][gi], res_zero[c][gi] = sc, zc
            S[cols], Z[cols], M[cols] = sc, zc, float(2 ** bits - 1)
        W1 = WT[i1:i2].clone()                                  # (cols, C·N)
        E1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = W1[j]
            q = torch.minimum(torch.clamp(torch.round(col / S) + Z, min=0), M)
            dq = (q - Z) * S
            qT[i1 + j] = q.to(torch.int32)
            QT[i1 + j] = dq
            e = (col - dq) / U1[j, j]
            E1[j] = e
            if j + 1 < W1.shape[0]:
                W1[j + 1:].addr_(U1[j, j + 1:], e, alpha=-1.0)
        if i2 < k:
            WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)

    out = []
    for c, p in enumerate(plans):
        rows = slice(c * n, (c + 1) * n)
        Q = QT[:, rows].T                                       # (N, K) permuted order
        if perm is not None:
            w_hat = torch.empty_like(Q)
            w_hat[:, perm] = Q
        else:
            w_hat = Q.clone()
        groups = [(b, st, ln) for (b, ln), st in zip(p.groups, starts[c])]
        out.append(QuantResult(qT[:, rows].contiguous(), res_scale[c], res_zero[c], groups,
                               None if perm is None else perm.clone(), w_hat, res_code[c], res_smax[c]))
    return out


def rtn_quantize(w: torch.Tensor, plan: LayerPlan) -> QuantResult:
    """Round-to-nearest with the same group quantizers (the baseline GPTQ must beat)."""
    k = w.shape[1]
    return gptq_quantize(w, torch.eye(k, dtype=torch.float64) * 1e6,
                         LayerPlan(plan.mode, plan.groups, plan.sym, False, plan.group_size), damp=0.0)


def plan_bits(plan: LayerPlan, out_features: int) -> int:
    """Storage bits of one EXL2/GPTQ matrix with this plan (values, scales, group table, perm)."""
    k = plan.in_features
    G = len(plan.groups)
    if plan.mode == "exl2":
        # q_weight and q_scale store columns padded to a multiple of 32 (formats/exl2.py pack_layer): priced too
        n = out_features + (-out_features % 32)
        # q_scale 4 bit/column/group, q_scale_max fp16/group, q_groups 2×int16/group, q_invperm int32/row
        return sum(b * ln for b, ln in plan.groups) * n + G * n * 4 + G * 16 + G * 32 + k * 32
    vals = sum(b * ln for b, ln in plan.groups) * out_features
    bits = plan.groups[0][0]
    # scales fp16 + packed zeros per column per group + g_idx int32 per row
    return vals + G * out_features * (16 + bits) + k * 32
