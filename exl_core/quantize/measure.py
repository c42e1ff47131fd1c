"""EXL2 candidate settings and the measurement record (measurement.json).

Each candidate is (group size, bit mix); for every linear layer the converter quantizes the
layer with each candidate (GPTQ on that layer's calibration Hessian) and records the storage
bits and the relative output error. The allocator then picks one candidate per layer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .gptq_solver import LayerPlan, plan_bits, plan_groups

MEASUREMENT_VERSION = 1


@dataclass(frozen=True)
class Candidate:
    group_size: int
    mix: tuple[tuple[int, float], ...]     # (bits, fraction), widest first

    @property
    def name(self) -> str:
        return "+".join(f"{b}b{int(round(f * 100))}" for b, f in self.mix) + f"/g{self.group_size}"

    def plan(self, in_features: int) -> LayerPlan:
        return plan_groups(in_features, self.group_size, list(self.mix), mode="exl2")


def _c(g, *mix):
    return Candidate(g, tuple(mix))


# From ~2.1 to ~8.1 bits per weight. Pure widths at g32 and g128 (the larger group saves 3/32
# bpw of scales), and mixes of neighbouring widths at g32 (act-order puts the widest rows on
# the channels with the largest Hessian diagonal).
CANDIDATES: tuple[Candidate, ...] = (
    _c(32, (2, 1.0)), _c(32, (3, 0.25), (2, 0.75)), _c(32, (3, 0.5), (2, 0.5)),
    _c(32, (3, 1.0)), _c(32, (4, 0.25), (3, 0.75)), _c(32, (4, 0.5), (3, 0.5)),
    _c(128, (4, 1.0)), _c(32, (4, 1.0)), _c(32, (5, 0.5), (4, 0.5)),
    _c(32, (5, 1.0)), _c(32, (6, 0.5), (5, 0.5)),
    _c(128, (6, 1.0)), _c(32, (6, 1.0)), _c(32, (8, 0.5), (6, 0.5)),
    _c(128, (8, 1.0)),
)


def candidate_bits(c: Candidate, out_features: int, in_features: int) -> int:
    return plan_bits(c.plan(in_features), out_features)


def candidates_to_json(cands) -> list[dict]:
    return [{"name": c.name, "group_size": c.group_size, "mix": [list(m) for m in c.mix]} for c in cands]


def candidates_from_json(data) -> tuple[Candidate, ...]:
    return tuple(Candidate(int(d["group_size"]), tuple((int(b), float(f)) for b, f in d["mix"])) for d in data)


def save_measurement(path: Path, layers: dict, cands, info: dict) -> None:
    data = {"version": MEASUREMENT_VERSION, "candidates": candidates_to_json(cands), "info": info,
            "layers": layers}
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def load_measurement(path: Path, expect_layers: dict[str, tuple[int, int]]) -> tuple[dict, tuple[Candidate, ...]]:
    """Reads measurement.json and checks it was made for a model with these (out, in) shapes."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"measurement file {path} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or data.get("version") != MEASUREMENT_VERSION or "layers" not in data:
        raise InputError(f"{path}: not an exl_core measurement (version {MEASUREMENT_VERSION})")
    cands = candidates_from_json(data["candidates"])
    layers = data["layers"]
    for name, shape in expect_layers.items():
        rec = layers.get(name)
        if rec is None:
            raise InputError(f"{path}: no measurement for layer {name}; was it made for another model?")
        if tuple(rec["shape"]) != tuple(shape):
            raise InputError(f"{path}: layer {name} measured with shape {rec['shape']}, model has {list(shape)}")
        if len(rec["err"]) != len(cands):
            raise InputError(f"{path}: layer {name} has {len(rec['err'])} errors for {len(cands)} candidates")
    return layers, cands
