"""config.json values that used to crash deep inside Python/torch or load silently wrong are refused with a
ConfigError naming config.json and the key: hidden_act, GPTQ quantization_config, head_dim / rope fields, special
token ids, architectures, and a file or None where a model folder is expected."""
import json

import pytest
import torch

import exl_core as exl
from exl_core.config import load_config
from exl_core.errors import ConfigError
from exl_core.formats import gptq
from test_config import write   # BASE config: vocab_size 100, head_dim 16


def refused(folder, field):
    """load_config(folder) raises ConfigError naming config.json and `field`."""
    with pytest.raises(ConfigError) as e:
        load_config(folder)
    assert "config.json" in str(e.value) and f"'{field}" in str(e.value), str(e.value)
    return str(e.value)


# -- hidden_act ---------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["gelu", "relu", "SiLU", 1])
def test_hidden_act_other_than_silu_is_refused(tmp_path, act):
    refused(write(tmp_path, hidden_act=act), "hidden_act")


@pytest.mark.parametrize("act", ["silu", "swish", None])   # None: the key is left out
def test_hidden_act_silu_spellings_and_absent_load(tmp_path, act):
    assert load_config(write(tmp_path, hidden_act=act)).architecture == "LlamaForCausalLM"


# -- GPTQ quantization_config -------------------------------------------------------------------
def _sequential_layer():
    """64 x 32 at 4 bits in 2 groups of 32 rows, without g_idx (groups come from group_size)."""
    t = gptq.quantize_rtn(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), bits=4, group_size=32)
    del t["g_idx"]
    return t


@pytest.mark.parametrize("qc,field", [
    ({"bits": 4, "group_size": 0}, "group_size"),          # was ZeroDivisionError
    ({"bits": 4, "group_size": -2}, "group_size"),
    ({"bits": 4, "group_size": "128"}, "group_size"),      # was TypeError
    ({"bits": 4, "group_size": 32.5}, "group_size"),
    ({"bits": 4, "group_size": True}, "group_size"),
    ({"bits": "four", "group_size": 32}, "bits"),          # was ValueError
    ({"bits": [4], "group_size": 32}, "bits"),             # was TypeError
    ({"bits": 4.9, "group_size": 32}, "bits"),             # was truncated to 4
    ({"bits": True, "group_size": 32}, "bits"),
])
def test_gptq_quant_config_values_are_type_checked(qc, field):
    t = _sequential_layer()
    for call in (lambda: gptq.read_layer(t, 64, 32, "model.layers.0.mlp.up_proj", qc),
                 lambda: gptq.dequantize_reference(t, qc)):
        with pytest.raises(ConfigError) as e:
            call()
        assert f"config.json (or quantize_config.json): key 'quantization_config.{field}'" in str(e.value), str(e.value)


def test_gptq_integral_floats_and_one_group_still_load():
    t = _sequential_layer()
    want = gptq.dequantize_reference(t, {"bits": 4, "group_size": 32})
    # 32.0 was a NotImplementedError from torch
    assert torch.equal(gptq.dequantize_reference(t, {"bits": 4.0, "group_size": 32.0}), want)
    assert gptq.read_layer(t, 64, 32, "L", {"bits": 4.0, "group_size": 32.0}).meta["bits"] == 4
    one = gptq.quantize_rtn(torch.randn(64, 32), bits=4, group_size=-1)
    del one["g_idx"]
    assert gptq.read_layer(one, 64, 32, "L", {"bits": 4, "group_size": -1}).meta["bits"] == 4


# -- head_dim and rope --------------------------------------------------------------------------
Q2W = {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8}
L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("over,field", [
    ({"head_dim": -64}, "head_dim"),                       # was RuntimeError in model/rope.py
    ({"head_dim": 0}, "head_dim"),
    ({"rope_theta": 0}, "rope_theta"),                     # loaded, then generated NaN
    ({"rope_theta": -10000.0}, "rope_theta"),
    ({"rope_theta": True}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": "abc"}}, "rope_parameters.rope_theta"),   # was a bare ValueError
    ({"rope_parameters": {"rope_theta": 0}}, "rope_parameters.rope_theta"),
    ({"rope_parameters": "default"}, "rope_parameters"),
    ({"rope_scaling": [2.0]}, "rope_scaling"),
    ({"rope_scaling": {**L3, "factor": -8}}, "rope_scaling.factor"),
    ({"rope_scaling": {**L3, "factor": True}}, "rope_scaling.factor"),
    ({"rope_scaling": {**L3, "low_freq_factor": 0}}, "rope_scaling.low_freq_factor"),   # was ZeroDivisionError
    ({"rope_scaling": {**L3, "high_freq_factor": 0}}, "rope_scaling.high_freq_factor"),
    ({"rope_scaling": {**L3, "high_freq_factor": 1.0}}, "rope_scaling.high_freq_factor"),   # == low: divides by 0
    ({"rope_scaling": {**L3, "original_max_position_embeddings": -1}},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {**L3, "original_max_position_embeddings": 8192.5}},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": L3, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),   # top level
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling.factor"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"type": "linear", "factor": False}}, "rope_scaling.factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {**L3, "rope_theta": 5e5, "low_freq_factor": 0}}, "rope_parameters.low_freq_factor"),
    # one rope a layer type (Gemma-style) was read as the default rope with theta 10,000
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "rope_parameters"),
    ({**Q2W, "layer_types": ["sliding_attention"]}, "layer_types"),                  # 1 entry for 2 layers
    ({**Q2W, "layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({**Q2W, "max_window_layers": -1}, "max_window_layers"),
])
def test_bad_head_dim_and_rope_fields(tmp_path, over, field):
    refused(write(tmp_path, **over), field)


def test_good_rope_fields_still_load(tmp_path):
    c = load_config(write(tmp_path, rope_parameters={**L3, "rope_theta": 500000}))
    assert c.rope_theta == 500000.0 and c.rope_scaling == {**L3, "original_max_position_embeddings": 8192.0}
    # llama3's pretraining length as transformers 5.x builds the model: a top-level key overrides the rope object's
    # (test_model_vs_hf checks the logits), else max_position_embeddings
    no_len = {k: v for k, v in L3.items() if k != "original_max_position_embeddings"}
    c = load_config(write(tmp_path, max_position_embeddings=2048, original_max_position_embeddings=1024,
                          rope_scaling=no_len))
    assert c.rope_scaling["original_max_position_embeddings"] == 1024.0
    c = load_config(write(tmp_path, original_max_position_embeddings=1024, rope_parameters={**L3, "rope_theta": 5e5}))
    assert c.rope_scaling["original_max_position_embeddings"] == 1024.0
    c = load_config(write(tmp_path, max_position_embeddings=2048, rope_scaling=no_len))
    assert c.rope_scaling["original_max_position_embeddings"] == 2048.0
    # an empty rope_scaling is absent for transformers (`rope_scaling or rope_parameters`): rope_parameters is read
    c = load_config(write(tmp_path, rope_scaling={}, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 5e5}))
    assert (c.rope_theta, c.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 2.0})
    # transformers 5.x reads one rope object: a legacy rope_scaling wins, its theta from the top level if it has none
    c = load_config(write(tmp_path, rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert (c.rope_theta, c.rope_scaling) == (1e4, {"rope_type": "linear", "factor": 2.0})
    c = load_config(write(tmp_path, head_dim=32, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2}))
    assert (c.head_dim, c.rope_theta, c.rope_scaling["factor"]) == (32, 1e6, 2.0)


# -- special token ids (BASE vocab_size is 100) -------------------------------------------------
@pytest.mark.parametrize("over,field", [
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"eos_token_id": ["a"]}, "eos_token_id[0]"),
    ({"eos_token_id": [2, 100]}, "eos_token_id[1]"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": 1000000}, "eos_token_id"),
    ({"eos_token_id": 2.5}, "eos_token_id"),
    ({"eos_token_id": {"id": 2}}, "eos_token_id"),
    ({"bos_token_id": -1}, "bos_token_id"),
    ({"bos_token_id": 100}, "bos_token_id"),
    ({"bos_token_id": True}, "bos_token_id"),
    ({"pad_token_id": "0"}, "pad_token_id"),
])
def test_bad_special_token_ids(tmp_path, over, field):
    msg = refused(write(tmp_path, **over), field)
    assert "vocab_size" in msg or "must be int" in msg


def test_good_special_token_ids_load(tmp_path):
    folder = write(tmp_path, bos_token_id=1, eos_token_id=[2, 99])
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "pad_token_id": None}))   # HF writes null when unset
    c = load_config(folder)
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (1, [2, 99], None)
    assert load_config(write(tmp_path, eos_token_id=2.0)).eos_token_ids == [2]   # was "'float' is not iterable"
    # pad_token_id is never read by the model; old conversions write -1 for none: out of range reads as none
    assert load_config(write(tmp_path, pad_token_id=-1)).pad_token_id is None
    assert load_config(write(tmp_path, pad_token_id=100)).pad_token_id is None
    assert load_config(write(tmp_path, pad_token_id=3)).pad_token_id == 3


# -- architectures and other keys ---------------------------------------------------------------
@pytest.mark.parametrize("archs", [[["x"]], [1], ["LlamaForCausalLM", None]])
def test_architectures_must_be_class_names(tmp_path, archs):
    refused(write(tmp_path, architectures=archs), "architectures")   # [["x"]] was "unhashable type"


def test_use_sliding_window_must_be_a_bool(tmp_path):
    # the string "false" is truthy: the window was switched on
    refused(write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window="false"),
            "use_sliding_window")


# -- a file or None where a model folder is expected --------------------------------------------
def test_a_file_is_not_a_model_folder(tmp_path):
    write(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for load in (load_config, lambda p: exl.load_model(p, load_tokenizer=False)):
        with pytest.raises(ConfigError, match="model folder.*is expected") as e:
            load(weights)
        assert str(weights) in str(e.value)   # not "not valid JSON"
    assert load_config(tmp_path / "config.json").vocab_size == 100   # the config file itself still works


@pytest.mark.parametrize("path", [None, 123, ""])
def test_load_config_needs_a_folder_path(path):
    import exl_core
    with pytest.raises(ConfigError, match="model folder path"):   # None was a TypeError from pathlib
        load_config(path)
    with pytest.raises(ConfigError, match="model folder path"):
        exl_core.load_model(path)


def test_config_json_that_is_a_folder(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: is a folder"):   # was IsADirectoryError
        load_config(tmp_path)
    (tmp_path / "config.json").rmdir()
    write(tmp_path)
    (tmp_path / "quantize_config.json").mkdir()
    with pytest.raises(ConfigError, match="quantize_config.json: is a folder"):
        load_config(tmp_path)
