"""The host side of one 2,048-token prompt (run by bench/gpu.sh phase `prompthost`).

Question: stop 35 call 2's traced prompt (bench/prompt_timeline.py) had EXL2's GPU idle for 20.0 ms of a 62.7 ms span
against GPTQ's 1.3 ms of 43.7 ms, with the same 874 launches and ~42.8 ms of kernels each: is the rewritten EXL2's
eager prompt bound by its host (Python between launches, or a host sync that drains the queue)?  Per format:
  - the time until forward() returns on the host (launches queued, no sync at the end) against the time until the
    GPU is done (medians of 7), with a sync before each;
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


@torch.inference_mode()
def run_format(path: Path, fmt: str) -> list[dict]:
    from exl_core.loader import load_model
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    prompt = gpu_bench.prefill_call(model, T)
    for _ in range(3):
        prompt()
    host, done = [], []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prompt()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        done.append((time.perf_counter() - t0) * 1e6)
    case = {"format": fmt, "host_us": statistics.median(host), "done_us": statistics.median(done),
            "host_all_us": host, "done_all_us": done}
    print(f"\n== {fmt}: forward returns after {case['host_us']:.1f} us, GPU done after {case['done_us']:.1f} us "
          f"({T / case['done_us'] * 1e6:.1f} tok/s); host {', '.join(f'{h:.0f}' for h in host)}")

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
