"""Bad arguments to Cache, Job, Generator and the Tokenizer are refused with an ExlError naming the argument or file,
never accepted into a silent wrong answer or a raw Python/torch error mid-generation."""
from __future__ import annotations

import json

import pytest
import torch

import exl_core as exl
from exl_core.cache import Cache
from exl_core.errors import InputError, TokenizerError
from exl_core.generation import Generator, Job
from exl_core.testing import make_completion_model
from exl_core.tokenizer import Tokenizer
from generator_support import (GREEDY, CharTokenizer, TinyLM, _one_thread, assert_greedy,  # noqa: F401 (fixture)
                               assert_pool_idle, rand_prompt, run_all)


@pytest.fixture(scope="module")
def wordlevel_dir(tmp_path_factory):
    """A tiny random Llama (vocab_size 64) whose word-level tokenizer holds 21 ids: rows 21..63 are padding."""
    return make_completion_model(tmp_path_factory.mktemp("wordlevel") / "m", "wordlevel", True)


def _generator(**kw):
    model = TinyLM(seed=0)
    cache = Cache(model, max_tokens=256, page_size=16)
    return Generator(model, cache, CharTokenizer(), **kw)


# -- Cache(dtype=...) ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, torch.bool, "float16"])
def test_cache_refuses_dtypes_the_kernels_do_not_compute_in(dtype):
    with pytest.raises(InputError, match=rf"Cache: dtype={dtype!r} is not supported.*torch.float16"):
        Cache(TinyLM(seed=0), max_tokens=64, page_size=16, dtype=dtype)


@pytest.mark.parametrize("model, shown", [("pair", r"model is a tuple; load_model returns \(model, tokenizer\): pass "
                                                   "the model"),
                                          (None, "model must be a model .*got NoneType"),
                                          ("m", "model must be a model .*got str")])
def test_cache_and_generator_refuse_what_is_not_a_model(model, shown):
    """An AttributeError ('tuple' object has no attribute 'config') before."""
    if model == "pair":                                  # what load_model returns
        model = (TinyLM(seed=0), CharTokenizer())
    with pytest.raises(InputError, match="Cache: " + shown):
        Cache(model, max_tokens=64, page_size=16)
    cache = Cache(TinyLM(seed=0), max_tokens=64, page_size=16)
    with pytest.raises(InputError, match="Generator: " + shown):
        Generator(model, cache, CharTokenizer())


@pytest.mark.parametrize("cache", [None, "cache", 64])
def test_generator_refuses_what_is_not_a_cache(cache):
    with pytest.raises(InputError, match=f"Generator: cache must be a Cache .*got {type(cache).__name__}"):
        Generator(TinyLM(seed=0), cache, CharTokenizer())


@pytest.mark.parametrize("tok", ["tok", 5, object()])
def test_generator_refuses_a_tokenizer_without_encode_and_decode(tok):
    """A str passed as the tokenizer failed only at generate(), as LookupError: unknown encoding: <the prompt>."""
    model = TinyLM(seed=0)
    with pytest.raises(InputError, match=f"Generator: tokenizer must have encode and decode .*got "
                                         f"{type(tok).__name__}"):
        Generator(model, Cache(model, max_tokens=64, page_size=16), tok)


def test_cache_takes_each_supported_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, None):
        assert Cache(TinyLM(seed=0), max_tokens=64, page_size=16, dtype=dtype).k[0].dtype == (dtype or torch.float32)


# -- Job arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler, shown", [({"temperature": 0}, r"dict \(e.g. SamplerSettings\(\*\*sampler\)\)"),
                                            ("greedy", "str")])
def test_job_sampler_must_be_sampler_settings(sampler, shown):
    with pytest.raises(InputError, match=f"Job: sampler must be a SamplerSettings or None, got {shown}"):
        Job([1, 2], sampler=sampler)


def test_generate_with_a_dict_sampler_is_refused_before_anything_is_queued():
    gen = _generator()
    with pytest.raises(InputError, match="sampler.*dict"):
        gen.generate("hi", max_new_tokens=2, sampler={"temperature": 0})
    assert not gen.has_work()


@pytest.mark.parametrize("name", ["callback", "token_filter"])
def test_job_callback_and_token_filter_must_be_callable(name):
    with pytest.raises(InputError, match=f"Job: {name} must be callable or None, got int"):
        Job([1, 2], **{name: 5})


@pytest.mark.parametrize("n", [True, 2.0, "3"])
def test_job_max_new_tokens_must_be_an_int(n):
    with pytest.raises(InputError, match=f"max_new_tokens={n!r} must be an int >= 1"):
        Job([1, 2], max_new_tokens=n)


@pytest.mark.parametrize("stop", [5.5, object(), False])
def test_job_stop_must_be_strings_or_token_ids(stop):
    """list(stop) raised a bare TypeError ('float' object is not iterable)."""
    with pytest.raises(InputError, match=r"Job: stop=.* must be a string, a token id or a list of them \(or None\)"):
        Job([1, 2], stop=stop)


@pytest.mark.parametrize("loras", ["x", 5, ["a"]])
def test_job_loras_must_be_a_mapping(loras):
    """dict(loras) raised a bare ValueError / TypeError."""
    with pytest.raises(InputError, match=r"Job: loras=.* must be a mapping of adapter name to weight"):
        Job([1, 2], loras=loras)


@pytest.mark.parametrize("name", ["stop_on_eos", "return_logprobs", "decode_special"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_job_flags_must_be_bools(name, value):
    """ "no" is truthy: it turned the flag on."""
    with pytest.raises(InputError, match=f"Job: {name}={value!r} must be True or False"):
        Job([1, 2], **{name: value})
    assert getattr(Job([1, 2], **{name: False}), name) is False


def test_job_takes_numpy_ints_for_counts_and_stop_ids():
    np = pytest.importorskip("numpy")
    job = Job([1, 2], max_new_tokens=np.int64(3), stop=np.int64(7))
    assert (job.max_new_tokens, job.limit, job.stop_tokens) == (3, 3, {7})
    assert type(job.max_new_tokens) is int and all(type(t) is int for t in job.stop_tokens)
    job = Job([1, 2], stop_on_eos=np.False_, return_logprobs=np.True_)      # numpy's bools too, as Python's
    assert job.stop_on_eos is False and job.return_logprobs is True


def test_stop_token_outside_the_vocabulary_is_refused_at_enqueue():
    gen = _generator()
    with pytest.raises(InputError, match=r"stop token ids \[1000000000\] are outside the vocabulary \(size 300\)"):
        gen.enqueue(Job([1, 2], stop=["x", 10 ** 9, 5]))
    assert not gen.has_work()
    with pytest.raises(InputError, match=r"input_ids token ids \[300\] are outside the vocabulary"):
        gen.enqueue(Job([1, 300]))
    gen.enqueue(Job([1, 2], max_new_tokens=1, stop=[299]))         # the last id is a valid stop


# -- token_filter's return value ----------------------------------------------------------------
@pytest.mark.parametrize("ret, shown", [(torch.zeros(3), r"a torch.float32 tensor of shape \[3\]"),
                                        (torch.zeros(300, dtype=torch.int64), r"a torch.int64 tensor of shape \[300\]"),
                                        ([0.0] * 299, "list"), ("x" * 300, "str")])
def test_token_filter_returning_a_bad_row_cancels_its_job_with_an_input_error(ret, shown):
    gen = _generator(max_batch_tokens=64, max_chunk_size=32)
    p_ok = rand_prompt(9)
    ok = gen.enqueue(Job(p_ok, max_new_tokens=4, sampler=GREEDY, stop_on_eos=False))   # a random prompt may draw EOS
    bad = gen.enqueue(Job(rand_prompt(9), max_new_tokens=4, sampler=GREEDY, token_filter=lambda ids, row: ret))
    with pytest.raises(InputError, match=rf"Job {bad.identifier!r}: token_filter returned {shown}; it must return "
                                         r"300 floats"):
        run_all(gen)
    run_all(gen)
    assert bad.finish_reason == "cancelled" and bad.table is None
    assert ok.finish_reason == "length"
    assert_greedy(gen.model, p_ok, ok.generated)
    assert_pool_idle(gen.cache)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39])
@pytest.mark.parametrize("form", ["tensor", "list", "float64"])
def test_token_filter_returning_nan_or_inf_is_blamed_on_the_filter(bad, form):
    """The sampler's check said "the model output is corrupt" -- also where the row holds the value only once cast to
    its dtype (1e39 in a float64 tensor or a list is +inf in the float32 row)."""
    gen = _generator()
    row = torch.zeros(300, dtype=torch.float64)
    row[7] = bad
    ret = row.tolist() if form == "list" else row if form == "float64" else row.float()
    job = gen.enqueue(Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY, token_filter=lambda ids, r: ret))
    with pytest.raises(InputError, match=rf"Job {job.identifier!r}: its token_filter returned NaN or \+inf logits"):
        run_all(gen)
    run_all(gen)
    assert job.finish_reason == "cancelled"
    assert_pool_idle(gen.cache)


def test_token_filter_writing_nan_in_place_is_blamed_on_the_filter():
    """A filter that edits the row in place (returns None) to NaN was reported as a corrupt model output."""
    gen = _generator()

    def in_place(ids, r):
        r[7] = float("nan")
    job = gen.enqueue(Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY, token_filter=in_place))
    with pytest.raises(InputError, match=rf"Job {job.identifier!r}: its token_filter wrote NaN or \+inf into"):
        run_all(gen)
    run_all(gen)
    assert job.finish_reason == "cancelled"
    banned = gen.enqueue(Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY,
                             token_filter=lambda ids, r: r.__setitem__(slice(0, 10), float("-inf"))))
    run_all(gen)                                      # -inf in place is a ban, as before
    assert banned.finish_reason == "length" and all(t >= 10 for t in banned.generated)


@pytest.mark.parametrize("form", ["tensor", "1xV", "list", "numpy list"])
def test_token_filter_replacement_row_is_used(form):
    import numpy as np
    gen = _generator()
    row = torch.full((300,), float("-inf"))
    row[42] = 0.0
    ret = {"tensor": row, "1xV": row[None], "list": row.tolist(),      # a list of V floats worked before too
           "numpy list": list(row.numpy())}[form]                       # np.float32 values: was refused
    job = gen.enqueue(Job(rand_prompt(5), max_new_tokens=3, sampler=GREEDY, token_filter=lambda ids, r: ret))
    run_all(gen)
    assert job.generated == [42, 42, 42]


# -- Generator budgets --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["max_chunk_size", "max_batch_tokens", "max_batch_size"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_generator_budgets_must_be_positive_ints(name, value):
    with pytest.raises(InputError, match=f"Generator: {name}={value!r} must be an int >= 1"):
        _generator(**{name: value})


def test_generator_budget_none_is_the_default():
    assert _generator(max_chunk_size=None, max_batch_tokens=None).scheduler.max_chunk_size == 512


# -- Tokenizer ----------------------------------------------------------------------------------
def _copy_folder(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_non_utf8_chat_template_file_names_the_file(wordlevel_dir, tmp_path):
    folder = _copy_folder(wordlevel_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: unreadable chat template.*UTF-8"):
        exl.load_model(folder)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.json"])
@pytest.mark.parametrize("template", [5, [{"name": "default", "template": 5}]])
def test_chat_template_of_the_wrong_type_names_the_file(wordlevel_dir, tmp_path, where, template):
    folder = _copy_folder(wordlevel_dir, tmp_path / "m")
    cfg = json.loads((folder / where).read_text()) if (folder / where).exists() else {}
    (folder / where).write_text(json.dumps({**cfg, "chat_template": template}))
    with pytest.raises(TokenizerError, match=rf"{where}: chat_template must be a Jinja template string"):
        Tokenizer.from_folder(folder)


def test_chat_templates_of_both_forms_still_render(wordlevel_dir, tmp_path):
    folder = _copy_folder(wordlevel_dir, tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    source = "{{ messages[0]['content'] }}!"
    for template in (source, [{"name": "default", "template": source}]):
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


@pytest.mark.parametrize("ids", [[10 ** 7], [64], [1.5], [True], [-1], torch.tensor([3.0]), "cat", 5])
def test_decode_refuses_what_is_not_a_token_id(wordlevel_dir, ids):
    tok = Tokenizer.from_folder(wordlevel_dir)
    with pytest.raises(TokenizerError, match=rf"{wordlevel_dir}: decode: ids"):
        tok.decode(ids)


def test_generate_refuses_lone_surrogates_in_prompts_and_stop_strings(wordlevel_dir):
    """Undecodable argv/stdin bytes ("\\udcff"): a TypeError from the tokenizers library (prompt), a
    UnicodeEncodeError from the piece lookup (stop string)."""
    model, tok = exl.load_model(wordlevel_dir)
    gen = Generator(model, Cache(model, max_tokens=64, page_size=16), tok)
    with pytest.raises(TokenizerError, match=r"not valid Unicode at position 4 \(a lone surrogate '\\udcff'"):
        gen.generate("the \udcff cat", max_new_tokens=2)
    with pytest.raises(TokenizerError, match=r"not valid Unicode at position 0 \(a lone surrogate '\\ud800'"):
        gen.generate("the cat", max_new_tokens=2, stop=["\ud800"])
    assert not gen.has_work()


def test_decode_drops_padding_rows_and_takes_integer_likes(wordlevel_dir):
    np = pytest.importorskip("numpy")
    tok = Tokenizer.from_folder(wordlevel_dir)
    assert (tok.vocab_size, tok.id_limit) == (21, 64)        # config.json: vocab_size 64
    want = tok.decode([3, 4])
    assert want and tok.decode([3, 63, 4]) == want           # a padding row the model may sample: no text
    assert tok.decode(torch.tensor([3, 4])) == tok.decode(np.array([3, 4])) == want
    assert tok.decode([torch.tensor(3), np.int32(4)]) == want
    (wordlevel_dir / "config.json").rename(wordlevel_dir / "config.json.away")    # a tokenizer folder alone:
    try:                                                                            # no model vocabulary, no bound
        alone = Tokenizer.from_folder(wordlevel_dir)
        assert alone.id_limit is None and alone.decode([3, 500, 4]) == want
    finally:
        (wordlevel_dir / "config.json.away").rename(wordlevel_dir / "config.json")


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("asked", [True, False])
def test_logprobs_under_a_token_filter_are_the_models(in_place, asked):
    """A job's logprobs are the model's log-softmax of the chosen token (docs/sampling.md); with a token_filter they
    came from the filtered row (renormalised over the tokens it left) -- and still did in job.logprobs where
    return_logprobs was not asked for."""
    gen = _generator()
    seen = []

    def ban_odd(ids, row):
        seen.append(torch.log_softmax(row.double(), -1))     # the model's row, before the filter
        out = row if in_place else row.clone()
        out[1::2] = float("-inf")
        return None if in_place else out
    job = gen.enqueue(Job(rand_prompt(5), max_new_tokens=4, sampler=GREEDY, token_filter=ban_odd,
                          return_logprobs=asked))
    run_all(gen)
    assert all(t % 2 == 0 for t in job.generated)
    want = [float(lp[t]) for lp, t in zip(seen, job.generated)]
    assert job.logprobs == pytest.approx(want, abs=1e-5)
    assert any(abs(float(torch.log_softmax(torch.where(torch.arange(lp.numel()) % 2 == 1, float("-inf"), lp), -1)[t])
                   - w) > 1e-3 for lp, t, w in zip(seen, job.generated, want))   # the filtered row would differ
