"""The permuted norm's shared-memory gather, its bank conflicts, and what a row order chosen inside quantization
groups takes off (CPU only; exl_core/formats/gather_order.py, the GPU kernel csrc/cuda/pointwise_cuda.cu
rms_norm_vec_kernel PERM).

For a random act-order permutation (the bench's EXL2 checkpoint draws one per input group) of H entries, and of H
plus repeated columns (the uniform-4 rewrite's extra rows), prints the mean wavefronts a warp's gather step costs as
stored and after gather_order.bank_order inside groups of --group rows, under the kernel's `block` mapping and a
`spread` one, and the reorder's time.

    python bench/gather_bank_order.py [--hidden 4096] [--extra 256] [--group 128]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from exl_core.formats.gather_order import MAPPINGS, bank_order, mean_wavefronts


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
        segs = [(g0, min(a.group, len(perm) - g0)) for g0 in range(0, len(perm), a.group)]
        for mapping in MAPPINGS:
            t0 = time.perf_counter()
            sigma = bank_order(perm, segs, elem_bytes=2, mapping=mapping).numpy()
            dt = time.perf_counter() - t0
            print(f"P = H + {extra:<4d} {mapping:6s}: wavefronts a step {mean_wavefronts(perm, 2, mapping):.3f} as "
                  f"stored, {mean_wavefronts(perm[sigma], 2, mapping):.3f} reordered ({dt:.3f} s)")


if __name__ == "__main__":
    main()
