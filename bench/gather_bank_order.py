"""The permuted norm's shared-memory gather, its bank conflicts, and what a row order chosen inside quantization
groups takes off (CPU only; exl_core/formats/gather_order.py, the GPU kernel csrc/cuda/pointwise_cuda.cu
rms_norm_vec_kernel PERM).

A random act-order permutation of H entries in groups of --group rows (the bench's EXL2 checkpoint draws one per
input group), alone and with --wide of its groups given twins as the uniform-4 rewrite lays them out (an extra group
after the H rows reading the same columns in the same order, reordered with its main group): the mean wavefronts a
warp's gather step costs as stored and after gather_order.bank_order, under the kernel's `block` mapping and a
`spread` one, and the reorder's time.

    python bench/gather_bank_order.py [--hidden 4096] [--group 128] [--wide 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from exl_core.formats.gather_order import MAPPINGS, bank_order, mean_wavefronts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--wide", type=int, default=2, help="groups with a twin (5..8-bit groups of the file)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    base = rng.permutation(a.hidden)
    mains = [(g0, a.group) for g0 in range(0, a.hidden, a.group)]
    wide = sorted(rng.choice(len(mains), a.wide, replace=False).tolist())
    for n_wide in sorted({0, a.wide}):
        chosen = wide[:n_wide]
        perm = np.concatenate([base] + [base[mains[i][0]:mains[i][0] + a.group] for i in chosen])
        twins = {mains[i][0]: a.hidden + r * a.group for r, i in enumerate(chosen)}
        segs = mains + [(t, a.group) for t in twins.values()]
        for mapping in MAPPINGS:
            t0 = time.perf_counter()
            sigma = bank_order(perm, segs, twins, elem_bytes=2, mapping=mapping).numpy()
            dt = time.perf_counter() - t0
            print(f"P = H + {len(perm) - a.hidden:<4d} {mapping:6s}: wavefronts a step "
                  f"{mean_wavefronts(perm, 2, mapping):.3f} as stored, {mean_wavefronts(perm[sigma], 2, mapping):.3f} "
                  f"reordered ({dt:.3f} s)")


if __name__ == "__main__":
    main()
