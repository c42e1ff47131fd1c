"""EXL2 bit allocation: pick one measured setting per layer to meet an average bpw.

Objective: minimise Σ_l e_l(c_l) subject to Σ_l bits_l(c_l) ≤ target · Σ_l numel_l, where
e_l(c) is the error candidate c of linear l adds to the residual stream, relative to the
residual's size: mean over calibration tokens of ||δh_t||² / ||h_t||², δh the change of the
sub-layer output (attention or MLP) when l alone is quantized (measure.py explains how it is
measured). Why this unit: every block reads the residual through an RMSNorm, so what a later
layer (and the final norm + head) sees of a perturbation is its size relative to ||h||; errors of
q_proj, v_proj, gate_proj and down_proj are expressed as the same physical quantity and add up,
to first order, as independent noise on the residual. Why not per-layer relative output errors
(the earlier objective, ||X(W-Ŵ)ᵀ||²/||XWᵀ||²): they weigh a layer whose output barely reaches
the residual (first-layer q/k) like one that writes straight into it (down_proj), and on
SmolLM2-135M at 4.0 bpw starved the sensitive layers: +42.8% perplexity against +14.3% now.

The problem is a multiple-choice knapsack. It is solved exactly by dynamic programming over
integer costs: bit counts are divided by a unit and rounded UP, so the returned choice never
exceeds the budget; with ~50k budget units the rounding costs < 0.01 bpw.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import InputError


def allocate(costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]], budget: float,
             resolution: int = 50000) -> list[int]:
    """Choose index c_l per item minimising Σ errors[l][c_l] with Σ costs[l][c_l] ≤ budget.

    costs/errors: per item, per choice. Integer costs with budget ≤ resolution are handled
    exactly (unit 1). Raises InputError when even the cheapest choices exceed the budget.
    """
    n = len(costs)
    if n == 0:
        return []
    if len(errors) != n or any(len(c) != len(e) or len(c) == 0 for c, e in zip(costs, errors)):
        raise InputError("allocate: costs and errors must have one non-empty row per layer, same lengths")
    min_total = sum(min(c) for c in costs)
    if min_total > budget + 1e-9:
        raise InputError(f"allocate: the cheapest settings need {min_total:.6g} bits, budget is {budget:.6g}")
    all_int = all(float(x).is_integer() for c in costs for x in c)
    if all_int and budget <= resolution:
        return _dp([[int(x) for x in c] for c in costs], errors, int(math.floor(budget + 1e-9)))
    unit = budget / resolution
    # Rounded costs may over- or undershoot; try generous slack first (nearest rounding) and keep
    # the first answer whose TRUE cost fits; rounding every cost up is always feasible.
    near = [[int(round(x / unit)) for x in c] for c in costs]
    B0 = int(math.floor(budget / unit + 1e-9))
    slack = n
    while slack >= 1:
        pick = _dp(near, errors, B0 + slack, raise_if_none=False)
        if pick is not None and sum(costs[i][c] for i, c in enumerate(pick)) <= budget:
            return pick
        slack //= 2
    up = [[int(math.ceil(x / unit - 1e-9)) for x in c] for c in costs]
    if sum(min(c) for c in up) > B0:
        # only the layers' cheapest settings fit at all: take them (true cost checked above)
        return [int(min(range(len(c)), key=lambda j: c[j])) for c in costs]
    return _dp(up, errors, B0)


def _dp(icost: list[list[int]], errors, B: int, raise_if_none: bool = True):
    """Exact multiple-choice knapsack on integer costs with capacity B."""
    n = len(icost)
    inf = np.inf
    dp = np.full(B + 1, inf)
    dp[0] = 0.0
    choice = np.zeros((n, B + 1), dtype=np.int16)
    for i in range(n):
        new = np.full(B + 1, inf)
        pick = np.zeros(B + 1, dtype=np.int16)
        for c, (ic, e) in enumerate(zip(icost[i], errors[i])):
            if ic > B:
                continue
            cand = np.full(B + 1, inf)
            cand[ic:] = dp[:B + 1 - ic] + float(e)
            better = cand < new
            new[better] = cand[better]
            pick[better] = c
        dp = new
        choice[i] = pick
    b = int(np.argmin(dp))
    if not np.isfinite(dp[b]):
        if raise_if_none:
            raise InputError("allocate: no combination of settings fits the budget")
        return None
    out = [0] * n
    for i in range(n - 1, -1, -1):
        c = int(choice[i, b])
        out[i] = c
        b -= icost[i][c]
    return out


def bpw_range(costs: Sequence[Sequence[float]], numel: Sequence[int]) -> tuple[float, float]:
    """(lowest, highest) average bits per weight reachable with these choices."""
    total = float(sum(numel))
    return sum(min(c) for c in costs) / total, sum(max(c) for c in costs) / total


def bpw_text(v: float, up: bool = False) -> str:
    """v with 4 decimals, rounded up or down: a printed bound must itself be reachable (4.1406 printed as 4.14 would
    invite a target just below the range)."""
    return f"{(math.ceil if up else math.floor)(v * 1e4) / 1e4:.4f}"


def range_text(lo: float, hi: float) -> str:
    """"lo to hi", rounded inwards (bpw_text); one value where the range is narrower than that rounding."""
    a, b = bpw_text(lo, up=True), bpw_text(hi)
    return f"{a} to {b}" if float(a) < float(b) else f"only {a}"


def allocate_bpw(costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]],
                 numel: Sequence[int], target_bpw: float, tolerance: float = 0.05,
                 clamp_high: bool = False, why: str = "") -> list[int]:
    """allocate() with the budget given as average bits per weight; refuses targets below the lowest or above the
    highest + tolerance with an InputError naming the reachable range (and `why`, the caller's reason for it) --
    unless clamp_high, where a target above it takes the highest (every layer's costliest choice)."""
    lo, hi = bpw_range(costs, numel)
    if target_bpw < lo or (target_bpw > hi + tolerance and not clamp_high):
        raise InputError(f"target {target_bpw} bpw is outside what the EXL2 settings allow "
                         f"({range_text(lo, hi)} bpw for this model){why}")
    return allocate(costs, errors, min(target_bpw, hi) * float(sum(numel)))
