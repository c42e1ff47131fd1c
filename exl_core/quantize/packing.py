"""QuantResult (solver output) -> PackedWeight (the kernel-native layout in formats/packed.py)."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.bitpack import pack_stream
from ..formats.packed import PackedWeight
from .gptq_solver import QuantResult


def to_packed(r: QuantResult, bias: Optional[torch.Tensor] = None, meta: Optional[dict] = None) -> PackedWeight:
    """Packs every group's values as one bit stream slab; rows stay in act-order (perm kept)."""
    k, n = r.qint.shape
    slabs, rows, qrow = [], [], 0
    for bits, k_start, k_len in r.groups:
        slabs.append(pack_stream(r.qint[k_start:k_start + k_len], bits))
        rows.append((bits, k_start, k_len, qrow))
        qrow += k_len * bits // 32
    pw = PackedWeight(
        qweight=torch.cat(slabs, 0),
        groups=torch.tensor(rows, dtype=torch.int32),
        scale=r.scale.to(torch.float32).clone(),
        zero=r.zero.to(torch.float32).clone(),
        perm=None if r.perm is None else r.perm.to(torch.int64).clone(),
        in_features=k, out_features=n,
        bias=None if bias is None else bias.detach().clone(),
        meta=dict(meta or {}),
    )
    return pw.validate("quantized weight")
