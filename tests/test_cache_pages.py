"""PagePool / PageTable accounting: exact page ids, eviction order, reservations, windows."""
import random

import pytest

from exl_core.cache.pages import PagePool, PageTable
from exl_core.cache.prefix import PrefixIndex, page_keys
from exl_core.errors import CacheFullError


def test_take_lowest_free_and_release_order():
    pool = PagePool(4)
    pool.reserve(4)
    assert [pool.take() for _ in range(4)] == [0, 1, 2, 3]
    assert pool.available == 0
    pool.release(2)
    pool.release(0)
    pool.reserve(2)
    assert pool.take() == 0 and pool.take() == 2     # lowest id first, not release order
    pool.check()


def test_reservation_limits_admission():
    pool = PagePool(3)
    pool.reserve(2)
    assert not pool.can_reserve(2)
    with pytest.raises(CacheFullError):
        pool.reserve(2)
    pool.unreserve(1)
    pool.reserve(2)
    assert pool.available == 0
    with pytest.raises(CacheFullError):
        pool.take(reserved=False)
    pool.take()
    assert pool.reserved == 2 and pool.num_free == 2


def test_cached_pages_go_to_lru_and_evict_oldest_first():
    pool = PagePool(3)
    evicted = []
    pool.on_evict = evicted.append
    pool.reserve(3)
    a, b, c = pool.take(), pool.take(), pool.take()
    for p in (a, b, c):
        pool.mark_cached(p)
    pool.release(b)
    pool.release(a)
    pool.release(c)
    assert pool.lru_order() == [b, a, c]
    assert pool.num_free == 0 and pool.available == 3
    pool.acquire(a)                       # reuse removes it from the LRU
    assert pool.lru_order() == [b, c]
    pool.reserve(2)
    assert pool.take() == b and evicted == [b]
    assert pool.take() == c and evicted == [b, c]
    assert not pool.is_cached(b)
    pool.release(b)                       # no longer cached -> free, not LRU
    assert pool.lru_order() == [] and pool.num_free == 1
    pool.check()


def test_acquire_of_free_page_is_an_error():
    pool = PagePool(2)
    with pytest.raises(ValueError):
        pool.acquire(0)
    with pytest.raises(ValueError):
        pool.release(1)


def test_page_table_slots_and_free_reverse_order():
    ps = 4
    pool = PagePool(8)
    index = PrefixIndex(pool, ps)
    t = PageTable(ps)
    pool.reserve(3)
    t.reserved = 3
    t.ensure(pool, 9)                     # positions 0..8 -> 3 pages
    assert t.pages == [0, 1, 2] and t.reserved == 0 and pool.reserved == 0
    assert t.slots(3, 3) == [3, 4, 5]
    assert t.slots(8, 1) == [8]
    toks = list(range(100, 109))
    for k, p in zip(page_keys(toks, ps), t.pages):
        index.register(k, p)
    t.num_tokens = 9
    t.free(pool)
    # tail first into the LRU: page 1 (second full page) evicted before page 0; page 2 (partial,
    # never registered) is free
    assert pool.lru_order() == [1, 0] and pool.num_free == 6
    pool.check()


def test_sliding_window_releases_pages_wholly_outside():
    ps, window = 4, 6
    pool = PagePool(10)
    t = PageTable(ps)
    pool.reserve(4)
    t.reserved = 4
    t.ensure(pool, 10)
    t.num_tokens = 10                      # next query at position 10 sees keys 5..10
    assert t.release_window(pool, window, keep_reservation=True) == 1
    assert t.pages == [-1, 1, 2]
    assert t.reserved == 2 and pool.reserved == 2 and pool.num_free == 8
    t.num_tokens = 13                      # sees 8..13: page 1 (4..7) out
    assert t.release_window(pool, window, keep_reservation=False) == 1
    assert t.pages == [-1, -1, 2] and t.reserved == 2
    t.free(pool)
    assert pool.reserved == 0 and pool.num_free == 10
    pool.check()


def test_random_churn_keeps_invariants():
    rng = random.Random()
    pool = PagePool(16)
    index = PrefixIndex(pool, 2)
    tables = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.5:
            n = rng.randint(1, 5)
            if pool.can_reserve(n):
                t = PageTable(2)
                toks = [rng.randint(0, 3) for _ in range(2 * n)]
                keys = page_keys(toks, 2)
                shared = index.acquire(keys[:n - 1])
                t.adopt_prefix(shared)
                need = n - len(shared)
                if pool.can_reserve(need):
                    pool.reserve(need)
                    t.reserved = need
                    t.ensure(pool, 2 * n)
                    for k, p in zip(keys, t.pages):
                        index.register(k, p)
                    tables.append(t)
                else:
                    t.free(pool)
        elif tables:
            tables.pop(rng.randrange(len(tables))).free(pool)
        pool.check()
        for p in range(16):
            assert pool.is_cached(p) == (p in index._key)
    for t in tables:
        t.free(pool)
    pool.check()
    assert pool.reserved == 0 and pool.num_free + pool.num_cached_unreferenced == 16
    assert all(pool.ref(p) == 0 for p in range(16))
