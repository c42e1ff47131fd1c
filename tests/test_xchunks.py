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
    monkeypatch.setattr(xchunks, "XCHUNKS_ON", False)
    assert xchunks.xchunks_of(pw, torch.device("cpu")) is None     # the switch off (EXL_CORE_KSLICE_XCHUNKS=0)
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


def test_tails_of_the_identity_and_chunks_again():
    K = 256
    tails = xchunks.tails_of(_identity_and_tail(K, [5, 0]), K)
    expect = torch.full((8,), -1, dtype=torch.int32)
    expect[5], expect[0] = K, K + 32                               # chunk 5's copy first, then chunk 0's
    assert torch.equal(tails, expect)
    assert xchunks.tails_of(_identity_and_tail(K, [1, 1]), K) is None          # a chunk read three times
    assert xchunks.tails_of(torch.cat([torch.arange(K), torch.arange(8, 40)]), K) is None   # not chunk-aligned
    shuffled = torch.cat([torch.arange(32, 64), torch.arange(32), torch.arange(64, K), torch.arange(32)])
    assert xchunks.tails_of(shuffled, K) is None                   # the first K rows are not the identity
    assert xchunks.tails_of(torch.arange(K), K) is None            # no extra rows


def _swiglu_reference(x, gate, up, tails=None):
    """What qmatmul_swiglu returns (ops/swiglu.py): the product, widened by tails -- a CPU stand-in for the CUDA
    pair kernel, so that the model's side of the tails runs here."""
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import qmatmul
    h = silu_mul(qmatmul(x, gate), qmatmul(x, up))
    if tails is None:
        return h
    t, cols = tails
    out = h.new_full((*h.shape[:-1], cols), float("nan"))
    out[..., :h.shape[-1]] = h
    for c in (t >= 0).nonzero().flatten().tolist():
        d = int(t[c])
        out[..., d:d + 32] = h[..., 32 * c:32 * c + 32]
    return out


def test_model_with_widened_products_matches(tiny_model_factory, tmp_path, monkeypatch):
    """A rewritten EXL2 model whose MLP products come widened (down_tails; here from a CPU stand-in of the pair
    kernel) and whose down projections read them as Prepermuted views gives the logits of the plain path (down
    projections of 11 chunks, several read again)."""
    from exl_core.model import linear
    from exl_core.ops import swiglu
    from exl_core.ops.dispatch import Candidate
    from test_norm_perm import rewritten_shared_exl2
    model = rewritten_shared_exl2(tiny_model_factory, tmp_path)
    widened = []

    def run(x, gate, up, tails=None):
        widened.append(tails is not None)
        return _swiglu_reference(x, gate, up, tails)
    monkeypatch.setattr(swiglu.DISPATCH_SWIGLU, "candidates",
                        [Candidate("ref", lambda x, gate, up, tails=None: None, run)])
    ids = torch.randint(0, 1000, (3, 5), generator=torch.Generator().manual_seed(1))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(xchunks, "TAILS_ON", on)
        for b in model.layers:
            b.mlp.down_proj.__dict__.pop("_tails", None)
        with torch.inference_mode():
            out[on] = model.forward_batch(ids)
        assert any(widened) == on
        widened.clear()
    maps = [linear.down_tails(b.mlp.down_proj) for b in model.layers]
    assert any(m is not None and int((m[0] >= 0).sum()) >= 2 for m in maps)
    assert float((out[True] - out[False]).abs().max()) < 1e-4 * float(out[False].abs().max())
