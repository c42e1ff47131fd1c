"""The Generator's pipelined decode (generation/lookahead.py): with the next decode step launched before this step's
tokens are read, every job gets the same tokens, log-probabilities, text and finish reason as without -- through
batches that shrink, stop tokens and EOS that end a job after its next step was launched, callbacks that stop a job or
enqueue another, seeded sampling with penalties, token filters and a follow-up that reuses a finished job's pages.
On the CPU the graphs' static context runs eagerly (GraphedDecoder capture=False), so the launch order is what is
tested here; tests/test_cuda_graphs.py checks the recorded graphs against it on a GPU."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.cache import Cache
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings
from exl_core.loader import load_model

GREEDY = SamplerSettings(temperature=0.0)


@pytest.fixture(autouse=True)
def _fixed_output_buffers(monkeypatch):
    """A recorded graph writes its logits into one buffer per shape, which the next replay overwrites; the CPU's
    eager static context returns a new tensor each step.  Every test here runs with the graph's behaviour, so a
    read of the logits after the next step's launch shows."""
    from exl_core.generation.cuda_graphs import GraphedDecoder
    real, buffers = GraphedDecoder.run, {}

    def run(self, ids, tables, device_ids=None):
        out = real(self, ids, tables, device_ids)
        buf = buffers.setdefault((id(self), tuple(out.shape)), torch.empty_like(out))
        return buf.copy_(out)
    monkeypatch.setattr(GraphedDecoder, "run", run)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    folder = tiny_model_factory("llama", seed=12, vocab_size=500, num_attention_heads=4, num_key_value_heads=2)
    return load_model(folder, load_tokenizer=False)[0]


def _prompts(seed, lens=(5, 40, 19, 70)):
    rnd = random.Random(seed)
    return [[rnd.randrange(3, 500) for _ in range(n)] for n in lens]


def _run(model, lookahead, make_jobs, hook=None):
    """Runs make_jobs(gen)'s jobs to the end; hook(gen, step) runs before every iterate (and once when nothing is
    left), returning jobs to follow too.  Returns what every job ended with, and the generator."""
    gen = Generator(model, Cache(model, max_tokens=4096, page_size=16), None, max_batch_tokens=256,
                    max_chunk_size=64, cuda_graphs=True, lookahead=lookahead)
    assert (gen.lookahead is not None) == lookahead
    jobs = list(gen.enqueue(make_jobs(gen)))
    step = 0
    while True:
        if hook is not None:
            jobs += hook(gen, step) or []
        if not gen.has_work():
            break
        gen.iterate()
        step += 1
    return [(j.generated, j.logprobs, j.finish_reason) for j in jobs], gen


def _both(model, make_jobs, hook=None):
    plain, _ = _run(model, False, make_jobs, hook)
    ahead, gen = _run(model, True, make_jobs, hook)
    assert ahead == plain
    return plain, gen.stats


def test_shrinking_batch_same_tokens_and_launches_ahead(model):
    prompts = _prompts(1)
    out, stats = _both(model, lambda g: [Job(p, max_new_tokens=m, sampler=GREEDY, stop_on_eos=False,
                                             return_logprobs=True) for p, m in zip(prompts, (12, 7, 20, 3))])
    assert [len(t) for t, _, _ in out] == [12, 7, 20, 3]
    assert stats.lookahead_used > 10              # most decode steps were launched a step early
    assert stats.lookahead_dropped == 0           # a job at its limit is foreseen: no launch wasted


def test_stop_tokens_and_eos_end_jobs_after_their_next_step_was_launched(model):
    prompts = _prompts(2)
    free, _ = _run(model, False, lambda g: [Job(p, max_new_tokens=16, sampler=GREEDY, stop_on_eos=False)
                                            for p in prompts])
    stop_a, stop_b = free[0][0][5], free[2][0][9]   # tokens that come up mid-generation
    model.config.eos_token_ids = [free[1][0][3]]
    try:
        out, stats = _both(model, lambda g: [Job(p, max_new_tokens=16, sampler=GREEDY, stop=[stop_a, stop_b],
                                                 stop_on_eos=i == 1) for i, p in enumerate(prompts)])
    finally:
        model.config.eos_token_ids = []
    assert {r for _, _, r in out} >= {"stop", "eos"}
    assert stats.lookahead_dropped >= 1 and stats.lookahead_used > 0


def test_callbacks_stopping_a_job_or_enqueuing_another(model):
    prompts = _prompts(3)
    late = _prompts(4, (9,))[0]

    def make(gen):
        def stop_at_6(res):
            return len(res.job.generated) < 6

        def enqueue_at_4(res):
            if len(res.job.generated) == 4:
                gen.enqueue(Job(late, max_new_tokens=8, sampler=GREEDY, stop_on_eos=False, identifier="late"))
        return [Job(prompts[0], max_new_tokens=15, sampler=GREEDY, stop_on_eos=False, callback=stop_at_6),
                Job(prompts[1], max_new_tokens=15, sampler=GREEDY, stop_on_eos=False, callback=enqueue_at_4),
                Job(prompts[2], max_new_tokens=15, sampler=GREEDY, stop_on_eos=False)]
    extra = []

    def collect(gen, step):                      # the job the callback enqueued, to compare it too
        found = [j for j in gen.waiting if j.identifier == "late" and j not in extra]
        extra.extend(found)
        return found
    out, stats = _both(model, make, collect)
    assert out[0][2] == "callback" and len(out[0][0]) == 6
    assert len(out) == 4 and len(out[3][0]) == 8   # the late job ran to its limit
    assert stats.lookahead_dropped >= 2            # the stopped job, the job that joined


def test_seeded_sampling_with_penalties_and_a_token_filter(model):
    prompts = _prompts(5)
    banned = 77

    def ban(ids, row):
        row[banned] = float("-inf")
    settings = SamplerSettings(temperature=0.9, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.2)
    out, stats = _both(model, lambda g: [Job(p, max_new_tokens=14, sampler=settings, seed=i, stop_on_eos=False,
                                             token_filter=ban if i % 2 else None, return_logprobs=True)
                                         for i, p in enumerate(prompts)])
    assert all(banned not in out[i][0] for i in (1, 3))
    assert stats.lookahead_used > 0


def test_follow_up_reuses_pages_of_a_job_whose_last_step_was_dropped(model):
    """A job ends by a stop token after its next step was launched; a follow-up prompt holding its whole text
    reuses its full pages (their K/V must be the job's, untouched by the dropped step)."""
    p = _prompts(6, (40,))[0]
    free, _ = _run(model, False, lambda g: [Job(p, max_new_tokens=30, sampler=GREEDY, stop_on_eos=False)])
    stop = free[0][0][26]
    first = [None]

    def make(gen):
        job = Job(p, max_new_tokens=30, sampler=GREEDY, stop=[stop], stop_on_eos=False)
        first[0] = job
        return [job]

    def follow(gen, step):
        job = first[0]
        if job.done and not getattr(job, "_followed", False):
            job._followed = True
            return [gen.enqueue(Job(job.tokens[:-1] + [5, 6, 7], max_new_tokens=10, sampler=GREEDY,
                                    stop_on_eos=False))]
    out, stats = _both(model, make, follow)
    assert out[0][2] == "stop" and len(out) == 2 and len(out[1][0]) == 10
    assert stats.lookahead_dropped >= 1 and stats.reused_tokens >= 48     # the follow-up took the full pages


def test_off_without_graphs_or_with_speculative_decoding(model):
    assert Generator(model, Cache(model, max_tokens=256), lookahead=True).lookahead is None      # CPU: no graphs
    g = Generator(model, Cache(model, max_tokens=256), cuda_graphs=True, lookahead=True, ngram_draft=True)
    assert g.lookahead is None
    assert Generator(model, Cache(model, max_tokens=256), cuda_graphs=True).lookahead is not None   # default: on


def test_a_row_that_cannot_be_sampled_after_the_launch_ends_only_its_job(model, monkeypatch):
    """The greedy sampler's row check is read with the ids, after the next step was launched
    (sampling.sample_batch_unchecked): a NaN row found then drops that step, cancels its job and raises, as
    without the lookahead; the other jobs go on with the same tokens."""
    from exl_core.errors import InputError
    prompts = _prompts(7)
    forward = model.forward

    def nan_at_5(ids, ctx):         # the model's row of the third job's sixth new token (position 19 + 5 - 1) is NaN
        out = forward(ids, ctx)     # (a token filter writing it in place is that filter's error, caught before)
        hit = (ctx.positions == 23).nonzero()
        if len(hit) and out.shape[0] == ctx.positions.numel():     # decode steps only: one row a job
            out[int(hit[0, 0])] = float("nan")
        return out
    monkeypatch.setattr(model, "forward", nan_at_5)

    def run(lookahead):
        gen = Generator(model, Cache(model, max_tokens=4096, page_size=16), None, max_batch_tokens=256,
                        max_chunk_size=64, cuda_graphs=True, lookahead=lookahead)
        jobs = gen.enqueue([Job(p, max_new_tokens=12, sampler=GREEDY, stop_on_eos=False) for p in prompts])
        raised = 0
        while gen.has_work():
            try:
                gen.iterate()
            except InputError as e:
                assert "NaN" in str(e)
                raised += 1
        return [(j.generated, j.finish_reason) for j in jobs], raised, gen.stats
    plain, raised_plain, _ = run(False)
    ahead, raised_ahead, stats = run(True)
    assert raised_plain == raised_ahead == 1
    assert ahead == plain and plain[2] == (plain[2][0], "cancelled") and len(plain[2][0]) == 5
    assert stats.lookahead_dropped >= 1


def test_unchecked_sampler_returns_what_sample_batch_does():
    from exl_core.generation.sampling import sample_batch, sample_batch_unchecked
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    ids, lp, m = sample_batch_unchecked(logits.clone(), GREEDY)
    ref_ids, ref_lp = sample_batch(logits.clone(), GREEDY)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp) and torch.equal(m, logits.amax(1))
    hot = SamplerSettings(temperature=0.7)
    ids, lp, m = sample_batch_unchecked(logits.clone(), hot, rngs=[torch.Generator().manual_seed(i) for i in range(4)])
    ref_ids, ref_lp = sample_batch(logits.clone(), hot, rngs=[torch.Generator().manual_seed(i) for i in range(4)])
    assert m is None and torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)     # checked by sample_batch


def test_an_abandoned_generator_is_freed_without_the_cycle_collector(model):
    """No reference cycle through the lookahead (or elsewhere) keeps a finished Generator alive: on a GPU the cycle
    collector could otherwise free its CUDA graphs inside another generator's graph capture, which invalidates that
    capture (bench/graph_capture_probe.py, stop 31)."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        _, gen = _run(model, True, lambda g: [Job(p, max_new_tokens=4, sampler=GREEDY, stop_on_eos=False)
                                             for p in _prompts(5)])
        assert gen.lookahead is not None
        ref = weakref.ref(gen)
        del gen
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_generator_whose_step_raised_is_freed_without_the_cycle_collector(model, lookahead):
    """The error a step raises (here a job's token filter) and the ones it kept for the caller hold no cycle back to
    the Generator: once the caller drops the error, the Generator is freed without the collector."""
    import gc
    import weakref

    def bad_filter(tokens, logits):
        raise ValueError("filter failed")
    gc.collect()
    gc.disable()
    try:
        gen = Generator(model, Cache(model, max_tokens=4096, page_size=16), None, max_batch_tokens=256,
                        max_chunk_size=64, cuda_graphs=True, lookahead=lookahead)
        gen.enqueue([Job(p, max_new_tokens=4, sampler=GREEDY, stop_on_eos=False) for p in _prompts(6)])
        gen.enqueue(Job(_prompts(7)[0], max_new_tokens=4, sampler=GREEDY, token_filter=bad_filter))
        with pytest.raises(ValueError, match="filter failed"):
            while gen.has_work():
                gen.iterate()
        ref = weakref.ref(gen)
        del gen
        assert ref() is None
    finally:
        gc.enable()
