"""Calibration-free round-to-nearest conversion of a dense HF folder into GPTQ or EXL2.

Used by tests and benchmarks before the real (Hessian-based) converter exists. Every
attention/MLP projection (`q/k/v/o_proj`, `gate/up/down_proj`) is quantized; embeddings and
norms stay dense fp16; the head is quantized only when `head_bits` is given (for a tied model
the embedding is then also kept, and the quantized `lm_head.*` wins over the tie, as
ExLlamaV2 writes it). HF stores weights [out, in]; both formats use [K=in, N=out].
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ..errors import ConfigError, FormatError
from ..formats import exl2, gptq
from ..formats.safetensors_io import WeightReader, write_sharded
from ..textfiles import loads_json

PROJ = re.compile(r"^(.*\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj))\.weight$")
_SKIP_COPY = {"config.json", "model.safetensors.index.json", "quantize_config.json", "measurement.json"}

BitsSpec = Union[int, Sequence[tuple[int, float]]]


def quantize_model_rtn(src_folder, dst_folder, fmt: str = "gptq", bits: BitsSpec = 4, group_size: int = 128,
                       sym: bool = True, act_order: bool = False, head_bits: Optional[int] = None,
                       checkpoint_format: str = "gptq", max_shard_bytes: int = 2 * 1024 ** 3,
                       clip_search: bool = False) -> Path:
    """Writes a quantized copy of `src_folder` to `dst_folder`; returns dst_folder.

    fmt="gptq": bits in {2,3,4,8}, group_size 32/64/128/-1, sym/asym, act_order (rows ordered
    by weight energy, see gptq.act_order_perm), checkpoint_format "gptq" (v1) or "gptq_v2".
    fmt="exl2": bits an int or [(bits, proportion)] widest first (e.g. [(6, .1), (4, .9)]),
    group_size per group of rows; act_order applies gptq.act_order_perm as the EXL2 permutation.
    clip_search: per-group (EXL2) / per-column (GPTQ) range search instead of plain min/max
    scales; better error, but the |W - deq| <= scale/2 guarantee no longer holds.
    """
    src, dst = Path(src_folder), Path(dst_folder)
    if fmt not in ("gptq", "exl2"):
        raise ConfigError(f"quantize_model_rtn: fmt must be 'gptq' or 'exl2', got {fmt!r}")
    cfg_path = src / "config.json"
    try:
        config = loads_json(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_path}: cannot read config.json ({e})") from e
    if (Path(dst) / "config.json").resolve() == cfg_path.resolve():
        raise ConfigError(f"{dst}: destination must differ from the source folder")
    if fmt == "gptq" and not isinstance(bits, int):
        raise ConfigError("quantize_model_rtn: GPTQ needs a single integer bit width")
    if fmt == "gptq" and head_bits not in (None, bits):
        # GPTQ configs carry one `bits` (GPTQModel's lm_head=True reuses it); readers could not
        # tell the head's width apart from a corrupt tensor.
        raise ConfigError(f"quantize_model_rtn: GPTQ head_bits must equal bits ({bits}) or be None")

    reader = WeightReader(src)
    names = sorted(reader.names())
    out: dict[str, torch.Tensor] = {}
    bpw_num, bpw_den = 0.0, 0

    def quantize(prefix: str, w_hf: torch.Tensor, b: Optional[torch.Tensor], layer_bits: BitsSpec) -> None:
        nonlocal bpw_num, bpw_den
        W = w_hf.t().to(torch.float64)                                  # (K=in, N=out)
        K, N = W.shape
        if fmt == "gptq":
            t = gptq.quantize_rtn(W, layer_bits, group_size, sym=sym, act_order=act_order,
                                  checkpoint_format=checkpoint_format, bias=b, clip_search=clip_search)
            stored_bits = sum(v.numel() * v.element_size() * 8 for k, v in t.items() if k != "bias")
        else:
            gs = K if group_size == -1 else group_size
            segs = ([(layer_bits, K)] if isinstance(layer_bits, int)
                    else exl2.segments_from_proportions(K, layer_bits, gs))
            perm = gptq.act_order_perm(W) if act_order else None
            t = exl2.quantize_rtn(W, segs, gs, perm=perm, bias=b, clip_search=clip_search)
            stored_bits = exl2.bits_per_weight(t, K, N) * K * N
        if prefix != "lm_head":     # "bits" describes the layers; the head has head_bits
            bpw_num += stored_bits
            bpw_den += K * N
        for k, v in t.items():
            out[f"{prefix}.{k}"] = v

    for name in names:
        m = PROJ.match(name)
        if m:
            prefix = m.group(1)
            bias = reader.get(f"{prefix}.bias") if reader.has(f"{prefix}.bias") else None
            quantize(prefix, reader.get(name), bias, bits)
        elif name.endswith(".bias") and PROJ.match(name[: -len(".bias")] + ".weight"):
            continue                                                    # written with its layer
        elif name == "lm_head.weight" and head_bits is not None:
            quantize("lm_head", reader.get(name), None, head_bits)
        else:
            t = reader.get(name)
            out[name] = t.to(torch.float16) if t.is_floating_point() else t
    if head_bits is not None and not reader.has("lm_head.weight"):
        if not config.get("tie_word_embeddings", False) or not reader.has("model.embed_tokens.weight"):
            raise FormatError(f"{src}: head_bits given but there is no lm_head.weight nor a tied embedding")
        quantize("lm_head", reader.get("model.embed_tokens.weight"), None, head_bits)
    reader.close()

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():            # tokenizer, generation config, chat template, ...
        if f.is_file() and f.name not in _SKIP_COPY and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    write_sharded(out, dst, max_shard_bytes=max_shard_bytes)
    config["quantization_config"] = _quant_config(fmt, bits, group_size, sym, act_order, head_bits,
                                                   checkpoint_format, bpw_num / max(bpw_den, 1))
    config["torch_dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quant_config(fmt, bits, group_size, sym, act_order, head_bits, checkpoint_format, bpw) -> dict:
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order,
              "sym": sym, "checkpoint_format": checkpoint_format, "static_groups": False}
        # no damp_percent: RTN uses no damping, and transformers' GPTQConfig rejects 0.0
        if head_bits is not None:
            qc["lm_head"] = True
        return qc
    from .. import __version__ as version  # noqa: WPS433
    return {"quant_method": "exl2", "version": f"exl_core-{version}", "bits": round(bpw, 3),
            "head_bits": head_bits if head_bits is not None else 16,
            "calibration": {"rows": 0, "length": 0, "dataset": "none (round-to-nearest)"}}
