"""The cache protocol the attention layers call (STYLE habit 6).

The model computes q, k, v for a flat batch of tokens from one or more sequences (ragged,
no padding) and hands them to a `ForwardContext`, which stores k/v wherever its cache keeps
them and returns the attention output. The model never sees the cache's memory layout:
`exl_core.cache` implements the paged version, `ContiguousContext` below is the simple one
(one contiguous K/V buffer per sequence), used by tests and the HF comparison.

Shapes:  q (T, Hq, D)   k, v (T, Hkv, D)   ->   out (T, Hq, D)
T = total new tokens of all sequences in this forward pass, sequence s owning rows
`cu_seqlens[s]:cu_seqlens[s+1]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


class ForwardContext(Protocol):
    positions: torch.Tensor      # int64 [T]: absolute position of every new token
    cu_seqlens: torch.Tensor     # int64 [S+1]: row offsets of the sequences in the flat batch
    logit_rows: Optional[torch.Tensor]  # int64 [R] rows whose logits are wanted (None = all)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, window: Optional[int]) -> torch.Tensor:
        """Store k/v of the new tokens for `layer`, attend causally (and within `window`
        tokens when given), return (T, Hq, D)."""
        ...

    # Optional: `attend_rope(layer, q, k, v, cos_sin, scale, window)`, `attend` of q and k before rope
    # (rotated at `positions` with cos_sin), for contexts that fuse rope into their K/V write.
    # Optional: `attend_rope_ordered(layer, q, k, v, cos_sin, scale, window, order) -> Optional[Tensor]`,
    # attend_rope's output (T, Hq * D) with its columns stored where `order` (ops.attention.OutOrder) puts them,
    # or None, doing nothing, where the context cannot (the model then calls attend_rope).
    # Optional: `num_positions: int`, 1 + the largest position (1 for no tokens) or more, known on the host: the model
    # sizes its rope lookup from it instead of reading positions.max() back (a sync on a GPU, and none is allowed
    # while a CUDA graph captures).
    # Optional: `native_kv() -> Optional[ops.decoder_layer.PagedKV]`, the paged tensors that let
    # the fused CPU decoder op (ops/decoder_layer.py) do `attend`'s work itself; contexts without
    # it (or returning None) always run the per-layer Python path.


@dataclass
class SequenceKV:
    """Contiguous K/V storage of one sequence: per layer (max_len, Hkv, D) tensors and a length."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device="cpu") -> "SequenceKV":
        shape = (max_len, num_kv_heads, head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)])


class ContiguousContext:
    """One forward pass over sequences each owning a `SequenceKV` (or none: no cache kept)."""

    def __init__(self, seq_lens: list[int], kvs: list[Optional[SequenceKV]],
                 device="cpu", logit_rows: Optional[torch.Tensor] = None):
        self.kvs = kvs
        starts = [kv.length if kv is not None else 0 for kv in kvs]
        self.starts = starts
        self.seq_lens = seq_lens
        self.cu_seqlens = torch.tensor([0] + list(_cumsum(seq_lens)), dtype=torch.int64, device=device)
        self.positions = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, seq_lens)]
                                   ).to(device) if seq_lens else torch.zeros(0, dtype=torch.int64, device=device)
        self.num_positions = max((s + n for s, n in zip(starts, seq_lens) if n > 0), default=1)
        self.logit_rows = logit_rows

    def attend(self, layer, q, k, v, scale, window):
        from ..ops.attention import attention_contiguous  # ops layer: no model knowledge
        outs = []
        cu = self.cu_seqlens.tolist()
        for s, kv in enumerate(self.kvs):
            a, b = cu[s], cu[s + 1]
            start = self.starts[s]
            if kv is not None:
                kv.k[layer][start:start + (b - a)] = k[a:b]
                kv.v[layer][start:start + (b - a)] = v[a:b]
                keys, vals = kv.k[layer][:start + b - a], kv.v[layer][:start + b - a]
            else:
                keys, vals = k[a:b], v[a:b]
            outs.append(attention_contiguous(q[a:b], keys, vals, scale=scale, q_start=start, window=window))
        return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)

    def finish(self):
        """Advance every sequence's length past the tokens of this pass."""
        for kv, n in zip(self.kvs, self.seq_lens):
            if kv is not None:
                kv.length += n


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t
