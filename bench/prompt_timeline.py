"""The kernels of one 2,048-token prompt on a timeline (run by bench/gpu.sh phase `prompttl`).

Question: stop 34's kernel totals (torch.profiler, GPTQ) summed to ~41.3 ms of a ~44.8 ms prompt: where do the other
~3.5 ms go -- the gaps between kernels (which kernel pairs), host launches, or the GPU idle before the first?  Per
format: the untraced eager prompt (gpu_bench.prompt_tok_s's forward), the same forward replayed from a CUDA graph (no
host work between launches), and a traced eager prompt (decode_timeline.traced_kernels: every kernel's start and
duration), summed by part, with the gaps before each part's launches and the largest gaps by (previous part, part).

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
    try:
        graphed = gpu_bench.graph_time(prompt, 5)
    except Exception as e:  # noqa: BLE001 - a probe keeps going and reports the failure
        print(f"{fmt}: graph capture failed: {e!r}")
        graphed = None
    runs = dt.traced_kernels(prompt)
    rows = dt.step_rows(runs[dt.REPLAYS // 2])
    summary = dt.summarise(rows)
    pairs: dict = {}
    prev = "start"
    for r in rows:
        p = pairs.setdefault(f"{prev} -> {r['part']}", {"n": 0, "gap_us": 0.0})
        p["n"] += 1
        p["gap_us"] += max(0.0, r["gap_us"])
        prev = r["part"]
    case = {"format": fmt, "eager_us": eager * 1e6, "graphed_us": None if graphed is None else graphed * 1e6,
            "traced_spans_us": [dt.summarise(dt.step_rows(s))["span_us"] for s in runs], **summary,
            "gap_pairs": pairs, "kernels": rows}
    dur = sum(r["dur_us"] for r in rows)
    gaps = sum(max(0.0, r["gap_us"]) for r in rows)
    print(f"\n== {fmt}: eager {eager * 1e6:.1f} us ({T / eager:.1f} tok/s), graphed "
          f"{'-' if graphed is None else f'{graphed * 1e6:.1f} us ({T / graphed:.1f} tok/s)'}, traced span "
          f"{summary['span_us']:.1f} us, {summary['launches']} launches, kernel time {dur:.1f} us, gaps {gaps:.1f} us")
    print(f"{'part':10s} {'launches':>8s} {'dur us':>10s} {'adds us':>10s} {'gaps us':>10s}")
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
