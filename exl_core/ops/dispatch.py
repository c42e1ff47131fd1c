"""Kernel selection: an ordered list of candidates, each able to refuse with a reason.

Every op in `exl_core.ops` declares its candidates in priority order (CUDA → CPU C++ →
torch reference). `select(op, **args)` returns the first candidate whose `can_implement`
accepts; when none does, KernelError lists every refusal. A debug switch lets a user force or
disable candidates (read here and nowhere else):

    EXL_CORE_FORCE_KERNEL="qmatmul=torch_ref,attention=cpu"   # force per op
    EXL_CORE_DISABLE_KERNEL="cpu_fused"                       # never use these
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import KernelError


@dataclass(frozen=True)
class Candidate:
    """One implementation of an op. `check(**args)` returns None when it can serve, else a reason."""
    name: str
    check: Callable[..., Optional[str]]
    run: Callable[..., Any]


def _parse_env(var: str) -> dict[str, str] | set[str]:
    raw = os.environ.get(var, "").strip()
    if not raw:
        return {} if var.endswith("FORCE_KERNEL") else set()
    if var.endswith("FORCE_KERNEL"):
        return dict(item.split("=", 1) for item in raw.split(",") if "=" in item)
    return {s.strip() for s in raw.split(",") if s.strip()}


_FORCED: dict[str, str] = _parse_env("EXL_CORE_FORCE_KERNEL")  # type: ignore[assignment]
_DISABLED: set[str] = _parse_env("EXL_CORE_DISABLE_KERNEL")  # type: ignore[assignment]


class Dispatcher:
    """Holds the candidates of one op and picks one per call.

    `key(**args)`, when given, must return a hashable summary of everything the candidates'
    checks read (devices, dtypes, contiguity, None-ness): calls with an equal key reuse the
    first choice instead of re-running every check (decode makes ~10^4 small calls per second,
    where the checks cost as much as the kernel). Ops whose checks read shapes or values pass
    no key.
    """

    def __init__(self, op: str, candidates: list[Candidate], key: Optional[Callable[..., Any]] = None):
        self.op = op
        self.candidates = list(candidates)
        self.key = key
        self._chosen: dict[Any, Candidate] = {}
        self._state: tuple = ()

    def reasons(self, **args) -> list[tuple[str, Optional[str]]]:
        """(name, refusal reason or None) for every candidate, in priority order."""
        out = []
        for c in self.candidates:
            if c.name in _DISABLED:
                out.append((c.name, "disabled by EXL_CORE_DISABLE_KERNEL"))
                continue
            forced = _FORCED.get(self.op)
            if forced is not None and forced != c.name:
                out.append((c.name, f"EXL_CORE_FORCE_KERNEL selects {forced!r}"))
                continue
            out.append((c.name, c.check(**args)))
        return out

    def select(self, **args) -> Candidate:
        for c in self.candidates:
            if c.name in _DISABLED:
                continue
            forced = _FORCED.get(self.op)
            if forced is not None and forced != c.name:
                continue
            if c.check(**args) is None:
                return c
        detail = "; ".join(f"{n}: {r}" for n, r in self.reasons(**args))
        raise KernelError(f"no kernel for {self.op}: {detail}")

    def choose(self, **args) -> Candidate:
        """The candidate a call with these arguments runs: `select`, cached by `key` when there is one."""
        if self.key is None:
            return self.select(**args)
        # the cached choices hold only while the candidate list and the force/disable settings do
        state = (tuple(map(id, self.candidates)), _FORCED.get(self.op), frozenset(_DISABLED))
        if state != self._state:
            self._chosen.clear()
            self._state = state
        k = self.key(**args)
        c = self._chosen.get(k)
        if c is None:
            c = self._chosen[k] = self.select(**args)
        return c

    def __call__(self, **args):
        return self.choose(**args).run(**args)


def extension():
    """The compiled extension module, or None when it is not built (pure-torch fallbacks then)."""
    global _EXT, _EXT_ERR
    if _EXT is None and _EXT_ERR is None:
        try:
            from .. import _C  # noqa: F401  (registers torch.ops.exl_core.*)
            _EXT = _C
        except ImportError as e:  # not built: reference kernels still work
            _EXT_ERR = str(e)
    return _EXT


def extension_error() -> Optional[str]:
    extension()
    return _EXT_ERR


_EXT = None
_EXT_ERR: Optional[str] = None


def has_op(name: str) -> bool:
    """True when torch.ops.exl_core.<name> exists (extension built with that kernel)."""
    import torch
    if extension() is None:
        return False
    return hasattr(torch.ops.exl_core, name)


@functools.lru_cache(maxsize=None)        # the extension is fixed once imported; asked on every call
def has_cuda_kernel(name: str) -> bool:
    """True when torch.ops.exl_core.<name> has a CUDA kernel (the extension was built with CUDA sources)."""
    import torch
    return has_op(name) and torch._C._dispatch_has_kernel_for_dispatch_key(f"exl_core::{name}", "CUDA")
