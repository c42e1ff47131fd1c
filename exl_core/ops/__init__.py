from . import cuda_candidates  # noqa: E402,F401  (puts a `cuda` candidate first in each dispatcher)
from . import cuda_norm_fold  # noqa: E402,F401  (and in norm_fold's)
from . import cuda_swiglu  # noqa: E402,F401  (and in swiglu's)
from . import cuda_norm_perm  # noqa: E402,F401  (and in norm_perm's)
from .attention_gathered import register as _register_gathered  # noqa: E402

_register_gathered()   # paged attention without host syncs where no paged kernel serves (CUDA)
