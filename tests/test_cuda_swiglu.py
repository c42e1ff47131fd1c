"""SwiGLU's gate/up pair in one batch-decode launch (ops/swiglu.py, exl_core::qgemm_wide_swiglu): against the two
launches (qgemm_wide_multi, then silu_mul) bit for bit and against float64; what it refuses; a model's decode step
with it against without.  The stream-K wgmma kernels (qgemm_wg_decode is on by default on sm_90; its pair,
qgemm_wg_swiglu, is not) are off here: they are tested in test_cuda_wg_decode.py.  Helpers from test_cuda_kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err, tiny_gptq_model

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _no_wg(monkeypatch):
    from exl_core.ops import cuda_wg_decode
    monkeypatch.setattr(cuda_wg_decode, "WG_DECODE", "0")


# k32: one chunk, so one K split (cluster_store_swiglu's S == 1 branch)
LAYOUTS = {"k512": [(4, 128)] * 4, "k4096": [(4, 128)] * 32, "k1024_g32": [(4, 32)] * 32, "k32": [(4, 32)]}


def _pair(layout, N, bias):
    gate, up = (random_packed(layout, N, perm=False, bias=bias).to("cuda") for _ in range(2))
    for pw in (gate, up):
        if pw.bias is not None:
            pw.bias = pw.bias.half()
    return gate, up


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("N", [704, 1000])                     # whole 64-column tiles; a partial last one
@pytest.mark.parametrize("M", [17, 24, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_equals_two_launches_and_float64(layout, N, M, bias, monkeypatch):
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import DISPATCH_MANY, qmatmul_many
    from exl_core.ops.swiglu import DISPATCH_SWIGLU, qmatmul_swiglu
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)            # these N are a few tiles (a 7B's gate/up: 172)
    gate, up = _pair(LAYOUTS[layout], N, bias)
    x = (torch.randn(M, gate.in_features) * 0.5).half().cuda()
    assert DISPATCH_SWIGLU.select(x=x, gate=gate, up=up).name == "cuda"
    assert DISPATCH_MANY.select(x=x, pws=[gate, up]).name == "cuda" and cc._wide_ok(M, [gate, up], x.device)
    poison_allocator()
    h = qmatmul_swiglu(x, gate, up)
    assert h.shape == (M, N) and h.dtype == torch.float16
    assert torch.equal(h, silu_mul(*qmatmul_many(x, [gate, up])))
    wg, wu = (dequantize_reference(pw.to("cpu")) for pw in (gate, up))
    bg, bu = ((pw.bias.double().cpu() if pw.bias is not None else 0) for pw in (gate, up))
    xd = x.double().cpu()
    assert rel_err(h, F.silu(xd @ wg + bg) * (xd @ wu + bu)) < 3e-3


def test_pair_plans_as_the_two_launches(monkeypatch):
    """N = 10176: the two launches' 160 column tiles plan 2 K splits where the pair's own grid (159 tiles of 64 of
    each) would plan 4; the pair takes the two launches' plan, so its sums -- and its bits -- are theirs."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import qmatmul_many
    from exl_core.ops.swiglu import qmatmul_swiglu
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)
    gate, up = _pair(LAYOUTS["k512"], 10176, False)
    x = (torch.randn(32, 512) * 0.5).half().cuda()
    assert torch.equal(qmatmul_swiglu(x, gate, up), silu_mul(*qmatmul_many(x, [gate, up])))


def test_pair_refuses_what_it_does_not_run(monkeypatch):
    """None (nothing done) for rows below the batch-decode kernel's, act-order or mixed-width weights, and with
    EXL_CORE_WIDE_SWIGLU=0; the model then runs the two projections and the product its own way."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_swiglu
    from exl_core.ops.swiglu import qmatmul_swiglu
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)
    gate, up = _pair(LAYOUTS["k512"], 704, False)
    x = torch.randn(32, 512).half().cuda()
    assert qmatmul_swiglu(x[:8], gate, up) is None
    perm = random_packed(LAYOUTS["k512"], 704, perm=True).to("cuda")
    mixed = random_packed([(5, 128), (4, 256), (3, 128)], 704, perm=False).to("cuda")
    assert qmatmul_swiglu(x, perm, up) is None and qmatmul_swiglu(x, mixed, up) is None
    monkeypatch.setattr(cuda_swiglu, "WIDE_SWIGLU_ON", False)
    assert qmatmul_swiglu(x, gate, up) is None


def test_model_decode_with_pair_matches_without(tiny_model_factory, tmp_path, monkeypatch):
    """A GPTQ model's 20-row decode step with the pair on (counted) and off: the same logits, bit for bit."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_swiglu, swiglu
    model = tiny_gptq_model(tiny_model_factory, tmp_path)
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)
    B, T = 20, 9
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    nxt = torch.randint(0, model.config.vocab_size, (B, 1))
    calls = [0]
    run = cuda_swiglu._run

    def counted(*a, **k):
        calls[0] += 1
        return run(*a, **k)
    monkeypatch.setattr(cuda_swiglu, "_run", counted)
    monkeypatch.setattr(swiglu.DISPATCH_SWIGLU, "candidates", list(swiglu.DISPATCH_SWIGLU.candidates))
    cuda_swiglu.install()                                      # the candidate bound to the counted run
    out = {}
    for on in (True, False):
        monkeypatch.setattr(cuda_swiglu, "WIDE_SWIGLU_ON", on)
        kv = [model.new_sequence_kv(T + 4) for _ in range(B)]
        model.forward_batch(ids.cuda(), kv)
        before = calls[0]
        out[on] = model.forward_batch(nxt.cuda(), kv)
        assert (calls[0] > before) == on
    assert torch.equal(out[True], out[False])
