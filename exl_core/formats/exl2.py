"""EXL2 (ExLlamaV2) layer tensors: reader, writer, float64 reference and RTN quantiser.

Layout written by ExLlamaV2's converter (facts and sources in docs/formats.md). For a linear
layer with K = in_features, N = out_features, Np = N padded to a multiple of 32 (only when
N % 32 != 0; the padding columns hold q = 2^(bits-1), i.e. zero weight):

    q_weight     int32 [R, Np]   per group, the group's k_len values of each column as one
                                 LSB-first bit stream (no interleaving in the file; ExLlamaV2
                                 shuffles in memory at load time)
    q_invperm    int32 [K]       argsort(q_perm); row i of W_perm is row q_perm[i] of W
    q_scale      int32 [G, Np/8] 4-bit codes c in [0, 16), 8 per word, column 8w+t at bits 4t
    q_scale_max  fp16  [G]
    q_groups     int16 [2G]      (bits, first q_weight row) per group, read as uint16
    bias         fp16  [N]       optional

    group g rows  = (qrow[g+1] - qrow[g]) * 32 / bits[g]   (last group: K - rows before)
    scale[g, n]   = (c + 1)^2 * q_scale_max[g] / 256
    W_perm[i, n]  = (q[i, n] - 2^(bits[g]-1)) * scale[g, n]      (symmetric, no stored zero)

ExLlamaV2's loader requires the bit widths to be non-increasing along K (8, 6, 5, 4, 3, 2);
this reader accepts any order (the kernel layout has per-group widths), the writer emits only
non-increasing order so its files load in ExLlamaV2.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from ..errors import FormatError
from .base import check_tensor, gather, register_format
from .bitpack import fp16_ceil, pack_stream, stream_to_bits_reference, to_int32
from .packed import PackedWeight

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
REQUIRED = ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups")
OPTIONAL = ("q_perm", "bias")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int16, torch.int32, torch.int64)


def padded_columns(n: int) -> int:
    return n + (-n % 32)


# ---- reading ------------------------------------------------------------------------------

def parse_groups(tensors: Mapping[str, torch.Tensor], in_features: int, name: str = "layer"
                 ) -> list[tuple[int, int, int, int]]:
    """Validates q_groups against q_weight/q_scale_max; returns [(bits, k_start, k_len, qrow)]."""
    qg = tensors.get("q_groups")
    qsm = check_tensor(f"{name}.q_scale_max", tensors.get("q_scale_max"), _FLOATS, None)
    if qsm.dim() != 1 or qsm.numel() == 0:
        raise FormatError(f"{name}.q_scale_max: expected a 1-D tensor [groups], got {list(qsm.shape)}")
    n_groups = qsm.numel()
    check_tensor(f"{name}.q_groups", qg, (torch.int16, torch.int32), (2 * n_groups,))
    qw = tensors["q_weight"]
    pairs = (qg.to(torch.int64) & 0xFFFF).view(n_groups, 2).tolist()   # stored as uint16
    out, k = [], 0
    for g, (bits, qrow) in enumerate(pairs):
        if bits not in SUPPORTED_BITS:
            raise FormatError(f"{name}.q_groups: group {g} has unsupported bit width {bits} "
                              f"(EXL2 uses {SUPPORTED_BITS})")
        q_end = pairs[g + 1][1] if g + 1 < n_groups else qw.shape[0]
        if (g == 0 and qrow != 0) or q_end <= qrow:
            raise FormatError(f"{name}.q_groups: group {g} starts at q_weight row {qrow}, next starts at "
                              f"{q_end}; rows must start at 0 and increase")
        if g + 1 < n_groups:
            k_len, rem = divmod((q_end - qrow) * 32, bits)
            if rem:
                raise FormatError(f"{name}.q_groups: group {g} spans {q_end - qrow} q_weight rows, "
                                  f"not a whole number of {bits}-bit values")
        else:
            k_len = in_features - k
            if k_len <= 0 or -(-k_len * bits // 32) != q_end - qrow:
                raise FormatError(f"{name}.q_weight: last group ({bits}-bit from row {qrow}) needs "
                                  f"{max(k_len, 0)} values = {-(-max(k_len, 0) * bits // 32)} rows, "
                                  f"q_weight has {q_end - qrow}")
        if k_len % 32:
            raise FormatError(f"{name}.q_groups: group {g} has {k_len} rows; exl_core's kernel layout "
                              f"needs multiples of 32")
        out.append((bits, k, k_len, qrow))
        k += k_len
    if k != in_features:
        raise FormatError(f"{name}.q_groups: groups cover {k} input rows, layer has in_features={in_features}")
    return out


def validate(tensors: Mapping[str, torch.Tensor], in_features: int, out_features: int,
             name: str = "layer") -> tuple[list[tuple[int, int, int, int]], int]:
    """Checks every tensor's dtype/shape; returns (groups, stored column count Np)."""
    K, N = in_features, out_features
    qw = check_tensor(f"{name}.q_weight", tensors.get("q_weight"), torch.int32, None)
    if qw.dim() != 2 or qw.shape[1] not in (N, padded_columns(N)):
        exp = f"[rows, {N}]" + ("" if N % 32 == 0 else f" or [rows, {padded_columns(N)}]")
        raise FormatError(f"{name}.q_weight: expected int32 {exp}, got int32 {list(qw.shape)}")
    np_ = qw.shape[1]
    groups = parse_groups(tensors, K, name)
    G = len(groups)
    check_tensor(f"{name}.q_scale", tensors.get("q_scale"), torch.int32, (G, np_ // 8))
    inv = check_tensor(f"{name}.q_invperm", tensors.get("q_invperm"), _INTS, (K,))
    if not torch.equal(torch.sort(inv.to(torch.int64)).values, torch.arange(K)):
        raise FormatError(f"{name}.q_invperm: not a permutation of 0..{K - 1}")
    if "q_perm" in tensors:
        qp = check_tensor(f"{name}.q_perm", tensors["q_perm"], _INTS, (K,))
        if not torch.equal(qp.to(torch.int64), torch.argsort(inv.to(torch.int64))):
            raise FormatError(f"{name}.q_perm: is not argsort(q_invperm)")
    if "bias" in tensors:
        b = check_tensor(f"{name}.bias", tensors["bias"], _FLOATS, None)
        if b.dim() != 1 or b.shape[0] not in (N, np_):
            raise FormatError(f"{name}.bias: expected float [{N}], got {list(b.shape)}")
    return groups, np_


def decode_scale_codes(q_scale: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [G, Np/8] -> int64 [G, n] codes in [0, 16) (column 8w+t in bits 4t..4t+3)."""
    words = q_scale.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    codes = (words.unsqueeze(-1) >> shifts) & 0xF                # (G, Np/8, 8)
    return codes.reshape(words.shape[0], -1)[:, :n]


def read_layer(tensors: Mapping[str, torch.Tensor], in_features: int, out_features: int,
               name: str = "layer", quant_config: Optional[dict] = None) -> PackedWeight:
    """File tensors (suffix keys: q_weight, q_invperm, ...) -> kernel layout PackedWeight.

    The file's bit streams already are the kernel's, so q_weight is only cropped to N columns."""
    groups, np_ = validate(tensors, in_features, out_features, name)
    N = out_features
    qw = tensors["q_weight"][:, :N].contiguous()
    codes = decode_scale_codes(tensors["q_scale"], N).to(torch.float64)
    smax = tensors["q_scale_max"].to(torch.float64).view(-1, 1)
    # (c+1)^2 <= 256 and an fp16 max: the product is exact in float32.
    scale = ((codes + 1) ** 2 * smax / 256).to(torch.float32)
    bits = torch.tensor([g[0] for g in groups], dtype=torch.float32).view(-1, 1)
    zero = (2 ** (bits - 1)).expand(len(groups), N).contiguous()
    perm = torch.argsort(tensors["q_invperm"].to(torch.int64))
    if torch.equal(perm, torch.arange(in_features)):
        perm = None
    bias = tensors.get("bias")
    if bias is not None:
        bias = bias[:N].contiguous()
    meta = {"format": "exl2", "bpw": bits_per_weight(tensors, in_features, out_features),
            "bits": sorted({g[0] for g in groups}, reverse=True)}
    pw = PackedWeight(qw, torch.tensor(groups, dtype=torch.int32), scale, zero, perm,
                      in_features, N, bias, meta)
    return pw.validate(name)


def reference_parts(tensors: Mapping[str, torch.Tensor], dtype=torch.float64):
    """Straight from the file, following ExLlamaV2's group map (rows = qrows*32/bits, last
    group = the rest): (q int64 [K, Np], zero [K, 1], scale [K, Np], invperm int64 [K]),
    rows in the stored (permuted) order."""
    qw, qg = tensors["q_weight"], (tensors["q_groups"].to(torch.int64) & 0xFFFF).tolist()
    K = tensors["q_invperm"].shape[0]
    np_ = qw.shape[1]
    n_groups = len(qg) // 2
    word_of_col = torch.arange(np_) // 8
    shift_of_col = (torch.arange(np_) % 8) * 4
    qs = tensors["q_scale"].to(torch.int64) & 0xFFFFFFFF
    qs_max = tensors["q_scale_max"].to(dtype)
    q_parts, z_parts, s_parts, done = [], [], [], 0
    for g in range(n_groups):
        bits, q0 = qg[2 * g], qg[2 * g + 1]
        q1 = qg[2 * g + 3] if g + 1 < n_groups else qw.shape[0]
        rows = (q1 - q0) * 32 // bits if g + 1 < n_groups else K - done
        q_parts.append(stream_to_bits_reference(qw[q0:q1], bits, rows))
        code = (qs[g, word_of_col] >> shift_of_col) & 15                  # (Np,)
        s = (code.to(dtype) + 1) ** 2 * qs_max[g] / 256
        s_parts.append(s.expand(rows, np_))
        z_parts.append(torch.full((rows, 1), 2.0 ** (bits - 1), dtype=dtype))
        done += rows
    return (torch.cat(q_parts), torch.cat(z_parts), torch.cat(s_parts),
            tensors["q_invperm"].to(torch.int64))


def dequantize_reference(tensors: Mapping[str, torch.Tensor], dtype=torch.float64,
                         out_features: Optional[int] = None) -> torch.Tensor:
    """The specification kernels are checked against: W [K, N] in original row order."""
    q, zero, scale, invperm = reference_parts(tensors, dtype)
    w_perm = (q.to(dtype) - zero) * scale                           # (K, Np), permuted rows
    w = w_perm[invperm]                                             # W[k] = W_perm[invperm[k]]
    return w[:, :out_features] if out_features is not None else w


def bits_per_weight(tensors: Mapping[str, torch.Tensor], in_features: int, out_features: int) -> float:
    """Stored bits of all layer tensors (bias excluded) per weight, ExLlamaV2 style."""
    total = sum(tensors[k].numel() * tensors[k].element_size() * 8 for k in REQUIRED if k in tensors)
    return total / (in_features * out_features)


# ---- writing ------------------------------------------------------------------------------

def pack_layer(q: torch.Tensor, qscale: torch.Tensor, qscale_max: torch.Tensor,
               groups: Sequence[tuple[int, int]], perm: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Writes the exact ExLlamaV2 tensors (suffix keys) for one layer.

    q          int   [K, N]  quantized values, rows in PERMUTED order (row i = W[perm[i]])
    qscale     int   [G, N]  scale codes in 1..16 (scale = qscale^2 * qscale_max / 256)
    qscale_max float [G]     stored as fp16
    groups     [(bits, k_len)] per group along the permuted rows, widths non-increasing
    perm       int   [K]     act-order permutation (None = identity)
    """
    K, N = q.shape
    G = len(groups)
    if tuple(qscale.shape) != (G, N) or tuple(qscale_max.shape) != (G,):
        raise ValueError(f"pack_layer: qscale must be [{G}, {N}] and qscale_max [{G}], got "
                         f"{list(qscale.shape)} and {list(qscale_max.shape)}")
    if int(qscale.min()) < 1 or int(qscale.max()) > 16:
        raise ValueError("pack_layer: scale codes must lie in 1..16")
    widths = [b for b, _ in groups]
    if any(b not in SUPPORTED_BITS for b in widths) or widths != sorted(widths, reverse=True):
        raise ValueError(f"pack_layer: bit widths {widths} must be in {SUPPORTED_BITS} and non-increasing "
                         f"(ExLlamaV2's loader assumes 8, 6, 5, 4, 3, 2 order)")
    if sum(r for _, r in groups) != K or any(r <= 0 or r % 32 for _, r in groups):
        raise ValueError(f"pack_layer: group rows {[r for _, r in groups]} must be multiples of 32 summing to {K}")
    pad = -N % 32
    q = q.to(torch.int64)
    words, q_groups, k, qrow = [], [], 0, 0
    for bits, rows in groups:
        g_q = q[k:k + rows]
        if pad:   # padded columns decode to zero weight, as ExLlamaV2 writes them
            g_q = torch.cat([g_q, torch.full((rows, pad), 2 ** (bits - 1), dtype=torch.int64)], dim=1)
        words.append(pack_stream(g_q, bits))
        q_groups += [bits, qrow]
        k += rows
        qrow += rows * bits // 32
    codes = qscale.to(torch.int64) - 1                              # file stores code - 1
    if pad:
        codes = torch.cat([codes, torch.full((G, pad), 15, dtype=torch.int64)], dim=1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    q_scale = to_int32((codes.view(G, -1, 8) << shifts).sum(-1))
    perm = torch.arange(K) if perm is None else perm.to(torch.int64)
    out = {
        "q_weight": torch.cat(words).contiguous(),
        "q_invperm": torch.argsort(perm).to(torch.int32),
        "q_scale": q_scale,
        "q_scale_max": qscale_max.to(torch.float16),
        "q_groups": torch.tensor(q_groups, dtype=torch.int16),
    }
    if bias is not None:
        out["bias"] = bias.detach().to(torch.float16).contiguous()
    return out


def segments_from_proportions(rows: int, bits_prop: Iterable[tuple[int, float]],
                              group_size: Union[int, Mapping[int, int]] = 128) -> list[tuple[int, int]]:
    """[(bits, proportion)] -> [(bits, rows)] the way ExLlamaV2's QParams splits a matrix:
    each width takes ceil(min(rows*p, remaining)/group) whole groups, the last one clipped."""
    out, remaining = [], rows
    for bits, p in bits_prop:
        gsz = group_size[bits] if isinstance(group_size, Mapping) else group_size
        take = min(math.ceil(min(rows * p, remaining) / gsz) * gsz, remaining)
        if take > 0:
            out.append((bits, take))
        remaining -= take
    if remaining > 0:
        raise ValueError(f"bit proportions {list(bits_prop)} leave {remaining} of {rows} rows unassigned")
    return out


def quantize_rtn(W: torch.Tensor, bits: Union[int, Sequence[tuple[int, int]]] = 4,
                 group_size: Union[int, Mapping[int, int]] = 128, perm: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, clip_search: bool = False) -> dict[str, torch.Tensor]:
    """Round-to-nearest EXL2 quantisation of W [K, N] (K = in_features) -> layer tensors.

    bits: one width, or [(bits, rows)] segments along the permuted rows (widest first).
    Scales follow ExLlamaV2's scheme (4-bit code per column times an fp16 per-group max) but
    codes round UP, so every element satisfies |W - deq| <= scale/2 (no clipping).
    clip_search: like ExLlamaV2's find_params, also try the group max scaled by p in
    [0.70, 1.20] and keep the p with the least sum |W - deq|^3.5 (p = 1 is a candidate, so the
    objective never gets worse; the scale/2 bound then no longer holds for clipped values)."""
    W = W.detach().to(torch.float64)
    K, N = W.shape
    segments = [(bits, K)] if isinstance(bits, int) else [(int(b), int(r)) for b, r in bits]
    w_perm = W if perm is None else W[perm.to(torch.int64)]
    groups, q_rows, codes, maxes, k = [], [], [], [], 0
    for b, seg_rows in segments:
        gsz = group_size[b] if isinstance(group_size, Mapping) else group_size
        if gsz % 32 or gsz <= 0:
            raise ValueError(f"quantize_rtn: group size {gsz} must be a positive multiple of 32")
        end = k + seg_rows
        while k < end:
            rows = min(gsz, end - k)
            x = w_perm[k:k + rows]                                   # (rows, N)
            base = x.abs().amax(dim=0) / (2 ** (b - 1) - 0.5)      # smallest unclipped scale
            m = float(fp16_ceil(base.max()))
            code = torch.ceil(torch.sqrt(base / m) * 16).clamp(1, 16)
            if clip_search:
                m = _search_max(x, code, m, b)
            scale = code ** 2 * m / 256
            q = torch.clamp(torch.round(x / scale) + 2 ** (b - 1), 0, 2 ** b - 1)
            groups.append((b, rows))
            q_rows.append(q.to(torch.int64))
            codes.append(code.to(torch.int64))
            maxes.append(m)
            k += rows
    if k != K:
        raise ValueError(f"quantize_rtn: segments cover {k} rows, W has {K}")
    return pack_layer(torch.cat(q_rows), torch.stack(codes), torch.tensor(maxes, dtype=torch.float64),
                      groups, perm, bias)


CLIP_GRID = [round(0.70 + 0.02 * i, 2) for i in range(26)]         # 0.70 .. 1.20, includes 1.0


def _search_max(x: torch.Tensor, code: torch.Tensor, m: float, bits: int, norm: float = 3.5) -> float:
    """The fp16 group max (m*p, p in CLIP_GRID) minimising sum |x - deq|^norm over the group."""
    z, maxq = 2 ** (bits - 1), 2 ** bits - 1
    best, best_err = m, None
    for p in CLIP_GRID:
        mp = m if p == 1.0 else float(torch.tensor(m * p, dtype=torch.float16))
        scale = code ** 2 * mp / 256
        deq = (torch.clamp(torch.round(x / scale) + z, 0, maxq) - z) * scale
        err = float((x - deq).abs().pow(norm).sum())
        if best_err is None or err < best_err:
            best, best_err = mp, err
    return best


# ---- plug-in -------------------------------------------------------------------------------

class Exl2Format:
    name = "exl2"
    tensor_suffixes = REQUIRED + OPTIONAL

    def detect(self, quant_config: Optional[dict], tensor_names: set[str]) -> bool:
        if quant_config and quant_config.get("quant_method") is not None:
            return str(quant_config["quant_method"]).lower() == self.name
        return any(n.endswith(".q_weight") or n.endswith(".q_groups") for n in tensor_names)

    def has_layer(self, tensor_names: set[str], prefix: str) -> bool:
        return f"{prefix}.q_weight" in tensor_names

    def load_layer(self, read, shape, prefix: str, in_features: int, out_features: int,
                   quant_config: Optional[dict]) -> PackedWeight:
        tensors = gather(read, shape, prefix, REQUIRED, OPTIONAL)
        return read_layer(tensors, in_features, out_features, prefix, quant_config)


register_format(Exl2Format())
