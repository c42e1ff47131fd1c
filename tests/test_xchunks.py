"""ops/xchunks.py: which act-order permutations read x in runs of 32 consecutive columns (the SwiGLU-fused decode
kernel then stages x by chunk offsets, tests/test_cuda_xchunks.py), and that the loader leaves rewritten EXL2 down
projections in that form."""
from __future__ import annotations

import torch

from exl_core.formats.packed import PackedWeight
from exl_core.ops import xchunks


def _identity_and_tail(K: int, tail_chunks) -> torch.Tensor:
    return torch.cat([torch.arange(K)] + [torch.arange(32 * c, 32 * c + 32) for c in tail_chunks])


def test_chunk_starts_of_runs():
    K = 256
    perm = _identity_and_tail(K, [0, 5, 6])
    assert torch.equal(xchunks.chunk_starts(perm), torch.tensor([32 * c for c in range(8)] + [0, 160, 192]))
    shuffled = torch.cat([torch.arange(32 * c, 32 * c + 32) for c in torch.randperm(8).tolist()])
    assert torch.equal(xchunks.chunk_starts(shuffled), shuffled[::32])
    odd = torch.arange(8, 8 + 64)                                  # runs from a multiple of 8, not of 32: loads fit
    assert torch.equal(xchunks.chunk_starts(odd), torch.tensor([8, 40]))


def test_chunk_starts_refuses_other_orders():
    assert xchunks.chunk_starts(torch.randperm(256)) is None
    broken = _identity_and_tail(256, [1])
    broken[270] = 3                                                # one value off its run
    assert xchunks.chunk_starts(broken) is None
    assert xchunks.chunk_starts(torch.arange(4, 4 + 64)) is None  # runs from a column not 16-byte aligned
    assert xchunks.chunk_starts(torch.arange(48)) is None          # not whole chunks
    assert xchunks.chunk_starts(torch.arange(0)) is None


def _pw(perm, K=256, N=8):
    rows = perm.numel()
    groups = torch.tensor([(4, k, 32, k // 8) for k in range(0, rows, 32)], dtype=torch.int32)
    G = rows // 32
    return PackedWeight(torch.zeros(rows // 8, N, dtype=torch.int32), groups, torch.ones(G, N), torch.full((G, N), 8.0),
                        perm, K, N, None, {}, rows if rows > K else None).validate()


def test_xchunks_of_switch_and_cache(monkeypatch):
    pw = _pw(_identity_and_tail(256, [2]))
    assert xchunks.xchunks_of(pw, torch.device("cpu")) is None     # off by default
    monkeypatch.setattr(xchunks, "XCHUNKS_ON", True)
    got = xchunks.xchunks_of(pw, torch.device("cpu"))
    assert torch.equal(got, torch.tensor([32 * c for c in range(8)] + [64]))
    assert xchunks.xchunks_of(pw, torch.device("cpu")) is got     # made once per permutation tensor
    pw.perm = _identity_and_tail(256, [3])                         # a new permutation: made again
    assert int(xchunks.xchunks_of(pw, torch.device("cpu"))[-1]) == 96
    assert xchunks.xchunks_of(_pw(torch.randperm(256)), torch.device("cpu")) is None
    plain = PackedWeight(pw.qweight[:32], pw.groups[:8], pw.scale[:8], pw.zero[:8], None, 256, 8)
    assert xchunks.xchunks_of(plain, torch.device("cpu")) is None
    unaligned = torch.zeros(17, dtype=torch.float16)[1:]
    assert xchunks.staged_xchunks(pw, unaligned) is None           # the kernel's 16-byte loads need aligned rows


def test_rewritten_exl2_down_reads_x_in_runs(exl2_act_order_dir):
    """After loader.fold_down_perms, a down projection rewritten as uniform 4-bit rows reads x through the identity
    and whole chunks again: the form the chunk offsets take (what makes them apply to EXL2 models at all)."""
    from exl_core.loader import as_uniform4_weights, load_model
    model, _ = load_model(exl2_act_order_dir, load_tokenizer=False)
    assert as_uniform4_weights(model) > 0
    downs = [b.mlp.down_proj.packed for b in model.layers if b.mlp.down_proj.packed.rows is not None]
    assert downs
    for pw in downs:
        starts = xchunks.chunk_starts(pw.perm)
        assert starts is not None
        assert torch.equal(starts[:pw.in_features // 32], torch.arange(0, pw.in_features, 32))
