"""Resumable job folder: every finished step is a file written atomically (tmp + rename).

    OUT/.exl_job/
        job.json                 the settings the job was started with (a rerun must match, but for
                                 those in JobState.redo: EXL2's -b redoes quant/) and its inputs'
                                 fingerprint under "inputs" (a rerun's inputs must match too)
        calib.safetensors        calibration tokens [rows, length] + info
        measure/state.safetensors  hidden states after the last measured layer (+ its index)
        measure/layer_XXX.json   errors of every candidate for the layers of block XXX
        measurement.json         all measurements (also copied to OUT/)
        quant/state.safetensors  hidden states after the last quantized layer (+ its index)
        quant/layer_XXX.safetensors  output tensors of block XXX
        quant/head.safetensors

A state file names the last layer whose outputs (layer file) were written before it, so a
SIGKILL at any point loses at most the layer in progress, and recomputing it from the saved
float32 hidden states gives bit-identical results.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import InputError
from ..textfiles import loads_json

JOB_DIR = ".exl_job"


def atomic_save(tensors: dict, path: Path, meta: Optional[dict] = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={k: str(v) for k, v in (meta or {}).items()})
    os.replace(tmp, path)


def atomic_json(data, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


class StaleJobError(InputError):
    """An unfinished job in the output folder was started with other settings or from other input files: its
    finished steps cannot be resumed into this conversion."""


class DamagedJobError(StaleJobError):
    """The job folder cannot be resumed as it is: a truncated or corrupt file, or files without job.json."""


class JobState:
    def __init__(self, out_dir: Path, settings: dict, inputs: Optional[dict] = None,
                 redo: Optional[dict[str, tuple[str, ...]]] = None):
        self.out = Path(out_dir)
        self.dir = self.out / JOB_DIR
        self.settings = settings
        self.inputs = inputs          # fingerprint of the input files (ConvertSettings.input_fingerprint)
        # setting -> the job steps (paths under dir) that alone depend on it: a rerun that changes only such settings
        # redoes those steps and keeps the others (EXL2's -b: the calibration and measurement stay valid)
        self.redo = redo or {}
        self.changed: dict[str, tuple] = {}      # what open() found changed of those: name -> (old, new)

    @contextlib.contextmanager
    def reading(self, path: Path):
        """Reading a job file: a damaged one (truncated, corrupt) is refused by name, with the way out."""
        try:
            yield
        # corrupt or missing content only (JSONDecodeError is a ValueError); a PermissionError and the like are the
        # system's to report, not a reason to throw the job away
        except (FileNotFoundError, IsADirectoryError, ValueError, KeyError, SafetensorError) as e:
            raise DamagedJobError(f"{path}: damaged job file ({type(e).__name__}: {e}); delete {self.dir} to start "
                                  "this conversion over (its finished work is lost)") from None

    def open(self) -> bool:
        """Creates or reopens the job; True when resuming. Refuses a job with other settings (but for those in
        `redo`, whose steps it drops: see self.changed), or one whose input files changed since it started (its
        finished steps come from the old ones), a damaged job.json, and job files without one (whose settings cannot
        be known)."""
        f = self.dir / "job.json"
        # (a temp file of an atomic write that a kill interrupted is no finished work: .job.json.tmp after a kill
        # during the first write)
        if not f.is_file() and self.dir.is_dir() and any(not (p.name.startswith(".") and p.name.endswith(".tmp"))
                                                         for p in self.dir.iterdir()):
            raise DamagedJobError(f"{self.dir}: job files without job.json (their settings are unknown, so they "
                                  f"cannot be resumed); delete {self.dir} to start this conversion over")
        if f.is_file():
            with self.reading(f):
                old = loads_json(f.read_text())
                if not isinstance(old, dict):
                    raise ValueError("not a JSON object")
            old_inputs = old.pop("inputs", None)        # absent in jobs started before it was recorded
            diff = sorted(k for k in set(old) | set(self.settings) if old.get(k) != self.settings.get(k))
            stale = [k for k in diff if k not in self.redo]
            if stale:
                raise StaleJobError(f"{self.out}: holds an unfinished conversion with other settings "
                                    f"({', '.join(stale)}); rerun with the same arguments to resume, or choose an "
                                    "empty output folder")
            if old_inputs is not None and self.inputs is not None:
                changed = input_changes(old_inputs, self.inputs, self.settings)
                if changed:
                    raise StaleJobError(
                        f"{self.out}: holds an unfinished conversion whose inputs changed since it started: "
                        f"{'; '.join(changed)}. Its finished layers were computed from the old inputs and "
                        f"cannot be mixed with the new ones: use a new output folder, or delete {self.dir} "
                        "to start this conversion over (its finished work is lost)")
            if diff:
                self._redo(diff, old, old_inputs)
            return True
        data = dict(self.settings)
        if self.inputs is not None:
            data["inputs"] = self.inputs
        atomic_json(data, f)
        return False

    def _redo(self, diff: list[str], old: dict, old_inputs: Optional[dict]) -> None:
        """Drops the steps that depend on the changed settings, then records the new settings: in this order, a kill
        in between leaves the old settings with fewer finished steps, never the new ones with steps of the old."""
        for part in sorted({p for k in diff for p in self.redo[k]}):
            p = self.path(part)
            if p.exists():
                tmp = p.with_name(f".{p.name}.tmp")      # renamed first: a step is gone whole or not at all
                shutil.rmtree(tmp, ignore_errors=True)
                os.replace(p, tmp)
                if tmp.is_dir():
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()
        data = dict(self.settings)
        if old_inputs is not None:                    # unchanged (checked by the caller)
            data["inputs"] = old_inputs
        atomic_json(data, self.dir / "job.json")
        self.changed = {k: (old.get(k), self.settings.get(k)) for k in diff}

    # -- files --------------------------------------------------------------------------------
    def path(self, *parts) -> Path:
        return self.dir.joinpath(*parts)

    def save_state(self, stage: str, hidden: torch.Tensor, layer: int) -> None:
        atomic_save({"hidden": hidden}, self.path(stage, "state.safetensors"), {"layer": layer})

    def load_state(self, stage: str) -> tuple[Optional[torch.Tensor], int]:
        """(hidden after the last finished layer, its index) or (None, -1)."""
        p = self.path(stage, "state.safetensors")
        if not p.is_file():
            return None, -1
        from safetensors import safe_open
        with self.reading(p), safe_open(str(p), "pt") as f:
            layer = int(f.metadata()["layer"])
            return f.get_tensor("hidden"), layer

    def load_tensors(self, *parts) -> dict[str, torch.Tensor]:
        """A finished step's tensors (a damaged file refused by name: reading())."""
        p = self.path(*parts)
        with self.reading(p):
            return load_file(str(p))

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def input_changes(old: dict, new: dict, settings: dict) -> list[str]:
    """What differs between two input fingerprints (ConvertSettings.input_fingerprint), one
    readable item per changed input."""
    out = []
    om, nm = old.get("model") or {}, new.get("model") or {}
    files = [f"{name} is gone" if name not in nm else f"{name} is new" if name not in om
             else f"{name} changed (size or modification time)"
             for name in sorted(set(om) | set(nm)) if om.get(name) != nm.get(name)]
    if files:
        out.append(f"input model {settings.get('input')}: {', '.join(files)}")
    for key, what in (("calib", "calibration file"), ("measurement", "measurement file")):
        if old.get(key) != new.get(key):
            out.append(f"{what} {settings.get(key)} changed (its sha256 differs)")
    return out
