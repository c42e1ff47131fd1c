"""Int8-activation qmatmul (exl_core::qmatmul_int8, csrc/cpu/qmatmul_int8*.cpp) against a float64
reference that quantizes x the way the kernel's contract states (qmatmul_int8.h: per row and
32-value chunk of the permuted x, sx = amax/127 and xq = round_half_even(x/sx), both in fp32)
and multiplies xq*sx by the float64-dequantised W.  Only fp32 rounding of the per-chunk
epilogue separates kernel and reference, so the tolerance is tight; ISA paths must agree bit for
bit; the opt-in switch goes through the dispatcher; a real model decodes sensibly with it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl_core.errors import ConfigError
from exl_core.formats.packed import SUPPORTED_BITS, dequantize_reference
from exl_core.ops import qmatmul as qm
from exl_core.ops.dispatch import has_op

from test_qmatmul import check_multi_equals_single, rand_packed

needs_op = pytest.mark.skipif(not has_op("qmatmul_int8"), reason="exl_core._C not built with qmatmul_int8")


def quantize_x_reference(xp: torch.Tensor) -> torch.Tensor:
    """fp32 permuted x [M, K] -> float64 xq * sx, chunk by chunk (the contract in qmatmul_int8.h)."""
    M, K = xp.shape
    xc = xp.float().reshape(M, K // 32, 32)
    amax = xc.abs().amax(-1, keepdim=True)                        # fp32, exact
    sx = amax / 127                                               # fp32 division, as the kernel
    safe = torch.where(amax > 0, sx, torch.ones_like(sx))
    xq = torch.where(amax > 0, torch.round(xc / safe), torch.zeros_like(xc))   # half to even
    assert xq.abs().max() <= 127
    return (xq.double() * sx.double()).reshape(M, K)


def reference_int8(x: torch.Tensor, pw) -> torch.Tensor:
    xp = x.float() if pw.perm is None else x.float()[:, pw.perm]
    w = dequantize_reference(pw, torch.float64)                   # original row order
    w_perm = w if pw.perm is None else w[pw.perm]
    y = quantize_x_reference(xp) @ w_perm
    return y if pw.bias is None else y + pw.bias.double()


def rel_err(y, ref) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_int8(x, pw):
    poison = torch.full((x.shape[0], pw.out_features), float("nan"))   # NaN on the allocator's free list
    del poison
    return torch.ops.exl_core.qmatmul_int8(x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm, pw.bias)




# Measured max |y - ref| / max |ref|: 2.6e-7 worst over every width, M in {1,3,8} at 576x1536
# (fp32 rounding of the per-chunk epilogue); against the exact float64 product (x not rounded)
# the same cases differ by up to 6.8e-3, so this bound does tell the two apart.
TOL = 1e-5


@needs_op
@pytest.mark.parametrize("bits", [*[(b,) for b in SUPPORTED_BITS], None])   # None: mixed widths
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("perm", [True, False])
def test_matches_int8_reference_576x1536(bits, M, perm, rng):
    pw = rand_packed(576, 1536, rng, bits=bits, perm=perm, bias=perm)
    x = torch.randn(M, 576)
    y = run_int8(x, pw)
    assert y.shape == (M, 1536) and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    assert rel_err(y, reference_int8(x, pw)) < TOL


@needs_op
@pytest.mark.parametrize("N", [1, 13, 37, 95, 200])
@pytest.mark.parametrize("M", [1, 2, 5, 37])
def test_odd_column_counts_and_rows(N, M, rng):
    """Column tails (masked lanes), every row-block remainder, and M beyond the dispatcher's cap."""
    pw = rand_packed(160, N, rng)
    x = torch.randn(M, 160) * 3
    y = run_int8(x, pw)
    assert torch.isfinite(y).all()
    assert rel_err(y, reference_int8(x, pw)) < TOL


@needs_op
def test_zero_chunks_and_bf16_input(rng):
    pw = rand_packed(128, 48, rng)
    x = torch.randn(2, 128)
    x[0, 32:64] = 0          # amax == 0: that chunk contributes nothing
    x[1] = 0
    y = run_int8(x, pw)
    assert rel_err(y, reference_int8(x, pw)) < TOL
    assert torch.equal(y[1], pw.bias)                              # all-zero row: bias only
    xb = torch.randn(3, 128).to(torch.bfloat16)
    yb = run_int8(xb, pw)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, run_int8(xb.float(), pw).to(torch.bfloat16))


@needs_op
@pytest.mark.parametrize("bits", [*[(b,) for b in SUPPORTED_BITS], None])
def test_isa_paths_bit_identical(bits, rng, isa_cap):
    pw = rand_packed(320, 203, rng, bits=bits)
    x = torch.randn(5, 320)
    isa_cap(2)
    detected = torch.ops.exl_core.matmul_isa(-1)        # before the loop caps it
    outs = {}
    for cap in (2, 1, 0):
        isa_cap(cap)
        outs[torch.ops.exl_core.qmatmul_int8_isa()] = run_int8(x, pw)
    assert 0 in outs and (1 in outs or detected == 0)
    first = next(iter(outs.values()))
    for level, y in outs.items():
        assert torch.equal(y, first), f"int8 ISA level {level} differs"


@needs_op
def test_vnni_path_runs_where_the_cpu_has_it():
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if "avx512_vnni" not in flags or "avx512bw" not in flags:
        pytest.skip("CPU without AVX-512 VNNI")
    assert torch.ops.exl_core.qmatmul_int8_isa() == 2


@needs_op
def test_rows_independent_and_multi_equals_single(rng):
    """Row i does not depend on the other rows; the multi op equals one call per weight."""
    check_multi_equals_single(torch.ops.exl_core.qmatmul_int8_multi, run_int8, 7, rng)


@needs_op
def test_bad_arguments_are_refused(rng):
    pw = rand_packed(64, 32, rng)
    with pytest.raises(RuntimeError, match="K = 96"):
        torch.ops.exl_core.qmatmul_int8(torch.randn(1, 96), pw.qweight, pw.groups, pw.scale, pw.zero, None, None)
    bad = pw.groups.clone()
    bad[0, 0] = 7
    with pytest.raises(RuntimeError, match="bit width 7"):
        torch.ops.exl_core.qmatmul_int8(torch.randn(1, 64), pw.qweight, bad, pw.scale, pw.zero, None, None)


# ---------------------------------------------------------------------------- dispatcher


@needs_op
def test_dispatcher_uses_int8_only_when_asked_and_for_small_m(rng):
    pw = rand_packed(128, 64, rng)
    x = torch.randn(2, 128)
    exact = qm.qmatmul(x, pw)
    assert torch.equal(exact, torch.ops.exl_core.qmatmul(x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm,
                                                         pw.bias))
    reasons = dict(qm.DISPATCH.reasons(x=x, pw=pw))
    assert "not requested" in reasons["cpu_int8"]
    pw8 = dataclasses.replace(pw, meta={"activations": "int8"})
    assert torch.equal(qm.qmatmul(x, pw8), run_int8(x, pw8))
    assert not torch.equal(qm.qmatmul(x, pw8), exact)
    big = torch.randn(qm.INT8_MAX_M + 1, 128)
    assert "prefill" in dict(qm.DISPATCH.reasons(x=big, pw=pw8))["cpu_int8"]
    assert torch.equal(qm.qmatmul(big, pw8), qm.qmatmul(big, pw))              # exact path kept
    # several weights: one int8 call, same as one per weight
    pws = [pw8, dataclasses.replace(rand_packed(128, 40, rng), perm=pw8.perm, meta={"activations": "int8"})]
    for y, p in zip(qm.qmatmul_many(x, pws), pws):
        assert torch.equal(y, run_int8(x, p))
    assert dict(qm.DISPATCH_MANY.reasons(x=x, pws=pws))["cpu_int8_multi"] is None


def test_unknown_activation_kind_is_a_config_error(tiny_llama_dir):
    from exl_core.loader import load_model
    with pytest.raises(ConfigError, match="activations='fp4'"):
        load_model(tiny_llama_dir, activations="fp4", load_tokenizer=False)


# ---------------------------------------------------------------------------- whole models


def _decode_logits(model, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits of the prompt's last row, then of each forced token fed one at a time (M = 1 rows,
    the decode shape the int8 path serves): [len(forced) + 1, vocab]."""
    kv = [model.new_sequence_kv(len(prompt) + len(forced) + 1)]
    out = [model.forward_batch(torch.tensor([prompt]), kv)[0, -1]]
    for t in forced:
        out.append(model.forward_batch(torch.tensor([[t]]), kv)[0, -1])
    return torch.stack(out).double()


@needs_op
def test_tiny_quantized_model_int8_logits_close(tiny_llama_dir, tmp_path):
    from exl_core.loader import load_model, set_activations
    from exl_core.quantize.rtn import quantize_model_rtn
    dst = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt="gptq", bits=4, group_size=32)
    model, _ = load_model(dst, load_tokenizer=False)
    prompt, forced = [1, 5, 9, 13, 2, 7, 3, 11, 4, 6], [8, 12, 3, 5, 1, 9]
    exact = _decode_logits(model, prompt, forced)
    set_activations(model, "int8")
    got = _decode_logits(model, prompt, forced)
    assert torch.equal(got[0], exact[0])            # 10-row prompt: exact path
    err = float((got[1:] - exact[1:]).norm() / exact[1:].norm())
    assert 0 < err < 0.02, err                      # int8 x rounding: ~2^-8 relative per value


@pytest.mark.slow
@pytest.mark.real_model
@needs_op
def test_smollm2_greedy_decode_with_int8_activations(smollm2_dir, tmp_path):
    from exl_core.loader import load_model, set_activations
    from exl_core.quantize.rtn import quantize_model_rtn
    from exl_core.tokenizer import Tokenizer
    dst = quantize_model_rtn(smollm2_dir, tmp_path / "q", fmt="gptq", bits=4, group_size=128)
    model, _ = load_model(dst, load_tokenizer=False)
    tok = Tokenizer.from_folder(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a long story about a dragon."}],
                                     add_generation_prompt=True, tokenize=True)
    steps = 32
    kv = [model.new_sequence_kv(len(prompt) + steps + 1)]       # exact greedy decode
    logits = model.forward_batch(torch.tensor([prompt]), kv)[0, -1]
    greedy = []
    for _ in range(steps):
        greedy.append(int(logits.argmax()))
        logits = model.forward_batch(torch.tensor([[greedy[-1]]]), kv)[0, -1]
    exact = _decode_logits(model, prompt, greedy[:-1])
    set_activations(model, "int8")
    got = _decode_logits(model, prompt, greedy[:-1])        # teacher-forced on the exact tokens
    assert torch.equal(got[0], exact[0])                     # prompt rows: exact path
    agree = (got.argmax(-1) == exact.argmax(-1)).double().mean().item()
    rel = float((got - exact).norm() / exact.norm())
    print(f"int8 activations: top-1 agreement {agree:.4f} over {steps} steps, rel. logit error {rel:.4g}")
    # Deterministic inputs (RTN weights, fixed prompt, teacher forcing): measured 30/32 steps
    # (0.9375) and 0.0318; the bounds leave two tokens and ~1.5x of margin.  Per-32 int8 rounding
    # of every matmul input is ~0.6% RMS per value, compounding over 30 layers.
    assert agree >= 28 / 32, agree
    assert rel < 0.05, rel


@needs_op
@pytest.mark.parametrize("bits", [(4,), (8,), None])
def test_per_group_zero_bit_identical(bits, rng, isa_cap):
    """One zero point per group ([G], qm.int8_zero: what decode passes where every column of a
    group shares it, as in EXL2 and symmetric GPTQ) gives the very bits of the [G, N] zeros on
    every ISA path and ragged N; non-shared zeros stay [G, N]; the exact kernel refuses [G]."""
    pw = rand_packed(352, 203, rng, bits=bits)
    shared = pw.zero[:, :1].round().expand_as(pw.zero).contiguous()       # one zero per group row
    pw = dataclasses.replace(pw, zero=shared)
    z = qm.int8_zero(pw)
    assert z.shape == (pw.groups.shape[0],) and torch.equal(z, shared[:, 0])
    assert qm.int8_zero(pw) is z                                           # cached
    for M in (1, 3):
        x = torch.randn(M, 352)
        for cap in (2, 1, 0):
            isa_cap(cap)
            want = run_int8(x, pw)
            got = torch.ops.exl_core.qmatmul_int8(x, pw.qweight, pw.groups, pw.scale, z, pw.perm, pw.bias)
            assert torch.equal(got, want), f"ISA cap {cap}, M {M}"
            many = torch.ops.exl_core.qmatmul_int8_multi(x, [pw.qweight], [pw.groups], [pw.scale], [z], pw.perm,
                                                         [pw.bias])
            assert torch.equal(many[0], want)
    with pytest.raises(RuntimeError, match=r"zero must be a contiguous float32 \["):
        torch.ops.exl_core.qmatmul(x, pw.qweight, pw.groups, pw.scale, z, pw.perm, pw.bias)
    with pytest.raises(RuntimeError, match="per-group zero"):
        torch.ops.exl_core.qmatmul_int8(x, pw.qweight, pw.groups, pw.scale, z[:-1].contiguous(), pw.perm, pw.bias)
    pw.zero[0, 5] += 1.0                                                   # in place: no longer shared
    assert qm.int8_zero(pw) is pw.zero
    assert qm.int8_zero(rand_packed(352, 64, rng, bits=bits)).dim() == 2  # random zeros: [G, N]


def to_panels(t: torch.Tensor) -> torch.Tensor:
    """[R, N] -> [N/32, R, 32], the int8 kernel's panel-major form (DecoderStack.set_panel_major)."""
    return t.view(t.shape[0], t.shape[1] // 32, 32).permute(1, 0, 2).contiguous()


@needs_op
@pytest.mark.parametrize("bits", [*[(b,) for b in SUPPORTED_BITS], None])   # None: mixed widths
def test_panel_major_weights_bit_identical(bits, rng, isa_cap):
    """Panel-major words/scales/zeros (one contiguous stream per thread) give the very bits of the
    row-major call on every ISA path, for 1..8 rows, both zero forms, single and multi calls; the
    exact kernel and wrongly shaped panels are refused."""
    pw = rand_packed(352, 224, rng, bits=bits)
    q, s = to_panels(pw.qweight), to_panels(pw.scale)
    zeros = ((pw.zero, to_panels(pw.zero)), (pw.zero[:, 0].contiguous(), pw.zero[:, 0].contiguous()))
    for M in (1, 3, 8):
        x = torch.randn(M, 352)
        for cap in (2, 1, 0):
            isa_cap(cap)
            for z_rm, z_pm in zeros:
                want = torch.ops.exl_core.qmatmul_int8(x, pw.qweight, pw.groups, pw.scale, z_rm, pw.perm, pw.bias)
                got = torch.ops.exl_core.qmatmul_int8(x, q, pw.groups, s, z_pm, pw.perm, pw.bias)
                assert torch.equal(got, want), f"ISA cap {cap}, M {M}, zero {tuple(z_rm.shape)}"
                many = torch.ops.exl_core.qmatmul_int8_multi(x, [q, pw.qweight], [pw.groups] * 2, [s, pw.scale],
                                                             [z_pm, z_rm], pw.perm, [pw.bias] * 2)
                assert torch.equal(many[0], want) and torch.equal(many[1], want)
        assert rel_err(got, reference_int8(x, dataclasses.replace(pw, zero=zeros[1][0][:, None].expand_as(pw.zero)))) < TOL
    with pytest.raises(RuntimeError, match="qweight must be a contiguous int32"):
        torch.ops.exl_core.qmatmul(x, q, pw.groups, s, to_panels(pw.zero), pw.perm, pw.bias)
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float32 \[N/32, G, 32\]"):
        torch.ops.exl_core.qmatmul_int8(x, q, pw.groups, pw.scale, to_panels(pw.zero), pw.perm, pw.bias)
    with pytest.raises(RuntimeError, match=r"panel-major \[N/32, Q, 32\]"):     # 16-column panels
        torch.ops.exl_core.qmatmul_int8(x, q.view(-1, q.shape[1], 16), pw.groups, s, pw.zero[:, 0].contiguous(),
                                        pw.perm, pw.bias)
    with pytest.raises(RuntimeError, match="groups need"):                       # a panel's rows cut short
        torch.ops.exl_core.qmatmul_int8(x, q[:, :-1].contiguous(), pw.groups, s, to_panels(pw.zero), pw.perm,
                                        pw.bias)



def test_fake_kernels_take_panel_major_words():
    """Under FakeTensor (torch.compile tracing) the int8 ops give [M, N] for panel-major words too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    qm._register_fake()
    with FakeTensorMode():
        x, g = torch.empty(3, 64), torch.empty(2, 4, dtype=torch.int32)
        q, s = torch.empty(4, 8, 32, dtype=torch.int32), torch.empty(4, 2, 32)
        assert torch.ops.exl_core.qmatmul_int8(x, q, g, s, s, None, None).shape == (3, 128)
        ys = torch.ops.exl_core.qmatmul_int8_multi(x, [q, torch.empty(8, 96, dtype=torch.int32)], [g, g], [s, s],
                                                   [s, s], None, [None, None])
        assert [tuple(y.shape) for y in ys] == [(3, 128), (3, 96)]
