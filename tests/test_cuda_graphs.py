"""Decode steps through GraphedDecoder (generation/cuda_graphs.py).

On the CPU the decoder runs its static context eagerly (capture=False): the padding of block
tables to width buckets and the buffer copies must not change a single token. On a GPU the
recorded graphs must reproduce the same decoder run eagerly, logits bit for bit.
"""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.cache import Cache
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings
from exl_core.loader import load_model
from exl_core.testing import assert_same_tokens_up_to_ties

GREEDY = SamplerSettings(temperature=0.0)


def _jobs(vocab, seed, logprobs=False):
    rnd = random.Random(seed)
    # lengths spanning several 16-token pages; different max_new_tokens so the batch shrinks
    return [Job([rnd.randrange(3, vocab) for _ in range(n)], max_new_tokens=m, sampler=GREEDY, stop_on_eos=False,
                return_logprobs=logprobs)
            for n, m in ((5, 12), (40, 7), (19, 20), (70, 3))]


def _run(model, graphs, seed, logprobs=False):
    """Tokens per job ((tokens, logprobs) per job with logprobs=True) and the generator."""
    gen = Generator(model, Cache(model, max_tokens=2048, page_size=16), None, max_batch_tokens=256, max_chunk_size=64,
                    cuda_graphs=graphs)
    jobs = gen.enqueue(_jobs(model.config.vocab_size, seed, logprobs))
    while gen.has_work():
        gen.iterate()
    return [(j.generated, list(j.logprobs)) if logprobs else j.generated for j in jobs], gen


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama", seed=4, vocab_size=500, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("attention", [None, "gathered_sdpa"])
def test_static_decode_context_gives_the_same_tokens(tiny, attention, monkeypatch):
    from exl_core.ops import dispatch
    if attention:                      # the GPU's attention path, here on the CPU
        monkeypatch.setitem(dispatch._FORCED, "attention", attention)
    model, _ = load_model(tiny, load_tokenizer=False)
    seed = random.randrange(1 << 20)
    plain, _ = _run(model, False, seed)
    static, gen = _run(model, True, seed)
    assert gen.graphs is not None and not gen.graphs.capture
    assert len(gen.graphs._entries) >= 3                       # batch sizes 4, 3, 2, 1 were served
    assert static == plain


def test_static_decode_context_with_sliding_window_pages(tiny_model_factory, monkeypatch):
    """Released window pages (-1 in the tables) travel through the packed host buffer unchanged."""
    from exl_core.generation import cuda_graphs
    folder = tiny_model_factory("mistral", seed=6, vocab_size=500, num_attention_heads=4, num_key_value_heads=2,
                                sliding_window=20)
    model, _ = load_model(folder, load_tokenizer=False)
    released = []
    fill = cuda_graphs.StaticDecodeContext.fill

    def spy(self, ids, tables):
        released.append(any(-1 in t.pages for t in tables))
        fill(self, ids, tables)
        assert (self.block_table == -1).any().item() == (released[-1] or any(
            len(t.pages) < self.width for t in tables))
    monkeypatch.setattr(cuda_graphs.StaticDecodeContext, "fill", spy)
    seed = random.randrange(1 << 20)
    plain, _ = _run(model, False, seed)
    static, gen = _run(model, True, seed)
    assert gen.graphs is not None and len(gen.graphs._entries) >= 3
    assert any(released), "no released window page reached a graphed step"
    assert static == plain


def _windowed_runs(model, prompt, n, each_step=lambda gen: None):
    """One job of `n` new tokens, eager and then through the graphed decoder (its static context, run eagerly on the
    CPU): ([generated tokens of each], the graphed run's Generator)."""
    out = []
    for graphs in (False, True):
        gen = Generator(model, Cache(model, max_tokens=64, page_size=8), max_batch_tokens=64, max_chunk_size=16,
                        cuda_graphs=graphs)
        job = gen.enqueue(Job(prompt, max_new_tokens=n, sampler=GREEDY, stop_on_eos=False))
        while gen.has_work():
            gen.iterate()
            if graphs:
                each_step(gen)
        assert job.finish_reason == "length"
        out.append(job.generated)
    return out, gen


def test_windowed_job_decodes_past_the_graphs_rope_table(tiny_model_factory):
    """A sliding window lets a job run past the cache; the graphs' rope table, sized once from the config and the
    cache, ended such a job (an InputError on the CPU; by the rope kernel's range check, NaN rows on a GPU). Steps
    past the table now run eagerly, with the same tokens."""
    folder = tiny_model_factory("mistral", seed=0, vocab_size=512, sliding_window=12, max_position_embeddings=64)
    model, _ = load_model(folder, load_tokenizer=False)
    out, gen = _windowed_runs(model, [random.Random(1).randrange(3, 512) for _ in range(5)], 300)
    assert gen.graphs.num_positions < 300 and gen.graphs._entries      # early steps did take the graph path
    assert out[0] == out[1]


def test_graph_entries_of_a_growing_window_table_stay_bounded(tiny_model_factory, monkeypatch):
    """A windowed job's block table widens with its length (released pages keep their places): one recorded shape a
    bucket, up to the rope table's length. The least recently used shapes are dropped past MAX_ENTRIES, with the same
    tokens, and `recorded` counts every recording."""
    from exl_core.generation import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "WIDTH_BUCKET_TOKENS", 8)      # a new width every page of 8
    monkeypatch.setattr(cuda_graphs, "MAX_ENTRIES", 3)
    folder = tiny_model_factory("mistral", seed=2, vocab_size=512, sliding_window=12)
    model, _ = load_model(folder, load_tokenizer=False)
    sizes = []
    out, gen = _windowed_runs(model, [random.Random(2).randrange(3, 512) for _ in range(5)], 120,
                              lambda g: sizes.append(len(g.graphs._entries)))
    assert max(sizes) == 3 and max(w for _, w in gen.graphs._entries) >= 14     # 15 widths came and went
    assert gen.graphs.recorded >= 15
    assert out[0] == out[1]


def test_graphs_off_by_default_on_cpu(tiny):
    model, _ = load_model(tiny, load_tokenizer=False)
    assert Generator(model, Cache(model, max_tokens=256)).graphs is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recorded_graphs_replay_the_eager_static_forward(tiny):
    from exl_core.generation.cuda_graphs import GraphedDecoder
    model, _ = load_model(tiny, device="cuda", dtype=torch.float32, load_tokenizer=False)
    seed = random.randrange(1 << 20)
    plain, _ = _run(model, False, seed, logprobs=True)
    graphed, gen = _run(model, True, seed, logprobs=True)
    assert gen.graphs.capture and gen.graphs.replays > 0
    # the eager generator's paged attention and the graphs' gathered attention round differently:
    # equal up to near-ties (the recorded-vs-eager comparison over one static context below is exact)
    for (ta, la), (tb, lb) in zip(plain, graphed):
        assert_same_tokens_up_to_ties(ta, la, tb, lb, 2e-3)
    # logits of one step, recorded vs eager over the same static context: identical
    cache = Cache(model, max_tokens=512, page_size=16)
    outs = []
    for capture in (False, True, True):
        gen = Generator(model, cache, None, cuda_graphs=False)
        gen.graphs = GraphedDecoder(model, cache, capture=capture)
        job = gen.enqueue(Job(list(range(3, 40)), max_new_tokens=4, sampler=GREEDY, stop_on_eos=False,
                              return_logprobs=True))
        while gen.has_work():
            gen.iterate()
        outs.append((job.generated, list(job.logprobs)))
    assert outs[0] == outs[1] == outs[2]

