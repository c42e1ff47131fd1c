"""HF `config.json` → typed `ModelConfig`, and the architecture registry.

Every read fails loudly: a missing or invalid key raises ConfigError naming the file and the
key. Architecture quirks live in the registry entry (`ArchSpec`), not in generic modules.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError
from .textfiles import loads_json


@dataclass(frozen=True)
class ArchSpec:
    """What differs between Llama-family architectures, keyed by the HF architecture name."""
    name: str
    default_attention_bias: bool = False   # Qwen2: q/k/v projections carry a bias
    uses_sliding_window: bool = False      # Mistral/Qwen2 may set `sliding_window`
    sliding_window_flag: Optional[str] = None  # Qwen2: `use_sliding_window` gates it
    o_proj_bias: bool = False              # o_proj carries a bias where attention_bias says so (HF's Llama); Mistral's
    # and Qwen2's never does
    fixed_biases: bool = False             # Mistral / Qwen2: the biases are the architecture's (default_attention_bias
    # on q/k/v, none elsewhere); HF ignores attention_bias / mlp_bias in their configs
    window_layers_key: Optional[str] = None  # Qwen2: layers below `max_window_layers` attend to every key, unless
    # `layer_types` lists each layer's kind
    window_layers_default: int = 0         # the key's value where config.json leaves it out (HF's Qwen2Config: 28)
    default_window: Optional[int] = None   # `sliding_window` where config.json leaves the key out (HF's MistralConfig
    # and Qwen2Config: 4096; an explicit null means none)
    default_kv_heads: Optional[int] = None  # `num_key_value_heads` where config.json leaves the key out (HF's
    # MistralConfig: 8, Qwen2Config: 32); None, and an explicit null, mean num_attention_heads (HF's LlamaConfig)
    default_max_positions: int = 2048      # `max_position_embeddings` where config.json leaves it out (HF's
    # LlamaConfig: 2048, MistralConfig: 131072, Qwen2Config: 32768); llama3 rope's pretraining length falls back on it


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LlamaForCausalLM", o_proj_bias=True),
    "MistralForCausalLM": ArchSpec("MistralForCausalLM", uses_sliding_window=True, fixed_biases=True,
                                   default_window=4096, default_kv_heads=8, default_max_positions=131072),
    "Qwen2ForCausalLM": ArchSpec("Qwen2ForCausalLM", default_attention_bias=True, uses_sliding_window=True,
                                 sliding_window_flag="use_sliding_window", fixed_biases=True,
                                 window_layers_key="max_window_layers", window_layers_default=28,
                                 default_window=4096, default_kv_heads=32, default_max_positions=32768),
}


# transformers' ACT2FN maps both names to SiLU
SILU_NAMES = ("silu", "swish")


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
    sliding_window: Optional[int] = None    # the window of the layers that slide
    sliding_layers: Optional[tuple[bool, ...]] = None   # which layers slide, where some do not (None: all do)
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

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of one decoder layer (None: it attends to every earlier key)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def uniform_window(self) -> Optional[int]:
        """The window every layer slides by, None where any layer attends to every key: a cache may drop the pages
        that left it only then."""
        return self.sliding_window if self.sliding_layers is None else None

    @property
    def quant_method(self) -> Optional[str]:
        qc = self.quantization_config
        return None if not qc else qc.get("quant_method")


class Reader:
    """Typed access to one config dict, with errors that name the file and key.

    `prefix` names a nested object ("rope_scaling."), so its keys are reported by their full path."""

    def __init__(self, data: dict, source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def fail(self, key, why):
        raise ConfigError(f"{self.source}: key '{self.prefix}{key}' {why}")

    def get(self, key, typ, default: Any = ..., positive=False):
        if key not in self.data or self.data[key] is None:
            if default is ...:
                self.fail(key, "is missing")
            return default
        return self.check(key, self.data[key], typ, positive)

    def check(self, key, v, typ, positive=False):
        """`v` (the value of `key`, or an item of it) as `typ`: ints pass as floats and integral floats
        as ints, bools pass only as bool."""
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if typ is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            self.fail(key, f"must be {typ.__name__}, got {type(v).__name__} {v!r}")
        if typ is float and not math.isfinite(v):
            self.fail(key, f"must be finite, got {v!r}")
        if positive and v <= 0:
            self.fail(key, f"must be > 0, got {v!r}")
        return v

    def sub(self, key) -> Optional["Reader"]:
        """A Reader over the nested object at `key`, None when absent or null."""
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            self.fail(key, f"must be an object, got {type(v).__name__} {v!r}")
        return Reader(v, self.source, f"{self.prefix}{key}.")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _original_max_positions(rs: Reader, r: Reader, max_positions: int) -> int:
    """llama3 rope's pretraining length as transformers 5.x builds the model (standardize_rope_params): a top-level
    original_max_position_embeddings (Phi3-style) overrides the rope object's, which else falls back on
    max_positions (max_position_embeddings or the architecture's default)."""
    for where in (r, rs):
        v = where.get("original_max_position_embeddings", int, None, positive=True)
        if v is not None:
            return v
    return max_positions


def _rope_parameters(r: Reader) -> Optional[Reader]:
    """transformers 5.x's `rope_parameters` (rope_theta and the scaling in one object). One object a layer type
    (Gemma-style) would be read as default rope here: refused."""
    rp = r.sub("rope_parameters")
    if rp is not None and any(k in rp.data for k in LAYER_TYPES):
        r.fail("rope_parameters", "holds one rope per layer type; exl_core supports one rope for every layer")
    return rp


def _rope_scaling(rs: Optional[Reader], r: Reader, max_positions: int) -> Optional[dict]:
    """The scaling of the rope object (rope_scaling, or transformers 5.x's rope_parameters)."""
    if rs is None:
        return None
    type_key = "rope_type" if "rope_type" in rs.data else "type"
    kind = rs.data.get(type_key)
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": rs.get("factor", float, positive=True)}
    if kind == "llama3":
        lo = rs.get("low_freq_factor", float, positive=True)
        hi = rs.get("high_freq_factor", float, positive=True)
        if hi <= lo:   # the llama3 formula divides by (high - low)
            rs.fail("high_freq_factor", f"must be greater than low_freq_factor ({lo}), got {hi}")
        return {"rope_type": "llama3", "factor": rs.get("factor", float, positive=True),
                "low_freq_factor": lo, "high_freq_factor": hi,
                "original_max_position_embeddings": float(_original_max_positions(rs, r, max_positions))}
    rs.fail(type_key, f"value {kind!r} is not supported (supported: default, linear, llama3)")


def _sliding_window(r: Reader, spec: ArchSpec, layers: int) -> tuple[Optional[int], Optional[tuple[bool, ...]]]:
    """(window, which layers slide) as HF's modeling code reads them: Mistral slides every layer by `sliding_window`
    (null: none); Qwen2 only where `use_sliding_window` is true, and then the layers `layer_types` calls
    sliding_attention, or without that list the layers from `max_window_layers` on."""
    if not spec.uses_sliding_window:
        return None, None
    # a missing key is the architecture's default (HF's config classes), an explicit null no window
    window = r.get("sliding_window", int, None) if "sliding_window" in r.data else spec.default_window
    if spec.sliding_window_flag and not r.get(spec.sliding_window_flag, bool, False):
        return None, None
    if window is None:
        return None, None
    if window <= 0:
        r.fail("sliding_window", f"must be > 0, got {window}")
    if not spec.window_layers_key:
        return window, None
    kinds = r.get("layer_types", list, None)
    if kinds is not None:
        if len(kinds) != layers or any(k not in LAYER_TYPES for k in kinds):
            r.fail("layer_types", f"must list {layers} entries (num_hidden_layers), each one of "
                                  f"{', '.join(LAYER_TYPES)}; got {kinds!r}")
        slides = tuple(k == "sliding_attention" for k in kinds)
    else:
        first = r.get(spec.window_layers_key, int, spec.window_layers_default)
        if first < 0:
            r.fail(spec.window_layers_key, f"must be >= 0, got {first}")
        slides = tuple(i >= first for i in range(layers))
    if not any(slides):
        return None, None
    return window, (None if all(slides) else slides)


def _token_id(r: Reader, key: str, v, vocab: int) -> int:
    """A special token id: an int the embedding has a row for."""
    i = r.check(key, v, int)
    if not 0 <= i < vocab:
        r.fail(key, f"must be a token id in [0, vocab_size={vocab}), got {i}")
    return i


def _optional_token_id(r: Reader, key: str, vocab: int) -> Optional[int]:
    v = r.data.get(key)
    return None if v is None else _token_id(r, key, v, vocab)


def _pad_token_id(r: Reader, vocab: int) -> Optional[int]:
    """pad_token_id: the model never reads it, and old conversions write -1 for "none": out of range means none
    here rather than a model refused for a field it does not use (its type is still checked)."""
    v = r.get("pad_token_id", int, None)
    return v if v is not None and 0 <= v < vocab else None


def _eos_token_ids(r: Reader, vocab: int) -> list[int]:
    eos = r.data.get("eos_token_id")
    if isinstance(eos, list):   # Llama 3 lists several
        return [_token_id(r, f"eos_token_id[{i}]", v, vocab) for i, v in enumerate(eos)]
    return [] if eos is None else [_token_id(r, "eos_token_id", eos, vocab)]


def config_from_dict(data: dict, source: str = "config.json", path: Optional[Path] = None) -> ModelConfig:
    r = Reader(data, source)
    archs = r.get("architectures", list)
    if not archs:
        raise ConfigError(f"{source}: key 'architectures' is empty")
    if not all(isinstance(a, str) for a in archs):
        r.fail("architectures", f"must be a list of class names (strings), got {archs!r}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: architecture {arch!r} is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    spec = ARCHITECTURES[arch]
    act = r.get("hidden_act", str, "silu")
    if act not in SILU_NAMES:   # the MLP computes SiLU only; another activation would run as SiLU
        r.fail("hidden_act", f"is {act!r}; exl_core supports only SiLU ({', '.join(map(repr, SILU_NAMES))})")
    vocab = r.get("vocab_size", int, positive=True)
    hidden = r.get("hidden_size", int, positive=True)
    heads = r.get("num_attention_heads", int, positive=True)
    # a missing key is the architecture's default (HF's config classes), an explicit null num_attention_heads
    kv_given = "num_key_value_heads" in r.data or spec.default_kv_heads is None
    kv_heads = r.get("num_key_value_heads", int, heads if kv_given else spec.default_kv_heads, positive=True)
    if heads % kv_heads:
        why = "" if kv_given else f", {arch}'s default where config.json leaves the key out"
        raise ConfigError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                          f"num_key_value_heads ({kv_heads}{why})")
    head_dim = r.get("head_dim", int, None, positive=True)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                              "and no head_dim is given")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")
    # transformers 5.x reads one rope object (a legacy rope_scaling, else rope_parameters) and fills its theta from
    # the top-level key only where it has none
    rp = _rope_parameters(r)
    legacy = r.sub("rope_scaling")
    rope = legacy if legacy is not None and legacy.data else rp    # an empty rope_scaling is absent there too
    rope_theta = rope.get("rope_theta", float, None, positive=True) if rope else None
    if rope_theta is None:
        rope_theta = r.get("rope_theta", float, 10000.0, positive=True)
    max_positions = r.get("max_position_embeddings", int, spec.default_max_positions, positive=True)
    layers = r.get("num_hidden_layers", int, positive=True)
    sliding, sliding_layers = _sliding_window(r, spec, layers)
    qc = data.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{source}: key 'quantization_config' must be an object")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=r.get("intermediate_size", int, positive=True),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6, positive=True),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        attention_bias=(spec.default_attention_bias if spec.fixed_biases
                        else r.get("attention_bias", bool, spec.default_attention_bias)),
        mlp_bias=False if spec.fixed_biases else r.get("mlp_bias", bool, False),
        rope_scaling=_rope_scaling(rope, r, max_positions),
        sliding_window=sliding,
        sliding_layers=sliding_layers,
        bos_token_id=_optional_token_id(r, "bos_token_id", vocab),
        eos_token_ids=_eos_token_ids(r, vocab),
        pad_token_id=_pad_token_id(r, vocab),
        torch_dtype=data.get("torch_dtype") or data.get("dtype"),
        quantization_config=qc,
        path=path,
        raw=data,
    )


def model_folder(path) -> Path:
    """`path` as an existing folder: None, a non-path or a file given by mistake is named as such here
    instead of failing inside pathlib or as a weight file that is "not valid JSON"."""
    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise ConfigError(f"a model folder path (str or pathlib.Path) is expected, got {path!r}")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: model folder not found")
    if not p.is_dir():
        raise ConfigError(f"{p}: is a file; a model folder (holding config.json and the weights) is expected")
    return p


def _read_json_object(file: Path) -> dict:
    if file.is_dir():
        raise ConfigError(f"{file}: is a folder, not a JSON file")
    if not file.exists():
        raise ConfigError(f"{file}: not found (a model folder needs a HF config.json)")
    try:
        data = loads_json(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot be read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: must hold a JSON object")
    return data


def load_config(folder) -> ModelConfig:
    """Reads `<folder>/config.json` (or a path to a .json config file itself)."""
    p = Path(folder) if isinstance(folder, (str, os.PathLike)) else None
    if p is not None and p.suffix == ".json" and p.is_file():     # the config file itself, whatever its name
        file = p
    else:
        file = model_folder(folder) / "config.json"
    data = _read_json_object(file)
    legacy = file.parent / "quantize_config.json"
    if "quantization_config" not in data and legacy.exists():
        # older AutoGPTQ folders keep the GPTQ settings beside config.json
        data = {**data, "quantization_config": {"quant_method": "gptq", **_read_json_object(legacy)}}
    return config_from_dict(data, str(file), file.parent)
