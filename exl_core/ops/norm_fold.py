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

import os
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


# ---------------------------------------------------------------------------- consumers reading x in their act-order
# Where the consumers (q/k/v, gate/up) share one act-order permutation -- EXL2 rewritten as uniform 4-bit rows, whose
# permutation repeats some columns (formats/uniform4.py) -- the producer also stores the new residual in that order
# (xp, through an ops.attention.OutOrder: its column c at pos[c] and pos2[c]), and the consumers' kernels stage xp as
# they stage a plain residual, normalising it with the norm weight in the same order; r's mean runs over the
# residual's own columns.  Written after stop 31's last device call and compile-checked only: off until a GPU has run
# its tests and measured it (EXL_CORE_NORM_FOLD_PERM=1 turns it on, here and in model/llama.py).
FOLD_PERM_ON = os.environ.get("EXL_CORE_NORM_FOLD_PERM", "0") == "1"
FOLD_PERM_MAX_ROWS = 32       # the model asks for decode rows only (the CUDA kernels take at most 8)

def _reference_normed_perm(residual, weight, eps, ss, xp, perm, weight_perm, pws):
    from .qmatmul import qmatmul_many
    return qmatmul_many(rms_norm(residual, weight, eps)[..., perm.long()], list(pws))


DISPATCH_ADD_SS_INTO = Dispatcher("qmatmul_add_ss_into_", [
    Candidate("none", lambda residual, x, pw, up, xp, order: None, lambda residual, x, pw, up, xp, order: None),
])
DISPATCH_MANY_NORMED_PERM = Dispatcher("qmatmul_many_normed_perm", [
    Candidate("torch", lambda residual, weight, eps, ss, xp, perm, weight_perm, pws: None, _reference_normed_perm),
])


def qmatmul_add_ss_into_(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight, up: Optional[torch.Tensor],
                         xp: torch.Tensor, order) -> Optional[torch.Tensor]:
    """qmatmul_add_ss_, the new residual also stored into xp [rows, order.cols] where `order` (ops.attention.OutOrder)
    puts its columns: xp = residual[..., perm] for the perm the order was made from.  None: nothing done."""
    return DISPATCH_ADD_SS_INTO(residual=residual, x=x, pw=pw, up=up, xp=xp, order=order)


def adds_ss_into(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight, up: Optional[torch.Tensor],
                 xp: torch.Tensor, order) -> bool:
    """Whether qmatmul_add_ss_into_ with these arguments would do it."""
    return DISPATCH_ADD_SS_INTO.choose(residual=residual, x=x, pw=pw, up=up, xp=xp, order=order).name != "none"


def folds_norm_perm(residual: torch.Tensor, weight: torch.Tensor, eps: float, xp: torch.Tensor, perm: torch.Tensor,
                    weight_perm: torch.Tensor, pws: Sequence[PackedWeight]) -> bool:
    """Whether qmatmul_many_normed_perm would take the norm into its kernels given a producer's sums and xp."""
    return DISPATCH_MANY_NORMED_PERM.choose(residual=residual, weight=weight, eps=eps, ss=FOLD_QUERY, xp=xp, perm=perm,
                                            weight_perm=weight_perm, pws=list(pws)).name != "torch"


def qmatmul_many_normed_perm(residual: torch.Tensor, weight: torch.Tensor, eps: float, ss: Optional[torch.Tensor],
                             xp: torch.Tensor, perm: torch.Tensor, weight_perm: torch.Tensor,
                             pws: Sequence[PackedWeight]) -> list[torch.Tensor]:
    """[qmatmul(rms_norm(residual, weight, eps)[..., perm], pw) for pw in pws]: pws read x in their act-order (the
    weights without their permutation, model/linear.py _without_perm); xp = residual[..., perm] from the producer
    (qmatmul_add_ss_into_), ss its sums of squares, weight_perm = weight[perm] (the caller keeps it: a weight)."""
    return DISPATCH_MANY_NORMED_PERM(residual=residual, weight=weight, eps=eps, ss=ss, xp=xp, perm=perm,
                                     weight_perm=weight_perm, pws=list(pws))
