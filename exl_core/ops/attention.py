"""Attention ops. `attention_dense` is the reference for one sequence with contiguous K/V."""
from __future__ import annotations

import math
from typing import Optional

import torch


def attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                    q_start: int, window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of one sequence.

    q (Tq, Hq, D) are the tokens at positions q_start .. q_start+Tq-1; k, v (Tk, Hkv, D) hold
    positions 0 .. Tk-1 (Tk = q_start + Tq). GQA: query head h reads kv head h // (Hq/Hkv).
    `window`: a query at position p sees keys p-window+1 .. p.
    Returns (Tq, Hq, D) in q's dtype; math in fp32.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    qf = q.float().transpose(0, 1)                           # (Hq, Tq, D)
    kf = k.float().transpose(0, 1).repeat_interleave(rep, 0)  # (Hq, Tk, D)
    vf = v.float().transpose(0, 1).repeat_interleave(rep, 0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale     # (Hq, Tq, Tk)
    qpos = torch.arange(q_start, q_start + tq).unsqueeze(1)
    kpos = torch.arange(tk).unsqueeze(0)
    mask = kpos > qpos
    if window is not None:
        mask = mask | (kpos <= qpos - window)
    scores = scores.masked_fill(mask.to(scores.device), -math.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)                              # (Hq, Tq, D)
    return out.transpose(0, 1).to(q.dtype)
