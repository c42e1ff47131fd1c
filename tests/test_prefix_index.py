"""PrefixIndex: chained keys, longest match, ref counts and LRU eviction with exact page ids."""
import random

from exl_core.cache.pages import PagePool, PageTable
from exl_core.cache.prefix import PrefixIndex, page_keys


def _tokens(n, rng):
    return [rng.randrange(50000) for _ in range(n)]


def test_keys_chain_over_all_previous_tokens():
    rng = random.Random()
    ps = 8
    a = _tokens(4 * ps, rng)
    b = list(a)
    b[3] = (b[3] + 1) % 50000                 # differs only in page 0
    ka, kb = page_keys(a, ps), page_keys(b, ps)
    assert len(ka) == 4
    assert all(x != y for x, y in zip(ka, kb))  # every later page differs too (chained)
    assert page_keys(a[:3 * ps + 5], ps) == ka[:3]   # partial page has no key
    assert page_keys(a, ps, prev=ka[1], first_page=2) == ka[2:]
    assert len(set(ka)) == 4


def _run_job(pool, index, tokens, ps):
    """Admit a sequence: reuse cached full pages, take new ones, register its full pages."""
    keys = page_keys(tokens, ps)
    t = PageTable(ps)
    t.adopt_prefix(index.acquire(keys))
    need = -(-len(tokens) // ps) - t.shared
    pool.reserve(need)
    t.reserved = need
    t.ensure(pool, len(tokens))
    t.num_tokens = len(tokens)
    for k, p in zip(keys, t.pages):
        index.register(k, p)
    return t


def test_reuse_exact_pages_and_eviction_order():
    rng = random.Random()
    ps = 4
    pool = PagePool(6)
    index = PrefixIndex(pool, ps)
    a = _tokens(3 * ps + 2, rng)                      # 3 full pages + partial
    ta = _run_job(pool, index, a, ps)
    assert ta.pages == [0, 1, 2, 3] and ta.shared == 0
    assert len(index) == 3
    # running job shares its first two pages with a new one
    b = a[:2 * ps] + _tokens(ps + 1, rng)
    tb = _run_job(pool, index, b, ps)
    assert tb.pages[:2] == [0, 1] and tb.shared == 2 and tb.pages[2:] == [4, 5]
    assert pool.ref(0) == 2 and pool.ref(1) == 2
    ta.free(pool)                                     # pages 2 cached; 3 free; 0, 1 still used by b
    assert pool.lru_order() == [2] and pool.ref(0) == 1
    tb.free(pool)                                     # b's tail (4) first, then 1, 0
    assert pool.lru_order() == [2, 4, 1, 0]
    assert pool.num_free == 2                         # 3 and 5 (partial pages)
    # a new unrelated job of 4 pages: free 3, 5 first, then evict LRU 2, then 4
    c = _tokens(4 * ps, rng)
    tc = _run_job(pool, index, c, ps)
    assert tc.pages == [3, 5, 2, 4]
    assert index.match(page_keys(a, ps)) == [0, 1]    # a's page 2 got evicted
    assert index.match(page_keys(b, ps)) == [0, 1]    # b's page 2 (4) got evicted
    pool.check()
    tc.free(pool)
    # re-running a reuses pages 0 and 1 from the LRU
    ta2 = _run_job(pool, index, a, ps)
    assert ta2.pages[:2] == [0, 1] and ta2.shared == 2
    pool.check()


def test_duplicate_registration_keeps_first_page():
    rng = random.Random()
    ps = 4
    pool = PagePool(4)
    index = PrefixIndex(pool, ps)
    toks = _tokens(ps, rng)
    # two sequences computed the same page concurrently (neither saw the other's)
    t1, t2 = PageTable(ps), PageTable(ps)
    pool.reserve(2)
    t1.reserved = t2.reserved = 1
    t1.ensure(pool, ps)
    t2.ensure(pool, ps)
    k = page_keys(toks, ps)[0]
    assert index.register(k, t1.pages[0]) is True
    assert index.register(k, t2.pages[0]) is False
    t2.free(pool)
    t1.free(pool)
    assert pool.lru_order() == [0] and pool.num_free == 3
    pool.check()


def test_evicted_key_disappears_and_match_stops_at_gap():
    rng = random.Random()
    ps = 2
    pool = PagePool(3)
    index = PrefixIndex(pool, ps)
    toks = _tokens(3 * ps, rng)
    t = _run_job(pool, index, toks, ps)
    t.free(pool)                      # LRU: 2, 1, 0
    keys = page_keys(toks, ps)
    pool.reserve(1)
    assert pool.take() == 2           # evicts the tail page
    assert index.match(keys) == [0, 1] and keys[2] not in index
    pool.reserve(1)
    assert pool.take() == 1
    assert index.match(keys) == [0]
    pool.check()
