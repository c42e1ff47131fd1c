"""qgemm_kslice's warp splits of mixed-width weights (ops/cuda_candidates.warp_splits), on the CPU: every chunk
covered once, in order; a warp marked 4-bit lies within one run of consecutive 4-bit chunks and its row offset
puts chunk c at qweight rows offset + 4c (the rows the chunk table holds); and the slowest warp's cost equals a
brute-force minimum over every split."""
from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch

from exl_core.ops.cuda_candidates import (_MIXED_WARP, MIXED_CHUNK_COST, SPLIT_INTS, SPLIT_WARPS, _chunk_runs,
                                          _warp_cost, chunk_table, warp_splits)


def _groups(layout):
    """[(bits, k_len)] -> groups int32 [G, 4] (bits, k_start, k_len, qrow_start), rows packed in order."""
    rows, k, q = [], 0, 0
    for bits, k_len in layout:
        rows.append((bits, k, k_len, q))
        k += k_len
        q += k_len * bits // 32
    return torch.tensor(rows, dtype=torch.int32)


def _decode(sp: list[int]):
    v, out, at = sp, {}, 0
    for kw in SPLIT_WARPS:
        out[kw] = (v[at:at + kw + 1], v[at + kw + 1:at + 2 * kw + 1])
        at += 2 * kw + 1
    assert at == len(v) == SPLIT_INTS
    return out


def _brute_min(run, kw):
    """The least slowest-warp cost over every split of the chunks into kw ranges (memoised on (start, warps))."""
    n = len(run)

    @functools.lru_cache(maxsize=None)
    def best(a, w):
        if w == 1:
            return _warp_cost(run, a, n)
        return min(max(_warp_cost(run, a, b), best(b, w - 1)) for b in range(a, n + 1))
    return best(0, kw)


LAYOUTS = [
    [(5, 256), (4, 3584), (3, 256)],                       # the bench's EXL2 ~4.0 bpw segments (K 4096)
    [(5, 896), (4, 9216), (3, 896)],                       # and K 11008
    [(6, 64), (4, 1024), (5, 96), (4, 512), (3, 128)],     # two 4-bit runs
    [(4, 32)] * 40,                                        # 4-bit only (groups of 32): one run
    [(3, 256), (5, 256)],                                  # no 4-bit chunk
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["bench4096", "bench11008", "two_runs", "all4", "none4"])
def test_splits_cover_runs_and_rows(layout):
    groups = _groups(layout)
    sp = warp_splits(groups)
    rows, run = _chunk_runs(groups)
    n = len(run)
    if all(r < 0 for r in run):
        assert sp is None
        return
    table = chunk_table(groups, "cpu").tolist()
    assert [r for _, _, r in table] == rows
    for kw, (starts, offs) in _decode(sp).items():
        assert starts[0] == 0 and starts[-1] == n and all(a <= b for a, b in zip(starts, starts[1:]))
        for (a, b), off in zip(zip(starts, starts[1:]), offs):
            if off == _MIXED_WARP:
                continue
            assert b > a and all(table[c][0] == 4 and table[c][2] == off + 4 * c for c in range(a, b)), (kw, a, b)
        assert any(off != _MIXED_WARP for off in offs)
        worst = max(_warp_cost(run, a, b) for a, b in zip(starts, starts[1:]))
        if n <= 128:                                        # the brute force is cubic
            assert worst == pytest.approx(_brute_min(run, kw))
        # never worse than the equal split the kernel takes without splits
        eq = [n * w // kw for w in range(kw + 1)]
        assert worst <= max(_warp_cost(run, a, b) for a, b in zip(eq, eq[1:])) + 1e-9


def test_the_bench_segments_get_their_own_warps():
    """K 4096, 8 warps: the 5-bit and 3-bit runs (8 chunks each) go to the first and last warps and the six others
    share the rest of the 4-bit chunks on the 4-bit path, so the slowest warp costs 18 chunks, not the equal
    split's 16 x 1.8 = 28.8."""
    starts, offs = _decode(warp_splits(_groups(LAYOUTS[0])))[8]
    assert starts[1] >= 8 and starts[-2] <= 120
    assert offs[0] == _MIXED_WARP and offs[-1] == _MIXED_WARP and all(o != _MIXED_WARP for o in offs[1:-1])
    _, run = _chunk_runs(_groups(LAYOUTS[0]))
    assert max(_warp_cost(run, a, b) for a, b in zip(starts, starts[1:])) == pytest.approx(18.0)
    assert 18.0 < 16 * MIXED_CHUNK_COST


def test_random_layouts_match_brute_force():
    rng = random.Random(7)
    for _ in range(30):
        layout = [(rng.choice([2, 3, 4, 4, 4, 5, 6, 8]), 32 * rng.randint(1, 4)) for _ in range(rng.randint(1, 12))]
        groups = _groups(layout)
        sp = warp_splits(groups)
        _, run = _chunk_runs(groups)
        if sp is None:
            assert all(r < 0 for r in run)
            continue
        for kw, (starts, _) in _decode(sp).items():
            worst = max(_warp_cost(run, a, b) for a, b in itertools.pairwise(starts))
            assert worst == pytest.approx(_brute_min(run, kw)), (layout, kw)
