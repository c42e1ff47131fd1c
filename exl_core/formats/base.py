"""Quantized-format plug-ins: "which format" kept apart from "how to compute" (STYLE habit 2).

A format is a small object that recognises its tensors and converts one linear layer into
the kernel layout `PackedWeight`. The loader asks the registry, never branches on names:

    fmt = detect_format(cfg.quantization_config, reader.names())
    if fmt is not None and fmt.has_layer(names, "model.layers.0.mlp.up_proj"):
        pw = fmt.load_layer(reader.get, reader.shape, prefix, in_features, out_features, qcfg)

Built-in formats (`exl2`, `gptq`) register themselves when this module is imported.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from ..errors import ExlError, FormatError
from .packed import PackedWeight

ReadFn = Callable[[str], torch.Tensor]
ShapeFn = Callable[[str], tuple]


@runtime_checkable
class QuantFormat(Protocol):
    name: str
    tensor_suffixes: tuple[str, ...]   # every per-layer suffix the format may store

    def detect(self, quant_config: Optional[dict], tensor_names: set[str]) -> bool: ...

    def has_layer(self, tensor_names: set[str], prefix: str) -> bool: ...

    def load_layer(self, read: ReadFn, shape: ShapeFn, prefix: str, in_features: int,
                   out_features: int, quant_config: Optional[dict]) -> PackedWeight: ...


FORMATS: dict[str, QuantFormat] = {}


def register_format(fmt: QuantFormat) -> QuantFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown quantization format '{name}'; known: {sorted(FORMATS)}") from None


def detect_format(quant_config: Optional[dict], tensor_names, where: str = "config.json") -> Optional[QuantFormat]:
    """The format named by quantization_config.quant_method, else the one whose tensors are
    present; None for a dense model. An unknown quant_method raises FormatError naming `where` (the config file)."""
    names = set(tensor_names)
    method = (quant_config or {}).get("quant_method")
    if method is not None:
        method = str(method).lower()
        if method not in FORMATS:
            raise FormatError(f"{where}: quantization_config.quant_method '{method}' is not supported "
                              f"(supported: {sorted(FORMATS)})")
        return FORMATS[method]
    for fmt in FORMATS.values():
        if fmt.detect(None, names):
            return fmt
    return None


# ---- helpers shared by the format modules -------------------------------------------------

def describe(t: Optional[torch.Tensor]) -> str:
    if t is None:
        return "missing"
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def check_tensor(name: str, t: Optional[torch.Tensor], dtypes, shape: Optional[tuple]) -> torch.Tensor:
    """Raises FormatError "<name>: expected int32 [72, 1536], got int32 [70, 1536]"."""
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    want = "/".join(str(d).replace("torch.", "") for d in dtypes)
    want_shape = "" if shape is None else f" {list(shape)}"
    if t is None:
        raise FormatError(f"{name}: tensor is missing (expected {want}{want_shape})")
    if t.dtype not in dtypes or (shape is not None and tuple(t.shape) != tuple(shape)):
        raise FormatError(f"{name}: expected {want}{want_shape}, got {describe(t)}")
    return t


def gather(read: ReadFn, shape: ShapeFn, prefix: str, required: tuple[str, ...],
           optional: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Reads `prefix.<suffix>` tensors; a missing required one raises FormatError naming it.

    Presence is probed through `shape` (KeyError, ExlError or None mean absent) so an optional
    tensor that exists but fails to read still raises instead of being silently dropped."""
    out: dict[str, torch.Tensor] = {}
    for suffix in required + optional:
        full = f"{prefix}.{suffix}"
        try:
            present = shape(full) is not None
        except (KeyError, ExlError):
            present = False
        if not present:
            if suffix in required:
                raise FormatError(f"{full}: tensor is missing (layer '{prefix}' needs {', '.join(required)})")
            continue
        out[suffix] = read(full)
    return out


def _load_builtin_formats() -> None:
    from . import exl2, gptq  # noqa: F401  (each calls register_format on import)


_load_builtin_formats()
