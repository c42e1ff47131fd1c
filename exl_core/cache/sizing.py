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
    """Free bytes on `device`: cudaMemGetInfo plus torch's cached blocks on GPU, MemAvailable from /proc/meminfo
    (else the OS's count of available pages) on CPU; None where neither can be read."""
    if device.type == "cuda":     # with the blocks torch's allocator holds unused: our tensors can take them too
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    free = _mem_available()
    room = cgroup_headroom()     # a container's memory limit: the host's free memory is not this process's
    return room if free is None else free if room is None else min(free, room)


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


_NO_LIMIT = 1 << 60      # cgroup v1 writes ~2^63 for "no limit"


def cgroup_headroom(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """Bytes this process's memory cgroup may still grow by (limit - usage, the tightest of v2's memory.max and
    v1's memory.limit_in_bytes at the cgroup's own path and at the mount's root), None where no limit is set or
    nothing can be read."""
    try:
        lines = _read(self_cgroup).splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":                                       # v2: one unified hierarchy
            for base in (os.path.join(root, path), root):
                candidates.append((base, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):                    # v1
            for base in (os.path.join(root, "memory", path), os.path.join(root, "memory")):
                candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    best = None
    for base, limit_name, usage_name, cache_key in candidates:
        try:
            limit = _read(os.path.join(base, limit_name))
            usage = int(_read(os.path.join(base, usage_name)))
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= _NO_LIMIT:
            continue
        # usage counts the page cache (the model's mapped weight files among it), which the kernel reclaims before
        # the limit bites: what is inactive of it is room too (as kubelet reckons a container's working set)
        room = max(0, int(limit) - usage + _stat(os.path.join(base, "memory.stat"), cache_key))
        best = room if best is None else min(best, room)
    return best


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _stat(path: str, key: str) -> int:
    """One field of a cgroup's memory.stat, 0 where it cannot be read."""
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


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
