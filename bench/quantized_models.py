"""Quantized SmolLM2 variants for benchmarks, made once and cached under $EXL_CORE_HOME/bench.

GPTQ 4-bit g128 and EXL2 4.0 bpw. Uses the converter (`exl_core.quantize.convert`) when it is
available, else the round-to-nearest quantiser; the folder name says which.
"""
from __future__ import annotations

from pathlib import Path

from exl_core.default_model import default_dense_path, exl_home


def quantized_smollm2(fmt: str) -> Path:
    from exl_core.quantize.rtn import quantize_model_rtn
    out = exl_home() / "bench" / f"smollm2-135m-{fmt}-4bit-rtn"
    if (out / "config.json").exists():
        return out
    kw = dict(bits=4, group_size=128) if fmt == "gptq" else dict(bits=4, group_size=32)
    quantize_model_rtn(default_dense_path(), out, fmt=fmt, **kw)
    return out
