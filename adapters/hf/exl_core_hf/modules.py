"""`HFQuantLinear`: exl_core's `QuantLinear` as it sits inside a transformers model.

transformers loads weights by name into whatever parameters/buffers `model.state_dict()`
lists, so the module keeps the checkpoint's own tensors (EXL2 ``q_weight, q_invperm, q_scale,
q_scale_max, q_groups[, q_perm, bias]``; GPTQ ``qweight, qzeros, scales, g_idx[, bias]``) as
persistent buffers with the exact shapes and dtypes read from the safetensors headers. After
loading, `finalize()` asks the exl_core format for the kernel-native `PackedWeight`, which
`QuantLinear.forward` then runs. `save_pretrained` writes the checkpoint tensors back untouched.

The packed copy lives in `QuantLinear`'s `_pk_*` buffers (set by `set_packed`), apart from the
checkpoint tensors' own names.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from exl_core.errors import FormatError
from exl_core.formats.packed import PackedWeight
from exl_core.model.linear import QuantLinear

class HFQuantLinear(QuantLinear):
    """QuantLinear holding checkpoint tensors under their file names (see module docstring)."""

    def __init__(self, in_features: int, out_features: int, tensors: dict[str, tuple[tuple, torch.dtype]],
                 prefix: str):
        super().__init__(in_features, out_features)
        self.prefix = prefix
        self.source_names = tuple(sorted(tensors))
        if "bias" in tensors:
            del self.bias   # QuantLinear sets a plain attribute; the checkpoint bias becomes a buffer
        for name, (shape, dtype) in tensors.items():
            # meta: transformers materialises it from the file; nothing is ever random-initialised
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device="meta"), persistent=True)

    def _fixed_dtype_buffers(self) -> tuple:
        # the checkpoint's tensors keep the file's dtypes through model.to(torch.bfloat16): save_pretrained writes
        # them back bit for bit (they are read only to build the packed weight)
        return super()._fixed_dtype_buffers() + self.source_names

    # -- after transformers filled the buffers -------------------------------------------------
    def finalize(self, pack: Callable[[Callable[[str], torch.Tensor], str], PackedWeight]) -> None:
        """Build the PackedWeight from the loaded checkpoint tensors.

        pack(get, prefix) -> PackedWeight, where get(full_name) returns a checkpoint tensor."""
        for n in self.source_names:
            if getattr(self, n).is_meta:
                raise FormatError(f"{self.prefix}.{n}: still on the meta device after loading "
                                  "(the checkpoint lacks it)")

        def get(full: str) -> torch.Tensor:
            short = full[len(self.prefix) + 1:] if full.startswith(self.prefix + ".") else full
            if short not in self.source_names:
                raise FormatError(f"{full}: not in the checkpoint (module has {', '.join(self.source_names)})")
            return getattr(self, short)

        pw = pack(get, self.prefix)
        if (pw.in_features, pw.out_features) != (self.in_features, self.out_features):
            raise FormatError(f"{self.prefix}: checkpoint holds a {pw.in_features}x{pw.out_features} "
                              f"matrix, the model expects {self.in_features}x{self.out_features}")
        dev = getattr(self, self.source_names[0]).device
        pw = pw.to(dev)
        self.set_packed(pw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            raise FormatError(f"{self.prefix}: quantized layer used before its weights were loaded")
        # HF hands (batch, seq, in); the kernels take (rows, in).
        shape = x.shape
        y = super().forward(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        fmt = (self._packed.meta.get("format") if self._packed is not None else None) or "checkpoint"
        return f"in={self.in_features}, out={self.out_features}, {fmt}, tensors={','.join(self.source_names)}"


def layer_tensors(names: Iterable[str], prefix: str) -> list[str]:
    """Short names of the checkpoint tensors directly under `prefix` (e.g. 'q_weight', 'bias')."""
    p = prefix + "."
    return sorted(n[len(p):] for n in names if n.startswith(p) and "." not in n[len(p):])


def as_torch_dtype(dtype, default: torch.dtype = torch.float32) -> torch.dtype:
    """A `torch.dtype` from a torch.dtype or its name ("float32", "torch.bfloat16", "fp16", ...).

    None and "auto" give `default`. transformers hands `model.config.dtype` to `dequantize`, and
    that is a string once the config was serialised (e.g. by `save_pretrained`)."""
    if dtype is None:
        return default
    given = dtype
    if isinstance(dtype, str):
        name = dtype.strip()
        if name.startswith("torch."):
            name = name[len("torch."):]
        if name == "auto":
            return default
        name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}.get(name, name)
        dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise TypeError(f"not a floating-point torch dtype: {given!r} (give a torch.dtype or its name, e.g. 'float16')")


def to_dense_linear(m: HFQuantLinear, dtype) -> nn.Linear:
    """Dequantised nn.Linear with the same function (for `model.dequantize()`).

    dtype: a torch.dtype or its name (see `as_torch_dtype`)."""
    dtype = as_torch_dtype(dtype)
    w = m.dense_weight(torch.float32).to(dtype)        # (out, in)
    lin = nn.Linear(m.in_features, m.out_features, bias=m._packed.bias is not None,
                    device=w.device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if lin.bias is not None:
            lin.bias.copy_(m._packed.bias.to(dtype))
    return lin
