"""The RMSNorm between two projections folded into them (decode on CUDA: csrc/cuda/norm_fold_device.cuh).

In a decode step the residual stream goes o_proj -> add -> RMSNorm -> gate/up and down_proj -> add -> RMSNorm ->
q/k/v. Two ops let the projections do the add and the norm themselves, so no norm kernel runs between them:

  qmatmul_add_ss_(residual, x, pw, up=None) -> Optional[Tensor]
      residual += qmatmul(x, pw) in place (with `up`: qmatmul(silu_mul(x, up), pw)), returning the sums of squares
      of the new residual per 32-column tile and row, float32 [ceil(N / 32), rows] -- or None when no kernel takes
      the call: then nothing is done and the caller adds its own way.
  qmatmul_many_normed(residual, weight, eps, ss, pws) -> list[Tensor]
      qmatmul_many(rms_norm(residual, weight, eps), pws). With `ss` from qmatmul_add_ss_, the CUDA kernels normalise x
      while they stage it (the same roundings as the norm kernel, r from the partial sums in a fixed order); the
      reference runs the norm, then qmatmul_many (any device; `ss` unused).

The CUDA candidates are in ops/cuda_norm_fold.py; EXL_CORE_NORM_FOLD=0 turns them off (A/B runs).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..formats.packed import PackedWeight
from .dispatch import Candidate, Dispatcher
from .norm import rms_norm


# `ss` of a query (folds_norm): "the sums a producer would leave", so the checks can answer before it runs.
FOLD_QUERY = object()


def _reference_normed(residual, weight, eps, ss, pws):
    from .qmatmul import qmatmul_many
    return qmatmul_many(rms_norm(residual, weight, eps), list(pws))


DISPATCH_ADD_SS = Dispatcher("qmatmul_add_ss_", [
    Candidate("none", lambda residual, x, pw, up: None, lambda residual, x, pw, up: None),
])
DISPATCH_MANY_NORMED = Dispatcher("qmatmul_many_normed", [
    Candidate("torch", lambda residual, weight, eps, ss, pws: None, _reference_normed),
])


def qmatmul_add_ss_(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight,
                    up: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """residual += qmatmul(x, pw) (x = silu_mul(x, up) with up) and the new residual's sums of squares, or None
    (nothing done) where no kernel takes it."""
    return DISPATCH_ADD_SS(residual=residual, x=x, pw=pw, up=up)


def adds_ss(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight) -> bool:
    """Whether qmatmul_add_ss_(residual, x, pw) would do it (x: any tensor of its device, dtype and shape)."""
    return DISPATCH_ADD_SS.choose(residual=residual, x=x, pw=pw, up=None).name != "none"


def folds_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float, pws: Sequence[PackedWeight]) -> bool:
    """Whether qmatmul_many_normed would take the norm into its kernels given a producer's sums (so a producer
    knows whether its add pays: where the consumer cannot fold, the plain path keeps the add in the norm kernel)."""
    return DISPATCH_MANY_NORMED.choose(residual=residual, weight=weight, eps=eps, ss=FOLD_QUERY,
                                       pws=list(pws)).name != "torch"


def qmatmul_many_normed(residual: torch.Tensor, weight: torch.Tensor, eps: float, ss: Optional[torch.Tensor],
                        pws: Sequence[PackedWeight]) -> list[torch.Tensor]:
    """[qmatmul(rms_norm(residual, weight, eps), pw) for pw in pws]; ss: qmatmul_add_ss_'s sums for residual."""
    return DISPATCH_MANY_NORMED(residual=residual, weight=weight, eps=eps, ss=ss, pws=list(pws))
