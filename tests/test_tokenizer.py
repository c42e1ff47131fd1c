"""exl_core.tokenizer against transformers' tokenizer (the reference) on the real SmolLM2
tokenizer, plus a SentencePiece-style (Metaspace + byte fallback) tokenizer built here, for
the leading-space and byte-token cases of the incremental decoder."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from exl_core.errors import TokenizerError
from exl_core.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces ",
    "Numbers 1234567890, 3.14159 and -42e10",
    "héllo wörld, naïve café — «quotes» “curly”",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤗🚀👩‍👩‍👧‍👦 flags 🇫🇷 and ZWJ",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f'{x!r}')\r\n",
    "<|im_start|>user\nHi<|im_end|>\n",
    "tabs\t\tand\nnewlines\n\n\n",
    "",
    "a",
]

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "héllo 🤗"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"}],
]


def _random_text(rng: random.Random, n: int) -> str:
    pools = ["abcdefghijklmnopqrstuvwxyz", "ABCXYZ", "0123456789", " \n\t", ".,;:!?()[]{}<>'\"",
             "éüßøñ", "日本語中文", "🤗🚀😀", "<|im_end|>"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


# -- real SmolLM2 tokenizer vs transformers -----------------------------------------------------

@pytest.fixture(scope="module")
def pair(smollm2_dir):
    from transformers import AutoTokenizer
    return Tokenizer.from_folder(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.real_model
def test_encode_decode_match_transformers(pair):
    ours, ref = pair
    rng = random.Random()
    texts = TEXTS + [_random_text(rng, rng.randint(1, 80)) for _ in range(30)]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=True), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special=False) == ref.decode(ids, skip_special_tokens=False)
        # special=False: "<|im_end|>" in the text is plain text, as split_special_tokens=True
        plain = ours.encode(text, special=False)
        assert plain == ref.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert ours.decode(plain) == ref.decode(plain, skip_special_tokens=True)


@pytest.mark.real_model
def test_encode_batch_equals_encode(pair):
    ours, _ = pair
    for special in (True, False):
        for add_bos in (None, True):
            assert ours.encode_batch(TEXTS, add_bos=add_bos, special=special) == [
                ours.encode(t, add_bos=add_bos, special=special) for t in TEXTS]


@pytest.mark.real_model
def test_special_ids_and_bos(pair):
    ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.pad_token_id == ref.pad_token_id
    cfg = json.loads((ours.folder / "config.json").read_text())
    assert cfg["eos_token_id"] in ours.eos_token_ids
    assert ours.id_to_piece(ours.bos_token_id) == ref.bos_token
    assert ours.encode("x", add_bos=True)[0] == ours.bos_token_id
    assert ours.encode("x", add_bos=False)[0] != ours.bos_token_id
    # SmolLM2 adds no BOS by default: both agree on the default
    assert ours.encode("x") == ref.encode("x")


@pytest.mark.real_model
def test_chat_template_matches_transformers(pair):
    ours, ref = pair
    for chat in CHATS:
        for agp in (True, False):
            want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=agp)
            assert ours.apply_chat_template(chat, add_generation_prompt=agp) == want
        ids = ours.apply_chat_template(chat, tokenize=True)
        want_ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        if hasattr(want_ids, "keys"):   # transformers 5 returns a BatchEncoding
            want_ids = want_ids["input_ids"]
        assert ids == list(want_ids)


@pytest.mark.real_model
def test_chat_template_continue_final_message(pair):
    ours, ref = pair
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=False,
                                   continue_final_message=True)
    got = ours.apply_chat_template(chat, continue_final_message=True)
    assert got == want and got.endswith("The colour is")


@pytest.mark.real_model
def test_incremental_decoder_on_text(pair):
    ours, _ = pair
    for text in TEXTS:
        ids = ours.encode(text)
        dec = IncrementalDecoder(ours)
        pieces = [dec.add(i) for i in ids]
        assert "".join(pieces) + dec.flush() == ours.decode(ids)
        # nothing should be held back for complete text, and no piece splits a character
        assert all("\ufffd" not in p for p in pieces)


@pytest.mark.real_model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_decoder_property_random_ids(pair, data):
    ours, _ = pair
    V = ours.vocab_size
    # mix: fully random ids, low ids (specials, single bytes) and ids of multi-byte text
    ids = data.draw(st.lists(st.one_of(st.integers(0, V - 1), st.integers(0, 300)), max_size=40))
    skip = data.draw(st.booleans())
    dec = IncrementalDecoder(ours, skip_special=skip)
    out = "".join(dec.add(i) for i in ids) + dec.flush()
    assert out == ours.decode(ids, skip_special=skip)


@pytest.mark.real_model
def test_incremental_decoder_splits_multibyte_chars(pair):
    ours, _ = pair
    # a 4-byte emoji is several byte-level tokens: no output may contain half a character
    ids = ours.encode("🤗🚀 日本")
    dec = IncrementalDecoder(ours)
    outs = [dec.add(i) for i in ids]
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) == "🤗🚀 日本"


@pytest.mark.real_model
def test_decode_ids_past_vocab(pair):
    """Ids past the tokenizer's vocabulary but below config.json's vocab_size (a padded model vocabulary) decode to
    nothing (test_generation_input_errors.py); SmolLM2's is not padded, so its id vocab_size + 5 is no token id."""
    ours, ref = pair
    ids = ours.encode("Hello world")
    with pytest.raises(TokenizerError, match=rf"decode: ids \[{ours.vocab_size + 5}\]"):
        ours.decode([ids[0], ours.vocab_size + 5, *ids[1:]])
    with pytest.raises(TokenizerError, match="negative"):
        ours.decode([-1])


def test_missing_tokenizer_names_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_folder(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "tokenizer.model" in msg


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_deeply_nested_tokenizer_config(tmp_path):
    """json.loads raised a bare RecursionError on a document nested past Python's recursion limit."""
    (tmp_path / "tokenizer_config.json").write_text('{"a":' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: .*JSON \(nested too deeply\)"):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_settings_files_of_another_json_kind_are_refused(tmp_path, name):
    (tmp_path / name).write_text('["eos_token_id", 2]')
    with pytest.raises(TokenizerError, match=rf"{name}: expected a JSON object, got a list"):
        Tokenizer.from_folder(tmp_path)


@pytest.mark.real_model
def test_eos_ids_collected_from_all_configs(smollm2_dir, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, tmp_path / f)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    tok = Tokenizer.from_folder(tmp_path)
    eos_text = json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"]
    assert tok.eos_token_ids == {0, 7, 11, tok.piece_to_id(eos_text)}


def test_no_chat_template_raises(sp_dir):
    tok = Tokenizer.from_folder(sp_dir)
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# -- SentencePiece-style tokenizer (Metaspace, byte fallback, Strip decoder) ---------------------

@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    """A Llama-2-style BPE tokenizer trained here: Metaspace pre-tokenizer, <0xXX> byte
    fallback tokens, decoder = Replace(▁→space), ByteFallback, Fuse, Strip(1 leading space)."""
    from tokenizers import Tokenizer as T, decoders, models, normalizers, pre_tokenizers, trainers
    tok = T(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz ▁"),
                                  show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "hello world hello there",
              "a stitch in time saves nine", "lorem ipsum dolor sit amet"] * 20
    tok.train_from_iterator(corpus, trainer)
    # put the 256 <0xXX> byte tokens into the model vocab (ids 3..258), as Llama-2 has them:
    # as ordinary (non-special) tokens, so decode keeps them
    j = json.loads(tok.to_str())
    trained = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(special)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in trained:
        vocab.setdefault(t, len(vocab))
    j["model"]["vocab"] = vocab
    for a in j["added_tokens"]:
        a["id"] = vocab[a["content"]]
    folder = tmp_path_factory.mktemp("sp_tok")
    (folder / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    return folder


def test_sentencepiece_style_encode_decode(sp_dir):
    tok = Tokenizer.from_folder(sp_dir)
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id                       # add_bos_token: true
    assert tok.decode(ids) == "hello world"                 # Strip removes the prepended ▁
    emoji = tok.encode("hi 🤗", add_bos=False)               # unknown chars -> byte tokens
    assert any(tok.id_to_piece(i).startswith("<0x") for i in emoji)
    assert tok.decode(emoji) == "hi 🤗"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_decoder_property_sentencepiece(sp_dir, data):
    tok = _sp_tok(sp_dir)
    V = tok.vocab_size
    # byte tokens (3..258) are where splitting goes wrong; specials 0..2 test leading-space strip
    ids = data.draw(st.lists(st.one_of(st.integers(0, V - 1), st.integers(0, 260),
                                       st.sampled_from([0, 1, 2])), max_size=30))
    skip = data.draw(st.booleans())
    dec = IncrementalDecoder(tok, skip_special=skip)
    out = "".join(dec.add(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids, skip_special=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_decoder_after_a_context_reads_as_the_whole_decode(sp_dir, data):
    """With a prompt as context the streamed text is the whole sequence's decode past the prompt's: the first token
    keeps the leading space SentencePiece drops at the start of a decode."""
    tok = _sp_tok(sp_dir)
    V = tok.vocab_size
    ctx = data.draw(st.lists(st.integers(259, V - 1), min_size=1, max_size=6))     # text tokens
    ids = data.draw(st.lists(st.one_of(st.integers(0, V - 1), st.integers(0, 260)), max_size=20))
    skip = data.draw(st.booleans())
    dec = IncrementalDecoder(tok, skip_special=skip, context=ctx)
    out = "".join(dec.add(i) for i in ids) + dec.flush()
    full, before = tok.decode(ctx + ids, skip_special=skip), tok.decode(ctx, skip_special=skip)
    assert full.startswith(before) and out == full[len(before):]


@pytest.mark.real_model
def test_a_context_ending_inside_a_character_is_not_taken(pair):
    """Byte-level tokens can hold part of a UTF-8 character: a prompt cut there (a job continuing another's ids) read
    as "\ufffd", which the whole decode never starts with, and the job's text came out empty (its stops never fired).
    Such a context is dropped: the text streams as it did without one. reset() restores the state it was made in."""
    tok = pair[0]
    ids = tok.encode("Hi 日本語 ok", add_bos=False)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts                                       # the tokenizer splits these characters (else no test)
    for k in cuts:
        plain = IncrementalDecoder(tok)
        want = "".join(plain.add(t) for t in ids[k:]) + plain.flush()
        dec = IncrementalDecoder(tok, context=ids[:k])
        assert "".join(dec.add(t) for t in ids[k:]) + dec.flush() == want and want.endswith(" ok")
    dec = IncrementalDecoder(tok, context=ids[:2])    # a clean context: kept, also through reset()
    first = dec.add(ids[2])
    dec.reset()
    assert dec.add(ids[2]) == first == tok.decode(ids[:3])[len(tok.decode(ids[:2])):]


def test_a_stop_string_with_the_first_tokens_leading_space_fires(sp_dir):
    """SentencePiece reads the first generated token's space only after the prompt: a stop string beginning with it
    (" world", " User:") never fired when the job's text was decoded from its first token on."""
    import torch
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from generator_support import TinyLM, run_all
    tok = _sp_tok(sp_dir)
    prompt = tok.encode("hello")
    forced = tok.encode("the quick fox", add_bos=False)        # its first piece begins with the space mark
    assert tok.decode(forced) == "the quick fox" and tok.decode(prompt + forced) == "hello the quick fox"

    def force(history, row):
        row.fill_(-1e4)
        row[forced[min(len(history) - len(prompt), len(forced) - 1)]] = 1e4
    model = TinyLM(vocab=tok.vocab_size, seed=1)
    for stop, text, reason in ((None, " the quick fox", "length"), ([" the"], "", "stop"),
                               ([" fox"], " the quick", "stop")):
        gen = Generator(model, Cache(model, max_tokens=256, page_size=8), tok)
        job = gen.enqueue(Job(prompt, max_new_tokens=len(forced), sampler=SamplerSettings(temperature=0.0),
                              token_filter=force, stop=stop, stop_on_eos=False))
        run_all(gen)
        assert (job.text, job.finish_reason) == (text, reason)
    assert torch.equal(torch.tensor(job.generated[:2]), torch.tensor(forced[:2]))


def test_incremental_decoder_keeps_space_after_special(sp_dir):
    tok = _sp_tok(sp_dir)
    ids = [tok.bos_token_id] + tok.encode("hello", add_bos=False) + [tok.eos_token_id] \
        + tok.encode("world", add_bos=False)
    dec = IncrementalDecoder(tok)
    out = "".join(dec.add(i) for i in ids) + dec.flush()
    assert out == tok.decode(ids) == "hello world"


def test_incremental_decoder_streams_long_byte_runs(sp_dir):
    """CJK text outside the vocabulary is one long run of byte tokens: it must stream in whole
    characters before the run ends, and still add up to decode()."""
    tok = _sp_tok(sp_dir)
    text = "汉字" * 30                                   # 60 chars = 180 byte tokens
    ids = tok.encode(text, add_bos=False)
    assert sum(i in tok.byte_fallback_ids for i in ids) >= 180
    dec = IncrementalDecoder(tok, max_byte_run=16)
    outs = [dec.add(i) for i in ids]
    first = next(k for k, o in enumerate(outs) if o)
    assert first < 40                                   # text arrived long before the end
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) + dec.flush() == tok.decode(ids) == text


_SP_CACHE: dict = {}


def _sp_tok(folder: Path) -> Tokenizer:
    if folder not in _SP_CACHE:
        _SP_CACHE[folder] = Tokenizer.from_folder(folder)
    return _SP_CACHE[folder]


# -- bare SentencePiece model (tokenizer.model only) vs the sentencepiece library ----------------

@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    spm = pytest.importorskip("sentencepiece")
    import io
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world hello there",
              "a stitch in time saves nine", "lorem ipsum dolor sit amet"] * 50
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=buf, vocab_size=320,
                                   byte_fallback=True, model_type="bpe", character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, minloglevel=2)
    folder = tmp_path_factory.mktemp("spm")
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))
    return folder


def test_sentencepiece_model_matches_library(spm_dir):
    import sentencepiece as spm
    ref = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    tok = Tokenizer.from_folder(spm_dir)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (ref.get_piece_size(), 1, {2})
    rng = random.Random()
    texts = ["hello world", "hi 🤗 there", "Ünïcödé 日本", "two  spaces", "\ttab"] + [
        _random_text(rng, rng.randint(1, 40)).replace("<|im_end|>", "") for _ in range(20)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == [1] + list(ref.encode(text)), text
        assert tok.decode(ids) == ref.decode(ids[1:]), text
        assert tok.id_to_piece(ids[-1]) == ref.id_to_piece(ids[-1])
    assert tok.encode("a</s>b", add_bos=False).count(2) == 1                 # matched as special
    assert 2 not in tok.encode("a</s>b", add_bos=False, special=False)
    assert tok.decode([1, *ref.encode("hi")], skip_special=False) == "<s>" + ref.decode(ref.encode("hi"))


@pytest.mark.parametrize("folder", ["sp_dir", "spm_dir"])
def test_lone_surrogates_are_refused(folder, request):
    """Undecodable argv/stdin bytes reach Python as lone surrogates ("\\udcff"): the tokenizers library refused them
    with "TypeError: TextInputSequence must be str", the piece lookups with a UnicodeEncodeError."""
    tok = Tokenizer.from_folder(request.getfixturevalue(folder))
    for call, where in ((lambda: tok.encode("the \udcff cat"), "encode: .* position 4"),
                        (lambda: tok.encode_batch(["ok", "x\ud800"]), "text 1: .* position 1"),
                        (lambda: tok.piece_to_id("\ud800"), "position 0"),
                        (lambda: tok.apply_chat_template([{"role": "user", "content": "a\udcff"}]),
                         "message 0: .* position 1")):
        with pytest.raises(TokenizerError, match=where + r" \(a lone surrogate .*not UTF-8\?\)"):
            call()
    assert tok.decode(tok.encode("héllo wörld 🤗", add_bos=False)) == "héllo wörld 🤗"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_decoder_property_sentencepiece_model(spm_dir, data):
    tok = _sp_tok(spm_dir)
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.vocab_size - 1), st.integers(0, 260)),
                             max_size=30))
    skip = data.draw(st.booleans())
    dec = IncrementalDecoder(tok, skip_special=skip)
    assert "".join(dec.add(i) for i in ids) + dec.flush() == tok.decode(ids, skip_special=skip)


@pytest.mark.real_model
def test_encode_from_threads(pair):
    """special=True and special=False encodes running at once must not leak into each other."""
    from concurrent.futures import ThreadPoolExecutor
    ours, _ = pair
    text = "a<|im_end|>b " * 50
    want_special, want_plain = ours.encode(text), ours.encode(text, special=False)
    assert want_special != want_plain
    with ThreadPoolExecutor(4) as ex:
        jobs = [ex.submit(ours.encode, text, None, bool(i % 2)) for i in range(400)]
        for i, j in enumerate(jobs):
            assert j.result() == (want_special if i % 2 else want_plain)
