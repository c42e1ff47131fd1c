"""WeightReader validation and write_sharded, checked against the safetensors library itself
(files written by `safetensors.torch.save_file`, headers crafted by hand for the bad cases)."""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exl_core.errors import FormatError
from exl_core.formats import safetensors_io as sio
from exl_core.formats.safetensors_io import WeightReader, read_header, write_sharded

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.uint8, torch.int64,
          torch.bool, torch.int8, torch.float64]


def _random_tensors(n: int = 12, seed=None) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        dt = rng.choice(DTYPES)
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
        if dt.is_floating_point:
            t = torch.randn(shape, dtype=torch.float32).to(dt)
        elif dt == torch.bool:
            t = torch.rand(shape) > 0.5
        else:
            t = torch.randint(0, 100, shape, dtype=dt)
        out[f"model.layers.{i}.w{rng.randint(0, 999)}"] = t
    return out


def _raw_file(path: Path, header: dict, data: bytes, length: int | None = None) -> Path:
    """Write a safetensors file byte by byte (to craft invalid ones)."""
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return path


def _assert_names(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    for p in parts:
        assert p in msg, f"{p!r} not in error message: {msg}"


# -- good files ---------------------------------------------------------------------------------

def test_reads_what_safetensors_wrote(tmp_path):
    ts = _random_tensors()
    save_file(ts, str(tmp_path / "model.safetensors"), metadata={"format": "pt", "k": "v"})
    r = WeightReader(tmp_path)
    assert r.names() == set(ts)
    assert r.metadata["k"] == "v"
    for name, t in ts.items():
        assert r.has(name) and name in r
        assert r.shape(name) == tuple(t.shape)
        assert r.dtype(name) == t.dtype
        assert r.file_of(name) == tmp_path / "model.safetensors"
        got = r.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
    # single-file path works too, and dtype conversion
    r1 = WeightReader(tmp_path / "model.safetensors")
    for name, t in ts.items():
        assert torch.equal(r1.get(name, dtype=torch.float64), t.to(torch.float64))


def test_sharded_read_equals_single_file(tmp_path):
    ts = _random_tensors(20)
    total = sum(t.numel() * t.element_size() for t in ts.values())
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    write_sharded(ts, single)
    files = write_sharded(ts, sharded, max_shard_bytes=max(64, total // 4), metadata={"a": "b"})
    assert (single / "model.safetensors").is_file()
    assert (sharded / sio.INDEX_NAME).is_file() and len(files) >= 4
    idx = json.loads((sharded / sio.INDEX_NAME).read_text())
    assert set(idx["weight_map"]) == set(ts)
    assert idx["metadata"]["total_size"] == total
    r1, r2 = WeightReader(single), WeightReader(sharded)
    assert r1.names() == r2.names() == set(ts)
    for name, t in ts.items():
        a, b = r1.get(name), r2.get(name)
        assert a.dtype == b.dtype == t.dtype and torch.equal(a, b) and torch.equal(a, t)
    assert len({r2.file_of(n) for n in ts}) >= 3
    # transformers' own loader agrees with the index we wrote
    from safetensors import safe_open
    for name, fname in idx["weight_map"].items():
        with safe_open(str(sharded / fname), "pt") as f:
            assert torch.equal(f.get_tensor(name), ts[name])


def test_writer_output_is_deterministic_and_safetensors_compatible(tmp_path):
    """Same tensors and metadata (in any insertion order) -> the same bytes; the file reads
    back through the safetensors library itself, empty and 0-d tensors included."""
    from safetensors import safe_open
    ts = _random_tensors(15)
    ts["empty.weight"] = torch.zeros(0, 3, dtype=torch.float16)
    ts["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    meta = {"quantizer": "exl_core", "b": "2", "a": "1"}
    write_sharded(ts, tmp_path / "x", metadata=meta)
    write_sharded(dict(reversed(list(ts.items()))), tmp_path / "y",
                  metadata=dict(reversed(list(meta.items()))))
    a, b = (tmp_path / "x/model.safetensors").read_bytes(), (tmp_path / "y/model.safetensors").read_bytes()
    assert a == b
    with safe_open(str(tmp_path / "x/model.safetensors"), "pt") as f:
        assert f.metadata() == {**meta, "format": "pt"}
        for k, t in ts.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k


def test_rewrite_with_fewer_shards_removes_stale_files(tmp_path):
    ts = _random_tensors(10)
    write_sharded(ts, tmp_path, max_shard_bytes=16)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    write_sharded(ts, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert WeightReader(tmp_path).names() == set(ts)


def test_interrupted_write_never_looks_complete(tmp_path, monkeypatch):
    ts = _random_tensors(10)
    real = sio.save_file_deterministic
    calls = {"n": 0}

    def failing(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated interrupt")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(sio, "save_file_deterministic", failing)
    with pytest.raises(KeyboardInterrupt):
        write_sharded(ts, tmp_path, max_shard_bytes=16)
    assert list(tmp_path.iterdir()) == []          # no final names, no temp leftovers


def test_sharded_writer_streams_and_aborts(tmp_path):
    ts = _random_tensors(12)
    with sio.ShardedWriter(tmp_path / "ok", max_shard_bytes=64) as w:
        for k, t in ts.items():
            w.add(k, t)
        assert not list((tmp_path / "ok").glob("model*"))     # nothing final before close
    r = WeightReader(tmp_path / "ok")
    assert all(torch.equal(r.get(k), t) for k, t in ts.items())
    with pytest.raises(RuntimeError):
        with sio.ShardedWriter(tmp_path / "bad", max_shard_bytes=64) as w:
            for k, t in ts.items():
                w.add(k, t)
            raise RuntimeError("converter failed")
    assert list((tmp_path / "bad").iterdir()) == []
    w = sio.ShardedWriter(tmp_path / "dup")
    w.add("x", torch.zeros(2))
    with pytest.raises(FormatError, match="'x' written twice"):
        w.add("x", torch.zeros(2))
    w.abort()


def test_tied_aliases_are_written(tmp_path):
    w = torch.randn(8, 4)
    write_sharded({"model.embed_tokens.weight": w, "lm_head.weight": w}, tmp_path)
    r = WeightReader(tmp_path)
    assert torch.equal(r.get("lm_head.weight"), w) and torch.equal(r.get("model.embed_tokens.weight"), w)


# -- bad files: each names the file and the tensor ----------------------------------------------

def test_truncated_file(tmp_path):
    ts = {"a.weight": torch.randn(4, 4), "model.layers.7.mlp.up_proj.weight": torch.randn(16, 8)}
    f = tmp_path / "model-00002-of-00002.safetensors"
    save_file(ts, str(f))
    data = f.read_bytes()
    f.write_bytes(data[:-10])
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "model.layers.7.mlp.up_proj.weight", "truncated",
                  str(len(data) - 10))


def test_corrupt_header_json(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"x": torch.randn(3)}, str(f))
    b = bytearray(f.read_bytes())
    b[8] = ord("[") + 50            # first header byte '{' -> garbage
    f.write_bytes(bytes(b))
    with pytest.raises(FormatError) as e:
        WeightReader(tmp_path)
    _assert_names(e, f.name, "JSON")


def test_deeply_nested_header_and_index(tmp_path):
    """A header or an index nested past Python's recursion limit: a bare RecursionError from json.loads."""
    deep = "[" * 100000 + "]" * 100000
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(deep)) + deep.encode())
    with pytest.raises(FormatError) as e:
        WeightReader(tmp_path)
    _assert_names(e, f.name, "not valid JSON (nested too deeply)")
    folder, _ = _sharded(tmp_path / "sharded")
    (folder / sio.INDEX_NAME).write_text('{"weight_map":' + deep + "}")
    with pytest.raises(FormatError) as e:
        WeightReader(folder)
    _assert_names(e, sio.INDEX_NAME, "nested too deeply")


def test_header_length_larger_than_file(tmp_path):
    f = _raw_file(tmp_path / "w.safetensors",
                  {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4,
                  length=10 ** 6)
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "header length", str(f.stat().st_size))


def test_tiny_file(tmp_path):
    f = tmp_path / "empty.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(FormatError, match="empty.safetensors"):
        WeightReader(f)


def test_unknown_dtype(tmp_path):
    f = _raw_file(tmp_path / "w.safetensors",
                  {"lm_head.weight": {"dtype": "F17", "shape": [2], "data_offsets": [0, 4]}},
                  b"\0" * 4)
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "lm_head.weight", "F17")


def test_offsets_inconsistent_with_shape(tmp_path):
    f = _raw_file(tmp_path / "w.safetensors",
                  {"q.weight": {"dtype": "F16", "shape": [3, 4], "data_offsets": [0, 20]}},
                  b"\0" * 24)
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "q.weight", "24", "20")


def test_overlapping_offsets(tmp_path):
    f = _raw_file(tmp_path / "w.safetensors",
                  {"a.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                   "b.weight": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
                  b"\0" * 24)
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "a.weight", "b.weight", "overlaps")


def test_gap_and_trailing_bytes(tmp_path):
    f = _raw_file(tmp_path / "w.safetensors",
                  {"a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b.weight": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}},
                  b"\0" * 20)
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "b.weight", "gap")
    f = _raw_file(tmp_path / "w.safetensors",
                  {"a.weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12)
    with pytest.raises(FormatError) as e:
        WeightReader(f)
    _assert_names(e, f.name, "a.weight", "trailing")


def test_bad_shape_and_offsets_types(tmp_path):
    for bad in ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
                {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]},
                {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]},
                {"dtype": "F32", "shape": [1]},
                "not an object"):
        f = _raw_file(tmp_path / "w.safetensors", {"the.tensor": bad}, b"\0" * 16)
        with pytest.raises(FormatError) as e:
            WeightReader(f)
        _assert_names(e, f.name, "the.tensor")


def _sharded(tmp_path) -> tuple[Path, dict]:
    ts = _random_tensors(8)
    write_sharded(ts, tmp_path, max_shard_bytes=16)
    return tmp_path, ts


def test_index_names_missing_shard(tmp_path):
    folder, ts = _sharded(tmp_path)
    idx = json.loads((folder / sio.INDEX_NAME).read_text())
    victim = sorted(set(idx["weight_map"].values()))[-1]
    (folder / victim).unlink()
    with pytest.raises(FormatError) as e:
        WeightReader(folder)
    name = next(k for k, v in idx["weight_map"].items() if v == victim)
    _assert_names(e, sio.INDEX_NAME, victim, name, "does not exist")


def test_index_of_none_of_the_folders_files_is_ignored(tmp_path):
    """ExLlamaV2's converter copies its fp16 source's index beside its own output-*.safetensors (which no index
    names): that folder was refused for shards it never had. An index with some shards present still decides."""
    folder, ts = _sharded(tmp_path / "src")
    out = tmp_path / "exl2"
    out.mkdir()
    (out / sio.INDEX_NAME).write_text((folder / sio.INDEX_NAME).read_text())
    names = sorted(ts)
    save_file({k: ts[k] for k in names[:3]}, str(out / "output-00001-of-00002.safetensors"))
    save_file({k: ts[k] for k in names[3:]}, str(out / "output-00002-of-00002.safetensors"))
    r = WeightReader(out)
    assert r.names() == set(ts) and all(torch.equal(r.get(k), ts[k]) for k in ts)
    (out / "output-00002-of-00002.safetensors").unlink()
    shard = sorted(set(json.loads((folder / sio.INDEX_NAME).read_text())["weight_map"].values()))[0]
    (out / shard).write_bytes((folder / shard).read_bytes())       # one of the index's shards present
    with pytest.raises(FormatError, match="does not exist"):
        WeightReader(out)


def test_index_maps_tensor_to_wrong_shard(tmp_path):
    folder, ts = _sharded(tmp_path)
    idx = json.loads((folder / sio.INDEX_NAME).read_text())
    shards = sorted(set(idx["weight_map"].values()))
    name = next(k for k, v in idx["weight_map"].items() if v == shards[0])
    idx["weight_map"][name] = shards[1]
    (folder / sio.INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(FormatError) as e:
        WeightReader(folder)
    _assert_names(e, sio.INDEX_NAME, name, shards[1], "does not contain")


def test_duplicate_tensor_across_files(tmp_path):
    save_file({"w": torch.randn(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.randn(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(FormatError) as e:
        WeightReader(tmp_path)
    _assert_names(e, "a.safetensors", "b.safetensors", "'w'")


def test_empty_folder(tmp_path):
    with pytest.raises(FormatError, match="no .*safetensors"):
        WeightReader(tmp_path)


class _Tripwire:
    """Unpickling it creates `path`: a reader that ever unpickled a file would leave it behind."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


@pytest.mark.parametrize("files", [["pytorch_model.bin"], ["consolidated.00.pth"], ["model.pt"],
                                   ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                                    "pytorch_model.bin.index.json"]])
def test_pickled_weights_are_named_never_opened(tmp_path, files):
    """A folder with only PyTorch pickles was refused with "no *.safetensors files", naming neither the files nor
    what to do; they are named now, and still never unpickled."""
    import pickle
    tripwire = tmp_path / "unpickled"
    for f in files:
        (tmp_path / f).write_bytes(b"{}" if f.endswith(".json") else pickle.dumps(_Tripwire(tripwire)))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FormatError) as e:
        WeightReader(tmp_path)
    _assert_names(e, str(tmp_path), *sorted(files)[:4], "pickle", "convert them to safetensors")
    assert "config.json" not in str(e.value)
    with pytest.raises(FormatError) as e:                 # the file itself
        WeightReader(tmp_path / files[0])
    _assert_names(e, files[0], "pickle", "convert them to safetensors")
    assert not tripwire.exists()


def test_missing_tensor_suggests_names(tmp_path):
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(2)}, str(tmp_path / "model.safetensors"))
    r = WeightReader(tmp_path)
    with pytest.raises(FormatError) as e:
        r.get("model.layers.0.mlp.up_proj.weights")
    _assert_names(e, "model.layers.0.mlp.up_proj.weights", "model.layers.0.mlp.up_proj.weight")


def test_get_checked_shape_mismatch(tmp_path):
    save_file({"model.layers.0.mlp.up_proj.weight": torch.randn(576, 1024)},
              str(tmp_path / "model.safetensors"))
    r = WeightReader(tmp_path)
    with pytest.raises(FormatError) as e:
        r.get_checked("model.layers.0.mlp.up_proj.weight", (576, 1536),
                      source="config.json: hidden_size=576, intermediate_size=1536")
    _assert_names(e, "model.safetensors", "model.layers.0.mlp.up_proj.weight", "[576, 1536]",
                  "[576, 1024]", "hidden_size=576")
    t = r.get_checked("model.layers.0.mlp.up_proj.weight", [576, 1024], dtype=torch.float16)
    assert t.dtype == torch.float16 and t.shape == (576, 1024)


def test_random_header_corruption_never_crashes(tmp_path):
    """Flip random header bytes: the reader either refuses with FormatError or yields tensors
    whose bytes lie inside the file and match their declared shape (what safetensors reads)."""
    ts = _random_tensors(6)
    f = tmp_path / "model.safetensors"
    save_file(ts, str(f))
    good = f.read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    rng = random.Random()
    for _ in range(200):
        b = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(0, 8 + n)] = rng.randrange(256)
        f.write_bytes(bytes(b))
        try:
            r = WeightReader(f)
        except FormatError:
            continue
        for name in r.names():
            t = r.get(name)
            assert tuple(t.shape) == r.shape(name)


def test_header_agrees_with_safetensors(tmp_path):
    from safetensors import safe_open
    ts = _random_tensors(15)
    f = tmp_path / "x.safetensors"
    save_file(ts, str(f))
    entries, _ = read_header(f)
    with safe_open(str(f), "pt") as h:
        assert set(h.keys()) == set(entries)
        for k in h.keys():
            sl = h.get_slice(k)
            assert tuple(sl.get_shape()) == entries[k].shape


def test_missing_tensor_names_similar_ones(tmp_path):
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "m.safetensors"))
    r = WeightReader(tmp_path)
    with pytest.raises(FormatError, match=r"tensor 'model.layers.0.mlp.upproj.weight' not found; similar names: "
                                          r"model.layers.0.mlp.up_proj.weight"):
        r.shape("model.layers.0.mlp.upproj.weight")
    assert not r.has("model.layers.0.mlp.upproj.weight")
