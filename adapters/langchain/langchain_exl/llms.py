"""`ExlLLM`: a LangChain text-completion LLM on exl_core's native Generator (no chat template)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Iterator, Optional

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.language_models.base import LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from ._common import ExlParams, completion_ids, gather_or_cancel, pop_model, usage


class ExlLLM(ExlParams, BaseLLM):
    """Completion model: ``ExlLLM(model="path/to/folder", max_tokens=64).invoke("Once upon a time")``.

    `batch()` / `generate([...])` send all prompts to the Generator at once (one batched run).
    Prompts are encoded as exl_core's native ``Generator.generate(prompt)`` encodes them (the
    tokenizer's own BOS setting, ``add_bos_token``), so greedy output matches it and transformers'
    ``generate`` on the same prompt. generation_info carries finish_reason and usage.
    """

    add_bos: Optional[bool] = None
    """None: a BOS only if the model's tokenizer adds one (tokenizer_config.json add_bos_token);
    True/False: always / never prepend the BOS."""

    @property
    def _llm_type(self) -> str:
        return "exl"

    model_config = ConfigDict(extra="forbid")     # a misspelt setting is an error, not silently ignored

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._exl_params()

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="exl_core", ls_model_name=kwargs.get("model", self.model),
                                 ls_model_type="llm", ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _prepare(self, prompt: str, stop: Optional[list[str]], kwargs: dict):
        kwargs = dict(kwargs)
        engine = self._engine(pop_model(kwargs))
        ids = completion_ids(engine.tokenizer, prompt, add_bos=self.add_bos)
        return engine, self._job(engine, ids, stop, **kwargs)

    @staticmethod
    def _info(job) -> dict:
        return {"finish_reason": job.finish_reason, "usage": usage(job)}

    def _generate(self, prompts: list[str], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> LLMResult:
        prepared = [self._prepare(p, stop, kwargs) for p in prompts]
        by_engine: dict[int, list] = {}
        for eng, job in prepared:
            by_engine.setdefault(id(eng), [eng, []])[1].append(job)
        texts = {}
        for eng, jobs in by_engine.values():   # one batched run per model folder
            for job, text in zip(jobs, eng.run(jobs)):
                texts[job.identifier] = text
        gens = [[Generation(text=texts[job.identifier], generation_info=self._info(job))] for _, job in prepared]
        total = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        for _, job in prepared:
            for k, v in usage(job).items():
                total[k] += v
        return LLMResult(generations=gens, llm_output={"token_usage": total, "model_name": self.model})

    async def _agenerate(self, prompts: list[str], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> LLMResult:
        import asyncio

        async def one(prompt):
            eng, job = await asyncio.to_thread(self._prepare, prompt, stop, kwargs)   # a first load off the loop
            text = "".join([r.text async for r in eng.astream(job)])
            return job, text
        done = await gather_or_cancel(*(one(p) for p in prompts))   # concurrent jobs batch in the engine
        total = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        for job, _ in done:
            for k, v in usage(job).items():
                total[k] += v
        return LLMResult(generations=[[Generation(text=t, generation_info=self._info(j))] for j, t in done],
                         llm_output={"token_usage": total, "model_name": self.model})

    def _stream(self, prompt: str, stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        eng, job = self._prepare(prompt, stop, kwargs)
        for r in eng.stream(job):
            info = self._info(job) if r.finish_reason is not None else None
            if r.text or info:
                chunk = GenerationChunk(text=r.text, generation_info=info)
                if run_manager is not None and r.text:
                    run_manager.on_llm_new_token(r.text, chunk=chunk)
                yield chunk

    async def _astream(self, prompt: str, stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        import asyncio
        eng, job = await asyncio.to_thread(self._prepare, prompt, stop, kwargs)
        async for r in eng.astream(job):
            info = self._info(job) if r.finish_reason is not None else None
            if r.text or info:
                chunk = GenerationChunk(text=r.text, generation_info=info)
                if run_manager is not None and r.text:
                    await run_manager.on_llm_new_token(r.text, chunk=chunk)
                yield chunk
