"""Why the bench's prompt reads lower after its decode runs than alone (stop 37: EXL2 38,325.6 tok/s in a `--quick`
run against 45,250.1-45,458.9 in three `--prompt-only` processes on the same machine): per format, the 2,048-token
prompt timed as gpu_bench.prompt_tok_s right after loading, after the decode runs (CUDA graphs at batch 1, 8, 32, as
`--quick`), and after gc.collect() + torch.cuda.empty_cache(); with each forward's host time (enqueue, no sync)
next to its GPU time, to tell a host-bound prompt from a slower GPU one.  One process: GPTQ first, then EXL2 (after
GPTQ's model is freed and the cache emptied), and once more after 15 s idle; each with nvidia-smi's SM clock, power,
temperature and throttle reasons while it ran, and Python's garbage collections (count per generation, ms) in it; then
after gc.collect() + gc.freeze(), at once and after 15 s idle.  Run by bench/gpu.sh phase `promptorder`.

    python bench/prompt_after_decode.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2
"""
from __future__ import annotations

import gc
import statistics
import subprocess
import time
from pathlib import Path

import torch

import gpu_bench

ROUNDS = 2
IDLE_S = 15


class SmiLog:
    """nvidia-smi sampled every 100 ms while a block runs: the SM clock (median, MHz), power (max, W), temperature
    (max, C) and the throttle reasons seen -- a prompt slower after the decode runs could be a hotter, slower-clocked
    GPU rather than the process's state (stop 38's open question)."""

    FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __enter__(self):
        try:
            self.p = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                       "-lms", "100"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.p = None
        self.stats = {}
        return self

    def __exit__(self, *exc):
        if self.p is None:
            return
        self.p.terminate()
        out, _ = self.p.communicate()
        rows = [r.split(", ") for r in out.strip().splitlines() if r.count(",") == 3]
        number = lambda v: v.replace(".", "", 1).isdigit()   # "[N/A]" and the like are skipped
        num = [(float(c), float(w), float(t), why) for c, w, t, why in rows if number(c) and number(w) and number(t)]
        if num:
            self.stats = {"smi_samples": len(num), "sm_mhz_median": statistics.median(r[0] for r in num),
                          "power_w_max": max(r[1] for r in num), "temp_c_max": max(r[2] for r in num),
                          "throttle_reasons": sorted({r[3] for r in num})}


class GcLog:
    """Python's garbage collections while a block runs (gc.callbacks): how many per generation and their total ms --
    a host slowed by full collections in the timed forwards would show here.  Stop 40 call 6: at most 0.228 ms in any
    state, and gc.freeze() did not help (csrc/cuda/NOTES.md, "twenty-first")."""

    def __enter__(self):
        self.counts, self.ms, self._t0 = [0, 0, 0], 0.0, 0.0
        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)
        self.stats = {"gc_collections": self.counts, "gc_ms": round(self.ms, 3)}


@torch.inference_mode()
def timed(model) -> dict:
    with SmiLog() as smi, GcLog() as gcl:
        r = _timed(model)
    return {**r, **smi.stats, **gcl.stats}


def _timed(model) -> dict:
    """gpu_bench.prompt_tok_s ROUNDS times (each the median of 5), and the median host (enqueue) and GPU ms of 5
    forwards."""
    tok_s = [gpu_bench.prompt_tok_s(model) for _ in range(ROUNDS)]
    fn = gpu_bench.prefill_call(model)
    fn()
    torch.cuda.synchronize()
    host, dev = [], []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        dev.append(a.elapsed_time(b))
    return {"tok_s": tok_s, "host_ms": statistics.median(host), "gpu_ms": statistics.median(dev),
            "host_all_ms": [round(h, 3) for h in host]}


def run_format(path: Path, fmt: str) -> list[dict]:
    from exl_core.loader import load_model
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    rows = [{"format": fmt, "when": "alone", **timed(model)}]
    for B in (1, 8, 32):
        gpu_bench.decode_tok_s(model, B, True)
    rows.append({"format": fmt, "when": "after decode", **timed(model)})
    gc.collect()
    torch.cuda.empty_cache()
    rows.append({"format": fmt, "when": "after empty_cache", **timed(model)})
    time.sleep(IDLE_S)                     # a cooler GPU, the process's state unchanged
    rows.append({"format": fmt, "when": f"after {IDLE_S} s idle", **timed(model)})
    gc.collect()
    gc.freeze()                            # every object so far out of the collector's scans
    rows.append({"format": fmt, "when": "gc frozen", **timed(model)})
    time.sleep(IDLE_S)
    rows.append({"format": fmt, "when": f"frozen, {IDLE_S} s idle", **timed(model)})
    gc.unfreeze()
    for r in rows:
        tok = ", ".join(f"{v:.1f}" for v in r["tok_s"])
        print(f"{fmt:5s} {r['when']:18s} tok/s {tok:>20s}  host {r['host_ms']:.2f} ms"
              f"  gpu {r['gpu_ms']:.2f} ms  sm {r.get('sm_mhz_median', '-')} MHz  {r.get('power_w_max', '-')} W"
              f"  {r.get('temp_c_max', '-')} C  {' '.join(r.get('throttle_reasons', []))}"
              f"  gc {r['gc_collections']} {r['gc_ms']} ms  host each {r['host_all_ms']}")
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = gpu_bench.probe_parser(__doc__, "prompt_after_decode_h200.json")
    a = ap.parse_args()
    out = gpu_bench.probe_record("prompt_after_decode", "2048-token prompt as gpu_bench.prompt_tok_s, before and "
                                 "after the --quick decode runs", "rows")
    out["rows"] += gpu_bench.probe_formats(a, run_format)
    gpu_bench._write(out, a.json)


if __name__ == "__main__":
    main()
