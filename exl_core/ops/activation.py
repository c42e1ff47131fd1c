"""SwiGLU gate `silu(gate) * up` with HF semantics (computed like `act(gate) * up` in the input dtype).

Candidates: [cuda slot] → cpu (exl_core::silu_mul) → torch_ref.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import InputError
from .dispatch import Candidate, Dispatcher, has_op


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch, any device: HF LlamaMLP's `act_fn(gate) * up`."""
    return F.silu(gate) * up


def _cpu_check(gate, up) -> Optional[str]:
    if not has_op("silu_mul"):
        return "C++ extension not built with exl_core::silu_mul"
    if gate.device.type != "cpu" or up.device.type != "cpu":
        return f"tensors on {gate.device}, kernel is CPU-only"
    if gate.dtype not in (torch.float32, torch.bfloat16) or up.dtype != gate.dtype:
        return f"dtypes gate={gate.dtype}, up={up.dtype}; kernel needs both float32 or both bfloat16"
    return None


def _cpu_run(gate, up):
    return torch.ops.exl_core.silu_mul(gate.contiguous(), up.contiguous())


def _key(gate, up):
    # everything the checks read (this file's and cuda_candidates')
    return gate.device, gate.dtype, up.device, up.dtype


SILU_MUL = Dispatcher("silu_mul", [
    # slot: Candidate("cuda", ...) goes first once csrc/cuda has an activation kernel
    Candidate("cpu", _cpu_check, _cpu_run),
    Candidate("torch_ref", lambda **_: None, lambda gate, up: silu_mul_ref(gate, up)),
], key=_key)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (..., I) -> silu(gate) * up, same shape and dtype."""
    if gate.shape != up.shape:
        raise InputError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    return SILU_MUL(gate=gate, up=up)


def _register_fakes() -> None:
    if has_op("silu_mul"):
        @torch.library.register_fake("exl_core::silu_mul")
        def _(gate, up):
            return torch.empty_like(gate)


_register_fakes()
