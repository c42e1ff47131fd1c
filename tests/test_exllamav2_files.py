"""Files crossing between ExLlamaV2 0.3.2 and exl_core, judged by the other side's own code.

The fixture tests/data/exllamav2/ was made by bench/exllamav2_compat.py on the H200 machine:
ExLlamaV2's converter turned a tiny random Llama (2 layers, hidden 256, vocabulary 512) into
EXL2 4.0 bpw (`exlv2_conv/`), and ExLlamaV2's forward computed logits of fixed token ids on that
folder and on exl_core's own EXL2 and GPTQ conversions of the same model (`ours_exl2/`,
`ours_gptq/`); its dequantised weights were stored too. None of these numbers comes from
exl_core, so every assertion below is against an independent implementation.

Tolerances: ExLlamaV2 dequantises to fp16 and runs activations in fp16, exl_core here runs
fp32 from the same integers. Weights must agree to ExLlamaV2's fp16 precision (see _close16);
logits within 1% of the logit range (measured: 0.3%), with the same argmax wherever the top two
logits are further apart than that.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl_core.loader import load_model

FIX = Path(__file__).resolve().parent / "data" / "exllamav2"
pytestmark = pytest.mark.skipif(not (FIX / "exlv2_conv" / "exllamav2_reference.safetensors").is_file(),
                                reason="ExLlamaV2 fixture not present (bench/exllamav2_compat.py makes it)")


@pytest.fixture(scope="module")
def ref():
    from safetensors.torch import load_file
    return load_file(str(FIX / "exlv2_conv" / "exllamav2_reference.safetensors"))


def _logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    span = (theirs.amax(-1) - theirs.amin(-1)).max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= 0.01 * span, f"max |diff| {err:.4g} vs logit range {span:.4g}"
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.01 * span
    assert clear.any()
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


def test_exllamav2_written_folder_is_detected_as_exl2():
    model, _ = load_model(FIX / "exlv2_conv", load_tokenizer=False)
    assert model.config.quant_method == "exl2"
    quantized = [n for n, layer in model.linear_layers() if layer.is_quantized]
    assert len(quantized) == 2 * 7 + 1            # every projection and the 6-bit head


def _close16(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Equal up to ExLlamaV2's fp16 arithmetic: it keeps q_scale_max / 256 in fp16, which for
    small scales is subnormal (about 2^-8 relative precision), then rounds scale and product to
    fp16. A misread bit order or group would be off by O(1) relative instead."""
    return bool(((ours - theirs.double()).abs() <= 2.0 ** -8 * ours.abs() + 2.0 ** -14).all())


def test_exllamav2_written_weights_dequantise_like_exllamav2(ref):
    """Every projection of ExLlamaV2's file, dequantised by exl_core, equals ExLlamaV2's own
    reconstruction. ExLlamaV2 reorders the MLP's intermediate channels at load time (gate/up
    output columns and down_proj input rows by one permutation, which leaves the MLP's
    function unchanged), so those are compared through that permutation, recovered from gate."""
    model, _ = load_model(FIX / "exlv2_conv", load_tokenizer=False)
    layers = dict(model.linear_layers())
    mine = {n: layers[n].dense_weight(torch.float64).t() for n in layers}      # (in, out) like ExLlamaV2's
    theirs = {n: ref[f"exlv2.dq.{n}"] for n in layers if f"exlv2.dq.{n}" in ref}
    assert len(theirs) == len(layers) == 2 * 7 + 1
    for i in range(2):
        p = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            assert _close16(mine[f"{p}.{n}"], theirs[f"{p}.{n}"]), f"{p}.{n}"
        gate, up, down = (f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
        sigma = torch.cdist(theirs[gate].double().t(), mine[gate].t()).argmin(1)   # their column j = our sigma[j]
        assert torch.equal(sigma.sort().values, torch.arange(sigma.numel())), "no one-to-one channel match"
        assert _close16(mine[gate][:, sigma], theirs[gate]), gate
        assert _close16(mine[up][:, sigma], theirs[up]), up
        assert _close16(mine[down][sigma], theirs[down]), down
    assert _close16(mine["lm_head"], theirs["lm_head"])


def _hf_unmasked_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """HF's Llama (fp32, eager) holding exl_core's dequantisation of `folder`, attention unmasked."""
    import json
    import transformers
    model, _ = load_model(folder, load_tokenizer=False)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    sd = {f"{n}.weight": layer.dense_weight(torch.float32) for n, layer in model.linear_layers()}
    sd["model.embed_tokens.weight"] = model.embed_weight.float()
    sd["model.norm.weight"] = model.norm.weight.float()
    for i, b in enumerate(model.layers):
        sd[f"model.layers.{i}.input_layernorm.weight"] = b.input_layernorm.weight.float()
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = b.post_attention_layernorm.weight.float()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    b, t = ids.shape
    with torch.no_grad():
        return hf(ids, attention_mask=torch.zeros(b, 1, t, t)).logits     # additive mask of zeros: no masking


@pytest.mark.parametrize("folder", ["exlv2_conv", "ours_exl2", "ours_gptq"])
def test_exllamav2_forward_reads_the_folder_as_exl_core_does(ref, folder):
    """exlv2_conv: ExLlamaV2's own file; ours_*: exl_core's converter output, run by ExLlamaV2.

    ExLlamaV2's logits were taken without a cache, where (without flash-attn) it attends
    bidirectionally, so the reference is HF's Llama with exl_core's dequantised weights and no
    causal mask. exl_core's own forward is checked against HF's elsewhere (test_model_vs_hf)."""
    key = "exlv2" if folder == "exlv2_conv" else folder
    if f"{key}.logits" not in ref:
        pytest.fail(f"ExLlamaV2 could not run {folder} when the fixture was made (see bench/exllamav2_compat.py)")
    _logits_close(_hf_unmasked_logits(FIX / folder, ref["ids"].long()), ref[f"{key}.logits"].float())
