"""The native Llama-family model: embed → N × [norm, attention, norm, MLP] → norm → head.

Tokens of all sequences in a forward pass travel as one flat batch (T, hidden) with no
padding; the `ForwardContext` says which rows belong to which sequence and owns the K/V
storage. Llama, Mistral and Qwen2 differ only in config values (QKV bias, sliding window),
which `ModelConfig` carries.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.activation import silu_mul
from ..ops.norm import rms_norm
from ..ops.rope import apply_rope
from .context import ContiguousContext, ForwardContext, SequenceKV
from .linear import QuantLinear, linear_many
from .rope import RopeTable


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, q_proj, k_proj, v_proj, o_proj):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.scale = self.head_dim ** -0.5
        self.window = cfg.sliding_window

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer_idx: int, cos_sin: torch.Tensor) -> torch.Tensor:
        """cos_sin: the rope table covering every position in ctx (looked up once per forward)."""
        t = x.shape[0]
        q, k, v = linear_many(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(t, self.num_heads, self.head_dim)                   # (T, Hq, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)                # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, ctx.positions, cos_sin)
        out = ctx.attend(layer_idx, q, k, v, self.scale, self.window)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, gate_proj, up_proj, down_proj):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x):
        gate, up = linear_many(x, (self.gate_proj, self.up_proj))
        return self.down_proj(silu_mul(gate, up))


class Block(nn.Module):
    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp, layer_idx: int):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp
        self.layer_idx = layer_idx

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], ctx: ForwardContext,
                cos_sin: torch.Tensor):
        """h: output of the previous block (not yet added to the residual stream)."""
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        attn = self.self_attn(x, ctx, self.layer_idx, cos_sin)
        x, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(x), residual


LinearFactory = Callable[[str, int, int, bool], QuantLinear]   # (prefix, in, out, bias) -> layer
TensorGetter = Callable[[str, tuple], torch.Tensor]           # (name, expected shape) -> tensor


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[Block], norm: RMSNorm,
                 lm_head: QuantLinear, rope: RopeTable):
        super().__init__()
        self.config = cfg
        self.register_buffer("embed_weight", embed, persistent=False)   # (vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rope = rope

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, get: TensorGetter, linear: LinearFactory, head: QuantLinear,
              dtype: torch.dtype, progress: Optional[Callable] = None) -> "Model":
        """Assembles the model from a tensor source; no weight is ever randomly initialised.

        `get(name, shape)` returns a checked tensor; `linear(prefix, in, out, bias)` builds a
        QuantLinear for a projection (packed or dense, the loader decides); `head` is the
        output layer (tied, dense or quantized).
        """
        h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        rope = RopeTable(d, cfg.rope_theta, cfg.rope_scaling)
        layers = []
        it = range(cfg.num_hidden_layers)
        for i in (progress(it) if progress else it):
            p = f"model.layers.{i}"
            ab, mb = cfg.attention_bias, cfg.mlp_bias
            attn = Attention(cfg, linear(f"{p}.self_attn.q_proj", h, nq, ab), linear(f"{p}.self_attn.k_proj", h, nkv, ab),
                             linear(f"{p}.self_attn.v_proj", h, nkv, ab), linear(f"{p}.self_attn.o_proj", nq, h, False))
            mlp = MLP(linear(f"{p}.mlp.gate_proj", h, inter, mb), linear(f"{p}.mlp.up_proj", h, inter, mb),
                      linear(f"{p}.mlp.down_proj", inter, h, mb))
            layers.append(Block(RMSNorm(get(f"{p}.input_layernorm.weight", (h,)).to(dtype), cfg.rms_norm_eps), attn,
                                RMSNorm(get(f"{p}.post_attention_layernorm.weight", (h,)).to(dtype), cfg.rms_norm_eps),
                                mlp, i))
        embed = get("model.embed_tokens.weight", (cfg.vocab_size, h)).to(dtype)
        norm = RMSNorm(get("model.norm.weight", (h,)).to(dtype), cfg.rms_norm_eps)
        return cls(cfg, embed, layers, norm, head, rope)

    def to(self, *args, **kwargs):
        super().to(*args, **kwargs)
        self.rope.to(self.embed_weight.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def linear_layers(self):
        """(name, QuantLinear) for every projection and the head, HF names."""
        for name, mod in self.named_modules():
            if isinstance(mod, QuantLinear):
                yield (name if name == "lm_head" else f"model.{name}"), mod

    def set_linear(self, hf_name: str, layer: QuantLinear) -> None:
        """Replace the projection called `hf_name` (as yielded by linear_layers)."""
        path = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        parent, _, attr = path.rpartition(".")
        setattr(self.get_submodule(parent) if parent else self, attr, layer)

    # -- forward ---------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_weight[input_ids]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids int64 [T] (flat ragged batch) → float32 logits [R, vocab] for ctx.logit_rows."""
        h = self.embed(input_ids)                                        # (T, hidden)
        # one host read of the largest position per forward (not one per layer: on CUDA each is a sync)
        n_pos = getattr(ctx, "num_positions", None)     # static contexts (CUDA graphs) state it: no sync
        if n_pos is None:
            n_pos = int(ctx.positions.max()) + 1 if input_ids.numel() else 1
        cos_sin = self.rope.cos_sin(n_pos)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, ctx, cos_sin)
        h, _ = self.norm(h, residual) if residual is not None else (self.norm(h), None)
        if ctx.logit_rows is not None:
            h = h[ctx.logit_rows]
        return self.lm_head(h).float()

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, kvs: Optional[list[SequenceKV]] = None) -> torch.Tensor:
        """Convenience for equal-length batches: input_ids [B, T] → logits [B, T, vocab].

        With `kvs` (one SequenceKV per row), the new tokens continue those sequences and
        their K/V are appended (used by tests and simple scripts; the generator uses the
        paged cache).
        """
        b, t = input_ids.shape
        kvs = kvs if kvs is not None else [None] * b
        ctx = ContiguousContext([t] * b, kvs, device=self.device)
        logits = self.forward(input_ids.reshape(-1).to(self.device), ctx)
        ctx.finish()
        return logits.view(b, t, -1)

    def new_sequence_kv(self, max_len: int) -> SequenceKV:
        c = self.config
        return SequenceKV.allocate(c.num_hidden_layers, max_len, c.num_key_value_heads, c.head_dim,
                                   self.dtype, self.device)
