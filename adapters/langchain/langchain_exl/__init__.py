"""langchain-exl: LangChain `ChatExl` and `ExlLLM` on exl_core's native generator.

    from langchain_exl import ChatExl
    chat = ChatExl(model="path/to/model-folder", temperature=0, max_tokens=128)
    print(chat.invoke("Hello").content)
"""
from .chat_models import ChatExl
from .llms import ExlLLM

__version__ = "0.1.0"
__all__ = ["ChatExl", "ExlLLM"]
