"""Dense safetensors reading (validated, memory-mapped) and atomic sharded writing.

A safetensors file is

    [u64 little-endian N][N bytes of JSON header][data area]
    header = {"__metadata__": {str: str}?, name: {"dtype": "F16", "shape": [..],
              "data_offsets": [begin, end]}, ...}      offsets relative to the data area

`WeightReader` checks every header it opens before any tensor is touched: a truncated
download or a corrupt file fails at open time with a `FormatError` naming the file, the
tensor and what is wrong, instead of a segfault or garbage weights later. Tensors are then
read through `safetensors.safe_open` (mmap, never pickle).
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from ..errors import FormatError
from ..textfiles import loads_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024   # the safetensors crate refuses larger headers too

# safetensors dtype string -> (torch dtype, itemsize)
_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
for _name, _attr, _size in (("F8_E4M3", "float8_e4m3fn", 1), ("F8_E5M2", "float8_e5m2", 1),
                            ("U16", "uint16", 2), ("U32", "uint32", 4), ("U64", "uint64", 8)):
    if hasattr(torch, _attr):
        _DTYPES[_name] = (getattr(torch, _attr), _size)
_TORCH_TO_ST = {v[0]: k for k, v in _DTYPES.items()}


class _Entry:
    __slots__ = ("file", "dtype", "shape", "begin", "end")

    def __init__(self, file: Path, dtype: str, shape: tuple, begin: int, end: int):
        self.file, self.dtype, self.shape, self.begin, self.end = file, dtype, shape, begin, end


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def read_header(path: Union[str, Path]) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Parse and validate one safetensors header without trusting it.
    Returns ({tensor name: entry}, metadata). Raises FormatError on any inconsistency."""
    path = Path(path)
    fn = str(path)          # the full path: a user may hold several model folders
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{fn}: file has {size} bytes, too short to hold a safetensors "
                                  "header (empty or truncated download?)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise FormatError(f"{fn}: header length field says {n} bytes but the file has only "
                                  f"{size} bytes (truncated download or not a safetensors file?)")
            if n > MAX_HEADER_BYTES:
                raise FormatError(f"{fn}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte "
                                  "limit (corrupt file?)")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e})") from e
    try:
        header = loads_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{fn}: header is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(header, dict):
        raise FormatError(f"{fn}: header must be a JSON object, got {type(header).__name__}")

    data_start = 8 + n
    data_size = size - data_start
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise FormatError(f"{fn}: __metadata__ must map strings to strings")

    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        where = f"{fn}: tensor '{name}'"
        if not isinstance(info, dict):
            raise FormatError(f"{where}: header entry must be an object, got {info!r:.80}")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in _DTYPES:
            raise FormatError(f"{where}: unknown dtype {dt!r} (known: {', '.join(_DTYPES)})")
        if (not isinstance(shape, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise FormatError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
                or offs[0] > offs[1]):
            raise FormatError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                              f"got {offs!r}")
        begin, end = offs
        want = math.prod(shape) * _DTYPES[dt][1]
        if end - begin != want:
            raise FormatError(f"{where}: data_offsets {offs} span {end - begin} bytes but shape "
                              f"{_fmt_shape(shape)} of {dt} needs {want} bytes")
        if end > data_size:
            raise FormatError(f"{where}: ends at byte {data_start + end} but the file has {size} "
                              "bytes (truncated download?)")
        entries[name] = _Entry(path, dt, tuple(shape), begin, end)

    # Tensors must tile the data area: no shared bytes (a corrupt header), no gaps and no
    # trailing bytes (the safetensors library refuses those, so refuse them here, clearly).
    spans = sorted((e.begin, e.end, k) for k, e in entries.items())
    prev_end, prev_name = 0, None
    for b, e, k in spans:
        if b < prev_end:
            raise FormatError(f"{fn}: tensor '{k}' (bytes {b}..{e}) overlaps tensor '{prev_name}' "
                              f"(ends at {prev_end}); the header is corrupt")
        if b > prev_end:
            after = f"tensor '{prev_name}' ends" if prev_name else "the data area starts"
            raise FormatError(f"{fn}: tensor '{k}' starts at data byte {b} but {after} at "
                              f"{prev_end}: unexplained gap, the header is corrupt")
        if e > b or prev_name is None:
            prev_end, prev_name = e, k
    if prev_end != data_size:
        raise FormatError(f"{fn}: tensors cover {prev_end} bytes of the {data_size}-byte data area "
                          f"(last tensor '{prev_name}'): trailing bytes, the header is corrupt")
    return entries, meta


class _TensorNotFound(FormatError):
    """A missing tensor. The "similar names" hint is computed only when the message is read:
    loaders probe optional tensors by catching this, and difflib over every name of a model
    costs ~0.2 s per probe (hundreds of probes made loading an EXL2 folder take 25 s)."""

    def __init__(self, path, name: str, names):
        super().__init__(f"{path}: tensor '{name}' not found")
        self._path, self._name, self._names = path, name, names

    def __str__(self) -> str:
        import difflib
        close = difflib.get_close_matches(self._name, list(self._names), n=3)
        hint = f"; similar names: {', '.join(close)}" if close else ""
        return f"{self._path}: tensor '{self._name}' not found{hint}"


def _stale_index(index: Path, folder: Path) -> bool:
    """An index none of whose shards is in the folder beside ExLlamaV2's output*.safetensors: its converter copies
    every non-safetensors file of its fp16 source (its index too) beside its own output files, which it names in no
    index. Read the folder's files then; any other index (some shards present: an incomplete download; none, beside
    unrelated files) is still read, and named in the error."""
    try:
        wmap = loads_json(index.read_text(encoding="utf-8")).get("weight_map")
        shards = {f for f in wmap.values() if isinstance(f, str)}
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False                                   # unreadable: _open_index says why
    return bool(shards) and not any((folder / f).is_file() for f in shards if "/" not in f and "\\" not in f) \
        and any(folder.glob("output*.safetensors"))


# PyTorch's pickled checkpoints (and the index of sharded ones): named in the refusal, never opened
PICKLED_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.bin.index.json")


def _pickled_weights(names: Sequence[str]) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"pickled PyTorch weights ({shown}): exl_core never loads pickles (unpickling can run arbitrary code); "
            "convert them to safetensors (e.g. transformers' save_pretrained(folder, safe_serialization=True))")


class WeightReader:
    """Validated, memory-mapped access to the tensors of a dense HF checkpoint.

    `path` may be a folder (model.safetensors.index.json shards, or any *.safetensors files)
    or a single .safetensors file.
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self._entries: dict[str, _Entry] = {}
        self._handles: dict[Path, object] = {}
        self.metadata: dict[str, str] = {}
        if self.path.is_file():
            if any(self.path.match(pat) for pat in PICKLED_PATTERNS):
                raise FormatError(f"{self.path}: is {_pickled_weights([self.path.name])}")
            self._add_file(self.path)
        elif self.path.is_dir():
            index = self.path / INDEX_NAME
            if index.is_file() and not _stale_index(index, self.path):
                self._open_index(index)
            else:
                files = sorted(self.path.glob("*.safetensors"))
                if not files:
                    pickled = sorted({f.name for pat in PICKLED_PATTERNS for f in self.path.glob(pat)})
                    if pickled:
                        raise FormatError(f"{self.path}: no {INDEX_NAME} and no *.safetensors files in this folder, "
                                          f"only {_pickled_weights(pickled)}")
                    raise FormatError(f"{self.path}: no {INDEX_NAME} and no *.safetensors files "
                                      "in this folder")
                for f in files:
                    self._add_file(f)
        else:
            raise FormatError(f"{self.path}: no such file or folder")

    # -- opening ------------------------------------------------------------------------------
    def _add_file(self, f: Path, only: Optional[Iterable[str]] = None) -> dict[str, _Entry]:
        entries, meta = read_header(f)
        for k, v in meta.items():
            self.metadata.setdefault(k, v)
        for name, e in entries.items():
            if only is not None and name not in only:
                continue
            prev = self._entries.get(name)
            if prev is not None:
                raise FormatError(f"{f}: tensor '{name}' also appears in {prev.file}; "
                                  "which copy to use is ambiguous")
            self._entries[name] = e
        return entries

    def _open_index(self, index: Path) -> None:
        try:
            data = loads_json(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{index}: unreadable index ({e})") from e
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise FormatError(f"{index}: missing or empty 'weight_map'")
        if isinstance(data.get("metadata"), dict):
            self.metadata.update({str(k): str(v) for k, v in data["metadata"].items()})
        by_file: dict[str, list[str]] = {}
        for name, fname in wmap.items():
            if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname.startswith(".."):
                raise FormatError(f"{index}: tensor '{name}' maps to an invalid file name "
                                  f"{fname!r}")
            by_file.setdefault(fname, []).append(name)
        for fname, names in sorted(by_file.items()):
            f = self.path / fname
            if not f.is_file():
                raise FormatError(f"{index}: tensor '{names[0]}' (and {len(names) - 1} more) "
                                  f"map to shard '{fname}', which does not exist in {self.path} "
                                  "(incomplete download?)")
            entries = self._add_file(f, only=set(names))
            for name in names:
                if name not in entries:
                    raise FormatError(f"{index}: tensor '{name}' is mapped to '{fname}' but "
                                      f"that shard does not contain it")

    # -- queries ------------------------------------------------------------------------------
    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            raise _TensorNotFound(self.path, name, self._entries)
        return e

    def names(self) -> set[str]:
        return set(self._entries)

    def has(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._entry(name).dtype][0]

    def file_of(self, name: str) -> Path:
        return self._entry(name).file

    def check_float(self, name: str) -> None:
        """A dense weight must be stored as floats: an int or bool tensor would be cast to floats without a word."""
        if not self.dtype(name).is_floating_point:
            raise FormatError(f"{self.file_of(name)}: tensor '{name}' is {self.dtype(name)}; dense weights are "
                              "float16, bfloat16 or float32")

    def get(self, name: str, dtype: Optional[torch.dtype] = None,
            device: Union[str, torch.device] = "cpu") -> torch.Tensor:
        """Read one tensor (memory-mapped), optionally cast and moved."""
        from safetensors import safe_open
        e = self._entry(name)
        h = self._handles.get(e.file)
        if h is None:
            try:
                h = safe_open(str(e.file), framework="pt", device="cpu")
            except Exception as ex:  # safetensors raises its own SafetensorError
                raise FormatError(f"{e.file}: safetensors cannot open the file ({ex})") from ex
            self._handles[e.file] = h
        t = h.get_tensor(name)
        if dtype is not None or str(device) != "cpu":
            t = t.to(device=device, dtype=dtype if dtype is not None else t.dtype)
        return t

    def get_checked(self, name: str, shape: Sequence[int], dtype: Optional[torch.dtype] = None,
                    device: Union[str, torch.device] = "cpu", source: Optional[str] = None
                    ) -> torch.Tensor:
        """Like get(), but the stored shape must equal `shape`. `source` explains where the
        expected shape comes from, e.g. "config.json: hidden_size=576, intermediate_size=1536"."""
        have = self.shape(name)
        if tuple(int(s) for s in shape) != have:
            why = f" (from {source})" if source else ""
            raise FormatError(f"{self.file_of(name)}: tensor '{name}': expected "
                              f"{_fmt_shape(shape)}{why}, file has {_fmt_shape(have)}")
        return self.get(name, dtype=dtype, device=device)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "WeightReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"WeightReader({str(self.path)!r}, {len(self._entries)} tensors)"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_file_deterministic(tensors: Mapping[str, torch.Tensor], path: Union[str, Path],
                            metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write one safetensors file whose bytes depend only on the inputs. (The safetensors
    library keeps __metadata__ in a Rust HashMap, so with two or more keys their order, and
    the file's bytes, change from process to process; resumable converters compare bytes.)

    Layout: tensors sorted by item size (largest first, so every tensor stays aligned after
    the 8-byte-padded header), then by name; header keys in that order, metadata sorted."""
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(metadata[k]) for k in sorted(metadata)}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _TORCH_TO_ST:
            raise FormatError(f"{path}: tensor '{name}' has dtype {t.dtype}, which safetensors "
                              "cannot store")
        nb = _nbytes(t)
        header[name] = {"dtype": _TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nb]}
        offset += nb
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                # raw little-endian bytes of any dtype (bf16/bool included) via a uint8 view
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


class ShardedWriter:
    """Streams tensors into safetensors shards of at most `max_shard_bytes`, so a converter
    never holds more than one shard in memory:

        with ShardedWriter(folder) as w:
            for name, t in ...: w.add(name, t)
        # -> model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json

    Shards are written under temporary names (n is unknown until the end) and renamed by
    close(); the index, or the single file, comes last, so an interrupted write never looks
    complete. Leaving the `with` block by an exception deletes the temporary files."""

    def __init__(self, folder: Union[str, Path], max_shard_bytes: int = 2 * 1024 ** 3,
                 metadata: Optional[Mapping[str, str]] = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.meta = {"format": "pt"}
        self.meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._tmp: list[tuple[Path, list[str]]] = []   # written temp shards and their tensors
        self._seen: set[str] = set()
        self._total = 0
        self._tag = f"{os.getpid()}-{id(self):x}"

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._seen:
            raise FormatError(f"{self.folder}: tensor '{name}' written twice")
        if t.dtype not in _TORCH_TO_ST:
            raise FormatError(f"{self.folder}: tensor '{name}' has dtype {t.dtype}, which "
                              "safetensors cannot store")
        t = t.detach().to("cpu").contiguous()   # tied (aliased) tensors are fine: bytes are copied
        nb = _nbytes(t)
        if self._pending and self._pending_bytes + nb > self.max_shard_bytes:
            self._flush()
        self._seen.add(name)
        self._pending[name] = t
        self._pending_bytes += nb
        self._total += nb

    def _flush(self) -> None:
        tmp = self.folder / f".shard-{len(self._tmp):05d}.tmp-{self._tag}"
        self._tmp.append((tmp, list(self._pending)))
        save_file_deterministic(self._pending, tmp, metadata=self.meta)
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Finish: rename shards into place, write the index. Returns the final files."""
        if self._pending or not self._tmp:
            self._flush()
        n = len(self._tmp)
        finals = ([SINGLE_NAME] if n == 1 else
                  [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        index_tmp = None
        if n > 1:
            index = {"metadata": {"total_size": self._total},
                     "weight_map": {k: f for (_, names), f in zip(self._tmp, finals) for k in names}}
            index_tmp = self.folder / f".{INDEX_NAME}.tmp-{self._tag}"
            index_tmp.write_text(json.dumps(index, indent=2))
        # a stale index from an earlier write would point at the wrong files: drop it first
        if (self.folder / INDEX_NAME).exists():
            os.unlink(self.folder / INDEX_NAME)
        for (tmp, _), f in zip(self._tmp, finals):
            os.replace(tmp, self.folder / f)
        if index_tmp is not None:
            os.replace(index_tmp, self.folder / INDEX_NAME)
        keep = set(finals) | {INDEX_NAME}
        for old in self.folder.glob("model*.safetensors"):   # leftovers of a different sharding
            if old.name not in keep:
                old.unlink()
        self._tmp = []
        out = [self.folder / f for f in finals]
        return out + ([self.folder / INDEX_NAME] if n > 1 else [])

    def abort(self) -> None:
        """Delete everything written so far (only temporary files exist before close())."""
        for tmp, _ in self._tmp:
            if tmp.exists():
                tmp.unlink()
        for tmp in self.folder.glob(f".*.tmp-{self._tag}"):
            tmp.unlink()
        self._tmp, self._pending = [], {}

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_sharded(tensors: Mapping[str, torch.Tensor], folder: Union[str, Path],
                  max_shard_bytes: int = 2 * 1024 ** 3,
                  metadata: Optional[Mapping[str, str]] = None) -> list[Path]:
    """Write `tensors` as model.safetensors, or as model-0000i-of-0000n.safetensors shards plus
    model.safetensors.index.json when they exceed `max_shard_bytes` (see ShardedWriter:
    atomic, an interrupted write never looks complete). Returns the written files."""
    w = ShardedWriter(folder, max_shard_bytes, metadata)
    try:
        for name, t in tensors.items():
            w.add(name, t)
        return w.close()
    except BaseException:
        w.abort()
        raise
