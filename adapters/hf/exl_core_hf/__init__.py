"""exl-core-hf: load EXL2 (and, opt-in, GPTQ) checkpoints in transformers on exl_core kernels.

After `import exl_core` (the plugin hook registers) or `exl_core_hf.register()`:

    model = AutoModelForCausalLM.from_pretrained("path/to/exl2-folder")

GPTQ folders go to exl_core kernels when EXL_CORE_HF_GPTQ=1 or after `set_gptq_routing(True)`.
"""
from __future__ import annotations

__version__ = "0.1.0"


def register() -> bool:
    """Register the `exl2` quantizer (and GPTQ router) with transformers now; idempotent."""
    from .quantizer import register as _register
    return _register()


def set_gptq_routing(enabled):
    from .config import set_gptq_routing as _set
    _set(enabled)


def prepare_folder(folder):
    """Make an ExLlamaV2 (output*.safetensors) or AutoGPTQ (quantize_config.json) folder loadable by
    `from_pretrained` (see folder.py); returns what it changed."""
    from .folder import prepare_folder as _prepare
    return _prepare(folder)


def __getattr__(name):
    if name == "ExlQuantConfig":
        from .config import ExlQuantConfig
        return ExlQuantConfig
    if name in ("ExlHfQuantizer", "ExlGptqHfQuantizer"):
        from . import quantizer
        return getattr(quantizer, name)
    if name == "HFQuantLinear":
        from .modules import HFQuantLinear
        return HFQuantLinear
    raise AttributeError(f"module 'exl_core_hf' has no attribute {name!r}")


__all__ = ["register", "set_gptq_routing", "prepare_folder", "ExlQuantConfig", "ExlHfQuantizer", "ExlGptqHfQuantizer",
           "HFQuantLinear"]
