"""The RMSNorm between two projections folded into them (decode on CUDA: csrc/cuda/norm_fold_device.cuh).

In a decode step the residual stream goes o_proj -> add -> RMSNorm -> gate/up and down_proj -> add -> RMSNorm ->
q/k/v. Two ops let the projections do the add and the norm themselves, so no norm kernel runs between them:

  qmatmul_add_ss_(residual, x, pw, up=None, ext=None) -> Optional[Tensor]
      residual += qmatmul(x, pw) in place (with `up`: qmatmul(silu_mul(x, up), pw)), returning the sums of squares
      of the new residual per 32-column tile and row, float32 [ceil(N / 32), rows] -- or None when no kernel takes
      the call: then nothing is done and the caller adds its own way.  ext = (copy [rows, P], places int32 [N, 2]):
      the new residual also stored at its places in the next projections' extended act-order, copy[:, places[n, i]]
      = residual[:, n] where places[n, i] >= 0 (ext_places) -- the extended copy.
  qmatmul_many_normed(residual, weight, eps, ss, pws, count=None) -> list[Tensor]
      qmatmul_many(rms_norm(residual, weight, eps), pws). With `ss` from qmatmul_add_ss_, the CUDA kernels normalise x
      while they stage it (the same roundings as the norm kernel, r from the partial sums in a fixed order); the
      reference runs the norm, then qmatmul_many (any device; `ss` unused).  count: `residual` is an extended copy
      (P columns, the weight gathered to it, pws the Prepermuted views) of a residual of `count` columns, whose r
      comes from `ss` alone (the copy repeats columns).

Why the extended copy: weights with an act-order permutation shared by q/k/v (gate/up), and with extra rows
(formats/uniform4.py), read x in that order; without the copy a norm launch gathers it (ops/norm_perm.py), with it
the producer's epilogue scatters each value it stores once more and the consumer folds the norm as GPTQ's do --
no norm launch (EXL2 batch 1 on the H200 spends 3.52 + 3.20 us a layer in its two permuted norms, stop 36's
timeline).  On CUDA behind EXL_CORE_NORM_FOLD_EXT=1 (off until measured).

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
# The extended copy (module docstring) for weights with a shared act-order, on CUDA: off until measured on a GPU.
NORM_FOLD_EXT = os.environ.get("EXL_CORE_NORM_FOLD_EXT", "0") == "1"


def _normed_from_ss(x: torch.Tensor, weight: torch.Tensor, eps: float, ss: torch.Tensor, count: int) -> torch.Tensor:
    """weight * (x * r) with rms_norm's roundings, r = rsqrt(sum(ss[:, m]) / count + eps) per row m: the norm of an
    extended copy, whose own mean would count its repeated columns twice."""
    r = torch.rsqrt(ss.float().sum(0) / count + eps)[:, None]
    return (weight.float() * (x.float() * r).to(x.dtype).float()).to(x.dtype)


def _reference_normed(residual, weight, eps, ss, pws, count=None):
    from .qmatmul import qmatmul_many
    if count is not None:
        if ss is None or ss is FOLD_QUERY:
            raise ValueError("qmatmul_many_normed: an extended copy (count) needs the producer's sums of squares")
        return qmatmul_many(_normed_from_ss(residual, weight, eps, ss, count), list(pws))
    return qmatmul_many(rms_norm(residual, weight, eps), list(pws))


DISPATCH_ADD_SS = Dispatcher("qmatmul_add_ss_", [
    Candidate("none", lambda residual, x, pw, up, ext=None: None, lambda residual, x, pw, up, ext=None: None),
])
DISPATCH_MANY_NORMED = Dispatcher("qmatmul_many_normed", [
    Candidate("torch", lambda residual, weight, eps, ss, pws, count=None: None, _reference_normed),
])


def qmatmul_add_ss_(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight, up: Optional[torch.Tensor] = None,
                    ext: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Optional[torch.Tensor]:
    """residual += qmatmul(x, pw) (x = silu_mul(x, up) with up) and the new residual's sums of squares, or None
    (nothing done) where no kernel takes it; ext: (copy, places), the extended copy written too."""
    return DISPATCH_ADD_SS(residual=residual, x=x, pw=pw, up=up, ext=ext)


def adds_ss(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight) -> bool:
    """Whether qmatmul_add_ss_(residual, x, pw) would do it (x: any tensor of its device, dtype and shape)."""
    return DISPATCH_ADD_SS.choose(residual=residual, x=x, pw=pw, up=None).name != "none"


def folds_norm(residual: torch.Tensor, weight: torch.Tensor, eps: float, pws: Sequence[PackedWeight],
               count: Optional[int] = None) -> bool:
    """Whether qmatmul_many_normed would take the norm into its kernels given a producer's sums (so a producer
    knows whether its add pays: where the consumer cannot fold, the plain path keeps the add in the norm kernel)."""
    return DISPATCH_MANY_NORMED.choose(residual=residual, weight=weight, eps=eps, ss=FOLD_QUERY,
                                       pws=list(pws), count=count).name != "torch"


def qmatmul_many_normed(residual: torch.Tensor, weight: torch.Tensor, eps: float, ss: Optional[torch.Tensor],
                        pws: Sequence[PackedWeight], count: Optional[int] = None) -> list[torch.Tensor]:
    """[qmatmul(rms_norm(residual, weight, eps), pw) for pw in pws]; ss: qmatmul_add_ss_'s sums for residual.
    count: residual is an extended copy of a `count`-column residual (module docstring)."""
    return DISPATCH_MANY_NORMED(residual=residual, weight=weight, eps=eps, ss=ss, pws=list(pws), count=count)


def ext_places(perm: torch.Tensor, width: int) -> Optional[torch.Tensor]:
    """int32 [width, 2] on perm's device: the places j where perm[j] == n, for each column n (the second -1 where
    n has one), or None where a column appears no time or more than twice (the copy holds at most two places).
    The attention kernel's store map for the same order (ops.attention.out_order_for), in the layout the add's
    epilogue reads.  One host read of perm."""
    from .attention import out_order_for
    order = out_order_for(perm, width)
    if order is None:
        return None
    second = order.pos2 if order.pos2 is not None else torch.full_like(order.pos, -1)
    return torch.stack([order.pos, second], 1).contiguous()
