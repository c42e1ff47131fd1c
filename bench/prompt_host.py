"""The host side of one 2,048-token prompt (run by bench/gpu.sh phase `prompthost`).

Question: stop 35 call 2's traced prompt (bench/prompt_timeline.py) had EXL2's GPU idle for 20.0 ms of a 62.7 ms span
against GPTQ's 1.3 ms of 43.7 ms, with the same 874 launches and ~42.8 ms of kernels each: is the rewritten EXL2's
eager prompt bound by its host (Python between launches, or a host sync that drains the queue)?  Per format:
  - the time until forward() returns on the host (launches queued, no sync at the end) against the time until the
    GPU is done (medians of 7), with a sync before each;
  - the same for the prompt's dequantise + cuBLAS as one C++ call a weight (qdequant_mm) against a Python slice loop
    (python_slices, stop 41's path), rounds alternated (ab_dequant_mm: medians of 15 forwards each);
  - the synchronising calls of one forward (torch.cuda.set_sync_debug_mode: their Python callers);
  - cProfile of one forward: the functions with the most own time and the most cumulative time.

    PYTHONPATH=. python bench/prompt_host.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch

import gpu_bench

T = 2048


def python_slices(x2, pw, chunks, perm, bias, add_to=None):
    """The prompt's dequantise + cuBLAS as stop 41 ran it, a Python round trip a slice (qdequant_chunks through
    dequant_w, then torch.mm into y's columns): the A/B reference for qdequant_mm's one call."""
    from exl_core.ops import cuda_dequant as cd
    N, step = pw.out_features, cd.DEQUANT_SLICE
    step = N if N <= 2 * step else step
    y = add_to if add_to is not None else torch.empty(x2.shape[0], N, dtype=x2.dtype, device=x2.device)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        w = cd.dequant_w(pw, chunks, perm, x2.dtype, n0, n1 - n0)
        if add_to is not None:
            y[:, n0:n1].addmm_(x2, w)
        elif bias is not None:
            torch.addmm(bias[n0:n1], x2, w, out=y[:, n0:n1])
        else:
            torch.mm(x2, w, out=y[:, n0:n1])
        del w
    return y


def time_forwards(prompt, n: int = 7) -> tuple[list, list]:
    """n forwards, a sync before each: host (until forward returns) and done (until the GPU finishes) in us."""
    host, done = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prompt()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        done.append((time.perf_counter() - t0) * 1e6)
    return host, done


@torch.inference_mode()
def run_format(path: Path, fmt: str) -> list[dict]:
    from exl_core.loader import load_model
    from exl_core.ops import cuda_dequant as cd
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    prompt = gpu_bench.prefill_call(model, T)
    for _ in range(3):
        prompt()
    host, done = time_forwards(prompt)
    case = {"format": fmt, "host_us": statistics.median(host), "done_us": statistics.median(done),
            "host_all_us": host, "done_all_us": done}
    print(f"\n== {fmt}: forward returns after {case['host_us']:.1f} us, GPU done after {case['done_us']:.1f} us "
          f"({T / case['done_us'] * 1e6:.1f} tok/s); host {', '.join(f'{h:.0f}' for h in host)}")
    ab: dict = {"op": ([], []), "python_slices": ([], [])}      # rounds alternated: qdequant_mm vs a slice loop
    one_call = cd.dequant_mm
    for _ in range(3):
        for name, fn in (("python_slices", python_slices), ("op", one_call)):
            cd.dequant_mm = fn
            try:
                prompt()
                h, d = time_forwards(prompt, 5)
            finally:
                cd.dequant_mm = one_call
            ab[name][0].extend(h)
            ab[name][1].extend(d)
    case["ab_dequant_mm"] = {k: {"host_us": statistics.median(h), "done_us": statistics.median(d), "host_all_us": h,
                                 "done_all_us": d} for k, (h, d) in ab.items()}
    for k, v in case["ab_dequant_mm"].items():
        print(f"   {k:14s} host {v['host_us']:9.1f} us  done {v['done_us']:9.1f} us  ({T / v['done_us'] * 1e6:.1f} tok/s)")

    syncs: dict = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prompt()
        for w in caught:
            if "synchroniz" not in str(w.message).lower():
                continue
            where = f"{Path(w.filename).name}:{w.lineno}"       # the Python line that called the op
            syncs[where] = syncs.get(where, 0) + 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    case["syncs"] = syncs
    print(f"synchronising calls in one forward: {sum(syncs.values())}")
    for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {n:5d}  {where}")

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    prompt()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(22)
        text = s.getvalue()
        case[f"cprofile_{key}"] = text[-6000:]
        print(f"-- cProfile by {key}:")
        print("\n".join(line[:150] for line in text.splitlines() if line.strip())[-4500:])
    del model
    torch.cuda.empty_cache()
    return [case]


def main() -> None:
    ap = gpu_bench.probe_parser(__doc__, "prompt_host_h200.json")
    a = ap.parse_args()
    out = gpu_bench.probe_record("prompt_host", f"{T}-token prompt, eager, as gpu_bench.py; host timings, syncs, "
                                 "cProfile", "cases")
    out["cases"] += gpu_bench.probe_formats(a, run_format)
    gpu_bench._write(out, a.json)


if __name__ == "__main__":
    main()
