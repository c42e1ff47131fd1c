"""CUDA kernels on weights with more rows than x has columns: EXL2's mixed widths rewritten as uniform 4-bit rows
(exl_core/formats/uniform4.py, some rows repeated through the permutation, K' > K), against float64 references of the
original weights; and the loader's default on CUDA, which rewrites EXL2 files so (stop 30).  Helpers from
test_cuda_kernels."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err

pytestmark = pytest.mark.cuda

U4_LAYOUTS = [
    [(5, 128), (4, 128), (4, 128), (3, 128)],                    # the H200 bench's mix (5/4/3 bits)
    [(8, 64), (6, 64), (5, 64), (4, 128), (2, 64)],              # every width that splits, and 2-bit
]


@pytest.mark.parametrize("layout", range(len(U4_LAYOUTS)))
@pytest.mark.parametrize("M", [1, 3, 8, 12, 17, 32, 48])         # kslice staged / from global, wide, dequant
@pytest.mark.parametrize("N", [4 * 33, 1024, 4608])              # few tiles; more tiles than SMs (kslice's kw 8)
def test_uniform4_rows_through_the_dispatcher(layout, M, N, monkeypatch):
    _need_kernels()
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import qmatmul as qm
    pw = random_packed(U4_LAYOUTS[layout], N, perm=random.random() < 0.7, bias=random.random() < 0.5)
    u = as_uniform4(pw, max_growth=10.0)
    assert u is not None and u.rows > u.in_features
    x = torch.randn(M, pw.in_features, dtype=torch.float16)
    ref = x.double() @ dequantize_reference(pw) + (pw.bias.half().double() if pw.bias is not None else 0)
    uc = u.to("cuda")
    if uc.bias is not None:
        uc.bias = uc.bias.half()
    xc = x.cuda()
    assert cc._route(M, uc, xc) == ("dequant" if M > 32 else "wide" if cc._wide_ok(M, [uc], xc.device) else "kslice")
    poison_allocator()
    y = qm.qmatmul(xc, uc)
    assert y.shape == (M, N) and rel_err(y, ref) < 2e-3
    if 17 <= M <= 32:                                            # the batch-decode GEMM on these narrow launches too
        monkeypatch.setattr(cc, "WIDE_U4_MIN_TILES", 1)
        assert cc._route(M, uc, xc) == "wide"
        assert rel_err(qm.qmatmul(xc, uc), ref) < 2e-3
    # q/k/v-style: three rewritten weights of the same layout in one call
    us = [as_uniform4(random_packed(U4_LAYOUTS[layout], n, perm=True), max_growth=10.0) for n in (N, 64, N)]
    ys = qm.qmatmul_many(xc, [w.to("cuda") for w in us])
    for w, yw in zip(us, ys):
        assert rel_err(yw, x.double() @ dequantize_reference(w)) < 2e-3


def test_uniform4_rows_other_kernels():
    """qgemm_wide below its 17-row floor (where qgemm_kslice refuses a weight with extra rows, the policy falls
    back to it), and weights of different row counts in one qmatmul_many (one launch per weight then)."""
    _need_kernels()
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import qmatmul as qm
    a = as_uniform4(random_packed(U4_LAYOUTS[0], 256, perm=True), max_growth=10.0)
    b = as_uniform4(random_packed([(5, 64), (4, 448)], 256, perm=True), max_growth=10.0)
    assert a.in_features == b.in_features and a.rows != b.rows
    for M in (1, 3, 8):
        x = torch.randn(M, a.in_features, dtype=torch.float16)
        ac = a.to("cuda")
        y = torch.ops.exl_core.qgemm_wide(x.cuda(), ac.qweight, cc._chunks_of(ac), ac.scale, ac.zero,
                                          cc._perm_of(ac, x.cuda().device), None, True)
        assert rel_err(y, x.double() @ dequantize_reference(a)) < 2e-3
        ys = qm.qmatmul_many(x.cuda(), [a.to("cuda"), b.to("cuda")])
        for w, yw in zip((a, b), ys):
            assert rel_err(yw, x.double() @ dequantize_reference(w)) < 2e-3


@pytest.mark.parametrize("M", [1, 4, 8])
def test_uniform4_rows_silu_down(M):
    """The down projection with silu(gate) * up computed while x is staged (qgemm_kslice_silu), rewritten weight."""
    _need_kernels()
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops.cuda_candidates import _kslice_ok
    from exl_core.ops.qmatmul import qmatmul_silu
    pw = random_packed(U4_LAYOUTS[0], 256, perm=True)
    u = as_uniform4(pw, max_growth=10.0)
    gate, up = torch.randn(M, pw.in_features, dtype=torch.float16), torch.randn(M, pw.in_features, dtype=torch.float16)
    act = (torch.nn.functional.silu(gate.double()) * up.double()).half().double()
    ref = act @ dequantize_reference(pw)
    uc = u.to("cuda")
    assert _kslice_ok(M, [uc], gate.cuda().device, one_wave=False)      # the fused launch, not silu_mul + matmul
    y = qmatmul_silu(gate.cuda(), up.cuda(), uc)
    assert rel_err(y, ref) < 3e-3


def test_loader_rewrites_mixed_widths_on_cuda_by_default(exl2_act_order_dir, monkeypatch):
    """load_model on CUDA rewrites EXL2's mixed widths as uniform 4-bit rows unless EXL_CORE_EXL2_AS_U4=0 (the tests'
    conftest sets 0 so that the other CUDA tests run the mixed-width kernels); the logits agree within fp16 rounding."""
    _need_kernels()
    from exl_core.loader import load_model
    monkeypatch.delenv("EXL_CORE_EXL2_AS_U4", raising=False)
    rewritten = load_model(exl2_act_order_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
    monkeypatch.setenv("EXL_CORE_EXL2_AS_U4", "0")
    plain = load_model(exl2_act_order_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
    assert any(m.packed.rows is not None for _, m in rewritten.linear_layers() if m.is_quantized)
    assert all(m.packed.rows is None for _, m in plain.linear_layers() if m.is_quantized)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.inference_mode():
        a, b = rewritten.forward_batch(ids).double(), plain.forward_batch(ids).double()
    assert float((a - b).norm() / b.norm()) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_prompt_dequantise_adds_twins(dtype, padded, monkeypatch):
    """The prompt's W of a rewritten weight has K rows: each chunk's values plus its twin's (the extra chunk reading the
    same x columns) in one thread, rounded once (qdequant_chunks' twin table, twins_of), whole and in a column slice;
    a padded weight's zero-scale chunks (formats.uniform4.pad_rows: all aimed at row 0) are left out.  Against the
    float64 dequantisation of the file's weight within one rounding (half an ulp of the largest value), where
    dequantising the extra rows apart and index_add-ing them (EXL_CORE_PROMPT_NATURAL_X=0) rounds three times."""
    _need_kernels()
    from exl_core.formats.uniform4 import as_uniform4, pad_rows
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_dequant as cd
    pw = random_packed(U4_LAYOUTS[1], 520, perm=True)
    u = as_uniform4(pw, max_growth=10.0)
    if padded:
        u = pad_rows(u, u.rows + 64)
    uc = u.to("cuda")
    chunks, perm = cc._chunks_of(uc), cc._perm_of(uc, torch.device("cuda"))
    twins = cd.twins_of(uc, chunks, perm)
    assert twins is not None and twins.shape == (u.in_features // 32,)
    assert int((twins >= 0).sum()) * 32 == u.rows - u.in_features - (64 if padded else 0)
    full = dequantize_reference(pw)
    for n0, cols in ((0, -1), (8, 256)):
        poison_allocator()
        w = cd.dequant_w(uc, chunks, perm, dtype, n0, cols)
        monkeypatch.setattr(cd, "PROMPT_NATURAL_X", False)
        two = cd.dequant_w(uc, chunks, perm, dtype, n0, cols)
        monkeypatch.setattr(cd, "PROMPT_NATURAL_X", True)
        ref = full[:, n0:n0 + w.shape[1]]
        assert w.shape == two.shape == ref.shape
        top = float(ref.abs().max())
        half_ulp = 2.0 ** (-11 if dtype == torch.float16 else -8)        # one rounding of a value <= top
        assert float((w.double().cpu() - ref).abs().max()) <= half_ulp * top * 1.001 + 1e-5 * top
        assert float((two.double().cpu() - ref).abs().max()) <= 3 * half_ulp * top
        assert not torch.equal(w, two) or not bool((twins >= 0).any())     # the twin path did run


def test_twin_table_needs_sixteen_times_the_scale():
    """The prompt's dequantise takes a chunk and its twin as one value r + 16 h with the chunk's scale, so twins_of
    gives a table only where every twin's scale is exactly 16x its chunk's (as formats.uniform4 writes it); one
    column's twin scale off by an ulp and there is none (the extra rows are then dequantised apart and added)."""
    _need_kernels()
    import dataclasses
    from exl_core.formats.uniform4 import as_uniform4
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_dequant as cd
    u = as_uniform4(random_packed(U4_LAYOUTS[1], 520, perm=True), max_growth=10.0).to("cuda")
    fresh = lambda pw: dataclasses.replace(pw, meta={k: v for k, v in pw.meta.items() if not k.startswith("_")})
    good = fresh(u)
    chunks, perm = cc._chunks_of(good), cc._perm_of(good, torch.device("cuda"))
    twins = cd.twins_of(good, chunks, perm)
    assert twins is not None and bool((twins >= 0).any())
    t = int(twins[twins >= 0][0])
    scale = u.scale.clone()
    g = int(chunks[t, 1])
    scale[g, 3] = torch.nextafter(scale[g, 3], torch.tensor(float("inf"), device="cuda"))
    bad = dataclasses.replace(fresh(u), scale=scale)
    chunks, perm = cc._chunks_of(bad), cc._perm_of(bad, torch.device("cuda"))
    assert cd.twins_of(bad, chunks, perm) is None


def test_rewritten_prompt_reads_x_in_natural_order(tiny_model_factory, tmp_path, monkeypatch):
    """A rewritten EXL2 model's prompt (rows past the decode kernels): the norm before q/k/v and gate/up writes x in
    its natural order (no permuted norm), every GEMM runs over K, and the logits agree with the extended-order path
    (EXL_CORE_PROMPT_NATURAL_X=0); a decode-sized forward still takes the permuted norm."""
    _need_kernels()
    from exl_core.ops import cuda_dequant as cd
    from test_norm_perm import record_norm_widths, rewritten_shared_exl2
    model = rewritten_shared_exl2(tiny_model_factory, tmp_path, device="cuda", dtype=torch.float16)
    assert model.layers[0].self_attn.q_proj.packed.rows is not None
    widths = record_norm_widths(monkeypatch)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.inference_mode():
        natural = model.forward_batch(ids).double()
        assert widths == []
        monkeypatch.setattr(cd, "PROMPT_NATURAL_X", False)
        extended = model.forward_batch(ids).double()
        assert len(widths) == 2 * len(model.layers) and max(widths) > model.config.hidden_size
        monkeypatch.setattr(cd, "PROMPT_NATURAL_X", True)
        widths.clear()
        model.forward_batch(ids[:, :8])                     # decode-sized rows keep the extended order
        assert len(widths) == 2 * len(model.layers)
    assert float(extended.abs().max()) > 1e-2
    assert float((natural - extended).norm() / extended.norm()) < 2e-3
