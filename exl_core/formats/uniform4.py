"""A mixed-width weight (EXL2) rewritten exactly as uniform 4-bit rows, for the GPU's 4-bit kernels.

Why: on the H200 the mixed-width decode kernels hold 128-168 registers and a width-dispatching extraction;
an EXL2 4.0 bpw model's batch-1 step with everything but the projections knocked out takes 1.719x GPTQ's
(exl_core/csrc/cuda/NOTES.md, session "seventh"), although most of its rows are 4-bit.

How, per group of W_perm (a PackedWeight's rows share one width):
  2..4 bits   the values as they are, stored in 4 bits (same zero and scale).
  5..8 bits   q = 16 h + r with r, h in [0, 16): the group's row keeps r with zero 8 and the group's scale;
              an extra row, appended after all K rows, holds h with zero (z - 8) / 16 and scale 16 * s, and
              reads the same x column (perm repeats it).  (r - 8) s + (h - (z - 8) / 16) 16 s = (q - z) s.
The result is a PackedWeight of 4-bit groups over rows = K + (rows of 5..8-bit groups) with a permutation of
that length (PackedWeight.rows): W = sum of the rows that share an x column.  Centring r on 8 keeps the main
row's term in [-8 s, 7 s], as a 4-bit weight's, so kernels that scale weights in fp16 round it the same way.
Every value is exact in float64 (tests/test_uniform4.py against dequantize_reference).  Storage grows where
rows are not 4-bit (3-bit rows 4/3, 5-bit 8/5, 2-bit 2x, 8-bit 1x): `as_uniform4` declines above max_growth.
"""
from __future__ import annotations

from typing import Optional

import torch

from .bitpack import pack_stream, unpack_stream
from .packed import PackedWeight


def growth(pw: PackedWeight) -> float:
    """Packed words of the uniform 4-bit form over the weight's own."""
    words = 0
    for bits, _k, k_len, _q in pw.groups.tolist():
        words += k_len * 4 // 32 * (2 if bits > 4 else 1)
    return words / max(1, pw.qweight.shape[0])


def as_uniform4(pw: PackedWeight, max_growth: float = 1.15) -> Optional[PackedWeight]:
    """pw with every group 4-bit (see the module docstring), on pw's device -- without extra rows (rows None, the
    same permutation) where no group has more than 4 bits.  None when pw already is uniform 4-bit, already has
    extra rows, would grow by more than max_growth, or has a 5..8-bit group's zero z for which (z - 8) / 16 is
    not exact in float32 (EXL2's and GPTQ's integer zeros are)."""
    groups = pw.groups.tolist()
    if pw.rows is not None or all(g[0] == 4 for g in groups) or growth(pw) > max_growth:
        return None
    K, N = pw.in_features, pw.out_features
    dev = pw.qweight.device
    perm = pw.perm.to(dev) if pw.perm is not None else torch.arange(K, device=dev)
    main_q, extra_q, main_g, extra_g, extra_rows = [], [], [], [], []
    for gi, (bits, k_start, k_len, q_start) in enumerate(groups):
        q = unpack_stream(pw.qweight[q_start:q_start + k_len * bits // 32], bits, k_len)
        s, z = pw.scale[gi], pw.zero[gi]
        if bits <= 4:
            main_q.append(q)
            main_g.append((s, z))
            continue
        zh = ((z.double() - 8) / 16).float()
        if not torch.equal(zh.double() * 16 + 8, z.double()):      # a zero whose split would round
            return None
        main_q.append(q & 15)
        main_g.append((s, torch.full_like(z, 8.0)))
        extra_q.append(q >> 4)
        extra_g.append((s * 16, zh))
        extra_rows.append(perm[k_start:k_start + k_len])
    lens = [g[2] for g in groups] + [g[2] for g in groups if g[0] > 4]
    new_groups, k = [], 0
    for k_len in lens:
        new_groups.append((4, k, k_len, k // 8))
        k += k_len
    parts = main_g + extra_g
    extra = bool(extra_rows)                   # 2..4-bit only: the same rows (and permutation), stored in 4 bits
    return PackedWeight(pack_stream(torch.cat(main_q + extra_q), 4).contiguous(), torch.tensor(new_groups, dtype=torch.int32),
                        torch.stack([p[0] for p in parts]).contiguous(), torch.stack([p[1] for p in parts]).contiguous(),
                        torch.cat([perm] + extra_rows).contiguous() if extra else pw.perm, K, N, pw.bias,
                        dict(pw.portable_meta(), uniform4_from=pw.meta.get("format", "packed"), uniform4_groups=groups),
                        k if extra else None).validate("uniform4")


def extra_group_pairs(pw: PackedWeight) -> Optional[list[tuple[int, int]]]:
    """[(g, e)] for a weight as_uniform4 wrote: main group g (a 5..8-bit group of the file) has its high halves in
    extra group e, which reads the same x columns in the same order. Read from the layout as_uniform4 writes (meta
    uniform4_groups: main groups first in their order, then one extra group per 5..8-bit group in that order; the
    permutation is not checked). None for a weight without that meta or with too few groups."""
    orig = pw.meta.get("uniform4_groups")
    if not orig:
        return None
    wide = [i for i, (bits, *_rest) in enumerate(orig) if bits > 4]
    if len(pw.groups) < len(orig) + len(wide):
        return None
    return [(i, len(orig) + rank) for rank, i in enumerate(wide)]


def twin_groups(pw: PackedWeight) -> Optional[tuple[list[int], int]]:
    """(twins, k_main) for a weight as_uniform4 wrote with extra rows, all of whose groups have one size G (pad_rows'
    padding group after them too, where it is G rows): group g of the k_main main rows has its high halves in group
    twins[g] (an extra group, at k_main or past it, reading the same x columns in the same order), or -1 (a group of
    2..4 bits).  Kernels can then add a main
    chunk's twin into it instead of running the extra rows as K rows of their own (qgemm_wide's TWIN).  None for any
    other weight.  Read from the layout as_uniform4 writes: the original groups (meta uniform4_groups), main groups
    first in their order, then one extra group per 5..8-bit group in that order (the permutation is not checked:
    views without it reach here)."""
    pairs = extra_group_pairs(pw)
    if not pairs:
        return None
    orig = pw.meta["uniform4_groups"]
    G = orig[0][2]
    if any(k_len != G for _b, _k, k_len, _q in orig):
        return None
    n_main, g = len(orig), pw.groups.tolist()
    n_all = n_main + len(pairs)
    if any(row[0] != 4 or row[2] != G for row in g[:n_all]) or any(g[i][1] != i * G for i in range(n_all)):
        return None
    twins = [-1] * n_main
    for i, e in pairs:
        twins[i] = e
    return twins, n_main * G


def pad_rows(pw: PackedWeight, rows: int) -> PackedWeight:
    """pw (a weight with extra rows) with zero rows appended up to `rows` (scale 0: they add nothing), so that
    weights reading one x (q/k/v, gate/up) share a row count and one launch serves them."""
    if pw.rows is None or rows == pw.rows:
        return pw
    extra = rows - pw.rows
    if extra < 0 or extra % 32:
        raise ValueError(f"pad_rows: {pw.rows} rows cannot grow to {rows} (a multiple of 32 more)")
    N, dev = pw.out_features, pw.qweight.device
    groups = torch.cat([pw.groups, torch.tensor([[4, pw.rows, extra, pw.rows // 8]], dtype=torch.int32)])
    zeros = torch.zeros(1, N, dtype=pw.scale.dtype, device=dev)
    return PackedWeight(torch.cat([pw.qweight, torch.zeros(extra // 8, N, dtype=torch.int32, device=dev)]), groups,
                        torch.cat([pw.scale, zeros]), torch.cat([pw.zero, zeros]),
                        torch.cat([pw.perm, torch.zeros(extra, dtype=pw.perm.dtype, device=dev)]),
                        pw.in_features, N, pw.bias, pw.portable_meta(), rows).validate("uniform4 padded")
