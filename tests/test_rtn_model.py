"""quantize_model_rtn: dense HF folder -> GPTQ / EXL2 folder, checked tensor by tensor and
(when the loader is available) end to end against HF transformers with dequantised weights."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from exl_core.formats import exl2, gptq
from exl_core.formats.base import detect_format
from exl_core.quantize.rtn import PROJ, quantize_model_rtn


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _layer(tensors, prefix):
    return {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")
            and "." not in k[len(prefix) + 1:]}


CASES = [
    ("gptq", dict(bits=4, group_size=32, sym=True, act_order=False)),
    ("gptq", dict(bits=3, group_size=32, sym=False, act_order=True, checkpoint_format="gptq_v2")),
    ("gptq", dict(bits=8, group_size=-1, sym=False, act_order=False)),
    ("exl2", dict(bits=4, group_size=32)),
    ("exl2", dict(bits=[(6, 0.25), (3, 0.75)], group_size=32, act_order=True, head_bits=6)),
]


@pytest.mark.parametrize("fmt, kw", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_folder_layout_and_error_bound(tiny_llama_dir, tmp_path, fmt, kw):
    dst = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt=fmt, **kw)
    src_t, dst_t = _tensors(tiny_llama_dir), _tensors(dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == fmt
    if fmt == "gptq":
        assert (qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"]) == \
            (kw["bits"], kw["group_size"], kw["act_order"], kw["sym"])
        assert qc["checkpoint_format"] == kw.get("checkpoint_format", "gptq")
    else:
        assert qc["head_bits"] == kw.get("head_bits", 16) and 2 < qc["bits"] < 9
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / f).exists() == (tiny_llama_dir / f).exists()
    assert detect_format(qc, set(dst_t)).name == fmt
    assert detect_format(None, set(dst_t)).name == fmt

    quantized = [PROJ.match(k).group(1) for k in src_t if PROJ.match(k)]
    if kw.get("head_bits"):
        quantized.append("lm_head")
    assert len(quantized) >= 14
    for prefix in quantized:
        assert f"{prefix}.weight" not in dst_t
        W = src_t[f"{prefix}.weight"].t().double()                  # (K, N)
        t = _layer(dst_t, prefix)
        K, N = W.shape
        if fmt == "gptq":
            lq = dict(qc, bits=kw.get("head_bits") if prefix == "lm_head" else qc["bits"])
            deq = gptq.dequantize_reference(t, lq)
            scale = t["scales"].double()[t["g_idx"].long()]
        else:
            deq = exl2.dequantize_reference(t, out_features=N)
            _, _, s, inv = exl2.reference_parts(t)
            scale = s[inv][:, :N]
        assert deq.shape == (K, N)
        assert torch.all((W - deq).abs() <= scale / 2 * (1 + 1e-9)), prefix
    for k, v in src_t.items():                                      # everything else: dense fp16
        if not PROJ.match(k) and not (k == "lm_head.weight" and kw.get("head_bits")):
            assert dst_t[k].dtype == torch.float16 and torch.equal(dst_t[k], v.half()), k


def test_mixed_exl2_widths_follow_proportions(tiny_llama_dir, tmp_path):
    dst = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt="exl2", bits=[(8, 0.3), (4, 0.7)], group_size=32)
    t = _layer(_tensors(dst), "model.layers.0.mlp.down_proj")     # K = intermediate = 96
    assert t["q_groups"].tolist()[0::2] == [8, 4, 4]


def _hf_reference_logits(src, dst, ids):
    """HF transformers forward with every quantized layer replaced by its float64 reference."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    dst_t = _tensors(dst)
    qprefixes = {k.rsplit(".", 1)[0] for k in dst_t if k.endswith((".qweight", ".q_weight"))}
    sd = {}
    for prefix in qprefixes:
        t = _layer(dst_t, prefix)
        deq = gptq.dequantize_reference(t, qc) if "qweight" in t else exl2.dequantize_reference(t)
        sd[prefix + ".weight"] = deq.t().float()                   # HF layout (out, in)
        if "bias" in t:
            sd[prefix + ".bias"] = t["bias"].float()
    for k, v in dst_t.items():
        if k.rsplit(".", 1)[0] not in qprefixes:
            sd[k] = v.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m or (cfg.tie_word_embeddings and m == "lm_head.weight") for m in missing)
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("fmt, kw", [("gptq", dict(bits=4, group_size=32, act_order=True, sym=False)),
                                     ("exl2", dict(bits=[(5, 0.5), (3, 0.5)], group_size=32, act_order=True))])
def test_loads_in_exl_core_and_matches_hf_with_dequantised_weights(tiny_llama_dir, tmp_path, fmt, kw):
    try:
        from exl_core.loader import load_model
        dst = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt=fmt, **kw)
        model, _ = load_model(dst, load_tokenizer=False)
    except ImportError as e:                 # the model stack is being written by others
        pytest.skip(f"exl_core model stack not importable yet: {e}")
    ids = torch.randint(0, 1000, (2, 11))
    ref = _hf_reference_logits(tiny_llama_dir, dst, ids)
    with torch.no_grad():
        out = model.forward_batch(ids).double()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=2e-3)


TEXT = ("The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed across the Atlantic "
        "Ocean and reached the islands of the Caribbean. Water boils at 100 degrees Celsius at sea "
        "level, and freezes at zero degrees.")


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["gptq", "exl2"])
def test_smollm2_rtn_8bit_predicts_like_dense(smollm2_dir, tmp_path, fmt):
    """Real weights through the whole folder pipeline: 8-bit RTN keeps next-token argmax on real
    text (measured 0.98 agreement). 4-bit RTN on this 135M model only agrees ~0.45 (no
    calibration, no clipping search), so it is not a correctness signal and is not asserted."""
    transformers = pytest.importorskip("transformers")
    dst = quantize_model_rtn(smollm2_dir, tmp_path / "q", fmt=fmt, bits=8, group_size=128)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    dense = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = dense(ids).logits.double()
    got = _hf_reference_logits(smollm2_dir, dst, ids)
    agree = (want.argmax(-1) == got.argmax(-1)).double().mean().item()
    assert agree > 0.9, agree
