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


def mode_ppl(key: str, kinds: tuple, setter, logits_fn, ctx: int, windows: int) -> list[dict]:
    """Perplexity of the GPTQ and EXL2 4-bit SmolLM2 models under each `kinds` of the `key` switch
    (setter(model, kind)), same text, windows and chunking (logits_fn(model)); the first kind is the
    base of ppl_rel_change. Shared with bench/bf16_prefill_ppl.py."""
    from convert_smollm2 import heldout_text
    from quantized_models import quantized_smollm2
    from exl_core.eval.perplexity import perplexity_from_logits_fn
    from exl_core.loader import load_model

    rows = []
    ids = None
    for fmt in ("gptq", "exl2"):
        model, tok = load_model(quantized_smollm2(fmt))
        if ids is None:
            ids = tok.encode(heldout_text(), add_bos=False, special=False)
        for kind in kinds:
            setter(model, kind)
            t = time.time()
            with torch.inference_mode():
                r = perplexity_from_logits_fn(logits_fn(model), ids, ctx=ctx, max_windows=windows)
            rows.append({"model": f"{fmt} 4-bit rtn", key: kind, "ppl": r.ppl, "tokens": r.tokens,
                         "windows": r.windows, "eval_s": round(time.time() - t, 1)})
            print_table(rows[-1:], ["model", key, "ppl", "tokens", "eval_s"])
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b[key] == kinds[0])
        r["ppl_rel_change"] = r["ppl"] / base["ppl"] - 1
    print()
    print_table(rows, ["model", key, "ppl", "ppl_rel_change", "tokens", "windows", "eval_s"])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from exl_core.loader import set_activations
    rows = mode_ppl("activations", ("exact", "int8"), set_activations, lambda m: chunked_logits_fn(m, args.rows),
                    args.ctx, args.windows)
    write_results("int8_act_ppl", {"ctx": args.ctx, "rows_per_call": args.rows,
                                   "text": "stdlib docstrings (bench/convert_smollm2.py heldout_text)",
                                   "results": rows})


if __name__ == "__main__":
    main()
