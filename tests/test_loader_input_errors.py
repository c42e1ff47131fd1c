"""Weights that do not match config.json are refused at load with the file and the tensor named, where they used
to load and give wrong text: non-float dense tensors, layers past num_hidden_layers, biases the config does not
describe (either way, dense and EXL2), NaN / inf in a packed layer's scales."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl_core.errors import ConfigError, FormatError
from exl_core.loader import load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: Path, edit) -> None:
    for f in folder.glob("*.safetensors"):
        t = load_file(f)
        edit(t)
        save_file(t, f, metadata={"format": "pt"})


def _edit_config(folder: Path, **over) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(over)
    (folder / "config.json").write_text(json.dumps(cfg))


def _load(folder):
    return load_model(folder, load_tokenizer=False)


@pytest.mark.parametrize("name,dtype", [("model.layers.1.input_layernorm.weight", torch.int32),
                                        ("model.embed_tokens.weight", torch.int8),
                                        ("model.layers.0.self_attn.q_proj.weight", torch.bool)])
def test_non_float_dense_tensors_are_refused(tiny_llama_dir, tmp_path, name, dtype):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_tensors(folder, lambda t: t.__setitem__(name, t[name].to(dtype)) if name in t else None)
    with pytest.raises(FormatError, match=rf"model.safetensors: tensor '{name}' is {dtype}"):
        _load(folder)


def test_layers_past_num_hidden_layers_are_refused(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    _edit_config(folder, num_hidden_layers=n - 1)
    with pytest.raises(ConfigError, match=rf"config.json: num_hidden_layers={n - 1}.*model.layers.{n - 1}"):
        _load(folder)


def test_a_bias_the_config_does_not_describe_is_refused(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_tensors(folder, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias",
                                                  torch.ones(t["model.layers.0.self_attn.q_proj.weight"].shape[0])))
    with pytest.raises(ConfigError, match="non-zero 'model.layers.0.self_attn.q_proj.bias'.*without a bias"):
        _load(folder)


def test_zero_biases_of_old_gptq_files_load(tiny_llama_dir, tmp_path):
    """GPTQ-for-LLaMa / old AutoGPTQ wrote a zero .bias on every projection whatever the config: those load, with
    the logits of the file without them."""
    from exl_core.quantize.rtn import quantize_model_rtn
    folder = quantize_model_rtn(tiny_llama_dir, tmp_path / "gptq", fmt="gptq", bits=4, group_size=32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        ref = _load(folder)[0].forward_batch(ids)

    def zero_biases(t):
        for n in [n for n in t if n.endswith(".qweight")]:
            t[n[:-len("qweight")] + "bias"] = torch.zeros(t[n].shape[1], dtype=torch.float16)
    _edit_tensors(folder, zero_biases)
    with torch.inference_mode():
        assert torch.equal(_load(folder)[0].forward_batch(ids), ref)


def test_exl2_layers_honour_the_config_bias_flags(exl2_act_order_dir, tmp_path):
    """Dense files already failed on a missing bias; EXL2 layers ran without it."""
    folder = _copy(exl2_act_order_dir, tmp_path / "m")
    _edit_config(folder, attention_bias=True)
    with pytest.raises(FormatError, match=r"'model.layers.0.self_attn.q_proj.bias' is missing"):
        _load(folder)
    _load(exl2_act_order_dir)                                  # the folder as written loads


def test_non_finite_exl2_scale_is_refused_at_load(exl2_act_order_dir, tmp_path):
    folder = _copy(exl2_act_order_dir, tmp_path / "m")
    name = "model.layers.1.mlp.down_proj.q_scale_max"

    def poison(t):
        if name in t:
            t[name] = t[name].clone()
            t[name][0] = float("nan")
    _edit_tensors(folder, poison)
    with pytest.raises(FormatError, match="model.layers.1.mlp.down_proj.*scale holds NaN or inf") as err:
        _load(folder)
    assert str(folder) in str(err.value)                       # the folder that holds it


@pytest.mark.parametrize("name,dtype,bad", [
    ("model.layers.1.mlp.up_proj.weight", torch.float16, float("nan")),
    ("model.layers.0.input_layernorm.weight", torch.bfloat16, float("-inf")),
    ("model.embed_tokens.weight", torch.float32, float("inf"))])
def test_non_finite_dense_tensor_is_refused_at_load(tiny_llama_dir, tmp_path, name, dtype, bad):
    """NaN / inf in a dense tensor (here a dense model's) used to load and surface only as "logits contain NaN" at the
    first forward, naming no tensor."""
    folder = _copy(tiny_llama_dir, tmp_path / "m")

    def poison(t):
        if name in t:
            t[name] = t[name].to(dtype)
            t[name].view(-1)[7] = bad
    _edit_tensors(folder, poison)
    with pytest.raises(FormatError, match=rf"{name}' holds NaN or inf") as err:
        _load(folder)
    assert str(folder) in str(err.value)


def test_nonfinite_check_reads_every_dtype_exactly():
    from exl_core.loader import has_nonfinite
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        big = torch.finfo(dtype).max
        t = torch.tensor([0.0, -0.0, big, -big, torch.finfo(dtype).tiny, 1e-45], dtype=dtype)
        assert not has_nonfinite(t) and not has_nonfinite(t[:0])
        for v in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[3] = v
            assert has_nonfinite(u), (dtype, v)


def test_tensors_the_model_never_reads_are_named_in_a_warning(tiny_llama_dir, tmp_path, recwarn):
    """q_norm / k_norm weights (Qwen3-style) in a folder whose config.json says Llama were skipped without a word;
    the model then is not the one the weights were trained as."""
    _load(tiny_llama_dir)
    assert not [w for w in recwarn if "not used by" in str(w.message)]
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16),
                                              "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    with pytest.warns(RuntimeWarning, match=r"1 tensor\(s\) are not used by LlamaForCausalLM: "
                                            r"model\.layers\.0\.self_attn\.q_norm\.weight;"):
        _load(folder)
