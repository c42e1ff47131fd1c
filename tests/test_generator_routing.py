"""Results and step errors reach each job's own consumer, whoever runs the step (generation/routing.py): a stream's
job cancelled by another caller keeps its held-back tail; a step's error reaches only the consumers of the jobs it
ended; astream is served by steps other threads run and from several event loops; callbacks hear an error's end;
the adapters' engine keys its callers by job, not by identifier."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from exl_core.cache import Cache
from exl_core.generation import Generator, Job
from generator_support import (GREEDY, CharTokenizer, TinyLM, _one_thread,  # noqa: F401 (autouse fixture)
                               assert_pool_idle, rand_prompt, reference_greedy, run_all)

P = CharTokenizer.PIECES


class Boom(Exception):
    pass


def _setup():
    model = TinyLM(seed=1)
    cache = Cache(model, max_tokens=1024, page_size=16)
    return model, cache, Generator(model, cache, CharTokenizer(), max_batch_tokens=64, max_chunk_size=32)


def _forcing(seq, prompt_len):
    def f(ids, logits):
        out = torch.full_like(logits, -1e4)
        out[seq[min(len(ids) - prompt_len, len(seq) - 1)]] = 0.0
        return out
    return f


def _fails_at(n, prompt_len, msg):
    def f(ids, logits):
        if len(ids) - prompt_len == n:
            raise Boom(msg)
    return f


def test_stream_keeps_its_held_back_tail_when_another_job_cancels_it():
    """The cancel's final result (with the text held back for a possible stop string) went to the events only; a
    stream that then read job.done stopped without it."""
    model, cache, gen = _setup()
    S, T = P.index("S"), P.index("T")
    job = Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, stop=["STOP"],
              token_filter=_forcing([0, 1, S, T, 2, 3, 4, 5], 5))

    def other_cb(r):       # another job's callback cancels the streamed one inside a step
        if len(job.generated) == 4:
            gen.cancel(job)
    gen.enqueue(Job(rand_prompt(5), max_new_tokens=30, sampler=GREEDY, callback=other_cb))
    pieces = list(gen.stream(job))
    assert job.finish_reason == "cancelled" and job.text.endswith("ST")
    assert "".join(pieces) == job.text
    run_all(gen)
    assert_pool_idle(cache)


def test_stream_is_not_raised_another_jobs_error():
    """Whichever stream ran a failing step raised the error, though it ended another job, and cancelled its own."""
    model, cache, gen = _setup()
    a = Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, stop_on_eos=False)
    b = gen.enqueue(Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, token_filter=_fails_at(2, 5, "B")))
    text = "".join(gen.stream(a))
    assert a.finish_reason == "length" and text == a.text
    assert a.generated == reference_greedy(model, a.input_ids, 10)
    assert b.finish_reason == "cancelled"
    with pytest.raises(Boom, match="B"):          # B's error is the next plain iterate's
        run_all(gen)


def test_astream_cancelled_job_gets_its_end_not_another_jobs_error():
    model, cache, gen = _setup()
    a = Job(rand_prompt(5), max_new_tokens=20, sampler=GREEDY)

    def b_filter(ids, logits):
        if len(ids) - 5 == 3:
            gen.cancel(a)                     # a plain cancel in the same step as B's error
            raise Boom("B")
    b = Job(rand_prompt(5), max_new_tokens=20, sampler=GREEDY, token_filter=b_filter)

    async def consume(job):
        try:
            return [r.finish_reason async for r in gen.astream_results(job)][-1]
        except Boom as e:
            return f"raised {e}"

    async def main():
        return await asyncio.wait_for(asyncio.gather(consume(a), consume(b)), 60)
    assert asyncio.run(main()) == ["cancelled", "raised B"]


def test_astream_is_fed_by_steps_another_thread_runs():
    """astream's queue was fed only by its own driver's steps: with another thread stepping the generator, its job
    could finish there and the consumer wait for ever."""
    model, cache, gen = _setup()
    stop = threading.Event()

    def stepper():
        while not stop.is_set():
            gen.generate("abcdef", max_new_tokens=8, sampler=GREEDY, stop_on_eos=False)
    job = Job(rand_prompt(5), max_new_tokens=30, sampler=GREEDY, stop_on_eos=False,
              token_filter=lambda ids, row: time.sleep(0.002))

    async def consume():
        return [p async for p in gen.astream(job)]
    t = threading.Thread(target=stepper)
    t.start()
    try:
        pieces = asyncio.run(asyncio.wait_for(consume(), 60))
    finally:
        stop.set()
        t.join(60)
    assert "".join(pieces) == job.text and len(job.generated) == 30


def test_astream_from_two_event_loops():
    """One driver served every loop, putting into other loops' queues from its own thread (never waking them)."""
    model, cache, gen = _setup()
    out = {}

    def consume(name, n, delay):
        async def main():
            job = Job(rand_prompt(5), max_new_tokens=n, sampler=GREEDY, stop_on_eos=False,
                      token_filter=lambda ids, row: time.sleep(delay))
            out[name] = ("".join([p async for p in gen.astream(job)]), job)
        asyncio.run(asyncio.wait_for(main(), 60))
    ta = threading.Thread(target=consume, args=("a", 40, 0.003))
    ta.start()
    time.sleep(0.05)
    tb = threading.Thread(target=consume, args=("b", 5, 0.0))
    tb.start()
    tb.join(60)
    ta.join(60)
    for text, job in out.values():
        assert text == job.text and job.finish_reason == "length"
    assert set(out) == {"a", "b"} and not gen._drivers


def test_astream_enqueue_does_not_hold_the_event_loop_for_a_step():
    model, cache, gen = _setup()
    busy = gen.enqueue(Job(rand_prompt(5), max_new_tokens=4, sampler=GREEDY, stop_on_eos=False,
                           token_filter=lambda ids, row: time.sleep(1.0)))
    t = threading.Thread(target=lambda: gen.iterate())
    t.start()                                # a step runs, holding the lock ~1 s
    time.sleep(0.1)

    from exl_core.testing import event_loop_longest_stall
    job = Job(rand_prompt(5), max_new_tokens=2, sampler=GREEDY, stop_on_eos=False)
    pieces = []

    async def consume():
        pieces.extend([p async for p in gen.astream(job)])
    gap = event_loop_longest_stall(consume)
    text = "".join(pieces)
    t.join(60)
    assert text == job.text and gap < 0.5, gap     # the loop kept ticking through the step (it stalled ~0.9 s)
    run_all(gen)
    assert busy.done


def test_callback_hears_the_end_of_a_job_its_filter_ended():
    """A job ended by its token_filter (or an unsamplable row) had its cancelled result in the events only: a
    consumer driven by callbacks never learned it ended."""
    model, cache, gen = _setup()
    seen = []
    gen.enqueue(Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, token_filter=_fails_at(2, 5, "f"),
                    callback=lambda r: seen.append(r.finish_reason)))
    with pytest.raises(Boom):
        run_all(gen)
    assert seen == [None, None, "cancelled"]


def test_engine_keys_callers_by_job_not_identifier():
    """Jobs sharing an identifier had their texts merged by run(), and one finishing dropped the other's caller."""
    from exl_core.plugins import SharedEngine
    model = TinyLM(seed=1)
    eng = SharedEngine("tiny", model=model, tokenizer=CharTokenizer(), cache_tokens=1024)
    try:
        jobs = [Job(rand_prompt(6), max_new_tokens=n, sampler=GREEDY, stop_on_eos=False, identifier="same")
                for n in (3, 7)]
        texts = eng.run(jobs)
        assert texts == [j.text for j in jobs] and [len(j.generated) for j in jobs] == [3, 7]
        a = Job(rand_prompt(6), max_new_tokens=2, sampler=GREEDY, stop_on_eos=False, identifier="x")
        b = Job(rand_prompt(6), max_new_tokens=20, sampler=GREEDY, stop_on_eos=False, identifier="x",
                token_filter=_fails_at(5, 6, "B"))
        c = Job(rand_prompt(6), max_new_tokens=20, sampler=GREEDY, stop_on_eos=False, identifier="c")
        out = {}

        def consume(name, job):
            try:
                out[name] = [r.finish_reason for r in eng.stream(job)][-1]
            except Boom as e:
                out[name] = f"raised {e}"
        ts = [threading.Thread(target=consume, args=nj) for nj in (("c", c), ("b", b), ("a", a))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert out == {"a": "length", "b": "raised B", "c": "length"}
    finally:
        eng.close()


def test_engine_close_reaches_a_caller_whose_callback_raises_on_its_cancel():
    from exl_core.plugins import SharedEngine
    eng = SharedEngine("tiny", model=TinyLM(seed=1), tokenizer=CharTokenizer(), cache_tokens=1024)

    def cb(r):
        time.sleep(0.005)
        if r.finish_reason == "cancelled":
            raise RuntimeError("dislikes cancels")
    job = Job(rand_prompt(6), max_new_tokens=500, sampler=GREEDY, stop_on_eos=False, callback=cb)
    got = []
    t = threading.Thread(target=lambda: got.extend(r.finish_reason for r in eng.stream(job)))
    t.start()
    time.sleep(0.3)
    eng.close()
    t.join(30)
    assert not t.is_alive() and got[-1] == "cancelled" and job.finish_reason == "cancelled"


def test_a_cancel_from_a_callback_comes_after_the_jobs_token_of_that_step():
    """cancel() routed its final result at once, ahead of the same step's token result for that job: the stream
    stopped at 'cancelled' and dropped the token's text."""
    model, cache, gen = _setup()
    job = Job(rand_prompt(5), max_new_tokens=30, sampler=GREEDY, stop_on_eos=False)

    def other_cb(r):        # runs after `job`'s token is accepted in the same step (job is first in the batch)
        if len(job.generated) == 4 and not job.done:
            gen.cancel(job)
    it = gen.stream(job)
    pieces = [next(it)]
    gen.enqueue(Job(rand_prompt(5), max_new_tokens=30, sampler=GREEDY, stop_on_eos=False, callback=other_cb))
    pieces += list(it)
    assert job.finish_reason == "cancelled" and len(job.generated) == 4 and "".join(pieces) == job.text
    run_all(gen)


def test_a_cancel_asked_while_the_lock_is_busy_is_carried_out_without_a_step():
    """A consumer leaving while something other than a step held the lock (a LoRA change, an enqueue) left its
    cancel in the inbox, which only a later step drained: the job kept its pages."""
    from exl_core.model.lora import jobs_frozen
    model, cache, gen = _setup()
    job = gen.enqueue(Job(rand_prompt(5), max_new_tokens=50, sampler=GREEDY, stop_on_eos=False))
    gen.iterate()
    with jobs_frozen(model):                  # the generator's lock, held by another section
        t = threading.Thread(target=gen._cancel_soon, args=(job,))    # an event loop's consumer leaving
        t.start()
        t.join(30)
        assert not t.is_alive() and job.status == "active"
    deadline = time.time() + 30
    while job.status != "done" and time.time() < deadline:
        time.sleep(0.01)
    assert job.finish_reason == "cancelled" and not gen._cancel_inbox
    assert_pool_idle(cache)


def test_an_abandoned_consumers_job_error_is_not_left_for_another_caller():
    """A job whose consumer left while the step that ended it ran counted as never consumed: its error was kept for
    the next plain iterate() -- an unrelated generate() raised it."""
    model, cache, gen = _setup()
    job = Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, token_filter=_fails_at(2, 5, "gone"))
    it = gen.stream(job)
    next(it)
    gen._detach(job, gen._sinks[id(job)].sink)     # its consumer leaves (as an astream whose task ended)
    gen._step_routed()
    gen._step_routed()
    assert job.finish_reason == "cancelled" and gen._orphan_error is None
    assert len(gen.generate("abc", max_new_tokens=3, sampler=GREEDY, stop_on_eos=False)) > 0


def test_a_generator_whose_consumers_raised_is_freed_without_the_cycle_collector():
    """The consumers' frames held the exception they raised, whose traceback held those frames and the generator."""
    import gc
    import weakref
    from exl_core.plugins import SharedEngine

    def stream_case():
        model, cache, gen = _setup()
        with pytest.raises(Boom):
            list(gen.stream(Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, token_filter=_fails_at(2, 5, "x"))))
        return weakref.ref(gen)

    def astream_case():
        model, cache, gen = _setup()

        async def main():
            with pytest.raises(Boom):
                async for _ in gen.astream(Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY,
                                               token_filter=_fails_at(2, 5, "x"))):
                    pass
        asyncio.run(main())
        return weakref.ref(gen)

    def orphan_case():       # a stream's step ends a job nobody consumes: its error waits for iterate()
        model, cache, gen = _setup()
        gen.enqueue(Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, token_filter=_fails_at(2, 5, "x")))
        list(gen.stream(Job(rand_prompt(5), max_new_tokens=6, sampler=GREEDY)))
        assert gen._orphan_error is not None
        return weakref.ref(gen)

    def engine_case():
        eng = SharedEngine("tiny", model=TinyLM(seed=1), tokenizer=CharTokenizer(), cache_tokens=1024)
        with pytest.raises(Boom):
            list(eng.stream(Job(rand_prompt(5), max_new_tokens=10, sampler=GREEDY, token_filter=_fails_at(2, 5, "x"))))
        eng.close()
        return weakref.ref(eng.generator)
    for case in (stream_case, astream_case, orphan_case, engine_case):
        gc.collect()
        gc.disable()
        try:
            ref = case()
            assert ref() is None, case.__name__
        finally:
            gc.enable()


def test_engine_astream_cancelled_during_its_enqueue_detaches_its_consumer():
    from exl_core.plugins import SharedEngine
    eng = SharedEngine("tiny", model=TinyLM(seed=1), tokenizer=CharTokenizer(), cache_tokens=1024)
    busy = threading.Event()

    def slow(ids, row):
        busy.set()
        time.sleep(0.3)
    try:
        first = Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY, stop_on_eos=False, token_filter=slow)
        t = threading.Thread(target=lambda: list(eng.stream(first)))
        t.start()
        assert busy.wait(30)                  # a step holds the lock: the enqueues below wait in their threads

        async def main():
            jobs = [Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY) for _ in range(4)]
            tasks = [asyncio.ensure_future(eng.astream(j).__anext__()) for j in jobs]
            await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return jobs
        jobs = asyncio.run(main())
        t.join(30)
        deadline = time.time() + 30
        while any(not j.done and j.status != "new" for j in jobs) and time.time() < deadline:
            time.sleep(0.01)
        assert not eng.generator._sinks
    finally:
        eng.close()


def test_a_stream_gets_every_token_when_another_jobs_callback_cancels_it_and_raises():
    """The step fails (the callback's error) after the streamed job's token of that step was made and its cancel
    filed: the token goes out before the job's end (_step_locked orders the failed step's results so; without that
    the stream lost its last piece)."""
    model, cache, gen = _setup()
    job = Job(rand_prompt(5), max_new_tokens=30, sampler=GREEDY, stop_on_eos=False)

    class Boom(Exception):
        pass

    def other_cb(r):
        if len(job.generated) == 4 and not job.done:
            gen.cancel(job)
            raise Boom("callback")
    it = gen.stream(job)
    pieces = [next(it)]
    gen.enqueue(Job(rand_prompt(5), max_new_tokens=30, sampler=GREEDY, stop_on_eos=False, callback=other_cb))
    pieces += list(it)                       # another job's error is not this stream's to raise
    assert job.finish_reason == "cancelled" and len(job.generated) == 4
    assert "".join(pieces) == job.text
