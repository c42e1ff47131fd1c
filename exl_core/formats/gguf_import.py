"""GGUF (llama.cpp) → HF-style dense folder, so the rest of exl_core only ever reads safetensors.

    import_gguf("model.gguf", "out/")   →  out/config.json, out/model.safetensors (fp16, HF names),
                                           out/tokenizer.json, tokenizer_config.json, ...

llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) permutes the rows of q_proj/k_proj
so that rotary pairs are interleaved (GPT-J style) instead of split in halves (NeoX/HF style):

    HF row layout per head:   [x0 .. x_{d/2-1} | y0 .. y_{d/2-1}]      reshape (H, 2, d/2, ...)
    GGUF row layout per head: [x0 y0 x1 y1 ...]                         reshape (H, d/2, 2, ...)

We undo that here. The output folder is built under a temporary name and renamed into place,
so an interrupted import never leaves a folder that looks complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..errors import ConfigError, FormatError

# Bump when the output of an import changes, so cached imports (default_model) are redone.
IMPORT_VERSION = 4
MARKER_NAME = "exl_import.json"



@dataclass(frozen=True)
class _Arch:
    hf_arch: str                 # config.json "architectures" entry
    model_type: str
    permute_qk: bool             # llama.cpp interleaved the q/k rotary rows (LlamaModel only)
    extra: tuple = ()            # (key, value) pairs added to config.json


# GGUF general.architecture -> HF equivalent. All share Llama's tensor layout.
SUPPORTED_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", True),
    # without attention.sliding_window the GGUF attends to every key (llama.cpp); a config.json without the key
    # would get MistralConfig's default window (4096): null says none (the GGUF's window, where given, replaces it)
    "mistral": _Arch("MistralForCausalLM", "mistral", True, (("sliding_window", None),)),
    # Qwen2's converter does not permute; q/k/v carry biases
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", False, (("use_sliding_window", False),)),
}

# Per-block GGUF tensor suffix -> HF name suffix (under model.layers.{i}.)
_BLOCK_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that have no HF weight (derived from config instead).
_SKIP = {"rope_freqs.weight"}


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _number(reader, key: str, path: str, default: Any = None, kind: type = int, minimum: Optional[int] = None):
    """Metadata `key` as a number of `kind` (int: a whole one), `default` where it is absent: a string, an array or
    a fraction stored there is a ConfigError naming the file and the key, not a ValueError from int()/float()."""
    v = _field(reader, key)
    if v is None:
        return default
    whole = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not whole):
        raise ConfigError(f"{path}: GGUF metadata '{key}' is {v!r:.60}; "
                          + ("a whole number" if kind is int else "a number") + " is expected")
    v = kind(v)
    if minimum is not None and v < minimum:
        raise ConfigError(f"{path}: GGUF metadata '{key}' is {v}; it must be at least {minimum}")
    return v


def _f32(x) -> float:
    """GGUF stores floats as f32: print the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def gguf_to_hf_name(name: str, path: str = "<gguf>") -> Optional[str]:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for skipped tensors."""
    if name in _SKIP:
        return None
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_MAP:
        return f"model.layers.{int(parts[1])}.{_BLOCK_MAP[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_MAP:
        return f"{_TOP_MAP[parts[0]]}.{parts[1]}"
    raise FormatError(f"{path}: tensor '{name}' has no known Llama (HF) equivalent; "
                      "this GGUF holds a layout exl_core cannot import")


def unpermute_rope_rows(w: np.ndarray, n_head: int, head_dim: Optional[int] = None,
                        where: str = "tensor 'attn_q'") -> np.ndarray:
    """Undo llama.cpp's q/k row interleave. w: (n_head*head_dim, ...) or (n_head*head_dim,)."""
    shape = w.shape
    head_dim = head_dim or shape[0] // n_head
    if shape[0] != n_head * head_dim or head_dim % 2:
        raise FormatError(f"{where} has {shape[0]} rows, not {n_head} heads x {head_dim} "
                          "(an even head size); it does not match the GGUF's metadata")
    return (w.reshape(n_head, head_dim // 2, 2, -1)
             .swapaxes(1, 2)
             .reshape(shape))


def llama3_freq_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """Per-frequency divisors of HF's "llama3" rope_scaling, i.e. what llama.cpp stores as
    rope_freqs.weight: (head_dim/2,) float64."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old = float(original_max_position_embeddings)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high_freq_factor, 1.0,
                    np.where(wavelen > old / low_freq_factor, factor, medium))


def _rope_scaling_from_factors(ff: np.ndarray, head_dim: int, theta: float,
                               orig_ctx: Optional[int], path: str) -> Optional[dict]:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor (Llama 3.1+ GGUFs
    carry the scaling only there). None when every factor is 1."""
    ff = np.asarray(ff, dtype=np.float64).reshape(-1)
    if ff.shape[0] != head_dim // 2:
        raise FormatError(f"{path}: tensor 'rope_freqs.weight' has {ff.shape[0]} values, expected "
                          f"head_dim/2 = {head_dim // 2}")
    if np.allclose(ff, 1.0):
        return None
    factor = round(float(ff.max()), 4)
    candidates = [(1.0, 4.0, orig_ctx or 8192), (1.0, 4.0, 8192)]
    # the medium band gives smooth = a/wavelen - b; with low_freq_factor = 1 that fixes the rest
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    mid = (ff > 1 + 1e-6) & (ff < factor - 1e-6)
    smooth = (factor / ff[mid] - 1) / (factor - 1)
    if orig_ctx and mid.any() and (smooth > 0).all():   # known context: solve for hf directly
        hf_est = float(np.mean(1 + (orig_ctx / wavelen[mid] - 1) / smooth))
        candidates.insert(0, (1.0, round(hf_est, 3), int(orig_ctx)))
    if mid.sum() >= 2:
        a, b = np.polyfit(1 / wavelen[mid], smooth, 1)
        a, b = float(a), -float(b)
        if a > 0 and b > 0:   # smooth = (old/wavelen - 1)/(hf - 1): a = old/(hf-1), b = 1/(hf-1)
            candidates.insert(0, (1.0, round(1 + 1 / b, 3), int(round(a / b))))
    for lf, hf, old in candidates:
        pred = llama3_freq_factors(head_dim, theta, factor, lf, hf, old)
        if np.allclose(pred, ff, rtol=1e-3, atol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(lf),
                    "high_freq_factor": float(hf), "original_max_position_embeddings": int(old)}
    raise FormatError(f"{path}: tensor 'rope_freqs.weight' holds per-frequency RoPE factors that "
                      "match no llama3 rope_scaling; exl_core cannot represent them")


def _config_from_gguf(reader, path: str, has_output: bool, embed_rows: int) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise FormatError(f"{path}: GGUF architecture '{arch}' is not supported "
                          f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    spec = SUPPORTED_ARCHS[arch]

    def num(key: str, default: Any = None, kind: type = int, minimum: Optional[int] = None):
        return _number(reader, f"{arch}.{key}", path, default, kind, minimum)

    def need(key: str, kind: type = int, minimum: Optional[int] = None):
        v = num(key, kind=kind, minimum=minimum)
        if v is None:
            raise ConfigError(f"{path}: GGUF metadata lacks '{arch}.{key}', needed for config.json")
        return v

    hidden = need("embedding_length")
    heads = need("attention.head_count", minimum=1)        # the divisor of the default head size
    kv_heads = num("attention.head_count_kv", heads, minimum=1)
    head_dim = num("attention.key_length", hidden // heads, minimum=1)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = num("vocab_size", len(tokens) if tokens else embed_rows)
    cfg = {
        "architectures": [spec.hf_arch],
        "model_type": spec.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon", float)),
        "rope_theta": _f32(num("rope.freq_base", 10000.0, float)),
        "max_position_embeddings": num("context_length", 2048),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float16",
    }
    rot = num("rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise FormatError(f"{path}: rope.dimension_count={rot} but head_dim={head_dim}: partial "
                          "rotary embeddings are not a Llama-family layout")
    cfg["rope_scaling"] = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    factor = num("rope.scaling.factor", kind=float)
    if scaling_type in ("linear", "yarn") and factor is not None:
        cfg["rope_scaling"] = {"type": scaling_type, "rope_type": scaling_type,
                               "factor": factor}
        orig = num("rope.scaling.original_context_length")
        if scaling_type == "yarn" and orig is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = orig
    cfg.update(dict(spec.extra))
    sw = num("attention.sliding_window")
    if sw:
        cfg["sliding_window"] = sw
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        v = _number(reader, f"tokenizer.ggml.{key}", path)
        if v is not None:
            cfg[hf_key] = v
    return cfg


def _stop_ids(reader, cfg: dict, path: str) -> list[int]:
    """eos plus llama.cpp's end-of-turn / end-of-message ids (chat models stop on those)."""
    ids = [cfg["eos_token_id"]] if "eos_token_id" in cfg else []
    for key in ("eot_token_id", "eom_token_id"):
        v = _number(reader, f"tokenizer.ggml.{key}", path)
        if v is not None and v not in ids:
            ids.append(v)
    return ids


# llama.cpp pre-tokenizer types that split every digit on its own before the GPT-2 regex
# (llama-vocab.cpp); transformers' GGUF tokenizer conversion drops that split, so we restore it.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def _fix_pre_tokenizer(tok_json: Path, pre: Optional[str]) -> None:
    if pre not in _DIGIT_SPLIT_PRE:
        return
    data = json.loads(tok_json.read_text(encoding="utf-8"))
    cur = data.get("pre_tokenizer") or {}
    if cur.get("type") == "ByteLevel":
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, cur]}
        tok_json.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _write_tokenizer(gguf_path: Path, out: Path, cfg: dict, reader) -> None:
    """Let transformers build the fast tokenizer from the GGUF vocab, then add the files
    other tools expect (chat template inside tokenizer_config.json, special tokens map,
    generation config). A GGUF without a vocabulary gets only generation_config.json."""
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    stops = _stop_ids(reader, cfg, str(gguf_path))
    if len(stops) > 1:
        gen["eos_token_id"] = stops
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if _field(reader, "tokenizer.ggml.tokens") is None:
        warnings.warn(f"{gguf_path}: no tokenizer in this GGUF; copy the model's tokenizer files "
                      f"into {out} to use it with exl_core")
        return
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises assorted errors for vocabularies it cannot convert
        raise FormatError(f"{gguf_path}: transformers cannot build a tokenizer from this GGUF's "
                          f"vocabulary ({type(e).__name__}: {e})") from e
    tok.save_pretrained(str(out))
    _fix_pre_tokenizer(out / "tokenizer.json", _field(reader, "tokenizer.ggml.pre"))
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    if tc.get("tokenizer_class") == "TokenizersBackend":
        # transformers 5's name for a plain tokenizer.json; 4.x only knows the older alias
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):   # loading details of this run, not settings
        tc.pop(k, None)
    tc["model_max_length"] = cfg["max_position_embeddings"]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tc["chat_template"] = template
        (out / "chat_template.jinja").write_text(template)
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        tc["add_bos_token"] = bool(add_bos)
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token")
    if add_eos is not None:
        tc["add_eos_token"] = bool(add_eos)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    special = {k: tc[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if isinstance(tc.get(k), str)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))


def _dequantize_raw(t, path: str) -> np.ndarray:
    """gguf's dequantize of tensor `t`; a storage type it cannot decode is a FormatError naming the tensor, not its
    NotImplementedError."""
    import gguf
    try:
        return gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise FormatError(f"{path}: tensor '{t.name}' is stored as GGML type {t.tensor_type.name}, which the gguf "
                          f"package cannot dequantize ({e}); re-export the model with another type") from None


def _dequantize(t, arch: str, n_head: int, n_kv: int, head_dim: int, path: str) -> np.ndarray:
    """One GGUF tensor as float32 in HF layout."""
    # dequantize returns float32 in numpy order (= HF order: out_features, in_features)
    w = _dequantize_raw(t, path)
    w = np.array(w, dtype=np.float32, copy=True).reshape([int(d) for d in reversed(t.shape)])
    if SUPPORTED_ARCHS[arch].permute_qk:
        if ".attn_q." in t.name:
            w = unpermute_rope_rows(w, n_head, head_dim, f"{path}: tensor '{t.name}'")
        elif ".attn_k." in t.name:
            w = unpermute_rope_rows(w, n_kv, head_dim, f"{path}: tensor '{t.name}'")
    return np.ascontiguousarray(w)


def import_gguf(gguf_file, out_dir, dtype: torch.dtype = torch.float16,
                progress: bool = True, max_shard_bytes: int = 4 * 1024 ** 3) -> Path:
    """Convert a Llama-family GGUF into an HF-style folder at `out_dir` (replaced if present).
    Returns the folder path."""
    import gguf
    from tqdm.auto import tqdm
    from .safetensors_io import ShardedWriter

    gguf_path = Path(gguf_file).resolve()
    out = Path(out_dir).resolve()
    if not gguf_path.is_file():
        raise FormatError(f"{gguf_path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # the gguf package raises assorted ValueError/struct errors
        raise FormatError(f"{gguf_path}: not a readable GGUF file ({e})") from e

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise FormatError(f"{gguf_path}: GGUF architecture '{arch}' is not supported "
                          f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise FormatError(f"{gguf_path}: no 'token_embd.weight' tensor; not a Llama-family model")
    cfg = _config_from_gguf(reader, str(gguf_path), "output.weight" in names,
                            int(embed.shape[-1]))
    if any(n.endswith(".bias") and ".attn_" in n for n in names):
        cfg["attention_bias"] = True
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        scaling = _rope_scaling_from_factors(
            _dequantize_raw(rope_freqs, str(gguf_path)), cfg["head_dim"], cfg["rope_theta"],
            _number(reader, f"{arch}.rope.scaling.original_context_length", str(gguf_path)), str(gguf_path))
        if scaling is not None:
            cfg["rope_scaling"] = scaling
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # stream: one dequantized tensor at a time, one shard in memory at most
        with ShardedWriter(tmp, max_shard_bytes=max_shard_bytes,
                           metadata={"source": gguf_path.name}) as writer:
            it = tqdm(reader.tensors, desc=f"import {gguf_path.name}", unit="tensor",
                      disable=not progress)
            for t in it:
                hf = gguf_to_hf_name(t.name, str(gguf_path))
                if hf is None:
                    continue
                w = _dequantize(t, arch, n_head, n_kv, cfg["head_dim"], str(gguf_path))
                writer.add(hf, torch.from_numpy(w).to(dtype))
        cfg_out = dict(cfg)
        cfg_out["torch_dtype"] = str(dtype).replace("torch.", "")
        (tmp / "config.json").write_text(json.dumps(cfg_out, indent=2))
        _write_tokenizer(gguf_path, tmp, cfg, reader)
        (tmp / MARKER_NAME).write_text(json.dumps(
            {"importer_version": IMPORT_VERSION, "source": gguf_path.name,
             "source_size": gguf_path.stat().st_size}, indent=2))
        if out.exists():
            # move the old folder aside first so `out` is never half old, half new
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
