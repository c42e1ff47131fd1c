"""What does the library's Generator decode at on a GPU, with and without CUDA graphs (and with the lookahead launch)?

bench/gpu_bench.py times the model with its own static contexts; this times the product path
(`Generator.iterate`, paged cache, sampling, streaming) on the same kind of checkpoint: decode at each batch size, and
a 2,048-token prompt's prefill until its first token (512-token chunks, the default, and one chunk).

    python bench/gpu_generator.py --model /tmp/exl_bench/gptq [--new-tokens 64] [--batches 1,8] [--chunks 512,2048] [--prompt-tokens 2048]

Writes bench/results/gpu_generator.json (and $OUT/gpu_generator.json when OUT is set).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import print_table, write_results  # noqa: E402
from exl_core.cache import Cache  # noqa: E402
from exl_core.generation import Generator, Job  # noqa: E402
from exl_core.generation.sampling import SamplerSettings  # noqa: E402
from exl_core.loader import load_model  # noqa: E402


def decode_tok_s(model, batch: int, new_tokens: int, graphs: bool, lookahead: bool = False) -> float:
    gen = Generator(model, Cache(model, max_tokens=batch * 512, page_size=256), None, cuda_graphs=graphs,
                    lookahead=lookahead)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, model.config.vocab_size, (128,), generator=g).tolist() for _ in range(batch)]

    def run(n):
        jobs = gen.enqueue([Job(p, max_new_tokens=n, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False)
                            for p in prompts])
        while any(j.fed < j.prompt_len for j in jobs) or gen.waiting:     # prefill is not timed
            gen.iterate()
        torch.cuda.synchronize()
        t0, n0 = time.perf_counter(), gen.stats.generated_tokens
        while gen.has_work():
            gen.iterate()
        torch.cuda.synchronize()
        return (gen.stats.generated_tokens - n0) / (time.perf_counter() - t0)
    run(8)                                           # warm-up: kernels, allocator, graph capture
    return run(new_tokens)


def prompt_tok_s(model, tokens: int, chunk: int) -> float:
    """A fresh `tokens`-token prompt through the Generator until its first sampled token (the paged cache's
    prefill: `chunk`-token chunks), tok/s of prompt; best of 3 after a warm-up (bench/gpu_bench.py's prompt2048 times
    the model's forward over its own contiguous cache)."""
    gen = Generator(model, Cache(model, max_tokens=tokens + 64, page_size=256), None,
                    max_batch_tokens=max(2048, chunk), max_chunk_size=chunk)
    g = torch.Generator().manual_seed(tokens + chunk)
    best = 0.0
    for i in range(4):
        ids = torch.randint(100, model.config.vocab_size, (tokens,), generator=g).tolist()   # no prefix reuse
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        job = gen.enqueue(Job(ids, max_new_tokens=1, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False))
        while not job.generated:
            gen.iterate()
        torch.cuda.synchronize()
        if i:                                        # the first pass warms kernels and the allocator
            best = max(best, tokens / (time.perf_counter() - t0))
        while gen.has_work():
            gen.iterate()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes ('' none: the prompts only)")
    ap.add_argument("--chunks", default="512,2048", help="prefill chunk sizes of the prompt")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    a = ap.parse_args()
    model, _ = load_model(a.model, device="cuda", dtype=torch.float16, load_tokenizer=False)
    rows = []
    for b in (int(x) for x in a.batches.split(",") if x):
        eager = decode_tok_s(model, b, a.new_tokens, graphs=False)
        graphed = decode_tok_s(model, b, a.new_tokens, graphs=True, lookahead=False)
        row = {"batch": b, "eager_tok_s": eager, "graphs_tok_s": graphed, "speedup": graphed / eager}
        try:                                     # a failure here must not cost the figures above
            ahead = decode_tok_s(model, b, a.new_tokens, graphs=True, lookahead=True)
            row.update(graphs_lookahead_tok_s=ahead, lookahead_ratio=ahead / graphed)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["lookahead_error"] = repr(e)[:300]
        rows.append(row)
        print_table(rows[-1:], list(rows[-1]))
    if rows:
        print()
        print_table(rows, ["batch", "eager_tok_s", "graphs_tok_s", "speedup", "graphs_lookahead_tok_s",
                           "lookahead_ratio"])
    prompts = []
    for c in (int(x) for x in a.chunks.split(",") if x):
        try:
            prompts.append({"prompt_tokens": a.prompt_tokens, "chunk": c,
                            "prompt_tok_s": prompt_tok_s(model, a.prompt_tokens, c)})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            prompts.append({"prompt_tokens": a.prompt_tokens, "chunk": c, "error": repr(e)[:300]})
    print_table(prompts, ["prompt_tokens", "chunk", "prompt_tok_s"])
    path = write_results("gpu_generator", {"model": str(a.model), "config_layers": model.config.num_hidden_layers,
                                           "new_tokens": a.new_tokens, "prompt_tokens": 128, "rows": rows,
                                           "prompts": prompts})
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])


if __name__ == "__main__":
    main()
