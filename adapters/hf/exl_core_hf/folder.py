"""`prepare_folder`: make a checkpoint folder that exl_core loads readable by transformers' `from_pretrained` too.

transformers opens `model.safetensors` or `model.safetensors.index.json` only, and reads quantization settings from
config.json only. ExLlamaV2 writes `output.safetensors` / `output-0000i-of-0000n.safetensors` (and copies its fp16
source's index, whose shards are not there); older AutoGPTQ folders keep the GPTQ settings in quantize_config.json.
Such a folder made transformers fail to find weights, or load a GPTQ model without its quantizer (every projection
randomly initialised). exl_core's own loader reads both layouts as they are.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

from exl_core.errors import FormatError
from exl_core.formats import exl2 as _exl2, gptq as _gptq  # noqa: F401 - registers both formats
from exl_core.formats.base import detect_format
from exl_core.formats.safetensors_io import INDEX_NAME, WeightReader
from exl_core.quantize.job_state import atomic_json   # never a half-written file

STALE_SUFFIX = ".stale"


def prepare_folder(folder: Union[str, Path]) -> list[str]:
    """Writes what transformers needs into `folder` (idempotent) and returns what it changed, one line each:
    - an index naming every tensor's file, where the folder has no model.safetensors and no index of its own files
      (a stale index is kept beside it as `model.safetensors.index.json.stale`);
    - `quantization_config` in config.json from quantize_config.json, where config.json has none; where there is
      neither and the tensors are EXL2's, `{"quant_method": "exl2"}` (a FormatError for other quantized tensors).
    The tensors themselves are never rewritten."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FormatError(f"{folder}: no config.json; not a model folder")
    changes = []
    index = folder / INDEX_NAME
    if not (folder / "model.safetensors").is_file():
        reader = WeightReader(folder)       # reads the folder's own files where an index names none of them
        files = {name: reader.file_of(name).name for name in reader.names()}
        reader.close()
        if not index.is_file() or json.loads(index.read_text(encoding="utf-8")).get("weight_map") != files:
            if index.is_file():
                os.replace(index, index.with_name(index.name + STALE_SUFFIX))
                changes.append(f"moved the index of files not in the folder to {index.name}{STALE_SUFFIX}")
            atomic_json({"metadata": {}, "weight_map": dict(sorted(files.items()))}, index)
            changes.append(f"wrote {index.name} for {', '.join(sorted(set(files.values())))}")
    cfg_path, legacy = folder / "config.json", folder / "quantize_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if "quantization_config" not in cfg and legacy.is_file():
        cfg["quantization_config"] = {"quant_method": "gptq", **json.loads(legacy.read_text(encoding="utf-8"))}
        atomic_json(cfg, cfg_path)
        changes.append("copied quantize_config.json into config.json's quantization_config")
    elif "quantization_config" not in cfg:
        # ExLlamaV2 writes quantization_config only when run with -cf; the usual folder has its fp16 source's
        # config.json, and transformers would load it as a dense model with every projection random
        reader = WeightReader(folder)
        fmt = detect_format(None, reader.names(), str(cfg_path))
        reader.close()
        if fmt is not None and fmt.name == "exl2":
            cfg["quantization_config"] = {"quant_method": "exl2"}
            atomic_json(cfg, cfg_path)
            changes.append("wrote quantization_config {quant_method: exl2} into config.json (EXL2 tensors found)")
        elif fmt is not None:
            raise FormatError(f"{cfg_path}: the weights are {fmt.name} but config.json has no quantization_config "
                              "(and there is no quantize_config.json) to give its settings")
    return changes


__all__ = ["prepare_folder"]
