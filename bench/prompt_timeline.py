"""The kernels of one 2,048-token prompt on a timeline (run by bench/gpu.sh phase `prompttl`).

Question: stop 34's kernel totals (torch.profiler, GPTQ) summed to ~41.3 ms of a ~44.8 ms prompt: where do the other
~3.5 ms go -- the gaps between kernels (which kernel pairs), host launches, or the GPU idle before the first?  Per
format: the untraced eager prompt (gpu_bench.prompt_tok_s's forward) and traced eager prompts
(decode_timeline.traced_kernels: every kernel's start and duration; the replay of median span reported), summed by
part, with the gaps before each part's launches and the largest gaps by (previous part, part).  Gaps: the idle time
before a launch (its start minus the latest end before it, when positive); the net idle time also subtracts where
kernels overlap (programmatic dependent launch).  The tracer's cost per launch can make a host-heavy path look
host-bound: bench/prompt_host.py times the host untraced.  (The prompt from a CUDA graph: bench/gpu_prompt_ab.py's
graph variants; PrefillContext states num_positions since stop 49, so Model.forward reads nothing back.)

    PYTHONPATH=. python bench/prompt_timeline.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2
"""
from __future__ import annotations

from pathlib import Path

import torch

import decode_timeline as dt
import gpu_bench

T = 2048
# the prompt's own kernels first (the decode parts' patterns would file the dequantise and cuDNN's SDPA as "other")
dt.PARTS = (("dequant", r"dequant"), ("sdpa", r"sdpa|flash|fmha")) + dt.PARTS


@torch.inference_mode()
def run_format(path: Path, fmt: str) -> list[dict]:
    from exl_core.loader import load_model
    model, _ = load_model(path, device="cuda", dtype=torch.float16, load_tokenizer=False)
    prompt = gpu_bench.prefill_call(model, T)
    eager = gpu_bench.gpu_time(prompt, 5, warmup=2)
    runs = dt.traced_kernels(prompt)
    spans = [dt.summarise(dt.step_rows(s))["span_us"] for s in runs]
    rows = dt.step_rows(runs[sorted(range(len(runs)), key=spans.__getitem__)[len(runs) // 2]])
    summary = dt.summarise(rows)
    pairs: dict = {}
    prev = "start"
    for r in rows:
        p = pairs.setdefault(f"{prev} -> {r['part']}", {"n": 0, "gap_us": 0.0})
        p["n"] += 1
        p["gap_us"] += max(0.0, r["gap_us"])
        prev = r["part"]
    dur = sum(r["dur_us"] for r in rows)
    gaps = sum(max(0.0, r["gap_us"]) for r in rows)
    case = {"format": fmt, "eager_us": eager * 1e6, "traced_spans_us": spans, **summary, "kernel_us": dur,
            "idle_us": gaps, "net_idle_us": summary["span_us"] - dur, "gap_pairs": pairs, "kernels": rows}
    print(f"\n== {fmt}: eager {eager * 1e6:.1f} us ({T / eager:.1f} tok/s), traced spans "
          f"{', '.join(f'{x:.1f}' for x in spans)} us (median reported), {summary['launches']} launches, kernel time "
          f"{dur:.1f} us, idle before launches {gaps:.1f} us, span minus kernel time {summary['span_us'] - dur:.1f} us")
    print(f"{'part':10s} {'launches':>8s} {'dur us':>10s} {'adds us':>10s} {'net gaps':>10s}")
    for p, v in sorted(summary["parts"].items(), key=lambda kv: -kv[1]["adds_us"]):
        print(f"{p:10s} {v['launches']:8d} {v['dur_us']:10.1f} {v['adds_us']:10.1f} {v['gap_us']:10.1f}")
    print("-- gaps by (previous part -> part), largest first:")
    for k, v in sorted(pairs.items(), key=lambda kv: -kv[1]["gap_us"])[:10]:
        print(f"  {k:28s} {v['n']:5d} launches, {v['gap_us']:9.1f} us ({v['gap_us'] / v['n']:.2f} each)")
    del model
    torch.cuda.empty_cache()
    return [case]


def main() -> None:
    ap = gpu_bench.probe_parser(__doc__, "prompt_timeline_h200.json")
    a = ap.parse_args()
    out = gpu_bench.probe_record("prompt_timeline", f"{T}-token prompt, eager, as gpu_bench.py; torch.profiler",
                                 "cases")
    out["cases"] += gpu_bench.probe_formats(a, run_format)
    gpu_bench._write(out, a.json)


if __name__ == "__main__":
    main()
