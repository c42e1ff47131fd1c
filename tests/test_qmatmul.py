"""exl_core::qmatmul (CPU kernel) and exl_core.ops.qmatmul against the float64 specification
`dequantize_reference`, on fresh random packed weights (random bits per group, random group
sizes, random input permutation), plus batch invariance and the dispatcher."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from exl_core.errors import InputError, KernelError
from exl_core.formats.packed import PackedWeight, SUPPORTED_BITS, dequantize_reference, pack_bitstream
from exl_core.ops import qmatmul as qm
from exl_core.ops.dispatch import has_op

needs_op = pytest.mark.skipif(not has_op("qmatmul"), reason="exl_core._C not built with the qmatmul kernel")


def rand_packed(K: int, N: int, rng: random.Random, bits=None, perm=True, bias=True,
                group_size=None) -> PackedWeight:
    """Random PackedWeight: each group gets a random width from `bits` and a random length
    (multiple of 32) unless group_size is given; asymmetric zero points."""
    bits = SUPPORTED_BITS if bits is None else tuple(bits)
    rows, q_parts, k, q = [], [], 0, 0
    while k < K:
        k_len = min(group_size or 32 * rng.randint(1, 4), K - k)
        b = rng.choice(bits)
        vals = torch.randint(0, 2 ** b, (k_len, N))
        q_parts.append(pack_bitstream(vals, b))
        rows.append((b, k, k_len, q))
        k += k_len
        q += k_len * b // 32
    G = len(rows)
    maxq = torch.tensor([2 ** r[0] - 1 for r in rows], dtype=torch.float32).unsqueeze(1)
    return PackedWeight(
        qweight=torch.cat(q_parts), groups=torch.tensor(rows, dtype=torch.int32),
        scale=torch.rand(G, N) * 0.05 + 1e-3,
        zero=torch.rand(G, N) * maxq,                          # fractional zeros are allowed
        perm=torch.randperm(K) if perm else None, in_features=K, out_features=N,
        bias=torch.randn(N) if bias else None).validate("test weight")


def check_multi_equals_single(multi_op, run_single, M: int, rng: random.Random) -> None:
    """A *_multi quantized matmul op equals one call per weight, and row i of a call does not depend
    on the other rows (shared by the int8- and bf16-activation tests)."""
    import dataclasses
    K = 256
    perm = torch.randperm(K)
    pws = [dataclasses.replace(rand_packed(K, n, rng), perm=perm) for n in (96, 32, 160)]
    x = torch.randn(M, K)
    ys = multi_op(x, [p.qweight for p in pws], [p.groups for p in pws], [p.scale for p in pws],
                  [p.zero for p in pws], perm, [p.bias for p in pws])
    for pw, y in zip(pws, ys):
        assert torch.equal(y, run_single(x, pw))
        for i in (0, M // 2, M - 1):
            assert torch.equal(y[i], run_single(x[i:i + 1], pw)[0])


def reference(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    y = x.double() @ dequantize_reference(pw, torch.float64)
    return y if pw.bias is None else y + pw.bias.double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def run_op(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    # Poison the allocator's free list with NaN so an unwritten output element shows up.
    poison = torch.full((x.shape[0], pw.out_features), float("nan"), dtype=x.dtype)
    del poison
    return torch.ops.exl_core.qmatmul(x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm, pw.bias)




@needs_op
@pytest.mark.parametrize("M", [1, 3, 8, 37, 512])
@pytest.mark.parametrize("perm,bias", [(True, True), (False, False)])
def test_fp32_mixed_bits_576x1536(M, perm, bias, rng):
    pw = rand_packed(576, 1536, rng, perm=perm, bias=bias)
    x = torch.randn(M, 576)
    y = run_op(x, pw)
    assert y.dtype == torch.float32 and y.shape == (M, 1536)
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(x, pw)) < 1e-3


@needs_op
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("M", [1, 5, 40])
def test_each_bit_width(bits, M, rng):
    pw = rand_packed(256, 160, rng, bits=(bits,), group_size=rng.choice([32, 64, 128]))
    x = torch.randn(M, 256)
    y = run_op(x, pw)
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(x, pw)) < 1e-3


@needs_op
@pytest.mark.parametrize("N", [1, 13, 37, 95])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 13, 26])   # 3-4: the fused path's narrower blocks and tails
def test_odd_shapes(N, M, rng):
    pw = rand_packed(96, N, rng)
    x = torch.randn(M, 96)
    y = run_op(x, pw)
    assert y.shape == (M, N) and torch.isfinite(y).all()
    assert rel_err(y, reference(x, pw)) < 1e-3


@needs_op
@pytest.mark.parametrize("M", [1, 9, 64])
def test_bf16_input(M, rng):
    pw = rand_packed(192, 96, rng)
    x = torch.randn(M, 192).to(torch.bfloat16)
    y = run_op(x, pw)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    ref = reference(x, pw)
    assert rel_err(y, ref) < 1e-2                    # bf16 output rounding (2^-8)
    # exactly the fp32 result rounded to bf16 (batch invariance carries over)
    assert torch.equal(y, run_op(x.float(), pw).to(torch.bfloat16))


@needs_op
def test_zero_rows_and_bias_only():
    rng = random.Random(0)
    pw = rand_packed(64, 20, rng)
    assert run_op(torch.randn(0, 64), pw).shape == (0, 20)


@needs_op
def test_batch_invariance(rng):
    """Row i is bit-identical whatever M is, where the row sits, and how many threads run."""
    K, N = 576, 1536
    pw = rand_packed(K, N, rng)
    x = torch.randn(512, K)
    full = run_op(x, pw)
    for M in (1, 2, 3, 4, 7, 64, 512):      # 1-4: the fused path's row blocks (fewer column vectors from 3 on AVX2)
        for start in {0, rng.randrange(0, 512 - M + 1)}:
            assert torch.equal(run_op(x[start:start + M].contiguous(), pw), full[start:start + M]), (M, start)
    order = torch.randperm(512)
    assert torch.equal(run_op(x[order].contiguous(), pw), full[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run_op(x[:37].contiguous(), pw), full[:37])
    finally:
        torch.set_num_threads(threads)


@needs_op
@pytest.mark.parametrize("M", [1, 3, 4, 5, 30])     # 3-4: AVX2's narrower small-M blocks (simd.h fused_nv)
def test_isa_paths_bit_identical(M, rng, isa_cap):
    """AVX-512, AVX2 and scalar paths run the same arithmetic: results are bit-identical."""
    pw = rand_packed(160, 70, rng)
    x = torch.randn(M, 160)
    outs = []
    for level in (2, 1, 0):
        isa_cap(level)
        outs.append(run_op(x, pw))
    assert rel_err(outs[0], reference(x, pw)) < 1e-3
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_op
def test_bad_arguments_are_named():
    rng = random.Random(1)
    pw = rand_packed(64, 16, rng)
    op = torch.ops.exl_core.qmatmul
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="K = 96"):
        op(torch.randn(2, 96), pw.qweight, pw.groups, pw.scale, pw.zero, None, None)
    with pytest.raises(RuntimeError, match="scale must be"):
        op(x, pw.qweight, pw.groups, pw.scale.double(), pw.zero, None, None)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        op(torch.randn(64, 2).t(), pw.qweight, pw.groups, pw.scale, pw.zero, None, None)
    bad = pw.groups.clone()
    bad[0, 0] = 7
    with pytest.raises(RuntimeError, match="bit width 7"):
        op(x, pw.qweight, bad, pw.scale, pw.zero, None, None)
    with pytest.raises(RuntimeError, match="qweight"):
        op(x, pw.qweight[:-1].contiguous(), pw.groups, pw.scale, pw.zero, None, None)
    with pytest.raises(RuntimeError, match="perm"):
        op(x, pw.qweight, pw.groups, pw.scale, pw.zero, torch.arange(63), None)
    with pytest.raises(InputError, match="in_features=64"):
        qm.qmatmul(torch.randn(3, 65), pw)


@needs_op
def test_opcheck(rng):
    pw = rand_packed(128, 48, rng)
    for x in (torch.randn(3, 128), torch.randn(1, 128).to(torch.bfloat16)):
        torch.library.opcheck(torch.ops.exl_core.qmatmul.default,
                              (x, pw.qweight, pw.groups, pw.scale, pw.zero, pw.perm, pw.bias))


# ---------------------------------------------------------------------------- several weights

needs_multi = pytest.mark.skipif(not has_op("qmatmul_multi"), reason="exl_core._C built without qmatmul_multi")


def run_multi(x, pws, perm):
    return torch.ops.exl_core.qmatmul_multi(x, [p.qweight for p in pws], [p.groups for p in pws],
                                            [p.scale for p in pws], [p.zero for p in pws], perm,
                                            [p.bias for p in pws])


@needs_multi
@pytest.mark.parametrize("M", [1, 3, 9])
def test_multi_equals_single_calls(M, rng):
    """One call over several weights (q/k/v style, shared permutation) gives each weight's own
    qmatmul bits, whose values match the float64 specification."""
    K = 192
    perm = torch.randperm(K)
    pws = [dataclasses.replace(rand_packed(K, n, rng, perm=False, bias=b), perm=perm)
           for n, b in ((96, True), (33, False), (160, True))]
    x = torch.randn(M, K)
    ys = run_multi(x, pws, perm)
    for y, pw in zip(ys, pws):
        assert torch.equal(y, run_op(x, pw))
        assert rel_err(y, reference(x, pw)) < 1e-3
    assert qm.DISPATCH_MANY.select(x=x, pws=pws).name == "cpu_fused_multi"
    for y, ref in zip(qm.qmatmul_many(x.unsqueeze(0), pws), ys):
        assert torch.equal(y[0], ref)
    # a different permutation: the Python face falls back to one call each, saying why
    other = [pws[0], dataclasses.replace(pws[1], perm=torch.randperm(K))]
    assert "permutation" in dict(qm.DISPATCH_MANY.reasons(x=x, pws=other))["cpu_fused_multi"]
    for y, pw in zip(qm.qmatmul_many(x, other), other):
        assert torch.equal(y, run_op(x, pw))


@needs_multi
def test_multi_bad_arguments_are_named(rng):
    pws = [rand_packed(64, 16, rng, perm=False), rand_packed(96, 16, rng, perm=False)]
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="groups cover 96 rows"):
        run_multi(x, pws, None)
    with pytest.raises(RuntimeError, match="equal, non-zero length"):
        torch.ops.exl_core.qmatmul_multi(x, [pws[0].qweight], [], [pws[0].scale], [pws[0].zero], None, [None])
    with pytest.raises(InputError, match="weight 1 has in_features=96"):
        qm.qmatmul_many(x, pws)


@needs_multi
def test_multi_opcheck(rng):
    pws = [rand_packed(128, n, rng, perm=False) for n in (48, 20)]
    torch.library.opcheck(torch.ops.exl_core.qmatmul_multi.default,
                          (torch.randn(3, 128), [p.qweight for p in pws], [p.groups for p in pws],
                           [p.scale for p in pws], [p.zero for p in pws], None, [p.bias for p in pws]))


# ---------------------------------------------------------------------------- Python face


def test_torch_ref_matches_spec(rng):
    pw = rand_packed(160, 45, rng)
    x = torch.randn(2, 3, 160)
    cand = qm.DISPATCH.candidates[[c.name for c in qm.DISPATCH.candidates].index("torch_ref")]
    y = cand.run(x=x, pw=pw)
    assert y.shape == (2, 3, 45)
    assert rel_err(y.reshape(6, 45), reference(x.reshape(6, 160), pw)) < 1e-3
    assert torch.allclose(qm.dequantize(pw, torch.float64), dequantize_reference(pw), rtol=0, atol=1e-12)


@needs_op
def test_dispatch_picks_cpu_kernel_and_explains(rng):
    pw = rand_packed(96, 33, rng)
    x = torch.randn(4, 2, 96)
    assert qm.DISPATCH.select(x=x, pw=pw).name == "cpu_fused"
    y = qm.qmatmul(x, pw)
    assert torch.equal(y.reshape(8, 33), run_op(x.reshape(8, 96), pw))
    # fp16 goes through the kernel via an exact fp32 copy: same bits as fp32 input, rounded
    yh = qm.qmatmul(x.half(), pw)
    assert yh.dtype == torch.float16
    assert torch.equal(yh, run_op(x.half().float().reshape(8, 96), pw).half().reshape(4, 2, 33))
    # float64 is not served by the CPU kernel: the reference takes it, with a reason recorded
    reasons = dict(qm.DISPATCH.reasons(x=x.double(), pw=pw))
    assert "float64" in reasons["cpu_fused"] and reasons["torch_ref"] is None
    assert "CUDA" in reasons["cuda"] or "cuda" in reasons["cuda"]
    yd = qm.qmatmul(x.double(), pw)
    assert yd.dtype == torch.float64 and rel_err(yd.reshape(8, 33), reference(x.reshape(8, 96), pw)) < 1e-3
    with pytest.raises(KernelError, match="torch_ref"):
        qm.DISPATCH(x=torch.zeros(1, 96, dtype=torch.int64), pw=pw)


@pytest.mark.cuda
def test_torch_ref_on_cuda(rng):
    pw = rand_packed(128, 64, rng)
    x = torch.randn(3, 128)
    y = qm.qmatmul(x.cuda(), pw.to("cuda"))
    assert rel_err(y.cpu(), reference(x, pw)) < 1e-3


def test_loaded_act_order_projections_take_the_one_call_path():
    """Converter output: q/k/v (gate/up) share one permutation tensor after loading, so
    qmatmul_many serves them with the multi-weight kernel instead of one call each."""
    from pathlib import Path
    from exl_core.loader import load_model
    folder = Path(__file__).parent / "data" / "exllamav2" / "ours_exl2"
    model, _ = load_model(folder, load_tokenizer=False)
    a, m = model.layers[0].self_attn, model.layers[0].mlp
    pws = [layer.packed for layer in (a.q_proj, a.k_proj, a.v_proj)]
    assert pws[0].perm is not None and all(pw.perm is pws[0].perm for pw in pws)
    assert m.gate_proj.packed.perm is m.up_proj.packed.perm
    x = torch.randn(2, pws[0].in_features)
    chosen = qm.DISPATCH_MANY.select(x=x, pws=pws)
    assert chosen.name == "cpu_fused_multi"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5])
def test_qmatmul_silu_is_silu_mul_then_qmatmul(dtype, M, rng):
    """The MLP's down projection op (fused on CUDA's decode kernel): against float64 (the product rounded to the
    input dtype, as HF's act_fn(gate) * up), the same values as the two steps here, and mismatched inputs named."""
    from exl_core.ops.activation import silu_mul
    pw = rand_packed(160, 24, rng)
    gate, up = torch.randn(M, 160).to(dtype), torch.randn(M, 160).to(dtype)
    y = qm.qmatmul_silu(gate, up, pw)
    act = (torch.nn.functional.silu(gate.double()).to(dtype).double() * up.double()).to(dtype)
    assert y.dtype == dtype and y.shape == (M, 24)
    assert rel_err(y, reference(act, pw)) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(y, qm.qmatmul(silu_mul(gate, up), pw))
    with pytest.raises(InputError, match="same shape"):
        qm.qmatmul_silu(gate, up[:, :96], pw)
    with pytest.raises(InputError, match="in_features=160"):
        qm.qmatmul_silu(gate[:, :96], up[:, :96], pw)


def test_add_into_residual_refused_off_cuda(rng):
    """qmatmul_add_ is only taken on CUDA's prompt path: on the CPU it says no and leaves the residual alone (the
    model then adds through the RMSNorm that follows, as before)."""
    pw = rand_packed(96, 64, rng)
    x, res = torch.randn(40, 96), torch.randn(40, 64)
    before = res.clone()
    assert not qm.adds_in_place(res, x, pw)
    assert not qm.qmatmul_add_(res, x, pw) and torch.equal(res, before)
