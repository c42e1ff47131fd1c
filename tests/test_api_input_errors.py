"""Bad input to the public API (Job, Cache, Generator.generate, load_model) is refused with an ExlError that names
the argument or file and the problem, never a raw Python/torch exception from deep inside."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import exl_core as exl
from exl_core import ConfigError, FormatError, InputError
from exl_core.cache import paged
from generator_support import CharTokenizer


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return exl.load_model(tiny_llama_dir, load_tokenizer=False)[0]


def _copy(folder, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def _edit_config(folder, **over):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(over)
    (folder / "config.json").write_text(json.dumps(cfg))


# -- Job ----------------------------------------------------------------------------------------
def test_job_refuses_a_2d_tensor_instead_of_joining_its_rows():
    with pytest.raises(InputError, match=r"input_ids.*1-D.*2-D tensor of shape \[2, 2\]"):
        exl.Job(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(InputError, match="input_ids"):
        exl.Job(torch.tensor([[1, 2]]))            # a batch of one too: one Job per row
    assert exl.Job(torch.tensor([1, 2, 3])).input_ids == [1, 2, 3]
    assert exl.Job([1, 2, 3]).input_ids == [1, 2, 3]


def test_job_refuses_none_and_text_as_input_ids():
    with pytest.raises(InputError, match="input_ids.*NoneType"):
        exl.Job(None)
    with pytest.raises(InputError, match="input_ids.*str"):
        exl.Job("hello")


@pytest.mark.parametrize("seed", ["abc", "5", 1.5, True, 2**70, -2**64])
def test_job_seed_must_be_an_int(seed):
    with pytest.raises(InputError, match=f"seed={seed!r}"):
        exl.Job([1, 2], seed=seed)


def test_job_seed_takes_integer_likes():
    np = pytest.importorskip("numpy")
    a, b = exl.Job([1], seed=np.int64(7)), exl.Job([1], seed=7)
    assert a.rng.initial_seed() == b.rng.initial_seed()


# -- Generator.generate -------------------------------------------------------------------------
def test_generate_names_bad_prompts_and_seed(tiny):
    gen = exl.Generator(tiny, exl.Cache(tiny, max_tokens=256, page_size=16), CharTokenizer())
    with pytest.raises(InputError, match="prompts.*NoneType"):
        gen.generate(None)
    with pytest.raises(InputError, match="seed='abc'"):
        gen.generate("abc", max_new_tokens=2, seed="abc")
    assert not gen.has_work()
    # still usable (CharTokenizer decodes ids < 300 only: keep the sampled tokens there)
    ban = lambda ids, logits: logits.index_fill_(0, torch.arange(300, logits.numel()), float("-inf"))  # noqa: E731
    assert isinstance(gen.generate("abc", max_new_tokens=2, seed=3, token_filter=ban), str)


# -- Model.forward_batch ------------------------------------------------------------------------
def test_forward_batch_refuses_ids_outside_the_vocabulary(tiny):
    """-1 read the last embedding row without a word; an id past the vocabulary was a bare IndexError (a device-side
    assert on CUDA)."""
    v = tiny.config.vocab_size
    for bad, shown in ((-1, -1), (v, v), (10 ** 6, 10 ** 6)):
        with pytest.raises(InputError, match=rf"forward_batch: input_ids hold {shown}, not a token id: each must be "
                                             rf"in \[0, {v}\)"):
            tiny.forward_batch(torch.tensor([[1, bad, 2]]))
    for ids, shown in ((torch.tensor([1, 2]), "a 1-D torch.int64 tensor"), (torch.tensor([[1.0, 2.0]]), "float32"),
                       ([[1, 2]], "list")):
        with pytest.raises(InputError, match=f"input_ids must be a 2-D int64 .*got .*{shown}"):
            tiny.forward_batch(ids)
    assert tiny.forward_batch(torch.tensor([[0, v - 1]])).shape == (1, 2, v)
    assert torch.equal(tiny.forward_batch(torch.tensor([[0, v - 1]], dtype=torch.int32)),
                       tiny.forward_batch(torch.tensor([[0, v - 1]])))


# -- Cache --------------------------------------------------------------------------------------
def test_cache_larger_than_memory_names_max_tokens_and_bytes(tiny):
    with pytest.raises(InputError) as e:
        exl.Cache(tiny, max_tokens=10 ** 12)
    msg = str(e.value)
    per_token = paged.bytes_per_token(tiny.config.num_hidden_layers, tiny.config.num_key_value_heads,
                                      tiny.config.head_dim, tiny.dtype)
    assert "max_tokens=1000000000000" in msg and str(10 ** 12 * per_token) in msg and "free" in msg


def test_cache_allocation_failure_is_an_exl_error(tiny, monkeypatch):
    # where free memory cannot be read, the allocator's own failure is still turned into a clear error
    monkeypatch.setattr(paged, "known_free_memory", lambda device: None, raising=False)
    with pytest.raises(InputError, match=r"max_tokens=1000000000000000: allocating \d+ bytes"):
        exl.Cache(tiny, max_tokens=10 ** 15)      # past any address space: the allocator refuses at once


@pytest.mark.parametrize("kw", [{"max_tokens": "1000"}, {"max_tokens": 10.5}, {"page_size": "16"}])
def test_cache_sizes_must_be_ints(tiny, kw):
    with pytest.raises(InputError, match=next(iter(kw))):
        exl.Cache(tiny, **kw)


# -- load_model arguments -----------------------------------------------------------------------
@pytest.mark.parametrize("max_memory", ["10GB", 1.5e9, True, 0])
def test_load_model_max_memory_must_be_bytes(tiny_llama_dir, max_memory):
    with pytest.raises(ConfigError, match=f"max_memory={max_memory!r}.*bytes"):
        exl.load_model(tiny_llama_dir, max_memory=max_memory, load_tokenizer=False)


def test_load_model_max_memory_int_still_works(tiny_llama_dir):
    with pytest.raises(ConfigError, match="weights need"):
        exl.load_model(tiny_llama_dir, max_memory=1000, load_tokenizer=False)
    assert exl.load_model(tiny_llama_dir, max_memory=10 ** 12, load_tokenizer=False)[0] is not None


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, "float16"])
def test_load_model_refuses_unsupported_dtype(tiny_llama_dir, dtype):
    with pytest.raises(ConfigError, match=r"dtype=.*torch.float16, torch.bfloat16, torch.float32"):
        exl.load_model(tiny_llama_dir, dtype=dtype, load_tokenizer=False)


@pytest.mark.parametrize("device", ["tpu", "meta", 3.5])
def test_load_model_refuses_unknown_device(tiny_llama_dir, device):
    with pytest.raises(ConfigError, match=f"device={device!r}.*'cpu' or 'cuda'"):
        exl.load_model(tiny_llama_dir, device=device, load_tokenizer=False)


# -- config.json against the tensors ------------------------------------------------------------
def test_hidden_size_contradicting_the_tensors_names_config_json(exl2_act_order_dir, tmp_path):
    """The QA case: an EXL2 folder (quantized layers) whose config.json doubles hidden_size used to fail inside the
    first packed layer with a message about group rows."""
    folder = _copy(exl2_act_order_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    _edit_config(folder, hidden_size=2 * hidden)
    with pytest.raises(FormatError) as e:
        exl.load_model(folder, load_tokenizer=False)
    msg = str(e.value)
    assert str(folder / "config.json") in msg and f"hidden_size={2 * hidden}" in msg
    assert f"model.embed_tokens.weight' of shape [{vocab}, {hidden}]" in msg and "vocab_size=" not in msg


def test_vocab_size_contradicting_the_tensors_names_config_json(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    _edit_config(folder, vocab_size=cfg["vocab_size"] + 1)
    with pytest.raises(FormatError, match=rf"config.json: vocab_size={cfg['vocab_size'] + 1} contradicts tensor "
                                          rf"'model.embed_tokens.weight' of shape \[{cfg['vocab_size']}, "):
        exl.load_model(folder, load_tokenizer=False)


# -- safetensors errors name the whole path -----------------------------------------------------
def _truncated_copy(folder, tmp_path):
    """(a copy of folder, its model.safetensors cut to 1,000 bytes)."""
    folder = _copy(folder, tmp_path)
    f = folder / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(1000)
    return folder, f


def test_truncated_safetensors_error_gives_the_full_path(tiny_llama_dir, tmp_path):
    folder, f = _truncated_copy(tiny_llama_dir, tmp_path)
    with pytest.raises(FormatError) as e:
        exl.load_model(folder, load_tokenizer=False)
    assert str(e.value).startswith(f"{f}: ") and "truncated" in str(e.value)


def test_tensor_shape_error_gives_the_full_path(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    _edit_config(folder, intermediate_size=cfg["intermediate_size"] + 32)
    with pytest.raises(FormatError) as e:
        exl.load_model(folder, load_tokenizer=False)
    assert str(e.value).startswith(f"{folder / 'model.safetensors'}: tensor ")
    assert f"{cfg['intermediate_size'] + 32}" in str(e.value)


def test_reader_errors_give_the_full_path_outside_load_model_too(tiny_llama_dir, tmp_path):
    """The converter and the HF adapter read through WeightReader directly: its own messages carry the path."""
    from exl_core.formats.safetensors_io import WeightReader
    folder, f = _truncated_copy(tiny_llama_dir, tmp_path)
    with pytest.raises(FormatError) as e:
        WeightReader(folder)
    assert str(e.value).startswith(f"{f}: ")


def test_cache_sized_from_little_free_memory_warns(tiny, monkeypatch):
    from exl_core.cache import sizing
    monkeypatch.setattr(sizing, "known_free_memory", lambda device: 1 << 20)
    with pytest.warns(RuntimeWarning, match=r"holds only \d+ tokens"):
        cache = exl.Cache(tiny)
    assert cache.max_tokens >= 1
