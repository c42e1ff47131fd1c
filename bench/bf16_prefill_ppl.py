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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from int8_act_ppl import mode_ppl  # noqa: E402


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
    from exl_core.loader import set_prefill
    rows = mode_ppl("prefill", ("exact", "bf16"), set_prefill, whole_window_logits_fn, args.ctx, args.windows)
    write_results("cpu_prompt_bf16_ppl", {"ctx": args.ctx, "rows_per_call": args.ctx,
                                          "text": "stdlib docstrings (bench/convert_smollm2.py heldout_text)",
                                          "results": rows})


if __name__ == "__main__":
    main()
