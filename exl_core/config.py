"""HF `config.json` → typed `ModelConfig`, and the architecture registry.

Every read fails loudly: a missing or invalid key raises ConfigError naming the file and the
key. Architecture quirks live in the registry entry (`ArchSpec`), not in generic modules.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError


@dataclass(frozen=True)
class ArchSpec:
    """What differs between Llama-family architectures, keyed by the HF architecture name."""
    name: str
    default_attention_bias: bool = False   # Qwen2: q/k/v projections carry a bias
    uses_sliding_window: bool = False      # Mistral/Qwen2 may set `sliding_window`
    sliding_window_flag: Optional[str] = None  # Qwen2: `use_sliding_window` gates it


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LlamaForCausalLM"),
    "MistralForCausalLM": ArchSpec("MistralForCausalLM", uses_sliding_window=True),
    "Qwen2ForCausalLM": ArchSpec("Qwen2ForCausalLM", default_attention_bias=True, uses_sliding_window=True,
                                 sliding_window_flag="use_sliding_window"),
}


def register_architecture(spec: ArchSpec) -> None:
    """Plugins add Llama-compatible architectures here."""
    ARCHITECTURES[spec.name] = spec


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool = False
    rope_scaling: Optional[dict] = None
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None
    quantization_config: Optional[dict] = None
    path: Optional[Path] = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def arch(self) -> ArchSpec:
        return ARCHITECTURES[self.architecture]

    @property
    def quant_method(self) -> Optional[str]:
        qc = self.quantization_config
        return None if not qc else qc.get("quant_method")


class _Reader:
    """Typed access to one config dict, with errors that name the file and key."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source

    def _fail(self, key, why):
        raise ConfigError(f"{self.source}: key '{key}' {why}")

    def get(self, key, typ, default: Any = ..., positive=False):
        if key not in self.data or self.data[key] is None:
            if default is ...:
                self._fail(key, "is missing")
            return default
        v = self.data[key]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if typ is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            self._fail(key, f"must be {typ.__name__}, got {type(v).__name__} {v!r}")
        if typ is float and not math.isfinite(v):
            self._fail(key, f"must be finite, got {v!r}")
        if positive and v <= 0:
            self._fail(key, f"must be > 0, got {v!r}")
        return v


def _rope_scaling(r: _Reader) -> Optional[dict]:
    rs = r.data.get("rope_scaling")
    if rs is None:
        # transformers 5.x may write `rope_parameters` instead of rope_scaling/rope_theta
        rp = r.data.get("rope_parameters")
        if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
            rs = rp
        else:
            return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{r.source}: key 'rope_scaling' must be an object, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        f = rs.get("factor")
        if not isinstance(f, (int, float)) or f <= 0:
            raise ConfigError(f"{r.source}: rope_scaling.factor must be > 0 for linear scaling, got {f!r}")
        return {"rope_type": "linear", "factor": float(f)}
    if kind == "llama3":
        need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        for k in need:
            if not isinstance(rs.get(k), (int, float)):
                raise ConfigError(f"{r.source}: rope_scaling.{k} is missing or not a number (llama3 scaling)")
        return {"rope_type": "llama3", **{k: float(rs[k]) for k in need}}
    raise ConfigError(f"{r.source}: rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def config_from_dict(data: dict, source: str = "config.json", path: Optional[Path] = None) -> ModelConfig:
    r = _Reader(data, source)
    archs = r.get("architectures", list)
    if not archs:
        raise ConfigError(f"{source}: key 'architectures' is empty")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: architecture {arch!r} is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    spec = ARCHITECTURES[arch]
    hidden = r.get("hidden_size", int, positive=True)
    heads = r.get("num_attention_heads", int, positive=True)
    kv_heads = r.get("num_key_value_heads", int, heads, positive=True)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    head_dim = r.get("head_dim", int, None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                              "and no head_dim is given")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")
    rope_theta = r.get("rope_theta", float, None)
    if rope_theta is None:
        rp = data.get("rope_parameters")
        rope_theta = float(rp["rope_theta"]) if isinstance(rp, dict) and "rope_theta" in rp else 10000.0
    sliding = None
    if spec.uses_sliding_window:
        sliding = r.get("sliding_window", int, None)
        if spec.sliding_window_flag and not data.get(spec.sliding_window_flag, False):
            sliding = None
        if sliding is not None and sliding <= 0:
            raise ConfigError(f"{source}: key 'sliding_window' must be > 0, got {sliding}")
    eos = data.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    qc = data.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{source}: key 'quantization_config' must be an object")
    return ModelConfig(
        architecture=arch,
        vocab_size=r.get("vocab_size", int, positive=True),
        hidden_size=hidden,
        intermediate_size=r.get("intermediate_size", int, positive=True),
        num_hidden_layers=r.get("num_hidden_layers", int, positive=True),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6, positive=True),
        rope_theta=rope_theta,
        max_position_embeddings=r.get("max_position_embeddings", int, 4096, positive=True),
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        attention_bias=r.get("attention_bias", bool, spec.default_attention_bias),
        mlp_bias=r.get("mlp_bias", bool, False),
        rope_scaling=_rope_scaling(r),
        sliding_window=sliding,
        bos_token_id=r.get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
        pad_token_id=r.get("pad_token_id", int, None),
        torch_dtype=data.get("torch_dtype") or data.get("dtype"),
        quantization_config=qc,
        path=path,
        raw=data,
    )


def load_config(folder) -> ModelConfig:
    """Reads `<folder>/config.json` (or a path to the file itself)."""
    p = Path(folder)
    file = p / "config.json" if p.is_dir() else p
    if not file.exists():
        raise ConfigError(f"{file}: not found (a model folder needs a HF config.json)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: must hold a JSON object")
    legacy = file.parent / "quantize_config.json"
    if "quantization_config" not in data and legacy.exists():
        # older AutoGPTQ folders keep the GPTQ settings beside config.json
        try:
            qc = json.loads(legacy.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{legacy}: not valid JSON ({e})") from None
        if not isinstance(qc, dict):
            raise ConfigError(f"{legacy}: must hold a JSON object")
        data = {**data, "quantization_config": {"quant_method": "gptq", **qc}}
    return config_from_dict(data, str(file), file.parent)
