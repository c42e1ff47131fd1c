"""exl_core plugin hooks of langchain-exl (import stays cheap: no langchain here)."""
from __future__ import annotations

from exl_core.plugins import hookimpl


@hookimpl
def exl_core_register_integration() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("langchain-exl")
    except PackageNotFoundError:
        v = "0+unknown"
    return {"name": "langchain", "version": v, "kind": "langchain (ChatExl, ExlLLM)"}
