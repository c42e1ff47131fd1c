"""Rotary position embedding, HF Llama "rotate_half" convention (pairs (i, i + D/2)).

cos_sin (max_pos, D) float32 = cat(cos(freqs), sin(freqs)) with freqs = positions ⊗ inv_freq
(D/2 each); `cos_sin_table` builds it the way HF's LlamaRotaryEmbedding does.
Candidates: [cuda slot] → cpu (exl_core::rope) → torch_ref.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from .dispatch import Candidate, Dispatcher, has_op


def cos_sin_table(inv_freq: torch.Tensor, max_pos: int, attention_scaling: float = 1.0) -> torch.Tensor:
    """inv_freq float [D/2] -> float32 [max_pos, D] = cat(cos, sin) of positions ⊗ inv_freq
    (times `attention_scaling`, as HF does for yarn/longrope)."""
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device), inv_freq.float())
    return torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1).contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D); cos, sin (T, 1, D/2) fp32 -> x*cos + rotate_half(x)*sin in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, any device; fp32 math, results in q's / k's dtype."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions.long()].float()                       # (T, D)
    cos, sin = cs[:, None, :half], cs[:, None, half:]            # (T, 1, D/2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _cpu_check(q, k, positions, cos_sin) -> Optional[str]:
    if not has_op("rope"):
        return "C++ extension not built with exl_core::rope"
    if any(t.device.type != "cpu" for t in (q, k, positions, cos_sin)):
        return "tensors not on CPU, kernel is CPU-only"
    if q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype:
        return f"dtypes q={q.dtype}, k={k.dtype}; kernel needs both float32 or both bfloat16"
    if cos_sin.dtype != torch.float32:
        return f"cos_sin dtype {cos_sin.dtype}, kernel needs float32"
    return None


def _cpu_run(q, k, positions, cos_sin):
    return tuple(torch.ops.exl_core.rope(q.contiguous(), k.contiguous(), positions.to(torch.int64).contiguous(),
                                         cos_sin.contiguous()))


def _key(q, k, positions, cos_sin):
    # everything the checks read (this file's and cuda_candidates')
    return tuple((t.device, t.dtype) for t in (q, k, positions, cos_sin))


ROPE = Dispatcher("rope", [
    # slot: Candidate("cuda", ...) goes first once csrc/cuda has a rope kernel
    Candidate("cpu", _cpu_check, _cpu_run),
    Candidate("torch_ref", lambda **_: None, lambda q, k, positions, cos_sin: apply_rope_ref(q, k, positions, cos_sin)),
], key=_key)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, Hq, D), k (T, Hkv, D), positions int64 [T], cos_sin float32 [max_pos, D] -> new (q, k)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise InputError(f"apply_rope: q {tuple(q.shape)} must be (T, Hq, D) and k {tuple(k.shape)} (T, Hkv, D)")
    t, _, d = q.shape
    if d % 2:
        raise InputError(f"apply_rope: head dim {d} must be even")
    if positions.shape != (t,):
        raise InputError(f"apply_rope: positions {tuple(positions.shape)} must be int64 [T={t}]")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise InputError(f"apply_rope: cos_sin {tuple(cos_sin.shape)} must be float32 [max_pos, D={d}]")
    # On CUDA this host check would sync twice per layer; the CUDA kernel writes NaN rows for
    # out-of-table positions instead (csrc/cuda/pointwise_cuda.cu).
    if t and positions.device.type != "cuda" and (int(positions.min()) < 0 or
                                                  int(positions.max()) >= cos_sin.shape[0]):
        raise InputError(f"apply_rope: positions span {int(positions.min())}..{int(positions.max())} but the "
                         f"cos_sin table covers 0..{cos_sin.shape[0] - 1}; build a longer table")
    return ROPE(q=q, k=k, positions=positions, cos_sin=cos_sin)


def _register_fakes() -> None:
    if has_op("rope"):
        @torch.library.register_fake("exl_core::rope")
        def _(q, k, positions, cos_sin):
            return torch.empty_like(q), torch.empty_like(k)


_register_fakes()
