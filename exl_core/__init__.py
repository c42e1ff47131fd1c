"""exl_core: fast inference for EXL2 and GPTQ quantized Llama-family models."""
from .errors import (CacheFullError, ConfigError, ExlError, FormatError, InputError, KernelError,
                     LoraError, SamplerError, TokenizerError)

__version__ = "0.1.0"

# The public API is imported lazily so `import exl_core` stays cheap and lower layers can be
# imported without pulling in the generator.
_LAZY = {
    "ModelConfig": ("config", "ModelConfig"),
    "load_config": ("config", "load_config"),
    "Model": ("model.llama", "Model"),
    "load_model": ("loader", "load_model"),
    "Tokenizer": ("tokenizer", "Tokenizer"),
    "Cache": ("cache", "Cache"),
    "Generator": ("generation", "Generator"),
    "Job": ("generation", "Job"),
    "SamplerSettings": ("generation.sampling", "SamplerSettings"),
    "load_lora": ("model.lora", "load_lora"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{mod}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'exl_core' has no attribute {name!r}")


__all__ = ["ExlError", "ConfigError", "FormatError", "TokenizerError", "CacheFullError", "SamplerError",
           "InputError", "KernelError", "LoraError", *_LAZY]


def _activate_plugins() -> None:
    """Run installed plugins' activation hooks once (e.g. the HF quantizer registration).

    A broken plugin is reported as a warning naming it, never an import failure here;
    EXL_CORE_NO_PLUGINS=1 switches discovery off.
    """
    try:
        from .plugins import activate_plugins
    except ImportError:  # pluggy missing: the core still works
        return
    activate_plugins()


_activate_plugins()
