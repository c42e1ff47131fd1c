"""langchain-exl: LangChain `ChatExl` and `ExlLLM` on exl_core's native generator.

    from langchain_exl import ChatExl
    chat = ChatExl(model="path/to/model-folder", temperature=0, max_tokens=128)
    print(chat.invoke("Hello").content)

The classes load lazily so exl_core's plugin discovery (which imports `langchain_exl.plugin`)
does not import langchain_core.
"""
__version__ = "0.1.0"
__all__ = ["ChatExl", "ExlLLM"]


def __getattr__(name):
    if name == "ChatExl":
        from .chat_models import ChatExl
        return ChatExl
    if name == "ExlLLM":
        from .llms import ExlLLM
        return ExlLLM
    raise AttributeError(f"module 'langchain_exl' has no attribute {name!r}")
