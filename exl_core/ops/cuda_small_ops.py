"""CUDA candidates of the small ops' dispatchers -- RMSNorm (ops/norm.py), SwiGLU's product (ops/activation.py),
rope (ops/rope.py), dense layers through cuBLAS (ops/linear.py), paged attention (ops/attention.py) -- kernels in
exl_core/csrc/cuda/pointwise_cuda.cu and paged_attention_cuda.cu; installed by cuda_candidates.install().  Every
check refuses off the GPU or without the CUDA kernel, so CPU behaviour is unchanged.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .cuda_candidates import _FLOATS, _has_cuda_kernel, install_candidate

NORM_EARLY_W_ON = os.environ.get("EXL_CORE_NORM_EARLY_W", "1") != "0"   # 0: a model's norm weight read after the wait


def _same_cuda(op: str, *ts) -> Optional[str]:
    if any(t.device.type != "cuda" for t in ts):
        return "tensors not on CUDA"
    if any(t.device != ts[0].device for t in ts):
        return "tensors on different GPUs"
    if not _has_cuda_kernel(op):
        return f"extension built without a CUDA {op} kernel"
    if ts[0].dtype not in _FLOATS or any(t.dtype != ts[0].dtype for t in ts):
        return f"dtypes {[t.dtype for t in ts]} must match and be float16/bfloat16/float32"
    return None


def _norm_check(x, weight, eps, residual, weight_static=False) -> Optional[str]:
    return _same_cuda("rms_norm", x, weight, *(() if residual is None else (residual,)))


def _norm_run(x, weight, eps, residual, weight_static=False):
    if weight_static and NORM_EARLY_W_ON and _has_cuda_kernel("rms_norm_static"):   # read before the PDL wait
        out = torch.ops.exl_core.rms_norm_static(x, residual, weight, float(eps))
        return out[0] if residual is None else (out[0], out[1])
    if residual is None:
        return torch.ops.exl_core.rms_norm(x, weight, float(eps))
    return tuple(torch.ops.exl_core.rms_norm_residual(x, residual, weight, float(eps)))


def _silu_check(gate, up) -> Optional[str]:
    return _same_cuda("silu_mul", gate, up)


def _rope_check(q, k, positions, cos_sin) -> Optional[str]:
    why = _same_cuda("rope", q, k)
    if why:
        return why
    if positions.device != q.device or cos_sin.device != q.device:
        return "positions / cos_sin not on q's device"
    if cos_sin.dtype != torch.float32:
        return f"cos_sin dtype {cos_sin.dtype}, kernel needs float32"
    return None


def _rope_run(q, k, positions, cos_sin):
    return tuple(torch.ops.exl_core.rope(q, k, positions, cos_sin))


def _dense_check(x, w_t, bias) -> Optional[str]:
    if x.device.type != "cuda" or w_t.device != x.device:
        return "x / w_t not both on one CUDA device"
    if x.dtype not in (torch.float16, torch.bfloat16) or w_t.dtype != x.dtype:
        return f"dtypes x={x.dtype}, w_t={w_t.dtype}; cuBLAS path wants both float16 or both bfloat16"
    return None


def _dense_run(x, w_t, bias):
    # cuBLAS in the weights' dtype (fp32 accumulation); the reference would upcast the whole
    # head to fp32 on every call.
    x2 = x.reshape(-1, w_t.shape[0])
    y = torch.addmm(bias.to(x.dtype), x2, w_t) if bias is not None else x2 @ w_t
    return y.reshape(*x.shape[:-1], w_t.shape[1])


# Paged attention straight over the cache pages (paged_attention_cuda.cu) for decode and speculative
# verification rows (up to attention.PAGED_MAX_Q_ROWS per sequence).

def _paged_check(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window,
                 max_q_len=None) -> Optional[str]:
    from .attention import PAGED_MAX_Q_ROWS, paged_layout_problem
    if not _has_cuda_kernel("paged_attention"):
        return "extension built without the CUDA paged_attention kernel"
    dev = q.device
    if dev.type != "cuda" or any(t.device != dev for t in (k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)):
        return "tensors not all on one CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype:
        return f"dtypes q={q.dtype}, cache={k_cache.dtype}; kernel takes one of float16/bfloat16 for both"
    if q.shape[-1] not in (64, 128, 256) or q.shape[1] // k_cache.shape[2] > 8:
        return f"head dim {q.shape[-1]} / {q.shape[1] // k_cache.shape[2]} heads per kv head; kernel takes " \
               f"64/128/256 and at most 8"
    if max_q_len is None or max_q_len > PAGED_MAX_Q_ROWS:
        return f"max_q_len {max_q_len}: the kernel serves up to {PAGED_MAX_Q_ROWS} query rows per sequence"
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return "k_cache / v_cache not 16-byte aligned"
    if block_table.shape[1] * k_cache.shape[1] >= 1 << 30:
        return "table width x page size >= 2^30 keys (the kernel counts keys in 32 bits)"
    return paged_layout_problem(k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)


def _paged_run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, window, max_q_len=None):
    return torch.ops.exl_core.paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
                                              float(scale), int(window or 0))


def install() -> None:
    """Put a `cuda` candidate at the front of each small op's dispatcher (idempotent)."""
    from . import activation, attention, linear, norm, rope
    install_candidate(attention.PAGED_ATTENTION, _paged_check, _paged_run)
    install_candidate(linear.DISPATCH, _dense_check, _dense_run)
    install_candidate(norm.RMS_NORM, _norm_check, _norm_run)
    install_candidate(activation.SILU_MUL, _silu_check, lambda gate, up: torch.ops.exl_core.silu_mul(gate, up))
    install_candidate(rope.ROPE, _rope_check, _rope_run)
