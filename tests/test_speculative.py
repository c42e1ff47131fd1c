"""Speculative decoding: the acceptance rule reproduces the main model's distribution
(chi-square against the exact joint law), greedy speculative output equals plain greedy
output token for token (draft model and n-gram), and the paged caches balance after the
rollbacks.

Statistical tests use fixed seeds and reject at p < 1e-4: with fresh seeds a correct sampler
would fail each of them once in 10,000 runs. Each also shows it can fail: a wrong rule
(always accepting drafts) is rejected by the same statistic on the same draws.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from exl_core.cache import Cache
from exl_core.errors import InputError
from exl_core.generation import Generator, Job
from exl_core.generation.ngram import ngram_draft
from exl_core.generation.sampling import SamplerSettings, processed_probs
from exl_core.generation.speculative import accept_draft, draw_from
from generator_support import TinyLM

GREEDY = SamplerSettings(temperature=0.0)
ALPHA = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny models: OpenMP spin-waits only cost on a shared box
    yield
    torch.set_num_threads(n)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expectation < 5 are pooled into one."""
    n = counts.sum().double()
    exp = probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    ex = torch.cat([exp[~small], exp[small].sum().view(1)])
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = ((obs - ex) ** 2 / ex).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _table(g, V, temp=1.0):
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2 / temp, 0)


# -- the rule alone: toy conditionals P(x | prefix), Q(x | prefix) ----------------------------------
@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_acceptance_rule_reproduces_main_distribution(deterministic_draft):
    V, K, N = 5, 3, 8000
    g = torch.Generator().manual_seed(1234)
    P, Q = {}, {}
    for n in range(K + 2):
        for pre in itertools.product(range(V), repeat=n):
            P[pre] = _table(g, V)
            Q[pre] = _table(g, V, temp=0.5)       # a sharper, different draft
    P[(0,)][3] = 0.0                               # a token the main model never emits ...
    P[(0,)] /= P[(0,)].sum()                       # ... after token 0
    rng = torch.Generator().manual_seed(99)
    joint_ok = torch.zeros(V * V)
    joint_naive = torch.zeros(V * V)
    for _ in range(N):
        drafts, qs = [], []
        for i in range(K):
            if deterministic_draft:                # like n-gram: a fixed guess per prefix
                d = int(Q[tuple(drafts)].argmax())
            else:
                qs.append(Q[tuple(drafts)])
                d = draw_from(qs[-1], rng)
            drafts.append(d)
        p = torch.stack([P[tuple(drafts[:i])] for i in range(K + 1)])
        toks, a = accept_draft(p, None if deterministic_draft else torch.stack(qs), drafts, rng)
        assert len(toks) == a + 1 and toks[:a] == drafts[:a]
        if len(toks) == 1:                        # the next step would draw the 2nd token plainly
            toks.append(draw_from(P[(toks[0],)], rng))
        joint_ok[toks[0] * V + toks[1]] += 1
        joint_naive[drafts[0] * V + drafts[1]] += 1
    exact = torch.stack([P[()][a] * P[(a,)] for a in range(V)]).reshape(-1)
    assert chi2_pvalue(joint_ok, exact) > ALPHA
    assert chi2_pvalue(joint_naive, exact) < ALPHA          # the statistic has power
    assert joint_ok[0 * V + 3] == 0                          # an impossible pair never appears


def test_acceptance_rule_greedy_and_shapes():
    V = 7
    p = torch.zeros(4, V)
    for i, t in enumerate([2, 5, 1, 6]):
        p[i, t] = 1.0
    rng = torch.Generator().manual_seed(0)
    state = rng.get_state()
    assert accept_draft(p, p[:3], [2, 5, 1], rng) == ([2, 5, 1, 6], 3)        # all accepted + bonus
    assert accept_draft(p, None, [2, 4, 1], rng) == ([2, 5], 1)                 # first mismatch corrected
    assert accept_draft(p[:1], None, [], rng) == ([2], 0)
    assert torch.equal(rng.get_state(), state)                                  # greedy draws nothing
    with pytest.raises(InputError):
        accept_draft(p, None, [1, 2], rng)


def test_ngram_draft_brute_force():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(200):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (), generator=g)),), generator=g).tolist()
        k = int(torch.randint(1, 6, (), generator=g))
        got = ngram_draft(seq, k, max_ngram=3)
        want = []
        for n in (3, 2, 1):                        # longest n-gram, most recent occurrence
            if n >= len(seq):
                continue
            hits = [i for i in range(len(seq) - n) if seq[i:i + n] == seq[-n:]]
            if hits:
                want = seq[hits[-1] + n:hits[-1] + n + k]
                break
        assert got == want, (seq, k)


# -- inside the generator, on tiny random Llamas -------------------------------------------------------
def _load(folder):
    from exl_core.loader import load_model
    return load_model(folder, dtype=torch.float32, load_tokenizer=False)[0]


def _perturb(model, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _, layer in model.linear_layers():
        layer.w_t += torch.randn(layer.w_t.shape, generator=g) * scale
    return model


@pytest.fixture(scope="module")
def small_vocab(tiny_model_factory):
    folder = tiny_model_factory(seed=3, vocab_size=48, hidden_size=64, num_hidden_layers=2)
    return _load(folder), _perturb(_load(folder), 0.03, seed=5)


def _run(gen, jobs, check=None):
    gen.enqueue(jobs)
    while gen.has_work():
        gen.iterate()
        if check is not None:
            check(gen)
    return [j.generated for j in jobs]


def _balanced(cache):
    cache.pool.check()
    assert cache.pool.reserved == 0
    assert cache.pool.num_free + cache.pool.num_cached_unreferenced == cache.pool.num_pages


def test_speculative_logprobs_are_the_verifying_rows_float64_log_softmax(tiny_llama_dir, monkeypatch):
    """Each token a speculative step emits reports float32(x[t] - lse) with lse in float64 over the very logits row
    that verified it, as the plain sampler does. A float32 log-sum-exp lands one or more float32 steps away on a
    good share of tokens, so bit equality over all of them tells the two apart."""
    main = _load(tiny_llama_dir)
    draft = _perturb(_load(tiny_llama_dir), 0.002, seed=7)
    forwards = []          # logits of every main-model forward, in order
    real_forward = main.forward

    def recording_forward(*a, **k):
        out = real_forward(*a, **k)
        forwards.append(out.detach().clone())
        return out
    monkeypatch.setattr(main, "forward", recording_forward)
    gen = Generator(main, Cache(main, max_tokens=1024, page_size=16), None, num_draft_tokens=4,
                    draft_model=draft, draft_cache=Cache(draft, max_tokens=1024, page_size=16))
    job = Job(torch.randint(0, 49152, (11,)).tolist(), max_new_tokens=60, sampler=GREEDY, stop_on_eos=False,
              return_logprobs=True)
    gen.enqueue(job)
    rows = []              # the logits row behind each emitted token
    while gen.has_work():
        before, seen = len(job.generated), len(forwards)
        gen.iterate()
        got = len(job.generated) - before
        assert len(forwards) == seen + 1
        rows.extend(forwards[-1][:got])      # one job: the forward returns its asked rows, verified ones first
    assert gen.spec.stats.accepted > 0                  # several tokens came from one verifying forward
    assert len(rows) == len(job.generated) == 60
    lg = torch.stack(rows).double()
    toks = torch.tensor(job.generated)
    assert torch.equal(lg.argmax(1), toks)
    ref = (lg.gather(1, toks[:, None]).squeeze(1) - torch.logsumexp(lg, 1)).float().tolist()
    assert job.logprobs == ref


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_greedy_speculative_equals_plain(tiny_llama_dir, mode):
    main = _load(tiny_llama_dir)
    draft = _perturb(_load(tiny_llama_dir), 0.002, seed=7)   # random tiny models have flat logits
    rep = torch.randint(0, 49152, (6,)).tolist()
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (3, 17, 40)] + [rep * 4]
    lens = [30, 9, 25, 33]
    plain_gen = Generator(main, Cache(main, max_tokens=1024, page_size=16), None)
    plain_jobs = [Job(p, max_new_tokens=n, sampler=GREEDY, stop_on_eos=False, return_logprobs=True)
                  for p, n in zip(prompts, lens)]
    plain = _run(plain_gen, plain_jobs)
    cache = Cache(main, max_tokens=1024, page_size=16)
    kw = dict(draft_model=draft, draft_cache=Cache(draft, max_tokens=1024, page_size=16)) if mode == "draft" \
        else dict(ngram_draft=True)
    gen = Generator(main, cache, None, num_draft_tokens=4, **kw)

    def check(g):            # decode invariant: every token but the last sampled one is stored
        for j in g.active:
            if j.fed >= j.prompt_len and len(j.generated):
                assert j.table.num_tokens == len(j.tokens) - 1
    spec_jobs = [Job(p, max_new_tokens=n, sampler=GREEDY, stop_on_eos=False, return_logprobs=True)
                 for p, n in zip(prompts, lens)]
    spec = _run(gen, spec_jobs, check)
    assert spec == plain
    # a sanity bound: the model's logprobs of the same tokens. The verifying forward's logits (several rows a job)
    # round apart from plain decoding's in the last bits (9.5e-07 here), so they are not compared bit for bit, and
    # this bound would not tell the sampler's float64 log-sum-exp from a float32 one
    diff = max(abs(a - b) for s, p in zip(spec_jobs, plain_jobs) for a, b in zip(s.logprobs, p.logprobs))
    assert diff < 1e-5
    assert [len(s) for s in spec] == lens
    st = gen.spec.stats
    assert st.drafted > 0 and 0 < st.accepted <= st.drafted
    # accepted drafts save main-model forward passes -- where they land on the longest job, which sets the count: the
    # n-gram drafter's few acceptances on a random model may all fall on shorter ones (a strict < failed once so)
    assert gen.stats.forward_passes <= plain_gen.stats.forward_passes
    if mode == "draft":
        assert gen.stats.forward_passes < plain_gen.stats.forward_passes
    _balanced(cache)
    if mode == "draft":
        _balanced(gen.spec.draft_cache)
        assert 0.3 < st.acceptance_rate             # a close copy agrees often


def test_sampled_speculative_matches_main_model(small_vocab):
    """First two tokens of many seeded jobs (top-k 4, temperature 1.3, repetition penalty):
    chi-square against the exact law computed from the main model's own logits."""
    main, draft = small_vocab
    s = SamplerSettings(temperature=1.3, top_k=4, repetition_penalty=1.3)
    prompt = [5, 9, 5, 17]
    # exact joint law of (t1, t2)
    ctx_logits = main.forward_batch(torch.tensor([prompt]))[0, -1]
    p1 = processed_probs(ctx_logits, s, prompt).double()
    exact = torch.zeros(48 * 48, dtype=torch.float64)
    for a in p1.nonzero().flatten().tolist():
        la = main.forward_batch(torch.tensor([prompt + [a]]))[0, -1]
        exact[a * 48:(a + 1) * 48] = p1[a] * processed_probs(la, s, prompt + [a]).double()
    N = 2000
    cache = Cache(main, max_tokens=8192, page_size=16)
    gen = Generator(main, cache, None, draft_model=draft, draft_cache=Cache(draft, max_tokens=16384, page_size=16),
                    num_draft_tokens=3, max_batch_size=512)
    jobs = [Job(prompt, max_new_tokens=4, sampler=s, seed=1000 + i, stop_on_eos=False) for i in range(N)]
    out = _run(gen, jobs)
    counts = torch.zeros(48 * 48)
    for g in out:
        counts[g[0] * 48 + g[1]] += 1
    assert chi2_pvalue(counts, exact) > ALPHA
    st = gen.spec.stats
    assert 0 < st.accepted < st.drafted                  # both branches of the rule ran
    _balanced(cache)
    _balanced(gen.spec.draft_cache)


def test_stops_and_limits_inside_accepted_drafts(tiny_llama_dir):
    """A stop token or the length limit falling inside an accepted run ends the job there."""
    main = _load(tiny_llama_dir)
    rep = torch.randint(0, 49152, (5,)).tolist()
    prompt = rep * 5
    ref = _run(Generator(main, Cache(main, max_tokens=512, page_size=16), None),
               [Job(prompt, max_new_tokens=12, sampler=GREEDY, stop_on_eos=False)])[0]
    stop_tok = ref[5]
    cut = _run(Generator(main, Cache(main, max_tokens=512, page_size=16), None),
               [Job(prompt, max_new_tokens=12, sampler=GREEDY, stop_on_eos=False, stop=[stop_tok])])[0]
    assert len(cut) < 12
    cache = Cache(main, max_tokens=512, page_size=16)
    gen = Generator(main, cache, None, ngram_draft=True, num_draft_tokens=6)
    a = Job(prompt, max_new_tokens=12, sampler=GREEDY, stop_on_eos=False, stop=[stop_tok])
    b = Job(prompt, max_new_tokens=7, sampler=GREEDY, stop_on_eos=False)
    _run(gen, [a, b])
    assert a.generated == cut and a.finish_reason == "stop"
    assert b.generated == ref[:7] and b.finish_reason == "length"
    _balanced(cache)


def test_bad_arguments(tiny_llama_dir):
    main = _load(tiny_llama_dir)
    cache = Cache(main, max_tokens=256, page_size=16)
    with pytest.raises(InputError, match="num_draft_tokens"):
        Generator(main, cache, None, ngram_draft=True, num_draft_tokens=0)
    with pytest.raises(InputError, match="draft_cache"):
        Generator(main, cache, None, draft_model=main, draft_cache=Cache(_load(tiny_llama_dir), max_tokens=64))


def test_pages_indexed_after_rollbacks_hold_the_right_kv(tiny_llama_dir):
    """Full pages registered in the prefix index during speculative decoding (with rejected
    drafts written past the kept positions) serve a later prompt exactly like recomputation."""
    main = _load(tiny_llama_dir)
    draft = _perturb(_load(tiny_llama_dir), 0.004, seed=11)      # accepts some, rejects some
    cache = Cache(main, max_tokens=2048, page_size=8)
    gen = Generator(main, cache, None, draft_model=draft, draft_cache=Cache(draft, max_tokens=2048, page_size=8),
                    num_draft_tokens=3)
    prompt = torch.randint(0, 49152, (13,)).tolist()
    a = Job(prompt, max_new_tokens=40, sampler=GREEDY, stop_on_eos=False)
    _run(gen, [a])
    st = gen.spec.stats
    assert 0 < st.accepted < st.drafted
    follow = prompt + a.generated[:35]
    b = Job(follow, max_new_tokens=10, sampler=GREEDY, stop_on_eos=False)
    _run(gen, [b])
    assert b.reused_tokens >= 40                                   # served from pages written above
    fresh = _run(Generator(main, Cache(main, max_tokens=2048, page_size=8), None, prefix_reuse=False),
                 [Job(follow, max_new_tokens=10, sampler=GREEDY, stop_on_eos=False)])[0]
    assert b.generated == fresh
    _balanced(cache)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_ngram_greedy_identical_and_fewer_passes(smollm2_dir):
    """SmolLM2 asked to repeat a paragraph: n-gram drafts are accepted, output unchanged."""
    from exl_core.loader import load_model
    model, tok = load_model(smollm2_dir, dtype=torch.float32)
    text = ("The river bends twice before it reaches the old mill, where the water turns a wheel "
            "that has not ground flour for a hundred years.")
    msg = [{"role": "user", "content": f"{text}\n\nRepeat the sentence above exactly."}]
    ids = tok.encode(tok.apply_chat_template(msg), add_bos=False, special=True)
    plain_gen = Generator(model, Cache(model, max_tokens=1024), tok)
    plain = _run(plain_gen, [Job(ids, max_new_tokens=20, sampler=GREEDY, stop_on_eos=False)])
    gen = Generator(model, Cache(model, max_tokens=1024), tok, ngram_draft=True, num_draft_tokens=4)
    spec = _run(gen, [Job(ids, max_new_tokens=20, sampler=GREEDY, stop_on_eos=False)])
    assert spec == plain
    assert gen.spec.stats.accepted > 0
    assert gen.stats.forward_passes < plain_gen.stats.forward_passes
    _balanced(gen.cache)


class _NaNAfter(TinyLM):
    """TinyLM whose logits are NaN in the rows right after token `bad` is fed."""
    bad = 4

    def forward(self, ids, ctx):
        out = super().forward(ids, ctx)
        rows = ctx.logit_rows if ctx.logit_rows is not None else torch.arange(ids.numel())
        out[ids[rows] == self.bad] = float("nan")
        return out


@pytest.mark.parametrize("bad,bias", [(4, {4: -5.0}), (5, {5: 5.0})])
def test_a_row_that_cannot_be_sampled_ends_only_its_job_as_plain_decoding(monkeypatch, bad, bias):
    """A verified row with NaN logits made every later step raise (no job advanced or ended). Now the job ends where
    plain decoding would: never, where the row follows a rejected draft (bad 4, which the bias keeps from being
    chosen); after emitting the accepted drafts, where they reach it (bad 5, always chosen: cancelled, as plain)."""
    import exl_core.generation.speculative as sp
    monkeypatch.setattr(sp, "ngram_draft", lambda tokens, n, *a: [bad, 5][:n])
    main = _NaNAfter(vocab=8, seed=2)
    main.bad = bad
    s = SamplerSettings.greedy(logit_bias=bias)
    runs = {}
    for label, kw in (("plain", {}), ("spec", dict(ngram_draft=True, num_draft_tokens=2))):
        gen = Generator(main, Cache(main, max_tokens=4096, page_size=16), None, **kw)
        jobs = [Job([0, 3], max_new_tokens=8, sampler=s, stop_on_eos=False),
                Job([1, 2], max_new_tokens=8, sampler=s, stop_on_eos=False)]
        gen.enqueue(jobs)
        errors, seen = 0, {id(j): [] for j in jobs}
        for _ in range(40):
            if not gen.has_work():
                break
            try:
                for r in gen.iterate():
                    seen[id(r.job)].append((r.token_ids, r.finish_reason))
            except InputError:
                errors += 1
        assert not gen.has_work()
        for j in jobs:     # every token's result, then the final one, in that order
            assert [t for ts, _ in seen[id(j)] for t in ts] == j.generated
            assert seen[id(j)][-1][1] == j.finish_reason and all(f is None for _, f in seen[id(j)][:-1])
        runs[label] = ([(j.generated, j.finish_reason) for j in jobs], errors)
    assert runs["spec"] == runs["plain"], runs
    if bad == 4:
        assert runs["plain"][1] == 0 and all(r == "length" for _, r in runs["plain"][0])
    else:   # both jobs choose 5 first: their next rows are NaN, one step raises for both
        assert runs["plain"] == ([([5], "cancelled"), ([5], "cancelled")], 1)
