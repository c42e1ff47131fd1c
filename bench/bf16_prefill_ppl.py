"""Perplexity cost of prefill="bf16" on SmolLM2-135M 4-bit (GPTQ g128 and EXL2 4.0 RTN, the
cpu_decode rows), on held-out text outside /work/shared/data: the Python stdlib docstrings that
bench/convert_smollm2.py evaluates on (the same text and windows as bench/int8_act_ppl.py).

    python bench/bf16_prefill_ppl.py [--ctx 256] [--windows 4] [--threads 2]

The bf16 kernels serve only prompt-sized calls (>= 9 rows), so every window goes through the
model in one call of `--ctx` rows, for the exact and the bf16 model alike (same chunking, so the
only difference is the kernel).  Writes bench/results/cpu_prompt_bf16_ppl.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402


def whole_window_logits_fn(model):
    def fn(window: torch.Tensor) -> torch.Tensor:
        kv = [model.new_sequence_kv(len(window))]
        return model.forward_batch(window[None], kv)[0]
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from convert_smollm2 import heldout_text
    from quantized_models import quantized_smollm2
    from exl_core.eval.perplexity import perplexity_from_logits_fn
    from exl_core.loader import load_model, set_prefill

    rows = []
    ids = None
    for fmt in ("gptq", "exl2"):
        model, tok = load_model(quantized_smollm2(fmt))
        if ids is None:
            ids = tok.encode(heldout_text(), add_bos=False, special=False)
        for pre in ("exact", "bf16"):
            set_prefill(model, pre)
            t = time.time()
            with torch.inference_mode():
                r = perplexity_from_logits_fn(whole_window_logits_fn(model), ids, ctx=args.ctx,
                                              max_windows=args.windows)
            rows.append({"model": f"{fmt} 4-bit rtn", "prefill": pre, "ppl": r.ppl, "tokens": r.tokens,
                         "windows": r.windows, "eval_s": round(time.time() - t, 1)})
            print_table(rows[-1:], ["model", "prefill", "ppl", "tokens", "eval_s"])
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["prefill"] == "exact")
        r["ppl_rel_change"] = r["ppl"] / base["ppl"] - 1
    print()
    print_table(rows, ["model", "prefill", "ppl", "ppl_rel_change", "tokens", "windows", "eval_s"])
    write_results("cpu_prompt_bf16_ppl", {"ctx": args.ctx, "rows_per_call": args.ctx,
                                          "text": "stdlib docstrings (bench/convert_smollm2.py heldout_text)",
                                          "results": rows})


if __name__ == "__main__":
    main()
