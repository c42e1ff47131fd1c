"""Generator under churn and faults: page accounting must stay exact whatever happens."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.cache import Cache
from exl_core.errors import CacheFullError, InputError, SamplerError
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings

from test_generator import GREEDY, TinyLM, assert_greedy, assert_pool_idle, rand_prompt, run_all


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["standin", "tiny_llama"])
def model(request):
    if request.param == "standin":
        return TinyLM()
    from exl_core.loader import load_model
    return load_model(request.getfixturevalue("tiny_llama_dir"), load_tokenizer=False)[0]


def test_500_random_jobs_leave_exact_accounting(model):
    rng = random.Random()
    ps = rng.choice([8, 16, 32])
    cache = Cache(model, max_tokens=rng.choice([256, 512]), page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=96, max_chunk_size=rng.choice([16, 32, 48]))
    bases = [rand_prompt(rng.randint(ps, 4 * ps)) for _ in range(4)]       # shared prefixes
    jobs, tokens_seen, checked = [], {}, 0
    n_jobs = 500

    def make():
        kind = rng.random()
        prompt = (rng.choice(bases) if kind < 0.5 else []) + rand_prompt(rng.randint(1, 60))
        stop_after = rng.randint(1, 8) if rng.random() < 0.15 else None
        count = [0]

        def cb(r):
            count[0] += 1
            return not (stop_after is not None and count[0] >= stop_after)
        sampler = GREEDY if rng.random() < 0.5 else SamplerSettings(temperature=rng.uniform(0.5, 1.5),
                                                                    top_k=rng.choice([0, 20]))
        return Job(prompt, max_new_tokens=rng.randint(1, 16), sampler=sampler, seed=rng.randrange(1 << 30),
                   callback=cb, stop=[rng.randrange(model.config.vocab_size)] if rng.random() < 0.2 else None)

    while len(jobs) < n_jobs or gen.has_work():
        for _ in range(rng.randint(0, 4)):
            if len(jobs) < n_jobs:
                jobs.append(gen.enqueue(make()))
        live = [j for j in jobs if not j.done]
        for j in live:
            if rng.random() < 0.02:
                gen.cancel(j)
        for r in gen.iterate():
            tokens_seen.setdefault(id(r.job), []).extend(r.token_ids)
            assert r.finish_reason in (None, "stop", "length", "eos", "cancelled", "callback")
        cache.pool.check()
        assert cache.pool.reserved == sum(j.table.reserved for j in gen.active)
        held = sum(1 for j in gen.active for p in j.table.pages if p >= 0)
        assert held >= cache.pool.num_pages - cache.pool.num_free - cache.pool.num_cached_unreferenced
    assert_pool_idle(cache)
    reasons = {}
    for j in jobs:
        assert j.done and j.table is None
        reasons[j.finish_reason] = reasons.get(j.finish_reason, 0) + 1
        assert tokens_seen.get(id(j), []) == j.generated
        assert len(j.generated) <= j.max_new_tokens
        if j.finish_reason == "length":
            assert len(j.generated) == j.limit
        if j.sampler.is_greedy and j.generated and checked < 25 and j.finish_reason != "cancelled":
            assert_greedy(model, j.input_ids, j.generated)
            checked += 1
    assert reasons.get("cancelled", 0) > 0 and reasons.get("callback", 0) > 0 and reasons.get("length", 0) > 0
    assert gen.stats.reused_tokens > 0


def test_callback_exception_cancels_only_that_job():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)

    def bad(r):
        if len(r.job.generated) == 2:
            raise RuntimeError("user callback failed")
    p_ok = rand_prompt(20)
    ok = gen.enqueue(Job(p_ok, max_new_tokens=6, sampler=GREEDY))
    failing = gen.enqueue(Job(rand_prompt(20), max_new_tokens=6, sampler=GREEDY, callback=bad))
    with pytest.raises(RuntimeError, match="user callback failed"):
        run_all(gen)
    assert failing.finish_reason == "cancelled" and failing.table is None
    run_all(gen)
    assert ok.finish_reason == "length"
    assert_greedy(model, p_ok, ok.generated)
    assert_pool_idle(cache)


def test_token_filter_exception_cancels_only_that_job():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)

    def bad(ids, logits):
        raise ValueError("filter broke")
    p_ok = rand_prompt(9)
    ok = gen.enqueue(Job(p_ok, max_new_tokens=5, sampler=GREEDY))
    failing = gen.enqueue(Job(rand_prompt(9), max_new_tokens=5, sampler=GREEDY, token_filter=bad))
    results = []
    with pytest.raises(ValueError, match="filter broke"):
        while gen.has_work():
            results.extend(gen.iterate())
    results.extend(run_all(gen))
    assert failing.finish_reason == "cancelled"
    assert [r.finish_reason for r in results if r.job is failing] == ["cancelled"]
    assert [t for r in results if r.job is ok for t in r.token_ids] == ok.generated
    assert_greedy(model, p_ok, ok.generated)
    assert_pool_idle(cache)


def test_unsamplable_row_cancels_only_its_job():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    p_ok = rand_prompt(12)
    ok = gen.enqueue(Job(p_ok, max_new_tokens=5, sampler=GREEDY))
    everything_banned = SamplerSettings(temperature=1.0, banned_tokens=list(range(model.config.vocab_size)))
    bad = gen.enqueue(Job(rand_prompt(12), max_new_tokens=5, sampler=everything_banned))
    with pytest.raises(SamplerError):
        while gen.has_work():
            gen.iterate()
    run_all(gen)
    assert bad.finish_reason == "cancelled" and bad.generated == []
    assert ok.finish_reason == "length"
    assert_greedy(model, p_ok, ok.generated)
    assert_pool_idle(cache)


def test_forward_failure_is_retryable():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    real = model.forward
    calls = {"n": 0}

    def flaky(ids, ctx):
        calls["n"] += 1
        if calls["n"] in (2, 5):
            raise MemoryError("simulated out of memory")
        return real(ids, ctx)
    model.forward = flaky
    prompts = [rand_prompt(n) for n in (50, 70, 5)]
    jobs = gen.enqueue([Job(p, max_new_tokens=6, sampler=GREEDY) for p in prompts])
    failures = 0
    while gen.has_work():
        try:
            gen.iterate()
        except MemoryError:
            failures += 1
        cache.pool.check()
    model.forward = real
    assert failures == 2
    for j, p in zip(jobs, prompts):
        assert_greedy(model, p, j.generated)
    assert_pool_idle(cache)


def test_cancel_from_another_jobs_callback():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    victim = Job(rand_prompt(10), max_new_tokens=20, sampler=GREEDY)

    def killer(r):
        if len(r.job.generated) == 3:
            gen.cancel(victim)
    gen.enqueue(Job(rand_prompt(10), max_new_tokens=5, sampler=GREEDY, callback=killer))
    gen.enqueue(victim)
    results = run_all(gen)
    assert victim.finish_reason == "cancelled" and len(victim.generated) <= 4
    assert [r.finish_reason for r in results if r.job is victim][-1] == "cancelled"
    assert sum(1 for r in results if r.job is victim and r.finish_reason) == 1
    assert_pool_idle(cache)


def test_shared_prefix_page_survives_cancel_of_its_first_owner():
    model = TinyLM()
    ps = 16
    cache = Cache(model, max_tokens=512, page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    prefix = rand_prompt(3 * ps)
    a = gen.enqueue(Job(prefix + rand_prompt(5), max_new_tokens=30, sampler=GREEDY))
    while a.fed < a.prompt_len:
        gen.iterate()
    pb = prefix + rand_prompt(7)
    b = gen.enqueue(Job(pb, max_new_tokens=8, sampler=GREEDY))
    gen.iterate()
    assert b.reused_tokens == 3 * ps
    gen.cancel(a)
    # poison every unreferenced page: b's shared pages must not be among them
    for p in range(cache.num_pages):
        if cache.pool.ref(p) == 0:
            for t in cache.k + cache.v:
                t[p].fill_(float("nan"))
    run_all(gen)
    assert_greedy(model, pb, b.generated)
    assert_pool_idle(cache)


def test_bad_arguments_raise_named_errors():
    model = TinyLM()
    cache = Cache(model, max_tokens=128, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    j = gen.enqueue(Job([1, 2, 3], max_new_tokens=2))
    with pytest.raises(InputError, match="already enqueued"):
        gen.enqueue(j)
    with pytest.raises(InputError):
        Job([1], max_new_tokens=0)
    with pytest.raises(InputError):
        Job([1], stop=[""])
    assert Job([1], stop="\n\n").stop_strings == ["\n\n"] and Job([1], stop=7).stop_tokens == {7}
    with pytest.raises(InputError):
        Job([1, -3])
    with pytest.raises(SamplerError):
        Job([1], sampler=SamplerSettings(temperature=-1))
    with pytest.raises(InputError, match="different model"):
        Generator(TinyLM(), cache)
    with pytest.raises(InputError, match="max_chunk_size"):
        Generator(model, cache, max_batch_tokens=16, max_chunk_size=32)
    with pytest.raises(InputError, match="tokenizer"):
        gen.generate("hi")
    with pytest.raises(CacheFullError):      # all or nothing: the good job is not queued either
        gen.enqueue([Job([1, 2], max_new_tokens=2), Job(rand_prompt(200), max_new_tokens=2)])
    assert gen.num_waiting == 1
    run_all(gen)
    assert_pool_idle(cache)
