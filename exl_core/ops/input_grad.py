"""Matmuls of a frozen weight made differentiable in their input.

The kernels (CPU and CUDA) have no autograd: without this, a loss through a quantized layer would give no gradient
to anything before it (HF's "silently incorrect" warning at most).  Adapter training (LoRA / PEFT) on a quantized
model needs dL/dx only: dL/dx = dL/dy @ W^T, W dequantised to fp32 in the backward pass (one layer at a time, so the
dense copy lives only while its gradient is computed).  The weight itself stays frozen: it gets no gradient.
"""
from __future__ import annotations

from typing import Callable

import torch


class _FrozenWeightMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, run: Callable, weight_kn: Callable):
        ctx.weight_kn = weight_kn
        return run(x)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        w = ctx.weight_kn()                                   # [K, N] fp32, x's order
        gx = gy.reshape(-1, w.shape[1]).to(w.dtype) @ w.t()
        return gx.to(gy.dtype).reshape(*gy.shape[:-1], w.shape[0]), None, None


def records_grad(x: torch.Tensor) -> bool:
    """Whether autograd records an op on x (then use with_input_grad; else call the kernel directly)."""
    return x.requires_grad and torch.is_grad_enabled()


def with_input_grad(x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                    weight_kn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """run(x) (= x @ W + bias, W [K, N]) with dL/dx = dL/dy @ W^T; weight_kn() gives W in fp32 when the backward
    pass needs it."""
    return _FrozenWeightMatmul.apply(x, run, weight_kn)
