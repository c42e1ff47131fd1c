"""EXL2 candidate settings, the measurement pass and its record (measurement.json).

Each candidate is (group size, bit mix). For every linear layer the converter quantizes the
layer with each candidate (GPTQ on that layer's calibration Hessian) and records the storage
bits and the error the candidate adds to the residual stream, in one unit for every layer:

    err_l(c) = mean over tokens t of ||δh_t||² / ||h_t||²

where h is the residual stream right after the sub-layer that holds l (attention or MLP) and δh
the change of that sub-layer's output when l alone is quantized with c. Each pre-norm block
reads the residual through an RMSNorm, so a perturbation acts on everything downstream in
proportion to its size relative to ||h||: this makes q_proj and down_proj errors comparable
(allocate.py sums them).

Measuring δh for every candidate would need a sub-layer forward per candidate; instead the
linear's own output error e_l(c) = tr(ΔH Δᵀ)/2 (exact, from the input Hessian H) is scaled by a
gain g_l = err_l(c_ref)/e_l(c_ref) measured with one forward at a reference candidate (first
order: δh is linear in the linear's output error). For o_proj and down_proj the gain is only the
1/||h||² token weighting; for q/k/v and gate/up it carries the attention / SiLU·up path and the
output projection.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from ..errors import ExlError, InputError
from ..formats.exl2 import REQUIRED as EXL2_TENSORS
from ..textfiles import loads_json
from .calib_forward import Dims, attention, linear, mlp_act, rms_norm
from .gptq_solver import LayerPlan, gptq_quantize_multi, plan_bits, plan_groups
from .hessian import HessianAccumulator, output_sq_error

MEASUREMENT_VERSION = 2


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


# From ~2.1 to ~8.1 bits per weight. Pure widths and mixes of neighbouring widths (act-order puts
# the widest rows on the channels with the largest Hessian diagonal), at g32 and at g128 (the
# larger group saves 3/32 bpw of scales, which buys a wider mix: 4b50+3b50/g128 ≈ 3.6 bpw).
CANDIDATES: tuple[Candidate, ...] = (
    _c(32, (2, 1.0)), _c(32, (3, 0.25), (2, 0.75)), _c(32, (3, 0.5), (2, 0.5)), _c(128, (3, 0.5), (2, 0.5)),
    _c(32, (3, 1.0)), _c(128, (3, 1.0)), _c(32, (4, 0.25), (3, 0.75)), _c(32, (4, 0.5), (3, 0.5)),
    _c(128, (4, 0.5), (3, 0.5)), _c(128, (4, 1.0)), _c(32, (4, 1.0)), _c(128, (5, 0.5), (4, 0.5)),
    _c(32, (5, 0.5), (4, 0.5)), _c(128, (5, 1.0)), _c(32, (5, 1.0)), _c(32, (6, 0.5), (5, 0.5)),
    _c(128, (6, 1.0)), _c(32, (6, 1.0)), _c(32, (8, 0.5), (6, 0.5)), _c(128, (8, 1.0)),
)
# the candidate whose residual error calibrates each linear's gain (errors well above fp32 noise)
REF_CANDIDATE = _c(32, (3, 1.0))


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


def load_measurement(path: Path, expect_layers: dict[str, tuple[int, int]],
                     fixed: Optional[Mapping[str, Optional[int]]] = None
                     ) -> tuple[dict, tuple[Candidate, ...]]:
    """Reads measurement.json and checks it was made for a model with these (out, in) shapes, and, given `fixed`
    (name -> the bits of the current source's exact repack of that layer, or None), with the same repacked layers.
    Every record is checked for its keys and types. The allocation takes only the errors (and the fixed flags)
    from the file: costs come from the current source, which a reused file cannot vouch for."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"measurement file {path} not found")
    try:
        data = loads_json(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or data.get("version") != MEASUREMENT_VERSION or "layers" not in data:
        raise InputError(f"{path}: not an exl_core measurement (version {MEASUREMENT_VERSION})")
    try:
        cands = candidates_from_json(data.get("candidates"))
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path}: \"candidates\" is not a list of candidate settings ({type(e).__name__}: {e})") \
            from None
    if cands != CANDIDATES:     # the allocator indexes CANDIDATES with the measured errors
        raise InputError(f"{path}: measured with other candidate settings than this converter's; "
                         "measure again (omit -m)")
    layers = data["layers"]
    if not isinstance(layers, dict):
        raise InputError(f"{path}: \"layers\" must be an object (layer name -> record)")
    for name, shape in expect_layers.items():
        rec = layers.get(name)
        if rec is None:
            raise InputError(f"{path}: no measurement for layer {name}; was it made for another model?")
        _check_record(path, name, rec, len(cands))
        if tuple(rec["shape"]) != tuple(shape):
            raise InputError(f"{path}: layer {name} measured with shape {rec['shape']}, model has {list(shape)}")
        if fixed is not None and rec.get("fixed", False) != (fixed.get(name) is not None):
            # a repacked layer is priced at its own bits with no error: trusting the flag of another source would
            # hand out bits the output does not spend (or spend bits the target never had)
            was, now = ("a GPTQ layer repacked as it is (\"fixed\": no error, one cost)",
                        "this model's layer is quantized") if rec.get("fixed") else \
                ("a quantized layer", "this model holds it as a GPTQ layer that EXL2 repacks as it is")
            raise InputError(f"{path}: layer {name} was measured as {was}, but {now}; the measurement was made for "
                             "another model: measure again (omit -m)")
    return layers, cands


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_record(path: Path, name: str, rec, n_cands: int) -> None:
    """One layer's record as measure_layer writes it: shape [out, in], numel, bits and err per candidate."""
    def bad(what):
        return InputError(f"{path}: layer {name}: {what}; the file is damaged or not a measurement: measure again "
                          "(omit -m)")
    if not isinstance(rec, dict):
        raise bad(f"the record must be an object, not {type(rec).__name__}")
    missing = [k for k in ("shape", "numel", "bits", "err") if k not in rec]
    if missing:
        raise bad(f"no {', '.join(repr(k) for k in missing)}")
    shape = rec["shape"]
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_num(v) and v == int(v) and v > 0 for v in shape)):
        raise bad(f"\"shape\" must be [out_features, in_features], got {shape!r}")
    if not (_is_num(rec["numel"]) and rec["numel"] == shape[0] * shape[1]):
        raise bad(f"\"numel\" {rec['numel']!r} is not {shape[0]}×{shape[1]}")
    for key in ("bits", "err"):
        v = rec[key]
        if not isinstance(v, list) or len(v) != n_cands:
            raise bad(f"\"{key}\" must be a list of {n_cands} numbers (one per candidate), got "
                      f"{len(v) if isinstance(v, list) else type(v).__name__ if v is not None else 'null'}")
        # NaN would read as zero error in the allocation (every comparison fails): refused like a negative one
        if not all(_is_num(x) and x >= 0 for x in v):
            raise bad(f"\"{key}\" holds a value that is not a finite number ≥ 0")
    if not isinstance(rec.get("fixed", False), bool):
        raise bad(f"\"fixed\" must be true or false, got {rec['fixed']!r}")


# ---- the measurement pass of one decoder layer ---------------------------------------------------

ATTN_IN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_IN = ("mlp.gate_proj", "mlp.up_proj")


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.hessian()


@torch.inference_mode()
def measure_layer(h: torch.Tensor, w: dict, d: Dims, cos, sin, cands, damp: float, prefix: str,
                  fixed: Optional[Callable[[str], Optional[dict]]] = None) -> tuple[dict, torch.Tensor]:
    """Measures every candidate on every linear of one decoder layer (dense propagation).

    h (B, T, hidden) residual input, w the layer's float32 weights (keys relative to `prefix`).
    Returns ({prefix+name: record}, next h). A record holds bits and err (residual units, see the
    module docstring) per candidate, plus the linear's relative output error `out_err` and `gain`.
    fixed(name) returns the EXL2 tensors of a layer stored as is (one cost, no error) or None.
    """
    g = w.get
    bias = {n: g(f"{n}.bias") for n in ATTN_IN + MLP_IN + ("self_attn.o_proj", "mlp.down_proj")}
    wo, wd = w["self_attn.o_proj.weight"], w["mlp.down_proj.weight"]
    x = rms_norm(h, w["input_layernorm.weight"], d.eps)                       # (B, T, hidden)

    def att_with(name=None, wq=None):                                         # o_proj input
        ws = [wq if n == name else w[f"{n}.weight"] for n in ATTN_IN]
        return attention(x, *ws, *(bias[n] for n in ATTN_IN), d, cos, sin)

    att = att_with()                                                          # (B, T, heads·D)
    h1 = h + linear(att, wo, bias["self_attn.o_proj"])
    x2 = rms_norm(h1, w["post_attention_layernorm.weight"], d.eps)

    def m_with(name=None, wq=None):                                           # down_proj input
        wg = wq if name == "mlp.gate_proj" else w["mlp.gate_proj.weight"]
        wu = wq if name == "mlp.up_proj" else w["mlp.up_proj.weight"]
        return mlp_act(x2, wg, wu, bias["mlp.gate_proj"], bias["mlp.up_proj"])

    m = m_with()                                                              # (B, T, intermediate)
    h2 = h1 + linear(m, wd, bias["mlp.down_proj"])

    def delta(name: str, wq: torch.Tensor) -> torch.Tensor:
        """Change of the sub-layer output (B, T, hidden) when only `name` uses wq."""
        if name in ATTN_IN:
            return linear(att_with(name, wq) - att, wo)
        if name == "self_attn.o_proj":
            return linear(att, wq - wo)
        if name in MLP_IN:
            return linear(m_with(name, wq) - m, wd)
        return linear(m, wq - wd)

    inv1 = 1.0 / h1.double().pow(2).sum(-1).clamp_min(1e-30)                 # (B, T) token weights
    inv2 = 1.0 / h2.double().pow(2).sum(-1).clamp_min(1e-30)
    ref = cands.index(REF_CANDIDATE) if REF_CANDIDATE in cands else len(cands) // 2
    rec: dict = {}
    for names, inp, inv in ((ATTN_IN, x, inv1), (("self_attn.o_proj",), att, inv1),
                            (MLP_IN, x2, inv2), (("mlp.down_proj",), m, inv2)):
        H = _hessian(inp)
        for n in names:
            W = w[f"{n}.weight"]
            out_f, in_f = W.shape
            key = prefix + n
            fx = fixed(key) if fixed is not None else None
            if fx is not None:      # repacked losslessly: one cost, no error
                b = sum(fx[k].numel() * fx[k].element_size() * 8 for k in EXL2_TENSORS)
                rec[key] = {"shape": [out_f, in_f], "numel": out_f * in_f, "fixed": True,
                            "bits": [b] * len(cands), "err": [0.0] * len(cands)}
                continue
            results = gptq_quantize_multi(W, H, [c.plan(in_f) for c in cands], damp=damp, name=key)
            sq = [output_sq_error(W, r.w_hat, H) for r in results]
            den = output_sq_error(W, torch.zeros_like(W), H)
            res_ref = (delta(n, results[ref].w_hat).double().pow(2).sum(-1) * inv).mean().item()
            bad = [c.name for c, e in zip(cands, sq) if not math.isfinite(e)]
            if bad or not math.isfinite(res_ref):
                # NaN fails every comparison: it would read as zero error and starve the layer of bits
                raise ExlError(f"{key}: the measured quantization error is not finite (candidates "
                               f"{', '.join(bad) or cands[ref].name}); the weights or calibration "
                               "activations of this layer hold inf/NaN, or the quantizer has a bug")
            gain = res_ref / sq[ref] if sq[ref] > 0 else 0.0
            rec[key] = {"shape": [out_f, in_f], "numel": out_f * in_f,
                        "bits": [candidate_bits(c, out_f, in_f) for c in cands],
                        "err": [gain * e for e in sq], "out_err": [e / max(den, 1e-30) for e in sq],
                        "gain": gain}
    return rec, h2
