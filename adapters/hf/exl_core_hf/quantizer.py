"""transformers 5.x quantizers that put exl_core's `QuantLinear` into HF models.

Flow inside `from_pretrained` (transformers/modeling_utils.py):

    config.quantization_config {"quant_method": "exl2"} -> ExlQuantConfig -> ExlHfQuantizer
    model built on meta -> preprocess_model(checkpoint_files=...)
        -> every nn.Linear whose prefix holds quantized tensors becomes an HFQuantLinear with
           buffers shaped from the safetensors headers; any model tensor the checkpoint lacks
           is a FormatError here (transformers would otherwise random-initialise it)
    weights load by name into those buffers
    postprocess_model -> HFQuantLinear.finalize(): checkpoint tensors -> PackedWeight

GPTQ checkpoints keep transformers' `GPTQConfig`; when routing is enabled (config.py) the
`gptq` slot of AUTO_QUANTIZER_MAPPING, which `_GptqRouter` occupies, builds `ExlGptqHfQuantizer`
instead of transformers' optimum-based one.
"""
from __future__ import annotations

import re
from pathlib import Path
import torch
from torch import nn
from transformers.quantizers import auto as _auto
from transformers.quantizers.base import HfQuantizer

from exl_core.errors import FormatError

from .config import EXL2_METHOD, ExlQuantConfig, gptq_routing_enabled


def _qcfg_dict(qc) -> dict:
    if isinstance(qc, dict):
        return dict(qc)
    d = dict(qc.to_dict())
    d["quant_method"] = str(getattr(qc.quant_method, "value", qc.quant_method))
    return d


def _format_for(qdict: dict, names: set):
    """exl_core's format object (has_layer / load_layer) for this checkpoint."""
    from exl_core.formats.base import detect_format
    fmt = detect_format(qdict, names)
    if fmt is None:
        raise FormatError(f"quantization_config {qdict.get('quant_method')!r}: exl_core finds no quantized "
                          "layers of that format in the checkpoint")
    return fmt


class ExlHfQuantizer(HfQuantizer):
    """Pre-quantized EXL2 (or routed GPTQ) checkpoints on exl_core kernels."""

    requires_calibration = True      # loads pre-quantized folders only; quantize with `exl convert`

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._fmt = None
        self._qdict: dict = {}
        self.modules_to_not_convert: list[str] = []

    # -- environment / dtype -------------------------------------------------------------------
    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("exl_core quantized layers cannot be offloaded to disk; drop 'disk' from device_map")

    def update_dtype(self, dtype):
        # exl_core's CPU kernels compute in float32; fp16 activations are accepted and cast.
        return dtype

    # -- before weights load --------------------------------------------------------------------
    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from exl_core.formats.safetensors_io import WeightReader
        from exl_core.loader import check_layer_bias

        from .modules import HFQuantLinear, layer_tensors

        if not checkpoint_files:
            raise FormatError("exl_core quantizer: from_pretrained gave no checkpoint files "
                              "(only safetensors folders are supported)")
        folder = Path(checkpoint_files[0]).parent
        reader = WeightReader(folder if len(checkpoint_files) > 1 or _has_index(folder) else checkpoint_files[0])
        names = reader.names()
        self._qdict = _qcfg_dict(self.quantization_config)
        self._fmt = _format_for(self._qdict, names)
        skip = list(getattr(self.quantization_config, "modules_to_not_convert", None) or [])
        self.modules_to_not_convert = skip

        # a base model (AutoModel: LlamaModel) names its modules without the checkpoint's "model." prefix, which
        # transformers strips when it loads the tensors
        ckpt = _checkpoint_prefix(model, names)
        replaced = 0
        for name, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            key = ckpt + name
            if not self._fmt.has_layer(names, key):
                continue
            listed = next((s for s in skip if name == s or name.startswith(s + ".")), None)
            if listed is not None:
                # no dense weight to keep it as: a tied lm_head silently became the embedding, others went missing
                raise FormatError(f"{folder}: modules_to_not_convert lists {listed!r}, but the checkpoint holds "
                                  f"{key} quantized; it can only load quantized (remove {listed!r} from the list)")
            check_layer_bias(reader, key, module.bias is not None, folder)   # the file's bias against config.json
            tensors = {t: (reader.shape(f"{key}.{t}"), reader.dtype(f"{key}.{t}"))
                       for t in layer_tensors(names, key)}
            new = HFQuantLinear(module.in_features, module.out_features, tensors, prefix=key)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, new)
            replaced += 1
        if replaced == 0:
            raise FormatError(f"{folder}: quant_method {self._qdict.get('quant_method')!r} but no linear layer "
                              "of the model matches quantized tensors in the checkpoint")
        _untie_quantized_head(model)
        _check_nothing_missing(model, names, folder, ckpt)
        reader.close()
        return model

    # -- after weights load ---------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model, **kwargs):
        from .modules import HFQuantLinear
        fmt, qdict = self._fmt, self._qdict
        for _, m in model.named_modules():
            if isinstance(m, HFQuantLinear):
                m.finalize(lambda get, prefix, m=m: fmt.load_layer(
                    get, lambda n: tuple(get(n).shape), prefix, m.in_features, m.out_features, qdict))
        return model

    def _dequantize(self, model, dtype=None):
        # transformers' `dequantize` passes `model.config.dtype` when the caller gives none; after
        # `save_pretrained` (or any config serialisation) that is the string "float32"/"float16".
        from .modules import HFQuantLinear, as_torch_dtype, to_dense_linear
        dtype = as_torch_dtype(dtype, default=_loaded_float_dtype(model))
        for name, m in list(model.named_modules()):
            if isinstance(m, HFQuantLinear):
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, to_dense_linear(m, dtype))
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


class ExlGptqHfQuantizer(ExlHfQuantizer):
    """GPTQ checkpoints (transformers' GPTQConfig) on exl_core kernels; opt-in, see config.py."""

    requires_calibration = True


def _loaded_float_dtype(model) -> torch.dtype:
    """dtype of the model's floating-point (non-quantized) parameters, float32 when it has none."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _has_index(folder: Path) -> bool:
    return (folder / "model.safetensors.index.json").is_file()


def _untie_quantized_head(model) -> None:
    """ExLlamaV2 stores a quantized lm_head for tied models: the stored head wins over the tie."""
    from .modules import HFQuantLinear
    head = model.get_output_embeddings()
    if isinstance(head, HFQuantLinear):
        for cfg in {id(model.config): model.config, id(model.config.get_text_config()): model.config.get_text_config()}.values():
            if getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = {}
        try:   # transformers caches the resolved tie map on the instance
            model.all_tied_weights_keys = {}
        except Exception:  # noqa: BLE001 - property without setter in some versions: nothing to clear
            pass


def _checkpoint_prefix(model, names: set) -> str:
    """"model." where the model is a base model (no `model.base_model_prefix` submodule) and the checkpoint's names
    carry that prefix (a causal-LM checkpoint), else ""."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or hasattr(model, prefix) or not any(n.startswith(prefix + ".") for n in names):
        return ""
    return prefix + "."


def _check_nothing_missing(model, names: set, folder: Path, ckpt: str = "") -> None:
    """Every persistent tensor of the model must come from the checkpoint (or a tie): transformers
    would silently random-initialise the rest, so refuse here, naming them."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    missing = [k for k in model.state_dict().keys()
               if ckpt + k not in names and k not in tied and not any(p.search(k) for p in ignore)]
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise FormatError(f"{folder}: the checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}. "
                          "Refusing to load rather than leave them randomly initialised.")


class _GptqRouter:
    """Occupies AUTO_QUANTIZER_MAPPING['gptq']: builds ours when routing is on, else the original."""

    original = None   # transformers' GptqHfQuantizer, set by register()

    def __new__(cls, quantization_config, **kwargs):
        if gptq_routing_enabled():
            return ExlGptqHfQuantizer(quantization_config, **kwargs)
        return cls.original(quantization_config, **kwargs)


def register() -> bool:
    """Register `exl2` (and the GPTQ router) with transformers. Idempotent; True if anything changed."""
    changed = False
    if EXL2_METHOD not in _auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        _auto.register_quantization_config(EXL2_METHOD)(ExlQuantConfig)
        changed = True
    if EXL2_METHOD not in _auto.AUTO_QUANTIZER_MAPPING:
        _auto.register_quantizer(EXL2_METHOD)(ExlHfQuantizer)
        changed = True
    types = getattr(_auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if types is not None and ExlQuantConfig not in types:
        # from_pretrained(quantization_config=ExlQuantConfig(modules_to_not_convert=...)) on a folder with its own
        # quantization_config keeps the loading attributes of these types only: ours were dropped with a warning
        _auto.LOADING_ATTRIBUTES_CONFIG_TYPES = types + (ExlQuantConfig,)
        changed = True
    current = _auto.AUTO_QUANTIZER_MAPPING.get("gptq")
    if current is not None and current is not _GptqRouter:
        # register_quantizer refuses an existing name; the router keeps the original reachable.
        _GptqRouter.original = current
        _auto.AUTO_QUANTIZER_MAPPING["gptq"] = _GptqRouter
        changed = True
    return changed


def is_registered() -> bool:
    return (_auto.AUTO_QUANTIZER_MAPPING.get(EXL2_METHOD) is ExlHfQuantizer
            and _auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(EXL2_METHOD) is ExlQuantConfig)


def _finish_deferred_registration() -> None:
    from .plugin import take_pending
    if take_pending():
        register()


_finish_deferred_registration()
