"""The fused CPU decoder stack (ops/decoder_layer.py, csrc/cpu/decoder_layer.cpp) against the
per-op Python path it replaces: bit-identical logits over a prefill and several decode steps of
a ragged batch on the paged cache, for dense, GPTQ and EXL2 weights, fp32 and bf16, with a
sliding window; and the refusals that send a forward pass back to the Python path."""
from __future__ import annotations

import pytest
import torch

from exl_core.cache import Cache
from exl_core.loader import load_model
from exl_core.model.context import ContiguousContext
from exl_core.ops import decoder_layer, dispatch
from exl_core.ops.dispatch import Candidate
from exl_core.quantize.rtn import quantize_model_rtn

pytestmark = pytest.mark.skipif(not decoder_layer._has_class(), reason="extension built without DecoderStack")

# head_dim 64 (the CPU attention kernel's size), GQA 2:1
TINY = dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=3)


class _Counter:
    """Wraps the dispatcher's candidates to count which one ran."""

    def __init__(self, monkeypatch):
        self.calls = {"cpu_layer": 0, "python": 0}
        wrapped = []
        for c in decoder_layer.DISPATCH.candidates:
            def run(_c=c, **kw):
                self.calls[_c.name] += 1
                return _c.run(**kw)
            wrapped.append(Candidate(c.name, c.check, run))
        monkeypatch.setattr(decoder_layer.DISPATCH, "candidates", wrapped)


def _decode_logits(model, prompts, steps, page_size=8, seed=0):
    """Prefill every prompt in one ragged pass, then `steps` decode passes over all sequences
    (next tokens drawn from a fixed generator, so both paths see the same inputs).
    Returns the logits of every pass, (S, vocab) each."""
    cache = Cache(model, max_tokens=4096, page_size=page_size)
    g = torch.Generator().manual_seed(seed)
    seqs = [list(p) for p in prompts]
    tables = [cache.try_admit(s, len(s) + steps, max_chunk=len(s), reuse=False) for s in seqs]
    assert all(t is not None for t in tables)
    out = []
    new = [list(s) for s in seqs]
    with torch.inference_mode():
        for _ in range(steps + 1):
            lens = [len(n) for n in new]
            rows = torch.tensor([sum(lens[:i + 1]) - 1 for i in range(len(lens))])
            ctx = cache.context(tables, lens, rows)
            ids = torch.tensor([x for n in new for x in n], dtype=torch.int64)
            out.append(model.forward(ids, ctx))
            for t, s, n in zip(tables, seqs, lens):
                cache.after_forward(t, s, n, more_to_come=True)
            new = [[int(torch.randint(0, model.config.vocab_size, (1,), generator=g))] for _ in seqs]
            for s, n in zip(seqs, new):
                s.extend(n)
    return out


def _prompts(vocab, lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _assert_fused_equals_python(model, monkeypatch, lens=(5, 23, 40), steps=4, page_size=8):
    prompts = _prompts(model.config.vocab_size, lens)
    counter = _Counter(monkeypatch)
    monkeypatch.setitem(dispatch._FORCED, "decoder_layers", "python")
    ref = _decode_logits(model, prompts, steps, page_size)
    assert counter.calls == {"cpu_layer": 0, "python": steps + 1}
    monkeypatch.delitem(dispatch._FORCED, "decoder_layers")
    got = _decode_logits(model, prompts, steps, page_size)
    assert counter.calls["cpu_layer"] == steps + 1, "the fused op did not run"
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == (len(lens), model.config.vocab_size)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"pass {i}: max diff {(a - b).abs().max().item()}"


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    from exl_core.testing import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_fused"), "llama", seed=5, **TINY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_dense_bit_identical(tiny_dense, monkeypatch, dtype):
    model, _ = load_model(tiny_dense, load_tokenizer=False, dtype=dtype)
    _assert_fused_equals_python(model, monkeypatch)


QUANT = [("gptq", dict(bits=4, group_size=32, act_order=True)),
         ("gptq", dict(bits=3, group_size=64, sym=False)),
         ("exl2", dict(bits=[(8, .1), (6, .1), (5, .2), (4, .2), (3, .2), (2, .2)], group_size=32, act_order=True))]


@pytest.mark.parametrize("fmt,kw", QUANT, ids=["gptq4-act", "gptq3-asym", "exl2-mixed-act"])
def test_tiny_quantized_bit_identical(tiny_dense, tmp_path, monkeypatch, fmt, kw):
    dst = tmp_path / fmt
    quantize_model_rtn(tiny_dense, dst, fmt=fmt, **kw)
    model, _ = load_model(dst, load_tokenizer=False)
    assert all(m.is_quantized for n, m in model.linear_layers() if n != "lm_head")
    # q|k|v and gate|up fuse where they share one group layout and permutation: not with
    # act-order (a permutation each) or mixed EXL2 widths; decode steps then use the fused weights
    fusable = not kw.get("act_order")
    assert (model._native_stack().fused == 2 * model.config.num_hidden_layers) == fusable
    _assert_fused_equals_python(model, monkeypatch)


@pytest.mark.parametrize("fmt,kw", [*QUANT, ("gptq", dict(bits=4, group_size=32))],
                         ids=["gptq4-act", "gptq3-asym-fused", "exl2-mixed-act", "gptq4-sym-fused-group-zero"])
def test_int8_activations_bit_identical_and_switchable(tiny_dense, tmp_path, monkeypatch, fmt, kw):
    """activations="int8": the stack picks the int8 kernel exactly where the per-op dispatchers do
    (decode rows <= INT8_MAX_M; the ragged prefill keeps the exact kernel), so the logits match bit
    for bit; switching back with set_activations after the stack was built reaches the stack."""
    from exl_core.loader import set_activations
    dst = tmp_path / fmt
    quantize_model_rtn(tiny_dense, dst, fmt=fmt, **kw)
    model, _ = load_model(dst, load_tokenizer=False, activations="int8")
    from exl_core.ops.qmatmul import int8_zero
    shared = int8_zero(model.layers[0].mlp.down_proj.packed).dim() == 1    # one zero point per group
    assert shared == (fmt == "exl2" or kw.get("sym", True))
    stack = model._native_stack()
    assert stack.panel_bytes > 0                          # the int8 kernel reads panel-major copies
    _assert_fused_equals_python(model, monkeypatch)
    prompts = _prompts(model.config.vocab_size, (5, 23, 40))
    stack.obj.panel_reads()
    panels = _decode_logits(model, prompts, 2)
    per_layer = 4 if stack.fused else 7                   # q|k|v, o, gate|up, down fused; else one by one
    assert stack.obj.panel_reads() == 2 * model.config.num_hidden_layers * per_layer   # 2 decode passes
    assert stack.obj.set_panel_major(False) == 0          # row-major words: the same bits
    assert all(torch.equal(a, b) for a, b in zip(panels, _decode_logits(model, prompts, 2)))
    assert stack.obj.panel_reads() == 0
    assert stack.obj.set_panel_major(True) == stack.panel_bytes
    int8 = _decode_logits(model, prompts, 2)
    set_activations(model, "exact")
    exact = _decode_logits(model, prompts, 2)
    assert torch.equal(int8[0], exact[0])                 # prefill: 68 rows, exact either way
    assert not torch.equal(int8[1], exact[1])             # decode: 3 rows, int8 vs exact kernels
    monkeypatch.setitem(dispatch._FORCED, "decoder_layers", "python")
    assert all(torch.equal(a, b) for a, b in zip(exact, _decode_logits(model, prompts, 2)))


@pytest.mark.skipif(not (dispatch.has_op("qmatmul_bf16") and torch.ops.exl_core.qmatmul_bf16_supported()),
                    reason="CPU without AVX512_BF16")
def test_bf16_prefill_steps_aside_for_prompts_only(tiny_dense, tmp_path, monkeypatch):
    """prefill="bf16": the stack has no bf16 kernel, so the 68-row prefill runs per op (where the
    bf16 kernel serves) and the 3-row decode passes stay in the stack; logits equal the per-op path's
    bit for bit, and the prefill differs from the exact model's."""
    from exl_core.loader import set_prefill
    dst = tmp_path / "gptq"
    quantize_model_rtn(tiny_dense, dst, fmt="gptq", **QUANT[0][1])
    model, _ = load_model(dst, load_tokenizer=False, prefill="bf16")
    prompts = _prompts(model.config.vocab_size, (5, 23, 40))
    counter = _Counter(monkeypatch)
    got = _decode_logits(model, prompts, 2)
    assert counter.calls == {"cpu_layer": 2, "python": 1}
    monkeypatch.setitem(dispatch._FORCED, "decoder_layers", "python")
    ref = _decode_logits(model, prompts, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    set_prefill(model, "exact")
    exact = _decode_logits(model, prompts, 2)
    err = float((got[0] - exact[0]).norm() / exact[0].norm())
    assert 0 < err < 0.02, err


@pytest.mark.parametrize("dense_k", [True, False], ids=["k-dense", "all-packed-fused"])
def test_tiny_mixed_dense_and_packed_bias_window(tmp_path_factory, tmp_path, monkeypatch, dense_k):
    """Qwen2-style q/k/v bias, a sliding window shorter than the prompts (pages leave the
    window), and one projection per layer swapped to dense (q/k/v then run one by one), or all
    packed (q|k|v fused with their biases for decode steps)."""
    from exl_core.model.linear import QuantLinear
    from exl_core.testing import make_tiny_model
    src = make_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), "qwen2", seed=7, use_sliding_window=True,
                          sliding_window=12, max_window_layers=0, **TINY)
    dst = tmp_path / "gptq"
    quantize_model_rtn(src, dst, fmt="gptq", bits=4, group_size=64)
    model, _ = load_model(dst, load_tokenizer=False)
    assert model.config.sliding_window == 12 and model.config.attention_bias
    for name, m in list(model.linear_layers()):
        if name.endswith("k_proj") and dense_k:
            model.set_linear(name, QuantLinear.from_dense(m.dense_weight(), m.packed.bias))
    # dense k: gate|up fuse, q|k|v cannot; all packed: both, q|k|v with their biases
    assert model._native_stack().fused == (1 if dense_k else 2) * model.config.num_hidden_layers
    _assert_fused_equals_python(model, monkeypatch, lens=(3, 17, 30), steps=5, page_size=4)


def _reasons(model, ctx_kind="paged"):
    from exl_core.ops.decoder_layer import DISPATCH
    cache = Cache(model, max_tokens=256, page_size=8)
    t = cache.try_admit([1, 2, 3], 3, 3, reuse=False)
    ctx = cache.context([t], [3]) if ctx_kind == "paged" else ContiguousContext([3], [None])
    kv = ctx.native_kv() if hasattr(ctx, "native_kv") else None
    h = model.embed(torch.tensor([1, 2, 3]))
    stack = model._native_stack() if kv is not None else None
    return dict(DISPATCH.reasons(h=h, stack=stack, kv=kv, cos_sin=model.rope.cos_sin(3), fallback=None))


def test_refusals(tiny_dense, monkeypatch):
    model, _ = load_model(tiny_dense, load_tokenizer=False)
    assert _reasons(model)["cpu_layer"] is None
    assert "not a plain paged" in _reasons(model, "contiguous")["cpu_layer"]
    # a LoRA-like hook on one projection: refused, and accepted again once removed (stack rebuilt)
    proj = model.layers[1].mlp.up_proj
    proj.lora = lambda x, y: y
    assert "LoRA" in _reasons(model)["cpu_layer"] and "layer 1" in _reasons(model)["cpu_layer"]
    proj.lora = None
    assert _reasons(model)["cpu_layer"] is None
    # a projection that is not a plain QuantLinear (as tensor-parallel shards are)
    orig = model.layers[0].self_attn.o_proj
    model.layers[0].self_attn.o_proj = torch.nn.Identity()
    assert "not a plain QuantLinear" in _reasons(model)["cpu_layer"]
    model.layers[0].self_attn.o_proj = orig
    # a debug switch moving an inner op to another kernel
    monkeypatch.setitem(dispatch._FORCED, "rms_norm", "torch_ref")
    assert "rms_norm" in _reasons(model)["cpu_layer"]
    monkeypatch.delitem(dispatch._FORCED, "rms_norm")
    # a hook already there when the stack is first built: refused, then served once it is gone
    fresh, _ = load_model(tiny_dense, load_tokenizer=False)
    fresh.layers[2].self_attn.q_proj.lora = lambda x, y: y
    assert "layer 2: self_attn.q_proj has a LoRA hook" in _reasons(fresh)["cpu_layer"]
    fresh.layers[2].self_attn.q_proj.lora = None
    assert _reasons(fresh)["cpu_layer"] is None
    # float16 models: the per-op kernels do not serve them either
    model16, _ = load_model(tiny_dense, load_tokenizer=False, dtype=torch.float16)
    assert "float16" in _reasons(model16)["cpu_layer"]


def test_forced_matmul_kernels_send_int8_stacks_to_python(tiny_dense, tmp_path, monkeypatch):
    """A forced or disabled quantized-matmul kernel changes which weights run int8 on the per-op path;
    the stack (which picks per weight) must step aside instead of computing something else."""
    dst = tmp_path / "gptq"
    quantize_model_rtn(tiny_dense, dst, fmt="gptq", **QUANT[0][1])
    model, _ = load_model(dst, load_tokenizer=False, activations="int8")
    assert _reasons(model)["cpu_layer"] is None
    for table, key, value in ((dispatch._FORCED, "qmatmul", "cpu_fused"),
                              (dispatch._FORCED, "qmatmul_many", "cpu_fused_multi")):
        monkeypatch.setitem(table, key, value)
        assert "qmatmul" in _reasons(model)["cpu_layer"]
        monkeypatch.delitem(table, key)
    monkeypatch.setattr(dispatch, "_DISABLED", set(dispatch._DISABLED) | {"cpu_int8"})
    assert "qmatmul" in _reasons(model)["cpu_layer"]


def test_layer_list_edits_and_lora_modules_reach_the_stack(tiny_dense, monkeypatch):
    model, _ = load_model(tiny_dense, load_tokenizer=False)
    assert _reasons(model)["cpu_layer"] is None
    model.layers[1].self_attn.q_proj.lora = torch.nn.Identity()     # a module hook: lives in _modules
    assert "LoRA" in _reasons(model)["cpu_layer"]
    del model.layers[1].self_attn.q_proj.lora
    assert _reasons(model)["cpu_layer"] is None
    assert model._native_stack().num_layers == 3
    del model.layers[2]                                             # no registration hook fires
    assert model._native_stack().num_layers == 2


def test_lora_hook_runs_on_python_path(tiny_dense, monkeypatch):
    """With a hook attached the outputs change exactly as the hook says (the fused op would skip it)."""
    model, _ = load_model(tiny_dense, load_tokenizer=False)
    prompts = _prompts(model.config.vocab_size, (6, 9))
    base = _decode_logits(model, prompts, 1)
    model.layers[0].mlp.down_proj.lora = lambda x, y: y * 0.5
    hooked = _decode_logits(model, prompts, 1)
    monkeypatch.setitem(dispatch._FORCED, "decoder_layers", "python")
    ref = _decode_logits(model, prompts, 1)
    assert all(torch.equal(a, b) for a, b in zip(hooked, ref))
    assert not torch.equal(hooked[0], base[0])


def test_stack_rejects_bad_input(tiny_dense):
    model, _ = load_model(tiny_dense, load_tokenizer=False)
    cache = Cache(model, max_tokens=64, page_size=8)
    t = cache.try_admit([1, 2, 3], 3, 3, reuse=False)
    kv = cache.context([t], [3]).native_kv()
    stack = model._native_stack()
    h = model.embed(torch.tensor([1, 2, 3]))
    cs = model.rope.cos_sin(3)
    with pytest.raises(RuntimeError, match="k and"):
        stack.obj.forward(h, None, kv.positions, cs, kv.slots, kv.block_table, kv.cu_seqlens, kv.seq_lens_k,
                          list(kv.k)[:1], list(kv.v))
    bad = kv.slots.clone()
    bad[1] = kv.k[0].shape[0] * kv.k[0].shape[1]      # one past the pool
    with pytest.raises(RuntimeError, match="outside the page pool"):
        stack.obj.forward(h, None, kv.positions, cs, bad, kv.block_table, kv.cu_seqlens, kv.seq_lens_k,
                          list(kv.k), list(kv.v))
    from exl_core.errors import KernelError
    bad_kv = decoder_layer.PagedKV(kv.positions, bad, kv.block_table, kv.cu_seqlens, kv.seq_lens_k, kv.k, kv.v)
    with pytest.raises(KernelError, match="outside the page pool"):
        decoder_layer.decoder_layers(h, stack, bad_kv, cs, fallback=None)
    with pytest.raises(RuntimeError, match="slots"):
        stack.obj.forward(h, None, kv.positions, cs, kv.slots[:2], kv.block_table, kv.cu_seqlens, kv.seq_lens_k,
                          list(kv.k), list(kv.v))


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dense", "gptq", "exl2"])
def test_smollm2_bit_identical(smollm2_dir, tmp_path, monkeypatch, fmt):
    if fmt == "dense":
        folder = smollm2_dir
    else:
        folder = tmp_path / fmt
        quantize_model_rtn(smollm2_dir, folder, fmt=fmt, bits=4, group_size=128 if fmt == "gptq" else 32)
    model, _ = load_model(folder, load_tokenizer=False)
    _assert_fused_equals_python(model, monkeypatch, lens=(4, 37, 70), steps=3, page_size=32)


def test_replaced_weights_reach_the_stack(tiny_dense, tmp_path, monkeypatch):
    """A weight tensor swapped after the stack was built (buffer assignment, set_packed, a new
    module) is what the next fused pass uses: it matches the Python path and differs from before."""
    from exl_core.model.linear import QuantLinear
    model, _ = load_model(tiny_dense, load_tokenizer=False)
    prompts = _prompts(model.config.vocab_size, (6, 11))
    before = _decode_logits(model, prompts, 1)
    down = model.layers[1].mlp.down_proj
    down.w_t = down.w_t * 0.5                                              # buffer assignment
    model.layers[0].self_attn.v_proj = QuantLinear.from_dense(torch.randn(128, 256) * 0.1)  # new module
    _assert_fused_equals_python(model, monkeypatch, lens=(6, 11), steps=1)
    assert not torch.equal(_decode_logits(model, prompts, 1)[0], before[0])


@pytest.fixture
def isa_level(request):
    """Caps every CPU kernel's vector ISA (0 scalar, 1 AVX2, 2 AVX-512) for one test."""
    ops = torch.ops.exl_core
    prev_simd = ops.cpu_isa_limit(-1)
    ops.matmul_isa(request.param)
    ops.cpu_isa_limit(request.param)
    yield request.param
    ops.matmul_isa(2)                 # the default cap (as tests/test_dense_matmul.py restores it)
    ops.cpu_isa_limit(prev_simd)


@pytest.mark.parametrize("isa_level", [0, 1], indirect=True, ids=["scalar", "avx2"])
def test_tiny_gptq_bit_identical_on_lower_isa(tiny_dense, tmp_path, monkeypatch, isa_level):
    dst = tmp_path / "gptq"
    quantize_model_rtn(tiny_dense, dst, fmt="gptq", bits=4, group_size=32, act_order=True)
    model, _ = load_model(dst, load_tokenizer=False)
    _assert_fused_equals_python(model, monkeypatch, lens=(5, 19), steps=2)
