"""Speculative decoding with sliding-window models: the draft cache slides like the main
cache (pages leaving the window go back), small caches never raise out of iterate(), and
greedy speculative output equals plain greedy output token for token (QA: a window-16
Mistral with a 64-token draft cache raised CacheFullError after one token)."""
from __future__ import annotations

import re

import pytest
import torch

from exl_core.cache import Cache
from exl_core.errors import CacheFullError
from exl_core.generation import Generator, Job
from exl_core.generation.sampling import SamplerSettings
from exl_core.testing import make_tiny_model
from test_speculative import _balanced, _load, _one_thread, _run as run_jobs  # noqa: F401 (_one_thread: autouse)

GREEDY = SamplerSettings(temperature=0.0)
WINDOW = 16


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mistral_w16"), "mistral", seed=1, sliding_window=WINDOW,
                           vocab_size=256)


@pytest.fixture(scope="module")
def models(mistral_dir):
    """(main, identical draft, perturbed draft: accepts some drafts, rejects others)."""
    close = _load(mistral_dir)
    g = torch.Generator().manual_seed(7)
    for _, layer in close.linear_layers():
        layer.w_t += torch.randn(layer.w_t.shape, generator=g) * 0.02
    return _load(mistral_dir), _load(mistral_dir), close


PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (80, 5, 33)]


def _run(gen, prompts, n, check=None):
    return run_jobs(gen, [Job(p, max_new_tokens=n, sampler=GREEDY, stop_on_eos=False) for p in prompts], check)


@pytest.fixture(scope="module")
def plain(models):
    main = models[0]
    return {n: _run(Generator(main, Cache(main, max_tokens=1024, page_size=16), None, max_chunk_size=16),
                    PROMPTS[:n], 200 if n == 1 else 60) for n in (1, 3)}


@pytest.mark.parametrize("draft_tokens", [64, 96, 128])
def test_qa_repro_small_draft_cache_slides(models, plain, draft_tokens):
    """The QA case: an 80-token prompt, 200 new tokens, the model as its own draft."""
    main, draft, _ = models
    dc = Cache(draft, max_tokens=draft_tokens, page_size=16)
    gen = Generator(main, Cache(main, max_tokens=1024, page_size=16), None, max_chunk_size=16,
                    draft_model=draft, draft_cache=dc)
    assert _run(gen, PROMPTS[:1], 200) == plain[1]
    st = gen.spec.stats
    # it drafted all along (nothing turned it off); the model is its own draft, so nearly every draft is accepted --
    # not all: a near tie may round apart between the draft's one-row and the verify pass' many-row forwards
    assert st.steps > 0 and st.accepted >= 0.9 * st.drafted
    _balanced(dc)
    _balanced(gen.cache)


def test_rejections_with_window_and_several_jobs(models, plain):
    """Rollbacks of rejected drafts never reach below what the window released; three jobs draft
    side by side in 9 pages (3 each), where the longest alone would otherwise need 9."""
    main, _, close = models
    dc = Cache(close, max_tokens=144, page_size=16)
    gen = Generator(main, Cache(main, max_tokens=1024, page_size=16), None, max_chunk_size=16,
                    draft_model=close, draft_cache=dc, num_draft_tokens=6)
    drafting = set()
    assert _run(gen, PROMPTS, 60, lambda g: drafting.update(g.spec._tables)) == plain[3]
    assert len(drafting) == 3                                  # no job was turned away by the draft cache
    st = gen.spec.stats
    assert 0 < st.accepted < st.drafted
    _balanced(dc)


def test_draft_cache_too_small_turns_speculation_off(models, plain):
    main, draft, _ = models
    dc = Cache(draft, max_tokens=32, page_size=16)    # the window plus a chunk needs 3 pages
    gen = Generator(main, Cache(main, max_tokens=1024, page_size=16), None, max_chunk_size=16,
                    draft_model=draft, draft_cache=dc)
    assert _run(gen, PROMPTS[:1], 200) == plain[1]
    assert gen.spec.stats.steps == 0
    _balanced(dc)


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_tight_window_main_cache_with_chunks_shorter_than_drafts(models, mode):
    """A main cache holding just the window plus one chunk: a step's drafts stay within that chunk."""
    main, draft, _ = models
    prompt = PROMPTS[0][:40]
    want = _run(Generator(main, Cache(main, max_tokens=32, page_size=16), None, max_chunk_size=1), [prompt], 40)
    kw = dict(draft_model=draft, draft_cache=Cache(draft, max_tokens=256, page_size=16)) if mode == "draft" \
        else dict(ngram_draft=True)
    cache = Cache(main, max_tokens=32, page_size=16)
    gen = Generator(main, cache, None, max_chunk_size=1, num_draft_tokens=6, **kw)
    assert _run(gen, [prompt], 40) == want
    assert gen.spec.stats.steps > 0
    _balanced(cache)


def test_cache_full_message_suggests_a_smaller_chunk(models, plain):
    main = models[0]
    gen = Generator(main, Cache(main, max_tokens=64, page_size=16), None)
    with pytest.raises(CacheFullError, match=r"needs 5 pages .* smaller Generator\(max_chunk_size=\.\.\.\)") as e:
        gen.enqueue(Job(PROMPTS[0], max_new_tokens=4))
    chunk = int(re.search(r"at most (\d+) fits", str(e.value)).group(1))
    assert chunk == 33                                       # 3 pages for the window, one for the chunk
    gen = Generator(main, Cache(main, max_tokens=64, page_size=16), None, max_chunk_size=chunk)
    assert _run(gen, PROMPTS[:1], 200) == plain[1]
    with pytest.raises(CacheFullError) as e:                 # one page: no chunk fits
        Generator(main, Cache(main, max_tokens=16, page_size=16), None).enqueue(Job(PROMPTS[0], max_new_tokens=4))
    assert "max_chunk_size" not in str(e.value)
