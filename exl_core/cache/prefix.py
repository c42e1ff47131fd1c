"""Prefix index: full pages keyed by a hash chained over every token up to their end.

    key(page i) = H(key(page i-1) || tokens[i*ps:(i+1)*ps])      key(page -1) = b""

Two sequences share page i's K/V only when all tokens before and inside it agree, and the
chain guarantees that. The index maps key <-> physical page; reference counts and the LRU of
unreferenced pages live in the PagePool, which tells the index when it evicts a cached page.
Holds no tensors.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

from .pages import PagePool


def page_keys(tokens: Sequence[int], page_size: int, prev: bytes = b"", first_page: int = 0) -> list[bytes]:
    """Chained keys of every FULL page of `tokens`, starting at page `first_page` whose
    predecessor key is `prev` (b"" for page 0)."""
    keys = []
    h = prev
    for i in range(first_page, len(tokens) // page_size):
        chunk = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        h = hashlib.blake2b(h + chunk, digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixIndex:
    """key <-> page map over a PagePool."""

    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self._page: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        pool.on_evict = self._evicted

    def __len__(self) -> int:
        return len(self._page)

    def __contains__(self, key: bytes) -> bool:
        return key in self._page

    def page_of(self, key: bytes) -> int | None:
        return self._page.get(key)

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest run of leading keys present in the index."""
        pages = []
        for k in keys:
            p = self._page.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def acquire(self, keys: Sequence[bytes]) -> list[int]:
        """`match` and take a reference on every matched page (they leave the LRU)."""
        pages = self.match(keys)
        for p in pages:
            self.pool.acquire(p)
        return pages

    def register(self, key: bytes, page: int) -> bool:
        """Index a freshly filled, referenced page. False when the key already has a page
        (another sequence computed the same prefix first): this page then stays private."""
        if key in self._page or page in self._key:
            return False
        self._page[key] = page
        self._key[page] = key
        self.pool.mark_cached(page)
        return True

    def _evicted(self, page: int) -> None:
        key = self._key.pop(page)
        del self._page[key]
