"""The extended copy (ops/norm_fold.py, EXL_CORE_NORM_FOLD_EXT): the producer's add also stores the new residual at
its places in the next weights' extended act-order, and the consumers fold the norm on that copy with r from the
producer's sums over the residual's own columns (norm_count).  Against float64 references, bit-exact where the
kernel only moves values, and a rewritten EXL2 model's decode with the copy on against off.  Helpers from
test_cuda_kernels and test_cuda_norm_fold."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_attn_out_order import _perm
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err
from test_cuda_norm_fold import U4, _args, _normed_ref, _tile_ss

pytestmark = pytest.mark.cuda


def _count_copy_reads(monkeypatch) -> list:
    """Wraps ExtFold.run: the returned list gets the residual width of every copy a consumer reads."""
    from exl_core.model import linear
    runs, real_run = [], linear.ExtFold.run

    def counted(self, eps, ss):
        runs.append(self.width)
        return real_run(self, eps, ss)
    monkeypatch.setattr(linear.ExtFold, "run", counted)
    return runs


@pytest.mark.parametrize("N", [4 * 131, 1024])                    # a partial last tile; whole tiles
@pytest.mark.parametrize("M", [1, 8, 17, 32])                     # staged x; x from global memory (one epilogue)
@pytest.mark.parametrize("silu", [False, True])
def test_add_writes_the_extended_copy(N, M, silu):
    """Every place of the copy holds the stored residual value (bit for bit: the epilogue stores the same fp16 twice);
    the residual and the sums are the plain add's."""
    _need_kernels()
    from exl_core.ops.norm_fold import ext_places
    if silu and M > 8:
        pytest.skip("the SwiGLU-fused add takes staged rows only")
    pw = random_packed(U4, N, perm=random.random() < 0.5)
    perm = _perm(N, N // 5, seed=N + M)
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    up = torch.randn(M, pw.in_features, dtype=torch.float16)
    res = torch.randn(M, N, dtype=torch.float16)
    c, xc = pw.to("cuda"), x.cuda()
    q, ch, s, z, p, b, u4 = _args(c, xc)
    plain = res.cuda()
    kw = {"up": up.cuda()} if silu else {}
    ss_plain = torch.ops.exl_core.qgemm_kslice_add_(plain, xc, q, ch, s, z, p, b, u4, **kw)
    rc = res.cuda()
    copy = torch.full((M, perm.numel()), float("nan"), dtype=torch.float16, device="cuda")
    poison_allocator()
    ss = torch.ops.exl_core.qgemm_kslice_add_(rc, xc, q, ch, s, z, p, b, u4, ext=copy,
                                              ext_pos=ext_places(perm, N).cuda(), **kw)
    assert torch.equal(rc, plain) and torch.equal(ss, ss_plain)
    assert torch.equal(copy, rc[:, perm.cuda()])
    assert float((rc.double().cpu() - res.double()).abs().max()) > 0          # the add did happen


@pytest.mark.parametrize("M", [1, 4, 8])
def test_swiglu_down_with_extra_rows_writes_the_copy(M):
    """The rewritten down projection (extra rows, a chunk-contiguous perm) as the copy's producer through
    qmatmul_add_ss_: chunk offsets (xchunks) taken, and the residual and sums bit for bit the permutation path's,
    the copy the new residual gathered."""
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import norm_fold
    from exl_core.ops.norm_fold import ext_places
    from test_cuda_xchunks import _cases
    g = torch.Generator().manual_seed(10 + M)
    w, W, u4 = next(iter(_cases(g)))                                 # the uniform 4-bit rewrite, identity + tail
    assert u4 and w.rows is not None
    K, N = w.in_features, w.out_features
    gate = torch.randn(M, K, dtype=torch.float16, generator=g).cuda()
    up = torch.randn(M, K, dtype=torch.float16, generator=g).cuda()
    res = torch.randn(M, N, dtype=torch.float16, generator=g).cuda()
    r_perm = res.clone()
    args = (w.qweight, cc._chunks_of(w), w.scale, w.zero)
    ss_perm = torch.ops.exl_core.qgemm_kslice_add_(r_perm, gate, *args, w.perm, None, u4, cc._min_group(w),
                                                   cc._group_shift(w), up=up)
    perm = _perm(N, N // 4, seed=M)
    copy = torch.full((M, perm.numel()), float("nan"), dtype=torch.float16, device="cuda")
    ext = (copy, ext_places(perm, N).cuda())
    assert norm_fold.DISPATCH_ADD_SS.choose(residual=res, x=gate, pw=w, up=up, ext=ext).name == "cuda"
    assert norm_fold.DISPATCH_ADD_SS.choose(residual=res, x=gate, pw=w, up=up).name == "none"   # rows: only with ext
    rc = res.clone()
    ss = norm_fold.qmatmul_add_ss_(rc, gate, w, up, ext)
    assert torch.equal(rc, r_perm) and torch.equal(ss, ss_perm)
    assert torch.equal(copy, rc[:, perm.cuda()])


@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("K", [512, 4096])
def test_many_normed_on_the_extended_copy_vs_float64(M, K):
    """q/k/v-like weights over the extended rows read the copy with the norm folded in (qgemm_kslice's fold with
    norm_count), against float64: the plain norm of the residual, gathered, times the weights."""
    _need_kernels()
    from exl_core.ops import norm_fold
    extra = K // 8
    perm = _perm(K, extra, seed=K + M)
    P = K + extra
    pws = [random_packed([(4, 32)] * (P // 32), n, perm=False, bias=random.random() < 0.3) for n in (384, 128)]
    eps = 1e-5
    res = (torch.randn(M, K) * 3).half()
    w = (torch.rand(K) + 0.5).half()
    ss = _tile_ss(res).float().cuda()                                # the producer's sums, over K columns
    copy, wext = res[:, perm].cuda(), w[perm].contiguous().cuda()
    pc = [pw.to("cuda") for pw in pws]
    choice = norm_fold.DISPATCH_MANY_NORMED.choose(residual=copy, weight=wext, eps=eps, ss=ss, pws=pc, count=K)
    assert choice.name == "cuda"
    poison_allocator()
    ys = norm_fold.qmatmul_many_normed(copy, wext, eps, ss, pc, count=K)
    xn = _normed_ref(res, w, eps)[:, perm]
    for pw, y in zip(pws, ys):
        ref = xn.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
        assert rel_err(y, ref) < 2e-3


@pytest.mark.parametrize("B", [1, 4])
def test_rewritten_exl2_decode_with_the_copy_matches_without(tiny_model_factory, tmp_path, B, monkeypatch):
    """A rewritten EXL2 model (q/k/v and gate/up sharing permutations, extra rows), one decode step of forward_batch:
    with the copy on, every layer's down but the last writes it and the next q/k/v fold their norm (counted); o,
    which gathers its own input under this contiguous context (a weight with extra rows), keeps the post-attention
    permuted norm.  The logits agree with the permuted-norm path's within fp16 rounding."""
    _need_kernels()
    from exl_core.ops import norm_fold
    from test_norm_perm import record_norm_widths, rewritten_shared_exl2
    model = rewritten_shared_exl2(tiny_model_factory, tmp_path, device="cuda", dtype=torch.float16)
    L = len(model.layers)
    T = 9
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    nxt = torch.randint(0, model.config.vocab_size, (B, 1), generator=torch.Generator().manual_seed(4))
    runs = _count_copy_reads(monkeypatch)
    widths = record_norm_widths(monkeypatch)
    out = {}
    with torch.inference_mode():
        for on in (False, True):
            monkeypatch.setattr(norm_fold, "NORM_FOLD_EXT", on)
            kv = [model.new_sequence_kv(T + 4) for _ in range(B)]
            model.forward_batch(ids.cuda(), kv)
            runs.clear(), widths.clear()
            out[on] = model.forward_batch(nxt.cuda(), kv).double().cpu()
            if on:
                assert len(runs) == L - 1 and set(runs) == {model.config.hidden_size}
                assert len(widths) == 1 + L                         # the first input norm, every post-attention one
            else:
                assert runs == [] and len(widths) == 2 * L
    assert float(out[False].abs().max()) > 1e-2
    assert float((out[True] - out[False]).norm() / out[False].norm()) < 5e-3


def test_generator_decode_with_the_copy(tiny_model_factory, tmp_path, monkeypatch):
    """Through the Generator (paged attention storing o's input in its extended order, so o is a producer too): each
    decode step folds every norm but the first layer's input norm (2L - 1 copies read), and the first decoded token
    (the second generated: the first comes from the prompt, where no copy is made) and its log-probability match the
    permuted-norm path's (later tokens may part on near-ties)."""
    _need_kernels()
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from exl_core.ops import norm_fold
    from test_norm_perm import rewritten_shared_exl2
    # heads 64 wide: the paged attention kernel stores o's input in its order (at 32, stop 38 call 1, attention fell
    # back to the gathering path, o kept its permutation and no o add wrote a copy)
    model = rewritten_shared_exl2(tiny_model_factory, tmp_path, heads=(2, 1), device="cuda", dtype=torch.float16)
    L = len(model.layers)
    runs = _count_copy_reads(monkeypatch)
    prompt = [random.Random(2).randrange(3, 500) for _ in range(12)]

    def run():
        gen = Generator(model, Cache(model, max_tokens=512, page_size=16), None, max_batch_tokens=64,
                        max_chunk_size=64, cuda_graphs=False)
        job, = gen.enqueue([Job(prompt, max_new_tokens=4, sampler=SamplerSettings(temperature=0.0),
                                stop_on_eos=False, return_logprobs=True)])
        while gen.has_work():
            gen.iterate()
        return job.generated, list(job.logprobs)
    monkeypatch.setattr(norm_fold, "NORM_FOLD_EXT", False)
    theirs = run()
    assert runs == []
    monkeypatch.setattr(norm_fold, "NORM_FOLD_EXT", True)
    mine = run()
    steps = len(mine[0]) - 1                                       # decode steps (the first token is the prompt's)
    assert steps >= 1 and len(runs) >= steps * (2 * L - 1)
    assert mine[0][:2] == theirs[0][:2]
    assert abs(mine[1][1] - theirs[1][1]) < 2e-2
