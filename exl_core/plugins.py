"""Plugin discovery over pluggy: integrations (HF, LangChain, LlamaIndex), formats, architectures, metrics.

A plugin is any installed distribution that declares an entry point in the group ``exl_core``::

    [project.entry-points.exl_core]
    hf = "exl_core_hf.plugin"          # a module (or object) holding @hookimpl functions

`get_plugin_manager()` builds one `pluggy.PluginManager` the first time it is asked for (never
at ``import exl_core``), loading every entry point on its own so that one broken plugin costs a
warning that names it, not the import of exl_core. `activate_plugins()` runs each plugin's
`exl_core_activate` hook once per process (the HF plugin registers its transformers quantizer
there); `list_plugins()` describes what was found.

Hook implementations run one plugin at a time through `_call_each`, again so a failing plugin
is reported and skipped while the others still run. Format and architecture hooks feed
`exl_core.formats.base.register_format` / `exl_core.config.register_architecture` on activation.

The second half of this module, `shared_engine()`, is the native runtime the adapters sit on:
one loaded model + Generator per folder, driven by a worker thread (see the diagram there).
"""
from __future__ import annotations

import atexit
import functools
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import pluggy

PROJECT = "exl_core"          # pluggy project name == entry-point group
ENTRY_POINT_GROUP = PROJECT
DISABLE_ENV = "EXL_CORE_NO_PLUGINS"   # "1": activate_plugins() does nothing (debug switch)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)   # plugins decorate their hooks with this


class PluginWarning(UserWarning):
    """A plugin failed to load or one of its hooks raised; exl_core carried on without it."""


class ExlCoreSpec:
    """Hook specifications. Every hook is optional for a plugin; names carry the project prefix."""

    # -- integrations -------------------------------------------------------------------------
    @hookspec
    def exl_core_register_integration(self) -> dict:
        """Describe the integration: ``{"name": str, "version": str, "kind": str}``.

        ``kind`` is free text such as ``"transformers-quantizer"``, ``"langchain"`` or
        ``"llamaindex"``. Shown by `list_plugins()` and ``exl plugins``."""

    @hookspec
    def exl_core_activate(self) -> None:
        """Do process-wide registrations (e.g. a transformers quantizer). Called at most once per
        process by `activate_plugins()`; must be idempotent and cheap (defer heavy imports)."""

    # -- extension points for other layers (declared now so plugins can target a stable name) --
    @hookspec
    def exl_core_register_formats(self) -> list:
        """Return quantized-weight formats to add to ``exl_core.formats.base.FORMATS``: objects
        following ``exl_core.formats.base.QuantFormat`` (name, tensor_suffixes, detect,
        has_layer, load_layer -> PackedWeight). Registered by `activate_plugins()`."""

    @hookspec
    def exl_core_register_architectures(self) -> list:
        """Return ``exl_core.config.ArchSpec`` objects for further Llama-compatible HF
        architectures (keyed by their HF class name). Registered by `activate_plugins()`."""

    @hookspec
    def exl_core_register_metrics(self) -> dict:
        """Return ``{metric_name: fn}`` for ``exl eval``; ``fn(model, tokenizer, **options) -> float``.
        Read on demand with ``collect("exl_core_register_metrics")``."""


# hook name -> (module, function) receiving each returned item; imported only when a plugin
# implements the hook, so plain `import exl_core` never imports torch through here.
_REGISTRIES = {
    "exl_core_register_formats": ("exl_core.formats.base", "register_format"),
    "exl_core_register_architectures": ("exl_core.config", "register_architecture"),
}


_lock = threading.RLock()
_pm: Optional[pluggy.PluginManager] = None
_dists: dict[str, dict] = {}      # plugin name -> {"distribution", "version", "entry_point"}
_errors: dict[str, str] = {}      # plugin name -> error text (load or hook failures)
_activated = False
_activated_names: list[str] = []


def _warn(plugin: str, what: str, exc: BaseException) -> None:
    msg = f"exl_core plugin {plugin!r} {what}: {type(exc).__name__}: {exc}"
    _errors[plugin] = msg
    warnings.warn(msg, PluginWarning, stacklevel=3)


def _entry_points():
    from importlib.metadata import entry_points
    return sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Like `pm.load_setuptools_entrypoints(group)` but one failure does not stop the others."""
    for ep in _entry_points():
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        dist = getattr(ep, "dist", None)
        info = {"distribution": dist.metadata["Name"] if dist is not None else None,
                "version": dist.version if dist is not None else None,
                "entry_point": ep.value}
        _dists[ep.name] = info
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not break `import exl_core`
            _warn(ep.name, f"(entry point {ep.value!r}) failed to load", exc)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager; created (and entry points loaded) on first call."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(ExlCoreSpec)
            _load_entry_points(pm)
            _pm = pm
        return _pm


def _call_each(hook_name: str, **kwargs) -> list[tuple[str, Any]]:
    """Call `hook_name` on every plugin separately: [(plugin_name, result)] for those that did not fail.

    pluggy's own hook call stops at the first exception; here a failure is a warning naming the
    plugin, and the remaining plugins still run."""
    pm = get_plugin_manager()
    out = []
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):  # registration order
        name = impl.plugin_name
        try:
            res = impl.function(*[kwargs[a] for a in impl.argnames])
        except Exception as exc:
            _warn(name, f"hook {hook_name} raised", exc)
            continue
        if res is not None:
            out.append((name, res))
    return out


def activate_plugins() -> list[str]:
    """Run every plugin's `exl_core_activate` once per process; returns the names activated
    (by this call or the first one: `import exl_core` already activates).

    Cheap when no plugin is installed (one entry-point scan). Safe to call repeatedly and from
    several threads. Intended call site: the end of ``exl_core/__init__.py``. Set
    EXL_CORE_NO_PLUGINS=1 to skip activation entirely."""
    global _activated
    with _lock:
        if _activated:
            return list(_activated_names)
        _activated = True
        if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            return []          # debug switch: run exl_core with no third-party code at all
        pm = get_plugin_manager()
        names = []
        for impl in reversed(pm.hook.exl_core_activate.get_hookimpls()):
            try:
                impl.function()
                names.append(impl.plugin_name)
                _activated_names.append(impl.plugin_name)
            except Exception as exc:
                _warn(impl.plugin_name, "hook exl_core_activate raised", exc)
        _apply_registries(pm)
        return names


def _apply_registries(pm: pluggy.PluginManager, only: Optional[str] = None) -> None:
    """Hand the items of the format/architecture hooks to their registries (per plugin, isolated)."""
    import importlib
    for hook_name, (mod_name, fn_name) in _REGISTRIES.items():
        impls = [i for i in getattr(pm.hook, hook_name).get_hookimpls() if only is None or i.plugin_name == only]
        if not impls:
            continue
        register = getattr(importlib.import_module(mod_name), fn_name)
        for impl in reversed(impls):
            try:
                for item in impl.function() or ():
                    register(item)
            except Exception as exc:
                _warn(impl.plugin_name, f"hook {hook_name} raised", exc)


def list_plugins() -> list[dict]:
    """One dict per discovered plugin, sorted by name::

        {"name", "distribution", "version", "entry_point", "integration": {name, version, kind} | None,
         "hooks": [hook names it implements], "error": str | None}
    """
    pm = get_plugin_manager()
    integrations = dict(_call_each("exl_core_register_integration"))
    rows = []
    names = set(_dists) | {n for n, _ in pm.list_name_plugin()}
    for name in sorted(names):
        plugin = pm.get_plugin(name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin)) if plugin is not None else []
        info = _dists.get(name, {})
        integ = integrations.get(name)
        rows.append({"name": name,
                     "distribution": info.get("distribution"),
                     "version": info.get("version") or (integ or {}).get("version"),
                     "entry_point": info.get("entry_point"),
                     "integration": integ,
                     "hooks": hooks,
                     "error": _errors.get(name)})
    return rows


def register_plugin(plugin: object, name: Optional[str] = None) -> str:
    """Register an in-process plugin object (tests, notebooks); returns its name. If plugins were
    already activated, its `exl_core_activate` runs now so late registrations still take effect."""
    pm = get_plugin_manager()
    with _lock:
        name = pm.register(plugin, name=name)
        if _activated:
            fn: Optional[Callable] = getattr(plugin, "exl_core_activate", None)
            if fn is not None:
                try:
                    fn()
                except Exception as exc:
                    _warn(name, "hook exl_core_activate raised", exc)
            _apply_registries(pm, only=name)
        return name


def collect(hook_name: str) -> dict:
    """Merge the dict (or list) results of a registry hook such as ``exl_core_register_metrics``
    over all plugins: dicts are merged (later plugins cannot silently override: a clash warns),
    lists concatenated into ``{plugin_name: [items]}``."""
    merged: dict = {}
    for name, res in _call_each(hook_name):
        if isinstance(res, dict):
            for k, v in res.items():
                if k in merged:
                    warnings.warn(f"exl_core plugin {name!r}: {hook_name} entry {k!r} already provided; "
                                  f"keeping the first", PluginWarning, stacklevel=2)
                    continue
                merged[k] = v
        else:
            merged[name] = list(res)
    return merged


# ---- shared native engines for the adapters ----------------------------------------------------
#
# The LangChain and LlamaIndex adapters (and anything else living above the generator) share
# one loaded model per folder. A `SharedEngine` owns the model, cache and Generator and runs
# them on one worker thread; callers submit `Job`s and read their `JobResult`s from a queue,
# so concurrent callers (LangChain batch(), asyncio tasks) are batched by the Generator
# instead of taking turns behind a lock.
#
#   caller thread(s) ──attach sink, gen.enqueue(job), wake──► worker: while has_work: step
#        ▲                      cancels (inbox) ──►                   │ the generator's routing
#        └───────────── per-job queue ◄───────────────────────────────┘
#
# Async callers enqueue from an executor thread: enqueue takes the generator's lock, which the worker holds for a
# whole step. Cancels go through the generator's inbox, drained at the end of the running step, so no caller waits
# on a step to leave.

_engines: dict[tuple, "SharedEngine"] = {}
_live_engines: "weakref.WeakSet[SharedEngine]" = weakref.WeakSet()   # closed at exit (atexit below)


class SharedEngine:
    """One model folder loaded once; `stream(job)` / `astream(job)` yield that job's JobResults."""

    def __init__(self, path, device: str = "cpu", dtype=None, cache_tokens: int = 8192, *,
                 model=None, tokenizer=None):
        import exl_core
        self.path = path
        if model is None:
            model, tokenizer = exl_core.load_model(path, device=device, dtype=dtype)
        self.model, self.tokenizer = model, tokenizer     # model/tokenizer given: an already loaded pair
        self.cache = exl_core.Cache(self.model, max_tokens=cache_tokens)
        self.generator = exl_core.Generator(self.model, self.cache, self.tokenizer)
        self.name = _model_name(path)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        _live_engines.add(self)

    # -- worker ----------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                # daemon, but joined at exit (close_engines): a daemon thread still inside torch when the interpreter
                # tears down aborts the process
                self._thread = threading.Thread(target=SharedEngine._work, args=(weakref.ref(self),),
                                                name=f"exl-engine:{self.name}", daemon=True)
                self._thread.start()

    @staticmethod
    def _work(ref) -> None:
        """The worker loop. It holds its engine by a weak reference while idle, so a released engine (and its model
        and cache) is freed; close() stops it."""
        while True:
            eng = ref()
            if eng is None:
                return
            wake, stop = eng._wake, eng._stop
            del eng
            while not wake.wait(1.0) and not stop.is_set():
                if ref() is None:
                    return
            wake.clear()                # cleared before has_work(): a later enqueue sets it again
            eng = ref()
            if eng is None:
                return
            if not stop.is_set():
                eng._run_steps()        # returns early once stop is set
            if stop.is_set():
                with eng._start_lock:   # a job enqueued from now on starts a new worker (_ensure_worker)
                    eng._cancel_all()
                    if eng._thread is threading.current_thread():
                        eng._thread = None
                return
            del eng

    def _run_steps(self) -> None:
        gen = self.generator
        while True:
            gen._drain_cancels_now()                # jobs callers gave up on while a step ran
            if self._stop.is_set() or not gen._has_jobs():
                return
            # results and a step's errors reach each job's caller through its sink (Generator routing): an error
            # that ended jobs (a token filter, a sampler) only theirs; one that ended none (a model/kernel failure)
            # every caller of a running job, and those jobs are cancelled
            gen._step_routed()      # a failed forward's callers heard it, their jobs ended (routing.py)

    def _cancel_all(self) -> None:
        for job in self.generator.pending_jobs():
            self.generator._cancel_quiet(job)   # frees its pages; its caller gets the cancelled result first

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker after its current step, cancelling the jobs left (their callers get cancelled results);
        the engine starts a new worker if used again."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # -- submitting --------------------------------------------------------------------------------
    def _submit(self, job, sink) -> None:
        """sink(x) gets each JobResult (the last one carries finish_reason) or an exception, on the worker's thread
        (it must not block). Bad jobs (prompt too long, bad sampler) raise here, in the caller's thread."""
        gen = self.generator
        gen._attach(job, sink)
        try:
            gen.enqueue(job)    # the generator locks its queues itself
        except BaseException:
            gen._detach(job, sink)
            raise
        self._start()

    def _start(self) -> None:
        """A job was queued: the worker runs (started if it is not) and wakes."""
        self._ensure_worker()
        self._wake.set()

    def _cancel(self, job) -> None:
        """Give up on a job without waiting for the running step (that step's end cancels it)."""
        self.generator._cancel_soon(job)
        self._wake.set()

    def stream(self, job):
        """Blocking iterator over the JobResults of `job` (ends with the one carrying finish_reason).
        Leaving the loop early cancels the job."""
        import queue
        q: "queue.Queue" = queue.Queue()
        sink = q.put
        self._submit(job, sink)
        ended = [False]
        try:
            while not ended[0]:
                yield self._take(q.get(), ended)
        finally:
            self.generator._detach(job, sink)
            if not ended[0]:
                self._cancel(job)

    async def astream(self, job):
        """Async iterator over the JobResults of `job`; the event loop never blocks on the model (the enqueue, which
        may wait for a running step, runs in a thread then: Generator._enqueue_nowait)."""
        import asyncio

        from .generation.async_consumers import LoopSink
        gen = self.generator
        q: "asyncio.Queue" = asyncio.Queue()
        sink = LoopSink(asyncio.get_running_loop(), q)
        gen._attach(job, sink)
        try:
            await gen._enqueue_nowait(job)      # a task cancelled meanwhile leaves no job running
        except BaseException:
            gen._detach(job, sink)
            raise
        self._start()
        ended = [False]
        try:
            while not ended[0]:
                yield self._take(await q.get(), ended)
        finally:
            self.generator._detach(job, sink)
            if not ended[0]:
                self._cancel(job)

    @staticmethod
    def _take(item, ended: list):
        """One queue item of stream/astream: the JobResult, or the worker's exception raised.
        ended[0] becomes True on the last result or an error (nothing left to cancel then)."""
        ended[0] = isinstance(item, BaseException) or item.finish_reason is not None
        if isinstance(item, BaseException):
            try:
                raise item
            finally:
                del item        # no cycle through this frame
        return item

    def run(self, jobs) -> list:
        """Run several jobs together (one batch for the Generator); returns their final texts. A job refused at
        submission (or an error) cancels the ones already submitted before it is raised."""
        import queue
        q: "queue.Queue" = queue.Queue()
        texts: list[list[str]] = [[] for _ in jobs]          # by position: identifiers need not be unique
        submitted = []
        try:
            for i, j in enumerate(jobs):
                sink = functools.partial(_put_tagged, q, i)
                self._submit(j, sink)
                submitted.append((j, sink))
            left = len(jobs)
            while left:
                i, item = q.get()
                if isinstance(item, BaseException):
                    try:
                        raise item
                    finally:
                        del item    # no cycle through this frame
                texts[i].append(item.text)
                if item.finish_reason is not None:
                    left -= 1
        except BaseException:
            for j, _ in submitted:
                if not j.done:
                    self._cancel(j)
            raise
        finally:
            for j, sink in submitted:
                self.generator._detach(j, sink)
        return ["".join(t) for t in texts]


def _put_tagged(q, i, item) -> None:
    q.put((i, item))


def _model_name(path) -> str:
    from pathlib import Path
    p = Path(path)
    return p.name or str(p)


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
                "bfloat16": "bfloat16", "bf16": "bfloat16"}


def dtype_setting(value, owner: str):
    """An adapter's dtype setting (a name such as "float16" / "fp16" / "bf16", a torch dtype, or None for
    exl_core's choice) as a torch dtype; an InputError naming the setting for anything else."""
    import torch
    if value is None or value == "" or isinstance(value, torch.dtype):
        return value or None
    name = _DTYPE_NAMES.get(str(value).lower().removeprefix("torch."))
    if name is None:
        from .errors import InputError
        raise InputError(f"{owner}: dtype={value!r} is not supported; use float16, bfloat16 or float32 (or None)")
    return getattr(torch, name)


def stop_strings(*groups, owner: str) -> Optional[list]:
    """Stop strings merged from settings and a call (each None, one string or a list of strings), duplicates
    dropped in order; None when there are none. A lone string is one stop, not its characters."""
    out: list = []
    for g in groups:
        items = [g] if isinstance(g, str) else list(g or [])
        if not all(isinstance(x, str) for x in items):
            from .errors import InputError
            raise InputError(f"{owner}: stop must be a string or a list of strings, got {g!r}")
        out.extend(items)
    return list(dict.fromkeys(out)) or None


def call_max_tokens(kwargs: dict, keys: tuple, default: int, owner: str, setting: str) -> int:
    """A call's new-token limit, popped from kwargs under `keys` (the last given wins; None: `default`, the
    instance's `setting`). No int(): 2.9 was cut to 2 and True counted as 1."""
    from .errors import InputError, is_int
    out = default
    for key in keys:
        v = kwargs.pop(key, None)
        if v is not None:
            if not is_int(v) or v < 1:
                raise InputError(f"{owner}: {key}={v!r} must be an int >= 1 (or None: the instance's {setting})")
            out = v
    return out


def shared_engine(path, device: str = "cpu", dtype=None, cache_tokens: int = 8192) -> SharedEngine:
    """The process-wide engine for a model folder (loaded on first request, then reused by every
    adapter instance pointing at the same folder, device, dtype and cache size)."""
    from pathlib import Path
    key = (str(Path(path).expanduser().resolve()), str(device), str(dtype), int(cache_tokens))
    with _lock:
        eng = _engines.get(key)
        if eng is None:
            # another cache size of the same model reuses its weights
            twin = next((e for k, e in _engines.items() if k[:3] == key[:3]), None)
            eng = SharedEngine(Path(key[0]), device=device, dtype=dtype, cache_tokens=cache_tokens,
                               model=twin.model if twin else None, tokenizer=twin.tokenizer if twin else None)
            _engines[key] = eng
        return eng


def release_engines() -> None:
    """Forget every shared engine and stop its worker (their models are freed once no adapter references them)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.close()


@atexit.register
def close_engines() -> None:
    """Stops every engine's worker before the interpreter tears down (a worker left inside torch aborts the
    process at exit)."""
    for eng in list(_live_engines):
        eng.close(timeout=10.0)


def _reset_for_tests() -> None:
    """Forget the manager and activation state (tests only)."""
    global _pm, _activated
    with _lock:
        _pm = None
        _activated = False
        _dists.clear()
        _errors.clear()
        _activated_names.clear()
