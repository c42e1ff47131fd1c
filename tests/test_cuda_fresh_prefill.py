"""A fresh sequence's prefill by SDPA's causal mask on a GPU (cache/paged.py fresh_prefill_on, on by default since stop
51, EXL_CORE_FRESH_PREFILL=0 turns it off): the model's logits of a paged prefill as with paged attention over gathered
pages, and the path taken in every layer. (Its attention against float64 brute force runs on the CPU, forced on:
tests/test_cache_pages.py, tests/test_attention_gathered.py.)"""
from __future__ import annotations

import pytest
import torch

from exl_core.cache import Cache
from exl_core.cache import paged
from exl_core.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("llama", seed=7, vocab_size=500, num_attention_heads=4, num_key_value_heads=2)


def prefill_logits(model, ids: list[int]) -> tuple[torch.Tensor, bool]:
    """Every row's logits (float32) of one prefill over a fresh paged cache, and whether its context is fresh."""
    cache = Cache(model, max_tokens=len(ids) + 64, page_size=16)
    table = cache.try_admit(ids, len(ids) + 8, len(ids), reuse=False)
    ctx = cache.context([table], [len(ids)])
    with torch.inference_mode():
        return model.forward(torch.tensor(ids, device=model.device), ctx).float(), ctx.fresh


def _count_calls(monkeypatch) -> list:
    """A list that grows by one each time the model's attention runs sequence_causal_attention."""
    calls = []
    real = paged.sequence_causal_attention
    monkeypatch.setattr(paged, "sequence_causal_attention", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-2)])
def test_fresh_prefill_matches_gathered_pages_on_the_gpu(tiny, monkeypatch, dtype, tol):
    model, _ = load_model(tiny, device="cuda", dtype=dtype, load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (77,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = _count_calls(monkeypatch)
    monkeypatch.setenv("EXL_CORE_FRESH_PREFILL", "0")
    off, fresh = prefill_logits(model, ids)
    assert fresh and calls == []
    monkeypatch.setenv("EXL_CORE_FRESH_PREFILL", "1")
    on, _ = prefill_logits(model, ids)
    assert len(calls) == model.config.num_hidden_layers
    assert torch.isfinite(on).all()
    scale = off.abs().max().item()
    assert (on - off).abs().max().item() <= tol * max(scale, 1.0)


def chunked_logits(model, ids: list[int], first: int) -> torch.Tensor:
    """The second chunk's logits (float32) of a prefill in two chunks, `first` rows then the rest, over a paged cache."""
    cache = Cache(model, max_tokens=len(ids) + 64, page_size=16)
    table = cache.try_admit(ids, len(ids) + 8, len(ids), reuse=False)
    with torch.inference_mode():
        model.forward(torch.tensor(ids[:first], device=model.device), cache.context([table], [first]))
        cache.after_forward(table, ids[:first], first, more_to_come=True)
        ctx = cache.context([table], [len(ids) - first])
        assert ctx.single and not ctx.fresh
        return model.forward(torch.tensor(ids[first:], device=model.device), ctx).float()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-2)])
def test_later_chunk_matches_gathered_pages_on_the_gpu(tiny, monkeypatch, dtype, tol):
    """A prefill's second chunk by the lower-right causal mask (chunk_prefill_on, on by default) against paged
    attention over gathered pages (EXL_CORE_CHUNK_PREFILL=0), the path taken in every layer (GQA: 4 heads over 2)."""
    model, _ = load_model(tiny, device="cuda", dtype=dtype, load_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    calls = _count_calls(monkeypatch)
    monkeypatch.setenv("EXL_CORE_CHUNK_PREFILL", "0")
    off = chunked_logits(model, ids, 37)
    first_chunk = len(calls)                     # the first chunk's fresh path only
    monkeypatch.setenv("EXL_CORE_CHUNK_PREFILL", "1")
    on = chunked_logits(model, ids, 37)
    assert len(calls) - 2 * first_chunk == model.config.num_hidden_layers
    assert torch.isfinite(on).all()
    scale = off.abs().max().item()
    assert (on - off).abs().max().item() <= tol * max(scale, 1.0)
