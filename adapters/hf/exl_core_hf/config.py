"""The `exl2` quantization config for transformers, and the one place the GPTQ routing switch is read.

Imports only what `transformers.quantizers.auto` itself has already imported, so registering
from inside that module's import (see `plugin.py`) cannot recurse.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Optional

from transformers.utils.quantization_config import QuantizationConfigMixin

EXL2_METHOD = "exl2"
GPTQ_ENV = "EXL_CORE_HF_GPTQ"          # "1": from_pretrained runs GPTQ checkpoints on exl_core kernels

_gptq_override: Optional[bool] = None  # set_gptq_routing() wins over the environment


def set_gptq_routing(enabled: Optional[bool]) -> None:
    """Route `quant_method: gptq` checkpoints to exl_core (True), to transformers' own GPTQ path
    (False), or follow the EXL_CORE_HF_GPTQ environment variable (None, the default)."""
    global _gptq_override
    _gptq_override = enabled


def gptq_routing_enabled() -> bool:
    """Read at each from_pretrained call, so tests and users can flip it at run time."""
    if _gptq_override is not None:
        return _gptq_override
    return os.environ.get(GPTQ_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


# Keys that steer loading in this process and are not part of the checkpoint's description.
_RUNTIME_KEYS = ("modules_to_not_convert",)


class ExlQuantConfig(QuantizationConfigMixin):
    """`quantization_config` of an EXL2 folder (``{"quant_method": "exl2", "bits": ..., ...}``).

    Every key of the checkpoint's dict is kept as-is so `save_pretrained` writes back the same
    `quantization_config`. Extra loading options:

    - ``modules_to_not_convert``: module names (prefixes) left as they are in the HF model; also taken from
      ``from_pretrained(quantization_config=...)``. Naming one the checkpoint stores quantized is a FormatError.
    """

    def __init__(self, bits: Optional[float] = None, modules_to_not_convert: Optional[list] = None,
                 **kwargs: Any):
        self.quant_method = EXL2_METHOD
        kwargs.pop("quant_method", None)
        self.bits = bits
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self._extra = copy.deepcopy(kwargs)   # version, head_bits, calibration, ... verbatim
        for k, v in kwargs.items():
            setattr(self, k, v)

    def to_dict(self) -> dict[str, Any]:
        d = {"quant_method": EXL2_METHOD}
        if self.bits is not None:
            d["bits"] = self.bits
        d.update(copy.deepcopy(self._extra))
        return d

    def __iter__(self):
        yield from self.to_dict().items()

    def get_loading_attributes(self) -> dict:
        return {k: getattr(self, k) for k in _RUNTIME_KEYS}
