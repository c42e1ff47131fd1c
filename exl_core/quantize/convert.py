"""`exl convert`: FP16 → EXL2 / GPTQ (and GPTQ → EXL2), layer by layer, resumable.

    calibration tokens ──► embed ──► for each decoder layer i:
        measurement (EXL2 only, dense propagation): every candidate setting of every linear
        ──► allocate one setting per linear for the target bpw (allocate.py)
        quantization: Hessian of each linear's input, computed on activations that already went
        through the quantized earlier layers and sub-layers (q/k/v → o → gate/up → down)
    ──► head (EXL2: head_bits) ──► sharded safetensors + config.json (written last)

Every step is saved in OUT/.exl_job (job_state.py); rerunning the same command resumes and gives
byte-identical files (a rerun whose input files changed is refused: see input_fingerprint; one with
another -b keeps the calibration and measurement and redoes the quantization). The job folder is
removed when the output is complete.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import load_config
from ..errors import ConfigError, ExlError, InputError
from ..formats import exl2 as exl2_fmt
from ..formats import gptq as gptq_fmt
from ..formats.safetensors_io import write_sharded
from ..textfiles import require_file
from .allocate import allocate_bpw, bpw_range, bpw_text, range_text
from .calib_forward import (LINEARS, Dims, attention, linear, mlp_act, rms_norm, rope_inv_freq, rope_tables)
from .calibration import Calibration, cached_self_calibration, from_file
from .gptq_solver import LayerPlan, QuantResult, gptq_quantize, plan_groups
from .hessian import HessianAccumulator
from .job_state import JobState, atomic_json, atomic_save
from .measure import (CANDIDATES, candidate_bits, load_measurement, measure_layer,
                      save_measurement)

HEAD_NONE = "__no_head__"
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


@dataclass
class ConvertSettings:
    input: str
    output: str
    format: str = "exl2"                 # "exl2" | "gptq"
    bpw: Optional[float] = None          # EXL2 target average bits per weight (decoder linears)
    bits: int = 4                        # GPTQ
    group_size: int = 128                # GPTQ
    act_order: bool = True
    sym: bool = True                     # GPTQ (EXL2 is always symmetric)
    calib: Optional[str] = None          # file, or None = sample from the model
    measurement: Optional[str] = None    # reuse a measurement.json
    head_bits: int = 6                   # EXL2 head; 16 = keep it dense
    rows: int = 32
    length: int = 256
    seed: int = 0
    damp: float = 0.01
    device: str = "cpu"
    threads: Optional[int] = None
    progress: bool = True
    keep_job: bool = False

    def job_key(self) -> dict:
        """Settings that change the output (a resumed job must match them)."""
        d = asdict(self)
        for k in ("output", "device", "threads", "progress", "keep_job"):
            d.pop(k)
        d["input"] = str(Path(self.input).resolve())
        d["calib"] = None if self.calib is None else str(Path(self.calib).resolve())
        d["measurement"] = None if self.measurement is None else str(Path(self.measurement).resolve())
        return d

    def input_fingerprint(self) -> dict:
        """The input files a resumed job must still find unchanged (job_key() holds only their
        paths): the model folder's config.json, *.safetensors and index by name, size and mtime
        (cheap, the weights are large), the calibration and measurement files by sha256 (small)."""
        folder = Path(self.input)
        files = set(folder.glob("*.safetensors")) | {folder / "config.json", folder / "model.safetensors.index.json",
                                                      folder / "quantize_config.json"}
        try:                                # shards the index names, wherever they are
            wm = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
            files |= {folder / v for v in wm.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        model = {}
        for f in sorted(files):
            if f.is_file():
                st = f.stat()
                model[Path(os.path.relpath(f, folder)).as_posix()] = [st.st_size, st.st_mtime_ns]
        return {"model": model, "calib": _sha256(self.calib), "measurement": _sha256(self.measurement)}


def _sha256(path: Optional[str]) -> Optional[str]:
    if path is None or not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _deterministic(threads: Optional[int]):
    old_det = torch.are_deterministic_algorithms_enabled()
    old_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def _bar(total: int, desc: str, enabled: bool, initial: int = 0):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="layer", disable=not enabled)


# ---- the layer walk shared by measurement and quantization --------------------------------------

QuantizeFn = Callable[[list[str], torch.Tensor, dict], dict]   # (names, H, weights) -> {name: w_hat}


def _walk_layer(h: torch.Tensor, w: dict, d: Dims, cos, sin, quantize: QuantizeFn) -> torch.Tensor:
    """h (B, T, hidden) → next hidden through a layer of dims `d`. `quantize(names, H, w)` returns the weights to
    propagate with (dense ones for measurement, quantized ones for the real pass) for each linear group."""
    g = w.get
    x = rms_norm(h, w["input_layernorm.weight"], d.eps)                      # (B, T, hidden)
    hat = quantize(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], _hess(x), w)
    att = attention(x, hat["self_attn.q_proj"], hat["self_attn.k_proj"], hat["self_attn.v_proj"],
                    g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"), g("self_attn.v_proj.bias"),
                    d, cos, sin)                                               # (B, T, heads·D)
    hat.update(quantize(["self_attn.o_proj"], _hess(att), w))
    h = h + linear(att, hat["self_attn.o_proj"], g("self_attn.o_proj.bias"))
    del att
    x = rms_norm(h, w["post_attention_layernorm.weight"], d.eps)
    hat.update(quantize(["mlp.gate_proj", "mlp.up_proj"], _hess(x), w))
    m = mlp_act(x, hat["mlp.gate_proj"], hat["mlp.up_proj"], g("mlp.gate_proj.bias"), g("mlp.up_proj.bias"))
    hat.update(quantize(["mlp.down_proj"], _hess(m), w))                       # m (B, T, intermediate)
    return h + linear(m, hat["mlp.down_proj"], g("mlp.down_proj.bias"))


def _hess(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.hessian()


# ---- stages ---------------------------------------------------------------------------------------

class Converter:
    def __init__(self, s: ConvertSettings, source, fixed: Optional[dict[str, Optional[int]]] = None):
        self.s = s
        self.src = source
        self.cfg = source.cfg
        # -b picks the allocation only: a rerun with another -b keeps the calibration and measurement, redoes quant/
        self.job = JobState(Path(s.output), s.job_key(), s.input_fingerprint(),
                            redo={"bpw": ("quant",)} if s.format == "exl2" else None)
        d = source.dims
        self.inv_freq = rope_inv_freq(d.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.shapes = {n: source.shape_of_linear(n) for i in range(self.cfg.num_hidden_layers)
                       for n in source.linear_names(i)}
        self.bpw = s.bpw        # EXL2 bitrate converted at: allocate() lowers a target above the reachable one
        # name -> bits of its exact repack (a GPTQ source's layer on EXL2's grid) or None
        self.fixed_bits = fixed if fixed is not None else fixed_bits(source)
        self.alloc_bits: Optional[int] = None       # the decoder linears' bits allocate() chose: checked on output

    # -- calibration --
    def calibration(self) -> Calibration:
        p = self.job.path("calib.safetensors")
        if p.is_file():
            from safetensors import safe_open
            with self.job.reading(p):
                with safe_open(str(p), "pt") as f:
                    return Calibration(f.get_tensor("tokens"), json.loads(f.metadata()["info"]))
        s = self.s
        if s.calib is not None:
            cal = from_file(s.calib, self.src.folder, s.rows, s.length)
        else:
            cal = cached_self_calibration(self.src, s.rows, s.length, seed=s.seed, progress=s.progress)
        atomic_save({"tokens": cal.tokens}, p, {"info": json.dumps(cal.info, sort_keys=True)})
        return cal

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.src.tensor("model.embed_tokens.weight")[tokens]             # (B, T, hidden)

    def _rope(self, length: int):
        return rope_tables(self.inv_freq, torch.arange(length))

    # -- measurement --
    def measure(self, cal: Calibration) -> dict:
        s, job = self.s, self.job
        final = job.path("measurement.json")
        if final.is_file():
            return load_measurement(final, self.shapes, self.fixed_bits)[0]
        cos, sin = self._rope(cal.tokens.shape[1])
        h, done = job.load_state("measure")
        if h is None:
            h = self._embed(cal.tokens)
        layers: dict = {}
        for i in range(done + 1):
            rec = job.path("measure", f"layer_{i:03d}.json")
            with job.reading(rec):
                layers.update(json.loads(rec.read_text()))
        n_layers = self.cfg.num_hidden_layers
        bar = _bar(n_layers, "measuring", s.progress, done + 1)
        for i in range(done + 1, n_layers):
            rec, h = measure_layer(h, self.src.layer_weights(i), self.src.layer_dims(i), cos, sin, CANDIDATES, s.damp,
                                   f"model.layers.{i}.", self._fixed)
            atomic_json(rec, job.path("measure", f"layer_{i:03d}.json"))
            job.save_state("measure", h, i)
            layers.update(rec)
            bar.update(1)
        bar.close()
        save_measurement(final, layers, CANDIDATES, {"calibration": cal.info})
        return layers

    # -- allocation --
    def allocate(self, layers: dict) -> dict[str, LayerPlan]:
        names = list(self.shapes)
        # costs from this source, not the measurement's records: a reused file (-m) cannot vouch for them
        costs = layer_costs(self.shapes, self.fixed_bits)
        errs = [layers[n]["err"] for n in names]
        numel = [o * i for o, i in self.shapes.values()]
        # a GPTQ source: its exactly repacked layers have one cost each, and more bits cannot add what its weights do
        # not hold -- a target above the highest converts at it (said), not a refusal after the measurement pass
        lossless = getattr(self.src, "fixed_exl2", None) is not None
        hi = bpw_range(costs, numel)[1]
        if self.s.bpw > hi:     # allocate_bpw converts at hi (where lossless or within its tolerance): recorded
            self.bpw = float(bpw_text(hi))
            if lossless:
                print(f"exl convert: -b {self.s.bpw}: this GPTQ model converts to at most {bpw_text(hi)} bpw; "
                      "converting at that", file=sys.stderr)
        # (_check_settings refuses a target outside the range before any work; a rerun with another -b keeps this
        # job's measurement should it get here)
        why = "; a GPTQ model's layers that EXL2 holds exactly are repacked as they are (one cost each), not " \
              "re-quantized lower" if lossless else ""
        choice = allocate_bpw(costs, errs, numel, self.s.bpw, clamp_high=lossless,
                              why=f"{why}; rerun with a -b in that range (this job's measurement is kept)")
        self.alloc_bits = sum(c[j] for c, j in zip(costs, choice))
        cands = CANDIDATES
        return {n: cands[c].plan(self.shapes[n][1]) for n, c in zip(names, choice)}

    def _fixed(self, name: str):
        """EXL2 tensors of a layer the source can repack without loss (GPTQ input), else None."""
        f = getattr(self.src, "fixed_exl2", None)
        return f(name) if f is not None else None

    # -- quantization --
    def _pack(self, r: QuantResult, bias: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.s.format == "exl2":
            return exl2_fmt.pack_layer(r.qint, r.scale_code + 1,
                                       r.scale_max.float(), [(b, ln) for b, _, ln in r.groups], r.perm, bias)
        # GPTQ: rows back in original order, g_idx = group of each original row
        k = r.qint.shape[0]
        g_idx = torch.empty(k, dtype=torch.int32)
        q = torch.empty_like(r.qint)
        perm = r.perm if r.perm is not None else torch.arange(k)
        for gi, (_, k0, ln) in enumerate(r.groups):
            g_idx[perm[k0:k0 + ln]] = gi
        q[perm] = r.qint
        return gptq_fmt.pack_layer(q, r.scale, r.zero, g_idx, r.groups[0][0], "gptq", bias)

    def quantize(self, cal: Calibration, plans: dict[str, LayerPlan]) -> None:
        s, job = self.s, self.job
        cos, sin = self._rope(cal.tokens.shape[1])
        h, done = job.load_state("quant")
        if h is None:
            h = self._embed(cal.tokens)
        n_layers = self.cfg.num_hidden_layers
        bar = _bar(n_layers, f"quantizing ({s.format})", s.progress, done + 1)
        for i in range(done + 1, n_layers):
            tensors: dict[str, torch.Tensor] = {}
            prefix = f"model.layers.{i}."

            def quant_group(names, H, w, tensors=tensors, prefix=prefix):
                hats = {}
                for n in names:
                    fixed = self._fixed(prefix + n) if s.format == "exl2" else None
                    if fixed is not None:
                        for k, t in fixed.items():
                            tensors[f"{prefix}{n}.{k}"] = t
                        o = self.shapes[prefix + n][0]       # EXL2 stores columns padded to a multiple of 32
                        w_hat = exl2_fmt.dequantize_reference(fixed, torch.float64, out_features=o)
                        hats[n] = w_hat.T.float().contiguous()
                        continue
                    r = gptq_quantize(w[f"{n}.weight"], H, plans[prefix + n], damp=s.damp, name=prefix + n)
                    for k, t in self._pack(r, w.get(f"{n}.bias")).items():
                        tensors[f"{prefix}{n}.{k}"] = t
                    hats[n] = r.w_hat
                return hats

            h = _walk_layer(h, self.src.layer_weights(i), self.src.layer_dims(i), cos, sin, quant_group)
            atomic_save(tensors, job.path("quant", f"layer_{i:03d}.safetensors"))
            job.save_state("quant", h, i)
            bar.update(1)
        bar.close()
        self._quantize_head(h)

    def _quantize_head(self, h: torch.Tensor) -> None:
        p = self.job.path("quant", "head.safetensors")
        if p.is_file():
            return
        tensors: dict[str, torch.Tensor] = {}
        if self.s.format == "exl2" and self.s.head_bits != 16:
            x = rms_norm(h, self.src.tensor("model.norm.weight"), self.src.dims.eps)
            W = self.src.head_weight()
            plan = plan_groups(W.shape[1], 32, [(self.s.head_bits, 1.0)], mode="exl2")
            r = gptq_quantize(W, _hess(x), plan, damp=self.s.damp, name="lm_head")
            for k, t in self._pack(r, None).items():
                tensors[f"lm_head.{k}"] = t
        elif self.src.has_tensor("lm_head.weight"):
            tensors["lm_head.weight"] = self.src.tensor("lm_head.weight").half()
        # a tied head stores nothing; safetensors cannot round-trip an empty file, keep a marker
        atomic_save(tensors or {HEAD_NONE: torch.zeros(1)}, p)

    # -- output --
    def finalize(self, cal: Calibration) -> dict:
        s, out = self.s, Path(self.s.output)
        tensors = self.src.passthrough_tensors()
        for i in range(self.cfg.num_hidden_layers):
            tensors.update(self.job.load_tensors("quant", f"layer_{i:03d}.safetensors"))
        tensors.update({k: v for k, v in self.job.load_tensors("quant", "head.safetensors").items()
                        if k != HEAD_NONE})
        tensors = dict(sorted(tensors.items()))
        bits, numel = self.stored_bits(tensors)
        real_bpw = bits / numel
        if s.format == "exl2" and bits != self.alloc_bits:      # what config.json's bits and real_bpw promise
            raise ExlError(f"{out}: internal error: the decoder linears hold {bits} bits ({real_bpw:.4f} bpw), the "
                           f"allocation chose {self.alloc_bits} ({(self.alloc_bits or 0) / numel:.4f} bpw); nothing "
                           "was written (please report this)")
        for f in COPY_FILES:
            if (self.src.folder / f).is_file():
                shutil.copyfile(self.src.folder / f, out / f)
        if s.format == "exl2":
            qc = {"quant_method": "exl2", "version": "exl_core-0.1", "bits": self.bpw, "head_bits": s.head_bits,
                  "real_bpw": round(real_bpw, 4), "calibration": cal.info}
            shutil.copyfile(self.job.path("measurement.json"), out / "measurement.json")
        else:
            qc = {"quant_method": "gptq", "bits": s.bits, "group_size": s.group_size, "desc_act": s.act_order,
                  "sym": s.sym, "checkpoint_format": "gptq", "damp_percent": s.damp, "true_sequential": True,
                  "real_bpw": round(real_bpw, 4), "calibration": cal.info}
        for stale in out.glob(".*.tmp-*"):           # a write killed (SIGKILL) before its cleanup could run
            stale.unlink()
        write_sharded(tensors, out, max_shard_bytes=s_max_shard(), metadata={"quantizer": "exl_core"})
        cfg = json.loads((self.src.folder / "config.json").read_text())
        cfg["quantization_config"] = qc
        cfg["torch_dtype"] = cfg["dtype"] = "float16"     # transformers 5 reads "dtype": both, never two answers
        tmp = out / ".config.json.tmp"
        tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        tmp.replace(out / "config.json")                # last: the folder is complete from here
        return qc

    def stored_bits(self, tensors: dict) -> tuple[int, int]:
        """(stored bits, weights) of the decoder linears (values, scales, group tables, permutations)."""
        bits = numel = 0
        keys = exl2_fmt.REQUIRED if self.s.format == "exl2" else ("qweight", "qzeros", "scales", "g_idx")
        for n, (o, i) in self.shapes.items():
            numel += o * i
            bits += sum(tensors[f"{n}.{k}"].numel() * tensors[f"{n}.{k}"].element_size() * 8 for k in keys)
        return bits, numel


def s_max_shard() -> int:
    return 2 * 1024 ** 3


# ---- entry points ---------------------------------------------------------------------------------

def _open_source(s: ConvertSettings):
    inp = Path(s.input)
    if not inp.is_dir():
        raise ConfigError(f"{inp}: input model folder not found")
    if not (inp / "config.json").is_file():
        raise ConfigError(f"{inp}: no config.json; -i must be a Hugging Face model folder")
    cfg = load_config(inp)      # with an older AutoGPTQ folder's quantize_config.json, as load_model reads it
    method = str((cfg.quantization_config or {}).get("quant_method", "")).lower()
    if method == "gptq":
        if s.format != "exl2":
            raise InputError(f"{inp}: input is already GPTQ; only GPTQ → EXL2 is supported (--format exl2)")
        from .gptq_to_exl2 import GptqSource
        return GptqSource(inp, cfg)
    if method:
        raise InputError(f"{inp}: input is quantized with {method!r}; convert from the FP16 model instead")
    from .source import DenseSource
    return DenseSource(inp, cfg)


def _check_settings(s: ConvertSettings, src, fixed: Optional[dict[str, Optional[int]]] = None) -> None:
    """Refuses settings before any work (no job folder yet). fixed: fixed_bits(src), computed when not given."""
    if s.format not in ("exl2", "gptq"):
        raise InputError(f"--format must be exl2 or gptq, got {s.format!r}")
    if s.calib is not None:
        require_file(s.calib, "calibration file")
    if s.rows < 1 or s.length < 16:
        raise InputError(f"calibration needs rows ≥ 1 and length ≥ 16 (got {s.rows}×{s.length})")
    # positions the model was never trained at mislead the measurement; the context config.json states, not
    # config.py's default for a missing key
    ctx = src.cfg.raw.get("max_position_embeddings")
    if isinstance(ctx, int) and ctx > 0 and s.length > ctx:
        raise InputError(f"--length {s.length}: the model's context is {ctx} tokens (max_position_embeddings); "
                         f"use --length {min(256, ctx)} or at most {ctx}")
    # the Hessian's dampening, a fraction of its mean diagonal: 0 (none, raised only where H is singular) is
    # meaningful for EXL2, but GPTQ writes it as damp_percent, which transformers' GPTQConfig wants in (0, 1)
    if not (0 < s.damp < 1 or (s.damp == 0 and s.format == "exl2")):
        allowed = "in [0, 1)" if s.format == "exl2" else "in (0, 1) (config.json's damp_percent for transformers)"
        raise InputError(f"--damp {s.damp}: must be {allowed} for --format {s.format}; it is a fraction of the "
                         "Hessian's mean diagonal, e.g. 0.01")
    if s.threads is not None and s.threads < 1:
        raise InputError(f"--threads {s.threads}: must be ≥ 1")
    # options of the other format would be ignored (and still count in job.json's resume key): refused
    flags = {"head_bits": "--head-bits", "measurement": "-m"} if s.format == "gptq" else \
        {"bits": "--bits", "group_size": "--group-size", "sym": "--asym", "act_order": "--no-act-order"}
    defaults = {f.name: f.default for f in fields(ConvertSettings)}
    given = [flag for k, flag in flags.items() if getattr(s, k) != defaults[k]]
    if given:
        why = ("EXL2 is always symmetric with act-order and picks its bits and groups per layer from -b"
               if s.format == "exl2" else "they are EXL2's")
        raise InputError(f"{', '.join(given)}: not used by --format {s.format} ({why})")
    if s.format == "gptq":
        if s.bpw is not None:
            raise InputError(f"-b {s.bpw}: -b is EXL2's target bitrate; GPTQ takes --bits "
                             f"({', '.join(map(str, gptq_fmt.SUPPORTED_BITS))})")
        if s.bits not in gptq_fmt.SUPPORTED_BITS:
            raise InputError(f"--bits {s.bits}: GPTQ supports {gptq_fmt.SUPPORTED_BITS}")
        if s.group_size not in (-1, 32, 64, 128):
            raise InputError(f"--group-size {s.group_size}: use 32, 64, 128 or -1")
        shapes = src_shapes(src)
        for n, (o, i) in shapes.items():
            plan_groups(i, s.group_size, [(s.bits, 1.0)], mode="gptq")     # raises on odd shapes
            if o * s.bits % 32:          # qzeros pack along N: refused here, not after the first layers' work
                fits = [b for b in gptq_fmt.SUPPORTED_BITS if all(oo * b % 32 == 0 for oo, _ in shapes.values())]
                instead = f"use --bits {' or '.join(map(str, fits))}" if fits else "no GPTQ bit width fits"
                raise InputError(f"{n}: {o} output features at --bits {s.bits} do not fill whole 32-bit words of "
                                 f"GPTQ's qzeros (out_features must be a multiple of {32 // math.gcd(32, s.bits)}); "
                                 f"{instead}, or convert to EXL2")
        return
    if s.bpw is None:
        raise InputError("EXL2 needs a target bitrate: -b BPW (e.g. -b 4.0)")
    if s.head_bits not in exl2_fmt.SUPPORTED_BITS + (16,):
        raise InputError(f"--head-bits {s.head_bits}: use one of {exl2_fmt.SUPPORTED_BITS} or 16 (unquantized)")
    shapes = src_shapes(src)
    # the costs allocate() uses: a GPTQ source's exact repacks count at their own bits (a lower bound from the
    # candidates alone let a too-low -b through, refused only after the measurement pass)
    costs = layer_costs(shapes, fixed_bits(src) if fixed is None else fixed)
    lo, hi = bpw_range(costs, [o * i for o, i in shapes.values()])
    lossless = getattr(src, "fixed_exl2", None) is not None
    if not (lo <= s.bpw and (lossless or s.bpw <= hi + 0.05)):     # a GPTQ source converts at hi at most: said
        why = "; a GPTQ model's layers that EXL2 holds exactly are repacked as they are (one cost each), not " \
              "re-quantized lower" if lossless and s.bpw < lo else ""
        raise InputError(f"-b {s.bpw}: EXL2 settings reach {range_text(lo, hi)} bpw for this model{why}")


def src_shapes(src) -> dict[str, tuple[int, int]]:
    return {n: src.shape_of_linear(n) for i in range(src.cfg.num_hidden_layers) for n in src.linear_names(i)}


def fixed_bits(src) -> dict[str, Optional[int]]:
    """Per decoder linear: the bits of its exact EXL2 repack where the source has one (a GPTQ layer on EXL2's
    grid), else None."""
    f = getattr(src, "fixed_exl2_bits", None)
    return {n: f(n) if f is not None else None for n in src_shapes(src)}


def layer_costs(shapes: dict[str, tuple[int, int]], fixed: dict[str, Optional[int]]) -> list[list[int]]:
    """Stored bits of every candidate per linear (in `shapes` order); an exactly repacked layer has its one cost."""
    return [[fixed[n]] * len(CANDIDATES) if fixed.get(n) is not None else
            [candidate_bits(c, o, i) for c in CANDIDATES] for n, (o, i) in shapes.items()]


def convert(s: ConvertSettings) -> dict:
    """Runs (or resumes) a conversion; returns the written quantization_config."""
    if s.device != "cpu":
        if s.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {s.device}: torch sees no CUDA GPU; use --device cpu")
        raise InputError(f"--device {s.device}: the converter runs on cpu only for now")
    src = _open_source(s)
    fixed = fixed_bits(src) if s.format == "exl2" else None
    _check_settings(s, src, fixed)
    out = Path(s.output)
    if (out / "config.json").exists():
        raise InputError(f"{out}: already holds a finished model (config.json); choose another output folder")
    if out.exists() and any(p.name != ".exl_job" for p in out.iterdir()) and not (out / ".exl_job").exists():
        raise InputError(f"{out}: folder is not empty; choose a new or empty output folder")
    measurement = None
    if s.measurement is not None:
        # its fixed flags must be this source's: a repacked layer is priced at its own bits with no error
        measurement = load_measurement(Path(s.measurement), src_shapes(src), fixed)[0]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with _deterministic(s.threads), torch.inference_mode():
        conv = Converter(s, src, fixed)
        resumed = conv.job.open()
        for k, (was, now) in conv.job.changed.items():
            print(f"exl convert: {out}: resuming the unfinished conversion with {'-b' if k == 'bpw' else k} {now} "
                  f"(it had {was}): its calibration and measurement are kept, its quantization starts over",
                  file=sys.stderr)
        try:
            cal = conv.calibration()
        except BaseException:
            if not resumed:      # a new job with no finished work: a refused calibration must not block a rerun
                conv.job.clear()
            raise
        if s.format == "exl2":
            if measurement is not None and not conv.job.path("measurement.json").is_file():
                save_measurement(conv.job.path("measurement.json"), measurement, CANDIDATES,
                                 {"reused_from": str(s.measurement)})
            plans = conv.allocate(conv.measure(cal))
        else:
            plans = {n: plan_groups(i, s.group_size, [(s.bits, 1.0)], mode="gptq", sym=s.sym,
                                    act_order=s.act_order) for n, (o, i) in conv.shapes.items()}
        conv.quantize(cal, plans)
        qc = conv.finalize(cal)
    if not s.keep_job:
        conv.job.clear()
    qc = dict(qc, seconds=round(time.time() - t0, 1))
    return qc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exl convert", description="Convert an FP16 HF model (or a GPTQ one) "
                                "to EXL2 or GPTQ. Rerun the same command to resume an interrupted job.")
    p.add_argument("-i", "--input", required=True, help="HF model folder (fp16/bf16/fp32, or GPTQ for → EXL2)")
    p.add_argument("-o", "--output", required=True, help="output folder (new or empty, or an unfinished job)")
    p.add_argument("-b", "--bpw", type=float, help="EXL2 target bits per weight (decoder layers)")
    p.add_argument("--format", choices=("exl2", "gptq"), default="exl2")
    p.add_argument("--bits", type=int, default=4, help="GPTQ bits (2, 3, 4, 8)")
    p.add_argument("--group-size", type=int, default=128, help="GPTQ group size (32, 64, 128, -1)")
    p.add_argument("--act-order", dest="act_order", action="store_true", default=True)
    p.add_argument("--no-act-order", dest="act_order", action="store_false")
    p.add_argument("--sym", dest="sym", action="store_true", default=True)
    p.add_argument("--asym", dest="sym", action="store_false")
    p.add_argument("-c", "--calib", help="calibration text (.txt, .jsonl with 'text', .json: an array of strings "
                   "or of objects with 'text', .parquet); "
                   "default: text sampled from the model itself")
    p.add_argument("--rows", type=int, default=32, help="calibration rows")
    p.add_argument("--length", type=int, default=256, help="calibration tokens per row")
    p.add_argument("-m", "--measurement", help="reuse this measurement.json (skips the measurement pass)")
    p.add_argument("--head-bits", type=int, default=6, help="EXL2 lm_head bits (16 = unquantized)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--keep-job", action="store_true", help="keep OUT/.exl_job after finishing")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def settings_from_args(a) -> ConvertSettings:
    return ConvertSettings(input=a.input, output=a.output, format=a.format, bpw=a.bpw, bits=a.bits,
                           group_size=a.group_size, act_order=a.act_order, sym=a.sym, calib=a.calib,
                           measurement=a.measurement, head_bits=a.head_bits, rows=a.rows, length=a.length,
                           seed=a.seed, damp=a.damp, device=a.device, threads=a.threads,
                           progress=not a.quiet, keep_job=a.keep_job)


def convert_main(argv: Optional[list[str]] = None) -> int:
    """`exl convert ...`: returns 0 on success, 2 on a refused input (message on stderr)."""
    a = build_parser().parse_args(argv)
    try:
        qc = convert(settings_from_args(a))
    except (ExlError, OSError) as e:    # OSError: an unwritable or odd output path, which its message names
        print(f"exl convert: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(qc, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(convert_main())
