"""`QuantLinear`: one linear layer whose weight is either packed-quantized or dense.

Formats never appear here (STYLE habit 2): a format converts its file tensors into a
`PackedWeight` (kernel-native layout) or the layer stays dense; forward hands the weight to
the op dispatchers, which pick a kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..formats.packed import PackedWeight
from ..ops.attention import OutOrder, out_order_for
from ..ops.linear import dense_linear
from ..ops.activation import silu_mul
from ..ops.norm import rms_norm
from ..ops.norm_fold import adds_ss, folds_norm, qmatmul_add_ss_, qmatmul_many_normed
from ..ops.qmatmul import adds_in_place, qmatmul, qmatmul_add_, qmatmul_many, qmatmul_silu
from ..ops import xchunks
from ..ops.swiglu import qmatmul_swiglu

_PACKED_FIELDS = ("qweight", "groups", "scale", "zero", "perm", "bias")


# Per-layer caches of the functions below (in the layer's __dict__: (source tensor, cached value)), dropped by
# QuantLinear._drop_caches when the packed weight is replaced or moved.
_LAYER_CACHES = ("_perm32", "_unpermuted", "_out_order", "_tails")

# Bumped whenever a QuantLinear's `lora` attribute is set or deleted (model/llama.py reads it to
# skip re-checking every projection for LoRA hooks on every forward pass).
LORA_VERSION = [0]


class QuantLinear(nn.Module):
    """y = x @ W (+ bias), W (in_features, out_features) packed or dense.

    Dense weights are kept transposed, `w_t` (in, out) contiguous, the layout the dense
    kernel streams along output columns.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._packed: Optional[PackedWeight] = None
        self.register_buffer("w_t", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.lora = None  # set by exl_core.model.lora: adds x·A·B·scale on the fly
        # Where the checkpoint's order was changed at load (loader.fold_down_perms): input j of this layer is the
        # checkpoint's input input_order[j], output j its output output_order[j]; int64 CPU tensors or None.
        # LoRA adapters (checkpoint order) are reordered by them.
        self.input_order: Optional[torch.Tensor] = None
        self.output_order: Optional[torch.Tensor] = None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "lora":
            LORA_VERSION[0] += 1     # the fused decoder stack re-checks its projections' hooks

    def __delattr__(self, name):
        super().__delattr__(name)
        if name == "lora":
            LORA_VERSION[0] += 1

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "QuantLinear":
        """weight in HF layout (out_features, in_features)."""
        out_f, in_f = weight.shape
        m = cls(in_f, out_f)
        m.register_buffer("w_t", weight.t().contiguous(), persistent=False)
        m.register_buffer("bias", bias, persistent=False)
        return m

    @classmethod
    def from_packed(cls, pw: PackedWeight) -> "QuantLinear":
        m = cls(pw.in_features, pw.out_features)
        m.set_packed(pw)
        return m

    def set_packed(self, pw: PackedWeight) -> None:
        """Install or swap the packed weight. Its tensors are buffers under `_pk_*` names, so
        they follow .to() and leave file tensor names (`q_scale`, `qweight`, ...) free for
        subclasses that keep a checkpoint's own tensors (the HF adapter)."""
        for f in _PACKED_FIELDS:
            self.register_buffer(f"_pk_{f}", getattr(pw, f), persistent=False)
        self._packed = pw
        self._drop_caches()

    def _drop_caches(self) -> None:
        """Forget what this module's functions cached on the layer from its packed weight (they would keep old or
        moved tensors alive): shared_perm's int32 copy, _without_perm's twin, input_out_order's store map,
        down_tails' map."""
        for name in _LAYER_CACHES:
            self.__dict__.pop(name, None)

    def with_columns(self, cols: torch.Tensor) -> "QuantLinear":
        """A new layer computing output columns `cols` (int64 indices, in that order) of this one; a packed
        weight's per-device caches (meta keys starting with "_") are dropped.  Not for layers with LoRA."""
        pick = lambda t: None if t is None else t.index_select(-1, cols.to(t.device)).contiguous()  # noqa: E731
        if self._packed is not None:
            pw = self.packed
            new = QuantLinear.from_packed(PackedWeight(pick(pw.qweight), pw.groups, pick(pw.scale), pick(pw.zero),
                                                       pw.perm, pw.in_features, int(cols.numel()), pick(pw.bias),
                                                       pw.portable_meta(), pw.rows))
        else:
            new = QuantLinear.from_dense(pick(self.w_t).t(), pick(self.bias))
        cols = cols.cpu()
        new.input_order = self.input_order
        new.output_order = cols if self.output_order is None else self.output_order[cols]
        return new

    @property
    def is_quantized(self) -> bool:
        return self._packed is not None

    @property
    def packed(self) -> Optional[PackedWeight]:
        """The packed weight, refreshed after .to()/.half() moved the buffers."""
        pw = self._packed
        if pw is None:
            return None
        b = self._buffers   # direct dict reads: this runs on every forward (nn.Module.__getattr__ is slow)
        if pw.qweight is not b["_pk_qweight"] or pw.scale is not b["_pk_scale"] or pw.bias is not b["_pk_bias"]:
            pw = PackedWeight(b["_pk_qweight"], b["_pk_groups"], b["_pk_scale"], b["_pk_zero"], b["_pk_perm"],
                              pw.in_features, pw.out_features, b["_pk_bias"], pw.meta, pw.rows)
            self._packed = pw
        return pw

    # Buffers whose dtype the kernels define: a dtype cast of the model moves them without rounding them.
    _FIXED_DTYPE_BUFFERS = ("_pk_scale", "_pk_zero")

    def _fixed_dtype_buffers(self) -> tuple:
        return self._FIXED_DTYPE_BUFFERS

    def _apply(self, fn, recurse=True):
        # Only float payloads follow dtype casts; packed integer words, scales and the permutation keep their dtypes
        # (the kernels define them) and only change device -- moved from the original, so no value is rounded (a
        # cast to bfloat16 and back would round the scales).
        fixed = {id(t) for n, t in self._buffers.items() if t is not None and n in self._fixed_dtype_buffers()}

        def guarded(t):
            moved = fn(t)
            if t.dtype != moved.dtype and (id(t) in fixed or not t.is_floating_point()):
                return t.to(moved.device)
            return moved
        super()._apply(guarded, recurse)
        self._drop_caches()
        return self

    def dense_weight(self, dtype=torch.float32) -> torch.Tensor:
        """W in HF layout (out_features, in_features), dequantised when packed; its rows and columns in the
        layer's own order (input_order / output_order say where the loader changed the checkpoint's)."""
        if self._packed is None:
            return self.w_t.t().to(dtype)
        from ..formats.packed import dequantize_reference
        return dequantize_reference(self.packed, dtype=torch.float64).t().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            y = qmatmul(x, self.packed)
        else:
            y = dense_linear(x, self.w_t, self.bias)
        if self.lora is not None:
            y = self.lora(x, y)
        return y

    def extra_repr(self) -> str:
        kind = "packed" if self._packed is not None else f"dense {self.w_t.dtype}"
        bias = self._packed.bias if self._packed is not None else self.bias
        return f"in={self.in_features}, out={self.out_features}, {kind}, bias={bias is not None}"


def _plain_packed(m) -> bool:
    """A packed QuantLinear without LoRA (not dense, not a tensor-parallel shard or other subclass), or a Prepermuted
    view of one: its output is qmatmul(x, m.packed), so fused ops may compute it."""
    return (type(m) is QuantLinear and m._packed is not None and m.lora is None) or type(m) is Prepermuted


def linear_many(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """[layer(x) for layer in layers] for projections that read the same x (q/k/v, gate/up): one
    kernel call when every layer is a plain packed QuantLinear without LoRA (same results);
    anything else (dense, LoRA, tensor-parallel shards, subclasses) runs layer by layer."""
    if all(_plain_packed(m) for m in layers):
        return qmatmul_many(x, [m.packed for m in layers])
    return [m(x) for m in layers]


# ---------------------------------------------------------------------------- x written in the layers' act-order
# The caches below live in the QuantLinear's __dict__ (cleared by _apply), not in PackedWeight.meta: a twin kept there
# would hold its weight's tensors after a move and, holding meta itself, form a reference cycle.

def shared_perm(layers) -> Optional[torch.Tensor]:
    """The act-order permutation all `layers` read x in, as int32 on their device, where they are plain packed
    layers sharing one permutation tensor (loader.share_input_perms: q/k/v, gate/up); else None.  The norm before
    them can then write x in that order (ops/norm_perm.py) for Prepermuted views of them.  Weights with extra rows
    (formats/uniform4.py) share one too where their row layouts agree: its length is then their rows.
    The copy is made once per permutation tensor and waited for on the host: the norm kernel reads it before
    its programmatic-dependent-launch wait, as data no kernel of the step writes (csrc/cuda/pdl.cuh).  While a CUDA
    graph is being captured a missing copy cannot be made that way: None then (the layers gather x themselves)."""
    if not all(_plain_packed(m) for m in layers):
        return None
    pw = layers[0].packed
    if pw.perm is None or any(m.packed.perm is not pw.perm for m in layers[1:]):
        return None
    held = layers[0].__dict__.get("_perm32")
    if held is None or held[0] is not pw.perm:
        if pw.perm.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        copy = pw.perm.to(torch.int32).contiguous()
        if copy.is_cuda:
            torch.cuda.current_stream(copy.device).synchronize()
        held = layers[0].__dict__["_perm32"] = (pw.perm, copy)
    return held[1]


def _without_perm(m: "QuantLinear") -> PackedWeight:
    """m's packed weight for an x already permuted: the same tensors, perm None, in_features its rows (x[..., perm]
    has that many columns); it shares the weight's meta, whose caches (chunk table, kernel checks) do not depend on
    the permutation."""
    pw = m.packed
    held = m.__dict__.get("_unpermuted")
    if held is None or held[0] is not pw:
        held = m.__dict__["_unpermuted"] = (pw, PackedWeight(pw.qweight, pw.groups, pw.scale, pw.zero, None, pw.k_rows,
                                                             pw.out_features, pw.bias, pw.meta, None))
    return held[1]


class Prepermuted:
    """A plain packed layer that reads an x already in its act-order (x[..., perm], from a kernel that stored it so:
    the permuted norm for q/k/v and gate/up, ops/norm_perm.py; the attention kernel for o_proj,
    ops.attention.OutOrder): _without_perm's weight.  The fused-op helpers here (linear_many, linear_swiglu,
    linear_add_, linear_add_ss_) take it as a layer; calling it is the layer's forward on that x."""
    __slots__ = ("packed",)

    def __init__(self, layer: "QuantLinear"):
        self.packed = _without_perm(layer)

    def __call__(self, xp: torch.Tensor) -> torch.Tensor:
        return qmatmul(xp, self.packed)


def input_out_order(layer, width: int) -> Optional[OutOrder]:
    """For a plain packed layer with an act-order permutation over `width` inputs: the OutOrder under which the
    attention kernel stores its output as the layer reads it (ops.attention.out_order_for; then run Prepermuted(layer)
    on it), on the layer's device, made once (a host sync) and cached on the layer (QuantLinear._apply drops it).
    None elsewhere, where no store map gives the layer's order, and while a CUDA graph is being captured with none
    made yet."""
    if not _plain_packed(layer) or type(layer) is Prepermuted:
        return None
    pw = layer.packed
    if pw.perm is None or pw.in_features != width:
        return None
    held = layer.__dict__.get("_out_order")
    if held is None or held[0] is not pw.perm:
        if pw.perm.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        order = out_order_for(pw.perm, width, pw.qweight.device)
        if order is not None and order.pos.is_cuda:     # the attention kernel reads the maps before its PDL wait
            torch.cuda.current_stream(order.pos.device).synchronize()
        held = layer.__dict__["_out_order"] = (pw.perm, order)
    return held[1]


def down_tails(down) -> Optional[tuple]:
    """(tails, columns) for a plain packed down projection whose weight reads x as ops/xchunks.py tails_of describes
    (a rewritten EXL2 down after loader.fold_down_perms): the SwiGLU pair kernel then writes its product [rows,
    columns] and down runs as Prepermuted on it (MLP.down_layer).  Made once per permutation tensor and cached on the
    layer; None where EXL_CORE_WIDE_TAILS is off, the weight is not of that form, or a CUDA graph is being captured
    with none made yet."""
    if not xchunks.TAILS_ON or type(down) is not QuantLinear or not _plain_packed(down):
        return None
    pw = down.packed
    if pw.perm is None or pw.rows is None:
        return None
    held = down.__dict__.get("_tails")
    if held is None or held[0] is not pw.perm:
        if pw.perm.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        tails = xchunks.tails_of(pw.perm, pw.in_features)
        held = down.__dict__["_tails"] = (pw.perm, None if tails is None else (tails, pw.rows))
    return held[1]


def linear_add_(residual: torch.Tensor, x: torch.Tensor, layer) -> bool:
    """residual += layer(x) in place, in one kernel call, for a plain packed layer without bias where one takes the
    add (the prompt's o and down projections on CUDA: the GEMM's beta = 1); returns False, doing nothing, elsewhere."""
    return _plain_packed(layer) and layer.packed.bias is None and qmatmul_add_(residual, x, layer.packed)


def linear_adds_in_place(residual: torch.Tensor, x: torch.Tensor, layer) -> bool:
    """Whether linear_add_(residual, x, layer) would do the add (x: any tensor of its device, dtype and shape)."""
    return _plain_packed(layer) and layer.packed.bias is None and adds_in_place(residual, x, layer.packed)


def linear_silu(gate: torch.Tensor, up: torch.Tensor, layer) -> torch.Tensor:
    """layer(silu_mul(gate, up)), the MLP's down projection: one fused op for a plain packed QuantLinear (the
    same values), the two steps for anything else."""
    if _plain_packed(layer):
        return qmatmul_silu(gate, up, layer.packed)
    return layer(silu_mul(gate, up))


def linear_swiglu(x: torch.Tensor, gate, up, tails: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """silu_mul(gate(x), up(x)) in one kernel call for plain packed layers where one takes it (batch decode on
    CUDA), else None: nothing done.  tails (down_tails): the product widened as the down projection reads it
    (qmatmul_swiglu)."""
    if _plain_packed(gate) and _plain_packed(up):
        return qmatmul_swiglu(x, gate.packed, up.packed, tails)
    return None


# ---------------------------------------------------------------------------- the RMSNorm folded in (ops/norm_fold.py)

def linear_add_ss_(residual: torch.Tensor, x: torch.Tensor, layer,
                   up: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """residual += layer(x) (layer(silu_mul(x, up)) with up) in place, in one kernel call, for a plain packed layer
    where one takes it; returns the new residual's sums of squares (for linear_many_normed), or None, doing nothing."""
    return qmatmul_add_ss_(residual, x, layer.packed, up) if _plain_packed(layer) else None


def linear_adds_ss(residual: torch.Tensor, x: torch.Tensor, layer) -> bool:
    """Whether linear_add_ss_(residual, x, layer) would do the add (x: any tensor of its device, dtype and shape)."""
    return _plain_packed(layer) and adds_ss(residual, x, layer.packed)


def linear_folds_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float, layers) -> bool:
    """Whether linear_many_normed(residual, weight, eps, ss, layers) would take the norm into its kernels."""
    return all(_plain_packed(m) for m in layers) and folds_norm(residual, weight, eps, [m.packed for m in layers])


def linear_many_normed(residual: torch.Tensor, weight: torch.Tensor, eps: float, ss: torch.Tensor,
                       layers) -> list[torch.Tensor]:
    """linear_many(rms_norm(residual, weight, eps), layers); ss: linear_add_ss_'s sums for residual, with which
    plain packed layers normalise x inside their kernel (no norm launch)."""
    if all(_plain_packed(m) for m in layers):
        return qmatmul_many_normed(residual, weight, eps, ss, [m.packed for m in layers])
    return linear_many(rms_norm(residual, weight, eps), layers)
