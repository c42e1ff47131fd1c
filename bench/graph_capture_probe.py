"""Which op breaks a decode step's CUDA graph capture (run by bench/gpu.sh phase `graphprobe`).

Stop 31 call 1: tests/test_cuda_model.py::test_generator_batched_equals_alone_on_gpu[gptq] (tiny float32 GPTQ model,
random prompts) warned "CUDA graph capture failed (... operation failed due to a previous error during capture)" once
and decoded that batch shape eagerly (the tokens still matched).  That message means an earlier call inside the
capture broke it without raising.  This probe runs the test's scenario over several seeds and dtypes; where a capture
fails it runs the same static step eagerly under torch.cuda.set_sync_debug_mode("error"), so an op that waits for the
device raises with its Python stack, and prints it.

    python bench/graph_capture_probe.py
"""
from __future__ import annotations

import random
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from exl_core.cache import Cache
from exl_core.generation import Generator, Job, cuda_graphs
from exl_core.generation.sampling import SamplerSettings
from exl_core.loader import load_model
from exl_core.quantize.rtn import quantize_model_rtn
from exl_core.testing import make_tiny_model

FAILED: list = []


def _diagnosing_record(orig):
    def record(self, e):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = orig(self, e)
        if e.eager_only:
            FAILED.append((e.ctx.batch, e.ctx.width, [str(w.message)[:200] for w in caught]))
            print(f"capture failed at batch {e.ctx.batch}, width {e.ctx.width}: {caught[0].message if caught else ''}"[:400])
            torch.cuda.synchronize()
            from exl_core.ops.attention_gathered import forget_plan
            forget_plan()                        # the failed capture's plan lives in the graph's pool
            try:
                torch.cuda.set_sync_debug_mode("error")
                self.model.forward(e.ctx.ids, e.ctx)
                print("  the eager step under sync-debug 'error' ran without a synchronizing op")
            except Exception:   # noqa: BLE001 - the point: show where
                traceback.print_exc(limit=25)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return out
    return record


def scenario(model, seed: int, lookahead: bool) -> None:
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(1000) for _ in range(rnd.randint(3, 50))] for _ in range(4)]
    greedy = SamplerSettings(temperature=0.0)
    gen = Generator(model, Cache(model, max_tokens=1024, page_size=16), max_batch_tokens=128, max_chunk_size=32,
                    lookahead=lookahead)
    gen.enqueue([Job(p, max_new_tokens=8, sampler=greedy, stop_on_eos=False, return_logprobs=True) for p in prompts])
    while gen.has_work():
        gen.iterate()


def main() -> None:
    cuda_graphs.GraphedDecoder._record = _diagnosing_record(cuda_graphs.GraphedDecoder._record)
    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_model(Path(tmp) / "src", "llama", seed=3, hidden_size=128, intermediate_size=352,
                              num_attention_heads=4, num_key_value_heads=2)
        for fmt in ("gptq", "exl2"):
            bits = 4 if fmt == "gptq" else [(6, 0.25), (4, 0.5), (3, 0.25)]
            q = quantize_model_rtn(src, Path(tmp) / fmt, fmt=fmt, bits=bits, group_size=32, act_order=fmt == "exl2")
            for dtype in (torch.float32, torch.float16):
                model, _ = load_model(q, device="cuda", dtype=dtype, load_tokenizer=False)
                for seed in range(6):
                    for lookahead in (True, False):
                        n = len(FAILED)
                        scenario(model, seed, lookahead)
                        print(f"{fmt} {dtype} seed {seed} lookahead {lookahead}: {len(FAILED) - n} failed captures")
                del model
    print(f"captures failed: {len(FAILED)}")


if __name__ == "__main__":
    main()
