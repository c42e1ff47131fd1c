"""Vectorised little-endian bit streams, shared by the EXL2 and GPTQ readers/writers.

Both formats (and the kernel layout in `formats.packed`) store values of one bit width as a
continuous LSB-first bit stream along one axis: value i occupies stream bits
[i*bits, (i+1)*bits), word j holds stream bits [32j, 32j+32). 3/5/6-bit values may straddle
two words. These helpers work on whole [k, N] tensors at once (one Python step per value
position inside a 32-value chunk, never per row), so a 1536x1536 matrix packs in milliseconds.

`stream_to_bits_reference` is a deliberately different algorithm (explode every word into its
32 bits, then regroup) used by the file-level float64 references, so that a bug in
`pack_stream`/`unpack_stream` cannot hide behind the same bug in the reference.
"""
from __future__ import annotations

import functools

import torch

_MASK32 = 0xFFFFFFFF


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor holding unsigned 32-bit words -> int32 with the same bit pattern."""
    words = words & _MASK32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _positions(bits: int):
    """For the 32 values of a chunk: word index, bit offset, and whether a value spills into
    the next word (then its top bits sit at the bottom of word+1)."""
    pos = torch.arange(32, dtype=torch.int64) * bits
    word, off = pos // 32, pos % 32
    return word, off, (off + bits) > 32


@functools.lru_cache(maxsize=64)
def _device_positions(bits: int, device: torch.device):
    """_positions on `device`, the spilling values as an index (None when none spill), decided on the host; made once
    per (bits, device): the readers call this per group (callers must not modify the tensors)."""
    word, off, spill = _positions(bits)
    idx = spill.nonzero().squeeze(1).to(device) if bool(spill.any()) else None
    return word.to(device), off.to(device), idx


def pack_stream(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: integers [k, N] in [0, 2^bits) -> int32 [k*bits/32, N], packed along dim 0, on q's device.

    k*bits must be a multiple of 32 (every stored word complete)."""
    k, n = q.shape
    if (k * bits) % 32:
        raise ValueError(f"pack_stream: {k} values of {bits} bits do not fill whole 32-bit words")
    q = q.to(torch.int64).contiguous()
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"pack_stream: values outside [0, {(1 << bits) - 1}] for {bits}-bit packing")
    pad = -k % 32
    if pad:
        q = torch.cat([q, q.new_zeros(pad, n)])
    chunks = q.shape[0] // 32
    q = q.view(chunks, 32, n)                                  # (chunk, value, column)
    word, off, idx = _device_positions(bits, q.device)
    # Fields never overlap, so summing the shifted values equals OR-ing them.
    words = torch.zeros(chunks, bits, n, dtype=torch.int64, device=q.device)   # a 32-value chunk fills `bits` words
    words.index_add_(1, word, (q << off.view(1, 32, 1)) & _MASK32)
    if idx is not None:
        words.index_add_(1, word[idx] + 1, q[:, idx] >> (32 - off[idx]).view(1, -1, 1))
    return to_int32(words.view(chunks * bits, n)[: k * bits // 32])


def unpack_stream(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_stream: int32 [>= ceil(k*bits/32), N] -> int64 [k, N] (first k values), on packed's device."""
    n = packed.shape[1]
    need = -(-k * bits // 32)
    p = packed[:need].to(torch.int64).contiguous() & _MASK32
    chunks = -(-k // 32)
    full = chunks * bits
    if p.shape[0] < full:
        p = torch.cat([p, p.new_zeros(full - p.shape[0], n)])
    p = p.view(chunks, bits, n)
    word, off, idx = _device_positions(bits, p.device)
    v = p[:, word] >> off.view(1, 32, 1)                       # (chunk, value, column)
    if idx is not None:
        v[:, idx] |= p[:, word[idx] + 1] << (32 - off[idx]).view(1, -1, 1)
    return (v & ((1 << bits) - 1)).reshape(chunks * 32, n)[:k]


def stream_to_bits_reference(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Slow-but-obvious decoder: int32 [r, N] -> int64 [k, N] by exploding all 32r stream bits.

    Used only by the float64 reference dequantisers (independent of unpack_stream)."""
    r, n = packed.shape
    p = packed.to(torch.int64).contiguous() & _MASK32
    shifts = torch.arange(32, dtype=torch.int64).view(1, 32, 1)
    stream = ((p.view(r, 1, n) >> shifts) & 1).reshape(r * 32, n)      # stream bit b = row b
    if stream.shape[0] < k * bits:
        raise ValueError(f"stream of {r} words holds fewer than {k} values of {bits} bits")
    vals = stream[: k * bits].view(k, bits, n)
    weights = (1 << torch.arange(bits, dtype=torch.int64)).view(1, bits, 1)
    return (vals * weights).sum(dim=1)


def fp16_ceil(x: torch.Tensor, floor: float = 2.0 ** -14) -> torch.Tensor:
    """Elementwise smallest fp16 >= max(x, floor) for positive x, returned as float64.

    Quantisers store scales in fp16; rounding a scale down would clip the largest weight, so
    they round up instead (floor keeps the value a normal fp16)."""
    x = x.to(torch.float64).clamp_min(floor)
    h = x.to(torch.float16)
    low = h.to(torch.float64) < x
    h = torch.where(low, (h.view(torch.int16) + 1).view(torch.float16), h)   # next fp16 up
    return h.to(torch.float64)
