"""exl_core plugin hooks of llama-index-llms-exl (import stays cheap: no llama_index.core here)."""
from __future__ import annotations

from exl_core.plugins import hookimpl


@hookimpl
def exl_core_register_integration() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("llama-index-llms-exl")
    except PackageNotFoundError:
        v = "0+unknown"
    return {"name": "llamaindex", "version": v, "kind": "llamaindex (Exl LLM)"}
