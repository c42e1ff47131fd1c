"""Where the Generator's prefill time goes on a GPU: host syncs (torch's sync debug mode, each location counted),
wall time per iterate() (one chunk each), and the torch profiler's busiest host and device ops for one chunked prompt.

    python bench/gen_prefill_probe.py --model /tmp/exl_bench/gptq [--tokens 2048] [--chunk 512]

Why: bench/gpu_generator.py measured a 2,048-token prompt through the Generator at 8,968.9 tok/s with 512-token
chunks and 32,704.7 with one chunk on the H200 (stop 30 call 2), where the bench's own forward runs ~45,000.
Prints only (a diagnostic, no result file).
"""
from __future__ import annotations

import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import gpu_model_cli  # noqa: E402
from exl_core.cache import Cache  # noqa: E402
from exl_core.generation import Generator, Job  # noqa: E402
from exl_core.generation.sampling import SamplerSettings  # noqa: E402


def prompt(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, model.config.vocab_size, (n,), generator=g).tolist()


def run_prompt(gen, ids, per_iter=None):
    job = gen.enqueue(Job(ids, max_new_tokens=1, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False))
    while not job.generated:
        t0 = time.perf_counter()
        gen.iterate()
        if per_iter is not None:
            torch.cuda.synchronize()
            per_iter.append(time.perf_counter() - t0)
    while gen.has_work():
        gen.iterate()


def main() -> None:
    a, model = gpu_model_cli(__doc__, tokens=(int, 2048), chunk=(int, 512))
    gen = Generator(model, Cache(model, max_tokens=a.tokens + 64, page_size=256), None,
                    max_batch_tokens=max(2048, a.chunk), max_chunk_size=a.chunk)
    run_prompt(gen, prompt(model, a.tokens, 1))                      # warm-up
    torch.cuda.synchronize()
    per_iter = []
    t0 = time.perf_counter()
    run_prompt(gen, prompt(model, a.tokens, 2), per_iter)
    print(f"prompt {a.tokens} chunk {a.chunk}: {time.perf_counter() - t0:.4f} s; per iterate (synced) "
          + ", ".join(f"{t * 1e3:.2f} ms" for t in per_iter))
    # host syncs: every synchronizing call's location (the innermost exl_core frame), counted
    where = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        orig = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack() if "exl_core" in f.filename]
            where[(f"{frames[-1].filename.split('exl_core/')[-1]}:{frames[-1].lineno} {frames[-1].name}"
                   if frames else f"{filename}:{lineno}")] += 1
        warnings.showwarning = note
        try:
            run_prompt(gen, prompt(model, a.tokens, 3))
        finally:
            warnings.showwarning = orig
            torch.cuda.set_sync_debug_mode(0)
    print(f"host syncs in one prompt: {sum(where.values())} at {len(where)} places")
    for k, v in where.most_common(20):
        print(f"  {v:6d}  {k}")
    # profiler: busiest host and device ops of one prompt
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_prompt(gen, prompt(model, a.tokens, 4))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
