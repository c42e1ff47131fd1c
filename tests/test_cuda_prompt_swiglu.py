"""The prompt's gate/up by column slices with SwiGLU's product per slice (ops/cuda_swiglu.py's prompt branch,
cuda_candidates._dequant_swiglu, exl_core::silu_mul_into): against float64 and against the three ops it replaces
(gate and up through qmatmul_many, then silu_mul), bit for bit where the GEMMs have the same shapes; what it
refuses; a GPTQ and a rewritten EXL2 model's prompt with it on and off.  Helpers from test_cuda_kernels."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from exl_core.formats.packed import dequantize_reference
from test_cuda_kernels import _need_kernels, poison_allocator, random_packed, rel_err

pytestmark = pytest.mark.cuda


def _pair(kind: str, N: int, bias: bool):
    from exl_core.formats.uniform4 import as_uniform4
    out = []
    for _ in range(2):
        if kind == "exl2":     # mixed widths rewritten as uniform 4-bit rows with twins (the loader's CUDA default)
            pw = as_uniform4(random_packed([(5, 128), (4, 256), (3, 128)], N, perm=True, bias=bias), max_growth=10.0)
        else:
            pw = random_packed([(4, 128)] * 4, N, perm=kind == "gptq_act", bias=bias)
        ref = dequantize_reference(pw)
        pw = pw.to("cuda")
        if pw.bias is not None:
            pw.bias = pw.bias.half()
        out.append((pw, ref))
    return out


@pytest.mark.parametrize("kind", ["gptq", "gptq_act", "exl2"])
@pytest.mark.parametrize("M", [33, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slice_cols", [4096, 256, 200])       # one slice; 3 and a partial; 4 and a partial
def test_prompt_swiglu_equals_three_ops_and_float64(kind, M, bias, slice_cols, monkeypatch):
    _need_kernels()
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_swiglu
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import qmatmul_many
    from exl_core.ops.swiglu import DISPATCH_SWIGLU, qmatmul_swiglu
    N = 704
    (gate, wg), (up, wu) = _pair(kind, N, bias)
    x = (torch.randn(M, gate.in_features) * 0.5).half().cuda()
    monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_SLICE", slice_cols)
    assert cc.prompt_rows(M) and DISPATCH_SWIGLU.select(x=x, gate=gate, up=up).name == "cuda"
    poison_allocator()
    h = qmatmul_swiglu(x, gate, up, tails=None)
    assert h.shape == (M, N) and h.dtype == torch.float16
    three = silu_mul(*qmatmul_many(x, [gate, up]))
    if slice_cols >= N:                                         # the same GEMMs as qmatmul_many's
        assert torch.equal(h, three)
    else:
        assert rel_err(h, three.double().cpu()) < 1e-3
    bg, bu = ((pw.bias.double().cpu() if pw.bias is not None else 0) for pw in (gate, up))
    xd = x.double().cpu()
    assert rel_err(h, F.silu(xd @ wg + bg) * (xd @ wu + bu)) < 3e-3


def test_prompt_swiglu_refuses_what_it_does_not_run(monkeypatch):
    """None (nothing done: MLP.gate_up runs qmatmul_many and down runs silu_mul) with EXL_CORE_PROMPT_SWIGLU=0, for
    N not a multiple of 8 (silu_mul_into's 16-byte vectors), and for a slice width that is not a positive multiple
    of 8; decode-sized rows never reach the prompt branch."""
    _need_kernels()
    from exl_core.ops import cuda_swiglu
    from exl_core.ops.swiglu import qmatmul_swiglu
    (gate, _), (up, _) = _pair("gptq", 704, False)
    x = torch.randn(64, gate.in_features).half().cuda()
    assert qmatmul_swiglu(x, gate, up) is not None
    assert qmatmul_swiglu(x[:8], gate, up) is None
    (g2, _), (u2, _) = _pair("gptq", 700, False)
    assert qmatmul_swiglu(x, g2, u2) is None
    monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_SLICE", 100)
    assert qmatmul_swiglu(x, gate, up) is None
    monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_SLICE", 4096)
    monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_ON", False)
    assert qmatmul_swiglu(x, gate, up) is None


def test_silu_mul_into_writes_only_its_columns():
    """silu_mul_into on a column slice of a wider matrix: the slice is silu_mul's result bit for bit, the columns
    around it keep their values."""
    _need_kernels()
    from exl_core.ops.activation import silu_mul
    g, u = (torch.randn(37, 96).half().cuda() for _ in range(2))
    h = torch.full((37, 256), 7.0, dtype=torch.float16, device="cuda")
    torch.ops.exl_core.silu_mul_into(g, u, h[:, 64:160])
    assert torch.equal(h[:, 64:160], silu_mul(g, u))
    assert bool((h[:, :64] == 7).all()) and bool((h[:, 160:] == 7).all())


def _gptq_model(tiny_model_factory, tmp_path):
    from exl_core.loader import load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    src = tiny_model_factory("llama", seed=random.randrange(1000), hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    d = quantize_model_rtn(src, tmp_path / "q", fmt="gptq", bits=4, group_size=128, act_order=False)
    return load_model(d, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]


@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_model_prompt_with_sliced_swiglu_matches_without(fmt, tiny_model_factory, tmp_path, monkeypatch):
    """A 40-token prompt with the prompt branch on (counted: once a layer) and off: the same logits, bit for bit
    (a tiny model's N fits one slice, so the GEMMs are the same); and with slices of 128 columns within 2e-3."""
    _need_kernels()
    from exl_core.ops import cuda_swiglu, swiglu
    from test_norm_perm import rewritten_shared_exl2
    if fmt == "gptq":
        model = _gptq_model(tiny_model_factory, tmp_path)
    else:
        model = rewritten_shared_exl2(tiny_model_factory, tmp_path, device="cuda", dtype=torch.float16)
        assert model.layers[0].mlp.gate_proj.packed.rows is not None
    calls = [0]
    run = cuda_swiglu._run

    def counted(*a, **k):
        calls[0] += 1
        return run(*a, **k)
    monkeypatch.setattr(cuda_swiglu, "_run", counted)
    monkeypatch.setattr(swiglu.DISPATCH_SWIGLU, "candidates", list(swiglu.DISPATCH_SWIGLU.candidates))
    cuda_swiglu.install()                                      # the candidate bound to the counted run
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
    out = {}
    with torch.inference_mode():
        for on in (True, False):
            monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_ON", on)
            calls[0] = 0
            out[on] = model.forward_batch(ids)
            assert calls[0] == (len(model.layers) if on else 0)
        monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_ON", True)
        monkeypatch.setattr(cuda_swiglu, "PROMPT_SWIGLU_SLICE", 128)
        sliced = model.forward_batch(ids).double()
    assert torch.equal(out[True], out[False])
    ref = out[False].double()
    assert float(ref.abs().max()) > 1e-2 and float((sliced - ref).norm() / ref.norm()) < 2e-3
