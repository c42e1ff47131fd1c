"""The Generator's lookahead launch (generation/lookahead.py) on a GPU: the recorded graphs replayed a step early,
with the sampler's ids copied into their input on the device and the tokens read through pinned memory, give what
the graphs give replayed after the host read the tokens. (The launch order itself is tested on the CPU,
tests/test_generator_lookahead.py; this file runs in gpu.sh's second test process, after the paged attention's.)"""
from __future__ import annotations

import random

import pytest
import torch
from test_cuda_graphs import GREEDY, _jobs

from exl_core.cache import Cache
from exl_core.generation import Generator, Job
from exl_core.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama", seed=4, vocab_size=500, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_lookahead_launch_gives_the_same_tokens_on_the_gpu(tiny, dtype):
    """Recorded graphs replayed a step early with the sampler's ids copied on the device (generation/lookahead.py):
    the same tokens and log-probabilities, bit for bit, as the graphs replayed after the host read the tokens --
    also where a callback ends a job after its next step was launched (that step dropped, the batch re-run)."""
    model, _ = load_model(tiny, device="cuda", dtype=dtype, load_tokenizer=False)
    seed = random.randrange(1 << 20)

    def run(lookahead, stop_third_at=None):
        gen = Generator(model, Cache(model, max_tokens=2048, page_size=16), None, max_batch_tokens=256,
                        max_chunk_size=64, cuda_graphs=True, lookahead=lookahead)
        cb = (lambda res: len(res.job.generated) < stop_third_at) if stop_third_at else None    # noqa: E731
        jobs = gen.enqueue([Job(j.input_ids, max_new_tokens=j.max_new_tokens, sampler=GREEDY, stop_on_eos=False,
                                return_logprobs=True, callback=cb if i == 2 else None)
                            for i, j in enumerate(_jobs(model.config.vocab_size, seed))])
        while gen.has_work():
            gen.iterate()
        return [(j.generated, list(j.logprobs), j.finish_reason) for j in jobs], gen

    plain, _ = run(False)
    ahead, gen = run(True)
    assert gen.graphs.capture and gen.stats.lookahead_used > 0
    assert ahead == plain, f"seed {seed}"
    plain, _ = run(False, 5)                                # the third job stopped by its callback mid-way
    ahead, gen = run(True, 5)
    assert plain[2][2] == "callback" and gen.stats.lookahead_dropped >= 1
    assert ahead == plain, f"seed {seed}"
