"""Rotary embedding frequency tables for the rope variants of Llama-family configs.

Matches transformers' `ROPE_INIT_FUNCTIONS` (default, linear, llama3) so positions rotate
exactly as in the HF model. The table is grown on demand: `cos_sin(n)` returns
(n, head_dim) float32 = cat(cos[:, :D/2], sin[:, :D/2]) for positions 0..n-1.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_l)
    raise ValueError(f"unsupported rope type {kind}")


class RopeTable:
    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], device="cpu"):
        self.inv_freq = inv_frequencies(head_dim, theta, scaling).to(device)
        self._table = torch.empty(0, head_dim, dtype=torch.float32, device=device)

    def to(self, device) -> "RopeTable":
        self.inv_freq = self.inv_freq.to(device)
        self._table = self._table.to(device)
        return self

    def cos_sin(self, n: int) -> torch.Tensor:
        if self._table.shape[0] < n:
            size = max(n, 2 * self._table.shape[0], 256)
            pos = torch.arange(size, dtype=torch.int64, device=self.inv_freq.device).float()
            freqs = pos[:, None] * self.inv_freq[None, :]         # (size, D/2)
            self._table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
        return self._table
