"""y = x @ w_t (+ bias) for dense (unquantized) weights stored pre-transposed: w_t [K, N].

Used for the LM head and unquantized layers. Candidates (see `ops/dispatch.py`):
  cpu_fused  -- `exl_core::dense_matmul` C++ op (csrc/cpu/dense_matmul.cpp + the shared kernel
                body in simd.h): fp32/bf16 x and w_t on CPU; batch invariant like qmatmul.
  torch_ref  -- torch.matmul in fp32 (any device, fp16 too); not batch invariant.
A CUDA candidate is not planned: torch's cuBLAS path (torch_ref) serves CUDA tensors.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from .dispatch import Candidate, Dispatcher, has_op
from .input_grad import records_grad, with_input_grad

_OP_DTYPES = (torch.float32, torch.bfloat16)


def _check_cpu_fused(x, w_t, bias) -> Optional[str]:
    if not has_op("dense_matmul"):
        return "extension exl_core._C not built or has no dense_matmul kernel"
    if x.device.type != "cpu" or w_t.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        return "tensors not on CPU"
    if x.dtype not in _OP_DTYPES or w_t.dtype not in _OP_DTYPES:
        return f"dtypes x={x.dtype}, w_t={w_t.dtype} not supported (float32, bfloat16)"
    if not w_t.is_contiguous():
        return "w_t not contiguous (store it as .t().contiguous() once at load time)"
    return None


def _run_cpu_fused(x, w_t, bias):
    x2 = x.reshape(-1, w_t.shape[0])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return torch.ops.exl_core.dense_matmul(x2, w_t, bias).reshape(*x.shape[:-1], w_t.shape[1])


def _check_torch_ref(x, w_t, bias) -> Optional[str]:
    if not x.is_floating_point() or not w_t.is_floating_point():
        return f"x and w_t must be floating point, got {x.dtype}, {w_t.dtype}"
    return None


def _run_torch_ref(x, w_t, bias):
    y = x.to(torch.float32) @ w_t.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _key(x, w_t, bias):
    # everything the checks above read
    return (x.device, x.dtype, w_t.device, w_t.dtype, w_t.is_contiguous(),
            None if bias is None else bias.device)


DISPATCH = Dispatcher("dense_linear", [
    Candidate("cpu_fused", _check_cpu_fused, _run_cpu_fused),
    Candidate("torch_ref", _check_torch_ref, _run_torch_ref),
], key=_key)


def dense_linear(x: torch.Tensor, w_t: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ w_t [K, N] (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation."""
    if w_t.dim() != 2 or x.dim() < 1 or x.shape[-1] != w_t.shape[0]:
        raise InputError(f"dense_linear: x {tuple(x.shape)} does not match w_t {tuple(w_t.shape)} "
                         f"(w_t must be the pre-transposed weight [in_features, out_features])")
    if bias is not None and tuple(bias.shape) != (w_t.shape[1],):
        raise InputError(f"dense_linear: bias shape {tuple(bias.shape)} != ({w_t.shape[1]},)")
    if records_grad(x) and not w_t.requires_grad and (bias is None or not bias.requires_grad):
        # dL/dx through the frozen weight (ops/input_grad.py); a weight that requires grad goes on as before
        return with_input_grad(x, lambda t: DISPATCH(x=t, w_t=w_t, bias=bias), lambda: w_t.float())
    return DISPATCH(x=x, w_t=w_t, bias=bias)


def _register_fake() -> None:
    if not has_op("dense_matmul") or getattr(_register_fake, "done", False):
        return
    _register_fake.done = True

    @torch.library.register_fake("exl_core::dense_matmul")
    def _(x, w_t, bias):
        torch._check(x.dim() == 2 and w_t.dim() == 2, lambda: "dense_matmul: x and w_t must be 2-D")
        return x.new_empty((x.shape[0], w_t.shape[1]))


_register_fake()
