"""RMSNorm (HF Llama semantics), optionally fused with the residual add of a transformer block.

Candidates: [cuda slot] → cpu (exl_core::rms_norm / rms_norm_residual) → torch_ref.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..errors import InputError
from .dispatch import Candidate, Dispatcher, has_op

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None):
    """Plain torch, any device: exactly HF LlamaRMSNorm (cast to x's dtype before the weight)."""
    if residual is not None:
        h = x + residual                                           # in x's dtype
        return rms_norm_ref(h, weight, eps), h
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _cpu_check(x, weight, eps, residual, weight_static=False) -> Optional[str]:
    if not has_op("rms_norm"):
        return "C++ extension not built with exl_core::rms_norm"
    if x.device.type != "cpu":
        return f"x on {x.device}, kernel is CPU-only"
    if x.dtype not in _KERNEL_DTYPES or weight.dtype != x.dtype:
        return f"dtypes x={x.dtype}, weight={weight.dtype}; kernel needs both float32 or both bfloat16"
    if residual is not None and (residual.dtype != x.dtype or residual.device != x.device):
        return f"residual dtype {residual.dtype} differs from x {x.dtype}"
    return None


def _cpu_run(x, weight, eps, residual, weight_static=False):
    x = x.contiguous()
    if residual is None:
        return torch.ops.exl_core.rms_norm(x, weight.contiguous(), float(eps))
    return tuple(torch.ops.exl_core.rms_norm_residual(x, residual.contiguous(), weight.contiguous(), float(eps)))


def _ref_run(x, weight, eps, residual, weight_static=False):
    return rms_norm_ref(x, weight, eps, residual)


def _key(x, weight, eps, residual, weight_static=False):
    # everything the checks read (this file's and cuda_candidates')
    return (x.device, x.dtype, weight.device, weight.dtype,
            None if residual is None else (residual.device, residual.dtype))


RMS_NORM = Dispatcher("rms_norm", [
    # slot: Candidate("cuda", ...) goes first once csrc/cuda has a norm kernel
    Candidate("cpu", _cpu_check, _cpu_run),
    Candidate("torch_ref", lambda **_: None, _ref_run),
], key=_key)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
             weight_static: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x (..., H), weight (H) -> (..., H).

    With `residual` (x's shape): h = x + residual in x's dtype; returns (rms_norm(h), h).
    weight_static: the weight is a model's parameter, written by no kernel just before this call (the same result;
    the CUDA kernel then reads it before its programmatic-dependent-launch wait, csrc/cuda/pdl.cuh).
    """
    check_norm_args("rms_norm", x, weight, residual)
    return RMS_NORM(x=x, weight=weight, eps=eps, residual=residual, weight_static=weight_static)


def check_norm_args(op: str, x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """Raises InputError unless x (..., H) is float, weight [H] and residual (if any) x's shape."""
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise InputError(f"{op}: weight {tuple(weight.shape)} must be [H] with H = x.shape[-1] "
                         f"(x {tuple(x.shape)})")
    if residual is not None and residual.shape != x.shape:
        raise InputError(f"{op}: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise InputError(f"{op}: x must be a float tensor, got {x.dtype}")


def _register_fakes() -> None:
    if has_op("rms_norm"):
        @torch.library.register_fake("exl_core::rms_norm")
        def _(x, weight, eps):
            return torch.empty_like(x)

        @torch.library.register_fake("exl_core::rms_norm_residual")
        def _(x, residual, weight, eps):
            return torch.empty_like(x), torch.empty_like(x)


_register_fakes()
