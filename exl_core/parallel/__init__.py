"""Tensor parallelism over torch.distributed (see tensor_parallel.py)."""
from .tensor_parallel import TPGroup, init_tensor_parallel, load_model_tp, shard_model

__all__ = ["TPGroup", "init_tensor_parallel", "load_model_tp", "shard_model"]
