"""`ChatExl`: a LangChain chat model on exl_core's native Generator (chat template of the model)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator, Optional

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage,
                                     SystemMessage, ToolMessage)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from exl_core.errors import InputError

from ._common import ExlParams, gather_or_cancel, pop_model, usage

_ROLES = {HumanMessage: "user", AIMessage: "assistant", SystemMessage: "system", ToolMessage: "tool"}


def _text(content: Any, where: str) -> str:
    """Message content (str or content blocks) -> text; non-text blocks are refused."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InputError(f"ChatExl: {where} has a {kind!r} content block; this model takes text only")
    return "".join(parts)


def to_chat_dicts(messages: list[BaseMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        role = m.role if isinstance(m, ChatMessage) else next(
            (r for cls, r in _ROLES.items() if isinstance(m, cls)), None)
        if role is None:
            raise InputError(f"ChatExl: message {i} has unsupported type {type(m).__name__}")
        out.append({"role": role, "content": _text(m.content, f"message {i}")})
    return out


class ChatExl(ExlParams, BaseChatModel):
    """Chat model on exl_core: ``ChatExl(model="path/to/folder", temperature=0.7, max_tokens=256)``.

    invoke / batch / stream (one chunk per generated token) and their async forms; `stop=`
    strings are cut from the output; callbacks get ``on_llm_new_token``; the final message or
    chunk carries ``usage_metadata`` and ``response_metadata`` (``model_name``,
    ``finish_reason``). Per-call kwargs override sampler fields (``temperature``, ``top_p``,
    ``max_tokens``, ``seed``, ...) and ``model=`` picks another folder for that call.
    """

    streaming: bool = False
    """If True, invoke() runs through _stream so callbacks see every token."""

    @property
    def _llm_type(self) -> str:
        return "exl-chat"

    model_config = ConfigDict(extra="forbid")     # a misspelt setting is an error, not silently ignored

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._exl_params()

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="exl_core", ls_model_name=kwargs.get("model", self.model),
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        ls_stop = stop or self.stop
        if ls_stop:
            params["ls_stop"] = ls_stop
        return params

    # -- plumbing ----------------------------------------------------------------------------------
    def _prepare(self, messages: list[BaseMessage], stop: Optional[list[str]], kwargs: dict):
        kwargs = dict(kwargs)
        model = pop_model(kwargs)
        engine = self._engine(model)
        job = self._job(engine, self._prompt_ids(engine, messages), stop, **kwargs)
        return engine, job, model or self.model

    @staticmethod
    def _prompt_ids(engine, messages: list[BaseMessage]) -> list[int]:
        """The ids sent for `messages`: the model's chat template with the assistant's generation prompt."""
        text = engine.tokenizer.apply_chat_template(to_chat_dicts(messages), add_generation_prompt=True)
        return engine.tokenizer.encode(text, add_bos=False, special=True)   # the template has its own BOS

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Optional[Any] = None) -> int:
        """Tokens of the chat-templated prompt that invoke(messages) sends (the default counts each message's text
        by get_token_ids, without the template's role markers)."""
        if self.custom_get_token_ids is not None:       # the user's own counter, as LangChain uses it
            return super().get_num_tokens_from_messages(messages, tools)
        if tools is not None:                           # as LangChain's default does: ChatExl takes no tools
            import warnings
            warnings.warn("ChatExl: tool schemas are not counted; ignoring tools", stacklevel=2)
        return len(self._prompt_ids(self._engine(), messages))

    @staticmethod
    def _meta(job, model_name: str) -> dict:
        return {"model_name": model_name, "finish_reason": job.finish_reason, "model_provider": "exl_core"}

    def _last_chunk(self, job, model_name: str) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage(job), response_metadata=self._meta(job, model_name),
            chunk_position="last"))

    # -- sync --------------------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import generate_from_stream
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        engine, job, name = self._prepare(messages, stop, kwargs)
        text = "".join(r.text for r in engine.stream(job))
        msg = AIMessage(content=text, usage_metadata=usage(job), response_metadata=self._meta(job, name))
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info={"finish_reason": job.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        engine, job, name = self._prepare(messages, stop, kwargs)
        for r in engine.stream(job):
            if r.text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=r.text))
                if run_manager is not None:
                    run_manager.on_llm_new_token(r.text, chunk=chunk)
                yield chunk
        yield self._last_chunk(job, name)

    # -- async: the event loop awaits the engine's worker thread, it never runs the model ----------
    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import agenerate_from_stream
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        engine, job, name = await asyncio.to_thread(self._prepare, messages, stop, kwargs)   # a first load off the loop
        parts = [r.text async for r in engine.astream(job)]
        msg = AIMessage(content="".join(parts), usage_metadata=usage(job), response_metadata=self._meta(job, name))
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info={"finish_reason": job.finish_reason})])

    async def abatch(self, inputs: list, config=None, *, return_exceptions: bool = False, **kwargs: Any) -> list:
        """Runnable.abatch (ainvoke per input, max_concurrency honoured), except that when one input fails the
        others are cancelled, their jobs with them, before the error is raised: Runnable's plain asyncio.gather left
        them generating on the shared engine."""
        if return_exceptions or not inputs:     # every input runs to its end anyway
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        from langchain_core.runnables.config import get_config_list
        configs = get_config_list(config, len(inputs))
        limit = configs[0].get("max_concurrency")
        gate = asyncio.Semaphore(limit) if limit is not None else None

        async def one(value, cfg):
            if gate is None:
                return await self.ainvoke(value, cfg, **kwargs)
            async with gate:
                return await self.ainvoke(value, cfg, **kwargs)
        return await gather_or_cancel(*map(one, inputs, configs))

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        engine, job, name = await asyncio.to_thread(self._prepare, messages, stop, kwargs)
        async for r in engine.astream(job):
            if r.text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=r.text))
                if run_manager is not None:
                    await run_manager.on_llm_new_token(r.text, chunk=chunk)
                yield chunk
        yield self._last_chunk(job, name)
