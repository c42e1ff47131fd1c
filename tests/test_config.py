"""config.json → ModelConfig: registry, rope variants, and errors naming file and key."""
import json

import pytest

from exl_core.config import load_config
from exl_core.errors import ConfigError

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}


def write(tmp_path, **over):
    d = dict(BASE)
    for k, v in over.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


def test_llama_defaults(tmp_path):
    c = load_config(write(tmp_path))
    assert (c.head_dim, c.num_key_value_heads, c.tie_word_embeddings, c.attention_bias) == (16, 2, False, False)
    assert c.rope_scaling is None and c.sliding_window is None and c.rope_theta == 10000.0


def test_qwen2_bias_and_sliding_flag(tmp_path):
    c = load_config(write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False))
    assert c.attention_bias is True and c.sliding_window is None
    c = load_config(write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=True,
                          max_window_layers=0))
    assert c.sliding_window == 32 and c.uniform_window == 32 and c.layer_window(1) == 32
    # HF's Qwen2Config: layers below max_window_layers (default 28) attend to every key
    c = load_config(write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=True))
    assert c.sliding_window is None and c.layer_window(1) is None
    c = load_config(write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=True,
                          max_window_layers=1))
    assert (c.layer_window(0), c.layer_window(1), c.uniform_window) == (None, 32, None)
    c = load_config(write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=True,
                          max_window_layers=0, layer_types=["sliding_attention", "full_attention"]))
    assert (c.layer_window(0), c.layer_window(1), c.uniform_window) == (32, None, None)
    # attention_bias / mlp_bias are Llama's keys: HF's Qwen2 ignores them
    c = load_config(write(tmp_path, architectures=["Qwen2ForCausalLM"], attention_bias=False, mlp_bias=True))
    assert c.attention_bias is True and c.mlp_bias is False


@pytest.mark.parametrize("arch,extra", [("MistralForCausalLM", {"model_type": "mistral"}),
                                         ("Qwen2ForCausalLM", {"model_type": "qwen2", "use_sliding_window": True,
                                                               "max_window_layers": 0})])
def test_missing_sliding_window_key_is_hfs_default(tmp_path, arch, extra):
    """Without a `sliding_window` key HF's MistralConfig / Qwen2Config slide by 4096 (exl_core attended to every key,
    so logits past 4096 tokens differed); an explicit null is no window for both."""
    transformers = pytest.importorskip("transformers")
    d = dict(BASE, architectures=[arch], **extra)
    for value in ("missing", None):
        if value != "missing":
            d["sliding_window"] = value
        (tmp_path / "config.json").write_text(json.dumps(d))
        hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
        assert load_config(tmp_path).sliding_window == hf.sliding_window == (4096 if value == "missing" else None)


@pytest.mark.parametrize("arch,model_type", [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                                             ("Qwen2ForCausalLM", "qwen2")])
def test_missing_kv_heads_and_max_positions_are_hfs_defaults(tmp_path, arch, model_type):
    """Without num_key_value_heads / max_position_embeddings HF's config classes take their own defaults (KV heads:
    LlamaConfig num_attention_heads, MistralConfig 8, Qwen2Config 32; positions: 2048, 131072, 32768); exl_core took
    num_attention_heads and 4096 for every architecture. An explicit null KV count is num_attention_heads (Llama,
    Qwen2; MistralConfig refuses it)."""
    transformers = pytest.importorskip("transformers")
    d = dict(BASE, architectures=[arch], model_type=model_type, num_attention_heads=64, hidden_size=1024)
    del d["num_key_value_heads"]
    for value in ("missing", None):
        if value != "missing":
            if arch == "MistralForCausalLM":
                continue
            d["num_key_value_heads"] = value
        (tmp_path / "config.json").write_text(json.dumps(d))
        hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
        c = load_config(tmp_path)
        assert (c.num_key_value_heads, c.max_position_embeddings) == (hf.num_key_value_heads,
                                                                      hf.max_position_embeddings)
        assert c.max_position_embeddings == {"llama": 2048, "mistral": 131072, "qwen2": 32768}[model_type]
        if value == "missing":
            assert c.num_key_value_heads == {"llama": 64, "mistral": 8, "qwen2": 32}[model_type]
        else:
            assert c.num_key_value_heads == 64


def test_mistral_window_and_rope_variants(tmp_path):
    c = load_config(write(tmp_path, architectures=["MistralForCausalLM"], sliding_window=4096))
    assert c.sliding_window == 4096
    c = load_config(write(tmp_path, rope_scaling={"type": "linear", "factor": 4}))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    assert load_config(write(tmp_path, rope_scaling=l3)).rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("over,needle", [
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"num_attention_heads": "four"}, "'num_attention_heads' must be int"),
    ({"vocab_size": 0}, "'vocab_size' must be > 0"),
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    # 4 heads and MistralConfig's 8 KV heads: the message says where the 8 comes from
    ({"architectures": ["MistralForCausalLM"], "num_key_value_heads": None},
     "num_key_value_heads (8, MistralForCausalLM's default where config.json leaves the key out)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2}}, "'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2}}, "low_freq_factor"),
])
def test_bad_configs_name_file_and_key(tmp_path, over, needle):
    folder = write(tmp_path, **over)
    with pytest.raises(ConfigError) as e:
        load_config(folder)
    assert needle in str(e.value) and "config.json" in str(e.value)


def test_missing_and_invalid_json(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_deeply_nested_json_is_invalid_json(tmp_path):
    """json.loads raised a bare RecursionError on a document nested past Python's recursion limit."""
    (tmp_path / "config.json").write_text('{"a":' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON \(nested too deeply\)"):
        load_config(tmp_path)


def test_legacy_quantize_config_json_is_merged(tmp_path):
    write(tmp_path)
    (tmp_path / "quantize_config.json").write_text('{"bits": 4, "group_size": 128, "desc_act": false}')
    c = load_config(tmp_path)
    assert c.quant_method == "gptq" and c.quantization_config["bits"] == 4
