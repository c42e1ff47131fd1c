"""CPU decode and prompt speed of SmolLM2-135M: exl_core vs its peers, in one run.

Rows: exl_core dense fp32 (native generator), exl_core GPTQ 4-bit g128 and EXL2 4.0 bpw
(when the formats exist), the same two with `activations="int8"` (int8-activation decode
kernels; prompt rows keep the exact path), with `prefill="bf16"` (bf16-activation prompt
kernels for calls of 9+ rows; this batch-1 decode keeps the exact path) and with both (`--formats gptq-int8-bf16`), HF transformers `generate` (fp32, same dense weights) and
llama.cpp through llama-cpp-python on the original Q4_1 GGUF (when `--llamacpp-python`
points at an interpreter that has it; it lives in its own environment because it compiles
for ~10 minutes).

    python bench/cpu_decode.py [--threads 2] [--new-tokens 128] [--prompt-tokens 512]
        [--llamacpp-python /path/to/venv/bin/python] [--skip-hf]

Decode tokens/s: batch 1, `--new-tokens` tokens after a short prompt, EOS ignored, time
after the first token. Prompt tokens/s: one forward pass over `--prompt-tokens` tokens
(random ids from a fixed seed: speed does not depend on the text), the best of
`--prompt-repeats` timed passes (default 1) for every engine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import greedy_decode_tok_s, print_table, write_results  # noqa: E402

LLAMACPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, n_prompt, n_new, decode_prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
repeats = int(sys.argv[6]) if len(sys.argv) > 6 else 1
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=max(1024, n_prompt + 16),
            n_batch=n_prompt, verbose=False)
import random
random.seed(0)
prompt = [random.randrange(100, 49000) for _ in range(n_prompt)]
llm.eval(prompt[:8]); llm.reset()                      # warm-up
t_prompt = float("inf")
for _ in range(repeats):                               # best of `repeats` prompt passes
    t0 = time.perf_counter(); llm.eval(prompt); t_prompt = min(t_prompt, time.perf_counter() - t0)
    llm.reset()
llm.eval(decode_prompt)
t2 = time.perf_counter()
for _ in range(n_new):
    tok = llm.sample(temp=0.0)
    llm.eval([tok])
t3 = time.perf_counter()
print(json.dumps({"prompt_tok_s": n_prompt / t_prompt, "decode_tok_s": n_new / (t3 - t2)}))
"""


def bench_exl(folder: Path, label: str, n_prompt: int, n_new: int, decode_prompt: list[int],
              head: str = "exact", activations: str = "exact", prefill: str = "exact", repeats: int = 1) -> dict:
    from exl_core.cache import Cache
    from exl_core.generation import Generator
    from exl_core.loader import load_model
    from exl_core.model.context import ContiguousContext

    model, tok = load_model(folder, head=head, activations=activations, prefill=prefill)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 49000, (n_prompt,), generator=g)
    with torch.inference_mode():  # prompt: one forward pass, logits of the last row only
        def prefill():
            ctx = ContiguousContext([n_prompt], [None], logit_rows=torch.tensor([n_prompt - 1]))
            model.forward(prompt, ctx)
        prefill()
        t_prompt = float("inf")
        for _ in range(repeats):                       # best of `repeats` prompt passes
            t0 = time.perf_counter()
            prefill()
            t_prompt = min(t_prompt, time.perf_counter() - t0)

    cache = Cache(model, max_tokens=len(decode_prompt) + n_new + 512)
    gen = Generator(model, cache, tok)

    greedy_decode_tok_s(gen, decode_prompt, n_new)  # warm-up (also fills the prefix cache; decode is timed)
    return {"engine": label, "prompt_tok_s": n_prompt / t_prompt,
            "decode_tok_s": greedy_decode_tok_s(gen, decode_prompt, n_new)}


def bench_hf(folder: Path, n_prompt: int, n_new: int, decode_prompt: list[int]) -> dict:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 49000, (1, n_prompt), generator=g)
    with torch.inference_mode():
        hf(prompt[:, :8])
        t0 = time.perf_counter()
        hf(prompt, logits_to_keep=1)
        t_prompt = time.perf_counter() - t0
        ids = torch.tensor([decode_prompt])
        kw = dict(do_sample=False, pad_token_id=0)
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        t_all = time.perf_counter() - t0
    return {"engine": "hf transformers fp32", "prompt_tok_s": n_prompt / t_prompt,
            "decode_tok_s": (n_new - 1) / (t_all - t_first)}


def bench_llamacpp(python: str, gguf: Path, threads: int, n_prompt: int, n_new: int, decode_prompt,
                   repeats: int = 1) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(LLAMACPP_SCRIPT)
    out = subprocess.run([python, f.name, str(gguf), str(threads), str(n_prompt), str(n_new),
                          json.dumps(decode_prompt), str(repeats)], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"engine": "llama.cpp Q4_1 (llama-cpp-python)", **res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--llamacpp-python", default=None)
    ap.add_argument("--prompt-repeats", type=int, default=1,
                    help="time this many prompt passes per engine (exl_core and llama.cpp alike), keep the best")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", "--name", dest="out", default="cpu_decode",
                    help="results name (bench/results/NAME.json)")
    ap.add_argument("--formats", default="dense,gptq,exl2,gptq-int8,exl2-int8,gptq-bf16,exl2-bf16",
                    help="rows; NAME-int8 = that format with activations='int8', NAME-bf16 with "
                         "prefill='bf16', NAME-int8-bf16 with both")
    ap.add_argument("--head", default="int8", choices=["exact", "bf16", "int8"],
                    help="output layer of the quantized rows (the dense row keeps the exact fp32 head)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from exl_core.default_model import default_dense_path, smollm2_gguf_path
    from exl_core.tokenizer import Tokenizer
    dense = default_dense_path()
    tok = Tokenizer.from_folder(dense)
    decode_prompt = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon."}],
                                            tokenize=True)
    rows = []
    variants = {"dense": (dense, "exl_core dense fp32", "exact", "exact", "exact")}
    wanted = args.formats.split(",")
    from quantized_models import quantized_smollm2
    for fmt in ("gptq", "exl2"):
        name = "gptq 4-bit" if fmt == "gptq" else "exl2 4.0bpw"
        for suffix, act, pre, note in (("", "exact", "exact", ""), ("-int8", "int8", "exact", ", int8 act."),
                                       ("-bf16", "exact", "bf16", ", bf16 prefill"),
                                       ("-int8-bf16", "int8", "bf16", ", int8 act., bf16 prefill")):
            if fmt + suffix in wanted:
                variants[fmt + suffix] = (quantized_smollm2(fmt), f"exl_core {name} ({args.head} head{note})",
                                          args.head, act, pre)
    for key in wanted:
        if key in variants:
            folder, label, head, act, pre = variants[key]
            rows.append(bench_exl(folder, label, args.prompt_tokens, args.new_tokens, decode_prompt, head, act,
                                  pre, args.prompt_repeats))
            print_table(rows[-1:], ["engine", "prompt_tok_s", "decode_tok_s"])
    if not args.skip_hf:
        rows.append(bench_hf(dense, args.prompt_tokens, args.new_tokens, decode_prompt))
    if args.llamacpp_python:
        rows.append(bench_llamacpp(args.llamacpp_python, smollm2_gguf_path(), args.threads, args.prompt_tokens,
                                   args.new_tokens, decode_prompt, args.prompt_repeats))
    peers = {r["engine"]: r for r in rows if not r["engine"].startswith("exl_core")}
    for r in rows:
        for name, p in peers.items():
            short = "hf" if name.startswith("hf") else "llamacpp"
            r[f"decode_x_{short}"] = r["decode_tok_s"] / p["decode_tok_s"]
            r[f"prompt_x_{short}"] = r["prompt_tok_s"] / p["prompt_tok_s"]
    cols = ["engine", "prompt_tok_s", "decode_tok_s"] + sorted({k for r in rows for k in r if "_x_" in k})
    print()
    print_table(rows, cols)
    write_results(args.out, {"threads": args.threads, "new_tokens": args.new_tokens, "head": args.head,
                             "force_kernel": os.environ.get("EXL_CORE_FORCE_KERNEL", ""),
                             "prompt_tokens": args.prompt_tokens, "prompt_repeats": args.prompt_repeats, "rows": rows})


if __name__ == "__main__":
    main()
