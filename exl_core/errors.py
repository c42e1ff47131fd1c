"""One exception family for everything exl_core refuses: messages name the file/tensor and the fix."""


class ExlError(Exception):
    """Base class of every error exl_core raises on purpose."""


class ConfigError(ExlError):
    """config.json (or another configuration) is missing, unreadable or has invalid keys."""


class FormatError(ExlError):
    """A weight file is corrupt, truncated, of an unknown layout or does not match the config."""


class TokenizerError(ExlError):
    """The tokenizer files are missing or unusable."""


class CacheFullError(ExlError):
    """A request can never fit in the KV cache."""


class SamplerError(ExlError, ValueError):
    """Invalid sampler settings."""


class InputError(ExlError, ValueError):
    """Invalid user input (empty prompt, bad arguments)."""


class KernelError(ExlError):
    """No kernel candidate can serve the arguments (the message lists every refusal)."""


class LoraError(ExlError):
    """A LoRA adapter does not fit the model or is stored unsafely."""


def is_bool(v) -> bool:
    """A flag argument as these checks take it: bool or numpy's bool scalar (not "no", which is truthy, nor 1)."""
    return isinstance(v, bool) or (getattr(getattr(v, "dtype", None), "kind", None) == "b"
                                   and getattr(v, "ndim", 1) == 0)


def is_int(v) -> bool:
    """An integer argument as the checks behind these errors take it: int or numpy's integers, not bool."""
    if type(v) is int:
        return True
    import numbers
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
