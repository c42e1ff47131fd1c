"""`Exl`: a LlamaIndex LLM on exl_core's native Generator.

chat/stream_chat (and async) format messages with the model's own chat template;
complete/stream_complete send the prompt as text (after `completion_to_prompt` unless
formatted=True), encoded as exl_core's native `Generator.generate(prompt)` encodes it (see
`completion_ids`). The model is loaded once per folder and shared (exl_core.plugins.shared_engine).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen,
                                              CompletionResponseGen, LLMMetadata, MessageRole, TextBlock)
from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical", "repetition_penalty",
                "frequency_penalty", "presence_penalty", "penalty_range", "penalize_prompt", "temperature_last",
                "logit_bias", "banned_tokens")
# Per-call kwargs besides those (max_tokens: the same as max_new_tokens).
CALL_KEYS = SAMPLER_KEYS + ("max_new_tokens", "max_tokens", "seed", "stop")


def completion_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a completion prompt, exactly as exl_core's `Generator.generate(prompt)` encodes
    it: `Tokenizer.encode`'s defaults, i.e. a BOS only when the model's tokenizer asks for one
    (tokenizer_config.json ``add_bos_token``; SmolLM2 says false) and special-token strings in the
    text as their ids -- also what transformers' tokenizer(prompt) gives. (langchain-exl has the
    same helper in langchain_exl/_common.py; the two distributions share only exl_core.)"""
    return tokenizer.encode(prompt)


def _text(message: ChatMessage, i: int) -> str:
    """A message's text; blocks other than text (images, audio, documents) are refused, not dropped."""
    from exl_core.errors import InputError
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise InputError(f"Exl: message {i} has a {type(block).__name__}; this model takes text only")
    return message.content or ""


class Exl(LLM):
    """``Exl(model="path/to/folder", temperature=0.7, max_new_tokens=256)``.

    chat() uses the model's chat template, unless ``messages_to_prompt`` is given: then its text is the prompt."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)   # a misspelt setting is an error

    model: str = Field(description="Model folder (dense, GPTQ or EXL2).")
    device: str = Field(default="cpu")
    dtype: Optional[str] = Field(default=None, description="float16/bfloat16/float32; None: exl_core's choice.")
    cache_tokens: int = Field(default=8192, description="KV cache size of the shared engine.")
    temperature: float = Field(default=0.7, ge=0.0)
    max_new_tokens: int = Field(default=256, gt=0, alias="max_tokens",
                                description="New tokens at most (also accepted as max_tokens).")
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_range: int = Field(default=-1, description="Tokens back that the penalties look at (-1: all).")
    penalize_prompt: bool = Field(default=True, description="False: the penalties count generated tokens only "
                                  "(OpenAI's convention), not the prompt's (llama.cpp's).")
    temperature_last: bool = Field(default=False, description="Temperature after the truncation filters.")
    logit_bias: Optional[dict[int, float]] = Field(default=None, description="Token id -> bias added to its logit.")
    banned_tokens: Optional[list[int]] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    context_window: Optional[int] = Field(default=None, description="Default: max_position_embeddings.")
    is_chat_model: bool = True

    _ctx: Optional[int] = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "Exl_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._context_window(), num_output=self.max_new_tokens,
                           is_chat_model=self.is_chat_model, model_name=self.model, system_role=MessageRole.SYSTEM)

    def _context_window(self) -> int:
        if self.context_window:
            return self.context_window
        if self._ctx is None:   # config.json only: no weights loaded for metadata
            from pathlib import Path

            from exl_core.config import load_config
            folder = Path(self.model).expanduser().resolve()     # as shared_engine reads it: "~/x" works there too
            self._ctx = min(load_config(folder).max_position_embeddings, self.cache_tokens)
        return self._ctx

    # -- plumbing ----------------------------------------------------------------------------------
    def _engine(self):
        from exl_core.plugins import dtype_setting, shared_engine
        return shared_engine(self.model, device=self.device, dtype=dtype_setting(self.dtype, "Exl"),
                             cache_tokens=self.cache_tokens)

    def _job(self, ids: list[int], **kwargs: Any):
        import exl_core
        from exl_core.errors import InputError
        unknown = sorted(set(kwargs) - set(CALL_KEYS))
        if unknown:
            raise InputError(f"Exl: unknown keyword argument(s) {', '.join(unknown)}; per call it takes "
                             f"{', '.join(CALL_KEYS)}")
        sampler = exl_core.SamplerSettings(**{k: kwargs.pop(k, getattr(self, k)) for k in SAMPLER_KEYS})
        from exl_core.plugins import call_max_tokens, stop_strings
        max_new = call_max_tokens(kwargs, ("max_tokens", "max_new_tokens"), self.max_new_tokens,   # the latter wins
                                  "Exl", "max_new_tokens")
        stops = stop_strings(self.stop, kwargs.pop("stop", None), owner="Exl")
        return exl_core.Job(ids, max_new_tokens=max_new, sampler=sampler, stop=stops,
                            seed=kwargs.pop("seed", self.seed))

    def _chat_job(self, messages: Sequence[ChatMessage], kwargs: dict):
        texts = [_text(m, i) for i, m in enumerate(messages)]
        eng = self._engine()
        if self.messages_to_prompt is not generic_messages_to_prompt:     # the user's own prompt format
            return eng, self._job(completion_ids(eng.tokenizer, self.messages_to_prompt(messages)), **kwargs)
        dicts = [{"role": m.role.value, "content": t} for m, t in zip(messages, texts)]
        text = eng.tokenizer.apply_chat_template(dicts, add_generation_prompt=True)
        return eng, self._job(eng.tokenizer.encode(text, add_bos=False, special=True), **kwargs)

    def _completion_job(self, prompt: str, formatted: bool, kwargs: dict):
        eng = self._engine()
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return eng, self._job(completion_ids(eng.tokenizer, prompt), **kwargs)

    @staticmethod
    def _info(job) -> dict:
        n_in, n_out = job.prompt_len, len(job.generated)
        return {"finish_reason": job.finish_reason, "prompt_tokens": n_in, "completion_tokens": n_out,
                "total_tokens": n_in + n_out}

    def _assistant(self, text: str) -> ChatMessage:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)

    # -- completion --------------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        eng, job = self._completion_job(prompt, formatted, kwargs)
        text = "".join(r.text for r in eng.stream(job))
        return CompletionResponse(text=text, additional_kwargs=self._info(job))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        eng, job = self._completion_job(prompt, formatted, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for r in eng.stream(job):
                if r.text or r.finish_reason is not None:
                    text += r.text
                    yield CompletionResponse(text=text, delta=r.text,
                                             additional_kwargs=self._info(job) if r.finish_reason else {})
        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        eng, job = await asyncio.to_thread(self._completion_job, prompt, formatted, kwargs)   # a first load
        parts = [r.text async for r in eng.astream(job)]
        return CompletionResponse(text="".join(parts), additional_kwargs=self._info(job))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        eng, job = await asyncio.to_thread(self._completion_job, prompt, formatted, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for r in eng.astream(job):
                if r.text or r.finish_reason is not None:
                    text += r.text
                    yield CompletionResponse(text=text, delta=r.text,
                                             additional_kwargs=self._info(job) if r.finish_reason else {})
        return gen()

    # -- chat (model's chat template) ----------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        eng, job = self._chat_job(messages, kwargs)
        text = "".join(r.text for r in eng.stream(job))
        return ChatResponse(message=self._assistant(text), additional_kwargs=self._info(job))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        eng, job = self._chat_job(messages, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for r in eng.stream(job):
                if r.text or r.finish_reason is not None:
                    text += r.text
                    yield ChatResponse(message=self._assistant(text), delta=r.text,
                                       additional_kwargs=self._info(job) if r.finish_reason else {})
        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        eng, job = await asyncio.to_thread(self._chat_job, messages, kwargs)   # a first call loads the model
        parts = [r.text async for r in eng.astream(job)]
        return ChatResponse(message=self._assistant("".join(parts)), additional_kwargs=self._info(job))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        eng, job = await asyncio.to_thread(self._chat_job, messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for r in eng.astream(job):
                if r.text or r.finish_reason is not None:
                    text += r.text
                    yield ChatResponse(message=self._assistant(text), delta=r.text,
                                       additional_kwargs=self._info(job) if r.finish_reason else {})
        return gen()
