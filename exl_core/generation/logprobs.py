"""The model's log-probabilities of sampled tokens, and the checks on a step's row maxima, shared
by the sampler's fast greedy path and its general path (sampling.py). On CPU and CUDA both go through
`exl_core::greedy_pick` (csrc/cpu/greedy.cpp, csrc/cuda/greedy_cuda.cu: first argmax, float64 log-sum-exp, the
chosen token's logprob), so the two paths agree bit for bit (one deterministic lse); elsewhere through torch's
float32 passes."""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..errors import InputError, SamplerError


def lse_rows(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over rows, [B, V] -> [B, 1] (rows have a finite max). Written out because
    torch.logsumexp is several times slower than these plain passes on CPU."""
    m = x.amax(dim=1, keepdim=True)
    return m + (x - m).exp_().sum(dim=1, keepdim=True).log_()


def native_lse(lg: torch.Tensor) -> bool:
    """exl_core::greedy_pick serves these float32 [B, V] logits (contiguous; on CPU, or on a GPU where the extension
    has its CUDA kernel: csrc/cuda/greedy_cuda.cu)."""
    kind = lg.device.type
    if kind not in _GREEDY_OP or not lg.is_contiguous():
        return False
    if _GREEDY_OP[kind] is None:              # looked up once: has_op costs ~20 us a step here
        from ..ops.dispatch import has_cuda_kernel, has_op
        _GREEDY_OP[kind] = has_op("greedy_pick") if kind == "cpu" else (
            has_cuda_kernel("greedy_pick") and os.environ.get("EXL_CORE_GREEDY_CUDA", "1") != "0")   # 0: A/B
    return _GREEDY_OP[kind]


_GREEDY_OP: dict = {"cpu": None, "cuda": None}


def chosen_logprobs(lg: torch.Tensor, ids: torch.Tensor, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's log-softmax of the chosen tokens, float32 [B], from float32 logits [B, V]: on
    CPU and CUDA through greedy_pick's float64 log-sum-exp (both sampler paths, so they agree bit for bit),
    elsewhere through torch's float32 passes."""
    if lse is None and native_lse(lg):
        lse = torch.ops.exl_core.greedy_pick(lg)[1]
    if lse is not None:
        return (lg.gather(1, ids[:, None]).squeeze(1).double() - lse).float()
    return (lg.gather(1, ids[:, None]) - lse_rows(lg)).squeeze(1)


def check_row_max(m: torch.Tensor) -> None:
    """Row maxima [B] (NaN where a row holds a NaN) -> the errors sample_batch raises. One
    tolist, not a chain of tiny torch ops: right after a decode step each op runs with cold
    caches and costs ~20 us."""
    maxes = m.tolist()
    if any(math.isnan(v) or v == math.inf for v in maxes):
        raise InputError("logits contain NaN or +inf; the model output is corrupt")
    for b, v in enumerate(maxes):
        if v == -math.inf:
            raise SamplerError(f"row {b}: every token is banned or has logit -inf; nothing can be sampled "
                               "(check banned_tokens / logit_bias)")
