"""Tokenizer: text <-> token ids, chat templates and streaming detokenisation.

Backed by the `tokenizers` library (tokenizer.json); folders holding only a SentencePiece
model (tokenizer.model) use the `sentencepiece` library (`transformers.AutoTokenizer` without
it). Special-token ids come from tokenizer_config.json, config.json and generation_config.json
together, because models disagree about which of them is authoritative (eos especially: chat
models often stop on several ids).
"""
from __future__ import annotations

import functools
import json
import operator
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from .errors import TokenizerError, is_int
from .textfiles import loads_json

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: unreadable JSON ({e})") from e
    if not isinstance(data, dict):       # read as empty, a list lost its settings (eos ids, template) silently
        raise TokenizerError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def _check_template(template: Any, source: Path) -> Any:
    """A chat template as transformers stores it: a Jinja string, or a list of {"name", "template"} dicts (named
    templates); anything else would fail only when a chat is rendered, with a Jinja error naming no file."""
    named = isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                               for t in template)
    if template is not None and not isinstance(template, str) and not named:
        raise TokenizerError(f"{source}: chat_template must be a Jinja template string or a list of "
                             '{"name": ..., "template": ...} entries, got ' + type(template).__name__)
    return template


def _token_text(tok: Any) -> Optional[str]:
    """tokenizer_config stores special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def _check_unicode(text: str, what: str) -> None:
    """Lone surrogates ("\\udcff": Python's stand-in for argv/stdin bytes that were not UTF-8) cannot be tokenized:
    the tokenizers library refuses them with a TypeError naming neither the text nor the place, and the lookups of
    a piece with a UnicodeEncodeError."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"{what}: the text is not valid Unicode at position {e.start} (a lone surrogate "
                             f"{text[e.start]!r}: input bytes that were not UTF-8?)") from None


def _cleanup_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (only applied when the config asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    """A sandboxed Jinja environment configured like transformers' chat templating, so the
    rendered prompt matches it byte for byte (trim_blocks/lstrip_blocks, tojson without ASCII
    escaping, raise_exception, strftime_now, loop controls, {% generation %} blocks)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # transformers tracks assistant spans with this tag; rendering just emits the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat_template(template: str, messages: list, add_generation_prompt: bool,
                         specials: dict, **kwargs) -> str:
    """Render a chat template with the variables transformers passes."""
    import jinja2
    try:
        compiled = _compile_template(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=kwargs.pop("tools", None),
                               documents=kwargs.pop("documents", None), **specials, **kwargs)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed: {e}") from e


class _FastBackend:
    """`tokenizers.Tokenizer` from tokenizer.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _T
        try:
            self.tok = _T.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from e
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    @functools.cached_property
    def _plain(self):
        """A second copy with encode_special_tokens=True ("<|im_start|>" in text stays text).
        A copy rather than toggling the flag, so threads encoding at once cannot race."""
        from tokenizers import Tokenizer as _T
        t = _T.from_str(self.tok.to_str())
        t.encode_special_tokens = True
        return t

    def encode(self, text: str, special: bool) -> list[int]:
        tok = self.tok if special else self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.tok.id_to_token(i)

    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        return self.tok.get_vocab(with_added_tokens=True)


class _SPBackend:
    """A bare SentencePiece model (tokenizer.model) through the sentencepiece library.
    Control pieces (<s>, </s>, ...) count as special: matched in text when asked, dropped by
    decode when skipping, else written out as their piece."""

    def __init__(self, path: Path):
        import sentencepiece as spm
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # sentencepiece raises OSError/RuntimeError on bad files
            raise TokenizerError(f"{path}: cannot load SentencePiece model ({e})") from e
        n = self.sp.get_piece_size()
        self.special_ids = {i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self._special_by_text = {self.sp.id_to_piece(i): i for i in self.special_ids
                                 if self.sp.is_control(i)}
        self._split = (re.compile("(" + "|".join(re.escape(t) for t in
                                                 sorted(self._special_by_text, key=len, reverse=True)) + ")")
                       if self._special_by_text else None)

    def encode(self, text: str, special: bool) -> list[int]:
        if not special or self._split is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self._special_by_text:
                ids.append(self._special_by_text[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        if skip_special:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        out, run = [], []
        for i in ids:   # sentencepiece drops control pieces: write them out between runs
            if i in self.special_ids and self.sp.is_control(i):
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def id_to_token(self, i: int) -> Optional[str]:
        return self.sp.id_to_piece(int(i)) if 0 <= int(i) < self.sp.get_piece_size() else None

    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def vocab(self) -> dict[str, int]:
        return {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}


class _HFBackend:
    """transformers' tokenizer: last resort for tokenizer.model files when the sentencepiece
    library is absent."""

    def __init__(self, folder: Path):
        try:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # transformers raises many types here
            raise TokenizerError(f"{folder}: transformers cannot build a tokenizer from "
                                 f"tokenizer.model ({e}); install sentencepiece or add "
                                 "tokenizer.json") from e
        self.special_ids = set(self.tok.all_special_ids)

    def encode(self, text: str, special: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special,
                               clean_up_tokenization_spaces=False)

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.tok.convert_tokens_to_ids(token)
        return None if i is None or i == self.tok.unk_token_id and token != self.tok.unk_token else i

    def id_to_token(self, i: int) -> Optional[str]:
        return self.tok.convert_ids_to_tokens(int(i))

    def vocab_size(self) -> int:
        return len(self.tok)

    def vocab(self) -> dict[str, int]:
        return self.tok.get_vocab()


class Tokenizer:
    """Text <-> ids for one model folder. Build with `Tokenizer.from_folder(path)`."""

    def __init__(self, backend, folder: Path, tok_config: dict, model_config: dict,
                 gen_config: dict, chat_template: Optional[Union[str, list]] = None):
        self._b = backend
        self.folder = folder
        self.tok_config = tok_config
        self.chat_template = chat_template

        def special(key: str, cfg_key: str) -> Optional[int]:
            text = _token_text(tok_config.get(key))
            if text is not None:
                i = backend.token_to_id(text)
                if i is not None:
                    return i
            ids = _ids(model_config.get(cfg_key)) or _ids(gen_config.get(cfg_key))
            return ids[0] if ids else None

        self.bos_token_id: Optional[int] = special("bos_token", "bos_token_id")
        self.pad_token_id: Optional[int] = special("pad_token", "pad_token_id")
        self.unk_token_id: Optional[int] = special("unk_token", "unk_token_id")
        eos = set(_ids(model_config.get("eos_token_id"))) | set(_ids(gen_config.get("eos_token_id")))
        eos_text = _token_text(tok_config.get("eos_token"))
        if eos_text is not None and backend.token_to_id(eos_text) is not None:
            eos.add(backend.token_to_id(eos_text))
        self.eos_token_ids: set[int] = eos
        self.eos_token_id: Optional[int] = (backend.token_to_id(eos_text) if eos_text is not None
                                            and backend.token_to_id(eos_text) is not None
                                            else (min(eos) if eos else None))
        self.special_ids: set[int] = set(backend.special_ids)
        if "add_bos_token" in tok_config:
            self.add_bos_default = bool(tok_config["add_bos_token"])
        else:
            self.add_bos_default = self._post_processor_adds_bos()
        self.clean_up_spaces = bool(tok_config.get("clean_up_tokenization_spaces", False))
        # ids a model of this folder can produce: config.json's vocab_size may exceed the tokenizer's (padding rows);
        # a folder without one (a tokenizer alone) sets no bound: a padded model's ids then decode to nothing
        n = model_config.get("vocab_size")
        self.id_limit: Optional[int] = max(self.vocab_size, int(n)) if is_int(n) else None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: Union[str, Path]) -> "Tokenizer":
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerError(f"{folder}: not a folder (looked for {', '.join(_TOKENIZER_FILES)})")
        tok_config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        gen_config = _read_json(folder / "generation_config.json")
        if (folder / "tokenizer.json").is_file():
            backend = _FastBackend(folder / "tokenizer.json")
        elif (folder / "tokenizer.model").is_file():
            try:
                import sentencepiece  # noqa: F401
                backend = _SPBackend(folder / "tokenizer.model")
            except ImportError:    # transformers may still manage (e.g. tiktoken files)
                backend = _HFBackend(folder)
        else:
            raise TokenizerError(f"{folder}: no tokenizer found (looked for tokenizer.json and "
                                 "tokenizer.model); copy the tokenizer files of the original model "
                                 "into this folder")
        template: Optional[Union[str, list]] = None
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():  # transformers >= 4.47 saves it here, and prefers it
            try:
                template = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja}: unreadable chat template ({e}); it must be UTF-8 text") from e
        elif tok_config.get("chat_template"):
            template = _check_template(tok_config["chat_template"], folder / "tokenizer_config.json")
        else:
            ct = folder / "chat_template.json"
            template = _check_template(_read_json(ct).get("chat_template") or None, ct)
        return cls(backend, folder, tok_config, model_config, gen_config, template)

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None or not isinstance(self._b, _FastBackend):
            return False
        enc = self._b.tok.encode("a", add_special_tokens=True).ids
        return bool(enc) and enc[0] == self.bos_token_id

    # -- text <-> ids ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._b.vocab_size()

    @property
    def bos_token(self) -> Optional[str]:
        return None if self.bos_token_id is None else self._b.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        return None if self.eos_token_id is None else self._b.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_bos: Optional[bool] = None, special: bool = True) -> list[int]:
        """Token ids of `text`. `add_bos=None` follows the model's config; `special=True` lets
        special-token strings in the text (e.g. "<|im_end|>") become their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        _check_unicode(text, "encode")
        ids = self._b.encode(text, special)
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: Optional[bool] = None,
                     special: bool = True) -> list[list[int]]:
        """encode() of each text (the tokenizers backend runs them in parallel)."""
        for n, t in enumerate(texts):
            if isinstance(t, str):
                _check_unicode(t, f"encode_batch: text {n}")
        if isinstance(self._b, _FastBackend) and all(isinstance(t, str) for t in texts):
            tok = self._b.tok if special else self._b._plain
            out = [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]
            if add_bos is None:
                add_bos = self.add_bos_default
            if add_bos and self.bos_token_id is not None:
                out = [ids if ids and ids[0] == self.bos_token_id else [self.bos_token_id] + ids
                       for ids in out]
            return out
        return [self.encode(t, add_bos=add_bos, special=special) for t in texts]

    def _token_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as ints, each in [0, id_limit): int() would pass 1.5 as 1 and True as 1."""
        if hasattr(ids, "tolist"):      # a tensor or array: its numbers (a float tensor's stay floats: refused)
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TokenizerError(f"{self.folder}: decode: ids must be a sequence of token ids, got "
                                 f"{type(ids).__name__}")
        out, bad = [], []
        for i in ids:
            try:
                v = None if isinstance(i, bool) else operator.index(i)   # ints, numpy ints, 0-d int tensors
            except TypeError:
                v = None
            if v is None or v < 0 or (self.id_limit is not None and v >= self.id_limit):
                bad.append(i)
            else:
                out.append(v)
        if bad:
            raise TokenizerError(f"{self.folder}: decode: ids {bad[:5]} are not token ids: each must be a "
                                 + (f"non-negative int below {self.id_limit} (the vocabulary size)"
                                    if self.id_limit is not None else "non-negative int"))
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`. Ids past the tokenizer's vocabulary but within config.json's vocab_size
        (padding rows of a larger model vocabulary) decode to nothing, as in `tokenizers`;
        negative ids, ids past both and non-integers are an error."""
        ids = self._token_ids(ids)
        vs = self.vocab_size
        if any(i >= vs for i in ids):
            ids = [i for i in ids if i < vs]
        text = self._b.decode(ids, skip_special)
        return _cleanup_spaces(text) if self.clean_up_spaces else text

    @functools.cached_property
    def special_pieces(self) -> tuple[str, ...]:
        """The text of every special token (once: the Generator checks each job's stop strings against them)."""
        return tuple(p for p in map(self.id_to_piece, sorted(self.special_ids)) if p)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._b.id_to_token(int(token_id))
        if piece is None:
            raise TokenizerError(f"{self.folder}: token id {token_id} is outside the vocabulary")
        return piece

    def piece_to_id(self, piece: str) -> Optional[int]:
        if isinstance(piece, str):
            _check_unicode(piece, f"piece_to_id({piece!r:.40})")
        return self._b.token_to_id(piece)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte tokens ("<0xE2>"). Their decoder joins a whole run of them
        before UTF-8 decoding, so text ending in such a token is not final yet."""
        return frozenset(i for piece, i in self._b.vocab().items() if _BYTE_PIECE.fullmatch(piece))

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, continue_final_message: bool = False,
                            **kwargs) -> Union[str, list[int]]:
        """Render `messages` with the model's Jinja chat template, as transformers does.
        `continue_final_message=True` ends the prompt right after the last message's content
        (to prefill the start of an answer); it implies add_generation_prompt=False. Other
        keyword arguments (tools, documents, enable_thinking, ...) go to the template."""
        if continue_final_message:
            add_generation_prompt = False
        for n, m in enumerate(messages):     # else encode would name a position in the rendered chat, not the message
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                _check_unicode(m["content"], f"apply_chat_template: message {n}")
        template = self.chat_template
        if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get(kwargs.pop("template_name", "default")) or next(iter(named.values()), None)
        if not template:
            raise TokenizerError(f"{self.folder}: the tokenizer has no chat template "
                                 "(no chat_template in tokenizer_config.json or chat_template.jinja)")
        specials = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            t = _token_text(self.tok_config.get(key))
            if t is not None:
                specials[key] = t
        extra = self.tok_config.get("additional_special_tokens")
        if isinstance(extra, list):
            specials["additional_special_tokens"] = [_token_text(t) for t in extra]
        text = render_chat_template(template, list(messages), add_generation_prompt,
                                    specials, **kwargs)
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            final = final.strip() if isinstance(final, str) else None
            if not final or final not in text:
                raise TokenizerError(f"{self.folder}: continue_final_message: the last message's "
                                     "text does not appear in the rendered chat")
            text = text[:text.rindex(final) + len(final)]
        if tokenize:
            return self.encode(text, add_bos=False, special=True)
        return text

    def incremental_decoder(self, skip_special: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.folder)!r}, vocab={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)})")


class IncrementalDecoder:
    """Streams text for token ids one at a time.

    Decoding a single token is wrong in general: SentencePiece drops the leading space of the
    first token of a decode, and a byte-level token may hold half of a UTF-8 character. So we
    decode a small window twice, `ids[prefix:read]` (already emitted context) and
    `ids[prefix:]`, and emit only the difference, and only when it does not end in U+FFFD (an
    incomplete character). The window start moves only past tokens that produced text, so
    the context always holds a text-producing token and every window decodes like the full
    sequence.

    SentencePiece byte tokens ("<0xE6>") are decoded a whole run at a time: a valid run is its
    text, an invalid one becomes one U+FFFD per byte, so a later byte can change how earlier
    ones read. We hold a run until it ends, or until it is `max_byte_run` tokens long (CJK
    text outside the vocabulary is one long run; holding it all would stall the stream).

    Invariant: "".join(outputs of add()) + flush() == tokenizer.decode(all ids), exactly, for
    every id sequence whose byte runs are at most `max_byte_run` long; longer runs stream in
    whole characters and differ only if the run holds invalid UTF-8.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, max_byte_run: int = 32,
                 context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.max_byte_run = max_byte_run
        self.ids: list[int] = []
        self.prefix = 0     # window start
        self.read = 0       # ids[:read] have been emitted as text
        self.text = ""      # everything emitted so far
        self._run = 0       # byte tokens at the end of ids (skipped specials do not break a run)
        self._byte_ids = tokenizer.byte_fallback_ids
        self._special = tokenizer.special_ids
        # context: the ids before the first one added (a prompt), taken as emitted, so the first token reads as it
        # does after them -- SentencePiece drops a decode's leading space, which a stop string may begin with.
        # Not where they end inside a character (a SentencePiece byte token, or a byte-level token holding part of
        # one): the new ids may complete it, and the context's text would then never be a prefix of the whole's
        ctx = [int(t) for t in list(context)[-8:]]
        text = self._decode(ctx) if ctx and ctx[-1] not in self._byte_ids else "\ufffd"
        self._ctx = ([], "") if text.endswith("\ufffd") else (ctx, text)
        self.reset()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=self.skip_special)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (possibly "")."""
        token_id = int(token_id)
        self.ids.append(token_id)
        skipped = self.skip_special and token_id in self._special
        if token_id in self._byte_ids:
            self._run += 1
        elif not skipped:
            self._run = 0
        if skipped or 0 < self._run <= self.max_byte_run:
            return ""   # no text of its own, or a byte run that may still change: wait
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or not after.startswith(before) or len(after) == len(before):
            return ""   # incomplete character, or nothing new yet: hold
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Return whatever is held back (e.g. an incomplete character at the end)."""
        full, emitted = self._decode(self.ids), self._ctx[1] + self.text
        if full.startswith(emitted):
            delta = full[len(emitted):]
        else:  # only after an invalid byte run longer than max_byte_run: emit the window tail
            before = self._decode(self.ids[self.prefix:self.read])
            after = self._decode(self.ids[self.prefix:])
            delta = after[len(before):] if after.startswith(before) else ""
        self.text += delta
        self.prefix = self.read = len(self.ids)
        self._run = 0
        return delta

    def reset(self) -> None:
        """Back to the state it was made in (its context kept)."""
        self.ids = list(self._ctx[0])
        self.prefix, self.read = 0, len(self.ids)
        self._run = 0
        self.text = ""
