"""GPTQ layer format: AutoGPTQ bit layout, v1/v2 zeros, act-order, references, RTN bound, errors."""
from __future__ import annotations

import pytest
import torch

from exl_core.errors import ConfigError, FormatError
from exl_core.formats import gptq
from exl_core.formats.base import detect_format, get_format
from exl_core.formats.packed import dequantize_reference as packed_dequant

BITS = (2, 3, 4, 8)


def autogptq_pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Scalar re-statement of AutoGPTQ's QuantLinear.pack (qlinear_cuda_old.py) along dim 0.

    2/4/8 bits: word r holds values 32/bits*r + j at bits*j. 3 bits, per 32 values in 3 words:
    values 0-9 at 3j of word 0, value 10 split (low 2 bits at 30, top bit at bit 0 of word 1),
    values 11-20 at 3j+1 of word 1, value 21 split (low bit at 31, top 2 bits at bit 0 of
    word 2), values 22-31 at 3j+2 of word 2."""
    k, n = v.shape
    v = v.tolist()
    out = []
    for c in range(n):
        col, words, i = [v[r][c] for r in range(k)], [], 0
        while i < k:
            if bits != 3:
                w = 0
                for j in range(32 // bits):
                    w |= col[i + j] << (bits * j)
                words.append(w)
                i += 32 // bits
                continue
            w0 = sum(col[i + j] << (3 * j) for j in range(10)) | ((col[i + 10] & 3) << 30)
            w1 = (col[i + 10] >> 2) | sum(col[i + 11 + j] << (3 * j + 1) for j in range(10)) \
                | ((col[i + 21] & 1) << 31)
            w2 = (col[i + 21] >> 1) | sum(col[i + 22 + j] << (3 * j + 2) for j in range(10))
            words += [w0, w1, w2]
            i += 32
        out.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return torch.tensor(out, dtype=torch.int64).t().to(torch.int32)


def random_layer(K, N, bits, group_size, act_order, g=None):
    gs = K if group_size == -1 else group_size
    G = -(-K // gs)
    q = torch.randint(0, 2 ** bits, (K, N), generator=g)
    scales = (torch.rand(G, N, generator=g) * 0.02 + 1e-3).half().double()
    zeros = torch.randint(1, 2 ** bits, (G, N), generator=g)          # >= 1: storable in v1 too
    g_idx = torch.arange(K) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    return q, scales, zeros, g_idx


def expected_weight(q, scales, zeros, g_idx):
    return (q.double() - zeros[g_idx].double()) * scales[g_idx]


@pytest.mark.parametrize("bits", BITS)
def test_qweight_and_qzeros_match_autogptq_packing(bits):
    K, N = 64, 32
    q, scales, zeros, g_idx = random_layer(K, N, bits, 32, False)
    t = gptq.pack_layer(q, scales, zeros, g_idx, bits, "gptq")
    assert torch.equal(t["qweight"], autogptq_pack_rows(q, bits))
    # AutoGPTQ v1: `zeros -= 1` then packs each row of zeros along the output columns
    assert torch.equal(t["qzeros"], autogptq_pack_rows((zeros - 1).t(), bits).t())


def test_hand_built_words():
    # Symmetric 4-bit v1 checkpoints famously have qzeros words 0x77777777 (zero 8 stored as 7).
    K, N = 32, 8
    W = torch.randn(K, N, dtype=torch.float64)
    t = gptq.quantize_rtn(W, 4, -1, sym=True)
    assert t["qzeros"].tolist() == [[0x77777777]]
    t2 = gptq.quantize_rtn(W, 4, -1, sym=True, checkpoint_format="gptq_v2")
    assert t2["qzeros"].tolist() == [[-0x77777778]]                # 0x88888888 as int32
    # 4-bit values 0..7 along K -> 0x76543210
    q = torch.arange(8).repeat(4).view(32, 1)
    t3 = gptq.pack_layer(q.repeat(1, 8), torch.ones(1, 8), torch.full((1, 8), 8), torch.zeros(32), 4)
    assert int(t3["qweight"][0, 0]) == 0x76543210


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_round_trip_and_references(bits, group_size, act_order, fmt):
    K, N = 256, 64
    q, scales, zeros, g_idx = random_layer(K, N, bits, group_size, act_order)
    t = gptq.pack_layer(q, scales, zeros, g_idx, bits, fmt, bias=torch.randn(N))
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "checkpoint_format": fmt,
          "desc_act": act_order}
    want = expected_weight(q, scales, zeros, g_idx)
    ref = gptq.dequantize_reference(t, qc)
    assert torch.equal(ref, want)
    pw = gptq.read_layer(t, K, N, "layer", qc)
    assert (pw.perm is None) == (not act_order or group_size == -1)
    assert torch.equal(packed_dequant(pw), ref)
    assert torch.equal(gptq.unpack_zeros(t["qzeros"], bits, N) + (1 if fmt == "gptq" else 0), zeros)
    assert torch.equal(pw.bias, t["bias"])


def test_v1_and_v2_differ_by_one_zero_step():
    K, N = 64, 32
    q, scales, zeros, g_idx = random_layer(K, N, 4, 32, False)
    t = gptq.pack_layer(q, scales, zeros, g_idx, 4, "gptq_v2")
    w1 = gptq.dequantize_reference(t, {"bits": 4, "checkpoint_format": "gptq"})
    w2 = gptq.dequantize_reference(t, {"bits": 4, "checkpoint_format": "gptq_v2"})
    assert torch.allclose(w2 - w1, scales[g_idx], rtol=0, atol=1e-12)


def test_arbitrary_g_idx_and_missing_g_idx():
    K, N = 128, 32
    q, scales, zeros, _ = random_layer(K, N, 3, 32, False)
    g_idx = torch.tensor([0, 2, 1, 3] * 32)[torch.randperm(K)]   # every group 32 rows, scattered
    t = gptq.pack_layer(q, scales, zeros, g_idx, 3)
    assert torch.equal(packed_dequant(gptq.read_layer(t, K, N, quant_config={"bits": 3})),
                       expected_weight(q, scales, zeros, g_idx))
    seq = torch.arange(K) // 32
    t2 = gptq.pack_layer(q, scales, zeros, seq, 3)
    del t2["g_idx"]                                                # old checkpoints without g_idx
    qc = {"bits": 3, "group_size": 32}
    assert torch.equal(packed_dequant(gptq.read_layer(t2, K, N, quant_config=qc)),
                       expected_weight(q, scales, zeros, seq))
    assert torch.equal(gptq.dequantize_reference(t2, qc), expected_weight(q, scales, zeros, seq))
    # act-order without its g_idx (a stripped file): refused, not read with sequential groups (every scale on the
    # wrong rows); static_groups act-order keeps sequential groups
    with pytest.raises(FormatError, match=r"layer\.g_idx is missing: .*desc_act"):
        gptq.read_layer(t2, K, N, quant_config=dict(qc, desc_act=True))
    assert torch.equal(packed_dequant(gptq.read_layer(t2, K, N, quant_config=dict(qc, desc_act=True,
                                                                                   static_groups=True))),
                       expected_weight(q, scales, zeros, seq))
    # one group (group_size -1): every row uses it, so no g_idx is needed even under desc_act
    q1, s1, z1, _ = random_layer(K, N, 3, K, False)
    one = gptq.pack_layer(q1, s1, z1, torch.zeros(K, dtype=torch.int64), 3)
    del one["g_idx"]
    assert torch.equal(packed_dequant(gptq.read_layer(one, K, N, quant_config={"bits": 3, "group_size": -1,
                                                                                "desc_act": True})),
                       expected_weight(q1, s1, z1, torch.zeros(K, dtype=torch.int64)))


def test_all_zero_g_idx_means_sequential_groups_like_exllamav2():
    K, N = 128, 32
    q, scales, zeros, g_idx = random_layer(K, N, 4, 32, False)
    t = gptq.pack_layer(q, scales, zeros, torch.zeros(K, dtype=torch.int64), 4)
    want = expected_weight(q, scales, zeros, g_idx)
    assert torch.equal(gptq.dequantize_reference(t, {"bits": 4}), want)
    assert torch.equal(packed_dequant(gptq.read_layer(t, K, N, quant_config={"bits": 4})), want)


def test_gptqmodel_dynamic_overrides_per_module():
    """GPTQModel's `dynamic`: down_proj at 8 bits in groups of 64 under a 4-bit / 32 config (no g_idx, so the group
    size decides the groups). It was refused by a shape check that did not name `dynamic`."""
    K, N = 256, 64
    fmt = get_format("gptq")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32,
          "dynamic": {r"-:.*\.o_proj": {}, r"+:.*down_proj": {"bits": 8, "group_size": 64}}}
    for name, bits, gs in (("model.layers.0.mlp.down_proj", 8, 64), ("model.layers.0.mlp.up_proj", 4, 32)):
        q, scales, zeros, seq = random_layer(K, N, bits, gs, False)
        t = gptq.pack_layer(q, scales, zeros, seq, bits)
        del t["g_idx"]
        full = {f"{name}.{k}": v for k, v in t.items()}
        pw = fmt.load_layer(full.__getitem__, lambda n: tuple(full[n].shape), name, K, N, qc)
        assert pw.meta["bits"] == bits
        assert torch.equal(packed_dequant(pw), expected_weight(q, scales, zeros, seq))
    assert gptq.layer_config(qc, "model.layers.3.self_attn.o_proj") is qc      # "-:": stored dense, no override
    with pytest.raises(ConfigError, match="dynamic"):
        gptq.layer_config({"bits": 4, "dynamic": {"+:(": {"bits": 8}}}, "x")


def test_bits_inferred_when_config_lacks_them():
    K, N = 64, 32
    q, scales, zeros, g_idx = random_layer(K, N, 8, 32, False)
    t = gptq.pack_layer(q, scales, zeros, g_idx, 8)
    assert gptq.read_layer(t, K, N).meta["bits"] == 8


# ---- RTN ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sym, fmt", [(True, "gptq"), (False, "gptq"), (False, "gptq_v2")])
@pytest.mark.parametrize("act_order", [False, True])
def test_rtn_error_bounded_by_half_scale(bits, sym, act_order, fmt):
    K, N, gs = 256, 64, 64
    W = torch.randn(K, N, dtype=torch.float64) * torch.rand(1, N, dtype=torch.float64)
    W[:, :4] = W[:, :4].abs()                       # all-positive columns: zero point 0 (v1 edge)
    t = gptq.quantize_rtn(W, bits, gs, sym=sym, act_order=act_order, checkpoint_format=fmt)
    qc = {"bits": bits, "group_size": gs, "checkpoint_format": fmt}
    deq = gptq.dequantize_reference(t, qc)
    scale = t["scales"].double()[t["g_idx"].long()]
    assert torch.all((W - deq).abs() <= scale / 2 * (1 + 1e-9))
    assert torch.equal(packed_dequant(gptq.read_layer(t, K, N, quant_config=qc)), deq)
    if act_order:
        assert not torch.equal(t["g_idx"].long(), torch.arange(K) // gs)


# ---- bad input ------------------------------------------------------------------------------------

def _good(bits=4):
    q, scales, zeros, g_idx = random_layer(64, 32, bits, 32, True)
    return gptq.pack_layer(q, scales, zeros, g_idx, bits)


@pytest.mark.parametrize("mutate, tensor, text", [
    (lambda t: t.__setitem__("qweight", t["qweight"][:-2]), "qweight", "expected int32 [8, 32], got int32 [6, 32]"),
    (lambda t: t.__setitem__("qweight", t["qweight"].float()), "qweight", "expected int32"),
    (lambda t: t.__setitem__("qzeros", t["qzeros"][:, :2]), "qzeros", "expected int32 [2, 4], got int32 [2, 2]"),
    (lambda t: t.__setitem__("scales", t["scales"].int()), "scales", "expected float16"),
    (lambda t: t.__setitem__("scales", t["scales"][:, :5]), "scales", "[groups, 32]"),
    (lambda t: t["g_idx"].__setitem__(3, 2), "g_idx", "values must lie in [0, 2)"),
    (lambda t: t["g_idx"].__setitem__(3, -1), "g_idx", "values must lie in [0, 2)"),
    (lambda t: t.__setitem__("g_idx", t["g_idx"][:10]), "g_idx", "expected"),
    (lambda t: t["g_idx"].copy_(torch.tensor([0] * 48 + [1] * 16)), "g_idx", "multiples of 32"),
    (lambda t: t.__setitem__("bias", torch.zeros(3)), "bias", "expected"),
    (lambda t: t.pop("scales"), "scales", "missing"),
])
def test_bad_tensors_raise_format_error_naming_the_tensor(mutate, tensor, text):
    t = _good()
    mutate(t)
    with pytest.raises(FormatError) as e:
        gptq.read_layer(t, 64, 32, "model.layers.3.mlp.up_proj", {"bits": 4, "group_size": 32})
    assert f"model.layers.3.mlp.up_proj.{tensor}" in str(e.value) and text in str(e.value)


def test_unsupported_bits_and_checkpoint_format():
    t = _good()
    with pytest.raises(FormatError, match=r"L\.qweight: unsupported GPTQ bit width 5"):
        gptq.read_layer(t, 64, 32, "L", {"bits": 5})
    with pytest.raises(FormatError, match="checkpoint_format 'marlin'"):
        gptq.read_layer(t, 64, 32, "L", {"bits": 4, "checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="v1 cannot store a zero point of 0"):
        gptq.pack_layer(torch.zeros(32, 8, dtype=torch.int64), torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(32), 4)
    with pytest.raises(ValueError, match="unsupported"):
        gptq.quantize_rtn(torch.randn(64, 32), bits=6)


def test_registry_detects_gptq_from_names_and_config():
    t = {f"model.layers.0.self_attn.q_proj.{k}": v for k, v in _good().items()}
    names = set(t)
    fmt = detect_format(None, names)
    assert fmt is get_format("gptq")
    assert detect_format({"quant_method": "gptq", "bits": 4}, set()) is fmt
    assert detect_format(None, {"model.embed_tokens.weight"}) is None
    pw = fmt.load_layer(t.__getitem__, lambda n: tuple(t[n].shape) if n in t else None,
                        "model.layers.0.self_attn.q_proj", 64, 32, {"bits": 4, "group_size": 32})
    plain = {k.rsplit(".", 1)[1]: v for k, v in t.items()}
    assert torch.equal(packed_dequant(pw), gptq.dequantize_reference(plain, {"bits": 4}))


@pytest.mark.parametrize("sym", [True, False])
def test_clip_search_never_worse_in_its_objective(sym):
    K, N, gs = 128, 64, 32
    W = torch.randn(K, N, dtype=torch.float64)
    W[::17, ::5] *= 6
    qc = {"bits": 3, "group_size": gs}
    plain = gptq.dequantize_reference(gptq.quantize_rtn(W, 3, gs, sym=sym), qc)
    t = gptq.quantize_rtn(W, 3, gs, sym=sym, clip_search=True)
    searched = gptq.dequantize_reference(t, qc)
    err = lambda d: (W - d).abs().pow(2.4).view(K // gs, gs, N).sum(dim=1)  # noqa: E731  (group, column)
    assert torch.all(err(searched) <= err(plain) * (1 + 1e-12))
    assert err(searched).sum() < err(plain).sum()
    assert torch.equal(packed_dequant(gptq.read_layer(t, K, N, quant_config=qc)), searched)
