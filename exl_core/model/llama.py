"""The native Llama-family model: embed → N × [norm, attention, norm, MLP] → norm → head.

Tokens of all sequences in a forward pass travel as one flat batch (T, hidden) with no
padding; the `ForwardContext` says which rows belong to which sequence and owns the K/V
storage. Llama, Mistral and Qwen2 differ only in config values (QKV bias, sliding window),
which `ModelConfig` carries.
"""
from __future__ import annotations

import dataclasses
import operator
import os

from typing import Callable, Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import InputError
from ..ops.activation import silu_mul
from ..ops.cuda_candidates import prompt_adds_extra_rows
from ..ops.decoder_layer import DenseWeight, LayerWeights, NativeStack, decoder_layers
from ..ops.norm import rms_norm
from ..ops.norm_perm import rms_norm_permuted
from ..ops.rope import apply_rope
from .context import ContiguousContext, ForwardContext, SequenceKV
from .linear import (LORA_VERSION, Prepermuted, QuantLinear, down_tails, input_out_order, linear_add_,
                     linear_add_ss_, linear_adds_in_place, linear_adds_ss, linear_folds_norm, linear_many,
                     linear_many_normed, linear_silu, linear_swiglu, shared_perm)
from .rope import RopeTable


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual, weight_static=True)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, q_proj, k_proj, v_proj, o_proj, layer: int = 0):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.scale = self.head_dim ** -0.5
        self.window = cfg.layer_window(layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer_idx: int, cos_sin: torch.Tensor) -> torch.Tensor:
        """cos_sin: the rope table covering every position in ctx (looked up once per forward). (Block runs the plain
        module through its parts -- attend and the projections -- so o_proj can add into the residual there.)"""
        q, k, v = linear_many(x, (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(self.attend(q, k, v, ctx, layer_idx, cos_sin))

    def heads(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections' outputs as heads: q (T, Hq, D), k and v (T, Hkv, D)."""
        t = q.shape[0]
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def attend(self, q, k, v, ctx: ForwardContext, layer_idx: int, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rope, the K/V write and attention from the projections' outputs: (T, Hq * D), o_proj's input."""
        t = q.shape[0]
        q, k, v = self.heads(q, k, v)
        attend_rope = getattr(ctx, "attend_rope", None)     # rope inside the context's K/V write (one launch)
        if attend_rope is not None:
            out = attend_rope(layer_idx, q, k, v, cos_sin, self.scale, self.window)
        else:
            q, k = apply_rope(q, k, ctx.positions, cos_sin)
            out = ctx.attend(layer_idx, q, k, v, self.scale, self.window)  # (T, Hq, D)
        return out.reshape(t, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, gate_proj, up_proj, down_proj):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x):
        """down_proj(silu(gate_proj(x)) * up_proj(x)). (Block runs the plain module through gate_up and down, which
        may add into the residual.)"""
        gate, up = self.gate_up(x)
        return self.down(gate, up)

    def gate_up(self, x, layers=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(gate_proj(x), up_proj(x)), or (silu_mul of them, None) where one kernel computes the product too
        (linear_swiglu: the batch-decode GEMM on CUDA) -- widened as down_proj reads it where it takes tails
        (model.linear down_tails; down_layer then reads it).  layers: stand-ins for (gate_proj, up_proj)
        (_norm_many's Prepermuted views)."""
        gate_proj, up_proj = layers or (self.gate_proj, self.up_proj)
        tails = down_tails(self.down_proj) if type(self) is MLP else None   # a subclass keeps its own down
        h = linear_swiglu(x, gate_proj, up_proj, tails)
        if h is not None:
            return h, None
        gate, up = linear_many(x, (gate_proj, up_proj))
        return gate, up

    def down_layer(self, h: torch.Tensor):
        """The layer that reads gate_up's product h: down_proj, or its Prepermuted view where h was widened to the
        rows of down_proj's weight (h's last dim is then not in_features)."""
        d = self.down_proj
        return Prepermuted(d) if h.shape[-1] != d.in_features and type(d) is QuantLinear else d

    def down(self, gate, up, residual: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """down_proj(silu_mul(gate, up)) -- down_proj(gate) when up is None (gate_up gave the product, perhaps
        widened: down_layer) --, into `residual` where a kernel adds (None returned then)."""
        if up is None:
            d = self.down_layer(gate)
            return None if residual is not None and linear_add_(residual, gate, d) else d(gate)
        if residual is not None and linear_adds_in_place(residual, gate, self.down_proj):   # gate: h's shape
            h = silu_mul(gate, up)
            return None if linear_add_(residual, h, self.down_proj) else self.down_proj(h)
        return linear_silu(gate, up, self.down_proj)


class Block(nn.Module):
    def __init__(self, input_layernorm, self_attn, post_attention_layernorm, mlp, layer_idx: int):
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp
        self.layer_idx = layer_idx

    def forward(self, h: Optional[torch.Tensor], residual: Optional[torch.Tensor], ctx: ForwardContext,
                cos_sin: torch.Tensor, ss: Optional[torch.Tensor] = None):
        """h: output of the previous block not yet added to the residual stream, or None when the previous block
        added it already (o and down add into the residual in their GEMM on the prompt path: linear_add_).
        ss: with h None, the residual's sums of squares from the previous down projection (linear_add_ss_), so the
        q/k/v kernel can take the norm in (ops/norm_fold.py).  Returns (h, residual, ss) for the next block.
        The plain Attention and MLP are called through their parts (attend, the projections), not their forward:
        hooks on those two modules do not fire; subclasses keep their forward.  Nor do the norms' where a kernel takes
        them in (the fold, ops/norm_fold.py; the permuted norm, _norm_many)."""
        own = type(self.self_attn) is Attention and type(self.mlp) is MLP    # a subclass keeps its own forward
        if own and h is None and ss is not None and self._folds():            # ss: only a CUDA producer leaves it
            a, n = self.self_attn, self.input_layernorm
            return self._tail(linear_many_normed(residual, n.weight, n.eps, ss, (a.q_proj, a.k_proj, a.v_proj)),
                              ctx, cos_sin, residual)
        if residual is None:
            residual, src, res = h, h, None
        elif h is None:
            src, res = residual, None
        else:
            src, res = h, residual                  # the norm adds them: its second output is the new residual
        if own:
            a = self.self_attn
            qkv, added = _norm_many(self.input_layernorm, src, res, (a.q_proj, a.k_proj, a.v_proj))
            return self._tail(qkv, ctx, cos_sin, residual if added is None else added)
        if res is None:
            x = self.input_layernorm(src)
        else:
            x, residual = self.input_layernorm(src, res)
        attn = self.self_attn(x, ctx, self.layer_idx, cos_sin)
        x, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(x), residual, None

    def _folds(self) -> bool:
        """Whether the norms may be folded into the projections: plain RMSNorm modules (their weight and eps are
        all the fold reads; another norm type keeps its own forward)."""
        return type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm

    def _tail(self, qkv: list, ctx: ForwardContext, cos_sin: torch.Tensor, residual: torch.Tensor):
        """Attention from the [q, k, v] list (emptied here, so that no caller keeps them alive through the MLP), o_proj
        into the residual, the post-attention norm, the MLP: (h, residual, ss) as forward returns.  Where the o (down)
        kernel adds into the residual and leaves its sums of squares, the gate/up (next q/k/v) kernel takes the norm
        in (linear_many_normed)."""
        a, mlp, n, n1 = self.self_attn, self.mlp, self.post_attention_layernorm, self.input_layernorm
        q, k, v = qkv
        qkv.clear()
        out, o_proj = _attend_for_o(a, q, k, v, ctx, self.layer_idx, cos_sin)
        del q, k, v
        # the adds go into the o / down kernels only where the norm after them folds too (this layer's q/k/v stand
        # for the next layer's): elsewhere the norm kernel keeps the add, as before (one pass over the residual)
        folds = residual.is_cuda and self._folds()          # the folds' kernels are CUDA's: no checks per layer elsewhere
        ss = linear_add_ss_(residual, out, o_proj) if folds and linear_folds_norm(
            residual, n.weight, n.eps, (mlp.gate_proj, mlp.up_proj)) else None
        if ss is not None:
            del out
            gate, up = linear_many_normed(residual, n.weight, n.eps, ss, (mlp.gate_proj, mlp.up_proj))
        else:
            attn = None if linear_add_(residual, out, o_proj) else o_proj(out)
            del out
            (gate, up), added = _norm_many(n, residual if attn is None else attn, None if attn is None else residual,
                                           (mlp.gate_proj, mlp.up_proj), mlp)
            del attn
            residual = residual if added is None else added
        ss = None
        if folds and linear_folds_norm(residual, n1.weight, n1.eps, (a.q_proj, a.k_proj, a.v_proj)):
            ss = linear_add_ss_(residual, gate, mlp.down_proj if up is not None else mlp.down_layer(gate), up)
            if ss is None and up is not None and linear_adds_ss(residual, gate, mlp.down_proj):   # rows past the
                ss = linear_add_ss_(residual, silu_mul(gate, up), mlp.down_proj)              # SwiGLU-fused kernel's
        if ss is not None:
            return None, residual, ss
        return mlp.down(gate, up, residual), residual, None


# Devices where the attention kernel stores its output in o_proj's act-order (_attend_for_o): CUDA (H200, EXL2 7B-shaped,
# same call, stop 30 call 1: 0.9999x / 1.0282x / 1.0250x at batch 1 / 8 / 32).  EXL_CORE_ATTN_OUT_ORDER=0: none (A/B).
ATTN_OUT_ORDER_DEVICES = ("cuda",) if os.environ.get("EXL_CORE_ATTN_OUT_ORDER", "1") != "0" else ()


def _attend_for_o(a: Attention, q, k, v, ctx: ForwardContext, layer_idx: int, cos_sin: torch.Tensor):
    """(attention's output, the layer that reads it).  Where o_proj has an act-order permutation and the context's
    kernel can store its output in that order (ctx.attend_rope_ordered, ATTN_OUT_ORDER_DEVICES), the output is
    already x[..., perm] and the layer o_proj's weight without its permutation (Prepermuted): o reads it without a
    gather (its staged gather at batch 1, a gather launch at batch decode).  Else attend's output and o_proj."""
    ordered = getattr(ctx, "attend_rope_ordered", None) if q.device.type in ATTN_OUT_ORDER_DEVICES else None
    order = input_out_order(a.o_proj, a.num_heads * a.head_dim) if ordered is not None else None
    if order is not None:
        out = ordered(layer_idx, *a.heads(q, k, v), cos_sin, a.scale, a.window, order)
        if out is not None:
            return out, Prepermuted(a.o_proj)
    return a.attend(q, k, v, ctx, layer_idx, cos_sin), a.o_proj


# Devices where the norm writes x in the act-order of the projections after it (_norm_many): CUDA, where their kernels
# would gather x per launch or per block.  The CPU per-op path keeps the gathers (it is the reference the CPU decoder
# stack matches).  EXL_CORE_NORM_PERM=0: none (A/B runs).
NORM_PERM_DEVICES = ("cuda",) if os.environ.get("EXL_CORE_NORM_PERM", "1") != "0" else ()
def _norm_many(norm, x: torch.Tensor, residual: Optional[torch.Tensor], layers, mlp: Optional["MLP"] = None):
    """(the projections of norm(x, residual)'s output -- linear_many(..., layers), or with `mlp` its gate_up (gate
    and up, or SwiGLU's product and None) --, the new residual: the norm's second output, None without a residual).
    Where the layers are plain packed ones sharing one act-order permutation (q/k/v, gate/up of EXL2 files; GPTQ
    act-order files whose permutations agree) and x is on CUDA, the norm writes its output in that order and the
    layers read it without a gather (ops/norm_perm.py; NORM_PERM_DEVICES).  The norm module's forward (and its hooks)
    does not run then: its weight and eps are all that is read."""
    perm = None
    if x.device.type in NORM_PERM_DEVICES and type(norm) is RMSNorm:
        perm = shared_perm(layers)
    if perm is not None and perm.numel() != x.shape[-1] and prompt_adds_extra_rows(x.numel() // x.shape[-1]):
        perm = None              # a prompt of weights with extra rows: their dequantise adds those, GEMMs over K
    if perm is None:
        out = norm(x) if residual is None else norm(x, residual)
    else:
        out = rms_norm_permuted(x, norm.weight, norm.eps, perm, residual, "attn" if mlp is None else "mlp")
        layers = [Prepermuted(m) for m in layers]          # their weights without the permutation
    xn, added = (out, None) if residual is None else out
    return (mlp.gate_up(xn, layers) if mlp is not None else linear_many(xn, layers)), added


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
            ob = ab and cfg.arch.o_proj_bias          # HF's Llama gives o_proj a bias too; Mistral / Qwen2 do not
            attn = Attention(cfg, linear(f"{p}.self_attn.q_proj", h, nq, ab), linear(f"{p}.self_attn.k_proj", h, nkv, ab),
                             linear(f"{p}.self_attn.v_proj", h, nkv, ab), linear(f"{p}.self_attn.o_proj", nq, h, ob), i)
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
        """Replace the projection called `hf_name` (as yielded by linear_layers).  Where the loader reordered the
        old layer's channels (its input_order / output_order, loader.fold_down_perms), the new one must compute in
        that order and carry the same orders for LoRA adapters loaded later."""
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
        n_pos = getattr(ctx, "num_positions", None)     # the library's contexts state it from the host: no sync
        if n_pos is None:
            n_pos = int(ctx.positions.max()) + 1 if input_ids.numel() else 1
        cos_sin = self.rope.cos_sin(n_pos)
        native_kv = getattr(ctx, "native_kv", None)
        kv = native_kv() if native_kv is not None and self.layers else None
        h, residual = decoder_layers(h, self._native_stack() if kv is not None else None, kv, cos_sin,
                                     lambda: self._layers_python(h, ctx, cos_sin))
        if residual is None:
            h = self.norm(h)
        else:
            h = self.norm(residual) if h is None else self.norm(h, residual)[0]
        if ctx.logit_rows is not None:
            h = h[ctx.logit_rows]
        return self.lm_head(h).float()

    def _layers_python(self, h, ctx, cos_sin):
        """The per-op decoder loop: the reference the fused `decoder_layers` op must match bit for bit."""
        residual = ss = None
        for layer in self.layers:
            h, residual, ss = layer(h, residual, ctx, cos_sin, ss)
        return h, residual

    def _native_stack(self) -> Optional[NativeStack]:
        """The layers' weights handed to the fused op, rebuilt when they may have changed: after
        any module or buffer (re)registration anywhere (set_linear, tensor-parallel shards,
        set_packed, LoRA merges: global torch hooks bump _WEIGHTS_VERSION), after .to()/.half() of
        the model, or when a LoRA hook sits in a projection's slot (re-checked whenever a
        QuantLinear's `lora` was set or deleted: LORA_VERSION)."""
        if self.embed_weight.device.type != "cpu":
            return None
        held = self.__dict__.get("_native")
        if held is None or held[0] != _WEIGHTS_VERSION[0]:
            held = (_WEIGHTS_VERSION[0], self._build_native_stack())
            self.__dict__["_native"] = held
        stack = held[1]
        if stack.reason is None and stack.num_layers != len(self.layers):   # ModuleList edits fire no hook
            held = (_WEIGHTS_VERSION[0], self._build_native_stack())
            self.__dict__["_native"] = held
            stack = held[1]
        scan = self.__dict__.get("_lora_scan")     # (LORA_VERSION, stack, answer): hooks change rarely
        if scan is None or scan[0] != LORA_VERSION[0] or scan[1] is not stack:
            scan = (LORA_VERSION[0], stack, self._lora_refusal(stack))
            self.__dict__["_lora_scan"] = scan
        return scan[2] or stack

    @staticmethod
    def _lora_refusal(stack: NativeStack) -> Optional[NativeStack]:
        if any(map(_LORA_ATTR, stack.lora_slots)) or any(map(_LORA_MODULE, stack.lora_modules)):
            i = next(i for i, (d, m) in enumerate(zip(stack.lora_slots, stack.lora_modules))
                     if d.get("lora") is not None or "lora" in m)
            p, n = _PROJ[i % len(_PROJ)]
            return NativeStack.refused(f"layer {i // len(_PROJ)}: {p}.{n} has a LoRA hook attached")
        return None

    def _apply(self, fn, recurse=True):
        _WEIGHTS_VERSION[0] += 1     # .to()/.half()/.float() replace every weight tensor
        # each layer's buffers move separately: layers that shared one permutation tensor (loader.share_input_perms,
        # what shared_perm and the permuted norm need) would come back with a copy each
        from ..loader import input_groups
        shared = [g for g in input_groups(self) if _share_one_perm(g)]
        out = super()._apply(fn, recurse)
        for group in shared:
            perm = group[0].packed.perm
            for layer in group[1:]:
                if layer.packed.perm is not perm:
                    layer.set_packed(dataclasses.replace(layer.packed, perm=perm))
        return out

    def _build_native_stack(self) -> NativeStack:
        layers, reason, consts, windows = [], None, None, []
        for i, blk in enumerate(self.layers):
            lw, why = _layer_weights(blk, i)
            a, n1, n2 = blk.self_attn, blk.input_layernorm, blk.post_attention_layernorm
            here = (a.num_heads, a.num_kv_heads, a.head_dim, n1.eps, a.scale)    # the window may differ by layer
            if why is None and (n2.eps != n1.eps or (consts is not None and here != consts)):
                why = "norm eps or attention shape/scale differ from the other layers (one stack takes one)"
            if why is not None:
                reason = f"layer {i}: {why}"
                break
            consts = here
            layers.append(lw)
            windows.append(a.window)
        if reason is not None:
            return NativeStack.refused(reason)
        hq, hkv, d, eps, scale = consts
        stack = NativeStack(layers, hq, hkv, d, eps, scale, windows, self.dtype)
        stack.lora_slots = [vars(getattr(getattr(blk, p), n)) for blk in self.layers for p, n in _PROJ]
        stack.lora_modules = [d["_modules"] for d in stack.lora_slots]
        return stack

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, kvs: Optional[list[SequenceKV]] = None) -> torch.Tensor:
        """Convenience for equal-length batches: input_ids [B, T] → logits [B, T, vocab].

        With `kvs` (one SequenceKV per row), the new tokens continue those sequences and
        their K/V are appended (used by tests and simple scripts; the generator uses the
        paged cache).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
                input_ids.dtype not in (torch.int64, torch.int32):
            got = (f"a {input_ids.dim()}-D {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor)
                   else type(input_ids).__name__)
            raise InputError(f"forward_batch: input_ids must be a 2-D int64 (or int32) tensor [batch, tokens], got "
                             f"{got}")
        if input_ids.numel():
            # embedding lookup would read -1 as the last row, and fail on ids past the vocabulary with an IndexError
            # (a device-side assert on CUDA): one min/max, one host read
            lo, hi = (int(v) for v in torch.aminmax(input_ids))
            n = self.embed_weight.shape[0]
            if lo < 0 or hi >= n:
                raise InputError(f"forward_batch: input_ids hold {lo if lo < 0 else hi}, not a token id: each must be "
                                 f"in [0, {n}) (the vocabulary size)")
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


_PROJ = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
         ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


# Bumped whenever any nn.Module registers a submodule or a buffer (assignment included), so a
# model can tell its fused stack may hold replaced weights without walking its layers per step.
_WEIGHTS_VERSION = [0]


def _share_one_perm(layers) -> bool:
    """Whether these packed layers read x through one permutation tensor."""
    pws = [m.packed if isinstance(m, QuantLinear) and m.is_quantized else None for m in layers]
    return None not in pws and pws[0].perm is not None and all(pw.perm is pws[0].perm for pw in pws[1:])


def _bump_weights_version(*_):
    _WEIGHTS_VERSION[0] += 1      # returns None: the registration itself is unchanged


def invalidate_native_stacks() -> None:
    """Say that packed weights changed in a way no registration shows (e.g. their kernel options
    in `PackedWeight.meta`, or values edited in place: the stack's fused q|k|v / gate|up copies
    and its panel-major int8 copies are snapshots): every model rebuilds its fused stack on its
    next forward."""
    _bump_weights_version()


torch.nn.modules.module.register_module_module_registration_hook(_bump_weights_version)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump_weights_version)
# QuantLinear keeps .lora in its __dict__; a hook that is an nn.Module lives in its _modules instead
# (and can be deleted without any registration hook firing): both are looked at whenever a
# QuantLinear's `lora` was set or deleted (LORA_VERSION), with C-level callables over the cached dicts.
_LORA_ATTR = operator.methodcaller("get", "lora")
_LORA_MODULE = operator.methodcaller("__contains__", "lora")


def _layer_weights(blk, index: int):
    """(LayerWeights, None) for a block the fused op can run, else (None, reason). LoRA hooks are
    not looked at here: Model._native_stack checks them whenever one was set or deleted (they come
    and go without any registration)."""
    if type(blk) is not Block or type(blk.self_attn) is not Attention or type(blk.mlp) is not MLP:
        return None, "block, attention or MLP module is a subclass (custom forward)"
    if type(blk.input_layernorm) is not RMSNorm or type(blk.post_attention_layernorm) is not RMSNorm:
        return None, "norm module is a subclass (custom forward)"
    if blk.layer_idx != index:
        return None, f"layer_idx {blk.layer_idx} at position {index} (the stack addresses caches by position)"
    ws = []
    for parent, name in _PROJ:
        lin = getattr(getattr(blk, parent), name)
        if type(lin) is not QuantLinear:
            return None, f"{parent}.{name} is {type(lin).__name__}, not a plain QuantLinear (tensor parallel shard?)"
        ws.append(lin.packed if lin.is_quantized else DenseWeight(lin.w_t, lin.bias))
    return LayerWeights(blk.input_layernorm.weight, blk.post_attention_layernorm.weight, tuple(ws)), None
