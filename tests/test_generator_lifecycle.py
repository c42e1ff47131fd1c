"""A job's life at its edges (stop 67's review): cancel across generators, generate()'s cleanup when a callback raises,
the text a stop string held back at a callback's or cancel's end, a step started from inside a step, speculative
decoding within max_batch_tokens, astream refusing a job, stream given a Job and settings, duplicates in one
enqueue, a transformers tokenizer."""
from __future__ import annotations

import asyncio
import random

import pytest

from exl_core.cache import Cache
from exl_core.errors import InputError
from exl_core.generation import Generator, Job

from generator_support import GREEDY, CharTokenizer, TinyLM, assert_pool_idle, rand_prompt, reference_greedy, run_all


def _gen(model, tokenizer=None, **kw):
    kw = {"max_batch_tokens": 64, "max_chunk_size": 32, **kw}
    return Generator(model, Cache(model, max_tokens=256, page_size=8), tokenizer, **kw)


def test_cancel_of_another_generators_job_is_refused_and_touches_nothing():
    random.seed(1)
    m = TinyLM(seed=3)
    g1, g2 = _gen(m), _gen(m)
    a = g1.enqueue(Job(rand_prompt(20), max_new_tokens=8, sampler=GREEDY))
    b = g2.enqueue(Job(rand_prompt(20), max_new_tokens=8, sampler=GREEDY))
    g1.iterate()
    g2.iterate()
    q = g1.enqueue(Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY))     # still queued
    for job in (a, q):
        with pytest.raises(InputError, match="another Generator"):
            g2.cancel(job)
    assert a.status == "active" and q.status == "queued"
    run_all(g1)
    run_all(g2)
    for job in (a, b, q):                                   # both ran on as if nothing happened
        assert job.generated == reference_greedy(m, job.input_ids, job.max_new_tokens)
    assert_pool_idle(g1.cache)
    assert_pool_idle(g2.cache)
    assert g1.cancel(a) is False                            # finished: False, as before


def test_generate_cancels_every_job_when_a_callback_raises_while_cancelled():
    random.seed(2)
    m = TinyLM(seed=4)
    g = _gen(m, CharTokenizer(), max_batch_size=1)         # one job runs, three wait
    first = RuntimeError("first")

    def cb(r):
        if r.finish_reason == "cancelled":
            raise RuntimeError(f"cleanup of job {r.job.identifier}")
        raise first
    with pytest.raises(RuntimeError) as err:
        g.generate(["abcd", "efgh", "ijkl", "mnop"], max_new_tokens=4, sampler=GREEDY, callback=cb)
    assert err.value is first                               # the step's error, not a cleanup one
    assert not g.pending_jobs()
    run_all(g)                                              # the cancelled results go out; none raises later
    assert g.generate("xyz", max_new_tokens=2, sampler=GREEDY, stop_on_eos=False)
    assert_pool_idle(g.cache)


@pytest.mark.parametrize("end", ["length", "callback", "cancel"])
def test_text_held_back_by_a_stop_string_is_released_at_every_end_but_a_stop_or_the_callbacks(end):
    """Tokens "a", "b", "OP" under stop "OPQ": "OP" may start the stop string, so it is held until the job ends;
    docs/sampling.md releases it at any end but a stop string's or the job's own callback's (which has seen every
    piece it gets: the callback and the iterator see the same text)."""
    m = TinyLM(seed=7)
    forced = [0, 1, 263]

    def force(hist, row):
        row.fill_(-1e4)
        row[forced[min(len(hist) - 1, len(forced) - 1)]] = 1e4
    g = _gen(m, CharTokenizer(), max_chunk_size=16)
    seen = []

    def cb(r):
        seen.append(r)
        if end == "callback" and len(seen) == 3:
            return False
    job = g.enqueue(Job([5], max_new_tokens=3 if end == "length" else 10, sampler=GREEDY, stop=["OPQ"],
                        token_filter=force, callback=cb, stop_on_eos=False))
    results = []
    while g.has_work():
        results += g.iterate()
        if end == "cancel" and len(job.generated) == 3 and not job.done:
            g.cancel(job)
    assert job.finish_reason == {"length": "length", "callback": "callback", "cancel": "cancelled"}[end]
    assert job.text == ("ab" if end == "callback" else "abOP")
    assert "".join(r.text for r in results) == job.text     # the iterator's pieces add up to the job's text,
    assert "".join(r.text for r in seen) == job.text        # and so do the callback's


def test_a_step_started_from_inside_a_step_is_refused():
    random.seed(3)
    m = TinyLM(seed=7)
    g = _gen(m, CharTokenizer(), max_chunk_size=16)
    errors = []

    def cb(r):
        if len(r.job.generated) == 2 and not errors:
            with pytest.raises(InputError, match="inside a step") as e:
                g.generate("abc", max_new_tokens=3, sampler=GREEDY, stop_on_eos=False)
            errors.append(e.value)
    a = Job(rand_prompt(12), max_new_tokens=6, sampler=GREEDY, callback=cb, stop_on_eos=False)
    b = Job(rand_prompt(9), max_new_tokens=6, sampler=GREEDY, stop_on_eos=False)
    g.enqueue([a, b])
    run_all(g)
    assert len(errors) == 1
    for job in (a, b):      # the nested step used to sample b from a's row
        assert job.generated == reference_greedy(m, job.input_ids, 6)


def test_speculative_forwards_stay_within_max_batch_tokens():
    random.seed(0)
    m, d = TinyLM(seed=7), TinyLM(seed=7)                  # draft == main: drafts proposed and accepted
    sizes = []
    forward = m.forward
    m.forward = lambda ids, ctx: sizes.append(ids.numel()) or forward(ids, ctx)
    g = Generator(m, Cache(m, max_tokens=1024, page_size=16), max_batch_tokens=16, max_chunk_size=8,
                  draft_model=d, draft_cache=Cache(d, max_tokens=1024, page_size=16), num_draft_tokens=4)
    jobs = g.enqueue([Job(rand_prompt(5), max_new_tokens=12, sampler=GREEDY) for _ in range(6)])
    run_all(g)
    assert max(sizes) <= 16                                 # was 52: verify rows on top of a full plan
    assert g.spec.stats.accepted > 0                        # drafts still ran where the budget had room
    for job in jobs:
        assert job.generated == reference_greedy(m, job.input_ids, 12)


def test_astream_leaves_a_job_it_refuses_alone():
    random.seed(4)
    m = TinyLM(seed=5)
    g = _gen(m, CharTokenizer())
    job = g.enqueue(Job(rand_prompt(8), max_new_tokens=4, sampler=GREEDY))
    g.iterate()

    async def consume():
        async for _ in g.astream_results(job):
            pass
    with pytest.raises(InputError, match="already enqueued"):
        asyncio.run(consume())
    assert job.status == "active" and job.finish_reason is None
    run_all(g)
    assert job.generated == reference_greedy(m, job.input_ids, 4)

    async def two_consumers():     # a second stream of a job the first one streams: refused, the first goes on
        other = Job(rand_prompt(8), max_new_tokens=4, sampler=GREEDY)
        first = g.astream_results(other)
        got = [await first.__anext__()]
        with pytest.raises(InputError, match="already enqueued"):
            async for _ in g.astream_results(other):
                pass
        got += [r async for r in first]
        return other, got
    other, got = asyncio.run(asyncio.wait_for(two_consumers(), 60))
    assert got[-1].done and other.generated == reference_greedy(m, other.input_ids, 4)


def test_a_finished_job_pickles():
    import pickle
    g = _gen(TinyLM(seed=5))
    job = g.enqueue(Job([1, 2, 3], max_new_tokens=2, sampler=GREEDY))
    run_all(g)
    assert job.done and job.owner is None
    assert pickle.loads(pickle.dumps(job)).generated == job.generated


def test_stream_of_a_job_refuses_settings_it_would_ignore():
    m = TinyLM(seed=5)
    g = _gen(m, CharTokenizer())
    for kw in ({"max_new_tokens": 5}, {"stop": ["x"]}, {"chat": True}):
        job = Job([1, 2, 3], max_new_tokens=3, sampler=GREEDY)
        with pytest.raises(InputError, match="carries its own settings"):
            next(g.stream(job, **kw))
        with pytest.raises(InputError, match="carries its own settings"):
            asyncio.run(g.astream(job, **kw).__anext__())
        assert job.status == "new"
    job = Job([1, 2, 3], max_new_tokens=3, sampler=GREEDY, stop_on_eos=False)
    assert "".join(g.stream(job)) == job.text and len(job.generated) == 3
    with pytest.raises(InputError, match="max_new_tokens=0"):          # a prompt's settings do reach its job
        next(g.stream("abc", max_new_tokens=0))


def test_enqueue_of_a_list_with_a_job_twice_queues_none():
    m = TinyLM(seed=5)
    g = _gen(m)
    a, b = Job([1, 2], max_new_tokens=2), Job([3, 4], max_new_tokens=2)
    with pytest.raises(InputError, match="twice"):
        g.enqueue([a, b, a])
    assert not g.pending_jobs() and a.status == b.status == "new"


def test_a_transformers_tokenizer_is_refused_by_name():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1},
                                                                                         unk_token="<unk>")))
    with pytest.raises(InputError, match="exl_core's Tokenizer"):
        _gen(TinyLM(seed=5), tok)


def test_stream_gets_every_piece_whoever_runs_the_steps():
    """stream() kept only the pieces of the steps it ran itself: two streams read in turn, or a stream beside a
    generate() in another thread, each lost the pieces of the steps the other ran (job.text stayed right)."""
    import threading
    m = TinyLM(seed=6)
    g = _gen(m, CharTokenizer())
    prompts = ["abcde", "fghij", "klmno"]
    want = [_gen(m, CharTokenizer()).generate(p, max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)
            for p in prompts]
    s1 = g.stream(prompts[0], max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)
    s2 = g.stream(prompts[1], max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)
    out1, out2 = [], []
    for a, b in zip(s1, s2):                                # in turn: each runs steps for both
        out1.append(a)
        out2.append(b)
    out1 += list(s1)
    out2 += list(s2)
    assert ["".join(out1), "".join(out2)] == want[:2]
    got, other = [], []
    t = threading.Thread(target=lambda: other.append(
        g.generate(prompts[2], max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)))
    it = g.stream(prompts[0], max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)
    got.append(next(it))
    t.start()                                               # its steps now carry the stream's job too
    t.join(60)
    got += list(it)
    assert "".join(got) == want[0] and other == [want[2]]
    assert not g._sinks


def test_stream_keeps_its_last_piece_when_another_thread_ends_its_job():
    """stream() read job.done without the lock: a step run by another thread sets it before feeding the job's last
    piece, so a stream checking in between ended without that piece (the window widened here to 0.3 s)."""
    import threading
    import time
    m = TinyLM(seed=6)
    want = _gen(m, CharTokenizer()).generate("abcde", max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)
    g = _gen(m, CharTokenizer())
    step = g._step

    def slow_end(results):
        out = step(results)
        if any(r.job.done for r in out):
            time.sleep(0.3)
        return out
    g._step = slow_end
    it = g.stream("abcde", max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)
    got = [next(it)]
    t = threading.Thread(target=g.generate, args=("klmno",),
                         kwargs=dict(max_new_tokens=30, sampler=GREEDY, stop_on_eos=False))
    t.start()
    time.sleep(0.1)
    for piece in it:
        got.append(piece)
        time.sleep(0.02)                                    # a consumer doing some work per piece
    t.join(60)
    assert "".join(got) == want
