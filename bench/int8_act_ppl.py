"""Perplexity cost of activations="int8" on SmolLM2-135M 4-bit (GPTQ g128 and EXL2 4.0 RTN, the
cpu_decode rows), on held-out text outside /work/shared/data: the Python stdlib docstrings that
bench/convert_smollm2.py evaluates on.

    python bench/int8_act_ppl.py [--ctx 256] [--windows 4] [--rows 8] [--threads 2]

The int8 kernels serve only decode-sized calls (<= 8 rows), so every window is fed `--rows`
tokens at a time through a KV sequence, for the exact and the int8 model alike (same chunking,
so the only difference is the kernel).  Writes bench/results/int8_act_ppl.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402


def chunked_logits_fn(model, rows: int):
    def fn(window: torch.Tensor) -> torch.Tensor:
        kv = [model.new_sequence_kv(len(window))]
        out = [model.forward_batch(window[i:i + rows][None], kv)[0] for i in range(0, len(window), rows)]
        return torch.cat(out)
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from convert_smollm2 import heldout_text
    from quantized_models import quantized_smollm2
    from exl_core.eval.perplexity import perplexity_from_logits_fn
    from exl_core.loader import load_model, set_activations

    rows = []
    ids = None
    for fmt in ("gptq", "exl2"):
        model, tok = load_model(quantized_smollm2(fmt))
        if ids is None:
            ids = tok.encode(heldout_text(), add_bos=False, special=False)
        for act in ("exact", "int8"):
            set_activations(model, act)
            t = time.time()
            with torch.inference_mode():
                r = perplexity_from_logits_fn(chunked_logits_fn(model, args.rows), ids, ctx=args.ctx,
                                              max_windows=args.windows)
            rows.append({"model": f"{fmt} 4-bit rtn", "activations": act, "ppl": r.ppl, "tokens": r.tokens,
                         "windows": r.windows, "eval_s": round(time.time() - t, 1)})
            print_table(rows[-1:], ["model", "activations", "ppl", "tokens", "eval_s"])
    print()
    print_table(rows, ["model", "activations", "ppl", "tokens", "windows", "eval_s"])
    write_results("int8_act_ppl", {"ctx": args.ctx, "rows_per_call": args.rows,
                                   "text": "stdlib docstrings (bench/convert_smollm2.py heldout_text)",
                                   "results": rows})


if __name__ == "__main__":
    main()
