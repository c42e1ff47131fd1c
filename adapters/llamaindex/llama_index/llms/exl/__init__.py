"""llama-index-llms-exl: `Exl`, a LlamaIndex LLM on exl_core's native generator."""
from llama_index.llms.exl.base import Exl

__all__ = ["Exl"]
