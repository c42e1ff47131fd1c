"""The model being converted, as float32 weights read one layer at a time.

`DenseSource` reads an HF folder (fp16/bf16/fp32 safetensors). `exl_core.quantize.gptq_to_exl2`
subclasses it to serve dequantized GPTQ layers. Nothing here builds modules: the converter
only needs tensors, and reading per layer keeps memory at one layer plus the activations.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from ..config import ModelConfig, load_config
from ..errors import ConfigError, FormatError
from ..formats.safetensors_io import WeightReader
from .calib_forward import LINEARS, Dims

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class DenseSource:
    def __init__(self, folder, cfg: Optional[ModelConfig] = None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConfigError(f"{self.folder}: input model folder not found")
        self.cfg = cfg or load_config(self.folder)
        if self.cfg.architecture not in SUPPORTED_ARCHS:
            raise ConfigError(f"{self.folder}/config.json: architecture {self.cfg.architecture!r} cannot be "
                              f"converted (supported: {', '.join(SUPPORTED_ARCHS)})")
        self.reader = WeightReader(self.folder)
        c = self.cfg
        self.dims = Dims(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rms_norm_eps, c.uniform_window)   # layer_dims(i): a layer's own
        self._check_names()

    def layer_dims(self, i: int) -> Dims:
        """The dims of decoder layer i: its own sliding window (Qwen2 slides only some layers)."""
        return dataclasses.replace(self.dims, window=self.cfg.layer_window(i))

    def _check_names(self):
        need = ["model.embed_tokens.weight", "model.norm.weight"]
        for i in range(self.cfg.num_hidden_layers):
            need += [f"model.layers.{i}.{n}.weight" for n in LINEARS[:1]]
        missing = [n for n in need if not self.has_tensor(n)]
        if missing:
            raise FormatError(f"{self.folder}: weights are missing tensors {missing[:3]} "
                              f"({len(missing)} missing); is this a complete model folder?")

    # -- tensor access ------------------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return self.reader.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        self.reader.check_float(name)
        t = self.reader.get(name, dtype=torch.float32)
        if not bool(torch.isfinite(t).all()):     # else a sampling or packing error deep in the quantizer
            raise FormatError(f"{self.reader.file_of(name)}: tensor '{name}' holds NaN or inf values; a model to "
                              "convert needs finite weights")
        return t

    def shape_of_linear(self, name: str) -> tuple[int, int]:
        """(out, in) of linear `name` (without .weight)."""
        return tuple(self.reader.shape(f"{name}.weight"))

    def linear_weight(self, name: str) -> torch.Tensor:
        """(out, in) float32."""
        return self.tensor(f"{name}.weight")

    def layer_weights(self, i: int) -> dict[str, torch.Tensor]:
        """float32 weights of decoder layer i, keys relative to `model.layers.{i}.`."""
        p = f"model.layers.{i}."
        w = {}
        for n in LINEARS:
            w[f"{n}.weight"] = self.linear_weight(p + n)
            if self.has_tensor(f"{p}{n}.bias"):
                w[f"{n}.bias"] = self.tensor(f"{p}{n}.bias")
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            w[n] = self.tensor(p + n)
        return w

    def head_weight(self) -> torch.Tensor:
        """(vocab, hidden) float32: lm_head, or the embedding when tied."""
        if self.has_tensor("lm_head.weight"):
            return self.linear_weight("lm_head")
        if self.cfg.tie_word_embeddings:
            return self.tensor("model.embed_tokens.weight")
        raise FormatError(f"{self.folder}: no lm_head.weight and tie_word_embeddings is false")

    def passthrough_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors copied unchanged (as fp16) into the output: embedding and norms."""
        out = {"model.embed_tokens.weight": self.reader.get("model.embed_tokens.weight", dtype=torch.float16),
               "model.norm.weight": self.reader.get("model.norm.weight", dtype=torch.float16)}
        for i in range(self.cfg.num_hidden_layers):
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                out[f"model.layers.{i}.{n}"] = self.reader.get(f"model.layers.{i}.{n}", dtype=torch.float16)
        return out

    def linear_names(self, i: int) -> list[str]:
        return [f"model.layers.{i}.{n}" for n in LINEARS]
