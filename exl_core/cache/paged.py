"""Paged K/V storage and the `ForwardContext` that reads/writes it.

    k[layer], v[layer]   (num_pages, page_size, Hkv, D)   model dtype, model device
    ┌────────┬────────┬────────┬─────┐
    │ page 0 │ page 1 │ page 2 │ ... │   a sequence's PageTable lists its pages in order;
    └────────┴────────┴────────┴─────┘   full pages may be shared through the PrefixIndex

The accounting (which page belongs to whom) lives in pages.py/prefix.py and holds no tensors;
this module only owns the tensors and turns page tables into the index tensors the attention
kernels take.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from ..errors import CacheFullError, InputError, is_int
from ..loader import SUPPORTED_DTYPES
from ..ops.attention import (PAGED_MAX_Q_ROWS, OutOrder, paged_attention, paged_attention_choice, rope_paged_attention,
                             rope_paged_attention_ordered, rope_write_kv, write_kv)
from ..ops.attention_gathered import sequence_causal_attention
from ..ops.decoder_layer import PagedKV
from ..ops.rope import apply_rope
from .pages import PagePool, PageTable
from .prefix import PrefixIndex, page_keys
from .sizing import bytes_per_token, known_free_memory, num_pages_for


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_model(model, what: str) -> None:
    """`model` as Cache and Generator take it: an object with a model config (a model load_model returned, or a
    stand-in); anything else would fail later as an AttributeError naming neither the argument nor the fix."""
    if isinstance(model, tuple):
        raise InputError(f"{what}: model is a tuple; load_model returns (model, tokenizer): pass the model "
                         "(model, tokenizer = load_model(...))")
    if getattr(model, "config", None) is None:
        raise InputError(f"{what}: model must be a model (as load_model returns it), got {type(model).__name__}")


class Cache:
    """Paged K/V cache of one model: tensors + PagePool + PrefixIndex (+ sliding window)."""

    def __init__(self, model, max_tokens: Optional[int] = None, page_size: int = 256,
                 dtype: Optional[torch.dtype] = None, tp_group=None):
        """`tp_group`: the tensor-parallel ranks that must all size this cache alike where it is sized from free
        memory (max_tokens None); default the model's own group (a sharded model's `tensor_parallel`)."""
        check_model(model, "Cache")
        cfg = model.config
        if not is_int(page_size) or page_size < 1:
            raise InputError(f"Cache: page_size={page_size!r} must be an int >= 1")
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
            raise InputError(f"Cache: max_tokens={max_tokens!r} must be an int >= 1 (or None to size from free "
                             "memory)")
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            # the dtypes load_model takes: an integer cache rounds every K/V to garbage, a str fails in sizing
            raise InputError(f"Cache: dtype={dtype!r} is not supported: use one of "
                             f"{', '.join(map(str, SUPPORTED_DTYPES))} (or None for the model's dtype)")
        self.model = model
        self.config = cfg
        self.page_size = page_size
        self.dtype = dtype or model.dtype
        self.device = torch.device(model.device)
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # pages leave the cache only where every layer slides (a model config of another kind: its sliding_window)
        self.window: Optional[int] = getattr(cfg, "uniform_window", getattr(cfg, "sliding_window", None)) or None
        # Prefix sharing is off with a sliding window: a job re-reserves every page it drops
        # out of the window, which is only sound when the dropped page really returns to the
        # pool (a page still shared with another sequence would not).
        self.prefix_sharing = self.window is None
        per_token = bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        self.num_pages = num_pages_for(per_token, page_size, self.device, max_tokens,
                                       cfg.max_position_embeddings)
        tp = tp_group if tp_group is not None else getattr(model, "tensor_parallel", None)
        if tp is not None and max_tokens is None:   # each rank read its own free memory: all take the smallest
            self.num_pages = tp.agreed_min(self.num_pages)
        need = self.num_pages * page_size * per_token
        if max_tokens is not None:
            # a size past the free memory fails deep in torch's allocator (or, where the OS overcommits, gets the
            # process killed while the pages are zeroed): refuse it here, with the numbers
            free = known_free_memory(self.device)
            if free is not None and need > free:
                raise InputError(f"Cache: max_tokens={max_tokens} needs {need} bytes ({_gib(need)}, {per_token} "
                                 f"bytes a token) but only {free} bytes ({_gib(free)}) are free on {self.device}; "
                                 f"lower max_tokens (under {free // per_token} tokens) or pass None to size from "
                                 "free memory")
        shape = (self.num_pages, page_size, self.num_kv_heads, self.head_dim)
        try:
            # zeros, not empty: a kernel reading a masked slot must see finite values (0 * NaN = NaN)
            self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        except RuntimeError as e:   # torch.OutOfMemoryError too: free memory is only an estimate
            self.k = self.v = []    # the traceback keeps self alive: drop the layers already allocated
            asked = f"max_tokens={max_tokens}" if max_tokens is not None else "sized from free memory"
            raise InputError(f"Cache: {asked}: allocating {need} bytes ({_gib(need)}) of K/V cache on "
                             f"{self.device} failed ({str(e).splitlines()[0][:200]}); lower max_tokens") from e
        self.pool = PagePool(self.num_pages)
        self.index = PrefixIndex(self.pool, page_size)

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- admission --------------------------------------------------------------------------
    def pages_to_reserve(self, total_len: int, shared: int, max_chunk: int) -> int:
        """New pages a sequence of `total_len` stored positions may hold at once, given
        `shared` adopted prefix pages. With a sliding window only the visible span (plus the
        chunk being written) is ever held."""
        ps = self.page_size
        total = -(-total_len // ps) - shared
        if self.window:
            total = min(total, -(-(self.window - 1 + max_chunk) // ps) + 1)
        return max(0, total)

    def check_fits(self, prompt_len: int, max_chunk: int, what: str = "prompt") -> None:
        """CacheFullError when a prompt can never fit, however empty the cache."""
        need = self.pages_to_reserve(prompt_len, 0, max_chunk)
        if need > self.num_pages:
            fix = "raise Cache(max_tokens=...) or shorten the prompt"
            # with a window a job holds the window plus one chunk: the largest chunk that fits
            chunk = (self.num_pages - 1) * self.page_size - self.window + 1 if self.window else 0
            if chunk >= 1:
                fix = (f"raise Cache(max_tokens=...), shorten the prompt or pass a smaller "
                       f"Generator(max_chunk_size=...) (now {max_chunk}; at most {chunk} fits with the model's "
                       f"sliding window of {self.window})")
            raise CacheFullError(f"{what} of {prompt_len} tokens needs {need} pages but the cache has "
                                 f"{self.num_pages} pages of {self.page_size} tokens ({self.max_tokens} tokens); "
                                 f"{fix}")

    def prompt_keys(self, prompt: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """Keys of the prompt's full pages that may be shared: those ending before its last
        token (which must run through the model to produce logits). `salt` starts the chain:
        sequences whose K/V differ for the same tokens (another LoRA mix) never share."""
        if not self.prefix_sharing:
            return []
        return page_keys(prompt[:len(prompt) - 1], self.page_size, prev=salt)

    def try_admit(self, prompt: Sequence[int], total_len: int, max_chunk: int,
                  reuse: bool = True, keys: Optional[list[bytes]] = None,
                  salt: bytes = b"") -> Optional[PageTable]:
        """A PageTable for a new sequence, or None when the pool cannot promise its pages now.

        Reuses every cached full page of the prompt that ends before its last token (the last
        token must run through the model to produce logits). `total_len`: positions whose K/V
        will ever be stored (prompt + new tokens - 1)."""
        ps = self.page_size
        if not reuse or not self.prefix_sharing:
            keys = []
        elif keys is None:
            keys = self.prompt_keys(prompt, salt)
        matched = self.index.match(keys)
        keys = keys[:len(matched)]
        need = self.pages_to_reserve(total_len, len(matched), max_chunk)
        # matched pages now in the LRU stop counting as available once referenced
        idle = sum(1 for p in matched if self.pool.ref(p) == 0)
        if need > self.pool.available - idle:
            return None
        for p in matched:
            self.pool.acquire(p)
        table = PageTable(ps)
        table.adopt_prefix(matched, keys)
        table.salt = salt
        self.pool.reserve(need)
        table.reserved = need
        return table

    def after_forward(self, table: PageTable, tokens: Sequence[int], n_new: int, more_to_come: bool) -> None:
        """Account `n_new` freshly written positions of `table` (whose sequence so far is
        `tokens`): index pages that became full, release pages that left the window."""
        ps = self.page_size
        table.num_tokens += n_new
        full = table.num_tokens // ps
        if self.prefix_sharing and full > len(table.keys):
            prev = table.keys[-1] if table.keys else table.salt
            new_keys = page_keys(tokens[:full * ps], ps, prev=prev, first_page=len(table.keys))
            for i, k in enumerate(new_keys, start=len(table.keys)):
                if table.pages[i] >= 0:
                    self.index.register(k, table.pages[i])
            table.keys.extend(new_keys)
        if self.window:
            table.release_window(self.pool, self.window, keep_reservation=more_to_come)

    def release(self, table: PageTable) -> None:
        table.free(self.pool)

    # -- forward ----------------------------------------------------------------------------
    def context(self, tables: Sequence[PageTable], new_lens: Sequence[int],
                logit_rows: Optional[torch.Tensor] = None) -> "PagedContext":
        """Context for one forward pass: sequence s appends `new_lens[s]` tokens after its
        `num_tokens` stored ones. Takes the pages the new tokens need (from reservations)."""
        self.prepare(tables, new_lens)
        return PagedContext(self, tables, new_lens, logit_rows)

    def prepare(self, tables: Sequence[PageTable], new_lens: Sequence[int]) -> None:
        """Take the pages `new_lens[s]` more tokens of each table need (from reservations); for
        callers that build their own context (cuda_graphs.StaticDecodeContext)."""
        for t, n in zip(tables, new_lens):
            t.ensure(self.pool, t.num_tokens + n)


def table_width(tables: Sequence[PageTable]) -> int:
    """Block-table columns a batch needs: its longest page list (at least 1)."""
    return max([len(t.pages) for t in tables] + [1])


def step_indices(tables: Sequence[PageTable], new_lens: Sequence[int], width: int
                 ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host lists of one forward pass where table s appends new_lens[s] tokens after its stored ones:
    positions and slots per new token, keys per sequence after the pass, and the block table flat,
    each row padded with -1 to `width` (PagedContext; cuda_graphs.StaticDecodeContext packs the same)."""
    pos, slots, lens, rows = [], [], [], []
    for t, n in zip(tables, new_lens):
        s = t.num_tokens
        pos.extend(range(s, s + n))
        slots.extend(t.slots(s, n))
        lens.append(s + n)
        rows += t.pages + [-1] * (width - len(t.pages))
    return pos, slots, lens, rows


def fresh_prefill_on(device: torch.device) -> bool:
    """Whether a fresh sequence's prefill may attend by SDPA's causal mask (sequence_causal_attention) where paged
    attention would gather every page under an explicit mask (ops/attention_gathered.py, the CUDA path above
    PAGED_MAX_Q_ROWS rows: a 2,048-token prompt's first token through the Generator ran at 0.8110x the bench's forward
    on the H200, stop 50). On by default on CUDA (H200, stop 51, bench/fresh_prefill_ab.py, GPTQ 7B, 3 rounds: a
    2,048-token prompt in one chunk 45,063.28 tok/s against 37,362.17, medians; logits within 0.0039 of the gathered
    path's); EXL_CORE_FRESH_PREFILL=0 turns it off (A/B). The CPU keeps its paged kernel."""
    return device.type == "cuda" and os.environ.get("EXL_CORE_FRESH_PREFILL", "1") != "0"


def chunk_prefill_on(device: torch.device) -> bool:
    """Whether one sequence's later prefill chunk (earlier positions cached: the Generator's chunks after the first,
    a prompt after a reused prefix) may attend by SDPA's lower-right causal mask over its gathered slots
    (sequence_causal_attention) where paged attention would gather every page under an explicit mask. On CUDA with
    fresh_prefill_on; EXL_CORE_CHUNK_PREFILL=0 turns it off (A/B)."""
    return fresh_prefill_on(device) and os.environ.get("EXL_CORE_CHUNK_PREFILL", "1") != "0"


class PagedContext:
    """`ForwardContext` over the paged cache for a flat ragged batch.

    positions int64 [T]; cu_seqlens int64 [S+1]; block_table int32 [S, max_pages] (-1 pads
    and released window pages); seq_lens_k int64 [S]; slots int64 [T].
    """
    fresh = False     # one sequence's first chunk (set per instance; subclasses that skip __init__ keep False)
    single = False    # one sequence's chunk of more than one row (fresh or after cached positions)
    kv_slots = None   # single and not fresh: the slots of all its keys (positions 0 .. seq_lens_k - 1), made once
    single_keys = 0   # single: its keys after this pass (seq_lens_k[0], known on the host)

    def __init__(self, cache: Cache, tables: Sequence[PageTable], new_lens: Sequence[int],
                 logit_rows: Optional[torch.Tensor] = None):
        dev = cache.device
        self.cache = cache
        width = table_width(tables)
        pos, slots, lens, rows = step_indices(tables, new_lens, width)
        cu = [0]
        for n in new_lens:
            cu.append(cu[-1] + n)
        self.positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        self.num_positions = max(pos) + 1 if pos else 1  # from the host list: the model reads no position back
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int64, device=dev)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=dev)
        self.block_table = torch.tensor(rows, dtype=torch.int32, device=dev).reshape(len(tables), width)
        self.seq_lens_k = torch.tensor(lens, dtype=torch.int64, device=dev)
        self.logit_rows = logit_rows.to(dev) if logit_rows is not None else None
        self.max_q_len = max(new_lens, default=0)
        # One sequence's chunk: its attention needs only the causal mask, over its own rows where they start at
        # position 0 (fresh), else over all its keys, whose slots are gathered (_sequence_slots; a window narrower
        # than the keys, whose released pages have no slots, is refused in _causal_attention before they are read)
        self.single = len(tables) == 1 and new_lens[0] > 1
        self.fresh = self.single and lens[0] == new_lens[0]
        self.single_keys = lens[0] if self.single else 0

    def _causal_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float,
                          window: Optional[int]) -> bool:
        """Whether attention runs as sequence_causal_attention: one sequence (self.single) of more rows than the paged
        kernels take, no window narrower than its keys, this class's own attend, fresh_prefill_on (chunk_prefill_on
        after cached positions), and only where paged attention would run the page-gathering SDPA (so a forced or
        disabled attention kernel is honoured)."""
        if not (self.single and self.max_q_len > PAGED_MAX_Q_ROWS and (not window or self.single_keys <= window)
                and type(self).attend is PagedContext.attend
                and (fresh_prefill_on(q.device) if self.fresh else chunk_prefill_on(q.device))):
            return False
        return paged_attention_choice(q, kc, vc, self.block_table, self.cu_seqlens, self.seq_lens_k, scale, window,
                                      self.max_q_len) == "gathered_sdpa"

    def _sequence_slots(self) -> torch.Tensor:
        """The single sequence's key slots: its rows' own when fresh, else all its positions' from the block table's row
        (on the device, made once a pass: no host list of every position)."""
        if self.fresh:
            return self.slots
        if self.kv_slots is None:
            ps = self.cache.page_size
            pages = self.block_table[0, :-(-self.single_keys // ps)].to(torch.int64)
            offsets = torch.arange(ps, dtype=torch.int64, device=pages.device)
            self.kv_slots = (pages[:, None] * ps + offsets).reshape(-1)[:self.single_keys]
        return self.kv_slots

    def native_kv(self) -> Optional[PagedKV]:
        """The tensors a fused decoder op needs to do what `attend` does, or None when a subclass
        changed `attend` or `attend_rope` (the fused op would skip that change)."""
        if type(self).attend is not PagedContext.attend or type(self).attend_rope is not PagedContext.attend_rope:
            return None
        return PagedKV(self.positions, self.slots, self.block_table, self.cu_seqlens, self.seq_lens_k,
                       self.cache.k, self.cache.v)

    def attend_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                    scale: float, window: Optional[int]) -> torch.Tensor:
        """`attend` of q and k before rope (rotated at self.positions): rope, the K/V write and attention in one op
        (rope_paged_attention: on CUDA one launch at decode, else rope_write_kv's, then attention's; at decode the
        launch takes each row's position and slot from seq_lens_k and the block table, so a subclass that changes
        self.positions or self.slots must override this too). A subclass that changed `attend` gets rope, then its
        `attend`."""
        if type(self).attend is not PagedContext.attend:
            q, k = apply_rope(q, k, self.positions, cos_sin)
            return self.attend(layer, q, k, v, scale, window)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if self.single and self._causal_attention(q, kc, vc, scale, window):    # decode: one attribute read
            q = rope_write_kv(q, k, v, self.positions, cos_sin, kc, vc, self.slots)
            return sequence_causal_attention(q, kc, vc, self._sequence_slots(), scale)
        return rope_paged_attention(q, k, v, self.positions, cos_sin, kc, vc, self.slots, self.block_table,
                                    self.cu_seqlens, self.seq_lens_k, scale, window, self.max_q_len)  # (T, Hq, D)

    def attend_rope_ordered(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos_sin: torch.Tensor, scale: float, window: Optional[int],
                            order: OutOrder) -> Optional[torch.Tensor]:
        """attend_rope's output (T, Hq * D) with its columns stored where `order` puts them (the o projection's
        act-order: ops.attention.rope_paged_attention_ordered), or None, doing nothing, where its one launch does not
        serve or a subclass changed `attend` or `attend_rope` (the caller then runs attend_rope)."""
        if (self.max_q_len != 1 or type(self).attend is not PagedContext.attend
                or type(self).attend_rope is not PagedContext.attend_rope):     # only decode rows take it
            return None
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        return rope_paged_attention_ordered(q, k, v, self.positions, cos_sin, kc, vc, self.slots, self.block_table,
                                            self.cu_seqlens, self.seq_lens_k, scale, window, self.max_q_len, order)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, window: Optional[int]) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        write_kv(kc, vc, k, v, self.slots)                     # k, v (T, Hkv, D) -> pages
        if self.single and self._causal_attention(q, kc, vc, scale, window):    # decode: one attribute read
            return sequence_causal_attention(q, kc, vc, self._sequence_slots(), scale)
        return paged_attention(q, kc, vc, self.block_table, self.cu_seqlens, self.seq_lens_k,
                               scale, window, self.max_q_len)  # (T, Hq, D)
