"""The MLP's gate/up projections and SwiGLU's product in one op (batch decode on CUDA: csrc/cuda/qgemm_wide_kernel.cuh,
its PAIR instances).

  qmatmul_swiglu(x, gate, up, tails=None) -> Optional[Tensor]
      silu_mul(qmatmul(x, gate), qmatmul(x, up)) where one kernel call computes it with the same bits, else None
      (nothing done: the caller runs qmatmul_many and the product its own way, e.g. fused into the down projection's
      decode kernel at 1..8 rows).  tails (int32 [N / 32] on x's device, columns): the product [rows, columns]
      with 32-column chunk c also at columns tails[c] .. + 31 where tails[c] >= 0 (model/linear.py down_tails, from
      ops/xchunks.py tails_of).

The CUDA candidate is in ops/cuda_swiglu.py; EXL_CORE_WIDE_SWIGLU=0 turns it off (A/B runs).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from ..formats.packed import PackedWeight
from .dispatch import Candidate, Dispatcher

DISPATCH_SWIGLU = Dispatcher("qmatmul_swiglu", [
    Candidate("none", lambda x, gate, up, tails=None: None, lambda x, gate, up, tails=None: None),
])


def qmatmul_swiglu(x: torch.Tensor, gate: PackedWeight, up: PackedWeight,
                   tails: Optional[tuple] = None) -> Optional[torch.Tensor]:
    """silu_mul(qmatmul(x, gate), qmatmul(x, up)) in one kernel call, or None where no kernel takes it; with tails
    widened as the module docstring says."""
    for name, pw in (("gate", gate), ("up", up)):
        if x.dim() < 1 or x.shape[-1] != pw.in_features:
            raise InputError(f"qmatmul_swiglu: x has shape {tuple(x.shape)}, {name} has in_features "
                             f"{pw.in_features}")
    if gate.out_features != up.out_features:
        raise InputError(f"qmatmul_swiglu: gate has {gate.out_features} outputs, up {up.out_features}")
    return DISPATCH_SWIGLU(x=x, gate=gate, up=up, tails=tails)
