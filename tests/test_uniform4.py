"""exl_core.formats.uniform4: mixed-width weights rewritten as uniform 4-bit rows, checked exactly against the
float64 specification (dequantize_reference) and the torch dequantiser."""
import dataclasses
import random

import pytest
import torch

from exl_core.errors import FormatError
from exl_core.formats.packed import PackedWeight, dequantize_reference, pack_bitstream
from exl_core.formats.uniform4 import as_uniform4, growth
from exl_core.ops.qmatmul import dequantize


def mixed(K, N, bits_of_group, seed, zeros="exl2", perm=True, group=64):
    """A PackedWeight with one width per group of `group` rows; EXL2 zeros 2^(b-1) or random integer zeros."""
    g = torch.Generator().manual_seed(seed)
    rows, parts, q = [], [], 0
    for i, k in enumerate(range(0, K, group)):
        b = bits_of_group[i % len(bits_of_group)]
        parts.append(pack_bitstream(torch.randint(0, 2 ** b, (group, N), generator=g), b))
        rows.append((b, k, group, q))
        q += group * b // 32
    G = len(rows)
    if zeros == "exl2":
        zero = torch.tensor([[2.0 ** (r[0] - 1)] for r in rows]).expand(G, N).contiguous()
    else:
        zero = torch.stack([torch.randint(0, 2 ** r[0], (N,), generator=g).float() for r in rows])
    return PackedWeight(torch.cat(parts), torch.tensor(rows, dtype=torch.int32),
                        torch.rand(G, N, generator=g) * 0.05 + 1e-3, zero,
                        torch.randperm(K, generator=g) if perm else None, K, N,
                        torch.randn(N, generator=g)).validate("mixed")


@pytest.mark.parametrize("widths", [(5, 4, 4, 4, 3), (2, 3, 4, 5, 6, 8), (8,), (6, 4)])
@pytest.mark.parametrize("zeros", ["exl2", "int"])
@pytest.mark.parametrize("perm", [True, False])
def test_exact_against_the_specification(widths, zeros, perm):
    pw = mixed(384, 40, widths, seed=len(widths), zeros=zeros, perm=perm)
    u = as_uniform4(pw, max_growth=10.0)
    assert u is not None
    assert set(u.groups[:, 0].tolist()) == {4}
    extra = sum(64 for i in range(384 // 64) if widths[i % len(widths)] > 4)
    assert u.rows == 384 + extra and u.in_features == 384 and u.perm.numel() == u.rows
    assert torch.equal(dequantize_reference(u), dequantize_reference(pw))      # float64: every value exact
    assert torch.equal(dequantize(u, torch.float64), dequantize(pw, torch.float64))
    # the kernels' view: x gathered by the (repeating) permutation times W_perm
    x = torch.randn(3, 384, dtype=torch.float64)
    w_perm = dequantize_reference(dataclasses.replace(u, perm=None, rows=None, in_features=u.rows))
    torch.testing.assert_close(x[:, u.perm] @ w_perm, x @ dequantize_reference(pw), rtol=1e-12, atol=1e-12)


def test_main_rows_stay_in_the_4bit_range():
    """A split group's row keeps r - 8 in [-8, 7] (as a 4-bit weight's), its extra row the rest."""
    pw = mixed(128, 8, (5,), seed=3, perm=False)
    u = as_uniform4(pw, max_growth=10.0)
    assert torch.equal(u.zero[:2], torch.full((2, 8), 8.0))
    assert torch.equal(u.scale[2:], pw.scale * 16) and torch.equal(u.zero[2:], torch.full((2, 8), 0.5))


def test_growth_and_what_is_left_alone():
    bench = mixed(704, 16, (5, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3), seed=1)    # the H200 bench's mix: 1/11 at 5 and 3 bits
    assert growth(bench) == pytest.approx(12 / 11)
    assert as_uniform4(bench) is not None                                 # 1.0909 <= 1.15
    assert as_uniform4(mixed(256, 16, (2,), seed=2)) is None              # 2-bit rows double
    assert as_uniform4(mixed(256, 16, (4,), seed=2)) is None              # already uniform 4-bit
    u = as_uniform4(bench)
    assert as_uniform4(u) is None                                         # not twice


@pytest.mark.parametrize("perm", [True, False])
def test_widths_up_to_4_keep_their_rows(perm):
    """3- and 4-bit groups only: no extra rows, the same permutation (the GPU's other 4-bit kernels stay open)."""
    pw = mixed(256, 24, (3, 4), seed=6, perm=perm)
    u = as_uniform4(pw, max_growth=10.0)
    assert u.rows is None and u.perm is pw.perm and set(u.groups[:, 0].tolist()) == {4}
    assert torch.equal(dequantize_reference(u), dequantize_reference(pw))


def test_fractional_zero_that_would_round_is_declined():
    pw = mixed(128, 8, (5,), seed=4, perm=False)
    assert as_uniform4(dataclasses.replace(pw, zero=pw.zero + 1e-6), max_growth=10.0) is not None  # 16 + 1e-6: exact
    assert as_uniform4(dataclasses.replace(pw, zero=torch.full_like(pw.zero, 0.3)), max_growth=10.0) is None


def test_validate_checks_the_extra_rows():
    u = as_uniform4(mixed(128, 8, (5, 4), seed=5), max_growth=10.0)
    with pytest.raises(FormatError, match="needs a permutation"):
        dataclasses.replace(u, perm=None).validate("w")
    bad = u.perm.clone()
    bad[-1] = 128
    with pytest.raises(FormatError, match=r"perm values must lie in \[0, 128\)"):
        dataclasses.replace(u, perm=bad).validate("w")
    twice = u.perm.clone()
    twice[1] = twice[0]                                 # a main row reading another main row's input
    with pytest.raises(FormatError, match="must read every input once"):
        dataclasses.replace(u, perm=twice).validate("w")
    assert u.to("cpu").rows == u.rows


def test_model_rewritten_computes_the_same(tiny_model_factory, tmp_path):
    """A tiny EXL2 model of mixed widths (2..8 bits, act-order): its projections rewritten as uniform 4-bit rows
    give the same logits (on the CPU they run the torch reference: the CPU kernels refuse extra rows)."""
    from exl_core.loader import as_uniform4_weights, load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    src = tiny_model_factory("llama", seed=3, hidden_size=128, intermediate_size=192)
    dst = tmp_path / "q_exl2"
    quantize_model_rtn(src, dst, fmt="exl2", bits=[(8, .1), (6, .1), (5, .2), (4, .2), (3, .4)], group_size=32,
                       act_order=True)
    model, _ = load_model(dst, load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    before = model.forward_batch(ids)
    widths = {int(b) for _, m in model.linear_layers() if m.is_quantized for b in m.packed.groups[:, 0]}
    assert widths - {4}, "the tiny model should have other widths than 4"
    n = as_uniform4_weights(model, max_growth=10.0)
    assert n > 0
    rows = [m.packed for _, m in model.linear_layers() if m.is_quantized and m.packed.rows is not None]
    assert len(rows) == n and all(set(p.groups[:, 0].tolist()) == {4} for p in rows)
    for block in model.layers:                                          # padded: one launch per group on the GPU
        for group in ((block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj),
                      (block.mlp.gate_proj, block.mlp.up_proj)):
            assert len({layer.packed.k_rows for layer in group}) == 1
    after = model.forward_batch(ids)
    assert (after - before).abs().max().item() < 1e-3


def test_lora_merge_requantizes_a_rewritten_weight_in_its_file_layout():
    """A merge (lora_requant.requantize_like) into a weight rewritten as uniform 4-bit rows quantizes in the file's
    own groups, widths and order (kept in the rewrite's meta), then rewrites again: the same values as re-quantizing
    the original weight."""
    import dataclasses

    from exl_core.model.lora_requant import requantize_like
    pw = mixed(128, 8, (5, 4), seed=7)
    pw = dataclasses.replace(pw, meta=dict(pw.meta, format="exl2"))
    u = as_uniform4(pw, max_growth=10.0)
    w = dequantize_reference(pw).float() + 0.01 * torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    again = requantize_like(u, w, "q_proj")
    ref = requantize_like(pw, w, "q_proj")
    assert again.rows is not None and torch.equal(again.perm[:128], pw.perm)
    assert torch.equal(dequantize_reference(again), dequantize_reference(ref))
    from exl_core.formats.uniform4 import pad_rows
    padded = requantize_like(pad_rows(u, u.rows + 32), w, "q_proj")      # padded to its group's rows: kept so
    assert padded.rows == u.rows + 32 and torch.equal(dequantize_reference(padded), dequantize_reference(ref))


def test_pad_rows_adds_nothing():
    from exl_core.formats.uniform4 import pad_rows
    u = as_uniform4(mixed(128, 8, (5, 4), seed=8), max_growth=10.0)
    p = pad_rows(u, u.rows + 64)
    assert p.rows == u.rows + 64 and p.perm.numel() == p.rows
    assert torch.equal(dequantize_reference(p), dequantize_reference(u))
    with pytest.raises(ValueError):
        pad_rows(u, u.rows + 16)


def test_twin_groups_name_each_main_groups_high_halves():
    """formats.uniform4.twin_groups: main group g's twin holds q >> 4 of its rows and reads the same x columns (so a
    kernel may add 16 x the twin's values into g's own: r + 16 h = q); None where groups differ in size or no group
    has more than 4 bits."""
    from exl_core.formats.bitpack import unpack_stream
    from exl_core.formats.uniform4 import as_uniform4, twin_groups
    from test_cuda_kernels import random_packed
    layout = [(5, 128), (4, 128), (8, 128), (3, 128), (6, 128)]
    pw = random_packed(layout, 64, perm=True, seed=3)
    u = as_uniform4(pw, max_growth=10.0)
    twins, k_main = twin_groups(u)
    assert k_main == pw.in_features and [t >= 0 for t in twins] == [b > 4 for b, _ in layout]
    assert sorted(t for t in twins if t >= 0) == list(range(len(layout), len(layout) + 3))
    q4 = unpack_stream(u.qweight, 4, u.rows)
    for g, (bits, _k) in enumerate(layout):
        q = unpack_stream(pw.qweight[sum(128 * b // 32 for b, _ in layout[:g]):][:128 * bits // 32], bits, 128)
        r = q4[128 * g:128 * (g + 1)]
        if twins[g] < 0:
            assert torch.equal(r, q)
            continue
        t = twins[g]
        assert torch.equal(r + 16 * q4[128 * t:128 * (t + 1)], q)
        assert torch.equal(u.perm[128 * t:128 * (t + 1)], u.perm[128 * g:128 * (g + 1)])
    assert twin_groups(as_uniform4(random_packed([(5, 64), (4, 128)], 64, seed=4), max_growth=10.0)) is None
    assert twin_groups(as_uniform4(random_packed([(3, 128), (4, 128)], 64, seed=5), max_growth=10.0)) is None
