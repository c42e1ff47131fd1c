"""GPTQ → EXL2: a GPTQ folder served to the converter as dequantized float32 layers.

A GPTQ layer is repacked losslessly when EXL2 can hold exactly the same weights: symmetric
(zero = 2^(bits-1)), an EXL2 bit width, groups of multiples of 32 rows, and every group's
scales on EXL2's grid scale = c²·smax/256 (c in 1..16, smax fp16). Such layers keep their
values bit for bit (no calibration error, fixed cost in the allocation). Every other layer is
dequantized and re-quantized by the normal GPTQ pass (the usual case: GPTQ stores free fp16
scales, which rarely sit on the EXL2 grid).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..errors import FormatError
from ..formats import exl2 as exl2_fmt
from ..formats import gptq as gptq_fmt
from ..formats.bitpack import unpack_stream
from ..formats.packed import PackedWeight, dequantize_reference
from .calib_forward import LINEARS
from .source import DenseSource


class GptqSource(DenseSource):
    def __init__(self, folder, cfg=None):
        super().__init__(folder, cfg)
        self.qc = self.cfg.quantization_config or {}
        self._packed: dict[str, PackedWeight] = {}
        self._fixed_bits: dict[str, Optional[int]] = {}

    def _check_names(self):
        for i in range(self.cfg.num_hidden_layers):
            for n in LINEARS:
                p = f"model.layers.{i}.{n}"
                if not self.reader.has(f"{p}.qweight") and not self.reader.has(f"{p}.weight"):
                    raise FormatError(f"{self.folder}: GPTQ layer {p} has neither qweight nor weight")
        for n in ("model.embed_tokens.weight", "model.norm.weight"):
            if not self.reader.has(n):
                raise FormatError(f"{self.folder}: tensor '{n}' is missing")

    def _is_quant(self, name: str) -> bool:
        return self.reader.has(f"{name}.qweight")

    def shape_of_linear(self, name: str) -> tuple[int, int]:
        if not self._is_quant(name):
            return super().shape_of_linear(name)
        n = self.reader.shape(f"{name}.qweight")[1]
        if self.reader.has(f"{name}.g_idx"):
            k = self.reader.shape(f"{name}.g_idx")[0]
        else:
            bits = int(gptq_fmt.layer_config(self.qc, name).get("bits", 4))   # GPTQModel's per-module dynamic
            k = self.reader.shape(f"{name}.qweight")[0] * 32 // bits
        return n, k

    def packed(self, name: str) -> PackedWeight:
        if name not in self._packed:
            n, k = self.shape_of_linear(name)
            t = {s: self.reader.get(f"{name}.{s}") for s in gptq_fmt.REQUIRED + gptq_fmt.OPTIONAL
                 if self.reader.has(f"{name}.{s}")}
            self._packed[name] = gptq_fmt.read_layer(t, k, n, name, gptq_fmt.layer_config(self.qc, name))
        return self._packed[name]

    def linear_weight(self, name: str) -> torch.Tensor:
        if not self._is_quant(name):
            return super().linear_weight(name)
        return dequantize_reference(self.packed(name), torch.float64).T.to(torch.float32).contiguous()

    def tensor(self, name: str) -> torch.Tensor:
        if name.endswith(".weight") and not self.reader.has(name) and self._is_quant(name[:-7]):
            return self.linear_weight(name[:-7])
        return super().tensor(name)

    def has_tensor(self, name: str) -> bool:
        if name.endswith(".weight") and self._is_quant(name[:-7]):
            return True
        return super().has_tensor(name)

    def fixed_exl2(self, name: str) -> Optional[dict[str, torch.Tensor]]:
        """EXL2 tensors holding exactly this GPTQ layer's weights, or None when impossible."""
        if not self._is_quant(name):
            return None
        return lossless_exl2(self.packed(name))

    def fixed_exl2_bits(self, name: str) -> Optional[int]:
        """Stored bits of fixed_exl2(name) (its cost in the allocation), or None; kept, the tensors are not."""
        if name not in self._fixed_bits:
            t = self.fixed_exl2(name)
            self._fixed_bits[name] = None if t is None else \
                sum(t[k].numel() * t[k].element_size() * 8 for k in exl2_fmt.REQUIRED)
        return self._fixed_bits[name]


def lossless_exl2(pw: PackedWeight) -> Optional[dict[str, torch.Tensor]]:
    groups = pw.groups.tolist()
    bits = [g[0] for g in groups]
    if any(b not in exl2_fmt.SUPPORTED_BITS for b in bits) or bits != sorted(bits, reverse=True):
        return None
    half = torch.tensor([2.0 ** (b - 1) for b in bits]).view(-1, 1)
    if not torch.equal(pw.zero, half.expand_as(pw.zero)):
        return None                                              # asymmetric: EXL2 has no zero point
    # the group's largest scale has some code c_top ≤ 16: smax = max·256/c_top², try each
    top = pw.scale.amax(1).double()                              # (G,)
    if bool((top <= 0).any()):
        return None
    scale = pw.scale.double()
    smax = torch.full_like(top, float("nan"))
    codes = torch.zeros_like(scale)
    for c_top in range(16, 0, -1):
        cand = top * 256 / c_top ** 2
        ok_max = cand.half().double() == cand
        c = torch.round(16 * torch.sqrt(scale / cand[:, None]))
        ok = ok_max & (c >= 1).all(1) & (c <= 16).all(1) & ((c ** 2 * cand[:, None] / 256) == scale).all(1)
        take = ok & torch.isnan(smax)
        smax[take] = cand[take]
        codes[take] = c[take]
    if bool(torch.isnan(smax).any()):
        return None
    q = torch.cat([unpack_stream(pw.qweight[q0:q0 + ln * b // 32], b, ln) for b, _, ln, q0 in groups])
    return exl2_fmt.pack_layer(q, codes.to(torch.int64), smax.float(), [(b, ln) for b, _, ln, _ in groups], pw.perm,
                               pw.bias)
