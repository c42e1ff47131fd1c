"""Page accounting for the paged KV cache. Holds no tensors (STYLE habit 4).

A page is `page_size` consecutive positions of one sequence, for every layer at once. Each
physical page id is in exactly one of three states:

    free          ref == 0, holds nothing worth keeping            -> `_free` (min-heap)
    in use        ref >= 1, listed in one or more PageTables
    cached        ref == 0, but its K/V is indexed by the PrefixIndex -> `_lru` (oldest first)

`take()` hands out the lowest free id; when none is free it evicts the least recently
released cached page (telling the index through `on_evict`). Jobs *reserve* pages at
admission so that a running job can always take the pages it was promised:
`available = free + cached - reserved` is what a new job may still claim.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Optional

from ..errors import CacheFullError


class PagePool:
    """Free list, ref counts, LRU of unreferenced cached pages and reservations."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise CacheFullError(f"PagePool: num_pages={num_pages}; the cache needs at least one page")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))       # heap: lowest id first
        self._ref: list[int] = [0] * num_pages
        self._cached: list[bool] = [False] * num_pages         # set by the PrefixIndex
        self._lru: OrderedDict[int, None] = OrderedDict()     # ref==0 cached pages, oldest first
        self.reserved = 0
        self.on_evict: Optional[Callable[[int], None]] = None  # PrefixIndex drops its key

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_unreferenced(self) -> int:
        return len(self._lru)

    @property
    def available(self) -> int:
        """Pages a new reservation may still claim."""
        return len(self._free) + len(self._lru) - self.reserved

    def ref(self, page: int) -> int:
        return self._ref[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def lru_order(self) -> list[int]:
        """Unreferenced cached pages, next to be evicted first."""
        return list(self._lru)

    # -- reservations -----------------------------------------------------------------------
    def can_reserve(self, n: int) -> bool:
        return n <= self.available

    def reserve(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"PagePool.reserve: n={n} < 0")
        if n > self.available:
            raise CacheFullError(f"PagePool: cannot reserve {n} pages, {self.available} available "
                                 f"of {self.num_pages}")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        if n < 0 or n > self.reserved:
            raise ValueError(f"PagePool.unreserve: n={n} but only {self.reserved} reserved")
        self.reserved -= n

    # -- page life cycle --------------------------------------------------------------------
    def take(self, reserved: bool = True) -> int:
        """A page with ref 1 for new K/V: lowest free id, else evict the LRU cached page.

        `reserved`: the caller holds a reservation that this take consumes."""
        if reserved:
            if self.reserved < 1:
                raise ValueError("PagePool.take: no reservation left to consume")
            self.reserved -= 1
        elif self.available < 1:
            raise CacheFullError(f"PagePool: no page available ({self.num_pages} pages, "
                                 f"{self.reserved} reserved)")
        if self._free:
            page = heapq.heappop(self._free)
        elif self._lru:
            page, _ = self._lru.popitem(last=False)
            self._cached[page] = False
            if self.on_evict is not None:
                self.on_evict(page)
        else:  # reservations guarantee this never happens
            raise CacheFullError("PagePool: out of pages despite a reservation (accounting bug)")
        self._ref[page] = 1
        return page

    def acquire(self, page: int) -> None:
        """One more reference to an existing page (prefix reuse). A cached page leaves the LRU."""
        if self._ref[page] == 0:
            if page not in self._lru:
                raise ValueError(f"PagePool.acquire: page {page} is free, not cached; nothing to share")
            del self._lru[page]
        self._ref[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; at zero the page becomes cached (MRU end of the LRU) or free."""
        if self._ref[page] < 1:
            raise ValueError(f"PagePool.release: page {page} has no reference")
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if self._cached[page]:
                self._lru[page] = None
            else:
                heapq.heappush(self._free, page)

    def mark_cached(self, page: int) -> None:
        """The index now keys this (referenced) page; keep it after its last release."""
        if self._ref[page] < 1:
            raise ValueError(f"PagePool.mark_cached: page {page} is not in use")
        self._cached[page] = True

    def check(self) -> None:
        """Assert the accounting invariants (tests and debugging)."""
        free = set(self._free)
        lru = set(self._lru)
        assert len(free) == len(self._free), "duplicate page in free list"
        assert not (free & lru), "page both free and cached"
        for p in range(self.num_pages):
            r = self._ref[p]
            assert r >= 0
            if r == 0:
                assert (p in free) != (p in lru), f"unreferenced page {p} neither free nor cached"
                assert (p in lru) == self._cached[p]
            else:
                assert p not in free and p not in lru, f"page {p} in use but listed free/cached"
        assert 0 <= self.reserved <= len(free) + len(lru)


class PageTable:
    """Logical → physical pages of one sequence.

        position p  ->  pages[p // page_size], offset p % page_size
        pages[i] == -1 once logical page i fell out of the sliding window (released)

    `num_tokens`: positions whose K/V is stored. `reserved`: pages promised by the pool and not
    yet taken. `shared`: leading pages taken over from the prefix index (never written).
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: list[int] = []
        self.num_tokens = 0
        self.reserved = 0
        self.shared = 0
        self.keys: list[bytes] = []     # chained keys of the full pages seen so far
        self.salt = b""                 # key of "page -1": separates K/V computed differently

    def adopt_prefix(self, pages: list[int], keys: Optional[list[bytes]] = None) -> None:
        """Start from already-referenced full pages of a cached prefix."""
        assert not self.pages
        self.pages = list(pages)
        self.shared = len(pages)
        self.keys = list(keys) if keys is not None else []
        self.num_tokens = len(pages) * self.page_size

    def ensure(self, pool: PagePool, upto: int) -> None:
        """Take pages so that positions < upto have a physical page."""
        need = -(-upto // self.page_size)
        while len(self.pages) < need:
            if self.reserved > 0:
                self.pages.append(pool.take(reserved=True))
                self.reserved -= 1
            else:  # beyond the promise (should not happen with correct reservations)
                self.pages.append(pool.take(reserved=False))

    def slots(self, start: int, n: int) -> list[int]:
        """Flat slot (page * page_size + offset) of positions start .. start+n-1."""
        ps = self.page_size
        return [self.pages[p // ps] * ps + p % ps for p in range(start, start + n)]

    def release_window(self, pool: PagePool, window: int, keep_reservation: bool) -> int:
        """Release pages no future query can see (all positions < num_tokens - window + 1).

        Returns the number released; each released page is re-reserved when the job still
        needs new pages later (`keep_reservation`), so the job's promise stays intact."""
        lowest_visible = self.num_tokens - window + 1
        n = 0
        for i in range(min(len(self.pages), max(0, lowest_visible) // self.page_size)):
            if self.pages[i] >= 0:
                pool.release(self.pages[i])
                self.pages[i] = -1
                n += 1
                if keep_reservation:
                    pool.reserve(1)
                    self.reserved += 1
        return n

    def free(self, pool: PagePool) -> None:
        """Release every page (last page first, so a prefix's tail is evicted before its head)
        and return unused reservations."""
        for p in reversed(self.pages):
            if p >= 0:
                pool.release(p)
        self.pages = []
        pool.unreserve(self.reserved)
        self.reserved = 0
        self.num_tokens = 0
