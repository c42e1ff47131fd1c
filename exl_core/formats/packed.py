"""The kernel-native quantized layout that every format (EXL2, GPTQ, ...) converts into.

Formats know their files; kernels know only this. A matrix W of shape (K=in_features,
N=out_features) is stored as a sequence of row groups along K, after an optional input
permutation:

    x_perm = x[..., perm]                      # act-order (EXL2 q_perm, GPTQ argsort(g_idx))
    y      = x_perm @ W_perm (+ bias)

    group g covers rows k_start .. k_start+k_len of W_perm (k_len a multiple of 32),
    all with the same bit width `bits` in {2, 3, 4, 5, 6, 8}:

    qweight[qrow_start + r, n]  int32        r in [0, k_len*bits/32)
        the k_len values of column n form one little-endian bit stream: value i of the
        group occupies bits [i*bits, (i+1)*bits) of the stream, word j holding stream bits
        [32j, 32j+32), LSB first. (For 4-bit: word r holds values 8r..8r+7, value 8r+t in
        bits 4t..4t+3; 3-bit values may straddle two words.)

    W_perm[k_start + i, n] = (q[i, n] - zero[g, n]) * scale[g, n]

    groups  int32 [G, 4]   rows (bits, k_start, k_len, qrow_start), sorted by k_start,
                           covering [0, R) without gaps, R = k_rows (K unless set below).
    scale   float32 [G, N]
    zero    float32 [G, N] (EXL2: 2^(bits-1) everywhere; GPTQ: the stored zero point)

W_perm may have more rows than x has columns (`rows` = R > K, only with a permutation of length R whose
values repeat): several rows then add into the same row of W (exl_core.formats.uniform4 writes 5..8-bit
values as two 4-bit rows this way).

`PackedWeight` is a plain container; `exl_core.ops.qmatmul` runs it and
`exl_core.formats.packed.dequantize_reference` is the float64 specification.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..errors import FormatError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


@dataclass
class PackedWeight:
    qweight: torch.Tensor            # int32 [sum_g k_len_g*bits_g/32, N]
    groups: torch.Tensor             # int32 [G, 4] (bits, k_start, k_len, qrow_start)
    scale: torch.Tensor              # float32 [G, N]
    zero: torch.Tensor               # float32 [G, N]
    perm: Optional[torch.Tensor]     # int64 [K] or None (identity)
    in_features: int
    out_features: int
    bias: Optional[torch.Tensor] = None   # [N] or None
    meta: dict = field(default_factory=dict)  # format-specific notes (e.g. source format, bpw)
    rows: Optional[int] = None       # rows of W_perm when more than in_features (perm then [rows], repeating)

    @property
    def k_rows(self) -> int:
        """Rows of W_perm (what the groups cover): in_features unless `rows` says more."""
        return self.in_features if self.rows is None else self.rows

    def validate(self, name: str = "weight") -> "PackedWeight":
        """Checks the invariants above; raises FormatError naming `name`."""
        K, N = self.k_rows, self.out_features
        g = self.groups
        if g.dim() != 2 or g.shape[1] != 4 or g.dtype != torch.int32:
            raise FormatError(f"{name}: groups must be int32 [G, 4], got {tuple(g.shape)} {g.dtype}")
        expect_k, expect_q = 0, 0
        for bits, k_start, k_len, q_start in g.tolist():
            if bits not in SUPPORTED_BITS:
                raise FormatError(f"{name}: unsupported bit width {bits}")
            if k_start != expect_k or k_len <= 0 or k_len % 32 or q_start != expect_q:
                raise FormatError(f"{name}: group layout broken at k={k_start} (expected k={expect_k}, "
                                  f"qrow={expect_q}, k_len multiple of 32)")
            expect_k += k_len
            expect_q += k_len * bits // 32
        if expect_k != K:
            raise FormatError(f"{name}: groups cover {expect_k} rows, "
                              f"{'rows' if self.rows is not None else 'in_features'} is {K}")
        if self.rows is not None and (self.rows < self.in_features or self.perm is None):
            raise FormatError(f"{name}: rows = {self.rows} needs a permutation and at least in_features = "
                              f"{self.in_features} rows")
        if self.perm is not None and self.rows is not None and self.perm.numel() and (
                int(self.perm.min()) < 0 or int(self.perm.max()) >= self.in_features):
            raise FormatError(f"{name}: perm values must lie in [0, {self.in_features})")
        if self.rows is not None and not torch.equal(torch.sort(self.perm[:self.in_features].cpu()).values,
                                                     torch.arange(self.in_features)):
            raise FormatError(f"{name}: the first {self.in_features} rows must read every input once (a permutation);"
                              " only the rows after them repeat inputs")
        if tuple(self.qweight.shape) != (expect_q, N) or self.qweight.dtype != torch.int32:
            raise FormatError(f"{name}: qweight must be int32 [{expect_q}, {N}], got "
                              f"{tuple(self.qweight.shape)} {self.qweight.dtype}")
        for t, tn in ((self.scale, "scale"), (self.zero, "zero")):
            if tuple(t.shape) != (g.shape[0], N):
                raise FormatError(f"{name}: {tn} must be [{g.shape[0]}, {N}], got {tuple(t.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (K,):
            raise FormatError(f"{name}: perm must be [{K}], got {tuple(self.perm.shape)}")
        if self.bias is not None and tuple(self.bias.shape) != (N,):
            raise FormatError(f"{name}: bias must be [{N}], got {tuple(self.bias.shape)}")
        for t, tn in ((self.scale, "scale"), (self.zero, "zero"), (self.bias, "bias")):
            # a NaN or inf here would surface only as corrupt logits, far from the file that holds it
            if t is not None and not bool(torch.isfinite(t).all()):
                raise FormatError(f"{name}: {tn} holds NaN or inf values (a corrupt file?)")
        return self

    def portable_meta(self) -> dict:
        """meta without the per-device caches the kernels keep there (keys starting with "_"), for a weight
        derived from this one (other columns, another permutation)."""
        return {k: v for k, v in self.meta.items() if not k.startswith("_")}

    def to(self, device) -> "PackedWeight":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedWeight(mv(self.qweight), self.groups, mv(self.scale), mv(self.zero), mv(self.perm),
                            self.in_features, self.out_features, mv(self.bias), dict(self.meta), self.rows)

    @property
    def bits_per_weight(self) -> float:
        """Bits of qweight + per-group scale/zero as the source format stores them is format-specific;
        this counts only the packed values (meta['bpw'] carries the file's own figure)."""
        return self.qweight.numel() * 32 / (self.in_features * self.out_features)


def scatter_rows(pw: PackedWeight, w_perm: torch.Tensor) -> torch.Tensor:
    """W [in_features, N] from W_perm [k_rows, N]: W[perm[k]] = W_perm[k], rows sharing a perm value added."""
    if pw.perm is None:
        return w_perm
    perm = pw.perm.to(w_perm.device)
    if pw.rows is None:
        w = torch.empty_like(w_perm)
        w[perm] = w_perm
        return w
    return torch.zeros(pw.in_features, w_perm.shape[1], dtype=w_perm.dtype,
                       device=w_perm.device).index_add_(0, perm, w_perm)


def pack_bitstream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: integer tensor [k, N] with values in [0, 2^bits), k a multiple of 32 -> int32 [k*bits/32, N]."""
    k, n = q.shape
    if k % 32:
        raise ValueError(f"pack_bitstream needs rows multiple of 32, got {k}")
    q = q.to(torch.int64)
    out = torch.zeros(k * bits // 32, n, dtype=torch.int64)
    for i in range(k):
        pos = i * bits
        w, off = divmod(pos, 32)
        out[w] |= (q[i] << off) & 0xFFFFFFFF
        if off + bits > 32:
            out[w + 1] |= q[i] >> (32 - off)
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32)


def unpack_bitstream(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_bitstream: int32 [k*bits/32, N] -> int64 [k, N]."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    rows = []
    for i in range(k):
        pos = i * bits
        w, off = divmod(pos, 32)
        v = p[w] >> off
        if off + bits > 32:
            v = v | (p[w + 1] << (32 - off))
        rows.append(v & mask)
    return torch.stack(rows)


def dequantize_reference(pw: PackedWeight, dtype=torch.float64) -> torch.Tensor:
    """The executable specification: W [K, N] in the ORIGINAL (unpermuted) row order."""
    w_perm = torch.empty(pw.k_rows, pw.out_features, dtype=dtype)
    for gi, (bits, k_start, k_len, q_start) in enumerate(pw.groups.tolist()):
        q = unpack_bitstream(pw.qweight[q_start:q_start + k_len * bits // 32].cpu(), bits, k_len)
        w_perm[k_start:k_start + k_len] = (q.to(dtype) - pw.zero[gi].cpu().to(dtype)) * pw.scale[gi].cpu().to(dtype)
    return scatter_rows(pw, w_perm)  # x_perm @ W_perm == x @ W with W[perm] = W_perm
