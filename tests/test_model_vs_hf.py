"""The native model against HF transformers' own modeling code (fp32, same weights)."""
from __future__ import annotations

import pytest
import torch

from exl_core.loader import load_model

ATOL = 1e-4


def _hf(folder, arch_cls):
    import transformers
    return getattr(transformers, arch_cls).from_pretrained(folder, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()


CASES = [
    ("llama", "LlamaForCausalLM", {}),
    ("llama", "LlamaForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64}}),
    ("llama", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),    # o_proj's bias too (was dropped)
    ("mistral", "MistralForCausalLM", {"sliding_window": 5}),
    ("qwen2", "Qwen2ForCausalLM", {}),
    # Qwen2 slides only layers >= max_window_layers (HF's default 28: none here), or those layer_types names
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4}),
    ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4,
                                   "layer_types": ["sliding_attention", "full_attention"]}),
    # HF ignores these keys for Qwen2 (q/k/v biases always, none elsewhere) and Mistral (no biases)
    ("qwen2", "Qwen2ForCausalLM", {"attention_bias": False, "mlp_bias": True}),
    ("mistral", "MistralForCausalLM", {"attention_bias": True}),
]


@pytest.mark.parametrize("arch,cls,over", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_logits_match_hf(tiny_model_factory, arch, cls, over):
    folder = tiny_model_factory(arch, seed=len(str(over)), **over)
    hf = _hf(folder, cls)
    model, _ = load_model(folder, load_tokenizer=False)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=g)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = model.forward_batch(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < ATOL

    # with cache: prefill 8 tokens, then decode the remaining 3 one at a time
    kvs = [model.new_sequence_kv(32) for _ in range(3)]
    pre = model.forward_batch(ids[:, :8], kvs)
    assert (pre - ref[:, :8]).abs().max().item() < ATOL
    for t in range(8, 11):
        step = model.forward_batch(ids[:, t:t + 1], kvs)
        assert (step[:, 0] - ref[:, t]).abs().max().item() < ATOL


def _edit_config(folder, **keys):
    import json
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(keys)
    path.write_text(json.dumps(cfg))


def test_rope_parameters_theta_wins_over_top_level(tiny_model_factory):
    """transformers 5.x keeps rope_parameters' rope_theta and fills it from the top-level key only where it is
    missing; a config carrying both (edited by a tool) was read with the top-level one."""
    folder = tiny_model_factory("llama", seed=3)
    _edit_config(folder, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    hf = _hf(folder, "LlamaForCausalLM")
    assert hf.config.rope_parameters["rope_theta"] == 500000.0
    model, _ = load_model(folder, load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (model.forward_batch(ids) - ref).abs().max().item() < ATOL


L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ARCH_CLS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# (arch, model built with, config.json keys then set, keys then dropped): config.json files transformers 5.x reads
# differently from the plain keys (its built model is the reference; AutoConfig alone shows some before standardizing)
CONFIG_EDITS = [
    # a top-level original_max_position_embeddings overrides the rope object's (was ignored)
    ("llama", {}, {"rope_scaling": L3, "original_max_position_embeddings": 64}, ()),
    ("qwen2", {}, {"rope_scaling": {**L3, "original_max_position_embeddings": 64},
                   "original_max_position_embeddings": 128}, ()),
    ("mistral", {}, {"rope_parameters": {**L3, "rope_theta": 5e5, "original_max_position_embeddings": 128},
                     "original_max_position_embeddings": 64}, ()),
    # an empty rope_scaling is absent: rope_parameters holds the rope (was read as default rope, theta 10,000)
    ("llama", {}, {"rope_scaling": {}, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}},
     ("rope_theta",)),
    # without max_position_embeddings llama3's pretraining length is the config class's default (was 4096 for all)
    ("llama", {}, {"rope_scaling": L3}, ("rope_parameters", "max_position_embeddings")),
    ("mistral", {}, {"rope_scaling": L3}, ("rope_parameters", "max_position_embeddings")),
    ("qwen2", {}, {"rope_scaling": L3}, ("rope_parameters", "max_position_embeddings")),
    # without num_key_value_heads: MistralConfig's 8, Qwen2Config's 32 (were num_attention_heads), LlamaConfig's
    # num_attention_heads; an explicit null is num_attention_heads (MistralConfig refuses a null)
    ("mistral", {"num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 128}, {},
     ("num_key_value_heads",)),
    ("qwen2", {"num_attention_heads": 64, "num_key_value_heads": 32, "hidden_size": 256}, {},
     ("num_key_value_heads",)),
    ("llama", {"num_key_value_heads": 4}, {}, ("num_key_value_heads",)),
    ("qwen2", {"num_key_value_heads": 4}, {"num_key_value_heads": None}, ()),
]


@pytest.mark.parametrize("arch,build,edit,drop", CONFIG_EDITS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CONFIG_EDITS)])
def test_config_keys_read_as_transformers_builds_the_model(tiny_model_factory, arch, build, edit, drop):
    import json
    folder = tiny_model_factory(arch, seed=7, vocab_size=256, rope_theta=5e6, **build)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg = {k: v for k, v in cfg.items() if k not in drop}
    path.write_text(json.dumps({**cfg, **edit}))
    hf = _hf(folder, ARCH_CLS[arch])
    model, _ = load_model(folder, load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert (model.forward_batch(ids) - ref).abs().max().item() < ATOL


def test_mixed_sliding_layers_through_the_generator(tiny_model_factory):
    """Qwen2 with one full and one sliding layer, past the window, through the paged cache and the generator (the
    cache must keep every page: the full layer reads them all), greedy against HF's greedy."""
    from exl_core import Cache, Generator, Job, SamplerSettings
    folder = tiny_model_factory("qwen2", seed=5, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                hidden_size=128, num_attention_heads=2, num_key_value_heads=1)   # head dim 64
    hf = _hf(folder, "Qwen2ForCausalLM")
    model, _ = load_model(folder, load_tokenizer=False)
    assert [blk.self_attn.window for blk in model.layers] == [None, 6]
    assert model._native_stack().reason is None       # per-layer windows in the fused CPU stack (was per op)
    cache = Cache(model, max_tokens=256, page_size=8)
    assert cache.window is None
    prompt = torch.randint(3, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           eos_token_id=None, pad_token_id=0)[0, 30:].tolist()
    gen = Generator(model, cache, max_chunk_size=7)
    job = Job(prompt, max_new_tokens=12, sampler=SamplerSettings(temperature=0), stop_on_eos=False)
    gen.enqueue(job)
    while not job.done:
        gen.iterate()
    assert job.generated == want


def test_bf16_close_to_fp32(tiny_llama_dir):
    m32, _ = load_model(tiny_llama_dir, load_tokenizer=False)
    m16, _ = load_model(tiny_llama_dir, dtype=torch.bfloat16, load_tokenizer=False)
    ids = torch.randint(0, m32.config.vocab_size, (2, 9))
    a, b = m32.forward_batch(ids), m16.forward_batch(ids)
    assert m16.dtype == torch.bfloat16 and b.dtype == torch.float32
    rel = (a - b).norm() / a.norm()
    assert rel < 3e-2


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_logits_and_greedy_match_hf(smollm2_dir):
    hf = _hf(smollm2_dir, "LlamaForCausalLM")
    model, tok = load_model(smollm2_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        ref = hf(ids).logits.double()
        truth = _hf(smollm2_dir, "LlamaForCausalLM").double()(ids).logits
    out = model.forward_batch(ids).double()
    assert (out - ref).abs().max().item() < ATOL
    # Not further from float64 than HF's own fp32 run is.
    assert (out - truth).abs().max().item() <= max(ATOL, (ref - truth).abs().max().item())

    with torch.no_grad():
        hf_tokens = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    kv = [model.new_sequence_kv(ids.shape[1] + 40)]
    logits = model.forward_batch(ids, kv)[0, -1]
    mine = []
    for _ in range(32):
        nxt = int(torch.argmax(logits))
        mine.append(nxt)
        if nxt in tok.eos_token_ids:
            break
        logits = model.forward_batch(torch.tensor([[nxt]]), kv)[0, -1]
    assert mine == hf_tokens[:len(mine)]


@pytest.mark.parametrize("kind,rel_tol", [("bf16", 1e-2), ("int8", 2e-2)])
def test_lighter_head_close_to_exact(tiny_llama_dir, kind, rel_tol):
    """bf16/int8 heads (decode speed) stay within the stated error of the exact fp32 head, and the
    exact head is the default (the HF comparisons above use it)."""
    exact, _ = load_model(tiny_llama_dir, load_tokenizer=False)
    light, _ = load_model(tiny_llama_dir, load_tokenizer=False, head=kind)
    assert exact.lm_head.w_t.dtype == torch.float32 and not exact.lm_head.is_quantized
    assert light.lm_head.is_quantized == (kind == "int8")
    ids = torch.randint(0, exact.config.vocab_size, (2, 7))
    a, b = exact.forward_batch(ids).double(), light.forward_batch(ids).double()
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < rel_tol   # > 0: the lighter head really is a different weight


def test_lighter_head_rejects_unknown_kind(tiny_llama_dir):
    from exl_core.errors import ConfigError
    with pytest.raises(ConfigError, match="head='fp8'"):
        load_model(tiny_llama_dir, load_tokenizer=False, head="fp8")


def test_int8_head_refuses_a_vocab_its_packing_cannot_hold(tiny_model_factory):
    """Four 8-bit zero points an int32: a vocab of 1,001 was a bare ValueError from deep inside the packer."""
    from exl_core.errors import ConfigError
    folder = tiny_model_factory("llama", seed=4, vocab_size=1001)
    with pytest.raises(ConfigError, match="head='int8' needs vocab_size a multiple of 4.*got 1001; use head='bf16'"):
        load_model(folder, load_tokenizer=False, head="int8")
    assert load_model(folder, load_tokenizer=False, head="bf16")[0].config.vocab_size == 1001
