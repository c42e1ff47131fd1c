"""Dispatcher: the per-key choice cache must pick what select() picks and notice new candidates."""
from __future__ import annotations

import pytest
import torch

from exl_core.errors import KernelError
from exl_core.ops.dispatch import Candidate, Dispatcher


def _disp(calls):
    def check_small(n):
        calls.append("check_small")
        return None if n < 10 else f"n={n} too large"
    return Dispatcher("toy", [
        Candidate("small", check_small, lambda n: ("small", n)),
        Candidate("any", lambda n: None, lambda n: ("any", n)),
    ], key=lambda n: n < 10)


def test_cached_choice_matches_select_and_skips_checks():
    calls = []
    d = _disp(calls)
    assert d(n=3) == ("small", 3)
    assert d(n=4) == ("small", 4)          # same key: checks not run again
    assert calls == ["check_small"]
    assert d(n=50) == ("any", 50)          # other key: selected afresh, refusal recorded
    assert d.reasons(n=50) == [("small", "n=50 too large"), ("any", None)]


def test_inserted_candidate_invalidates_cache():
    d = _disp([])
    assert d(n=1)[0] == "small"
    d.candidates.insert(0, Candidate("first", lambda n: None, lambda n: ("first", n)))
    assert d(n=1) == ("first", 1)


def test_no_candidate_lists_every_reason():
    d = Dispatcher("toy", [Candidate("a", lambda n: "nope", lambda n: n)], key=lambda n: 0)
    with pytest.raises(KernelError, match="a: nope"):
        d(n=1)


def test_cached_choice_follows_forcing_and_replacement(monkeypatch):
    from exl_core.ops import dispatch as D
    calls = []
    d = D.Dispatcher("toy_op_for_cache", [D.Candidate("a", lambda x: None, lambda x: calls.append("a")),
                                          D.Candidate("b", lambda x: None, lambda x: calls.append("b"))],
                     key=lambda x: type(x))
    d(x=1)
    monkeypatch.setitem(D._FORCED, "toy_op_for_cache", "b")
    d(x=1)
    monkeypatch.delitem(D._FORCED, "toy_op_for_cache")
    d.candidates[0] = D.Candidate("c", lambda x: None, lambda x: calls.append("c"))   # same length, new member
    d(x=1)
    assert calls == ["a", "b", "c"]


def test_uniform4_needs_words_in_k_order():
    """The uniform-4-bit decode kernel computes chunk c's word rows as 4c..4c+3 instead of reading the
    chunk table, so the flag must be refused for 4-bit weights packed in another order (runs without a GPU)."""
    from types import SimpleNamespace
    from exl_core.ops.cuda_candidates import _uniform4
    k_order = torch.tensor([[4, 0, 128, 0], [4, 128, 128, 16]], dtype=torch.int32)
    swapped = torch.tensor([[4, 0, 128, 16], [4, 128, 128, 0]], dtype=torch.int32)
    mixed = torch.tensor([[4, 0, 128, 0], [3, 128, 128, 16]], dtype=torch.int32)
    assert _uniform4(SimpleNamespace(groups=k_order, meta={}))
    assert not _uniform4(SimpleNamespace(groups=swapped, meta={}))
    assert not _uniform4(SimpleNamespace(groups=mixed, meta={}))


def test_group_shift_only_for_regular_power_of_two_groups():
    """qgemm_kslice computes chunk c's group as c >> shift instead of reading the chunk table, so the shift must
    be refused for groups that are not equal, in order, of 32 * 2**s rows (runs without a GPU)."""
    from types import SimpleNamespace
    from exl_core.ops.cuda_candidates import _group_shift, _pws_group_shift

    def pw(layout, K=None):                                    # layout [(bits, k_len)] in K order
        rows, k, q = [], 0, 0
        for bits, n in layout:
            rows.append((bits, k, n, q))
            k, q = k + n, q + n * bits // 32
        return SimpleNamespace(groups=torch.tensor(rows, dtype=torch.int32), in_features=K or k, k_rows=K or k,
                               meta={})

    assert _group_shift(pw([(4, 128)] * 3)) == 2
    assert _group_shift(pw([(4, 64)] * 3 + [(4, 32)])) == 1    # a short last group
    assert _group_shift(pw([(4, 32)] * 5)) == 0
    assert _group_shift(pw([(4, 96)] * 2)) == -1               # 3 chunks a group: not a power of two
    assert _group_shift(pw([(4, 64), (4, 128)])) == -1         # unequal
    assert _group_shift(pw([(4, 32), (4, 64)])) == -1          # first one short
    swapped = pw([(4, 128)] * 2)
    swapped.groups[:, 1] = torch.tensor([128, 0])             # out of K order
    assert _group_shift(swapped) == -1
    assert _pws_group_shift([pw([(4, 128)] * 2), pw([(4, 128)] * 4)]) == 2
    assert _pws_group_shift([pw([(4, 128)] * 2), pw([(4, 64)] * 4)]) == -1


def test_cuda_qmatmul_row_policy():
    """Which tensor-core kernel may take how many rows (runs without a GPU): uniform 4-bit weights use
    qgemm_mma up to MMA_MAX_ROWS, other weights (EXL2 mixed widths) only up to MMA_MIXED_MAX_ROWS,
    nothing below MMA_MIN_ROWS."""
    from types import SimpleNamespace
    from exl_core.ops import cuda_candidates as cc
    u4 = SimpleNamespace(groups=torch.tensor([[4, 0, 128, 0], [4, 128, 128, 16]], dtype=torch.int32), meta={})
    mixed = SimpleNamespace(groups=torch.tensor([[4, 0, 128, 0], [3, 128, 128, 16]], dtype=torch.int32), meta={})
    assert cc.MMA_MIN_ROWS <= cc.MMA_MIXED_MAX_ROWS < cc.MMA_MAX_ROWS
    assert cc._mma_rows_ok(cc.MMA_MAX_ROWS, u4) and not cc._mma_rows_ok(cc.MMA_MAX_ROWS + 1, u4)
    assert cc._mma_rows_ok(cc.MMA_MIXED_MAX_ROWS, mixed) and not cc._mma_rows_ok(cc.MMA_MIXED_MAX_ROWS + 1, mixed)
    assert not cc._mma_rows_ok(cc.MMA_MIN_ROWS - 1, u4)
