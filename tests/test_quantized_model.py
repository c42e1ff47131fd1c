"""A whole quantized model equals the dense model built from its float64-dequantised weights.

The reference weights come from each format's file-level `dequantize_reference` (computed
straight from the tensors in the file), not from the kernel layout the loader produces.
"""
from __future__ import annotations

import pytest
import torch

from exl_core.config import load_config
from exl_core.formats import exl2, gptq
from exl_core.formats.safetensors_io import WeightReader
from exl_core.loader import load_model
from exl_core.model.linear import QuantLinear
from exl_core.quantize.rtn import quantize_model_rtn

FILE_TENSORS = {"gptq": ("qweight", "qzeros", "scales", "g_idx", "bias"),
                "exl2": ("q_weight", "q_invperm", "q_scale", "q_scale_max", "q_groups", "bias")}


def dense_twin(model, folder, fmt):
    """Replace every quantized layer of `model` by a dense one holding the file-level reference."""
    reader = WeightReader(folder)
    qc = load_config(folder).quantization_config
    n = 0
    for name, mod in list(model.linear_layers()):
        if not mod.is_quantized:
            continue
        tensors = {s: reader.get(f"{name}.{s}") for s in FILE_TENSORS[fmt] if reader.has(f"{name}.{s}")}
        if fmt == "gptq":
            w = gptq.dequantize_reference(tensors, qc)
        else:
            w = exl2.dequantize_reference(tensors)
        bias = tensors["bias"].float() if "bias" in tensors else None
        model.set_linear(name, QuantLinear.from_dense(w.t().to(torch.float32), bias))
        n += 1
    assert n > 0
    return model


VARIANTS = [
    ("gptq", dict(bits=4, group_size=32)),
    ("gptq", dict(bits=3, group_size=64, act_order=True)),
    ("gptq", dict(bits=2, group_size=128, sym=False)),
    ("gptq", dict(bits=8, group_size=-1)),
    ("exl2", dict(bits=4, group_size=32)),
    ("exl2", dict(bits=[(8, .1), (6, .1), (5, .2), (4, .2), (3, .2), (2, .2)], group_size=32, act_order=True)),
]


@pytest.mark.parametrize("fmt,kw", VARIANTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(VARIANTS)])
def test_tiny_quantized_equals_dequantised_dense(tiny_model_factory, tmp_path, fmt, kw):
    src = tiny_model_factory("llama", seed=3, hidden_size=128, intermediate_size=192)
    dst = tmp_path / f"q_{fmt}"
    quantize_model_rtn(src, dst, fmt=fmt, **kw)
    qmodel, _ = load_model(dst, load_tokenizer=False)
    assert any(m.is_quantized for _, m in qmodel.linear_layers())
    ref, _ = load_model(dst, load_tokenizer=False)
    dense_twin(ref, dst, fmt)
    ids = torch.randint(0, qmodel.config.vocab_size, (2, 13))
    a, b = qmodel.forward_batch(ids), ref.forward_batch(ids)
    assert (a - b).abs().max().item() < 1e-3


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_smollm2_quantized_equals_dequantised_dense(smollm2_dir, tmp_path, fmt):
    dst = tmp_path / fmt
    quantize_model_rtn(smollm2_dir, dst, fmt=fmt, bits=4, group_size=128 if fmt == "gptq" else 32)
    qmodel, tok = load_model(dst)
    ref, _ = load_model(dst, load_tokenizer=False)
    dense_twin(ref, dst, fmt)
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. " * 3)])
    a, b = qmodel.forward_batch(ids), ref.forward_batch(ids)
    assert (a - b).abs().max().item() < 1e-3
