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
    fn = path.name
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
        header = json.loads(raw.decode("utf-8"))
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
            self._add_file(self.path)
        elif self.path.is_dir():
            index = self.path / INDEX_NAME
            if index.is_file():
                self._open_index(index)
            else:
                files = sorted(self.path.glob("*.safetensors"))
                if not files:
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
                raise FormatError(f"{f.name}: tensor '{name}' also appears in {prev.file.name}; "
                                  "which copy to use is ambiguous")
            self._entries[name] = e
        return entries

    def _open_index(self, index: Path) -> None:
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{index.name}: unreadable index ({e})") from e
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise FormatError(f"{index.name}: missing or empty 'weight_map'")
        if isinstance(data.get("metadata"), dict):
            self.metadata.update({str(k): str(v) for k, v in data["metadata"].items()})
        by_file: dict[str, list[str]] = {}
        for name, fname in wmap.items():
            if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname.startswith(".."):
                raise FormatError(f"{index.name}: tensor '{name}' maps to an invalid file name "
                                  f"{fname!r}")
            by_file.setdefault(fname, []).append(name)
        for fname, names in sorted(by_file.items()):
            f = self.path / fname
            if not f.is_file():
                raise FormatError(f"{index.name}: tensor '{names[0]}' (and {len(names) - 1} more) "
                                  f"map to shard '{fname}', which does not exist in {self.path} "
                                  "(incomplete download?)")
            entries = self._add_file(f, only=set(names))
            for name in names:
                if name not in entries:
                    raise FormatError(f"{index.name}: tensor '{name}' is mapped to '{fname}' but "
                                      f"that shard does not contain it")

    # -- queries ------------------------------------------------------------------------------
    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(name)
        if e is None:
            import difflib
            close = difflib.get_close_matches(name, list(self._entries), n=3)
            hint = f"; similar names: {', '.join(close)}" if close else ""
            raise FormatError(f"{self.path}: tensor '{name}' not found{hint}")
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
                raise FormatError(f"{e.file.name}: safetensors cannot open the file ({ex})") from ex
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
            raise FormatError(f"{self.file_of(name).name}: tensor '{name}': expected "
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


def write_sharded(tensors: Mapping[str, torch.Tensor], folder: Union[str, Path],
                  max_shard_bytes: int = 2 * 1024 ** 3,
                  metadata: Optional[Mapping[str, str]] = None) -> list[Path]:
    """Write `tensors` as model.safetensors, or as model-0000i-of-0000n.safetensors shards plus
    model.safetensors.index.json when they exceed `max_shard_bytes`. Every file is written
    under a temporary name and renamed; the index (or the single file) is renamed last, so
    an interrupted write never looks complete. Returns the written files."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})

    shards: list[dict[str, torch.Tensor]] = [{}]
    used, seen_ptrs = 0, set()
    for name, t in tensors.items():
        if t.dtype not in _TORCH_TO_ST:
            raise FormatError(f"{folder}: tensor '{name}' has dtype {t.dtype}, which safetensors "
                              "cannot store")
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.data_ptr() in seen_ptrs:   # tied weights: safetensors refuses aliases
            t = t.clone()
        if t.numel():
            seen_ptrs.add(t.data_ptr())
        nb = _nbytes(t)
        if shards[-1] and used + nb > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nb

    n = len(shards)
    final_names = ([SINGLE_NAME] if n == 1 else
                   [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    tmp_names = []
    pid = os.getpid()
    try:
        for shard, fname in zip(shards, final_names):
            tmp = folder / f".{fname}.tmp-{pid}"
            tmp_names.append(tmp)
            save_file(shard, str(tmp), metadata=meta)
        index_tmp = None
        if n > 1:
            index = {"metadata": {"total_size": sum(_nbytes(t) for s in shards for t in s.values())},
                     "weight_map": {k: fname for s, fname in zip(shards, final_names) for k in s}}
            index_tmp = folder / f".{INDEX_NAME}.tmp-{pid}"
            index_tmp.write_text(json.dumps(index, indent=2))
            tmp_names.append(index_tmp)
        # a stale index from an earlier write would point at the wrong files: drop it first
        if (folder / INDEX_NAME).exists():
            os.unlink(folder / INDEX_NAME)
        for tmp, fname in zip(tmp_names, final_names):
            os.replace(tmp, folder / fname)
        if index_tmp is not None:
            os.replace(index_tmp, folder / INDEX_NAME)
    except BaseException:
        for tmp in tmp_names:
            if tmp.exists():
                tmp.unlink()
        raise
    # remove files of an earlier, differently sharded write
    keep = set(final_names) | {INDEX_NAME}
    for old in folder.glob("model*.safetensors"):
        if old.name not in keep:
            old.unlink()
    out = [folder / f for f in final_names]
    if n > 1:
        out.append(folder / INDEX_NAME)
    return out
