"""langchain-exl against the real SmolLM2-135M-Instruct.

Reference for the text: transformers' own greedy generation with its own chat template on the
same folder (an implementation independent of exl_core). LangChain's standard suites are in
test_langchain_standard.py.
"""
from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from exl_core.errors import InputError
from exl_core.testing import (COMPLETION_PROMPT, COMPLETION_TOKENIZER_CASES, assert_native_generates,
                              event_loop_ticks_within, native_prompt_ids, record_prompts)
from langchain_exl import ChatExl, ExlLLM

N = 16   # tokens per generation in these tests: enough to see divergence, cheap on 2 cores


def chat(path, **kw) -> ChatExl:
    return ChatExl(model=path, temperature=0, max_tokens=kw.pop("max_tokens", N), **kw)


def hf_greedy(path: str, messages: tuple, n: int) -> str:
    return hf_greedy_tokens(path, messages, n)[0]


@functools.lru_cache(maxsize=None)
def hf_greedy_tokens(path: str, messages: tuple, n: int) -> tuple[str, int]:
    """transformers' greedy continuation of the chat-templated messages (independent reference)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = _hf_model(path)
    ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), out.shape[1] - ids.shape[1]


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def pick_stop(text: str) -> str:
    """A short substring whose first occurrence is well inside `text` (so the cut is non-trivial)."""
    for k in range(max(1, len(text) // 3), len(text) - 2):
        cand = text[k:k + 3]
        if cand.strip() and text.index(cand) > 0:
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


class Collect(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


# -- behaviour against references ---------------------------------------------------------------

@pytest.mark.real_model
def test_invoke_matches_transformers_greedy(smollm2_dir):
    msgs = (("system", "You are a concise assistant."), ("user", "Name three primary colors."))
    res = chat(smollm2_dir).invoke([SystemMessage(msgs[0][1]), HumanMessage(msgs[1][1])])
    assert isinstance(res, AIMessage)
    text, n_tokens = hf_greedy_tokens(smollm2_dir, msgs, N)
    assert res.content == text
    u = res.usage_metadata          # generated tokens counted like transformers does (EOS included)
    assert u["output_tokens"] == n_tokens and u["total_tokens"] == u["input_tokens"] + n_tokens
    assert u["input_tokens"] > 10 and res.response_metadata["model_name"] == smollm2_dir
    assert res.response_metadata["finish_reason"] == ("length" if n_tokens == N else "eos")


@pytest.mark.real_model
def test_stream_is_token_by_token_with_callbacks_and_usage(smollm2_dir):
    cb = Collect()
    model = chat(smollm2_dir)
    chunks = list(model.stream("Tell me about the sea.", config={"callbacks": [cb]}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    texts = [c.content for c in chunks if c.content]
    assert len(texts) >= N - 3          # one chunk per token (a few may merge across UTF-8/stop hold-back)
    assert [t for t in cb.tokens if t] == texts     # LangChain adds one "" for the closing chunk
    cb2 = Collect()                     # streaming=True: invoke() runs _stream, callbacks see every token
    msg = ChatExl(model=smollm2_dir, temperature=0, max_tokens=N, streaming=True).invoke(
        "Tell me about the sea.", config={"callbacks": [cb2]})
    assert [t for t in cb2.tokens if t] == texts and msg.content == "".join(texts)
    full = functools.reduce(lambda a, b: a + b, chunks)
    assert full.content == "".join(texts) == model.invoke("Tell me about the sea.").content
    assert chunks[-1].chunk_position == "last" and full.usage_metadata["output_tokens"] == N


@pytest.mark.real_model
def test_stop_sequence_cuts_output(smollm2_dir):
    model = chat(smollm2_dir, max_tokens=24)
    text = model.invoke("Count from one to ten in words, separated by commas.").content
    stop = pick_stop(text)
    cut = text[:text.index(stop)]
    res = model.invoke("Count from one to ten in words, separated by commas.", stop=[stop])
    assert res.content == cut and res.response_metadata["finish_reason"] == "stop"
    # one string is one stop (it was split into its characters, cutting at the first of any)
    assert model.invoke("Count from one to ten in words, separated by commas.", stop=stop).content == cut
    bound = chat(smollm2_dir, max_tokens=24, stop=[stop])          # stop as a model field
    assert bound.invoke("Count from one to ten in words, separated by commas.").content == cut
    streamed = "".join(c.content for c in model.stream("Count from one to ten in words, separated by commas.",
                                                         stop=[stop]))
    assert streamed == cut


@pytest.mark.real_model
@pytest.mark.slow      # many generations: > 20 s on 2 shared cores
def test_batch_and_async_agree_with_invoke(smollm2_dir):
    model = chat(smollm2_dir)
    prompts = ["What is 2+2?", "Say hello in French.", "Name a planet."]
    single = [model.invoke(p).content for p in prompts]
    assert [m.content for m in model.batch(prompts)] == single

    async def run():
        together = await asyncio.gather(*(model.ainvoke(p) for p in prompts))
        streamed = [c.content async for c in model.astream(prompts[0])]
        return [m.content for m in together], "".join(streamed)
    together, streamed = asyncio.run(run())
    assert together == single and streamed == single[0]


@pytest.mark.real_model
@pytest.mark.slow      # many generations: > 20 s on 2 shared cores
def test_sampler_parameters_and_overrides(smollm2_dir):
    model = ChatExl(model=smollm2_dir, temperature=1.5, top_k=50, max_tokens=N)
    a = model.invoke("Write a random word.", seed=1234).content
    b = model.invoke("Write a random word.", seed=1234).content
    c = model.invoke("Write a random word.", seed=99).content
    assert a == b and a != c
    short = model.invoke("Write a long story.", max_tokens=3, temperature=0)
    assert short.usage_metadata["output_tokens"] == 3 and short.response_metadata["finish_reason"] == "length"
    assert short.content == chat(smollm2_dir, max_tokens=3).invoke("Write a long story.").content


@pytest.mark.real_model
def test_instances_share_one_loaded_model(smollm2_dir):
    a, b = chat(smollm2_dir), ChatExl(model=smollm2_dir, temperature=0.3)
    ea, eb = a._engine(), b._engine()
    assert ea is eb and ea.model is eb.model
    assert ExlLLM(model=smollm2_dir)._engine() is ea


@pytest.mark.real_model
def test_lcel_chain_streams_and_honours_stop(smollm2_dir):
    prompt = ChatPromptTemplate.from_messages([("system", "You answer briefly."), ("human", "{question}")])
    chain = prompt | chat(smollm2_dir) | StrOutputParser()
    q = {"question": "What is the capital of France?"}
    pieces = list(chain.stream(q))
    assert len(pieces) > 3 and all(isinstance(p, str) for p in pieces)
    full = chain.invoke(q)
    assert "".join(pieces) == full
    assert full == hf_greedy(smollm2_dir, (("system", "You answer briefly."),
                                           ("user", "What is the capital of France?")), N)
    stop = pick_stop(full)
    stopped = (prompt | chat(smollm2_dir).bind(stop=[stop]) | StrOutputParser()).invoke(q)
    assert stopped == full[:full.index(stop)]


@pytest.mark.real_model
@pytest.mark.slow      # many generations: > 20 s on 2 shared cores
def test_llm_completion_batch_stream_and_stop(smollm2_dir):
    llm = ExlLLM(model=smollm2_dir, temperature=0, max_tokens=N)
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    single = [llm.invoke(p) for p in prompts]
    assert llm.batch(prompts) == single
    assert "".join(llm.stream(prompts[1])) == single[1]
    assert asyncio.run(llm.ainvoke(prompts[0])) == single[0]
    # reference: transformers greedy on the raw prompt (SmolLM2 adds no BOS of its own); the
    # prompt ids must be transformers' and the native tokenizer's default encoding
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok(prompts[1], return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == llm._engine().tokenizer.encode(prompts[1])
    with torch.inference_mode():
        out = _hf_model(smollm2_dir).generate(ids, max_new_tokens=N, do_sample=False,
                                              pad_token_id=tok.eos_token_id)
    assert single[1] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    stop = pick_stop(single[1])
    assert llm.invoke(prompts[1], stop=[stop]) == single[1][:single[1].index(stop)]


def test_non_text_content_is_refused():
    from langchain_exl.chat_models import to_chat_dicts
    msgs = [HumanMessage(content=[{"type": "text", "text": "hi"},
                                  {"type": "image", "url": "http://127.0.0.1/x.png"}])]
    with pytest.raises(InputError, match="image"):
        to_chat_dicts(msgs)
    assert to_chat_dicts([SystemMessage("s"), HumanMessage([{"type": "text", "text": "a"}, "b"])]) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]


# -- completion prompts are encoded like exl_core's native Generator ----------------------------

@pytest.mark.parametrize("source,add_bos_token", COMPLETION_TOKENIZER_CASES)
def test_llm_prompt_ids_are_the_native_generators(completion_model, monkeypatch, source, add_bos_token):
    """Regression: ExlLLM prepended a BOS to every prompt although SmolLM2's tokenizer says
    add_bos_token false, so its greedy text differed from Generator.generate and transformers."""
    folder = completion_model(source, add_bos_token)
    llm = ExlLLM(model=folder, temperature=0, max_tokens=4)
    eng = llm._engine()
    tok = eng.tokenizer
    prompt = COMPLETION_PROMPT
    want = native_prompt_ids(tok, add_bos_token)          # the native tokenizer's default encoding

    seen = record_prompts(eng.generator, monkeypatch)
    text = llm.invoke(prompt)
    assert llm.batch([prompt, prompt]) == [text, text]
    assert "".join(llm.stream(prompt)) == text
    assert asyncio.run(llm.ainvoke(prompt)) == text
    assert seen == [want] * 5

    assert_native_generates(eng, text, want, monkeypatch)   # the native path: same ids, same greedy text

    # explicit override still works
    seen.clear()
    ExlLLM(model=folder, temperature=0, max_tokens=1, add_bos=False).invoke(prompt)
    ExlLLM(model=folder, temperature=0, max_tokens=1, add_bos=True).invoke(prompt)
    assert seen == [tok.encode(prompt, add_bos=False), tok.encode(prompt, add_bos=True)]
    assert seen[0][0] != tok.bos_token_id and seen[1][0] == tok.bos_token_id


# -- settings: cache keys, validation, async loading, serialization -------------------------------

def test_every_output_setting_is_in_the_cache_key(completion_model):
    """LangChain's LLM cache keys on _identifying_params: instances differing in any setting that changes the
    output must not share entries (regression: penalties, min_p, seed, stop, ... were left out)."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache
    from langchain_exl._common import _OUTPUT_FIELDS
    folder = completion_model("smollm2", False)
    changed = {"device": "meta", "dtype": "float16", "cache_tokens": 64, "max_tokens": 3, "seed": 5, "stop": ["x"],
               "add_bos": True, "temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "typical": 0.5,
               "repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.5, "penalty_range": 8,
               "penalize_prompt": False, "temperature_last": True, "logit_bias": {1: 2.0}, "banned_tokens": [3],
               "model": folder + "/other"}
    assert set(changed) == set(_OUTPUT_FIELDS)
    base = ExlLLM(model=folder, temperature=0, max_tokens=4)
    for k, v in changed.items():
        assert ExlLLM(**{"model": folder, "temperature": 0, "max_tokens": 4, k: v})._identifying_params != \
            base._identifying_params, k
    set_llm_cache(InMemoryCache())
    try:
        first = base.invoke(COMPLETION_PROMPT)
        ids = base._engine().tokenizer.encode(first)
        banned = ExlLLM(model=folder, temperature=0, max_tokens=4, banned_tokens=ids[:1]).invoke(COMPLETION_PROMPT)
        assert banned != first                          # computed, not the cached answer of `base`
        assert base.invoke(COMPLETION_PROMPT) == first
    finally:
        set_llm_cache(None)


def test_settings_are_validated_and_reach_the_sampler(completion_model):
    from pydantic import ValidationError
    folder = completion_model("smollm2", False)
    with pytest.raises(ValidationError, match="top_pp"):
        ExlLLM(model=folder, top_pp=0.1)
    with pytest.raises(ValidationError, match="model_kwargs"):
        ChatExl(model=folder, model_kwargs={"x": 1})
    assert ExlLLM(model=folder, max_new_tokens=2).max_tokens == 2      # exl_core's name for it
    assert ChatExl(model=folder, max_new_tokens=2).max_tokens == 2
    llm = ExlLLM(model=folder, temperature=0, max_tokens=4)
    with pytest.raises(InputError, match="top_pp"):
        llm.invoke(COMPLETION_PROMPT, top_pp=0.1)
    plain = llm.invoke(COMPLETION_PROMPT)
    first = llm._engine().tokenizer.encode(plain)[0]
    assert llm.invoke(COMPLETION_PROMPT, max_new_tokens=1) == llm._engine().tokenizer.decode([first])
    for per_call in ({"banned_tokens": [first]}, {"logit_bias": {first: -1e4}}):
        got = llm.invoke(COMPLETION_PROMPT, **per_call)
        assert llm._engine().tokenizer.encode(got)[:1] != [first], per_call


def test_penalty_convention_settings_reach_the_sampler(completion_model, monkeypatch):
    """penalize_prompt (OpenAI's convention: generated tokens only) and temperature_last were not settable here."""
    llm = ExlLLM(model=completion_model("smollm2", False), temperature=0, max_tokens=1, penalize_prompt=False)
    from exl_core.testing import record_prompts
    seen = record_prompts(llm._engine().generator, monkeypatch, of=lambda job: job.sampler)
    llm.invoke(COMPLETION_PROMPT)
    llm.invoke(COMPLETION_PROMPT, penalize_prompt=True, temperature_last=True)
    assert [(s.penalize_prompt, s.temperature_last) for s in seen] == [(False, False), (True, True)]


def test_async_calls_load_the_model_off_the_event_loop(completion_model, monkeypatch):
    """The first call on a folder loads the model: in ainvoke / astream that runs in a worker thread, so the event
    loop keeps serving other tasks meanwhile (regression: it stalled for the whole load)."""
    import time
    from langchain_exl._common import ExlParams
    folder = completion_model("smollm2", False)
    real = ExlParams._engine

    spans = []                                       # (start, end) of each slow load

    def slow_engine(self, model=None):
        spans.append([time.monotonic()])
        time.sleep(0.4)
        spans[-1].append(time.monotonic())           # a load's duration, on whichever thread calls it
        return real(self, model)
    monkeypatch.setattr(ExlParams, "_engine", slow_engine)

    llm = ExlLLM(model=folder, temperature=0, max_tokens=2)
    chat_model = ChatExl(model=folder, temperature=0, max_tokens=2)

    async def astream_all():
        return [c async for c in chat_model.astream("hi")]
    for call in (lambda: llm.ainvoke(COMPLETION_PROMPT), lambda: chat_model.ainvoke("hi"), astream_all):
        assert event_loop_ticks_within(call, lambda: spans[-1]) >= 10   # ticks during the load


@pytest.mark.parametrize("cls,module", [(ExlLLM, "llms"), (ChatExl, "chat_models")])
def test_models_serialize_and_load_back(cls, module):
    from langchain_core.load import dumpd, load
    llm = cls(model="some/folder", temperature=0.2, max_tokens=7, stop=["\n"], logit_bias={5: -2.0})
    ser = dumpd(llm)
    assert ser["id"] == ["langchain_exl", module, cls.__name__]
    back = load(ser, valid_namespaces=["langchain_exl"], allowed_objects=[cls])
    assert type(back) is cls and back._identifying_params == llm._identifying_params


# -- async batches, LangChain's own kwargs, token counts, per-call max_tokens ---------------------

def test_a_failed_prompt_cancels_the_other_prompts_jobs(completion_model, monkeypatch):
    """Regression: ExlLLM.agenerate/abatch and ChatExl.abatch ran one task per prompt under plain asyncio.gather: when
    one prompt failed (longer than the cache) the call raised while the others' jobs went on generating on the shared
    engine."""
    from exl_core.errors import CacheFullError
    # EOS banned: a sibling left running would generate to the cache's end (seconds), not stop on its own
    kw = dict(model=completion_model("smollm2", False), temperature=0, max_tokens=4000, cache_tokens=1024,
              banned_tokens=[2])
    llm, chat_model = ExlLLM(**kw), ChatExl(**kw)
    gen = llm._engine().generator
    assert chat_model._engine().generator is gen
    jobs = record_prompts(gen, monkeypatch, of=lambda job: job)
    too_long = "the cat " * 1000            # more tokens than the cache holds: CacheFullError at enqueue

    async def left_running(call) -> list:
        with pytest.raises(CacheFullError):
            await call()
        for _ in range(500):                # a cancel takes effect at the end of the engine's running step
            if not gen.pending_jobs():
                break
            await asyncio.sleep(0.01)
        return gen.pending_jobs()           # read while the loop still runs (asyncio.run's end cancels what is left)
    for call in (lambda: llm.agenerate(["the cat", too_long]), lambda: llm.abatch(["the cat", too_long]),
                 lambda: chat_model.abatch(["the cat", too_long])):
        jobs.clear()
        assert asyncio.run(left_running(call)) == []
        assert [j.finish_reason for j in jobs if len(j.input_ids) < 100] in ([], ["cancelled"])
    short = chat(kw["model"], max_tokens=3, cache_tokens=1024)     # abatch keeps max_concurrency, return_exceptions
    want = short.invoke("hi").content
    assert [m.content for m in asyncio.run(short.abatch(["hi", "hi"], config={"max_concurrency": 1}))] == [want] * 2
    ok, err = asyncio.run(short.abatch(["hi", too_long], return_exceptions=True))
    assert ok.content == want and isinstance(err, CacheFullError)


def test_langchains_own_stream_kwarg_is_accepted(completion_model):
    """Regression: LangChain passes its per-call stream=<bool> on to _generate/_stream (core already chose the path
    with it); ChatExl and ExlLLM refused it as an unknown keyword argument."""
    folder = completion_model("smollm2", False)
    chat_model = chat(folder, max_tokens=3)
    want = chat_model.invoke("hi").content
    for kw in ({"stream": False}, {"stream": True}):
        assert chat_model.invoke("hi", **kw).content == want
        assert asyncio.run(chat_model.ainvoke("hi", **kw)).content == want
        assert "".join(c.content for c in chat_model.stream("hi", **kw)) == want
    assert chat_model.bind(stream=True).invoke("hi").content == want
    llm = ExlLLM(model=folder, temperature=0, max_tokens=3)
    text = llm.invoke(COMPLETION_PROMPT)
    assert llm.invoke(COMPLETION_PROMPT, stream=True) == "".join(llm.stream(COMPLETION_PROMPT, stream=False)) == text


@pytest.mark.parametrize("source,add_bos_token", COMPLETION_TOKENIZER_CASES)
def test_token_ids_are_the_models_own(completion_model, monkeypatch, source, add_bos_token):
    """Regression: get_token_ids / get_num_tokens fell back to GPT-2's tokenizer (0 tokens offline)."""
    llm = ExlLLM(model=completion_model(source, add_bos_token), temperature=0, max_tokens=1)
    seen = record_prompts(llm._engine().generator, monkeypatch)
    llm.invoke(COMPLETION_PROMPT)
    assert llm.get_token_ids(COMPLETION_PROMPT) == seen[0] == native_prompt_ids(llm._engine().tokenizer, add_bos_token)
    assert llm.get_num_tokens(COMPLETION_PROMPT) == len(seen[0])
    with_bos = ExlLLM(model=llm.model, add_bos=True)          # the instance's BOS setting, as its calls use it
    assert with_bos.get_token_ids(COMPLETION_PROMPT) == llm._engine().tokenizer.encode(COMPLETION_PROMPT, add_bos=True)
    assert ExlLLM(model=llm.model, custom_get_token_ids=lambda t: [7]).get_token_ids(COMPLETION_PROMPT) == [7]


def test_chat_token_count_is_the_templated_prompts(completion_model, monkeypatch):
    """Regression: ChatExl counted tokens with GPT-2's tokenizer, message by message without the chat template; the
    count is now that of the prompt invoke() sends."""
    chat_model = chat(completion_model("smollm2", False), max_tokens=1)
    tok = chat_model._engine().tokenizer
    assert chat_model.get_token_ids(COMPLETION_PROMPT) == tok.encode(COMPLETION_PROMPT)
    msgs = [SystemMessage("You are brief."), HumanMessage(COMPLETION_PROMPT), AIMessage("ok"), HumanMessage("more")]
    seen = record_prompts(chat_model._engine().generator, monkeypatch)
    res = chat_model.invoke(msgs)
    n = chat_model.get_num_tokens_from_messages(msgs)
    assert n == len(seen[0]) == res.usage_metadata["input_tokens"] > len(tok.encode(COMPLETION_PROMPT)) + 4


def test_per_call_max_tokens_is_checked(completion_model):
    """Regression: per-call max_tokens went through a bare int(): None (the instance's setting) raised a raw
    TypeError, 2.9 became 2 and True 1."""
    import re
    folder = completion_model("smollm2", False)
    llm = ExlLLM(model=folder, temperature=0, max_tokens=3, banned_tokens=[2])     # no EOS: the length decides

    def out_tokens(**kw) -> int:
        return llm.generate([COMPLETION_PROMPT], **kw).generations[0][0].generation_info["usage"]["output_tokens"]
    assert out_tokens(max_tokens=None) == out_tokens(max_new_tokens=None) == 3
    assert out_tokens(max_tokens=2, max_new_tokens=None) == 2
    chat_model = chat(folder, max_tokens=3)
    for bad in (2.9, True, 0, -1, "2"):
        for key in ("max_tokens", "max_new_tokens"):
            with pytest.raises(InputError, match=re.escape(f"ExlLLM: {key}={bad!r}")):
                llm.invoke(COMPLETION_PROMPT, **{key: bad})
            with pytest.raises(InputError, match=re.escape(f"ChatExl: {key}={bad!r}")):
                chat_model.invoke("hi", **{key: bad})
