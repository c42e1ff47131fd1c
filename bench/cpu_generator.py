"""Generator throughput and time-to-first-token on CPU with SmolLM2-135M.

Question: how many tokens/s does the dynamic generator deliver at 1, 4 and 16 concurrent jobs,
and how much does the prefix index cut the time to first token of a prompt that shares a
1,000-token prefix with an earlier one?

    python bench/cpu_generator.py [--new-tokens 64] [--dense] [--threads N]

Model: 4-bit GPTQ (round-to-nearest, exl_core.quantize.rtn) when that module exists, else the
dense import; the output says which. Writes bench/results/cpu_generator.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import print_table, write_results  # noqa: E402
from exl_core.cache import Cache  # noqa: E402
from exl_core.generation import Generator, Job  # noqa: E402
from exl_core.generation.sampling import SamplerSettings  # noqa: E402
from exl_core.loader import load_model  # noqa: E402

GREEDY = SamplerSettings(temperature=0.0)
TOPICS = ["the ocean", "a robot", "Paris", "mathematics", "a small dog", "the moon", "coffee", "winter",
          "a library", "trains", "music", "a garden", "the desert", "chess", "volcanoes", "bread"]


def pick_model(dense: bool):
    from exl_core.default_model import default_dense_path
    if not dense and importlib.util.find_spec("exl_core.quantize.rtn") is not None:
        from quantized_models import quantized_smollm2
        return quantized_smollm2("gptq"), "SmolLM2-135M-Instruct GPTQ 4-bit g128 (RTN)"
    return default_dense_path(progress=False), "SmolLM2-135M-Instruct dense"


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False, special=True)


def throughput(model, tok, n_jobs: int, new_tokens: int) -> dict:
    cache = Cache(model, max_tokens=max(4096, n_jobs * 512), page_size=256)
    gen = Generator(model, cache, tok)
    prompts = [chat_ids(tok, f"Write a long story about {TOPICS[i % len(TOPICS)]}.") for i in range(n_jobs)]
    jobs = [Job(p, max_new_tokens=new_tokens, sampler=GREEDY, stop_on_eos=False) for p in prompts]
    t0 = time.perf_counter()
    gen.enqueue(jobs)
    first = None
    while gen.has_work():
        res = gen.iterate()
        if first is None and any(r.token_ids for r in res):
            first = time.perf_counter()
    t1 = time.perf_counter()
    generated = sum(len(j.generated) for j in jobs)
    decode_steps = new_tokens - 1
    return {"jobs": n_jobs, "prompt_tokens": sum(len(p) for p in prompts), "generated": generated,
            "wall_s": t1 - t0, "total_tok_s": generated / (t1 - t0),
            "decode_tok_s": n_jobs * decode_steps / (t1 - first) if first and t1 > first else None,
            "forward_passes": gen.stats.forward_passes}


def load_hf():
    import transformers
    from exl_core.default_model import default_dense_path
    return transformers.AutoModelForCausalLM.from_pretrained(default_dense_path(progress=False),
                                                             dtype=torch.float32).eval()


def hf_peer(hf, tok, n_jobs: int, new_tokens: int) -> dict:
    """Peer in the same run: transformers' generate() on the dense model (left-padded batch)."""
    prompts = [chat_ids(tok, f"Write a long story about {TOPICS[i % len(TOPICS)]}.") for i in range(n_jobs)]
    width = max(len(p) for p in prompts)
    pad = tok.eos_token_ids and min(tok.eos_token_ids) or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        hf.generate(input_ids=ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2, do_sample=False,
                    pad_token_id=pad)
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad)
        t1 = time.perf_counter()
    generated = (out.shape[1] - width) * n_jobs
    return {"jobs": n_jobs, "generated": generated, "wall_s": t1 - t0, "total_tok_s": generated / (t1 - t0)}


def ttft(model, tok, prefix_len: int = 1000, suffix_len: int = 40, repeat: int = 3) -> dict:
    rng = random.Random(0)
    vocab = [i for i in range(200, 40000)]

    def rand(n):
        return [rng.choice(vocab) for _ in range(n)]

    def first_token_time(gen, ids):
        j = gen.enqueue(Job(ids, max_new_tokens=1, sampler=GREEDY, stop_on_eos=False))
        t0 = time.perf_counter()
        before = gen.stats.forward_tokens
        while not j.done:
            gen.iterate()
        return time.perf_counter() - t0, gen.stats.forward_tokens - before

    cold, warm = [], []
    for _ in range(repeat):
        prefix = rand(prefix_len)
        gen = Generator(model, Cache(model, max_tokens=8192, page_size=256), tok)
        cold.append(first_token_time(gen, prefix + rand(suffix_len)))       # nothing cached
        warm.append(first_token_time(gen, prefix + rand(suffix_len)))       # shares the prefix
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"prompt_tokens": prefix_len + suffix_len, "shared_prefix": prefix_len,
            "ttft_no_reuse_s": med([c[0] for c in cold]), "ttft_shared_prefix_s": med([w[0] for w in warm]),
            "forward_tokens_no_reuse": cold[0][1], "forward_tokens_shared": warm[0][1],
            "speedup": med([c[0] for c in cold]) / med([w[0] for w in warm])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dense", action="store_true", help="use the dense model even if RTN exists")
    ap.add_argument("--threads", type=int, default=None, help="default: all cores, or 1 on a busy box")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = ap.parse_args()
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if args.threads is None:
        # On a box busier than its core count, OpenMP threads spin-wait on each other and one
        # thread is many times faster (measured 0.16 s vs 6 s per decode step at load 19 on 2 cores).
        args.threads = 1 if load1 > (os.cpu_count() or 1) else (os.cpu_count() or 1)
    torch.set_num_threads(args.threads)
    path, label = pick_model(args.dense)
    model, tok = load_model(path)
    print(f"model: {label}  ({path})  dtype={model.dtype}  threads={torch.get_num_threads()}")
    # warm-up: kernels, allocator
    Generator(model, Cache(model, max_tokens=1024), tok).generate("Hello", max_new_tokens=4, sampler=GREEDY)

    rows = [throughput(model, tok, int(c), args.new_tokens) for c in args.concurrency.split(",")]
    print_table(rows, ["jobs", "prompt_tokens", "generated", "wall_s", "total_tok_s", "decode_tok_s",
                       "forward_passes"])
    base = rows[0]["total_tok_s"]
    for r in rows:
        r["vs_1_job"] = r["total_tok_s"] / base
    peers = []
    if not args.no_hf:
        hf = load_hf()
        peers = [hf_peer(hf, tok, int(c), args.new_tokens) for c in args.concurrency.split(",")]
        del hf
        for p, r in zip(peers, rows):
            p["exl_vs_hf"] = r["total_tok_s"] / p["total_tok_s"]
        print("\npeer: transformers generate(), dense fp32, same prompts")
        print_table(peers, ["jobs", "generated", "wall_s", "total_tok_s", "exl_vs_hf"])
    t = ttft(model, tok)
    print()
    print_table([t], ["prompt_tokens", "shared_prefix", "ttft_no_reuse_s", "ttft_shared_prefix_s", "speedup",
                      "forward_tokens_no_reuse", "forward_tokens_shared"])
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    write_results("cpu_generator", {
        "model": label, "model_path": str(path), "dtype": str(model.dtype), "new_tokens": args.new_tokens,
        "sampler": "greedy", "page_size": 256, "throughput": rows, "hf_peer": peers, "ttft": t,
        "load_average": load, "load_average_at_start": load1, "threads": args.threads,
        "note": "total_tok_s = generated tokens / wall time including prefill; decode_tok_s from the first "
                "sampled token to the end. hf_peer: transformers generate() on the DENSE fp32 model with "
                "left-padded batches (exl_vs_hf compares our model above, possibly 4-bit, with it). "
                "The box is shared; load_average shows how busy it was.",
    })


if __name__ == "__main__":
    main()
