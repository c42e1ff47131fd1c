"""exl_core plugin hooks of exl-core-hf. Importing this module must stay cheap: no transformers.

`exl_core_activate` registers the quantizer right away when transformers' quantizer registry
is already imported; otherwise it arms a one-shot import hook that registers the moment
`transformers.quantizers.auto` finishes importing. So `import exl_core` never pays for
importing transformers, yet `AutoModelForCausalLM.from_pretrained(exl2_folder)` works after it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings

from exl_core.plugins import PluginWarning, hookimpl

TARGET = "transformers.quantizers.auto"
_lock = threading.Lock()
_armed = None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("exl-core-hf")
    except PackageNotFoundError:
        return "0+unknown"


_pending = False


def take_pending() -> bool:
    """True once if a registration was deferred to the end of `quantizer`'s own import."""
    global _pending
    pending, _pending = _pending, False
    return pending


def _register_now() -> None:
    global _pending
    mod = sys.modules.get("exl_core_hf.quantizer")
    if mod is not None and not hasattr(mod, "register"):
        # transformers is being imported *by* our quantizer module: it registers when it is done
        _pending = True
        return
    try:
        from .quantizer import register
        register()
    except Exception as exc:  # never break the import of transformers itself
        warnings.warn(f"exl_core plugin 'hf' (exl-core-hf) could not register the exl2 quantizer with "
                      f"transformers: {type(exc).__name__}: {exc}", PluginWarning, stacklevel=2)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the registration."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _register_now()


class _PostImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        _disarm()          # one shot; also keeps find_spec below from recursing into us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def _disarm() -> None:
    global _armed
    with _lock:
        if _armed is not None and _armed in sys.meta_path:
            sys.meta_path.remove(_armed)
        _armed = None


def ensure_registered() -> None:
    """Register now if transformers' registry is loaded, else when it gets imported."""
    global _armed
    if TARGET in sys.modules:
        _register_now()
        return
    with _lock:
        if _armed is None:
            _armed = _PostImportHook()
            sys.meta_path.insert(0, _armed)


@hookimpl
def exl_core_register_integration() -> dict:
    return {"name": "hf", "version": _version(), "kind": "transformers-quantizer (exl2, gptq opt-in)"}


@hookimpl
def exl_core_activate() -> None:
    ensure_registered()
