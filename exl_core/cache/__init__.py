"""Paged KV cache: page accounting (no tensors), prefix index, tensor storage and context."""
from .paged import Cache, PagedContext
from .pages import PagePool, PageTable
from .prefix import PrefixIndex, page_keys

__all__ = ["Cache", "PagedContext", "PagePool", "PageTable", "PrefixIndex", "page_keys"]
