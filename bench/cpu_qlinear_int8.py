"""Decode GEMV: the int8-activation kernel (exl_core::qmatmul_int8) vs the exact fp32 kernel
(exl_core::qmatmul), same packed weights, same run.

    python bench/cpu_qlinear_int8.py [--threads 2] [--rows 1,4] [--out bench/results/cpu_qlinear_int8.json]

Timing and weights as in bench/cpu_qlinear.py (whose helpers this reuses): minimum over repeats,
weights rotated past the L3 so they come from DRAM; a wall-clock pass with `--threads` and a
1-thread pass on the calling thread's CPU time (robust on a loaded machine).  Groups of 128
rows; SmolLM2's int8 head (8-bit, groups of 32) as its own row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_qlinear as base  # noqa: E402

SHAPES = [(576, 1536), (1536, 576), (576, 192), (2048, 8192)]
BITS = [2, 3, 4, 5, 6, 8]


def bench_pair(K, N, bits, M, gs=128) -> dict:
    first = base.packed_args(K, N, bits, gs)
    nbytes = base.weight_bytes(first)
    copies = [first] + [base.packed_args(K, N, bits, gs)
                        for _ in range(max(0, min(base.ROTATE_BYTES // nbytes, 64) - 1))]
    x = torch.randn(M, K)
    out = {}
    for name, op in (("fp32", torch.ops.exl_core.qmatmul), ("int8", torch.ops.exl_core.qmatmul_int8)):
        i = [0]

        def call():
            op(x, *copies[i[0] % len(copies)])
            i[0] += 1
        out[name] = base.timeit(call)
    return dict(K=K, N=N, bits=bits, group=gs, M=M, weight_bytes=nbytes, fp32_us=out["fp32"] * 1e6,
                int8_us=out["int8"] * 1e6, speedup=out["fp32"] / out["int8"],
                int8_GBps=nbytes / out["int8"] / 1e9)


def run_pass(threads, clock, rows_m) -> dict:
    base.CLOCK = time.thread_time if clock == "thread_cpu" else time.perf_counter
    torch.set_num_threads(threads)
    print(f"\n== {threads} thread(s), clock {clock}, load {os.getloadavg()[0]:.1f} ==")
    print(f"{'K':>5} {'N':>6} {'bits':>4} {'g':>3} {'M':>2} | {'fp32 us':>8} {'int8 us':>8} {'speedup':>7} {'GB/s':>6}")
    res = []
    cases = [(K, N, b, 128) for K, N in SHAPES for b in BITS] + [(576, 49152, 8, 32)]
    for K, N, b, gs in cases:
        for M in rows_m:
            r = bench_pair(K, N, b, M, gs)
            res.append(r)
            print(f"{K:5d} {N:6d} {b:4d} {gs:3d} {M:2d} | {r['fp32_us']:8.1f} {r['int8_us']:8.1f} "
                  f"{r['speedup']:7.2f} {r['int8_GBps']:6.1f}", flush=True)
    return dict(threads=threads, clock=clock, loadavg=list(os.getloadavg()), results=res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--passes", choices=["both", "wall", "cpu"], default="both")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_qlinear_int8.json"))
    args = ap.parse_args()
    if not base.has_op("qmatmul_int8"):
        raise SystemExit(f"exl_core._C is not built with qmatmul_int8 ({base.extension_error()})")
    rows_m = [int(v) for v in args.rows.split(",")]
    info = base.machine_info(args.threads)
    info["int8_isa_level"] = int(torch.ops.exl_core.qmatmul_int8_isa())
    print(f"{info['cpu']}, {info['logical_cores']} cores, int8 ISA level {info['int8_isa_level']} "
          f"(2 = AVX-512 VNNI), load {info['loadavg_start'][0]:.1f}")
    passes = []
    if args.passes in ("both", "wall"):
        passes.append(run_pass(args.threads, "wall_min", rows_m))
    if args.passes in ("both", "cpu"):
        passes.append(run_pass(1, "thread_cpu", rows_m))
    info["loadavg_end"] = list(os.getloadavg())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(machine=info, timing="minimum over repeats", passes=passes), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
