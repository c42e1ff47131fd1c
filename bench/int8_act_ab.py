"""Decode tokens/s with activations="int8" vs exact, same loaded model, runs interleaved.

On a shared machine, rows measured one after another in bench/cpu_decode.py see different
load; here one model is loaded once per format and the two settings alternate (`--rounds`
times, best of each kept), so the ratio is fair even when absolute numbers move.

    python bench/int8_act_ab.py [--threads 2] [--rounds 4] [--new-tokens 64] [--llamacpp-python PY]

With `--llamacpp-python`, each round also runs llama.cpp (Q4_1 GGUF, bench/cpu_decode.py's
script, same prompt and token count) between the two settings, best of its rounds kept too.

Writes bench/results/int8_act_ab[_{threads}thread].json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import greedy_decode_tok_s, print_table, write_results  # noqa: E402


COLS = ["model", "exact_tok_s", "int8_tok_s", "int8_x_exact", "llamacpp_tok_s", "exact_x_llamacpp",
        "int8_x_llamacpp"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--head", default="int8", choices=["exact", "bf16", "int8"])
    ap.add_argument("--llamacpp-python", default=None)
    ap.add_argument("--out", default=None, help="results name (default int8_act_ab[_Nthread])")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quantized_models import quantized_smollm2
    from exl_core.cache import Cache
    from exl_core.generation import Generator
    from exl_core.loader import load_model, set_activations
    from exl_core.default_model import smollm2_gguf_path
    from cpu_decode import bench_llamacpp

    rows = []
    for fmt in ("gptq", "exl2"):
        model, tok = load_model(quantized_smollm2(fmt), head=args.head)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon."}],
                                         tokenize=True)
        gen = Generator(model, Cache(model, max_tokens=len(prompt) + args.new_tokens + 512), tok)
        best = {"exact": [], "int8": [], "llamacpp": []}
        for _ in range(args.rounds):
            for act in ("exact", "int8"):
                set_activations(model, act)
                best[act].append(greedy_decode_tok_s(gen, prompt, args.new_tokens))
                if act == "exact" and args.llamacpp_python:
                    best["llamacpp"].append(bench_llamacpp(args.llamacpp_python, smollm2_gguf_path(), args.threads,
                                                           16, args.new_tokens, prompt)["decode_tok_s"])
        row = {"model": f"{fmt} 4-bit rtn ({args.head} head)", "exact_tok_s": max(best["exact"]),
               "int8_tok_s": max(best["int8"]), "runs_exact": best["exact"], "runs_int8": best["int8"]}
        row["int8_x_exact"] = row["int8_tok_s"] / row["exact_tok_s"]
        if best["llamacpp"]:
            row.update(llamacpp_tok_s=max(best["llamacpp"]), runs_llamacpp=best["llamacpp"],
                       exact_x_llamacpp=row["exact_tok_s"] / max(best["llamacpp"]),
                       int8_x_llamacpp=row["int8_tok_s"] / max(best["llamacpp"]))
        rows.append(row)
        print_table(rows[-1:], COLS)
    print()
    print_table(rows, COLS)
    name = args.out or ("int8_act_ab" if args.threads == 2 else f"int8_act_ab_{args.threads}thread")
    write_results(name, {"threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens,
                         "loadavg_end": list(os.getloadavg()), "rows": rows})


if __name__ == "__main__":
    main()
