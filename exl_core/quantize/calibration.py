"""Calibration tokens: from a user file (.jsonl or .json with "text", .parquet, else plain text) or sampled from
the model itself (the default: needs no download and matches the model's own distribution).

Both return `Calibration(tokens int64 [rows, length], info dict)`; `info` goes into the output's
quantization_config so a reader knows what the weights were tuned on.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..errors import InputError, TokenizerError
from ..textfiles import jsonl_objects, loads_json, read_utf8, require_file
from .calib_forward import rms_norm, rope_inv_freq, rope_tables, linear, mlp_act


@dataclass
class Calibration:
    tokens: torch.Tensor       # int64 [rows, length]
    info: dict


def _load_tokenizer(folder: Path):
    from tokenizers import Tokenizer
    f = Path(folder) / "tokenizer.json"
    if not f.is_file():
        raise TokenizerError(f"{folder}: tokenizer.json is missing; a calibration text file needs the "
                             "model's tokenizer (or omit -c to calibrate on text sampled from the model)")
    return Tokenizer.from_file(str(f))


def read_texts(path: Path) -> list[str]:
    """Documents of a .jsonl ("text" field per line), a .json (an array of such objects, or of strings: a dataset
    export, not text to calibrate on), a .parquet ("text" column) or any other file as one text document."""
    path = require_file(path, "calibration file")
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = loads_json(read_utf8(path, "calibration file"))
        except ValueError as e:
            raise InputError(f"{path}: not valid JSON ({e}); a plain text calibration file should not end in "
                             ".json") from None
        texts = [d.get("text") if isinstance(d, dict) else d for d in data] if isinstance(data, list) else None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InputError(f"{path}: a .json calibration file must hold an array of strings or of objects with a "
                             "string field \"text\"")
        return texts
    if suffix == ".jsonl":
        texts = []
        for n, obj in jsonl_objects(path, "calibration file"):
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise InputError(f"{path}:{n}: each line needs a string field \"text\"")
            texts.append(obj["text"])
        return texts
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise InputError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow), "
                             "or pass a .txt/.jsonl file") from e
        table = pq.read_table(str(path))
        if "text" not in table.column_names:
            raise InputError(f"{path}: parquet file has no 'text' column (columns: {table.column_names})")
        return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    return [read_utf8(path, "calibration file")]


def from_file(path, tokenizer_folder, rows: int, length: int) -> Calibration:
    """`rows` windows of `length` tokens, evenly spread over the concatenated documents."""
    path = Path(path)
    texts = read_texts(path)
    tok = _load_tokenizer(tokenizer_folder)
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t, add_special_tokens=False).ids
        ids += tok.encode("\n\n", add_special_tokens=False).ids
    n = min(rows, len(ids) // length)
    if n < 1:
        raise InputError(f"{path}: only {len(ids)} tokens, a calibration row needs {length}")
    if n < rows:        # said, not only recorded in the output's calibration info
        print(f"exl convert: {path} holds {len(ids)} tokens: {n} calibration rows of {length}, not {rows}",
              file=sys.stderr)
    stride = len(ids) // n
    tokens = torch.tensor([ids[r * stride:r * stride + length] for r in range(n)], dtype=torch.int64)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return Calibration(tokens, {"dataset": path.name, "sha256": digest, "rows": n, "length": length})


@torch.inference_mode()
def sample_from_model(source, rows: int, length: int, seed: int = 0, temperature: float = 1.0,
                      batch: int = 64, progress: bool = True) -> Calibration:
    """Self-calibration: `rows` sequences of `length` tokens sampled from the model.

    Half the rows start from BOS, half from a random ordinary token (topic diversity); each
    then continues with plain temperature sampling from the float32 model, KV-cached.
    """
    cfg, d = source.cfg, source.dims
    gen = torch.Generator().manual_seed(seed)
    vocab = cfg.vocab_size
    n_special = 32                                   # low ids are control tokens in most vocabularies
    first = torch.randint(n_special, vocab, (rows,), generator=gen)
    if cfg.bos_token_id is not None:
        first[::2] = cfg.bos_token_id
    layers = [source.layer_weights(i) for i in range(cfg.num_hidden_layers)]
    embed = source.tensor("model.embed_tokens.weight")
    norm_w = source.tensor("model.norm.weight")
    head = source.head_weight()
    inv = rope_inv_freq(d.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos_all, sin_all = rope_tables(inv, torch.arange(length))
    out = torch.zeros(rows, length, dtype=torch.int64)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=rows * length, desc="self-calibration: sampling", unit="tok")
    for a in range(0, rows, batch):
        b = min(batch, rows - a)
        toks = first[a:a + b].clone()
        out[a:a + b, 0] = toks
        kc = [torch.zeros(b, d.kv_heads, length, d.head_dim) for _ in layers]
        vc = [torch.zeros(b, d.kv_heads, length, d.head_dim) for _ in layers]
        for t in range(length - 1):
            h = embed[toks].unsqueeze(1)                                    # (b, 1, hidden)
            cos, sin = cos_all[t:t + 1], sin_all[t:t + 1]
            for li, w in enumerate(layers):
                h = _decode_layer(h, w, source.layer_dims(li), cos, sin, kc[li], vc[li], t)
            logits = linear(rms_norm(h[:, 0], norm_w, d.eps), head)        # (b, vocab)
            probs = torch.softmax(logits.double() / temperature, -1)
            toks = torch.multinomial(probs, 1, generator=gen)[:, 0]
            out[a:a + b, t + 1] = toks
            if bar:
                bar.update(b)
    if bar:
        bar.close()
    return Calibration(out, {"dataset": "self", "rows": rows, "length": length, "seed": seed,
                             "temperature": temperature})


def _decode_layer(h, w, d, cos, sin, kc, vc, t):
    """One token per sequence through one layer; appends its K/V at position t."""
    from .calib_forward import _rotate
    g = w.get
    b = h.shape[0]
    x = rms_norm(h, w["input_layernorm.weight"], d.eps)
    q = linear(x, w["self_attn.q_proj.weight"], g("self_attn.q_proj.bias")).view(b, 1, d.heads, d.head_dim).transpose(1, 2)
    k = linear(x, w["self_attn.k_proj.weight"], g("self_attn.k_proj.bias")).view(b, 1, d.kv_heads, d.head_dim).transpose(1, 2)
    v = linear(x, w["self_attn.v_proj.weight"], g("self_attn.v_proj.bias")).view(b, 1, d.kv_heads, d.head_dim).transpose(1, 2)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    kc[:, :, t] = k[:, :, 0]
    vc[:, :, t] = v[:, :, 0]
    lo = 0 if d.window is None else max(0, t + 1 - d.window)
    rep = d.heads // d.kv_heads
    keys = kc[:, :, lo:t + 1].repeat_interleave(rep, 1)                    # (b, H, t+1, D)
    vals = vc[:, :, lo:t + 1].repeat_interleave(rep, 1)
    s = (q @ keys.transpose(-1, -2)) * d.head_dim ** -0.5
    att = (torch.softmax(s, -1) @ vals).transpose(1, 2).reshape(b, 1, d.heads * d.head_dim)
    h = h + linear(att, w["self_attn.o_proj.weight"], g("self_attn.o_proj.bias"))
    x = rms_norm(h, w["post_attention_layernorm.weight"], d.eps)
    m = mlp_act(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], g("mlp.gate_proj.bias"), g("mlp.up_proj.bias"))
    return h + linear(m, w["mlp.down_proj.weight"], g("mlp.down_proj.bias"))


def self_calibration_path(folder, rows: int, length: int, seed: int = 0, temperature: float = 1.0) -> Path:
    """Cache file of the self-calibration of the model in `folder` with these settings (keyed by
    its config and weight files' names, sizes and mtimes)."""
    from ..default_model import exl_home
    h = hashlib.sha256()
    config = (Path(folder) / "config.json").read_bytes()
    h.update(config)
    if b"use_sliding_window" in config and json.loads(config).get("use_sliding_window"):
        h.update(b"per-layer windows")   # Qwen2's windows read as HF reads them since stop 66: older tokens differ
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    h.update(json.dumps([rows, length, seed, temperature]).encode())
    return exl_home() / "calib" / f"self-{h.hexdigest()[:24]}.safetensors"


def cached_self_calibration(source, rows: int, length: int, seed: int = 0, temperature: float = 1.0,
                            progress: bool = True) -> Calibration:
    """sample_from_model() through a cache in $EXL_CORE_HOME/calib: sampling is deterministic,
    so the same model and settings always give the same tokens; reuse saves minutes per run."""
    from .job_state import atomic_save
    path = self_calibration_path(source.folder, rows, length, seed, temperature)
    if path.is_file():
        cal, why = _read_cached(path, rows, length, source.cfg.vocab_size)
        if cal is not None:
            return cal
        # a cache: sampling again gives the same tokens, so a damaged file is replaced (atomically), not refused
        print(f"exl convert: {path}: damaged self-calibration cache ({why}); sampling it again", file=sys.stderr)
    cal = sample_from_model(source, rows, length, seed, temperature, progress=progress)
    atomic_save({"tokens": cal.tokens}, path, {"info": json.dumps(cal.info, sort_keys=True)})
    return cal


def _read_cached(path: Path, rows: int, length: int, vocab: int) -> tuple[Optional[Calibration], str]:
    """(the cached calibration, "") or (None, what is wrong with the file)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as f:
            tokens = f.get_tensor("tokens")
            info = json.loads((f.metadata() or {})["info"])
    except (SafetensorError, ValueError, KeyError, TypeError) as e:     # truncated, corrupt, keys missing
        return None, f"{type(e).__name__}: {e}"
    if tokens.dtype != torch.int64 or tuple(tokens.shape) != (rows, length):
        return None, f"tokens {tokens.dtype} {list(tokens.shape)}, expected int64 [{rows}, {length}]"
    if not isinstance(info, dict):
        return None, "its info is not a JSON object"
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        return None, f"token ids outside the vocabulary of {vocab}"
    return Calibration(tokens, info), ""
