from . import cuda_candidates  # noqa: E402,F401  (puts a `cuda` candidate first in each dispatcher)
