from . import cuda_candidates  # noqa: E402,F401  (puts a `cuda` candidate first in each dispatcher)
from .attention_gathered import register as _register_gathered  # noqa: E402

_register_gathered()   # paged attention without host syncs where no paged kernel serves (CUDA)
