"""How many cache pages fit: from a user cap or from the device's free memory."""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

# Share of the free memory the cache may take; the rest stays for activations, other
# processes and (on CPU) the OS page cache.
CPU_FRACTION = 0.25
GPU_FRACTION = 0.80
ACTIVATION_RESERVE = 512 << 20       # bytes kept aside for the forward pass' activations
DEFAULT_CAP_SEQS = 4                 # without a user cap: at most 4 full-length sequences


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one position in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def known_free_memory(device: torch.device) -> Optional[int]:
    """Free bytes on `device`: cudaMemGetInfo on GPU, MemAvailable from /proc/meminfo (else the OS's count of
    available pages) on CPU; None where neither can be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def free_memory(device: torch.device) -> int:
    """known_free_memory, or a modest 4 GiB where the OS does not say."""
    free = known_free_memory(device)
    return free if free is not None else 4 << 30


def num_pages_for(per_token: int, page_size: int, device: torch.device, max_tokens: Optional[int],
                  max_seq_len: int) -> int:
    """Pages for `max_tokens` positions (rounded up), or what a fraction of free memory holds,
    capped at DEFAULT_CAP_SEQS sequences of `max_seq_len` so a small model does not claim the
    whole machine."""
    if max_tokens is not None:
        return max(1, -(-int(max_tokens) // page_size))
    frac = GPU_FRACTION if device.type == "cuda" else CPU_FRACTION
    free = free_memory(device)
    budget = max(0, int(free * frac) - ACTIVATION_RESERVE)
    by_memory = budget // (per_token * page_size)
    cap = -(-(DEFAULT_CAP_SEQS * max(max_seq_len, 8192)) // page_size)
    pages = max(1, min(by_memory, cap))
    if pages * page_size < min(max_seq_len, 2048):     # a cache this small fails or shortens most jobs: say why
        warnings.warn(f"Cache sized from free memory holds only {pages * page_size} tokens ({free} "
                      f"bytes free on {device}, {per_token} bytes a token, {ACTIVATION_RESERVE} kept for "
                      "activations); pass Cache(max_tokens=...) to choose its size", RuntimeWarning, stacklevel=3)
    return pages
