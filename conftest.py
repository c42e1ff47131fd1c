"""Repository-wide test settings: no test may reach the network (tests/ and adapters/*/tests)."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LANGSMITH_TRACING", "false")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    from exl_core.testing import refuse_network
    refuse_network(monkeypatch)
