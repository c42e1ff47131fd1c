"""The decoder layer stack in one call: RMSNorm → q/k/v → rope → K/V write → paged attention →
o_proj → residual + norm → gate/up → silu·mul → down, for every layer.

Candidates (see `ops/dispatch.py`):
  cpu_layer  -- `exl_core.DecoderStack` (csrc/cpu/decoder_layer.cpp): the same C++ kernels the
                per-op path runs, called back to back from C++; bit-identical to that path.
                Serves CPU tensors in float32/bfloat16 over a paged cache.
  python     -- the caller's own per-op loop (`fallback`), the reference; serves anything.

Every projection inside the C++ op goes through one helper (`linears` in decoder_layer.cpp) that
picks the kernel the per-op path's dispatchers would: the int8-activation one for weights that ask
for it (`wants_int8`) at up to INT8_MAX_M rows, else the exact fused one. It has no bf16 kernel: where
weights ask for bf16 prompts (`wants_bf16`), calls of BF16_MIN_M rows or more run the per-op path.
For decode-sized calls it reads q|k|v and gate|up as one packed weight each (copies made within
FUSE_MAX_BYTES where the parts share their layout; bit-identical outputs), and the int8 kernel
gets one zero point per group where the weight's columns share it (`int8_zero`).

The ops layer knows no modules: the model hands over plain weights (`LayerWeights`) once, gets a
`NativeStack` back, and calls `decoder_layers` per forward pass with the paged K/V tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from ..formats.packed import PackedWeight
from . import dispatch
from .attention import SUPPORTED_HEAD_DIMS
from ..errors import KernelError
from .dispatch import Candidate, Dispatcher, extension
from .qmatmul import BF16_MIN_M, INT8_MAX_M, int8_zero, rows_reason, wants_bf16, wants_int8

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_REP = 16   # query heads per kv head the CPU attention kernel takes
# Decode-sized calls (up to INT8_MAX_M rows) read q|k|v and gate|up as one packed weight each
# (DecoderStack.set_fused): a copy of those weights, made while it costs at most this many bytes
# for the whole model (SmolLM2-135M 4-bit: 37 MB), since the stack then holds them twice.
FUSE_MAX_BYTES = 256 << 20
# The int8 kernel reads panel-major copies of the weights decode uses (DecoderStack.set_panel_major:
# one contiguous stream per thread instead of one short stream per qweight row and per scale row),
# made while the int8 projections take at most this many bytes, since they are then held twice (q|k|v
# and gate|up three times: the parts, the stack's fused copy, its panel-major copy).
# SmolLM2-135M int8 decode, one model per process, 10 interleaved rounds with the copies on/off:
# GPTQ 4-bit g128 median 141.1 -> 166.6 tok/s (57 MB of copies), EXL2 4-bit g32 153.4 -> 185.2 (66 MB).
PANEL_MAX_BYTES = 512 << 20


@dataclass(frozen=True)
class DenseWeight:
    w_t: torch.Tensor                   # (in_features, out_features), contiguous
    bias: Optional[torch.Tensor] = None


Weight = Union[PackedWeight, DenseWeight]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: two norm weights and seven projections (packed or dense)."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: tuple[Weight, ...]     # q, k, v, o, gate, up, down


@dataclass(frozen=True)
class PagedKV:
    """What a paged ForwardContext hands the fused op: its index tensors and per-layer pages."""
    positions: torch.Tensor             # int64 [T]
    slots: torch.Tensor                 # int64 [T] flat slot of each new token
    block_table: torch.Tensor           # int32 [S, max_pages]
    cu_seqlens: torch.Tensor            # int64 [S+1]
    seq_lens_k: torch.Tensor            # int64 [S]
    k: Sequence[torch.Tensor]           # per layer (num_pages, page_size, Hkv, D)
    v: Sequence[torch.Tensor]


class NativeStack:
    """The C++ `DecoderStack` built from the layers' weights, or the reason it cannot be."""

    def __init__(self, layers: Sequence[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, scale: float, windows: Sequence[Optional[int]], dtype: torch.dtype):
        """`windows`: each layer's sliding window (None: every key)."""
        self.dtype = dtype
        self.num_layers = len(layers)
        self.lora_slots: list = []     # projections' __dict__s whose .lora the caller re-checks (model/llama.py)
        self.lora_modules: list = []   # and their _modules dicts (a LoRA hook that is an nn.Module)
        self.obj = None
        self.fused = 0                 # weights handed over fused (q|k|v, gate|up) for decode-sized calls
        self.panel_bytes = 0           # bytes of the int8 kernel's panel-major copies (0: row-major)
        # the stack has no bf16 kernel: where a weight asks for it, prompt-sized calls run per op
        self.bf16_prefill = any(isinstance(w, PackedWeight) and wants_bf16(w) for lw in layers for w in lw.projections)
        self.reason = _weights_reason(layers, num_heads, num_kv_heads, head_dim, dtype)
        if self.reason is None:
            fusions = [_fusions(lw.projections) for lw in layers]
            fuse = sum(_packed_bytes(w) for f in fusions for _, parts in f for w in parts) <= FUSE_MAX_BYTES
            obj = torch.classes.exl_core.DecoderStack(num_heads, num_kv_heads, head_dim, float(eps), float(scale),
                                                      int(windows[0] or 0))
            for lw, layer_fusions, window in zip(layers, fusions, windows):
                for w in lw.projections:
                    if isinstance(w, PackedWeight):
                        obj.add_packed(w.qweight, w.groups, w.scale, w.zero, w.perm, w.bias, wants_int8(w),
                                       int8_zero(w) if wants_int8(w) else None)
                    else:
                        obj.add_dense(w.w_t, w.bias)
                obj.add_layer(lw.input_norm.contiguous(), lw.post_norm.contiguous())
                if window != windows[0]:
                    obj.set_layer_window(int(window or 0))
                for which, parts in layer_fusions if fuse else ():
                    _set_fused(obj, which, parts)
                    self.fused += 1
            obj.set_int8_rows(INT8_MAX_M)
            obj.set_fused_rows(INT8_MAX_M)
            int8 = [w for lw in layers for w in lw.projections if isinstance(w, PackedWeight) and wants_int8(w)]
            if int8 and sum(map(_packed_bytes, int8)) <= PANEL_MAX_BYTES:
                self.panel_bytes = obj.set_panel_major(True)
            self.obj = obj


    @classmethod
    def refused(cls, reason: str) -> "NativeStack":
        """A stack the caller already knows the fused op cannot run (the reason says why)."""
        self = cls.__new__(cls)
        self.dtype, self.num_layers, self.obj, self.reason, self.lora_slots = None, 0, None, reason, []
        self.bf16_prefill = False
        self.lora_modules = []
        self.fused = 0
        self.panel_bytes = 0
        return self


_FUSED_PARTS = ((0, (0, 1, 2)), (1, (4, 5)))     # (set_fused index, projections): q|k|v, gate|up


def _fusable(parts: Sequence[Weight]) -> bool:
    """Packed weights that one kernel call can serve side by side: same K, group layout,
    permutation, int8 choice, and all or none with a bias."""
    first = parts[0]
    if not all(isinstance(w, PackedWeight) for w in parts):
        return False
    return all(w.in_features == first.in_features and torch.equal(w.groups, first.groups)
               and (w.perm is first.perm or (w.perm is not None and first.perm is not None
                                             and torch.equal(w.perm, first.perm)))
               and wants_int8(w) == wants_int8(first) and (w.bias is None) == (first.bias is None)
               for w in parts)


def _packed_bytes(w: PackedWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scale, w.zero))


def _fusions(projections: Sequence[Weight]) -> list[tuple[int, list[PackedWeight]]]:
    """(set_fused index, parts) of one layer's fusable q|k|v and gate|up."""
    groups = [(which, [projections[i] for i in idx]) for which, idx in _FUSED_PARTS]
    return [(which, parts) for which, parts in groups if _fusable(parts)]


def _set_fused(obj, which: int, parts: list[PackedWeight]) -> None:
    """Hands the stack the last added layer's parts packed side by side along N."""
    cat = lambda f: torch.cat([f(w) for w in parts], dim=1).contiguous()  # noqa: E731
    bias = None if parts[0].bias is None else torch.cat([w.bias.float() for w in parts])
    fused = PackedWeight(cat(lambda w: w.qweight), parts[0].groups, cat(lambda w: w.scale), cat(lambda w: w.zero),
                         parts[0].perm, parts[0].in_features, sum(w.out_features for w in parts))
    int8 = wants_int8(parts[0])
    obj.set_fused(which, fused.qweight, fused.groups, fused.scale, fused.zero, fused.perm, bias, int8,
                  int8_zero(fused) if int8 else None, [w.out_features for w in parts])


def _has_class() -> bool:
    if extension() is None:
        return False
    try:
        torch.classes.exl_core.DecoderStack   # noqa: B018 - raises when the class is not registered
    except (RuntimeError, AttributeError):
        return False
    return True


def _weights_reason(layers, hq, hkv, d, dtype) -> Optional[str]:
    if not _has_class():
        return "extension exl_core._C not built with exl_core.DecoderStack"
    if dtype not in _DTYPES:
        return f"model dtype {dtype} not supported (float32, bfloat16)"
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head dim {d} not in {SUPPORTED_HEAD_DIMS}"
    if hkv <= 0 or hq % hkv or hq // hkv > _MAX_REP:
        return f"{hq} query heads over {hkv} kv heads (the attention kernel takes up to {_MAX_REP} per kv head)"
    for i, lw in enumerate(layers):
        if len(lw.projections) != 7:
            return f"layer {i}: {len(lw.projections)} projections, expected 7"
        for t in (lw.input_norm, lw.post_norm):
            if t.device.type != "cpu" or t.dtype != dtype:
                return f"layer {i}: norm weight {t.dtype} on {t.device}, needs {dtype} on CPU"
        for j, w in enumerate(lw.projections):
            why = _weight_reason(w)
            if why is not None:
                return f"layer {i} projection {j}: {why}"
    return None


def _weight_reason(w: Weight) -> Optional[str]:
    if isinstance(w, PackedWeight):
        if w.qweight.device.type != "cpu":
            return f"packed weight on {w.qweight.device}"
        if w.scale.dtype != torch.float32 or w.zero.dtype != torch.float32:
            return f"scale/zero must be float32, got {w.scale.dtype}/{w.zero.dtype}"
        return rows_reason(w)
    if w.w_t.device.type != "cpu" or w.w_t.dtype not in _DTYPES or not w.w_t.is_contiguous():
        return f"dense weight {w.w_t.dtype} on {w.w_t.device} (needs contiguous float32/bfloat16 on CPU)"
    return None


# The per-op kernels the fused op stands in for: op -> the candidates it may have chosen there. When
# a debug switch disables any of them, or forces the op to another one, the user asked for another
# kernel there and the fused op steps aside. The quantized matmuls step aside on any force at all:
# the stack picks int8 or exact per weight and row count, which a forced choice would not follow.
_INNER = {"qmatmul": ("cpu_int8", "cpu_fused"), "qmatmul_many": ("cpu_int8_multi", "cpu_fused_multi"),
          "dense_linear": ("cpu_fused",), "rms_norm": ("cpu",), "rope": ("cpu",), "silu_mul": ("cpu",),
          "attention": ("cpu",)}
_PICKS_PER_WEIGHT = ("qmatmul", "qmatmul_many")


def _switch_reason() -> Optional[str]:
    for op, names in _INNER.items():
        forced = dispatch._FORCED.get(op)
        moved = forced is not None and (op in _PICKS_PER_WEIGHT or forced not in names)
        if moved or any(n in dispatch._DISABLED for n in names):
            return f"EXL_CORE_FORCE_KERNEL/EXL_CORE_DISABLE_KERNEL move {op} off its {'/'.join(names)} kernels"
    return None


def _bf16_rows(h, stack) -> bool:
    return stack.bf16_prefill and h.dim() == 2 and h.shape[0] >= BF16_MIN_M


def _check_cpu(h, stack, kv, cos_sin, fallback) -> Optional[str]:
    if kv is None:
        return "context is not a plain paged cache context"
    if stack is None:
        return "no native stack for this model (weights not on the CPU)"
    if stack.reason is not None:
        return stack.reason
    if h.device.type != "cpu" or h.dtype != stack.dtype or h.dim() != 2:
        return f"h {h.dtype} on {h.device}, needs (T, hidden) {stack.dtype} on CPU"
    if _bf16_rows(h, stack):
        return f"{h.shape[0]} rows with prefill='bf16': the per-op path has the bf16 kernel, the stack does not"
    if len(kv.k) != stack.num_layers or not kv.k:
        return f"cache has {len(kv.k)} layers, model {stack.num_layers} (needs at least one)"
    c = kv.k[0]
    if c.device.type != "cpu" or c.dtype not in _DTYPES:
        return f"cache {c.dtype} on {c.device}, needs float32/bfloat16 on CPU"
    if kv.block_table.dtype != torch.int32 or kv.cu_seqlens.dtype != torch.int64 or \
            kv.seq_lens_k.dtype != torch.int64 or kv.positions.dtype != torch.int64:
        return "index dtypes must be block_table int32, cu_seqlens/seq_lens_k/positions int64"
    return _switch_reason()


def _run_cpu(h, stack, kv, cos_sin, fallback):
    try:
        return tuple(stack.obj.forward(h, None, kv.positions, cos_sin, kv.slots, kv.block_table, kv.cu_seqlens,
                                       kv.seq_lens_k, list(kv.k), list(kv.v)))
    except RuntimeError as e:    # a C++ argument check (bad slot, page, shape): name the op, keep the text
        raise KernelError(f"decoder_layers (exl_core.DecoderStack): {e}") from e


def _key(h, stack, kv, cos_sin, fallback):
    # everything _check_cpu reads (stack identity is not: equal fields mean an equal answer)
    if stack is None or kv is None or not kv.k:
        return (stack is None, kv is None)
    c = kv.k[0]
    return (stack.reason, stack.dtype, stack.num_layers, h.device, h.dtype, h.dim(), len(kv.k), c.device, c.dtype,
            kv.block_table.dtype, kv.cu_seqlens.dtype, kv.seq_lens_k.dtype, kv.positions.dtype,
            _switch_reason(), _bf16_rows(h, stack))


DISPATCH = Dispatcher("decoder_layers", [
    Candidate("cpu_layer", _check_cpu, _run_cpu),
    Candidate("python", lambda **_: None, lambda h, stack, kv, cos_sin, fallback: fallback()),
], key=_key)


def decoder_layers(h: torch.Tensor, stack: Optional[NativeStack], kv: Optional[PagedKV], cos_sin: torch.Tensor,
                   fallback: Callable[[], tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer over h (T, hidden) (the embeddings) -> (h, residual) of the last layer.

    `fallback()` computes the same with the per-op path; it runs where the fused op refuses.
    """
    return DISPATCH(h=h, stack=stack, kv=kv, cos_sin=cos_sin, fallback=fallback)
