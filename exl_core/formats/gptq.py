"""GPTQ (AutoGPTQ / GPTQModel / transformers) layer tensors: reader, writer, reference, RTN.

Layout (K = in_features, N = out_features, G groups; sources in docs/formats.md):

    qweight  int32 [K*bits/32, N]   each column's K values as one LSB-first bit stream along K
                                    (3-bit: 32 values in 3 words, values 10 and 21 straddle)
    qzeros   int32 [G, N*bits/32]   each row's N zero points as one bit stream along N
    scales   fp16  [G, N]
    g_idx    int32 [K]              group of each input row (i // group_size unless act-order)
    bias     fp16  [N]              optional

    W[k, n] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]
    z = stored + 1 for checkpoint_format "gptq" (v1, the default), z = stored for "gptq_v2".

Act-order checkpoints keep rows in the original order with a scattered g_idx; the reader
stable-sorts rows by g_idx into the kernel layout's `perm` and repacks the bit streams.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

import torch

from ..config import Reader
from ..errors import ConfigError, FormatError
from .base import check_tensor, gather, register_format
from .bitpack import fp16_ceil, pack_stream, stream_to_bits_reference, unpack_stream
from .packed import PackedWeight

SUPPORTED_BITS = (2, 3, 4, 8)
REQUIRED = ("qweight", "qzeros", "scales")
OPTIONAL = ("g_idx", "bias")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int16, torch.int32, torch.int64)


def checkpoint_is_v1(quant_config: Optional[dict], name: str = "quantization_config") -> bool:
    """True for v1 ("gptq", zeros stored minus one), False for "gptq_v2"; others refused."""
    qc = quant_config or {}
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise FormatError(f"{name}: GPTQ checkpoint_format '{fmt}' is not supported (use 'gptq' or 'gptq_v2')")
    return fmt == "gptq"


def layer_config(quant_config: Optional[dict], name: str) -> Optional[dict]:
    """The quantization settings of one layer: GPTQModel's `dynamic` maps regular expressions (matched at the start
    of the module name, the first that matches wins) to per-module overrides of bits / group_size / sym / desc_act
    ("+:" or no prefix); a "-:" rule leaves the module unquantized (it is stored dense, so no override is needed)."""
    dyn = (quant_config or {}).get("dynamic")
    if not dyn:
        return quant_config
    if not isinstance(dyn, dict):
        raise ConfigError(f"quantization_config.dynamic must be an object {{regex: settings}}, got {dyn!r}")
    for pattern, over in dyn.items():
        try:
            hit = re.match(str(pattern)[2:] if str(pattern)[:2] in ("+:", "-:") else str(pattern), name)
        except re.error as e:
            raise ConfigError(f"quantization_config.dynamic: {pattern!r} is not a regular expression ({e})") from e
        if hit:
            if str(pattern).startswith("-:") or not isinstance(over, dict):
                return quant_config
            return {**quant_config, **over}
    return quant_config


def quant_settings(quant_config: Optional[dict]) -> tuple[Optional[int], Optional[int]]:
    """(bits, group_size) of quantization_config, None where absent; a value of the wrong type, or a
    group_size that is neither > 0 nor -1 (one group over all rows), raises ConfigError."""
    r = Reader(quant_config or {}, "config.json (or quantize_config.json)", "quantization_config.")
    bits, gs = r.get("bits", int, None), r.get("group_size", int, None)
    if gs is not None and gs <= 0 and gs != -1:
        r.fail("group_size", f"must be > 0, or -1 for one group over all rows, got {gs}")
    return bits, gs


def _bits(tensors: Mapping[str, torch.Tensor], in_features: int, bits: Optional[int], name: str) -> int:
    qw = check_tensor(f"{name}.qweight", tensors.get("qweight"), torch.int32, None)
    if qw.dim() != 2:
        raise FormatError(f"{name}.qweight: expected a 2-D int32 tensor, got {list(qw.shape)}")
    if bits is None:   # infer from the shape: rows = K*bits/32
        bits, rem = divmod(qw.shape[0] * 32, in_features)
        if rem:
            bits = -1
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"{name}.qweight: unsupported GPTQ bit width {bits} (supported: {SUPPORTED_BITS})")
    return bits


def validate(tensors: Mapping[str, torch.Tensor], in_features: int, out_features: int,
             quant_config: Optional[dict] = None, name: str = "layer") -> tuple[int, torch.Tensor, int]:
    """Checks every tensor; returns (bits, g_idx int64 [K], groups G)."""
    K, N = in_features, out_features
    bits, gs = quant_settings(quant_config)
    bits = _bits(tensors, K, bits, name)
    if (K * bits) % 32 or (N * bits) % 32:
        raise FormatError(f"{name}: in_features={K} / out_features={N} do not fill whole 32-bit words "
                          f"at {bits} bits")
    check_tensor(f"{name}.qweight", tensors["qweight"], torch.int32, (K * bits // 32, N))
    sc = check_tensor(f"{name}.scales", tensors.get("scales"), _FLOATS, None)
    if sc.dim() != 2 or sc.shape[1] != N or sc.shape[0] < 1:
        raise FormatError(f"{name}.scales: expected float16 [groups, {N}], got {list(sc.shape)}")
    G = sc.shape[0]
    check_tensor(f"{name}.qzeros", tensors.get("qzeros"), torch.int32, (G, N * bits // 32))
    if "g_idx" in tensors and not _placeholder_g_idx(tensors["g_idx"], G):
        g_idx = check_tensor(f"{name}.g_idx", tensors["g_idx"], _INTS, (K,)).to(torch.int64)
        if K and (int(g_idx.min()) < 0 or int(g_idx.max()) >= G):
            raise FormatError(f"{name}.g_idx: values must lie in [0, {G}) (scales has {G} groups), got "
                              f"[{int(g_idx.min())}, {int(g_idx.max())}]")
    else:   # no g_idx: sequential groups of group_size (or K/G) rows
        qc = quant_config or {}
        if "g_idx" not in tensors and G > 1 and qc.get("desc_act") is True and not qc.get("static_groups"):
            # act-order: g_idx is the only record of which group each row uses; sequential groups would apply
            # every scale to the wrong rows
            raise FormatError(f"{name}.g_idx is missing: the quantization_config says desc_act (act-order), whose "
                              "layers need it")
        gs = K if gs in (None, -1) and G == 1 else gs if gs not in (None, -1) else -(-K // G)
        if -(-K // gs) != G:
            raise FormatError(f"{name}.scales: {G} groups do not match group_size={gs} for {K} rows")
        g_idx = torch.arange(K) // gs
    if "bias" in tensors:
        check_tensor(f"{name}.bias", tensors["bias"], _FLOATS, (N,))
    return bits, g_idx, G


def _placeholder_g_idx(g_idx: torch.Tensor, groups: int) -> bool:
    """Some exporters write an all-zero g_idx for multi-group layers; ExLlamaV2 (ext.py
    make_q_matrix) ignores such a g_idx and uses sequential groups, and so do we."""
    return groups > 1 and g_idx.numel() > 0 and not bool(g_idx.to(torch.int64).any())


def unpack_zeros(qzeros: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 [G, N*bits/32] -> int64 [G, N] stored values (the stream runs along N)."""
    return unpack_stream(qzeros.t(), bits, n).t()


def read_layer(tensors: Mapping[str, torch.Tensor], in_features: int, out_features: int,
               name: str = "layer", quant_config: Optional[dict] = None) -> PackedWeight:
    """File tensors (suffix keys: qweight, qzeros, scales, g_idx, bias) -> PackedWeight."""
    K, N = in_features, out_features
    bits, g_idx, G = validate(tensors, K, N, quant_config, name)
    v1 = checkpoint_is_v1(quant_config, name)
    zeros = unpack_zeros(tensors["qzeros"], bits, N).to(torch.float32) + (1 if v1 else 0)
    scales = tensors["scales"].to(torch.float32)
    perm = torch.sort(g_idx, stable=True).indices                  # act-order -> contiguous groups
    counts = torch.bincount(g_idx, minlength=G).tolist()
    groups, used, k = [], [], 0
    for g, c in enumerate(counts):
        if c == 0:
            continue   # a group no row refers to
        if c % 32:
            raise FormatError(f"{name}.g_idx: group {g} has {c} rows; exl_core's kernel layout needs "
                          f"multiples of 32")
        groups.append((bits, k, c, k * bits // 32))
        used.append(g)
        k += c
    if torch.equal(perm, torch.arange(K)):
        perm, qweight = None, tensors["qweight"].contiguous()
    else:
        q = unpack_stream(tensors["qweight"], bits, K)[perm]      # (K, N) rows in group order
        qweight = pack_stream(q, bits)
    used_t = torch.tensor(used, dtype=torch.int64)
    bias = tensors.get("bias")
    meta = {"format": "gptq", "bits": bits, "checkpoint_format": "gptq" if v1 else "gptq_v2",
            "bpw": bits + (16 + bits) * G / K}
    pw = PackedWeight(qweight, torch.tensor(groups, dtype=torch.int32), scales[used_t].contiguous(),
                      zeros[used_t].contiguous(), perm, K, N, bias, meta)
    return pw.validate(name)


def dequantize_reference(tensors: Mapping[str, torch.Tensor], quant_config: Optional[dict] = None,
                         dtype=torch.float64) -> torch.Tensor:
    """The specification: W [K, N] straight from the file tensors (bit-explosion decoding,
    per-row g_idx lookup; no permutation or repacking involved)."""
    qw, sc = tensors["qweight"], tensors["scales"]
    N = qw.shape[1]
    bits, gs = quant_settings(quant_config)
    if bits is None:
        if "g_idx" not in tensors:
            raise FormatError("dequantize_reference: needs quant_config['bits'] when g_idx is absent")
        bits = qw.shape[0] * 32 // tensors["g_idx"].shape[0]
    K = qw.shape[0] * 32 // bits
    v1 = checkpoint_is_v1(quant_config)
    q = stream_to_bits_reference(qw, bits, K)                                   # (K, N)
    z = stream_to_bits_reference(tensors["qzeros"].t().contiguous(), bits, N).t() + (1 if v1 else 0)
    if "g_idx" in tensors and not _placeholder_g_idx(tensors["g_idx"], sc.shape[0]):
        g_idx = tensors["g_idx"].to(torch.int64)
    else:
        G = sc.shape[0]
        g_idx = torch.arange(K) // (gs if gs not in (None, -1) else -(-K // G))
    return (q.to(dtype) - z[g_idx].to(dtype)) * sc.to(dtype)[g_idx]


# ---- writing ------------------------------------------------------------------------------

def pack_layer(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
               bits: int, checkpoint_format: str = "gptq", bias: Optional[torch.Tensor] = None
               ) -> dict[str, torch.Tensor]:
    """Writes GPTQ tensors (suffix keys) for one layer.

    q      int [K, N]  values in [0, 2^bits), rows in ORIGINAL order
    scales     [G, N]  stored as fp16
    zeros  int [G, N]  true zero points (v1 stores zero-1, so zero 0 is refused there: AutoGPTQ's
                       own packer would spill the -1 into neighbouring fields)
    g_idx  int [K]
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack_layer: unsupported GPTQ bit width {bits} (supported: {SUPPORTED_BITS})")
    K, N = q.shape
    if (K * bits) % 32 or (N * bits) % 32:
        raise ValueError(f"pack_layer: [{K}, {N}] at {bits} bits does not fill whole 32-bit words "
                         f"(GPTQ packs qweight along K and qzeros along N)")
    v1 = checkpoint_is_v1({"checkpoint_format": checkpoint_format})
    stored = zeros.to(torch.int64) - (1 if v1 else 0)
    if stored.numel() and (int(stored.min()) < 0 or int(stored.max()) >= 2 ** bits):
        raise ValueError(f"pack_layer: zero points do not fit {bits} bits in checkpoint_format "
                         f"'{checkpoint_format}' (v1 cannot store a zero point of 0)")
    out = {
        "qweight": pack_stream(q, bits),
        "qzeros": pack_stream(stored.t(), bits).t().contiguous(),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }
    if bias is not None:
        out["bias"] = bias.detach().to(torch.float16).contiguous()
    return out


def act_order_perm(W: torch.Tensor) -> torch.Tensor:
    """Without calibration data, order input rows by their weight energy (largest first);
    a stand-in for GPTQ's Hessian-diagonal order that still exercises the act-order layout."""
    return torch.argsort(W.to(torch.float64).pow(2).sum(dim=1), descending=True, stable=True)


def quantize_rtn(W: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                 act_order: bool = False, perm: Optional[torch.Tensor] = None,
                 checkpoint_format: str = "gptq", bias: Optional[torch.Tensor] = None,
                 clip_search: bool = False) -> dict[str, torch.Tensor]:
    """Round-to-nearest GPTQ quantisation of W [K, N] -> layer tensors.

    Scales are rounded UP to fp16 so every element satisfies |W - deq| <= scale/2 (unless
    clip_search, which trades clipped outliers for finer steps, see _rtn_groups).
    act_order: g_idx[perm[i]] = i // group_size with `perm` (default: act_order_perm(W))."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantize_rtn: unsupported GPTQ bit width {bits} (supported: {SUPPORTED_BITS})")
    W = W.detach().to(torch.float64)
    K, N = W.shape
    gs = K if group_size == -1 else group_size
    if act_order or perm is not None:
        perm = act_order_perm(W) if perm is None else perm.to(torch.int64)
        g_idx = torch.empty(K, dtype=torch.int64)
        g_idx[perm] = torch.arange(K) // gs
    else:
        g_idx = torch.arange(K) // gs
    G = -(-K // gs)
    v1 = checkpoint_is_v1({"checkpoint_format": checkpoint_format})
    order = torch.sort(g_idx, stable=True).indices                  # rows grouped: group g = block g
    ws = W[order]
    q_sorted, scales, zeros = [], [], []
    full = K // gs
    for lo, hi in ((0, full), (full, G)):                           # whole groups, then a short tail
        if hi > lo:
            blk = ws[lo * gs:min(hi * gs, K)].view(hi - lo, -1, N)     # (groups, rows, N)
            q, s, z = _rtn_groups(blk, bits, sym, v1, clip_search)
            q_sorted.append(q.reshape(-1, N))
            scales.append(s)
            zeros.append(z)
    q = torch.empty(K, N, dtype=torch.int64)
    q[order] = torch.cat(q_sorted)
    scales, zeros = torch.cat(scales), torch.cat(zeros)
    return pack_layer(q, scales, zeros, g_idx, bits, checkpoint_format, bias)


SHRINK_GRID = [round(1 - 0.02 * i, 2) for i in range(20)]          # 1.00 .. 0.62


def _rtn_groups(x: torch.Tensor, bits: int, sym: bool, v1: bool, clip_search: bool = False):
    """x (groups, rows, N) float64 -> q (groups, rows, N), scale (groups, N), zero (groups, N).

    clip_search: like AutoGPTQ's `mse` option, shrink each column's range by p in SHRINK_GRID
    and keep the p with the least sum |x - deq|^2.4 (p = 1 is a candidate)."""
    if not clip_search:
        return _rtn_params(x, bits, sym, v1, 1.0)
    best, best_err = None, None
    for p in SHRINK_GRID:
        q, s, z = cand = _rtn_params(x, bits, sym, v1, p)
        err = ((q - z.unsqueeze(1)) * s.unsqueeze(1) - x).abs().pow(2.4).sum(dim=1)   # (groups, N)
        if best is None:
            best, best_err = cand, err
            continue
        better = err < best_err
        best = (torch.where(better.unsqueeze(1), q, best[0]), torch.where(better, s, best[1]),
                torch.where(better, z, best[2]))
        best_err = torch.where(better, err, best_err)
    return best


def _rtn_params(x: torch.Tensor, bits: int, sym: bool, v1: bool, p: float):
    maxq = 2 ** bits - 1
    if sym:
        s = fp16_ceil(2 * x.abs().amax(dim=1) * p / maxq)
        z = torch.full_like(s, 2 ** (bits - 1), dtype=torch.int64)
    else:
        xmin = x.amin(dim=1).clamp(max=0) * p
        xmax = x.amax(dim=1).clamp(min=0) * p
        s = fp16_ceil((xmax - xmin) / maxq)
        z = torch.round(-xmin / s).to(torch.int64)
        if v1:   # zero 0 is not storable in v1: widen the scale so zero 1 still covers [0, xmax]
            bad = z == 0
            s = torch.where(bad, fp16_ceil(xmax / (maxq - 1)), s)
            z = torch.where(bad, torch.ones_like(z), z)
    q = torch.clamp(torch.round(x / s.unsqueeze(1)) + z.unsqueeze(1), 0, maxq).to(torch.int64)
    return q, s, z


# ---- plug-in -------------------------------------------------------------------------------

class GptqFormat:
    name = "gptq"
    tensor_suffixes = REQUIRED + OPTIONAL

    def detect(self, quant_config: Optional[dict], tensor_names: set[str]) -> bool:
        if quant_config and quant_config.get("quant_method") is not None:
            return str(quant_config["quant_method"]).lower() == self.name
        return any(n.endswith(".qweight") or n.endswith(".qzeros") for n in tensor_names)

    def has_layer(self, tensor_names: set[str], prefix: str) -> bool:
        return f"{prefix}.qweight" in tensor_names

    def load_layer(self, read, shape, prefix: str, in_features: int, out_features: int,
                   quant_config: Optional[dict]) -> PackedWeight:
        tensors = gather(read, shape, prefix, REQUIRED, OPTIONAL)
        return read_layer(tensors, in_features, out_features, prefix, layer_config(quant_config, prefix))


register_format(GptqFormat())
