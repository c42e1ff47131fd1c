"""llama-index-llms-exl: `Exl`, a LlamaIndex LLM on exl_core's native generator.

`Exl` loads lazily so exl_core's plugin discovery (which imports `llama_index.llms.exl.plugin`)
does not import llama_index.core.
"""
__all__ = ["Exl"]


def __getattr__(name):
    if name == "Exl":
        from llama_index.llms.exl.base import Exl
        return Exl
    raise AttributeError(f"module 'llama_index.llms.exl' has no attribute {name!r}")
