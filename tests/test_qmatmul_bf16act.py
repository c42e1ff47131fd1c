"""bf16-activation qmatmul (exl_core::qmatmul_bf16, csrc/cpu/qmatmul_bf16*.cpp, opt-in for prompts)
against a float64 reference that rounds x to bf16 the way the kernel's contract states (round to
nearest even, as torch's .bfloat16()) and multiplies it by the float64-dequantised W (the weights
are NOT rounded: raw q is exact in bf16 and the scales apply in fp32).  Fresh random data,
poisoned outputs, odd shapes; the same bound must reject the exact product, so the tests tell
bf16 from exact.  Then the dispatcher's opt-in and a whole model."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl_core.errors import ConfigError
from exl_core.formats.packed import SUPPORTED_BITS, dequantize_reference
from exl_core.ops import qmatmul as qm
from exl_core.ops.dispatch import has_op

from test_qmatmul import check_multi_equals_single, rand_packed, reference, rel_err

needs_op = pytest.mark.skipif(not has_op("qmatmul_bf16"), reason="exl_core._C not built with qmatmul_bf16")


def _supported() -> bool:
    return has_op("qmatmul_bf16") and bool(torch.ops.exl_core.qmatmul_bf16_supported())


needs_cpu = pytest.mark.skipif(not _supported(), reason="CPU without AVX512_BF16 (or extension not built)")


def reference_bf16(x: torch.Tensor, pw) -> torch.Tensor:
    y = x.float().bfloat16().double() @ dequantize_reference(pw, torch.float64)
    return y if pw.bias is None else y + pw.bias.double()


def run_bf16(x, pw):
    poison = torch.full((x.shape[0], pw.out_features), float("nan"))   # NaN on the allocator's free list
    del poison
    return torch.ops.exl_core.qmatmul_bf16(x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm, pw.bias)


# Measured max |y - ref_bf16| / max |ref_bf16|: 4.8e-7 worst over the shapes below, two seeds
# (fp32 sums of exact bf16 x integer products); the exact product (x not rounded) is at least
# 7.8e-4 away from the same outputs, so the bound tells the two apart: _check asserts both on
# every call.
TOL = 1e-5


def _check(x, pw):
    y = run_bf16(x, pw)
    assert y.shape == (x.shape[0], pw.out_features) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert rel_err(y, reference_bf16(x, pw)) < TOL
    assert rel_err(y, reference(x, pw)) > 10 * TOL          # the rounding of x shows: this is not exact
    return y


@needs_cpu
@pytest.mark.parametrize("bits", [*[(b,) for b in SUPPORTED_BITS], None])   # None: mixed widths (EXL2)
@pytest.mark.parametrize("M", [9, 37, 512])
@pytest.mark.parametrize("perm", [True, False])
def test_matches_bf16_reference_576x1536(bits, M, perm, rng):
    pw = rand_packed(576, 1536, rng, bits=bits, perm=perm, bias=perm)
    _check(torch.randn(M, 576), pw)


@needs_cpu
def test_bound_rejects_the_exact_kernel(rng):
    """The reverse of _check's second assertion: exact outputs fail the bf16 bound."""
    pw = rand_packed(576, 1536, rng, bits=(4,), group_size=128)
    x = torch.randn(37, 576)
    exact = torch.ops.exl_core.qmatmul(x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm, pw.bias)
    assert rel_err(exact, reference(x, pw)) < TOL
    assert rel_err(exact, reference_bf16(x, pw)) > 10 * TOL


@needs_cpu
@pytest.mark.parametrize("M", [9, 37, 512])
def test_gptq_g128_act_order_k_not_multiple_of_group(M, rng):
    """GPTQ 4-bit g128 at K = 576 (last group 64 rows), act-order permutation, down_proj's shape too."""
    for K, N in ((576, 1536), (1536, 576)):
        pw = rand_packed(K, N, rng, bits=(4,), group_size=128, perm=True)
        assert pw.groups[-1, 2].item() == K % 128 or K % 128 == 0
        _check(torch.randn(M, K), pw)


@needs_cpu
@pytest.mark.parametrize("N", [1, 13, 37, 95, 200])
@pytest.mark.parametrize("M", [9, 10, 11, 37])
def test_odd_column_counts_and_rows(N, M, rng):
    """Column tails (masked lanes, 1-panel tiles) and every remainder of the 3-row blocks."""
    pw = rand_packed(160, N, rng)
    _check(torch.randn(M, 160) * 3, pw)


@needs_cpu
def test_bf16_input_and_small_m(rng):
    pw = rand_packed(128, 48, rng)
    xb = torch.randn(12, 128).to(torch.bfloat16)
    yb = run_bf16(xb, pw)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, run_bf16(xb.float(), pw).to(torch.bfloat16))
    x1 = torch.randn(1, 128)                         # the op serves any M; only the dispatcher draws lines
    assert rel_err(run_bf16(x1, pw), reference_bf16(x1, pw)) < TOL


@needs_cpu
def test_rows_independent_and_multi_equals_single(rng):
    """Row i does not depend on the other rows; the multi op equals one call per weight."""
    check_multi_equals_single(torch.ops.exl_core.qmatmul_bf16_multi, run_bf16, 40, rng)


@needs_op
def test_refused_without_avx512(rng, isa_cap):
    pw = rand_packed(64, 32, rng)
    isa_cap(1)
    assert not torch.ops.exl_core.qmatmul_bf16_supported()
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        run_bf16(torch.randn(16, 64), pw)
    pwb = dataclasses.replace(pw, meta={"prefill": "bf16"})
    x = torch.randn(16, 64)
    assert "AVX512_BF16" in dict(qm.DISPATCH.reasons(x=x, pw=pwb))["cpu_bf16"]
    assert torch.equal(qm.qmatmul(x, pwb), qm.qmatmul(x, pw))     # exact kernel serves instead


@needs_op
def test_bad_arguments_are_refused(rng):
    if not _supported():
        pytest.skip("CPU without AVX512_BF16")
    pw = rand_packed(64, 32, rng)
    with pytest.raises(RuntimeError, match="K = 96"):
        torch.ops.exl_core.qmatmul_bf16(torch.randn(16, 96), pw.qweight, pw.groups, pw.scale, pw.zero, None, None)


# ---------------------------------------------------------------------------- dispatcher


@needs_cpu
def test_dispatcher_uses_bf16_only_when_asked_and_for_large_m(rng):
    pw = rand_packed(128, 64, rng)
    big = torch.randn(qm.BF16_MIN_M, 128)
    exact = qm.qmatmul(big, pw)
    assert "not requested" in dict(qm.DISPATCH.reasons(x=big, pw=pw))["cpu_bf16"]
    pwb = dataclasses.replace(pw, meta={"prefill": "bf16"})
    assert torch.equal(qm.qmatmul(big, pwb), run_bf16(big, pwb))
    assert not torch.equal(qm.qmatmul(big, pwb), exact)
    small = torch.randn(qm.BF16_MIN_M - 1, 128)
    assert "rows" in dict(qm.DISPATCH.reasons(x=small, pw=pwb))["cpu_bf16"]
    assert torch.equal(qm.qmatmul(small, pwb), qm.qmatmul(small, pw))        # decode-sized: exact kept
    both = dataclasses.replace(pw, meta={"prefill": "bf16", "activations": "int8"})   # the two switches
    assert torch.equal(qm.qmatmul(small, both), qm.qmatmul(small, dataclasses.replace(pw, meta={"activations": "int8"})))
    assert torch.equal(qm.qmatmul(big, both), run_bf16(big, pwb))
    # several weights: one bf16 call, same as one per weight
    pws = [pwb, dataclasses.replace(rand_packed(128, 40, rng), perm=pwb.perm, meta={"prefill": "bf16"})]
    for y, p in zip(qm.qmatmul_many(big, pws), pws):
        assert torch.equal(y, run_bf16(big, p))
    assert dict(qm.DISPATCH_MANY.reasons(x=big, pws=pws))["cpu_bf16_multi"] is None


def test_unknown_prefill_kind_is_a_config_error(tiny_llama_dir):
    from exl_core.loader import load_model
    with pytest.raises(ConfigError, match="prefill='fp8'"):
        load_model(tiny_llama_dir, prefill="fp8", load_tokenizer=False)


# ---------------------------------------------------------------------------- whole models


@needs_cpu
def test_tiny_quantized_model_bf16_prefill_close(tiny_llama_dir, tmp_path):
    from exl_core.loader import load_model, set_prefill
    from exl_core.quantize.rtn import quantize_model_rtn
    dst = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt="gptq", bits=4, group_size=32)
    model, _ = load_model(dst, load_tokenizer=False)
    prompt = torch.tensor([[1, 5, 9, 13, 2, 7, 3, 11, 4, 6, 8, 12]])
    with torch.inference_mode():
        kv = [model.new_sequence_kv(16)]
        exact = model.forward_batch(prompt, kv)[0].double()
        step_exact = model.forward_batch(torch.tensor([[5]]), kv)[0].double()
        set_prefill(model, "bf16")
        kv = [model.new_sequence_kv(16)]
        got = model.forward_batch(prompt, kv)[0].double()
        step = model.forward_batch(torch.tensor([[5]]), kv)[0].double()
    err = float((got - exact).norm() / exact.norm())
    assert 0 < err < 0.02, err                        # bf16 x rounding: ~2^-9 relative per value
    assert float((step - step_exact).norm() / step_exact.norm()) < 0.02   # decode row itself is exact;
    set_prefill(model, "exact")                                            # its K/V came from the bf16 prompt
    assert all("prefill" not in m.packed.meta for m in model.modules() if getattr(m, "is_quantized", False))
