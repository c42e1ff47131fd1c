"""A small float32 Llama-family forward used only by the converter.

The converter runs one decoder layer at a time over a whole calibration batch (B, T, hidden)
and needs the inputs of each linear group *between* sub-steps (to build Hessians, quantize,
and only then compute the next input with the quantized weights). The inference model's
modules fuse those steps and work on flat ragged batches with a cache, so this file keeps a
plain, deterministic float32 version with the same math as HF's LlamaDecoderLayer:

    x   = rms_norm(h) · w_in            -> q/k/v inputs          ("attn_in")
    a   = softmax(rope(q) rope(k)ᵀ / √d + causal) v            -> o_proj input ("o_in")
    h  += o_proj(a)
    x   = rms_norm(h) · w_post          -> gate/up inputs        ("mlp_in")
    m   = silu(gate(x)) · up(x)         -> down_proj input       ("down_in")
    h  += down(m)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    window: Optional[int]


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """(head_dim/2,) float64 inverse frequencies, with HF's linear / llama3 scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, out)
    return inv


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor):
    """positions (T,) -> cos, sin (T, head_dim) float32, HF's half-split layout."""
    ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def rms_norm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(var + eps) * w


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., in) @ w (out, in)ᵀ."""
    return F.linear(x, w, b)


def attention(q_in: torch.Tensor, wq, wk, wv, bq, bk, bv, d: Dims, cos, sin, chunk: int = 8) -> torch.Tensor:
    """q_in (B, T, hidden) normed input -> (B, T, heads·head_dim), the o_proj input."""
    B, T, _ = q_in.shape
    outs = []
    rep = d.heads // d.kv_heads
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if d.window is not None and d.window < T:
        mask &= ~torch.ones(T, T, dtype=torch.bool).tril(-d.window)
    for a in range(0, B, chunk):        # bounded memory for the (b, H, T, T) scores
        x = q_in[a:a + chunk]
        b = x.shape[0]
        q = linear(x, wq, bq).view(b, T, d.heads, d.head_dim).transpose(1, 2)
        k = linear(x, wk, bk).view(b, T, d.kv_heads, d.head_dim).transpose(1, 2)
        v = linear(x, wv, bv).view(b, T, d.kv_heads, d.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) * (d.head_dim ** -0.5)      # (b, H, T, T)
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, -1) @ v                                 # (b, H, T, D)
        outs.append(o.transpose(1, 2).reshape(b, T, d.heads * d.head_dim))
    return torch.cat(outs, 0)


def mlp_act(x: torch.Tensor, wg, wu, bg=None, bu=None) -> torch.Tensor:
    """x (…, hidden) -> silu(gate) · up (…, intermediate), the down_proj input."""
    return F.silu(linear(x, wg, bg)) * linear(x, wu, bu)


def layer_forward(h: torch.Tensor, w: dict, d: Dims, cos, sin, chunk: int = 8) -> torch.Tensor:
    """Whole decoder layer with weights w (keys as in LINEARS + '.weight'/'.bias', norms)."""
    g = w.get
    out = torch.empty_like(h)
    for a in range(0, h.shape[0], chunk):
        hc = h[a:a + chunk]
        x = rms_norm(hc, w["input_layernorm.weight"], d.eps)
        att = attention(x, w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"],
                        g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias"),
                        d, cos, sin, chunk)
        hc = hc + linear(att, w["self_attn.o_proj.weight"], g("self_attn.o_proj.bias"))
        x = rms_norm(hc, w["post_attention_layernorm.weight"], d.eps)
        m = mlp_act(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], g("mlp.gate_proj.bias"), g("mlp.up_proj.bias"))
        out[a:a + chunk] = hc + linear(m, w["mlp.down_proj.weight"], g("mlp.down_proj.bias"))
    return out
