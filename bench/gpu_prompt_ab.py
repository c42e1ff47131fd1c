"""The 2048-token prompt's CUDA paths side by side in one process (bench/gpu.sh phase `promptab`): both bench
checkpoints loaded once, a warm-up that brings the clocks up, then every variant timed once a round, rounds
alternated, so the variants share clocks and heat (separate processes drifted 36,228 -> 45,177 tok/s over four
runs in stop 34 call 3).  Variants are switches of ops/cuda_candidates.py read at call time:

  gptq u4 / exl2 nat      the defaults: GPTQ's uniform 4-bit weights by the 4-bit dequantise instance; rewritten
                          EXL2, x in natural order, extra rows added in the dequantise (twins)
  gptq l2 / exl2 l2       the same with W persisting in L2 from its dequantise to its GEMM (cuda_dequant.DEQUANT_L2)
  gptq graph / exl2 graph the defaults' prefill replayed from a CUDA graph captured once (no host time, launch gaps
                          shrunk): how much of the eager prompt is host and gaps; the logits are compared with
                          the eager forward's (max |diff| recorded, not asserted; a failed capture reads NaN)
Before each variant the persisting lines are reset and the set-aside put back to 0 (exl_core::l2_reset), so one
variant's window does not shrink the L2 of the next (stop 41's promptab reset the lines only: its "l2 off" ran with
the set-aside raised and read 0.8479x / 0.8506x, where separate processes read 0.9955x / 1.0375x).  Earlier variants, none kept: the width switch's instance for GPTQ and the extended
order for EXL2 (stop 34, `gpu_prompt_ab_h200_stop34_call5_*.json`); gate/up by slices with SwiGLU's product per
slice, cuBLASLt and gate/up slice widths, the dequantise at 4 columns a thread (stop 35, calls 1, 2, 4).

    PYTHONPATH=. python bench/gpu_prompt_ab.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2 [--rounds 6]

Prints per-variant medians of the rounds and each variant against the first of its format; writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gpu_bench import _write, capture_graph, gpu_time, prefill_call, prompt_tok_s

VARIANTS = {   # name: (format, settings that differ from the process's: cuda_dequant's switches, "blas")
    "gptq u4": ("gptq", {}), "gptq l2": ("gptq", {"DEQUANT_L2": True}),
    "exl2 nat": ("exl2", {}), "exl2 l2": ("exl2", {"DEQUANT_L2": True}),
    "gptq graph": ("gptq", {"graph": True}), "exl2 graph": ("exl2", {"graph": True}),
}
T = 2048


def main() -> None:
    from exl_core.loader import load_model
    from exl_core.ops import cuda_dequant as cd
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gptq", type=Path, required=True)
    ap.add_argument("--exl2", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "gpu_prompt_ab_h200.json")
    a = ap.parse_args()
    # every variant starts from the settings this process began with (the library's defaults, or EXL_CORE_* set
    # for the whole run), so the first variant of a format times them
    switches = {k for _, diff in VARIANTS.values() for k in diff if k not in ("blas", "graph")}
    for k in switches:
        assert hasattr(cd, k), f"cuda_dequant has no switch {k}"   # a typo must not time the default
    defaults = {k: getattr(cd, k) for k in switches}
    defaults["blas"] = torch.backends.cuda.preferred_blas_library()
    models = {f: load_model(getattr(a, f), device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
              for f in ("gptq", "exl2")}

    graphs, graph_err = {}, {}

    def graph_tok_s(fmt: str) -> float:
        if fmt not in graphs:                         # captured once; its logits against an eager forward's
            fn = prefill_call(models[fmt], T)
            try:
                g, out = capture_graph(fn)
            except RuntimeError as e:                 # a sync or other uncapturable call: recorded, not fatal
                graph_err[fmt], graphs[fmt] = f"capture failed: {e}".splitlines()[0], None
                torch.cuda.synchronize()
                return float("nan")
            g.replay()
            ref = fn()
            graph_err[fmt] = (out.float() - ref.float()).abs().max().item()
            graphs[fmt] = g
        if graphs[fmt] is None:
            return float("nan")
        return T / gpu_time(graphs[fmt].replay, 5, warmup=2)

    def run(name: str) -> float:
        fmt, diff = VARIANTS[name]
        settings = {**defaults, **diff}
        graph = settings.pop("graph", False)
        torch.backends.cuda.preferred_blas_library(settings.pop("blas"))
        for k, v in settings.items():
            setattr(cd, k, v)
        torch.cuda.synchronize()
        torch.ops.exl_core.l2_reset()
        return graph_tok_s(fmt) if graph else prompt_tok_s(models[fmt], T)

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 8.0:            # warm-up: every variant (first calls build tables), clocks up
        for name in VARIANTS:
            run(name)
    rows = {name: [] for name in VARIANTS}
    for r in range(a.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            rows[name].append(run(name))
    out = {"gpu": torch.cuda.get_device_name(), "rounds": a.rounds, "tok_s": rows,
           "median_tok_s": {n: statistics.median(v) for n, v in rows.items()},
           "graph_max_abs_diff_vs_eager": graph_err,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    base = {}
    print(f"{'variant':14s} {'median tok/s':>13s} {'vs first of format':>19s}   rounds")
    for name, (fmt, _) in VARIANTS.items():
        med = out["median_tok_s"][name]
        base.setdefault(fmt, med)
        out.setdefault("ratio", {})[name] = med / base[fmt]
        print(f"{name:14s} {med:13.1f} {med / base[fmt]:18.4f}x   " + " ".join(f"{v:.0f}" for v in rows[name]))
    print("graph logits against the eager forward's, max |diff|:", graph_err)
    _write(out, a.json)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
