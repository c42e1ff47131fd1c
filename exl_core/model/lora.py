"""LoRA adapters (PEFT format) for the native model: on the fly or merged into the weights.

On the fly, every targeted `QuantLinear` gets a `LoraHook` in its `.lora` slot; after the
base matmul the hook adds, for each row range of the flat batch and the adapter mix chosen
for it,

    y[rows] += sum_a  w_a * scale_a * (x[rows] @ A_a^T) @ B_a^T        A (r, in)   B (out, r)

so different jobs in one batched forward may use different mixes while the base weights
stay untouched. Which rows use which mix is the model's `LoraManager` state: a row plan
(set by the generator before each forward) or, without one, a mix for every row
(`set_active`). Merging bakes one adapter into the weights (dense: add; quantized:
dequantise -> add -> re-quantize with the layer's own format, groups, widths and order,
keeping the layer's own scales and zeros wherever they fit the new values at least as well as
fresh ones: see `requantize_like`; a zero update leaves a layer untouched).

scale_a = lora_alpha / r (or lora_alpha / sqrt(r) with use_rslora), as PEFT computes it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

from ..errors import LoraError, is_bool, is_int
from ..textfiles import loads_json
from .linear import QuantLinear
from .lora_requant import requantize_like

# base_model.model.<hf module name>.lora_A[.<adapter name>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Mix = Mapping[str, float]                       # adapter name -> weight
RowPlan = Sequence[tuple[int, int, Mix]]        # (first row, end row, mix) over the flat batch


@dataclass
class _LayerAdapter:
    a_t: torch.Tensor      # (in, r) float32, model device
    b_t: torch.Tensor      # (r, out) float32
    scale: float


class LoraHook:
    """Sits in `QuantLinear.lora`: y (T, out) += the mixed low-rank updates of x (T, in)."""

    def __init__(self, manager: "LoraManager", name: str):
        self.manager = manager
        self.name = name
        self.adapters: dict[str, _LayerAdapter] = {}

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        plan = self.manager.current_plan(x.shape[0])
        if not plan:
            return y
        out = None
        for start, end, mix in plan:
            delta = None
            xs = x[start:end].float()
            for aname, w in mix.items():
                ad = self.adapters.get(aname)
                if ad is None or w == 0:
                    continue      # this adapter does not touch this layer
                d = (xs @ ad.a_t) @ ad.b_t * (ad.scale * float(w))    # (rows, out)
                delta = d if delta is None else delta + d
            if delta is not None:
                if out is None:
                    out = y.clone()   # the kernel's output may be reused by the caller
                out[start:end] += delta.to(y.dtype)
        return y if out is None else out


class LoraManager:
    """All adapters loaded into one model, and which rows use which mix right now."""

    def __init__(self, model):
        self.model = model
        self.adapters: dict[str, "LoraAdapter"] = {}
        self.hooks: dict[str, LoraHook] = {}
        self.active: dict[str, float] = {}            # mix for every row when no plan is set
        # the row plan lives per thread: generators on one model step on their own threads, each between its own
        # set_plan and forward (one plan on the manager let a forward run with another generator's mix)
        self._local = threading.local()
        self.merged: list[str] = []                   # merge order: merges are undone in reverse (each saved the
        # weights as they were, which hold the merges before it)
        # bumped where the weights change (merge, unmerge) or an adapter's name may come to mean other factors
        # (unload): prefix pages from before never match after (prefix_salt; the mix itself is in the salt). It goes
        # on from the model's previous manager (unload drops the last one), so a name reloaded with other factors
        # never meets that manager's pages
        self.epoch = getattr(model, "_lora_epoch", 0)

    def jobs_using(self, name: str) -> int:
        """Queued or running jobs (of generators on this model) whose mix names adapter `name`."""
        return self._pending(lambda j: name in (j.loras or {}))

    def _pending(self, affected) -> int:
        return sum(1 for g in generators_of(self.model) for j in g.pending_jobs() if affected(j))

    def check_unused(self, name: str, doing: str) -> None:
        n = self.jobs_using(name)
        if n:
            jobs = f"{n} queued or running job{'s use' if n > 1 else ' uses'}"
            raise LoraError(f"cannot {doing} adapter {name!r}: {jobs} it; let them finish or cancel them first")

    def check_no_jobs(self, doing: str, default_mix_only: bool = False) -> None:
        """Refuses a change of what rows compute under queued or running jobs (every job's for merges, the jobs
        without their own mix for the active one): their K/V so far was computed the old way."""
        n = self._pending((lambda j: not j.loras) if default_mix_only else (lambda j: True))
        if n:
            whose = " without their own loras (they use the active mix)" if default_mix_only else ""
            raise LoraError(f"cannot {doing}: {n} queued or running job{'s' if n > 1 else ''}{whose} would mix K/V "
                            "computed before and after it; let them finish or cancel them first")

    def set_active(self, mix: dict[str, float], doing: str = "change the active mix") -> None:
        if mix != self.active:
            self.check_no_jobs(doing, default_mix_only=True)
            self.active = mix

    def check_mix(self, mix: Optional[Mix], what: str = "loras") -> dict[str, float]:
        """Validated copy of a mix: known, unmerged adapters with finite weights."""
        out = {}
        for name, w in (mix or {}).items():
            if name not in self.adapters:
                raise LoraError(f"{what}: no adapter named {name!r} is loaded (loaded: "
                                f"{sorted(self.adapters)}); call exl_core.load_lora(model, folder, name=...)")
            if self.adapters[name].merged:
                raise LoraError(f"{what}: adapter {name!r} is merged into the weights and already applies to "
                                "every row; unmerge() it to choose it per job")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise LoraError(f"{what}: weight of adapter {name!r} must be a finite number, got {w!r}")
            if w != 0:
                out[name] = float(w)
        return out

    def set_plan(self, plan: Optional[RowPlan]) -> None:
        """Per-row mixes for the next forward(s): [(start, end, mix)] over the flat batch rows;
        rows outside every range get no adapter. None: back to `active` for every row."""
        if plan is None:
            self._local.plan = None
            return
        merged: list[tuple[int, int, dict]] = []
        for start, end, mix in plan:
            mix = self.check_mix(mix)
            if not mix or end <= start:
                continue
            if merged and merged[-1][1] == start and merged[-1][2] == mix:   # one matmul for neighbours
                merged[-1] = (merged[-1][0], end, mix)
            else:
                merged.append((start, end, mix))
        self._local.plan = merged

    def current_plan(self, rows: int) -> list[tuple[int, int, dict]]:
        plan = getattr(self._local, "plan", None)
        if plan is not None:
            return plan
        return [(0, rows, self.active)] if self.active else []

    def hook_for(self, name: str, layer: QuantLinear) -> LoraHook:
        hook = self.hooks.get(name)
        if hook is None:
            if layer.lora is not None and not isinstance(layer.lora, LoraHook):
                raise LoraError(f"{name}: the layer already carries a foreign .lora hook")
            hook = layer.lora if isinstance(layer.lora, LoraHook) else LoraHook(self, name)
            layer.lora = hook
            self.hooks[name] = hook
        return hook


# Every generator of a model, whether or not its jobs name adapters: a merge or a new active mix changes the rows of
# jobs that name none. Kept apart from the LoraManager, whose mere existence keeps a model off the CUDA graphs.
_GENERATORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_GENERATORS_LOCK = threading.Lock()      # generators are made, and enqueue, on other threads too


def register_generator(model, gen) -> None:
    with _GENERATORS_LOCK:
        _GENERATORS.setdefault(model, weakref.WeakSet()).add(gen)


def generators_of(model) -> list:
    with _GENERATORS_LOCK:
        return list(_GENERATORS.get(model, ()))


@contextmanager
def jobs_frozen(model):
    """Holds every generator's lock of `model` (in one order: no deadlock): no job is enqueued, admitted or stepped
    meanwhile, so a check of the pending jobs and the change it allows are one step (Generator.enqueue checks a job's
    mix again under its lock)."""
    while True:
        gens = sorted(generators_of(model), key=id)
        for g in gens:
            g._lock.acquire()
        if set(generators_of(model)) <= set(gens):
            break
        # a generator was made while this waited for the others' locks: all again, in one order with it
        for g in reversed(gens):
            g._lock.release()
    try:
        yield
    finally:
        for g in reversed(gens):
            g._lock.release()


def _jobs_frozen(change):
    """A LoraAdapter method that changes what rows compute, run under jobs_frozen."""
    @functools.wraps(change)
    def run(self, *args, **kwargs):
        with jobs_frozen(self.manager.model):
            return change(self, *args, **kwargs)
    return run


def lora_manager(model, create: bool = False) -> Optional[LoraManager]:
    m = getattr(model, "_lora_manager", None)
    if m is None and create:
        m = LoraManager(model)
        model._lora_manager = m      # a plain attribute (not a submodule): no state_dict entry
    return m


def set_row_plan(model, plan: Optional[RowPlan]) -> None:
    """Per-row adapter mixes for the next forward (the generator calls this; None clears)."""
    m = lora_manager(model)
    if m is None:
        if plan and any(mix for _, _, mix in plan):
            raise LoraError("loras were requested but no adapter is loaded into this model")
        return
    m.set_plan(plan)


@contextmanager
def row_plan(model, plan: Optional[RowPlan]):
    """`with row_plan(model, [(0, 5, {"a": 1.0}), (5, 9, {"b": 0.5})]): model.forward(...)`"""
    set_row_plan(model, plan)
    try:
        yield
    finally:
        set_row_plan(model, None)


def check_job_loras(model, mix: Optional[Mix], what: str = "loras") -> dict[str, float]:
    """Validated mix for a job (LoraError when an adapter is unknown, merged or weighted badly)."""
    m = lora_manager(model)
    if m is None:
        if mix:
            raise LoraError(f"{what}: loras={dict(mix)} requested but no adapter is loaded into this model; "
                            "call exl_core.load_lora(model, folder) first")
        return {}
    return m.check_mix(mix, what)


@contextmanager
def lora_rows(model, jobs_and_lens: Sequence[tuple[object, int]]):
    """Row plan for one flat forward: the i-th entry's `job.loras` (or, where it has none, the active mix) covers
    its `n` consecutive rows. Does nothing (no plan set) when no job asks for an adapter."""
    m = lora_manager(model)
    if m is None or not any(getattr(j, "loras", None) for j, _ in jobs_and_lens):
        yield
        return
    plan, r = [], 0
    for job, n in jobs_and_lens:   # a job without its own mix takes the active one, as it would alone
        plan.append((r, r + n, getattr(job, "loras", None) or m.active))
        r += n
    m.set_plan(plan)
    try:
        yield
    finally:
        m.set_plan(None)


def set_active(model, mix: Optional[Mix]) -> None:
    """The mix applied to every row of plain `model.forward` calls (no row plan set), and to the generator's jobs
    that name no mix of their own."""
    m = lora_manager(model)
    if m is None:
        check_job_loras(model, mix, "set_active")     # refuses a mix; nothing to change without adapters
        return
    with jobs_frozen(model):
        m.set_active(m.check_mix(mix, "set_active"))


def prefix_salt(model, loras: Optional[Mix]) -> bytes:
    """Starts a job's prefix-index key chain: jobs whose rows compute different K/V for the same tokens (another
    mix, or the model's adapters loaded, merged or activated since) must never share pages.  b"" for a model no
    adapter ever touched."""
    m = lora_manager(model)
    if m is None:
        return b""
    mix = loras or m.active
    if not mix and m.epoch == 0:
        return b""
    return hashlib.blake2b(repr((m.epoch, sorted(mix.items()))).encode(), digest_size=16).digest()


# -- loading ------------------------------------------------------------------------------------
def _read_config(folder: Path) -> dict:
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoraError(f"{folder}: adapter_config.json not found; a PEFT LoRA folder needs it")
    try:
        cfg = loads_json(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{cfg_path}: unreadable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_path}: expected a JSON object of PEFT settings, got a {type(cfg).__name__}")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise LoraError(f"{cfg_path}: '{key}' must be an object of module pattern -> value, got "
                            f"{type(cfg[key]).__name__}")
    ptype = str(cfg.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise LoraError(f"{cfg_path}: peft_type {ptype!r} is not supported (only LORA)")
    # ranks are positive integers, alphas positive finite numbers (json reads NaN and Infinity, which would
    # scale every update into NaN), in the patterns as at the top level
    for key, v in [("r", cfg.get("r"))] + [
            (f"rank_pattern[{k!r}]", v) for k, v in (cfg.get("rank_pattern") or {}).items()]:
        if not (is_int(v) or (isinstance(v, float) and v.is_integer())) or v <= 0:     # 8.0 is a rank too
            raise LoraError(f"{cfg_path}: '{key}' must be a positive integer, got {v!r}")
    for key, v in [("lora_alpha", cfg.get("lora_alpha"))] + [
            (f"alpha_pattern[{k!r}]", v) for k, v in (cfg.get("alpha_pattern") or {}).items()]:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise LoraError(f"{cfg_path}: '{key}' must be a positive finite number, got {v!r}")
    if cfg.get("use_rslora") is not None and not is_bool(cfg["use_rslora"]):    # "false" is truthy
        raise LoraError(f"{cfg_path}: 'use_rslora' must be true or false, got {cfg['use_rslora']!r}")
    if cfg.get("use_dora"):
        raise LoraError(f"{cfg_path}: DoRA adapters (use_dora) are not supported")
    return cfg


def _read_tensors(folder: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(st))
        except (SafetensorError, OSError, ValueError) as e:
            raise LoraError(f"{st}: not a readable safetensors file ({e})") from e
    binf = folder / "adapter_model.bin"
    if binf.is_file():
        if not allow_pickle:
            raise LoraError(f"{binf}: pickled adapter weights can run code when loaded; convert them to "
                            "adapter_model.safetensors or pass allow_pickle=True if you trust the file")
        try:
            return torch.load(str(binf), map_location="cpu", weights_only=True)
        except Exception as e:   # noqa: BLE001 - any unpickling failure is a bad file
            raise LoraError(f"{binf}: cannot be loaded ({e})") from e
    raise LoraError(f"{folder}: neither adapter_model.safetensors nor adapter_model.bin found")


def _pattern_value(patterns: Optional[dict], module: str, default):
    """PEFT rank_pattern / alpha_pattern: the first key that, as a regex, matches the module name after a "."
    boundary (PEFT's rule: "(.*\\.)?(key)$"), e.g. "q_proj", "q_proj|v_proj", "layers\\.1\\.self_attn\\.q_proj"."""
    for key, v in (patterns or {}).items():
        try:
            hit = re.match(rf"(.*\.)?({key})$", module)
        except re.error as e:
            raise LoraError(f"adapter_config.json: pattern key {key!r} is not a valid regular expression "
                            f"({e})") from None
        if hit:
            return v
    return default


class LoraAdapter:
    """One loaded adapter: per-layer A/B factors; `merge()`/`unmerge()`; per job via mixes."""

    def __init__(self, manager: LoraManager, name: str, folder: Path, config: dict,
                 layers: dict[str, _LayerAdapter]):
        self.manager, self.name, self.folder, self.config = manager, name, folder, config
        self.layers = layers
        self.merged = False
        self.merge_report: dict[str, float] = {}     # layer -> relative weight error of the merge
        self._saved: dict[str, tuple] = {}

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def delta(self, module: str) -> torch.Tensor:
        """The float32 weight update of one layer in HF layout (out, in): scale * B @ A, in the layer's own channel
        order (QuantLinear.input_order / output_order: as the layer's dense_weight)."""
        ad = self.layers[module]
        return (ad.a_t @ ad.b_t).t() * ad.scale

    def activate(self, weight: float = 1.0) -> None:
        """Apply this adapter (alone) on the fly to every row of plain forward calls."""
        set_active(self.manager.model, {self.name: weight})

    @_jobs_frozen
    def merge(self, weight: float = 1.0) -> dict[str, float]:
        """Bake weight * delta into the base weights (every row then sees it). Quantized layers
        are dequantised, updated and re-quantized in their own layout; returns, per layer,
        ||W_new - (W + delta)|| / ||W + delta|| (0 for dense fp32 layers, up to rounding)."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise LoraError(f"merge: weight of adapter {self.name!r} must be a finite number, got {weight!r}")
        if self.merged:
            raise LoraError(f"adapter {self.name!r} is already merged")
        if self.name in self.manager.active:
            raise LoraError(f"adapter {self.name!r} is active on the fly; set_active(model, None) first")
        self.manager.check_unused(self.name, "merge")
        self.manager.check_no_jobs(f"merge adapter {self.name!r} (every row's weights change)")
        layers = dict(self.manager.model.linear_layers())
        report = {}
        for module in self.layers:
            layer = layers[module]
            d = self.delta(module).to(torch.float64) * weight
            if not bool(d.any()):
                # weight 0, or an all-zero A or B: nothing to add, so nothing to re-quantize (exactly a no-op)
                self._saved[module] = ("packed", layer.packed) if layer.is_quantized else ("dense", layer.w_t)
                report[module] = 0.0
                continue
            if layer.is_quantized:
                self._saved[module] = ("packed", layer.packed)
                target = layer.dense_weight(torch.float64) + d
                new = requantize_like(layer.packed, target.t(), module)
                layer.set_packed(new)
            else:
                self._saved[module] = ("dense", layer.w_t)
                target = layer.w_t.to(torch.float64).t() + d
                layer.w_t = target.t().to(layer.w_t.dtype).contiguous()
            got = layer.dense_weight(torch.float64)
            report[module] = float((got - target).norm() / target.norm().clamp_min(1e-30))
        from ..loader import share_input_perms   # q/k/v (gate/up) re-quantized alike share one permutation again
        share_input_perms(self.manager.model)
        self.merged = True
        self.manager.merged.append(self.name)
        self.manager.epoch += 1
        self.merge_report = report
        return report

    @_jobs_frozen
    def unmerge(self) -> None:
        """Restore the exact weights saved by merge(); merges are undone in reverse order (the weights this one saved
        hold the merges made before it, and restoring them under a later merge would drop that one's update)."""
        if not self.merged:
            raise LoraError(f"adapter {self.name!r} is not merged")
        stack = self.manager.merged
        if stack and stack[-1] != self.name:
            raise LoraError(f"adapter {self.name!r}: {stack[-1]!r} was merged after it; unmerge {stack[-1]!r} first "
                            "(merges are undone in reverse order)")
        self.manager.check_no_jobs(f"unmerge adapter {self.name!r} (every row's weights change)")
        layers = dict(self.manager.model.linear_layers())
        for module, (kind, saved) in self._saved.items():
            if kind == "packed":
                layers[module].set_packed(saved)
            else:
                layers[module].w_t = saved
        self._saved.clear()
        self.merged = False
        stack.pop()
        self.manager.epoch += 1

    @_jobs_frozen
    def unload(self) -> None:
        """Forget the adapter (unmerging it first). Refused while queued or running jobs use it; a no-op once
        unloaded."""
        if self.manager.adapters.get(self.name) is not self:
            return
        self.manager.check_unused(self.name, "unload")
        if self.merged:
            self.unmerge()
        m = self.manager
        m.set_active({k: w for k, w in m.active.items() if k != self.name}, f"unload active adapter {self.name!r}")
        layers = dict(m.model.linear_layers())
        for module in self.layers:
            hook = m.hooks[module]
            hook.adapters.pop(self.name, None)
            if not hook.adapters:       # a layer with an empty hook still left the fused CPU stack and TP refusing it
                if layers[module].lora is hook:
                    layers[module].lora = None
                del m.hooks[module]
        m.adapters.pop(self.name, None)
        m.epoch += 1     # a later adapter loaded under this name computes other K/V
        if not m.adapters and getattr(m.model, "_lora_manager", None) is m:
            # the last adapter gone: the model is the base model again (a manager keeps it off the CUDA graphs
            # and the fused CPU stack); the next manager's epochs go on from this one's
            m.model._lora_epoch = m.epoch
            del m.model._lora_manager

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, r={self.rank}, layers={len(self.layers)}, merged={self.merged})"


def load_lora(model, folder, name: Optional[str] = None, allow_pickle: bool = False) -> LoraAdapter:
    """Load a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) into `model`.

    The adapter is not applied until chosen: per job (`Job(..., loras={name: weight})`), for
    every row (`adapter.activate()` / `set_active`) or merged (`adapter.merge()`). Raises
    LoraError when a file is missing or pickled, a target module is absent from the model, or
    a factor's rank or shape does not fit the base model."""
    folder = Path(folder)
    if getattr(model, "tensor_parallel", None) is not None:   # its projections are column shards
        raise LoraError(f"{folder}: LoRA adapters are not supported on a tensor-parallel model")
    if not folder.is_dir():
        raise LoraError(f"{folder}: adapter folder not found")
    cfg = _read_config(folder)
    tensors = _read_tensors(folder, allow_pickle)
    name = name or folder.name
    # made only for an adapter that loads: a manager's mere existence keeps the model off CUDA graphs
    manager = lora_manager(model)
    if manager is not None and name in manager.adapters:
        raise LoraError(f"an adapter named {name!r} is already loaded; pass name=... or unload() it")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        mt = _KEY.match(key)
        if mt is None:
            raise LoraError(f"{folder}: tensor '{key}' is not a LoRA A/B weight (DoRA magnitudes, embedding "
                            "LoRA and trained biases are not supported)")
        ab = pairs.setdefault(mt["module"], {})
        if mt["ab"] in ab:            # e.g. q_proj.lora_A.weight beside q_proj.lora_A.default.weight
            raise LoraError(f"{folder}: {mt['module']} has more than one lora_{mt['ab']} weight (one adapter a "
                            "folder; the second is named by its key)")
        ab[mt["ab"]] = t
    if not pairs:
        raise LoraError(f"{folder}: the adapter holds no lora_A/lora_B weights")

    layers_by_name = dict(model.linear_layers())
    n_layers = model.config.num_hidden_layers
    r0, alpha0 = cfg["r"], cfg["lora_alpha"]
    out: dict[str, _LayerAdapter] = {}
    dev = model.device
    for module, ab in sorted(pairs.items()):
        where = f"{folder}: {module}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: lora_{'B' if 'A' in ab else 'A'}.weight is missing")
        layer = layers_by_name.get(module)
        if layer is None or module == "lm_head" or module.rsplit(".", 1)[-1] not in _PROJECTIONS:
            m = re.search(r"layers\.(\d+)\.", module)
            hint = (f" (the base model has {n_layers} layers: adapter made for a different model?)"
                    if m and int(m.group(1)) >= n_layers else "")
            raise LoraError(f"{where}: target module is not an attention/MLP projection of this model{hint}")
        a, b = ab["A"], ab["B"]
        r = int(_pattern_value(cfg.get("rank_pattern"), module, r0))
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha0))
        if a.dim() != 2 or b.dim() != 2:
            raise LoraError(f"{where}: lora_A/lora_B must be 2-D, got {list(a.shape)} and {list(b.shape)}")
        if a.shape[0] != r or b.shape[1] != r:
            raise LoraError(f"{where}: rank mismatch: adapter_config.json says r={r}, lora_A is {list(a.shape)} "
                            f"and lora_B is {list(b.shape)} (expected [{r}, in] and [out, {r}])")
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
            raise LoraError(f"{where}: shapes do not match the base model: lora_A {list(a.shape)}, lora_B "
                            f"{list(b.shape)} but the layer is {layer.in_features} -> {layer.out_features} "
                            "(adapter trained on a different base model?)")
        if not (a.is_floating_point() and b.is_floating_point()) or not (
                torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"{where}: lora_A/lora_B must be finite floating-point tensors")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        a_t, b_t = a.t(), b.t()
        if layer.input_order is not None:          # the layer's inputs / outputs were reordered at load
            a_t = a_t[layer.input_order]
        if layer.output_order is not None:
            b_t = b_t[:, layer.output_order]
        out[module] = _LayerAdapter(a_t.to(dev, torch.float32).contiguous(), b_t.to(dev, torch.float32).contiguous(),
                                    scale)

    manager = lora_manager(model, create=True)
    adapter = LoraAdapter(manager, name, folder, cfg, out)
    for module, lad in out.items():
        manager.hook_for(module, layers_by_name[module]).adapters[name] = lad
    manager.adapters[name] = adapter
    return adapter


__all__ = ["LoraAdapter", "LoraHook", "LoraManager", "check_job_loras", "load_lora", "lora_manager", "lora_rows",
           "requantize_like", "row_plan", "set_active", "set_row_plan"]
