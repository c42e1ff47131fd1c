"""Input Hessians of linear layers: H = 2/n · Σ x xᵀ over calibration tokens.

GPTQ minimises ||X W - X Ŵ||² per output channel; its second derivative in the weights is
H = 2 XᵀX / n. We accumulate in float64 (the solver inverts H, and float32 sums over tens of
thousands of tokens lose the small eigenvalues that decide the error compensation).
"""
from __future__ import annotations

import torch

from ..errors import InputError


class HessianAccumulator:
    """Running H for one layer input of width `in_features` (shared by layers reading the same x)."""

    def __init__(self, in_features: int, name: str = "layer"):
        self.in_features = in_features
        self.name = name
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor, chunk: int = 4096) -> None:
        """x: (..., in_features) activations; any leading shape is flattened into tokens."""
        if x.shape[-1] != self.in_features:
            raise InputError(f"{self.name}: Hessian expects inputs of width {self.in_features}, "
                             f"got {tuple(x.shape)}")
        x = x.reshape(-1, self.in_features)
        # float32 products per chunk (4x faster than float64 on CPU), float64 across chunks:
        # each chunk's sum has at most `chunk` terms, so the float32 rounding stays ~1e-7 relative.
        for a in range(0, x.shape[0], chunk):
            xc = x[a:a + chunk].float()
            self.xtx += (xc.T @ xc).double()
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """(in_features, in_features) float64, 2/n · XᵀX."""
        if self.count == 0:
            raise InputError(f"{self.name}: no calibration tokens reached this layer")
        return self.xtx * (2.0 / self.count)


def output_sq_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """Mean squared output error per token, (1/n) Σ_t ||x_t (W-Ŵ)ᵀ||² = tr(Δ H Δᵀ)/2.

    w, w_hat: (out, in) weights; h: (in, in) Hessian 2/n · XᵀX, so no activations are needed.
    """
    d = (w.double() - w_hat.double())
    return torch.einsum("ni,ij,nj->", d, h, d).item() / 2.0


def output_error(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """Relative output error on the calibration inputs: ||X(W-Ŵ)ᵀ||² / ||X Wᵀ||²."""
    return output_sq_error(w, w_hat, h) / max(output_sq_error(w, torch.zeros_like(w), h), 1e-30)
