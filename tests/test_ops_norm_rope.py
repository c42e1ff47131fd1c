"""rms_norm, apply_rope and silu_mul against HF's own functions and float64 references."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from exl_core.errors import InputError
from exl_core.ops import activation as ACT
from exl_core.ops import norm as NORM
from exl_core.ops import rope as ROPE
from exl_core.ops.dispatch import has_op

# cpu_avx2 / cpu_scalar: the C++ kernels with the vector ISA capped (ops without that path fall to scalar)
PATHS = ["torch_ref", "cpu", "cpu_avx2", "cpu_scalar"]
_ISA_CAP = {"cpu_avx2": 1, "cpu_scalar": 0}


@pytest.fixture
def path(request):
    name = request.param
    if name.startswith("cpu") and not has_op("cpu_isa_limit"):
        pytest.skip("C++ extension not built")
    if name in _ISA_CAP:
        prev = torch.ops.exl_core.cpu_isa_limit(_ISA_CAP[name])
        yield "cpu"
        torch.ops.exl_core.cpu_isa_limit(prev)
    else:
        yield name


def _call(dispatcher, name, **args):
    c = next(c for c in dispatcher.candidates if c.name == name)
    reason = c.check(**args)
    assert reason is None, f"{name} refused: {reason}"
    return c.run(**args)


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# rms_norm
SHAPES = [(1, 1), (26, 37), (5, 3, 576), (7, 4097), (2, 17)]


def _hf_norm(x, w, eps):
    m = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        m.weight.copy_(w)
        return m(x)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fp32(path, shape):
    x = torch.randn(shape) * 3
    w = torch.randn(shape[-1])
    eps = 1e-5
    got = _call(NORM.RMS_NORM, path, x=x, weight=w, eps=eps, residual=None)
    x64 = x.double()
    ref = w.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _rel(got, ref) < 1e-5
    assert _rel(got, _hf_norm(x, w, eps).double()) < 1e-5


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("shape", [(26, 37), (9, 576)])
def test_rms_norm_bf16_matches_hf(path, shape):
    x = torch.randn(shape).bfloat16()
    w = (torch.rand(shape[-1]) + 0.5).bfloat16()
    got = _call(NORM.RMS_NORM, path, x=x, weight=w, eps=1e-6, residual=None)
    hf = _hf_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    # HF's roundings: y = (x * rsqrt(mean(x^2) + eps)).to(bf16), then w * y in bf16.  Only the fp32 sum of squares may
    # be summed in another order, which can move y by one bf16 ulp (the product then by up to ~2 ulps: a flat
    # 1-ulp bound on the output failed ~3.6 % of seeds for the scalar path, ~0.1 % for the vector ones): the output
    # must be w * y' for y' = y or one of its bf16 neighbours, exactly.
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(w * y, hf)                                      # the reference's roundings, spelled out
    inf = torch.full_like(y, float("inf"))
    ok = torch.zeros_like(got, dtype=torch.bool)
    for y2 in (y, torch.nextafter(y, inf), torch.nextafter(y, -inf)):
        ok |= (w * y2) == got
    assert ok.all(), (got[~ok][:4], hf[~ok][:4])


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_residual(path, dtype):
    x, r = torch.randn(13, 3, 200).to(dtype), torch.randn(13, 3, 200).to(dtype)
    w = torch.randn(200).to(dtype)
    y, h = _call(NORM.RMS_NORM, path, x=x, weight=w, eps=1e-6, residual=r)
    assert torch.equal(h, x + r)                       # the add happens in x's dtype
    y_alone = _call(NORM.RMS_NORM, path, x=h, weight=w, eps=1e-6, residual=None)
    assert torch.equal(y, y_alone)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_rms_norm_batch_invariance(path):
    x = torch.randn(33, 576).bfloat16()
    w = torch.randn(576).bfloat16()
    full = _call(NORM.RMS_NORM, path, x=x, weight=w, eps=1e-5, residual=None)
    for i in (0, 7, 32):
        one = _call(NORM.RMS_NORM, path, x=x[i:i + 1].clone(), weight=w, eps=1e-5, residual=None)
        assert torch.equal(one[0], full[i])


def test_rms_norm_public_face():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    assert torch.allclose(NORM.rms_norm(x, w, 1e-5), NORM.rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    # weight of another dtype: the kernel refuses, the reference keeps HF's promotion
    out = NORM.rms_norm(x.bfloat16(), w, 1e-5)
    assert out.dtype == torch.float32
    with pytest.raises(InputError, match="weight"):
        NORM.rms_norm(x, torch.randn(63), 1e-5)
    with pytest.raises(InputError, match="residual"):
        NORM.rms_norm(x, w, 1e-5, residual=torch.randn(3, 64))


# ---------------------------------------------------------------------------------------------
# rope
def _inv_freq(d, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


def _rope64(x, pos, inv_freq):
    """float64 rotate_half rope with angles computed in float64."""
    half = x.shape[-1] // 2
    ang = pos.double()[:, None] * inv_freq[None, :]                  # (T, D/2)
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def test_cos_sin_table_matches_hf():
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                      rope_theta=100000.0)
    emb = LlamaRotaryEmbedding(cfg)
    pos = torch.randint(0, 512, (1, 40))
    cos, sin = emb(torch.zeros(1, 40, 64), pos)                      # (1, T, D)
    table = ROPE.cos_sin_table(emb.inv_freq, 512)
    assert torch.allclose(table[pos[0], :32], cos[0, :, :32], rtol=0, atol=1e-6)
    assert torch.allclose(table[pos[0], 32:], sin[0, :, :32], rtol=0, atol=1e-6)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (37, 4, 2, 128), (5, 3, 1, 10), (11, 2, 2, 34)])
def test_rope_fp32(path, t, hq, hkv, d):
    max_pos = 3000
    inv = _inv_freq(d)
    table = ROPE.cos_sin_table(inv.float(), max_pos)
    q, k = torch.randn(t, hq, d), torch.randn(t, hkv, d)
    pos = torch.randint(0, max_pos, (t,))
    gq, gk = _call(ROPE.ROPE, path, q=q, k=k, positions=pos, cos_sin=table)
    assert gq.dtype == torch.float32 and gq.shape == q.shape and gk.shape == k.shape
    # HF's own function on the same fp32 cos/sin
    cs = table[pos]
    cos = torch.cat([cs[:, :d // 2]] * 2, -1)[None]
    sin = torch.cat([cs[:, d // 2:]] * 2, -1)[None]
    hq_, hk_ = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert _rel(gq, hq_[0].transpose(0, 1).double()) < 1e-5
    assert _rel(gk, hk_[0].transpose(0, 1).double()) < 1e-5
    # float64 angles: the fp32 table's own rounding at position < 3000 stays below ~3e-4 rad
    assert _rel(gq, _rope64(q, pos, inv)) < 1e-3


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_rope_bf16(path):
    d = 64
    table = ROPE.cos_sin_table(_inv_freq(d).float(), 100)
    q, k = torch.randn(7, 9, d).bfloat16(), torch.randn(7, 3, d).bfloat16()
    pos = torch.randint(0, 100, (7,))
    gq, gk = _call(ROPE.ROPE, path, q=q, k=k, positions=pos, cos_sin=table)
    assert gq.dtype == torch.bfloat16 and gk.dtype == torch.bfloat16
    rq, rk = ROPE.apply_rope_ref(q.float(), k.float(), pos, table)  # fp32 math, then one bf16 rounding
    for g, r in ((gq, rq), (gk, rk)):
        # fp32 results one ulp apart (fused vs separate multiply-add) can round to neighbouring bf16 values when
        # they straddle a rounding boundary: allow one bf16 ulp, but nearly every element must be exact
        rb = r.bfloat16().float()
        diff = (g.float() - rb).abs()
        ulp = torch.exp2(torch.floor(torch.log2(rb.abs().clamp_min(2.0 ** -100))) - 7)
        assert (diff <= ulp).all() and float((diff == 0).float().mean()) > 0.99


def test_rope_bad_input():
    table = ROPE.cos_sin_table(_inv_freq(64).float(), 10)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(InputError, match="cos_sin table"):
        ROPE.apply_rope(q, k, torch.tensor([3, 10]), table)
    with pytest.raises(InputError, match="positions"):
        ROPE.apply_rope(q, k, torch.tensor([3]), table)
    with pytest.raises(InputError, match="even"):
        ROPE.apply_rope(q[..., :63], k[..., :63], torch.tensor([0, 1]), table[:, :63])


# ---------------------------------------------------------------------------------------------
# silu_mul
@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("shape", [(1,), (26, 37), (3, 1536), (4099,)])
def test_silu_mul_fp32(path, shape):
    g, u = torch.randn(shape) * 6, torch.randn(shape)
    g.view(-1)[0] = -200.0                       # exp overflow side
    got = _call(ACT.SILU_MUL, path, gate=g, up=u)
    g64 = g.double()
    ref = g64 / (1 + torch.exp(-g64)) * u.double()
    assert got.dtype == torch.float32 and got.shape == g.shape
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_silu_mul_bf16_matches_hf(path):
    g, u = (torch.randn(9, 1536) * 4).bfloat16(), torch.randn(9, 1536).bfloat16()
    got = _call(ACT.SILU_MUL, path, gate=g, up=u)
    hf = F.silu(g) * u                           # LlamaMLP: act_fn(gate) * up in bf16
    assert got.dtype == torch.bfloat16
    # two bf16 roundings like HF; a 1-ulp difference of silu may carry through: allow 2 ulp
    assert ((got.float() - hf.float()).abs() <= hf.float().abs() * 2 ** -6 + 1e-30).all()


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck on every registered op (schema, fake kernel, autograd registration)
@pytest.mark.skipif(not has_op("rms_norm"), reason="C++ extension not built")
def test_opcheck():
    ops = torch.ops.exl_core
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 576).to(dt)
        w = torch.randn(576).to(dt)
        torch.library.opcheck(ops.rms_norm, (x, w, 1e-5))
        torch.library.opcheck(ops.rms_norm_residual, (x, torch.randn_like(x), w, 1e-5))
        torch.library.opcheck(ops.silu_mul, (x, torch.randn_like(x)))
        table = ROPE.cos_sin_table(_inv_freq(64).float(), 50)
        torch.library.opcheck(ops.rope, (torch.randn(3, 9, 64).to(dt), torch.randn(3, 3, 64).to(dt),
                                         torch.tensor([0, 4, 49]), table))
