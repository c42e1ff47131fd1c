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


# -- tensor storage + PagedContext -------------------------------------------------------------
import types  # noqa: E402

import torch  # noqa: E402

from exl_core.cache import Cache  # noqa: E402
from exl_core.cache import sizing  # noqa: E402


def _fake_model(layers=2, hkv=2, d=64, window=None, dtype=torch.float32):
    cfg = types.SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=hkv, head_dim=d,
                                sliding_window=window, max_position_embeddings=2048)
    return types.SimpleNamespace(config=cfg, dtype=dtype, device=torch.device("cpu"))


def _brute_attention(q, k, v, q_start, window, scale=None):
    """float64 causal (windowed) attention of one sequence: q (Tq, Hq, D), k/v (Tk, Hkv, D); scale 1 / sqrt(D) unless
    given."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        p = q_start + i
        lo = max(0, p - window + 1) if window else 0
        for h in range(q.shape[1]):
            s = (k[lo:p + 1, h // rep] @ q[i, h]) * (q.shape[2] ** -0.5 if scale is None else scale)
            out[i, h] = torch.softmax(s, 0) @ v[lo:p + 1, h // rep]
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_paged_context_matches_brute_force(window):
    rng = random.Random()
    ps, hq, hkv, d = 8, 4, 2, 64
    cache = Cache(_fake_model(layers=1, hkv=hkv, d=d, window=window), max_tokens=40 * ps, page_size=ps)
    assert cache.num_pages == 40 and cache.k[0].shape == (40, ps, hkv, d)
    for t in cache.k + cache.v:       # poison: no kernel may read a slot no sequence owns
        t.fill_(float("nan"))
    seqs = []   # (table, all k, all v)
    for _ in range(3):
        n_total = rng.randint(1, 60)
        t = cache.try_admit(list(range(n_total)), n_total + 20, 32, reuse=False)
        seqs.append([t, torch.randn(n_total + 20, hkv, d), torch.randn(n_total + 20, hkv, d), n_total])
    # two passes: a ragged prefill of everything, then a ragged extension of random length
    for step in range(2):
        lens = [s[3] if step == 0 else rng.randint(0, 20) for s in seqs]
        starts = [s[0].num_tokens for s in seqs]
        ctx = cache.context([s[0] for s in seqs], lens)
        T = sum(lens)
        q = torch.randn(T, hq, d)
        k = torch.cat([s[1][a:a + n] for s, a, n in zip(seqs, starts, lens)])
        v = torch.cat([s[2][a:a + n] for s, a, n in zip(seqs, starts, lens)])
        assert ctx.positions.tolist() == [p for a, n in zip(starts, lens) for p in range(a, a + n)]
        assert ctx.num_positions == (int(ctx.positions.max()) + 1 if T else 1)     # the model's rope table size
        out = ctx.attend(0, q, k, v, d ** -0.5, window)
        row = 0
        for s, a, n in zip(seqs, starts, lens):
            ref = _brute_attention(q[row:row + n], s[1][:a + n], s[2][:a + n], a, window)
            torch.testing.assert_close(out[row:row + n].double(), ref, atol=2e-5, rtol=2e-5)
            row += n
        for s, n in zip(seqs, lens):
            cache.after_forward(s[0], list(range(s[0].num_tokens + n)), n, more_to_come=True)
        cache.pool.check()
    for s in seqs:
        cache.release(s[0])
    cache.pool.check()
    assert cache.pool.reserved == 0 and cache.pool.num_free + cache.pool.num_cached_unreferenced == 40


def _fresh_spy(monkeypatch):
    """sequence_causal_attention's calls, with the path forced on as on CUDA (fresh_prefill_on, and the dispatcher
    picking the page-gathering SDPA it stands in for)."""
    from exl_core.cache import paged
    from exl_core.ops import dispatch
    calls = []
    real = paged.sequence_causal_attention
    monkeypatch.setattr(paged, "sequence_causal_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(paged, "fresh_prefill_on", lambda device: True)
    monkeypatch.setitem(dispatch._FORCED, "attention", "gathered_sdpa")
    return calls


def _poisoned_cache(window, ps, hkv, d):
    """A one-layer cache of 40 pages, every slot NaN: no attention may read a slot its sequence did not write."""
    cache = Cache(_fake_model(layers=1, hkv=hkv, d=d, window=window), max_tokens=40 * ps, page_size=ps)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("window", [None, 20])
def test_fresh_prefill_attends_by_the_causal_mask(monkeypatch, window):
    """A fresh sequence's first chunk (positions from 0, more rows than the paged kernels take, no window narrower
    than it) attends by SDPA's causal mask over its own slots (forced on here; off by default, on CUDA only): as
    float64 brute force, with and without rope, and only there: a later chunk, two sequences, 16 rows or a chunk
    longer than the window take paged attention."""
    from exl_core.cache import paged
    calls = _fresh_spy(monkeypatch)
    ps, hq, hkv, d = 8, 4, 2, 64
    cache = _poisoned_cache(window, ps, hkv, d)
    n = 30
    tabs = [cache.try_admit(list(range(100 + i, 100 + i + n + 8)), n + 8, 32, reuse=False) for i in range(2)]
    k, v = torch.randn(n + 8, hkv, d), torch.randn(n + 8, hkv, d)
    for m in (n, 20, 18, 16):                    # a window of 20: 30 rows take paged attention, 20 the causal mask
        ctx = cache.context([tabs[0]], [m])
        assert ctx.fresh
        expect = 0 if m <= 16 or (window and m > window) else 1
        calls.clear()
        q = torch.randn(m, hq, d)
        out = ctx.attend(0, q, k[:m], v[:m], d ** -0.5, window)
        assert len(calls) == expect
        torch.testing.assert_close(out.double(), _brute_attention(q, k[:m], v[:m], 0, window), atol=2e-5, rtol=2e-5)
        cos_sin = torch.randn(64, d)                # attend_rope: the same rope, then either attention
        calls.clear()
        out_rope = ctx.attend_rope(0, q, k[:m], v[:m], cos_sin, d ** -0.5, window)
        monkeypatch.setattr(paged, "fresh_prefill_on", lambda device: False)
        ref_rope = ctx.attend_rope(0, q, k[:m], v[:m], cos_sin, d ** -0.5, window)
        monkeypatch.setattr(paged, "fresh_prefill_on", lambda device: True)
        assert len(calls) == expect
        torch.testing.assert_close(out_rope, ref_rope, atol=2e-5, rtol=2e-5)
    cache.after_forward(tabs[0], list(range(100, 100 + 12)), 12, more_to_come=True)
    assert not cache.context([tabs[0]], [5]).fresh                   # rows from position 12: its keys are cached
    assert not cache.context(tabs, [5, 5]).fresh                     # two sequences
    assert not cache.context([tabs[1]], [1]).fresh                   # one row: decode's own path


@pytest.mark.parametrize("window", [None, 40])
def test_later_prefill_chunk_attends_by_the_lower_right_causal_mask(monkeypatch, window):
    """One sequence's later chunk (earlier positions cached, more rows than the paged kernels take) attends by the
    lower-right causal mask over all its keys' slots (forced on as on CUDA: chunk_prefill_on; its pages not contiguous):
    as float64 brute force, and with rope as the paged path (EXL_CORE_CHUNK_PREFILL=0); paged attention where
    the keys outnumber the window, for 16 rows and for two sequences."""
    from exl_core.cache import paged
    calls = _fresh_spy(monkeypatch)
    ps, hq, hkv, d = 8, 4, 2, 64
    cache = _poisoned_cache(window, ps, hkv, d)
    total = 60
    tabs = [cache.try_admit(list(range(100 + i, 100 + i + total)), total, 32, reuse=False) for i in range(2)]
    k, v = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    first = 13
    ctx = cache.context([tabs[0]], [first])
    ctx.attend(0, torch.randn(first, hq, d), k[:first], v[:first], d ** -0.5, window)   # the first chunk's keys
    cache.after_forward(tabs[0], list(range(100, 100 + first)), first, more_to_come=True)
    other = cache.context([tabs[1]], [20])       # its pages next: the first sequence's later pages are not contiguous,
    other.attend(0, torch.randn(20, hq, d), k[:20], v[:20], d ** -0.5, window)    # so its key slots must follow its
    cache.after_forward(tabs[1], list(range(101, 121)), 20, more_to_come=True)    # table, not its positions
    for m in (30, 16):
        ctx = cache.context([tabs[0]], [m])
        assert ctx.single and not ctx.fresh
        keys = first + m
        expect = 0 if m <= 16 or (window and keys > window) else 1
        calls.clear()
        q = torch.randn(m, hq, d)
        out = ctx.attend(0, q, k[first:keys], v[first:keys], d ** -0.5, window)
        assert len(calls) == expect
        torch.testing.assert_close(out.double(), _brute_attention(q, k[:keys], v[:keys], first, window),
                                   atol=2e-5, rtol=2e-5)
        cos_sin = torch.randn(128, d)
        calls.clear()
        out_rope = ctx.attend_rope(0, q, k[first:keys], v[first:keys], cos_sin, d ** -0.5, window)
        assert len(calls) == expect
        monkeypatch.setenv("EXL_CORE_CHUNK_PREFILL", "0")
        ref_rope = ctx.attend_rope(0, q, k[first:keys], v[first:keys], cos_sin, d ** -0.5, window)
        monkeypatch.delenv("EXL_CORE_CHUNK_PREFILL")
        assert len(calls) == expect
        torch.testing.assert_close(out_rope, ref_rope, atol=2e-5, rtol=2e-5)
    assert tabs[0].slots(0, first + 30) != list(range(first + 30))   # the case above: slots other than positions
    assert not cache.context(tabs, [20, 20]).single                  # two sequences
    assert not cache.context([tabs[0]], [1]).single                  # one row: decode's own path


def test_chunk_prefill_is_on_with_the_fresh_prefill_on_cuda_only(monkeypatch):
    from exl_core.cache.paged import chunk_prefill_on
    monkeypatch.delenv("EXL_CORE_FRESH_PREFILL", raising=False)
    monkeypatch.delenv("EXL_CORE_CHUNK_PREFILL", raising=False)
    assert chunk_prefill_on(torch.device("cuda")) and not chunk_prefill_on(torch.device("cpu"))
    monkeypatch.setenv("EXL_CORE_CHUNK_PREFILL", "0")
    assert not chunk_prefill_on(torch.device("cuda"))
    monkeypatch.setenv("EXL_CORE_CHUNK_PREFILL", "1")
    monkeypatch.setenv("EXL_CORE_FRESH_PREFILL", "0")
    assert not chunk_prefill_on(torch.device("cuda"))


def test_fresh_prefill_keeps_a_subclass_attend_a_forced_kernel_and_the_cache_dtype(monkeypatch):
    """The causal-mask path stays out where a subclass changed `attend` or a forced attention kernel is not the
    page-gathering SDPA, and reads a cache of another dtype than q as paged attention does (converted to q's)."""
    from exl_core.cache.paged import PagedContext
    from exl_core.ops import dispatch
    calls = _fresh_spy(monkeypatch)
    ps, hq, hkv, d, m = 8, 4, 2, 64, 24
    cache = Cache(_fake_model(layers=1, hkv=hkv, d=d, dtype=torch.bfloat16), max_tokens=10 * ps, page_size=ps)
    tab = cache.try_admit(list(range(m + 4)), m + 4, 32, reuse=False)
    q, k, v = torch.randn(m, hq, d), torch.randn(m, hkv, d), torch.randn(m, hkv, d)
    ctx = cache.context([tab], [m])
    out = ctx.attend(0, q, k, v, d ** -0.5, None)                     # bf16 cache, fp32 q
    assert len(calls) == 1 and out.dtype == torch.float32
    ref = _brute_attention(q, k.bfloat16().float(), v.bfloat16().float(), 0, None)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)

    class Logged(PagedContext):
        def attend(self, layer, q, k, v, scale, window):
            return super().attend(layer, q, k, v, scale, window)
    ctx.__class__ = Logged
    calls.clear()
    ctx.attend_rope(0, q, k, v, torch.randn(64, d), d ** -0.5, None)
    assert calls == []
    ctx.__class__ = PagedContext
    monkeypatch.setitem(dispatch._FORCED, "attention", "torch_ref")
    ctx.attend(0, q, k, v, d ** -0.5, None)
    assert calls == []
    monkeypatch.delitem(dispatch._FORCED, "attention")
    monkeypatch.setattr(dispatch, "_DISABLED", {"gathered_sdpa", "cpu"})    # the reference, not the gathering SDPA
    ctx.attend(0, q, k, v, d ** -0.5, None)
    assert calls == []


def test_fresh_prefill_keeps_the_attention_scale(monkeypatch):
    """The model's attention scale, not SDPA's default 1 / sqrt(D), in the causal-mask path."""
    calls = _fresh_spy(monkeypatch)
    ps, hq, hkv, d, m = 8, 4, 2, 64, 24
    cache = Cache(_fake_model(layers=1, hkv=hkv, d=d), max_tokens=10 * ps, page_size=ps)
    ctx = cache.context([cache.try_admit(list(range(m + 4)), m + 4, 32, reuse=False)], [m])
    q, k, v = torch.randn(m, hq, d), torch.randn(m, hkv, d), torch.randn(m, hkv, d)
    out = ctx.attend(0, q, k, v, 0.3, None)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), _brute_attention(q, k, v, 0, None, scale=0.3), atol=2e-5, rtol=2e-5)


def test_fresh_prefill_is_on_by_default_on_cuda_only(monkeypatch):
    from exl_core.cache.paged import fresh_prefill_on
    monkeypatch.delenv("EXL_CORE_FRESH_PREFILL", raising=False)
    assert fresh_prefill_on(torch.device("cuda")) and not fresh_prefill_on(torch.device("cpu"))
    monkeypatch.setenv("EXL_CORE_FRESH_PREFILL", "0")
    assert not fresh_prefill_on(torch.device("cuda")) and not fresh_prefill_on(torch.device("cpu"))
    monkeypatch.setenv("EXL_CORE_FRESH_PREFILL", "1")
    assert fresh_prefill_on(torch.device("cuda")) and not fresh_prefill_on(torch.device("cpu"))


def test_contiguous_context_states_its_rope_size():
    """ContiguousContext gives the model 1 + its largest position from the host (Model.forward then reads no position
    back from the device), also with cached starts, an empty sequence and no tokens at all."""
    from exl_core.model.context import ContiguousContext
    for lens, starts in (([5, 0, 3], [0, 9, 7]), ([1], [30]), ([0, 0], [4, 2]), ([], [])):
        ctx = ContiguousContext(lens, [types.SimpleNamespace(length=s) if s else None for s in starts])
        T = sum(lens)
        assert ctx.num_positions == (int(ctx.positions.max()) + 1 if T else 1)


def test_cache_sizing_from_cap_and_memory(monkeypatch):
    m = _fake_model(layers=30, hkv=3, d=64, dtype=torch.bfloat16)
    assert sizing.bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert Cache(m, max_tokens=1000, page_size=256).num_pages == 4          # rounded up
    per_page = sizing.bytes_per_token(30, 3, 64, torch.bfloat16) * 256
    monkeypatch.setattr(sizing, "free_memory", lambda dev: int((100 * per_page + sizing.ACTIVATION_RESERVE)
                                                               / sizing.CPU_FRACTION))
    assert sizing.num_pages_for(per_page // 256, 256, torch.device("cpu"), None, 10 ** 6) == 100
    monkeypatch.setattr(sizing, "free_memory", lambda dev: int((1000 * per_page + sizing.ACTIVATION_RESERVE)
                                                               / sizing.CPU_FRACTION))
    # without a cap: at most DEFAULT_CAP_SEQS sequences of max(max_seq_len, 8192)
    assert sizing.num_pages_for(per_page // 256, 256, torch.device("cpu"), None, 8192) == 4 * 8192 // 256
    assert sizing.num_pages_for(per_page // 256, 256, torch.device("cpu"), None, 32768) == 4 * 32768 // 256
    with pytest.raises(Exception):
        Cache(m, max_tokens=0)


def test_free_memory_respects_a_container_memory_limit(tmp_path, monkeypatch):
    """A memory cgroup's limit (Docker, Kubernetes) bounds what the process may use whatever the host has free: the
    cache was sized from /proc/meminfo alone and could outgrow the limit (the process killed while zeroing it)."""
    def tree(lines: str, files: dict) -> tuple[str, str]:
        root = tmp_path / f"cg{len(list(tmp_path.iterdir()))}"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        (root / "self").write_text(lines)
        return str(root), str(root / "self")

    gib = 1 << 30
    v2 = tree("0::/job\n", {"job/memory.max": f"{4 * gib}\n", "job/memory.current": f"{gib}\n"})
    assert sizing.cgroup_headroom(*v2) == 3 * gib
    # reclaimable page cache (the mapped weight files) is room too
    v2 = tree("0::/job\n", {"job/memory.max": f"{4 * gib}\n", "job/memory.current": f"{2 * gib}\n",
                            "job/memory.stat": f"anon 5\ninactive_file {gib}\nactive_file 9\n"})
    assert sizing.cgroup_headroom(*v2) == 3 * gib
    v1 = tree("4:memory:/pod/x\n3:cpu:/\n", {"memory/pod/x/memory.limit_in_bytes": f"{2 * gib}",
                                              "memory/pod/x/memory.usage_in_bytes": f"{gib // 2}",
                                              "memory/memory.limit_in_bytes": "9223372036854771712",
                                              "memory/memory.usage_in_bytes": "5"})
    assert sizing.cgroup_headroom(*v1) == 2 * gib - gib // 2
    assert sizing.cgroup_headroom(*tree("0::/\n", {"memory.max": "max\n", "memory.current": "7\n"})) is None
    assert sizing.cgroup_headroom(str(tmp_path / "none"), str(tmp_path / "missing")) is None
    monkeypatch.setattr(sizing, "cgroup_headroom", lambda: 3 * gib)
    monkeypatch.setattr(sizing, "_mem_available", lambda: 20 * gib)
    assert sizing.known_free_memory(torch.device("cpu")) == 3 * gib
    monkeypatch.setattr(sizing, "cgroup_headroom", lambda: None)
    assert sizing.known_free_memory(torch.device("cpu")) == 20 * gib
    # on a GPU, blocks torch's allocator caches unused count as free: the size from free memory and Cache's check
    # of a max_tokens read the same number (the sizing left them out)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: gib)
    assert sizing.known_free_memory(torch.device("cuda", 0)) == 7 * gib


def test_cache_full_check_names_sizes():
    cache = Cache(_fake_model(), max_tokens=64, page_size=16)
    cache.check_fits(64, 32)
    with pytest.raises(CacheFullError, match="65 tokens needs 5 pages"):
        cache.check_fits(65, 32)
    assert cache.try_admit([1] * 30, 64, 32) is not None
    assert cache.try_admit([1] * 30, 64, 32) is None          # 4 pages reserved already: busy, not full


def test_salted_chains_never_share_pages():
    ps = 4
    cache = Cache(_fake_model(), max_tokens=64, page_size=ps)
    prompt = [random.randrange(1000) for _ in range(3 * ps + 1)]
    a = cache.try_admit(prompt, len(prompt), 8)
    a.ensure(cache.pool, len(prompt))
    cache.after_forward(a, prompt, len(prompt), more_to_come=False)
    assert len(cache.index) == 3
    salt = bytes(range(16))    # what lora.prefix_salt gives another mix (tests/test_lora.py checks it)
    b = cache.try_admit(prompt, len(prompt), 8, salt=salt)         # another LoRA mix: nothing shared
    assert b.shared == 0 and b.salt == salt
    b.ensure(cache.pool, len(prompt))
    cache.after_forward(b, prompt, len(prompt), more_to_come=False)
    assert len(cache.index) == 6                                    # its own chain
    c = cache.try_admit(prompt, len(prompt), 8, salt=salt)
    assert c.shared == 3 and c.pages[:3] == b.pages[:3]
    d = cache.try_admit(prompt, len(prompt), 8)
    assert d.shared == 3 and d.pages[:3] == a.pages[:3]
    for t in (a, b, c, d):
        cache.release(t)
    cache.pool.check()
    assert cache.pool.reserved == 0
