"""Tensor parallelism on gloo (two CPU processes) against the same model in one process.

Column slicing keeps every output column's arithmetic identical to the unsharded model, so
logits must match exactly (up to 1e-6 for safety across thread schedules) for dense, GPTQ
and EXL2 weights, and the generator on each rank must produce the single-process tokens.
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from exl_core.errors import InputError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _sharded_rank(rank: int, world: int, port: int, folder: str):
    """This rank's shard of the model in `folder`, in a gloo group of `world` processes."""
    import torch.distributed as dist
    from exl_core.loader import load_model
    from exl_core.parallel.tensor_parallel import shard_model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, _ = load_model(folder, load_tokenizer=False)
        shard_model(model)
        yield model
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, folder: str, ids: torch.Tensor, out_dir: str):
    with _sharded_rank(rank, world, port, folder) as model:
        logits = model.forward_batch(ids)
        tokens = _sample(model, ids)
        torch.rand(rank + 1)               # the ranks' global generators drift apart (rank-dependent work)
        unseeded = _sample(model, ids, seeded=False)
        torch.save({"logits": logits, "tokens": tokens, "unseeded": unseeded,
                    "local_heads": model.config.num_key_value_heads}, os.path.join(out_dir, f"rank{rank}.pt"))


def _sample(model, ids, seeded: bool = True) -> list[list[int]]:
    """Sampling of 6 tokens per row of ids through the Generator (seeded: each job its own seed)."""
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    gen = Generator(model, Cache(model, max_tokens=256, page_size=16), None)
    jobs = gen.enqueue([Job(input_ids=ids[i].tolist(), max_new_tokens=6, stop_on_eos=False,
                            sampler=SamplerSettings(temperature=0.8, top_k=50), seed=11 + i if seeded else None)
                        for i in range(ids.shape[0])])
    while gen.has_work():
        gen.iterate()
    return [j.generated for j in jobs]


def _reference(folder, ids):
    from exl_core.loader import load_model
    model, _ = load_model(folder, load_tokenizer=False)
    return model.forward_batch(ids), _sample(model, ids), model.config.num_key_value_heads


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    from exl_core.quantize.rtn import quantize_model_rtn
    from exl_core.testing import make_tiny_model
    root = tmp_path_factory.mktemp("tp")
    dense = make_tiny_model(root / "dense", seed=5, vocab_size=1001, num_attention_heads=4, num_key_value_heads=2)
    return {"dense": dense,
            "gptq": quantize_model_rtn(dense, root / "gptq", fmt="gptq", bits=4, group_size=32, act_order=True),
            "exl2": quantize_model_rtn(dense, root / "exl2", fmt="exl2", bits=[(6, 0.25), (3, 0.75)],
                                       group_size=32, act_order=True)}


@pytest.mark.parametrize("kind", ["dense", "gptq", "exl2"])
def test_two_ranks_match_one_process(tp_models, tmp_path, kind):
    folder = tp_models[kind]
    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    ref_logits, ref_tokens, heads = _reference(folder, ids)
    mp.start_processes(_worker, args=(2, _free_port(), str(folder), ids, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["local_heads"] == heads // 2                       # each rank caches half the KV heads
        assert got["logits"].shape == ref_logits.shape
        assert (got["logits"] - ref_logits).abs().max().item() <= 1e-6
        assert got["tokens"] == ref_tokens
    # jobs without a seed: every rank samples the same tokens (a seed shared from rank 0), else the gathered
    # activations would mix different histories
    unseeded = [torch.load(tmp_path / f"rank{rank}.pt")["unseeded"] for rank in range(2)]
    assert unseeded[0] == unseeded[1]


def _cache_size_worker(rank: int, world: int, port: int, folder: str, out_dir: str):
    """Each rank reads a different free memory (as ranks on GPUs of one host do): a Cache sized from it must come
    out the same on every rank, or the ranks admit different jobs and their all-gathers stop matching."""
    from exl_core.cache import Cache, sizing
    with _sharded_rank(rank, world, port, folder) as model:
        free = int(sizing.ACTIVATION_RESERVE / sizing.CPU_FRACTION) + (rank + 1) * (8 << 20)
        sizing.known_free_memory = lambda device: free
        cache = Cache(model)
        own = sizing.num_pages_for(sizing.bytes_per_token(
            cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype), cache.page_size, cache.device, None,
            model.config.max_position_embeddings)
        # an unsharded draft model on each rank: its default cache agrees too (the ranks must draft alike)
        from exl_core.generation import Generator
        from exl_core.loader import load_model
        draft, _ = load_model(folder, load_tokenizer=False)
        gen = Generator(model, cache, None, draft_model=draft)
        torch.save({"pages": cache.num_pages, "own": own, "draft_pages": gen.spec.draft_cache.num_pages},
                   os.path.join(out_dir, f"cache{rank}.pt"))


def test_ranks_agree_on_a_cache_sized_from_free_memory(tp_models, tmp_path):
    mp.start_processes(_cache_size_worker, args=(2, _free_port(), str(tp_models["dense"]), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    got = [torch.load(tmp_path / f"cache{rank}.pt") for rank in range(2)]
    assert got[0]["own"] != got[1]["own"]                 # the ranks' own readings differ ...
    assert got[0]["pages"] == got[1]["pages"] == min(g["own"] for g in got)     # ... and both take the smaller
    assert got[0]["draft_pages"] == got[1]["draft_pages"]


def test_indivisible_heads_are_refused(tp_models):
    from exl_core.loader import load_model
    from exl_core.parallel.tensor_parallel import TPGroup, shard_model
    model, _ = load_model(tp_models["dense"], load_tokenizer=False)
    with pytest.raises(InputError, match="KV heads \\(2\\) is not divisible by the number of ranks \\(4\\)"):
        shard_model(model, TPGroup(rank=0, world=4))


def test_shard_needs_an_initialised_group(tp_models):
    from exl_core.loader import load_model
    from exl_core.parallel.tensor_parallel import shard_model
    model, _ = load_model(tp_models["dense"], load_tokenizer=False)
    with pytest.raises(InputError, match="not initialised"):
        shard_model(model)


@pytest.mark.real_model
def test_cli_run_under_torchrun_prints_the_single_process_text(tmp_path):
    """`torchrun --nproc-per-node 2 -m exl_core.cli run --tensor-parallel` prints exactly what
    one process prints (rank 0 speaks), on a tiny model with the real SmolLM2 tokenizer."""
    import subprocess
    import sys
    from exl_core.testing import make_tiny_model, smollm2_path
    folder = make_tiny_model(tmp_path / "m", seed=2, tokenizer_from=Path(smollm2_path()))
    args = ["-m", "exl_core.cli", "run", "-m", str(folder), "-p", "Tell me a story", "--max-new-tokens", "8",
            "--ignore-eos", "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), *args, "--tensor-parallel"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.strip() and two.stdout == one.stdout
