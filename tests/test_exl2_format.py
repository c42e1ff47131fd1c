"""EXL2 layer format: ExLlamaV2 bit layout, round trips, float64 references, RTN bound, errors."""
from __future__ import annotations

import pytest
import torch

from exl_core.errors import FormatError
from exl_core.formats import exl2
from exl_core.formats.base import detect_format, get_format
from exl_core.formats.packed import dequantize_reference as packed_dequant
from exl_core.formats.packed import unpack_bitstream

BITS = (2, 3, 4, 5, 6, 8)
# values per block and 32-bit words per block in ExLlamaV2's pack_columns_kernel (pack_tensor.cu)
EXL2_BLOCKS = {2: (16, 1), 3: (32, 3), 4: (8, 1), 5: (32, 5), 6: (16, 3), 8: (4, 1)}


def exllamav2_pack_columns(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Scalar re-statement of ExLlamaV2's pack_columns_kernel: for each block of values and each
    output word w of the block, word |= wshift(x_i, bits*i - 32*w), where a negative shift is a
    right shift and |shift| >= 32 gives 0. Deliberately written per word (not as a bit stream)."""
    def wshift(x, j):
        if j <= -32 or j >= 32:
            return 0
        return (x >> -j) if j < 0 else (x << j) & 0xFFFFFFFF
    vals, words = EXL2_BLOCKS[bits]
    k, n = q.shape
    out = []
    for r0 in range(0, k, vals):
        for w in range(words):
            row = []
            for c in range(n):
                packed = 0
                for i in range(vals):
                    packed |= wshift(int(q[r0 + i, c]), bits * i - 32 * w)
                row.append(packed - (1 << 32) if packed >= 1 << 31 else packed)
            out.append(row)
    return torch.tensor(out, dtype=torch.int32)


def random_layer(K, N, segments, group_size, with_perm=True, seed=None):
    """Random quantized content: (q [K, N] permuted order, codes [G, N], smax [G], groups, perm)."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    groups = []
    for bits, rows in segments:
        done = 0
        while done < rows:
            r = min(group_size, rows - done)
            groups.append((bits, r))
            done += r
    q = torch.cat([torch.randint(0, 2 ** b, (r, N), generator=g) for b, r in groups])
    codes = torch.randint(1, 17, (len(groups), N), generator=g)
    smax = (torch.rand(len(groups), generator=g) * 0.05 + 1e-3).half().double()
    perm = torch.randperm(K, generator=g) if with_perm else None
    return q, codes, smax, groups, perm


def expected_weight(q, codes, smax, groups, perm):
    """float64 W [K, N] straight from the definition, without any file tensor."""
    rows = []
    for gi, (bits, r) in enumerate(groups):
        start = sum(x for _, x in groups[:gi])
        scale = codes[gi].double() ** 2 * smax[gi] / 256
        rows.append((q[start:start + r].double() - 2 ** (bits - 1)) * scale)
    w_perm = torch.cat(rows)
    if perm is None:
        return w_perm
    w = torch.empty_like(w_perm)
    w[perm] = w_perm
    return w


# ---- the bit layout ExLlamaV2 writes ------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
def test_q_weight_matches_exllamav2_pack_columns(bits):
    K, N = 64, 5
    q = torch.randint(0, 2 ** bits, (K, N))
    t = exl2.pack_layer(q, torch.randint(1, 17, (1, N)), torch.tensor([0.01]), [(bits, K)])
    assert torch.equal(t["q_weight"][:, :N], exllamav2_pack_columns(q, bits))


def test_hand_built_words():
    # 4-bit: ExLlamaV2 packs value i of an 8-value block at bits 4i (pack_columns<4>), so
    # values 0..7 give 0x76543210.
    q = torch.arange(8).repeat(4).view(32, 1).repeat(1, 32)
    t = exl2.pack_layer(q, torch.arange(1, 33).remainder(16).add(1).view(1, 32),
                        torch.tensor([0.5]), [(4, 32)])
    assert int(t["q_weight"][0, 0]) == 0x76543210
    # 3-bit, from the comment in ExLlamaV2's qdq_3.cuh ("qa: aa999888 ... 22111000"):
    # value 10 puts its low 2 bits at bits 30..31 of word 0 and its top bit at bit 0 of word 1.
    q3 = torch.zeros(32, 32, dtype=torch.int64)
    q3[10, 0] = 0b101
    t3 = exl2.pack_layer(q3, torch.ones(1, 32, dtype=torch.int64), torch.tensor([0.5]), [(3, 32)])
    assert int(t3["q_weight"][0, 0]) & 0xFFFFFFFF == 0b01 << 30
    assert int(t3["q_weight"][1, 0]) == 0b1
    # q_scale: pack_rows_4 stores code-1, column 8w+t at bits 4t: codes 1..8 -> 0x76543210
    codes = torch.arange(1, 9).repeat(4).view(1, 32)
    t4 = exl2.pack_layer(torch.zeros(32, 32, dtype=torch.int64), codes, torch.tensor([0.5]), [(4, 32)])
    assert int(t4["q_scale"][0, 0]) == 0x76543210


def test_q_groups_and_group_map_follow_exllamav2():
    K, N = 256, 32
    q, codes, smax, groups, perm = random_layer(K, N, [(8, 32), (6, 64), (4, 128), (2, 32)], 64)
    t = exl2.pack_layer(q, codes, smax, groups, perm)
    qg = t["q_groups"].tolist()
    assert t["q_groups"].dtype == torch.int16 and len(qg) == 2 * len(groups)
    # ExLlamaV2 (ext.py make_group_map_py): rows of group i = (qrow[i+1]-qrow[i])*32/bits, the last
    # group takes what is left of q_weight.
    n_q = t["q_weight"].shape[0]
    for i, (bits, rows) in enumerate(groups):
        assert qg[2 * i] == bits
        q_end = qg[2 * i + 3] if i + 1 < len(groups) else n_q
        assert (q_end - qg[2 * i + 1]) * 32 // bits == rows
    assert torch.equal(torch.argsort(t["q_invperm"].long()), perm)


def test_padding_to_32_columns_like_exllamav2():
    K, N = 64, 40                                                  # N % 32 != 0 -> padded to 64
    q, codes, smax, groups, perm = random_layer(K, N, [(4, K)], 32)
    t = exl2.pack_layer(q, codes, smax, groups, perm)
    assert t["q_weight"].shape == (K * 4 // 32, 64) and t["q_scale"].shape == (2, 8)
    w = exl2.dequantize_reference(t)
    assert torch.all(w[:, N:] == 0)                                # padding decodes to zero weight
    pw = exl2.read_layer(t, K, N)
    assert pw.qweight.shape[1] == N
    assert torch.equal(packed_dequant(pw), exl2.dequantize_reference(t, out_features=N))


# ---- round trips and references -----------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("with_perm", [False, True])
def test_round_trip_uniform(bits, group_size, with_perm):
    K, N = 256, 64
    q, codes, smax, groups, perm = random_layer(K, N, [(bits, K)], group_size, with_perm)
    t = exl2.pack_layer(q, codes, smax, groups, perm)
    got_q, _, scale, invperm = exl2.reference_parts(t)
    assert torch.equal(got_q, q)
    assert torch.equal(exl2.decode_scale_codes(t["q_scale"], N) + 1, codes)
    want = expected_weight(q, codes, smax, groups, perm)
    ref = exl2.dequantize_reference(t)
    assert torch.equal(ref, want)
    pw = exl2.read_layer(t, K, N)
    for gi, (b, k0, kl, q0) in enumerate(pw.groups.tolist()):
        assert torch.equal(unpack_bitstream(pw.qweight[q0:q0 + kl * b // 32], b, kl), q[k0:k0 + kl])
    assert (pw.perm is None) == (not with_perm)
    assert torch.equal(packed_dequant(pw), ref)


@pytest.mark.parametrize("segments", [
    [(8, 32), (6, 64), (5, 32), (4, 64), (3, 32), (2, 32)],
    [(6, 96), (5, 160)],
    [(4, 32), (3, 224)],
])
def test_round_trip_mixed_widths(segments):
    K, N = 256, 96
    q, codes, smax, groups, perm = random_layer(K, N, segments, 64)
    t = exl2.pack_layer(q, codes, smax, groups, perm, bias=torch.randn(N))
    ref = exl2.dequantize_reference(t)
    assert torch.equal(ref, expected_weight(q, codes, smax, groups, perm))
    pw = exl2.read_layer(t, K, N)
    assert torch.equal(packed_dequant(pw), ref)
    assert torch.equal(pw.bias, t["bias"])
    assert pw.meta["format"] == "exl2" and pw.meta["bits"] == sorted({b for b, _ in segments}, reverse=True)


def test_old_files_with_stored_q_perm_load():
    K, N = 64, 32
    q, codes, smax, groups, perm = random_layer(K, N, [(4, K)], 32)
    t = exl2.pack_layer(q, codes, smax, groups, perm)
    t["q_perm"] = perm.to(torch.int32)
    assert torch.equal(packed_dequant(exl2.read_layer(t, K, N)), exl2.dequantize_reference(t))


# ---- RTN ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [[(8, 32), (6, 32), (5, 64), (4, 64), (3, 32), (2, 32)], 2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_rtn_error_bounded_by_half_scale(bits, group_size):
    K, N = 256, 72
    W = torch.randn(K, N, dtype=torch.float64) * torch.rand(1, N, dtype=torch.float64)
    perm = torch.randperm(K)
    t = exl2.quantize_rtn(W, bits, group_size, perm=perm)
    _, _, scale_perm, invperm = exl2.reference_parts(t)
    scale = scale_perm[invperm][:, :N]                             # per element, original rows
    deq = exl2.dequantize_reference(t, out_features=N)
    assert torch.all((W - deq).abs() <= scale / 2 * (1 + 1e-9))
    assert torch.equal(packed_dequant(exl2.read_layer(t, K, N)), deq)


def test_rtn_more_bits_less_error():
    W = torch.randn(128, 64, dtype=torch.float64)
    errs = [(exl2.dequantize_reference(exl2.quantize_rtn(W, b, 32)) - W).pow(2).mean().item() for b in BITS]
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert errs[-1] < 1e-4 * W.pow(2).mean().item()


def test_segments_from_proportions_follow_exllamav2_qparams():
    # QParams([32, 128], [8, 4], [0.05, 0.95]) on 576 rows: ceil(28.8/32)=1 group of 8-bit,
    # the 4-bit part takes the remaining 544 rows (4 full groups + a clipped one).
    assert exl2.segments_from_proportions(576, [(8, 0.05), (4, 0.95)], {8: 32, 4: 128}) == [(8, 32), (4, 544)]
    assert exl2.segments_from_proportions(1536, [(6, 0.1), (5, 0.9)], 32) == [(6, 160), (5, 1376)]


# ---- bad input ------------------------------------------------------------------------------------

def _good(K=64, N=32):
    q, codes, smax, groups, perm = random_layer(K, N, [(6, 32), (4, 32)], 32)
    return exl2.pack_layer(q, codes, smax, groups, perm)


@pytest.mark.parametrize("mutate, tensor, text", [
    (lambda t: t.__setitem__("q_weight", t["q_weight"].long()), "q_weight", "expected int32"),
    (lambda t: t.__setitem__("q_weight", t["q_weight"][:-1]), "q_weight", "last group"),
    (lambda t: t.__setitem__("q_scale", t["q_scale"][:, :3]), "q_scale", "expected int32 [2, 4], got int32 [2, 3]"),
    (lambda t: t.__setitem__("q_scale_max", t["q_scale_max"].long()), "q_scale_max", "expected"),
    (lambda t: t.__setitem__("q_invperm", t["q_invperm"] * 0), "q_invperm", "not a permutation"),
    (lambda t: t["q_groups"].__setitem__(0, 7), "q_groups", "unsupported bit width 7"),
    (lambda t: t["q_groups"].__setitem__(3, 0), "q_groups", "increase"),
    (lambda t: t.__setitem__("q_perm", torch.arange(64, dtype=torch.int32).flip(0)), "q_perm", "argsort"),
    (lambda t: t.__setitem__("bias", torch.zeros(31, dtype=torch.float16)), "bias", "expected"),
    (lambda t: t.pop("q_groups"), "q_groups", "missing"),
])
def test_bad_tensors_raise_format_error_naming_the_tensor(mutate, tensor, text):
    t = _good()
    mutate(t)
    with pytest.raises(FormatError) as e:
        exl2.read_layer(t, 64, 32, name="model.layers.3.mlp.up_proj")
    assert f"model.layers.3.mlp.up_proj.{tensor}" in str(e.value) and text in str(e.value)


def test_wrong_in_features_is_reported():
    with pytest.raises(FormatError, match="q_"):
        exl2.read_layer(_good(), 96, 32, name="x")


def test_registry_load_layer_and_missing_tensor():
    t = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in _good().items()}
    names = set(t)
    fmt = detect_format(None, names)
    assert fmt is get_format("exl2") and fmt.name == "exl2"
    assert detect_format({"quant_method": "exl2", "bits": 4.0}, set()) is fmt
    assert fmt.has_layer(names, "model.layers.0.mlp.up_proj")
    assert not fmt.has_layer(names, "model.layers.0.mlp.down_proj")

    def shape(n):
        if n not in t:
            raise FormatError(f"tensor '{n}' not found")
        return tuple(t[n].shape)

    pw = fmt.load_layer(t.__getitem__, shape, "model.layers.0.mlp.up_proj", 64, 32, {"quant_method": "exl2"})
    plain = {k.rsplit(".", 1)[1]: v for k, v in t.items()}
    assert torch.equal(packed_dequant(pw), exl2.dequantize_reference(plain))
    del t["model.layers.0.mlp.up_proj.q_scale"]
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.up_proj\.q_scale: tensor is missing"):
        fmt.load_layer(t.__getitem__, shape, "model.layers.0.mlp.up_proj", 64, 32, None)
    with pytest.raises(FormatError, match="awq"):
        detect_format({"quant_method": "awq"}, names)


def test_writer_refuses_what_exllamav2_cannot_load():
    q = torch.zeros(64, 32, dtype=torch.int64)
    with pytest.raises(ValueError, match="non-increasing"):
        exl2.pack_layer(q, torch.ones(2, 32, dtype=torch.int64), torch.ones(2), [(4, 32), (6, 32)])
    with pytest.raises(ValueError, match="multiples of 32"):
        exl2.pack_layer(q, torch.ones(2, 32, dtype=torch.int64), torch.ones(2), [(4, 48), (4, 16)])


def test_clip_search_never_worse_in_its_objective():
    K, N = 128, 64
    W = torch.randn(K, N, dtype=torch.float64)
    W[::17, ::5] *= 6                                              # outliers make clipping pay off
    plain = exl2.dequantize_reference(exl2.quantize_rtn(W, 3, 32))
    t = exl2.quantize_rtn(W, 3, 32, clip_search=True)
    searched = exl2.dequantize_reference(t)
    err = lambda d: (W - d).abs().pow(3.5).view(4, 32, N).sum(dim=(1, 2))  # noqa: E731  per group
    assert torch.all(err(searched) <= err(plain) * (1 + 1e-12))
    assert err(searched).sum() < err(plain).sum()
    assert torch.equal(packed_dequant(exl2.read_layer(t, K, N)), searched)
