"""The permuted norm's shared-memory gather, its bank conflicts, and what a row order chosen inside quantization
groups could take off (CPU only, a design study for exl_core/csrc/cuda/pointwise_cuda.cu rms_norm_vec_kernel PERM).

The kernel's gather: thread t of warp w reads, at step (i, e), the fp16 value at index perm[p] of the row staged in
shared memory, p = 8 v + e, v = 32 w + t + 256 i (the `block` mapping). The 32 reads of a step ("a class") cost as
many shared-memory wavefronts as the largest number of distinct 4-byte words any one bank holds among them. Reordering
rows inside a quantization group (the weight's rows and perm's entries alike) changes no product, only which index
sits where. The `spread` mapping would give lane l of a step the vector v = l C + c (C = ceil(vectors / 32)), so a
class spans the whole row instead of 256 entries: the bank supply over the whole row is balanced for a permutation
(each bank holds H / 32 entries), within 256 entries it is not. Prints the mean wavefronts per class for a random
act-order permutation (the bench's EXL2 checkpoint draws one per input group) as stored and as a greedy reorder inside
128-row groups leaves it, for both mappings, and the reorder's time.

    python bench/gather_bank_order.py [--hidden 4096] [--extra 256] [--group 128]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

ELEM_BYTES, VEC = 2, 8        # fp16 values; 8 values (16 bytes) a thread's vector


def classes(rows: int, mapping: str) -> np.ndarray:
    """The class (one warp-wide read step) of each position of a row of `rows` entries."""
    p = np.arange(rows)
    v, e = p // VEC, p % VEC
    if mapping == "block":
        return (v // 32) * VEC + e
    cols = -(-(rows // VEC) // 32)
    return (v % cols) * VEC + e


def wavefronts(idx: np.ndarray) -> int:
    words = np.unique(idx * ELEM_BYTES // 4)
    return int(np.bincount(words & 31, minlength=32).max())


def mean_wavefronts(perm: np.ndarray, mapping: str) -> float:
    k = classes(len(perm), mapping)
    return float(np.mean([wavefronts(perm[k == c]) for c in np.unique(k)]))


def greedy_order(perm: np.ndarray, group: int, mapping: str) -> np.ndarray:
    """sigma (positions -> old positions), each group's rows kept inside it: position by position, the entry of the
    group's remaining ones whose bank its class has used least (a word the class holds already costs nothing)."""
    k, sigma, used = classes(len(perm), mapping), np.arange(len(perm)), {}
    for g0 in range(0, len(perm), group):
        pool = [dict() for _ in range(32)]                 # bank -> word -> old positions
        for q in range(g0, min(g0 + group, len(perm))):
            w = int(perm[q]) * ELEM_BYTES // 4
            pool[w & 31].setdefault(w, []).append(q)
        for p in range(g0, min(g0 + group, len(perm))):
            seen = used.setdefault(int(k[p]), {})
            best = None
            for b in range(32):
                if not pool[b]:
                    continue
                shared = [w for w in pool[b] if w in seen.get(b, ())]
                score = (0, 0) if shared else (len(seen.get(b, ())), -sum(map(len, pool[b].values())))
                if best is None or score < best[0]:
                    best = (score, b, shared[0] if shared else max(pool[b], key=lambda w: len(pool[b][w])))
            _, b, w = best
            sigma[p] = pool[b][w].pop()
            if not pool[b][w]:
                del pool[b][w]
            seen.setdefault(b, set()).add(w)
    return sigma


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--extra", type=int, default=256, help="repeated columns after H (the uniform-4 rewrite's rows)")
    ap.add_argument("--group", type=int, default=128)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    base = rng.permutation(a.hidden)
    for extra in sorted({0, a.extra}):
        perm = np.concatenate([base, rng.integers(0, a.hidden, extra)]) if extra else base
        for mapping in ("block", "spread"):
            t0 = time.perf_counter()
            sigma = greedy_order(perm, a.group, mapping)
            dt = time.perf_counter() - t0
            for g0 in range(0, len(perm), a.group):          # every row stays in its group
                assert sorted(sigma[g0:g0 + a.group]) == list(range(g0, min(g0 + a.group, len(perm))))
            print(f"P = H + {extra:<4d} {mapping:6s}: wavefronts a class {mean_wavefronts(perm, mapping):.3f} as stored, "
                  f"{mean_wavefronts(perm[sigma], mapping):.3f} reordered ({dt:.3f} s)")


if __name__ == "__main__":
    main()
