"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs).

Every rank holds a slice of the OUTPUT columns of every projection and runs the same
program (SPMD): the same forward calls, the same generator, the same seeds; the model's
logits are bit-identical on all ranks, so every rank samples the same tokens.

Why column slices only (no Megatron row-parallel o_proj/down_proj): a packed weight keeps N
as its last axis (formats/packed.py), so a column slice is exact for every format, bit mix,
group size and act-order permutation, whereas a row (K) slice would have to cut through
groups and through the permutation. The price is an all-gather of the input of o_proj and
down_proj instead of one all-reduce of their output; both are activations of T tokens
(small in decode), and each column is computed by the very kernel arithmetic of the
unsharded model, so results equal the single-process model bit for bit.

Per decoder block: q/k/v sliced by heads (KV heads included, so each rank's cache holds only
its heads), attention on the local heads, all-gather (heads) -> o_proj columns -> all-gather
(hidden); gate/up columns -> silu·mul -> all-gather (intermediate) -> down columns ->
all-gather (hidden). The head is sliced by vocabulary and gathered.

    torchrun --nproc-per-node 2 script.py       # in script.py:
        model, tok = load_model_tp(FOLDER)      # inits the process group from the env
"""
from __future__ import annotations

import atexit
import dataclasses
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InputError
from ..model.linear import QuantLinear


@dataclasses.dataclass
class TPGroup:
    rank: int
    world: int
    group: Optional[object] = None   # a torch.distributed ProcessGroup, None = the default one

    @classmethod
    def current(cls, group=None) -> "TPGroup":
        if not dist.is_available() or not dist.is_initialized():
            raise InputError("tensor parallel: torch.distributed is not initialised "
                             "(call init_tensor_parallel() or dist.init_process_group first)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def shared_seed(self) -> int:
        """A seed drawn by rank 0 (from torch's global generator there) and handed to every rank: jobs without a
        seed of their own sample from it, so ranks whose global generators drifted apart still pick the same tokens
        (different tokens would feed the ranks different histories, and the gathered activations mix them)."""
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(self._device())
        dist.broadcast(seed, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                       group=self.group)
        return int(seed.item())

    def agreed_min(self, value: int) -> int:
        """The smallest of every rank's value, on every rank: a size each rank measured for itself (a cache sized
        from its own free memory) must be the same on all of them, or they admit different jobs and their
        collectives stop matching."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: the current GPU)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def gather_columns(self, y: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world * n], rank r's block at columns r*n:(r+1)*n."""
        if self.world == 1:
            return y
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)


def slice_columns(layer: QuantLinear, cols: torch.Tensor) -> QuantLinear:
    """A new QuantLinear computing only output columns `cols` (int64 indices) of `layer`."""
    if layer.lora is not None:
        raise InputError("tensor parallel: LoRA adapters are not supported on a tensor-parallel model (the model "
                         "has adapters loaded; load it without them)")
    return layer.with_columns(cols)


class ColumnShard(nn.Module):
    """A column slice of a projection; optionally gathers its input and/or its output."""

    def __init__(self, inner: QuantLinear, tp: TPGroup, gather_input: bool, gather_output: bool,
                 out_features: Optional[int] = None):
        super().__init__()
        self.inner, self.tp = inner, tp
        self.gather_input, self.gather_output = gather_input, gather_output
        self.out_features = out_features        # full width after the gather (drops head padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = self.tp.gather_columns(x)
        y = self.inner(x)
        if self.gather_output:
            y = self.tp.gather_columns(y)
            if self.out_features is not None and y.shape[-1] != self.out_features:
                y = y[..., :self.out_features]
        return y


def _block_cols(n: int, rank: int, world: int, what: str) -> torch.Tensor:
    if n % world:
        raise InputError(f"tensor parallel: {what} ({n}) is not divisible by the number of ranks ({world})")
    per = n // world
    return torch.arange(rank * per, (rank + 1) * per)


def _head_cols(heads: int, head_dim: int, rank: int, world: int, what: str) -> torch.Tensor:
    h = _block_cols(heads, rank, world, what)
    return (h[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)


def shard_model(model, tp: Optional[TPGroup] = None, device=None):
    """Turns a fully loaded `model` (same weights on every rank) into this rank's shard, in place.

    The model keeps its API (forward, forward_batch, Cache, Generator); its config reports
    the LOCAL head counts, which is what the cache sizes itself from.
    """
    tp = tp or TPGroup.current()
    cfg = model.config
    r, w, d = tp.rank, tp.world, cfg.head_dim
    if cfg.num_attention_heads // max(cfg.num_key_value_heads, 1) * cfg.num_key_value_heads != cfg.num_attention_heads:
        raise InputError("tensor parallel: attention heads must be a multiple of KV heads")
    q_cols = _head_cols(cfg.num_attention_heads, d, r, w, "attention heads")
    kv_cols = _head_cols(cfg.num_key_value_heads, d, r, w, "KV heads")
    hid_cols = _block_cols(cfg.hidden_size, r, w, "hidden size")
    mlp_cols = _block_cols(cfg.intermediate_size, r, w, "intermediate size")
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        a.q_proj = ColumnShard(slice_columns(a.q_proj, q_cols), tp, False, False)
        a.k_proj = ColumnShard(slice_columns(a.k_proj, kv_cols), tp, False, False)
        a.v_proj = ColumnShard(slice_columns(a.v_proj, kv_cols), tp, False, False)
        a.o_proj = ColumnShard(slice_columns(a.o_proj, hid_cols), tp, True, True)
        a.num_heads, a.num_kv_heads = cfg.num_attention_heads // w, cfg.num_key_value_heads // w
        m.gate_proj = ColumnShard(slice_columns(m.gate_proj, mlp_cols), tp, False, False)
        m.up_proj = ColumnShard(slice_columns(m.up_proj, mlp_cols), tp, False, False)
        m.down_proj = ColumnShard(slice_columns(m.down_proj, hid_cols), tp, True, True)
    # vocabulary: pad to a multiple of world (padding columns are dropped after the gather)
    per = -(-cfg.vocab_size // w)
    vocab_cols = torch.arange(r * per, (r + 1) * per).clamp(max=cfg.vocab_size - 1)
    model.lm_head = ColumnShard(slice_columns(model.lm_head, vocab_cols), tp, False, True, cfg.vocab_size)
    model.config = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // w,
                                       num_key_value_heads=cfg.num_key_value_heads // w)
    model.tensor_parallel = tp
    if device is not None:
        model.to(device)
    return model


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def init_tensor_parallel(backend: Optional[str] = None) -> TPGroup:
    """Initialises the default process group from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT); NCCL when CUDA is available, else gloo. Sets this rank's CUDA device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise InputError("tensor parallel: RANK/WORLD_SIZE not set; launch with torchrun "
                             "--nproc-per-node N, or call dist.init_process_group yourself")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
        # A group left to interpreter teardown can abort the process ("terminate called without
        # an active exception" from a still-running gloo thread, seen once under a loaded test
        # run): the group this call made is destroyed before teardown.
        atexit.register(_destroy_group)
    tp = TPGroup.current()
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", tp.rank)) % torch.cuda.device_count())
    return tp


def load_model_tp(folder, dtype: Optional[torch.dtype] = None, load_tokenizer: bool = True, backend=None):
    """load_model on the CPU, shard for this rank, move the shard to this rank's device."""
    from ..loader import load_model
    tp = init_tensor_parallel(backend)
    model, tok = load_model(folder, device="cpu", dtype=dtype, load_tokenizer=load_tokenizer)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    return shard_model(model, tp, device), tok
