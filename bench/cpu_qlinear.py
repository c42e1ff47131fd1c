"""CPU quantized/dense linear kernels vs the machine's copy bandwidth and vs torch.mm.

Question: how close do exl_core's CPU kernels get to the memory roofline for decode (GEMV,
M=1) and to the FMA roofline for prefill (GEMM, M=512)?  Peers measured in the same run:
a large torch tensor copy (bytes read + written) and torch.mm in fp32 on the same shape.

    python bench/cpu_qlinear.py [--threads 2] [--quick] [--out bench/results/cpu_qlinear.json]

Timing: two passes.  `--threads N` (default 2) times the minimum WALL time over repeated
calls.  On a shared, oversubscribed machine that is unreliable (a 2-thread call waits whenever
one of its threads is descheduled), so a second pass runs 1 thread and times the calling
thread's CPU time (CLOCK_THREAD_CPUTIME_ID; memory stalls count, descheduled time does not):
the per-core figures, robust to other load.  `--passes wall` or `--passes cpu` runs one.  GEMV rotates through enough weight copies to overflow the L3, so
weights come from DRAM as in a real decode step.  Packed words are random (every bit pattern
is a valid value), one bit width per matrix, groups of 128 rows along K.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exl_core.ops.dispatch import extension_error, has_op  # noqa: E402

SHAPES = [(576, 1536), (2048, 8192), (4096, 11008)]
BITS = [2, 3, 4, 5, 6, 8]
ROTATE_BYTES = 96 << 20   # > 3x a 32 MiB L3


CLOCK = time.perf_counter   # set per pass: perf_counter (wall) or thread_time (CPU of this thread)


def timeit(fn, min_time=0.4, min_reps=3, max_reps=2000) -> float:
    fn()
    best, reps, t_end = float("inf"), 0, time.perf_counter() + min_time
    while reps < max_reps and (reps < min_reps or time.perf_counter() < t_end):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
        reps += 1
    return best


def copy_bandwidth() -> float:
    src = torch.rand(64 << 20)                      # 256 MiB fp32
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), min_time=1.0)
    return 2 * src.numel() * 4 / t                  # bytes read + written per second


def packed_args(K, N, bits, gs=128):
    rows, k, q = [], 0, 0
    while k < K:
        kl = min(gs, K - k)
        rows.append((bits, k, kl, q))
        k, q = k + kl, q + kl * bits // 32
    G = len(rows)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (q, N), dtype=torch.int32)
    return (qweight, torch.tensor(rows, dtype=torch.int32), torch.rand(G, N) * 0.01,
            torch.rand(G, N) * (2 ** bits - 1), None, None)


def weight_bytes(args) -> int:
    return sum(t.numel() * t.element_size() for t in args[:4] if t is not None)


def bench_quant(K, N, bits, copy_bw, quick):
    op = torch.ops.exl_core.qmatmul
    first = packed_args(K, N, bits)
    nbytes = weight_bytes(first)
    copies = [first] + [packed_args(K, N, bits) for _ in range(max(0, min(ROTATE_BYTES // nbytes, 64) - 1))]
    x1 = torch.randn(1, K)
    i = [0]

    def gemv():
        a = copies[i[0] % len(copies)]
        i[0] += 1
        op(x1, *a)

    t_gemv = timeit(gemv)
    row = dict(kind="qmatmul", K=K, N=N, bits=bits, weight_bytes=nbytes, gemv_us=t_gemv * 1e6,
               gemv_GBps=nbytes / t_gemv / 1e9, gemv_frac_copy_bw=nbytes / t_gemv / copy_bw)
    if not quick or K <= 2048:
        xb = torch.randn(512, K)
        w = torch.randn(K, N)
        flop = 2 * 512 * K * N
        t_ours = timeit(lambda: op(xb, *first), min_time=0.6)
        t_mm = timeit(lambda: torch.mm(xb, w), min_time=0.6)
        row.update(gemm_ms=t_ours * 1e3, gemm_GFLOPs=flop / t_ours / 1e9, torch_mm_GFLOPs=flop / t_mm / 1e9,
                   gemm_vs_torch_mm=t_mm / t_ours)
    return row


def bench_dense(K, N, wdt, copy_bw):
    op = torch.ops.exl_core.dense_matmul
    w = (torch.randn(K, N) * 0.02).to(wdt)
    nbytes = w.numel() * w.element_size()
    copies = [w] + [w.clone() for _ in range(max(0, min(ROTATE_BYTES // nbytes, 16) - 1))]
    x1 = torch.randn(1, K)
    i = [0]

    def gemv():
        op(x1, copies[i[0] % len(copies)], None)
        i[0] += 1

    t_gemv = timeit(gemv)
    x1w = x1.to(wdt)
    t_gemv_torch = timeit(lambda: torch.mm(x1w, copies[i[0] % len(copies)]))
    xb = torch.randn(512, K)
    flop = 2 * 512 * K * N
    wf = w.float()
    t_ours = timeit(lambda: op(xb, w, None), min_time=0.6)
    t_mm = timeit(lambda: torch.mm(xb, wf), min_time=0.6)
    return dict(kind="dense_matmul", K=K, N=N, w_dtype=str(wdt).replace("torch.", ""), weight_bytes=nbytes,
                gemv_us=t_gemv * 1e6, gemv_GBps=nbytes / t_gemv / 1e9, gemv_frac_copy_bw=nbytes / t_gemv / copy_bw,
                torch_gemv_us=t_gemv_torch * 1e6, gemm_ms=t_ours * 1e3, gemm_GFLOPs=flop / t_ours / 1e9,
                torch_mm_GFLOPs=flop / t_mm / 1e9, gemm_vs_torch_mm=t_mm / t_ours)


def machine_info(threads) -> dict:
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu=model, logical_cores=os.cpu_count(), threads=threads, torch=torch.__version__,
                python=platform.python_version(), isa_level=int(torch.ops.exl_core.matmul_isa()),
                loadavg_start=list(os.getloadavg()))


def run_pass(shapes, threads, clock_name, quick) -> dict:
    global CLOCK
    CLOCK = time.thread_time if clock_name == "thread_cpu" else time.perf_counter
    torch.set_num_threads(threads)
    copy_bw = copy_bandwidth()
    print(f"\n== {threads} thread(s), clock: {clock_name}, load {os.getloadavg()[0]:.1f} ==")
    print(f"copy bandwidth (read+write): {copy_bw / 1e9:.1f} GB/s")
    print(f"{'kernel':>12} {'K':>5} {'N':>6} {'w':>5} | {'GEMV us':>8} {'GB/s':>6} {'of copy':>7} | "
          f"{'GEMM GF/s':>9} {'torch.mm':>8} {'ratio':>5}")
    rows = []

    def show(r):
        w = f"{r['bits']}b" if "bits" in r else r["w_dtype"][:4]
        g = (f"{r['gemm_GFLOPs']:9.1f} {r['torch_mm_GFLOPs']:8.1f} {r['gemm_vs_torch_mm']:5.2f}"
             if "gemm_GFLOPs" in r else f"{'-':>9} {'-':>8} {'-':>5}")
        print(f"{r['kind']:>12} {r['K']:5d} {r['N']:6d} {w:>5} | {r['gemv_us']:8.1f} {r['gemv_GBps']:6.1f} "
              f"{r['gemv_frac_copy_bw']:7.2f} | {g}", flush=True)

    for K, N in shapes:
        for bits in BITS:
            rows.append(bench_quant(K, N, bits, copy_bw, quick))
            show(rows[-1])
    for wdt in (torch.float32, torch.bfloat16):
        rows.append(bench_dense(576, 49152, wdt, copy_bw))   # SmolLM2's LM head
        show(rows[-1])
    return dict(threads=threads, clock=clock_name, copy_bandwidth_GBps=copy_bw / 1e9,
                loadavg=list(os.getloadavg()), results=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", choices=["both", "wall", "cpu"], default="both")
    ap.add_argument("--quick", action="store_true", help="skip the largest shape's GEMM")
    ap.add_argument("--shapes", default=None, help="e.g. 576x1536,2048x8192")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_qlinear.json"))
    args = ap.parse_args()
    if not has_op("qmatmul"):
        raise SystemExit(f"exl_core._C is not built with qmatmul ({extension_error()}): "
                         "python setup.py build_ext --inplace")
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    info = machine_info(args.threads)
    print(f"{info['cpu']}, {info['logical_cores']} cores, torch {info['torch']}, load {info['loadavg_start'][0]:.1f}")
    passes = []
    if args.passes in ("both", "wall"):
        passes.append(run_pass(shapes, args.threads, "wall_min", args.quick))
    if args.passes in ("both", "cpu"):
        passes.append(run_pass(shapes, 1, "thread_cpu", args.quick))
    info["loadavg_end"] = list(os.getloadavg())
    out = dict(machine=info, timing="minimum over repeats; see each pass's clock", passes=passes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
