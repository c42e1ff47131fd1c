"""The RMSNorm written in an act-order on CUDA (exl_core::rms_norm_perm, ops/cuda_norm_perm.py): the same bits as the
norm kernel with its columns gathered, and EXL2 and GPTQ act-order models whose q/k/v and gate/up share their
permutations (as ExLlamaV2's converter writes them) giving the same decode logits bit for bit with the norm writing their order as
with the projections gathering x (batch 1, 8 and 20 rows: the staged, skinny and wide kernels), and the prompt's
within rounding (its dequantise + GEMM sums K in the permuted order)."""
from __future__ import annotations

import pytest
import torch
from test_cuda_kernels import _need_kernels, poison_allocator
from test_norm_perm import record_norm_widths, rewritten_shared_exl2, share_group_perms

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("H", [4096, 576, 8192, 100], ids=["4096", "576", "8192", "100"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("extra", [0, 256], ids=["perm", "perm+256"])
@pytest.mark.parametrize("rows", [13, 32])      # 32: the lean instance (ops/cuda_norm_perm.py _lean)
def test_rms_norm_perm_is_the_norm_gathered(dtype, H, with_residual, extra, rows):
    _need_kernels()
    from exl_core.ops.norm import rms_norm
    from exl_core.ops.norm_perm import RMS_NORM_PERM, rms_norm_permuted
    g = torch.Generator().manual_seed(H)
    x = torch.randn(rows, H, generator=g).to(dtype).cuda()
    w = (torch.rand(H, generator=g) + 0.5).to(dtype).cuda()
    res = torch.randn(rows, H, generator=g).to(dtype).cuda() if with_residual else None
    # extra: columns read again (weights with extra rows, formats/uniform4.py): y has H + extra columns
    perm = torch.cat([torch.randperm(H, generator=g), torch.randint(0, H, (extra,), generator=g)]).to(torch.int32).cuda()
    per_vec, P = 16 // x.element_size(), H + extra        # the kernel: whole 16-byte vectors, at most 4 a thread
    kernel = H % per_vec == 0 and P <= 256 * 4 * per_vec  # (fp16/bf16 up to 8192, fp32 up to 4096)
    assert (RMS_NORM_PERM.select(x=x, weight=w, eps=1e-5, perm=perm, residual=res).name == "cuda") == kernel
    poison_allocator()
    ref = rms_norm(x, w, 1e-5, res, weight_static=True)
    got = rms_norm_permuted(x * 1, w, 1e-5, perm, None if res is None else res * 1)   # inputs made just before
    if with_residual:
        assert torch.equal(got[0], ref[0][:, perm.long()]) and torch.equal(got[1], ref[1])
    else:
        assert torch.equal(got, ref[:, perm.long()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("lean", [False, True], ids=["regular", "lean"])
def test_rms_norm_perm_every_instance(dtype, late, lean):
    """The kernel's launch options (the policy in ops/cuda_norm_perm.py picks them, lean where its shared memory
    fits): the same bits either way; an int16 perm (the P16 instance's, removed in stop 67) is refused."""
    _need_kernels()
    from exl_core.ops.norm import rms_norm
    g = torch.Generator().manual_seed(7)
    # (16-bit: H 8192 with P 8192 does not fit the lean instance's shared memory: the host takes the regular one)
    H, extra = (8192, 0) if dtype == torch.bfloat16 else (4096, 256) if dtype == torch.float16 else (2048, 64)
    x, res = (torch.randn(20, H, generator=g).to(dtype).cuda() for _ in range(2))
    w = (torch.rand(H, generator=g) + 0.5).to(dtype).cuda()
    perm = torch.cat([torch.randperm(H, generator=g), torch.randint(0, H, (extra,), generator=g)]).int().cuda()
    ref = rms_norm(x, w, 1e-5, res, weight_static=True)
    for r in (None, res):
        poison_allocator()
        got = torch.ops.exl_core.rms_norm_perm(x, r, w, 1e-5, perm, late, lean)
        want = ref if r is not None else (rms_norm(x, w, 1e-5, weight_static=True),)
        assert torch.equal(got[0], want[0][:, perm.long()])
        if r is not None:
            assert torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="int32 perm"):
        torch.ops.exl_core.rms_norm_perm(x, res, w, 1e-5, perm.short(), late, lean)


def test_rms_norm_perm_refusals_fall_back_to_the_reference():
    _need_kernels()
    from exl_core.ops.norm_perm import RMS_NORM_PERM, rms_norm_permuted
    x, w = torch.randn(3, 256).half().cuda(), torch.ones(256).half().cuda()
    p64 = torch.randperm(256).cuda()
    assert RMS_NORM_PERM.select(x=x, weight=w, eps=1e-5, perm=p64, residual=None).name != "cuda"   # int64
    assert torch.equal(rms_norm_permuted(x, w, 1e-5, p64), rms_norm_permuted(x, w, 1e-5, p64.int()))
    xs = x[:, 8:].contiguous()[:, :240]                   # a row stride the kernel does not take: copied first
    p240 = torch.randperm(240).int().cuda()
    from exl_core.ops.norm import rms_norm
    ref = rms_norm(xs.contiguous(), w[:240], 1e-5, weight_static=True)[:, p240.long()]
    assert torch.equal(rms_norm_permuted(xs, w[:240], 1e-5, p240), ref)


@pytest.fixture(scope="module", params=["exl2", "gptq"])
def shared_perm_model(request, tiny_model_factory, tmp_path_factory):
    """An act-order model whose q/k/v and gate/up share permutations: EXL2 (mixed widths) and GPTQ 4-bit."""
    from exl_core.loader import load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    src = tiny_model_factory("llama", seed=5, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                             num_key_value_heads=2)
    bits = [(6, 0.25), (4, 0.5), (3, 0.25)] if request.param == "exl2" else 4
    q = quantize_model_rtn(src, tmp_path_factory.mktemp(f"{request.param}_shared"), fmt=request.param, bits=bits,
                           group_size=32, act_order=True)
    model = load_model(q, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
    assert share_group_perms(model) == 2 * len(model.layers)
    return model


def _step_logits(model, ids, kvs):
    with torch.inference_mode():
        return model.forward_batch(ids, kvs)


@pytest.mark.parametrize("rows", [1, 8, 20])
def test_model_decode_same_bits_with_the_norm_writing_the_order(shared_perm_model, rows, monkeypatch):
    from exl_core.model import llama
    model = shared_perm_model
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randint(0, 1000, (rows, 6), generator=g).cuda()
    nxt = torch.randint(0, 1000, (rows, 1), generator=g).cuda()
    calls = []
    real = llama.rms_norm_permuted
    monkeypatch.setattr(llama, "rms_norm_permuted", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    out = {}
    for devices in ((), ("cuda",)):
        monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ())        # the prompt's K/V alike (its GEMMs sum K in
        kvs = [model.new_sequence_kv(16) for _ in range(rows)]      # another order with the norm permuted)
        _step_logits(model, prompt, kvs)
        monkeypatch.setattr(llama, "NORM_PERM_DEVICES", devices)
        out[devices] = _step_logits(model, nxt, kvs)
    assert len(calls) == 2 * len(model.layers)          # the step's q/k/v and gate/up inputs, every layer
    from exl_core.ops.norm_perm import RMS_NORM_PERM
    x, weight, eps, perm, residual, site = calls[1][0]    # a middle norm's arguments: the kernel served it
    assert site == "mlp" and [c[0][5] for c in calls[:2]] == ["attn", "mlp"] and perm.dtype == torch.int32
    assert RMS_NORM_PERM.select(x=x, weight=weight, eps=eps, perm=perm, residual=residual, site=site).name == "cuda"
    assert float(out[()].abs().max()) > 1e-2
    assert torch.equal(out[("cuda",)], out[()])


def test_model_prompt_within_rounding(shared_perm_model, monkeypatch):
    from exl_core.model import llama
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(9)).cuda()
    monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ())
    ref = _step_logits(shared_perm_model, ids, None).double()
    monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ("cuda",))
    widths = record_norm_widths(monkeypatch)
    got = _step_logits(shared_perm_model, ids, None).double()
    assert len(widths) == 2 * len(shared_perm_model.layers)      # the permuted norm ran for every q/k/v and gate/up
    assert float((got - ref).norm() / ref.norm()) < 2e-3


def test_uniform4_rows_decode_with_the_norm_writing_the_extended_order(tiny_model_factory, tmp_path, monkeypatch):
    """EXL2 rewritten as uniform 4-bit rows (EXL_CORE_EXL2_AS_U4's loader.as_uniform4_weights): q/k/v and gate/up with
    one row layout share the extended permutation, the norm writes all its columns, and their kernels run as plain
    uniform 4-bit weights of that many rows; decode logits agree with the gathering path within rounding (the two
    may take different kernels at 8 and 20 rows)."""
    from exl_core.model import llama
    from exl_core.model.linear import shared_perm
    model = rewritten_shared_exl2(tiny_model_factory, tmp_path, device="cuda", dtype=torch.float16)
    blk = model.layers[0]
    qkv = (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj)
    assert blk.self_attn.q_proj.packed.rows is not None and shared_perm(qkv) is not None
    widths = record_norm_widths(monkeypatch)
    for rows in (1, 8, 20):
        g = torch.Generator().manual_seed(rows)
        prompt = torch.randint(0, 1000, (rows, 6), generator=g).cuda()
        nxt = torch.randint(0, 1000, (rows, 1), generator=g).cuda()
        out = {}
        for devices in ((), ("cuda",)):
            monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ())
            kvs = [model.new_sequence_kv(16) for _ in range(rows)]
            _step_logits(model, prompt, kvs)
            monkeypatch.setattr(llama, "NORM_PERM_DEVICES", devices)
            out[devices] = _step_logits(model, nxt, kvs).double()
        ref = out[()]
        assert float(ref.abs().max()) > 1e-2
        assert float((out[("cuda",)] - ref).norm() / ref.norm()) < 2e-3, rows
    assert len(widths) == 3 * 2 * len(model.layers) and max(widths) > model.config.hidden_size   # the extended x
