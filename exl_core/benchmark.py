"""`exl bench`: how fast this machine runs a model through the dynamic generator.

One measurement per batch size: `batch` jobs of `prompt_tokens` random token ids each (seeded; random ids, so
no prompt shares a prefix with another and the prefix index saves nothing), greedy, `new_tokens` new tokens each
with EOS ignored.  Prompt tokens/s is every prompt's tokens over the time until every job has its first token;
decode tokens/s is the tokens made after that moment over the rest of the run (tokens an early job decoded while a
later one still prefilled count toward neither).  The project's benchmarks against
peers (HF transformers, llama.cpp, ExLlamaV2) are the scripts under bench/; this is the quick check a user runs.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class BenchRow:
    batch: int
    prompt_tokens: int             # a job's
    new_tokens: int                # a job's (asked)
    generated: int                 # all jobs' new tokens
    prompt_tok_s: float
    decode_tok_s: float
    peak_mem_gb: float             # CUDA: the device's peak allocation; CPU: the process's peak resident set
    forward_passes: int            # the timed run's (new_tokens when every job prefills in the first and decodes
                                   # together after it)

    def as_dict(self) -> dict:
        return asdict(self)


def _peak_mem_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss       # Linux: KiB (macOS: bytes)
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def check_sizes(batch: int, prompt_tokens: int, new_tokens: int) -> None:
    if batch < 1 or prompt_tokens < 1 or new_tokens < 2:
        raise InputError(f"bench: batch {batch}, prompt tokens {prompt_tokens} and new tokens {new_tokens} must be "
                         ">= 1, >= 1 and >= 2 (decode speed needs a token after the first)")


def measure(model, tokenizer, batch: int, prompt_tokens: int, new_tokens: int, seed: int = 0,
            warmup: bool = True) -> BenchRow:
    """One BenchRow: `batch` random prompts of `prompt_tokens` ids, `new_tokens` greedy tokens each (after one
    short untimed job with `warmup`)."""
    from .cache import Cache
    from .generation import Generator, Job
    from .generation.sampling import SamplerSettings
    check_sizes(batch, prompt_tokens, new_tokens)
    vocab = model.config.vocab_size
    gen_ids = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=gen_ids).tolist() for _ in range(batch)]
    page = 256
    # whole pages a job: a cache of batch * (prompt + new) tokens holds fewer jobs at once when a job's tokens do not
    # fill its last page, and the rest would wait (measured: 3 of 4 jobs of 64 + 16 tokens in 576 tokens)
    cache = Cache(model, max_tokens=batch * page * -(-(prompt_tokens + new_tokens) // page), page_size=page)
    gen = Generator(model, cache, tokenizer)
    greedy = SamplerSettings(temperature=0.0)
    if warmup:              # the first forward pays one-time costs (weights packed for the fused kernels, allocations)
        warm = Job(prompts[0][:8], max_new_tokens=2, sampler=greedy, stop_on_eos=False)
        gen.enqueue(warm)
        while gen.has_work():
            gen.iterate()
    jobs = [Job(p, max_new_tokens=new_tokens, sampler=greedy, stop_on_eos=False) for p in prompts]
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
    passes0 = gen.stats.forward_passes
    t0 = time.perf_counter()
    gen.enqueue(jobs)
    first_all, n0 = None, 0
    while gen.has_work():
        gen.iterate()
        if first_all is None and all(j.generated for j in jobs):
            first_all = time.perf_counter()
            n0 = sum(len(j.generated) for j in jobs)     # early jobs may decode while later ones still prefill
    t1 = time.perf_counter()
    generated = sum(len(j.generated) for j in jobs)
    first_all = first_all or t1
    decode = (generated - n0) / (t1 - first_all) if t1 > first_all else 0.0
    return BenchRow(batch, prompt_tokens, new_tokens, generated, batch * prompt_tokens / (first_all - t0), decode,
                    _peak_mem_gb(model.device), gen.stats.forward_passes - passes0)


def machine_info(device: torch.device) -> dict:
    """What the figures were measured on: the GPU's name, or the CPU's model name (Linux: /proc/cpuinfo)."""
    import platform
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if name is None:
        try:
            name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                         if line.startswith("model name")), None)
        except OSError:
            name = None
    return {"device": name or platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def format_table(rows: list[BenchRow]) -> str:
    head = f"{'batch':>5} {'prompt':>6} {'new':>5} {'prompt tok/s':>13} {'decode tok/s':>13} {'peak GB':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.batch:>5} {r.prompt_tokens:>6} {r.new_tokens:>5} {r.prompt_tok_s:>13.1f} "
                     f"{r.decode_tok_s:>13.1f} {r.peak_mem_gb:>8.2f}")
    return "\n".join(lines)
