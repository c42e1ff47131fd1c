"""Probe one qmatmul kernel on a random 4096x4096 4-bit weight (for ncu, or a quick timing).

    python bench/cuda_probe.py [mma|gemv] [M] [splits]      # ncu --clock-control none -k regex:qgemm ...
    python bench/cuda_probe.py check                         # do the C++ input checks raise (not crash)?
"""
from __future__ import annotations

import subprocess
import sys

import torch

import exl_core  # noqa: F401  (loads the extension)
from exl_core.formats.packed import PackedWeight
from exl_core.ops.cuda_candidates import chunk_table


def weight(K=4096, N=4096, bits=4) -> PackedWeight:
    groups = torch.tensor([(bits, k, 128, k * bits // 32) for k in range(0, K, 128)], dtype=torch.int32)
    qw = torch.randint(-2**31, 2**31, (K * bits // 32, N), dtype=torch.int64).to(torch.int32)
    G = K // 128
    return PackedWeight(qw, groups, torch.rand(G, N) * 0.002 + 0.002, torch.full((G, N), 8.0), None, K, N).to("cuda")


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "mma"
    if what == "check":
        for code in ("ops.qgemm_mma(x.float(), pw.qweight, ch, pw.scale, pw.zero, None, None)",
                     "ops.qgemv_chunks(x, pw.qweight, ch[:3], pw.scale, pw.zero, None, None)"):
            src = ("import torch, exl_core; from bench.cuda_probe import weight; from exl_core.ops.cuda_candidates "
                   "import chunk_table; ops = torch.ops.exl_core; pw = weight(256, 64); ch = chunk_table(pw.groups, "
                   f"'cuda'); x = torch.randn(2, 256, device='cuda').half()\ntry:\n {code}\nexcept Exception as e:\n "
                   "print('raised', type(e).__name__, str(e)[:120])")
            r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True)
            print(f"check rc={r.returncode}: {code[:40]} -> {r.stdout.strip()[:200]} {r.stderr.strip()[-200:]}")
        return
    M = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    splits = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    pws = [weight() for _ in range(8)]
    x = torch.randn(M, 4096, device="cuda", dtype=torch.float16)
    ops = torch.ops.exl_core
    for _ in range(3):
        for pw in pws:
            ch = chunk_table(pw.groups, "cuda") if "_ch" not in pw.meta else pw.meta["_ch"]
            pw.meta["_ch"] = ch
            if what == "mma":
                ops.qgemm_mma(x, pw.qweight, ch, pw.scale, pw.zero, None, None, splits)
            else:
                ops.qgemv_chunks(x, pw.qweight, ch, pw.scale, pw.zero, None, None)
    torch.cuda.synchronize()
    print("probe done", what, M, splits)


if __name__ == "__main__":
    main()
