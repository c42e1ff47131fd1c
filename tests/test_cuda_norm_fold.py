"""The residual add and the RMSNorm folded into the decode GEMMs (ops/norm_fold.py, csrc/cuda/norm_fold_device.cuh):
the producer's add and sums of squares, and the consumers' normalised x, against float64 references and against the
unfused path (norm kernel, then the plain kernels).  Helpers from test_cuda_kernels."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err

pytestmark = pytest.mark.cuda

U4 = [(4, 128)] * 4                                   # GPTQ-like 4-bit g128, K = 512
MIXED = [(5, 128), (4, 256), (3, 128)]                # EXL2-like


def _args(c, xc):
    from exl_core.ops import cuda_candidates as cc
    return (c.qweight, cc._chunks_of(c), c.scale, c.zero, cc._perm_of(c, xc.device),
            None if c.bias is None else c.bias.half().contiguous(), cc._uniform4(c))


def _tile_ss(res: torch.Tensor) -> torch.Tensor:
    """float64 [ceil(N / 32), M] sums of squares of res's values per 32-column tile."""
    r = res.double().cpu()
    M, N = r.shape
    pad = torch.zeros(M, (N + 31) // 32 * 32, dtype=torch.float64)
    pad[:, :N] = r * r
    return pad.view(M, -1, 32).sum(-1).t().contiguous()


@pytest.mark.parametrize("layout", [U4, MIXED], ids=["u4", "mixed"])
@pytest.mark.parametrize("N", [4 * 131, 1024])                    # a partial last tile; whole tiles
@pytest.mark.parametrize("M", [1, 3, 8, 17, 32])                  # staged x; x from global memory
@pytest.mark.parametrize("perm", [False, True])
def test_add_ss_vs_float64(layout, N, M, perm):
    _need_kernels()
    pw = random_packed(layout, N, perm=perm, bias=random.random() < 0.5)
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    res = torch.randn(M, N, dtype=torch.float16)
    ref = res.double() + x.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
    c, xc, rc = pw.to("cuda"), x.cuda(), res.cuda()
    poison_allocator()
    q, ch, s, z, p, b, u4 = _args(c, xc)
    ss = torch.ops.exl_core.qgemm_kslice_add_(rc, xc, q, ch, s, z, p, b, u4)
    assert ss.shape == ((N + 31) // 32, M) and ss.dtype == torch.float32
    assert rel_err(rc, ref) < 2e-3                                # the residual, added in place
    torch.testing.assert_close(ss.double().cpu(), _tile_ss(rc), rtol=1e-5, atol=1e-6)   # of the values stored


@pytest.mark.parametrize("layout", [U4, MIXED], ids=["u4", "mixed"])
@pytest.mark.parametrize("M", [1, 4, 8])
def test_add_ss_silu_vs_float64(layout, M):
    """The down projection: silu(gate) * up staged, then the add and the sums (qgemm_kslice_add_ with up)."""
    _need_kernels()
    import torch.nn.functional as F
    pw = random_packed(layout, 4 * 67, perm=random.random() < 0.5)
    gate = torch.randn(M, pw.in_features, dtype=torch.float16)
    up = torch.randn(M, pw.in_features, dtype=torch.float16)
    h = (F.silu(gate.float()).half().float() * up.float()).half()       # silu_mul's roundings
    res = torch.randn(M, pw.out_features, dtype=torch.float16)
    ref = res.double() + h.double() @ dequantize_reference(pw)
    c, gc, rc = pw.to("cuda"), gate.cuda(), res.cuda()
    q, ch, s, z, p, b, u4 = _args(c, gc)
    ss = torch.ops.exl_core.qgemm_kslice_add_(rc, gc, q, ch, s, z, p, b, u4, up=up.cuda())
    assert rel_err(rc, ref) < 2e-3
    torch.testing.assert_close(ss.double().cpu(), _tile_ss(rc), rtol=1e-5, atol=1e-6)


def _count_runs(monkeypatch, calls: dict, runs: dict) -> None:
    """Wraps ops/cuda_norm_fold.py's run functions (runs: {name in calls: attribute}) to count their calls, and
    installs the candidates again bound to the wrappers (on copies of the dispatchers' lists)."""
    from exl_core.ops import cuda_norm_fold as nf
    from exl_core.ops import norm_fold
    for disp in (norm_fold.DISPATCH_ADD_SS, norm_fold.DISPATCH_MANY_NORMED, norm_fold.DISPATCH_ADD_SS_INTO,
                 norm_fold.DISPATCH_MANY_NORMED_PERM):
        monkeypatch.setattr(disp, "candidates", list(disp.candidates))

    def counted(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run
    for name, attr in runs.items():
        monkeypatch.setattr(nf, attr, counted(name, getattr(nf, attr)))
    nf.install()


def _decode_step_both_ways(model, B: int, T: int, switch, calls: dict) -> tuple[dict, dict]:
    """The logits of one decode step of B sequences after a T-token prompt with switch(True) and with switch(False),
    and what `calls` counted during the step with it on."""
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    nxt = torch.randint(0, model.config.vocab_size, (B, 1))
    out, during = {}, {}
    for on in (True, False):
        switch(on)
        kv = [model.new_sequence_kv(T + 4) for _ in range(B)]
        model.forward_batch(ids.cuda(), kv)
        before = dict(calls)
        out[on] = model.forward_batch(nxt.cuda(), kv)
        if on:
            during = {k: calls[k] - before[k] for k in calls}
    return out, during


def _normed_ref(res: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm's roundings in fp16: w * fp16(x * r), rounded (r from float64 sums)."""
    r = torch.rsqrt(res.double().pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * (res.double() * r).half().float()).half()


# K 512 (g128), 4096 (128 tiles of sums: several passes of a lane's loop) and 1440 (g32, 45 chunks: uneven warp splits)
NORMED_LAYOUTS = {"k512": U4, "k4096": [(4, 128)] * 32, "k1440": [(4, 32)] * 45}


@pytest.mark.parametrize("M", [1, 5, 8, 17, 32])                  # qgemm_kslice staged rows; qgemm_wide
@pytest.mark.parametrize("layout", list(NORMED_LAYOUTS))
@pytest.mark.parametrize("widths", [(512, 128, 384), (4096, 1024, 1024)], ids=["24tiles", "192tiles"])
def test_many_normed_vs_float64_and_unfused(M, layout, widths, monkeypatch):
    """192 column tiles of 32 (more than an H200's 132 SMs) run qgemm_kslice's kw 8 fold instance, as a 7B's q/k/v
    (384 tiles) and gate/up (688) do at batch 1; 24 tiles run the kw 16 one."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import norm_fold
    from exl_core.ops.norm import rms_norm
    from exl_core.ops.qmatmul import qmatmul_many
    from exl_core.ops import cuda_norm_fold as nf
    monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)                 # qgemm_wide on these narrow launches too
    monkeypatch.setattr(nf, "NORM_FOLD_WIDE", True)                 # (off by default: slower end to end)
    if widths[0] > 512 and layout != "k512":
        pytest.skip("the wide launch once, at K 512, is enough")
    pws = [random_packed(NORMED_LAYOUTS[layout], n, perm=False, bias=random.random() < 0.3) for n in widths]
    K, eps = pws[0].in_features, 1e-5
    res = (torch.randn(M, K) * 3).half()
    w = (torch.rand(K) + 0.5).half()
    ss = _tile_ss(res).float()                                      # a producer's sums, computed independently
    pc = [pw.to("cuda") for pw in pws]
    rc, wc, sc = res.cuda(), w.cuda(), ss.cuda()
    assert norm_fold.DISPATCH_MANY_NORMED.choose(residual=rc, weight=wc, eps=eps, ss=sc, pws=pc).name == "cuda"
    poison_allocator()
    ys = norm_fold.qmatmul_many_normed(rc, wc, eps, sc, pc)
    xn = _normed_ref(res, w, eps)
    unfused = qmatmul_many(rms_norm(rc, wc, eps), pc)
    for pw, y, u in zip(pws, ys, unfused):
        ref = xn.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
        assert y.shape == (M, pw.out_features) and rel_err(y, ref) < 2e-3
        assert rel_err(y, u.double().cpu()) < 2e-3


def test_many_normed_refuses_what_it_cannot_fold():
    """Act-order weights and missing sums go to the reference (norm, then qmatmul_many).  (A refused op call
    itself is not tried: a failing TORCH_CHECK kills the process on the device image, csrc/cuda/NOTES.md.)"""
    _need_kernels()
    from exl_core.ops import norm_fold
    pw = random_packed(U4, 256, perm=True).to("cuda")
    res = torch.randn(1, pw.in_features, dtype=torch.float16, device="cuda")
    w = torch.ones(pw.in_features, dtype=torch.float16, device="cuda")
    ss = _tile_ss(res).float().cuda()
    mixed = random_packed(MIXED, 256, perm=False).to("cuda")
    for s, p in ((ss, pw), (None, pw), (ss, mixed)):
        c = norm_fold.DISPATCH_MANY_NORMED.choose(residual=res, weight=w, eps=1e-6, ss=s, pws=[p])
        assert c.name == "torch"
        y = norm_fold.qmatmul_many_normed(res, w, 1e-6, s, [p])[0]
        ref = _normed_ref(res.cpu(), w.cpu(), 1e-6).double() @ dequantize_reference(p.to("cpu"))
        assert rel_err(y, ref) < 2e-3


@pytest.mark.parametrize("B", [1, 2, 20])
def test_model_decode_folded_matches_unfused(tiny_model_factory, tmp_path, B, monkeypatch):
    """A GPTQ model's decode step with the folds on (counted) and off: the same logits up to fp16 rounding."""
    _need_kernels()
    from exl_core.loader import load_model
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_norm_fold as nf
    from exl_core.quantize.rtn import quantize_model_rtn
    src = tiny_model_factory("llama", seed=random.randrange(1000), hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    d = quantize_model_rtn(src, tmp_path / "q", fmt="gptq", bits=4, group_size=128, act_order=False)
    model, _ = load_model(d, device="cuda", dtype=torch.float16, load_tokenizer=False)
    wide_ok = cc._wide_ok

    def multi_wide(rows, pws, device, any_rows=False):
        """q/k/v and gate/up on qgemm_wide (as a 7B model's 96 and 172 tiles), o and down not (32 tiles)."""
        saved = cc.WIDE_U4_MIN_TILES
        cc.WIDE_U4_MIN_TILES = 1 if len(pws) > 1 else saved
        try:
            return wide_ok(rows, pws, device, any_rows)
        finally:
            cc.WIDE_U4_MIN_TILES = saved
    monkeypatch.setattr(cc, "_wide_ok", multi_wide)
    monkeypatch.setattr(nf, "NORM_FOLD_WIDE", True)
    calls = {"add": 0, "normed": 0}
    _count_runs(monkeypatch, calls, {"add": "_add_ss_run", "normed": "_normed_run"})
    out, during = _decode_step_both_ways(model, B, 9, lambda on: monkeypatch.setattr(nf, "NORM_FOLD_ON", on), calls)
    L = model.config.num_hidden_layers
    assert during == {"add": 2 * L, "normed": 2 * L - 1}    # o and down of every layer; every norm but layer 0's input
    assert rel_err(out[True], out[False].double().cpu()) < 5e-3


# ---------------------------------------------------------------------------- through a shared act-order (not measured)
def _extended_perm(H: int, extra: int, g: torch.Generator) -> torch.Tensor:
    """An act-order over H columns followed by `extra` repeats, as formats/uniform4.py writes them."""
    return torch.cat([torch.randperm(H, generator=g), torch.randperm(H, generator=g)[:extra]])


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("extra", [0, 64])
def test_add_ss_into_stores_the_residual_in_the_consumers_order(M, extra):
    """qgemm_kslice_add_ with xp / xp_pos / xp_pos2 (ops/norm_fold.py qmatmul_add_ss_into_): the residual and its sums
    as without them, and xp == the new residual[:, perm] in every column, twice-read ones included."""
    _need_kernels()
    from exl_core.ops.attention import out_order_for
    g = torch.Generator().manual_seed(M + extra)
    pw = random_packed(U4, 1024, perm=True)
    perm = _extended_perm(1024, extra, g)
    order = out_order_for(perm, 1024, torch.device("cuda"))
    assert (order.pos2 is not None) == (extra > 0)
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    res = torch.randn(M, 1024, dtype=torch.float16)
    c, xc, rc = pw.to("cuda"), x.cuda(), res.cuda()
    plain = rc.clone()
    q, ch, s, z, p, b, u4 = _args(c, xc)
    ss_plain = torch.ops.exl_core.qgemm_kslice_add_(plain, xc, q, ch, s, z, p, b, u4)
    poison_allocator()
    xp = torch.full((M, order.cols), float("nan"), dtype=torch.float16, device="cuda")
    ss = torch.ops.exl_core.qgemm_kslice_add_(rc, xc, q, ch, s, z, p, b, u4, xp=xp, xp_pos=order.pos,
                                              xp_pos2=order.pos2)
    assert torch.equal(rc, plain) and torch.equal(ss, ss_plain)
    assert torch.equal(xp, rc[:, perm.cuda()])


@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("extra", [0, 64])
def test_many_normed_reads_the_residual_in_its_order(M, extra):
    """qgemm_kslice_multi with norm_k (the consumer of qmatmul_many_normed_perm): x = residual[:, perm] (P columns),
    the norm weight in that order, r's mean over the residual's H columns -- the values of the unpermuted fold on
    the residual with the weights' permutation taken out, within fp16 rounding of the float64 reference."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    g = torch.Generator().manual_seed(10 * M + extra)
    H, eps = 512, 1e-5
    perm = _extended_perm(H, extra, g)
    P = perm.numel()
    pws = [random_packed([(4, 32)] * (P // 32), n, perm=False) for n in (256, 128)]   # the weights seen through perm
    res = torch.randn(M, H, dtype=torch.float16, generator=g)
    w = (torch.rand(H, generator=g) + 0.5).half()
    x_ref = _normed_ref(res, w, eps)[:, perm]                                          # fp16 [M, P]
    rc = res.cuda()
    ss = _tile_ss(rc).float().cuda()                                                  # a producer's sums
    xp, wp = rc[:, perm.cuda()].contiguous(), w.cuda()[perm.cuda()].contiguous()
    cs = [pw.to("cuda") for pw in pws]
    assert cc._kslice_ok(M, cs, xp.device)
    poison_allocator()
    ys = torch.ops.exl_core.qgemm_kslice_multi(xp, [c.qweight for c in cs], [cc._chunks_of(c) for c in cs],
                                               [c.scale for c in cs], [c.zero for c in cs], [None, None],
                                               [None, None], True, min_group=32, group_shift=0, norm_weight=wp,
                                               norm_ss=ss, norm_eps=eps, norm_k=H)
    for pw, y in zip(pws, ys):
        assert rel_err(y, x_ref.double() @ dequantize_reference(pw)) < 3e-3


@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("uniform4", [False, True])
def test_model_decode_folded_through_the_shared_order(exl2_act_order_dir, B, uniform4, monkeypatch):
    """EXL_CORE_NORM_FOLD_PERM=1 on an EXL2 act-order model whose q/k/v and gate/up share their permutations (and
    rewritten as uniform 4-bit rows: extended orders): the decode step's logits with the permuted folds (counted)
    and without, up to fp16 rounding.  Without the rewrite the mixed widths refuse the fold (nothing counted)."""
    _need_kernels()
    from exl_core.loader import as_uniform4_weights, load_model
    from exl_core.ops import norm_fold
    from test_norm_perm import share_group_perms
    model, _ = load_model(exl2_act_order_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)
    share_group_perms(model)
    if uniform4:
        assert as_uniform4_weights(model, max_growth=10.0) > 0
    calls = {"into": 0, "normed": 0}
    _count_runs(monkeypatch, calls, {"into": "_add_ss_into_run", "normed": "_normed_perm_run"})
    out, during = _decode_step_both_ways(model, B, 7, lambda on: monkeypatch.setattr(norm_fold, "FOLD_PERM_ON", on),
                                         calls)
    n = 2 * model.config.num_hidden_layers - 1 if uniform4 else 0       # o every layer, down all but the last
    assert during == {"into": n, "normed": n}
    assert rel_err(out[True], out[False].double().cpu()) < 5e-3
