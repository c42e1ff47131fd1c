"""What ChatExl and ExlLLM share: model/sampler fields, Job building, usage metadata."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

# Per-call kwargs that map onto SamplerSettings fields.
SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical", "repetition_penalty",
                "frequency_penalty", "presence_penalty", "penalty_range", "penalize_prompt", "temperature_last",
                "logit_bias", "banned_tokens")
# Per-call kwargs besides those (max_new_tokens: the same as max_tokens); model= / model_name= (another folder for
# the call) are taken by pop_model before.
CALL_KEYS = SAMPLER_KEYS + ("max_tokens", "max_new_tokens", "seed")


class ExlParams(BaseModel):
    """Fields of both LangChain classes. `model` is a model folder (dense, GPTQ or EXL2)."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model: str = Field(alias="model_name")
    """Model folder; instances with the same folder/device/dtype/cache share one loaded model."""
    device: str = "cpu"
    dtype: Optional[str] = None
    """"float16" / "bfloat16" / "float32"; None lets exl_core choose (float32 on CPU)."""
    cache_tokens: int = 8192
    """KV cache size of the shared engine (tokens over all concurrent requests)."""

    temperature: float = 0.7
    max_tokens: int = Field(default=256, alias="max_new_tokens")
    """New tokens at most (also accepted as max_new_tokens, exl_core's name)."""
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_range: int = -1
    """Tokens back that the penalties look at (-1: all)."""
    penalize_prompt: bool = True
    """False: the penalties count generated tokens only (OpenAI's convention), not the prompt's (llama.cpp's)."""
    temperature_last: bool = False
    """Apply the temperature after the truncation filters instead of before."""
    logit_bias: Optional[dict[int, float]] = None
    """Token id -> bias added to its logit."""
    banned_tokens: Optional[list[int]] = None
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    """Stop strings (never part of the output); merged with per-call `stop=`."""

    # Accepted for LangChain's standard parameters; a local model neither times out nor retries.
    timeout: Optional[float] = None
    max_retries: int = 0

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """["langchain_exl", the class's module]: where load() imports it from."""
        return ["langchain_exl", cls.__module__.rsplit(".", 1)[-1]]

    def _exl_params(self) -> dict[str, Any]:
        """Every setting that changes the output (LangChain's cache key is built from _identifying_params: two
        instances that differ in any of these must not share cached answers)."""
        return {k: getattr(self, k) for k in _OUTPUT_FIELDS if k in type(self).model_fields}

    def _engine(self, model: Optional[str] = None):
        from exl_core.plugins import dtype_setting, shared_engine
        return shared_engine(model or self.model, device=self.device,
                             dtype=dtype_setting(self.dtype, type(self).__name__), cache_tokens=self.cache_tokens)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` by the model's own tokenizer, encoded as ExlLLM encodes a prompt (LangChain's default
        counts with GPT-2's tokenizer: other counts, and offline none at all)."""
        custom = getattr(self, "custom_get_token_ids", None)    # LangChain's own override comes first
        if custom is not None:
            return custom(text)
        return completion_ids(self._engine().tokenizer, text, add_bos=getattr(self, "add_bos", None))

    def _job(self, engine, prompt_ids: list[int], stop: Optional[list[str]], **kwargs: Any):
        """A Job with this instance's settings overridden by call kwargs (temperature=..., max_tokens=...)."""
        import exl_core
        from exl_core.errors import InputError
        # LangChain's own per-call stream=<bool> comes through to _generate/_stream: core chose the path with it
        # already (BaseLLM ignores it), and the output is the same either way
        kwargs.pop("stream", None)
        unknown = sorted(set(kwargs) - set(CALL_KEYS))
        if unknown:
            raise InputError(f"{type(self).__name__}: unknown keyword argument(s) {', '.join(unknown)}; per call it "
                             f"takes {', '.join(CALL_KEYS)}, model and stop")
        sampler_kw = {k: kwargs.pop(k, getattr(self, k)) for k in SAMPLER_KEYS}
        sampler = exl_core.SamplerSettings(**sampler_kw)     # temperature 0 = greedy
        from exl_core.plugins import call_max_tokens, stop_strings
        max_new = call_max_tokens(kwargs, ("max_new_tokens", "max_tokens"), self.max_tokens,    # max_tokens wins
                                  type(self).__name__, "max_tokens")
        seed = kwargs.pop("seed", self.seed)
        stops = stop_strings(self.stop, stop, owner=type(self).__name__)
        return exl_core.Job(prompt_ids, max_new_tokens=max_new, sampler=sampler, stop=stops, seed=seed)


# Fields of ExlParams (and the classes' own output settings) that _exl_params reports.
_OUTPUT_FIELDS = ("model", "device", "dtype", "cache_tokens", "max_tokens", "seed", "stop", "add_bos") + SAMPLER_KEYS


def pop_model(kwargs: dict) -> Optional[str]:
    """The call's model folder (model= or model_name=), taken out of kwargs; None: the instance's."""
    return kwargs.pop("model", None) or kwargs.pop("model_name", None)


def completion_ids(tokenizer, prompt: str, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of a plain completion prompt, exactly as exl_core's `Generator.generate(prompt)`
    encodes it: `Tokenizer.encode`'s defaults, i.e. a BOS only when the model's tokenizer asks for
    one (tokenizer_config.json ``add_bos_token``; SmolLM2 says false) and special-token strings in
    the text as their ids -- also what transformers' tokenizer(prompt) gives. `add_bos` True/False
    overrides the tokenizer's BOS setting."""
    return tokenizer.encode(prompt, add_bos=add_bos)


async def gather_or_cancel(*aws):
    """asyncio.gather that, when one awaitable fails, cancels the others and waits for them before raising the first
    error: a task cancelled inside SharedEngine.astream cancels its job, so a failed prompt (longer than the cache,
    say) leaves no sibling generating on the shared engine. asyncio.TaskGroup does this from Python 3.11 only."""
    import asyncio
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def usage(job) -> dict:
    n_in, n_out = job.prompt_len, len(job.generated)
    return {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
