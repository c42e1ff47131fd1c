"""The peer on the same GPU and checkpoints: ExLlamaV2 0.3.2 on the Llama-2-7B-shaped GPTQ / EXL2
folders bench/gpu_bench.py measures, with the same workload (decode 128 tokens after a 128-token
prompt, greedy, batch 1 / 8 / 32; a 2,048-token prompt), and the ratio exl_core / ExLlamaV2.

Run on the GPU machine by `PHASES="... exlv2" bash bench/gpu.sh` (the wheel travels in .whl/; its
extension is JIT-built on first import, ~2 min). How ExLlamaV2 is driven: its own model.forward with
its static ExLlamaV2Cache (batch B), ids on the CPU as its embedding expects, argmax of the last
logits copied back each step (its generators sample on the host the same way). No flash-attn on the
machine: ExLlamaV2 then attends with torch SDPA. exl_core's numbers come from the same call's
gpu_h200.json (bench/gpu_bench.py: CUDA graphs, argmax on the device) and, for the product path
(paged cache, sampler, CUDA graphs), gpu_generator.json: its default, each step launched before the
previous step's tokens reach the host (graphs_lookahead_tok_s; graphs_tok_s where a run has none).

    python bench/exllamav2_peer.py --gptq /tmp/exl_bench/gptq --exl2 /tmp/exl_bench/exl2 \
        --ours $OUT/gpu_h200.json --ours-generator $OUT/gpu_generator.json
    python bench/exllamav2_peer.py --peer-json exllamav2_h200.json --ours ... --ours-generator ... --json NEW
        (the ratios again from a saved run's ExLlamaV2 figures, without running it)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import traceback
from pathlib import Path

import torch

PROMPT, DECODE, LONG = 128, 128, 2048


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def load(folder: Path):
    from exllamav2 import ExLlamaV2, ExLlamaV2Config
    cfg = ExLlamaV2Config(str(folder))
    cfg.arch_compat_overrides()
    cfg.max_batch_size = 32                 # its scratch buffers are sized by batch x input length
    cfg.max_input_len = LONG
    cfg.max_attention_size = LONG ** 2
    model = ExLlamaV2(cfg)
    model.load()
    return model


@torch.inference_mode()
def decode_tok_s(model, B: int) -> float:
    from exllamav2 import ExLlamaV2Cache
    cache = ExLlamaV2Cache(model, batch_size=B, max_seq_len=PROMPT + DECODE + 8)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(B)
    ids = torch.randint(0, vocab, (B, PROMPT), generator=g)

    def run(n):
        cache.current_seq_len = 0
        tok = model.forward(ids, cache, last_id_only=True)[:, -1].argmax(-1).cpu().view(B, 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            tok = model.forward(tok, cache)[:, -1].argmax(-1).cpu().view(B, 1)
        torch.cuda.synchronize()
        return B * n / (time.perf_counter() - t0)

    run(8)                                   # warm-up: kernels, allocator
    return run(DECODE)


@torch.inference_mode()
def prompt_tok_s(model) -> float:
    from exllamav2 import ExLlamaV2Cache
    cache = ExLlamaV2Cache(model, batch_size=1, max_seq_len=LONG + 8)
    ids = torch.randint(0, model.config.vocab_size, (1, LONG), generator=torch.Generator().manual_seed(0))

    def fwd():
        cache.current_seq_len = 0
        model.forward(ids, cache, last_id_only=True)

    for _ in range(2):
        fwd()
    ts = sorted(_sync_time(fwd) for _ in range(5))
    return LONG / ts[len(ts) // 2]


def without_g_idx(src: Path, dst: Path) -> Path:
    """A copy of a GPTQ folder minus its g_idx tensors. Ours are trivial (row // group, no act-order),
    but ExLlamaV2 takes any g_idx that is not all zeros as act-order (ext.make_q_matrix: q_perm); the
    copy shows what it does on the plain path. Same weights, same math."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as h:
                save_file({k: h.get_tensor(k) for k in h.keys() if not k.endswith(".g_idx")}, str(dst / f.name),
                          metadata=h.metadata())
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return dst


def bench(folder: Path, r: dict) -> None:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = load(folder)
    r["load_s"] = time.perf_counter() - t0
    for B in (1, 8, 32):
        try:
            r[f"bs{B}_decode_tok_s"] = decode_tok_s(model, B)
        except Exception as e:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            r[f"bs{B}_decode_error"] = repr(e)[:300]
    try:
        r["prompt2048_tok_s"] = prompt_tok_s(model)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        r["prompt2048_error"] = repr(e)[:300]
    r["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    model.unload()
    del model
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gptq", type=Path)
    ap.add_argument("--exl2", type=Path)
    ap.add_argument("--gptq-no-gidx", type=Path, metavar="SRC",
                    help="also (or only) the GPTQ folder SRC with its g_idx tensors removed (written beside it)")
    ap.add_argument("--ours", type=Path, help="gpu_h200.json of the same call (bench/gpu_bench.py)")
    ap.add_argument("--ours-generator", type=Path, help="gpu_generator.json of the same call")
    ap.add_argument("--json", type=Path, help="default bench/results/exllamav2_h200.json (required with --peer-json)")
    ap.add_argument("--peer-json", type=Path, help="a saved run's JSON: its ExLlamaV2 figures, ExLlamaV2 not run")
    a = ap.parse_args()
    if a.json is None:
        if a.peer_json:
            ap.error("--peer-json needs --json: the recomputed run goes to a file of its own")
        a.json = Path(__file__).parent / "results" / "exllamav2_h200.json"
    formats = ("gptq", "gptq_no_gidx", "exl2")
    out = json.loads(a.peer_json.read_text()) if a.peer_json else run_peer(a, formats)
    ratios(out, a, formats)
    text = json.dumps(out, indent=1) + "\n"
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], a.json.name).write_text(text)


def run_peer(a: argparse.Namespace, formats: tuple) -> dict:
    """ExLlamaV2 on each folder given: its figures by format (an "error" where it refuses one)."""
    t0 = time.perf_counter()
    import exllamav2                         # JIT-builds its extension on a fresh machine
    from exllamav2 import ext  # noqa: F401  (the import is the build)
    out: dict = {"peer": f"ExLlamaV2 {exllamav2.__version__}", "gpu": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "import_and_build_s": time.perf_counter() - t0,
                 "workload": f"{DECODE} tokens after a {PROMPT}-token prompt, greedy; prompt {LONG} tokens",
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.gptq_no_gidx is not None:
        a.gptq_no_gidx = without_g_idx(a.gptq_no_gidx, a.gptq_no_gidx.with_name(a.gptq_no_gidx.name + "_nogidx"))
    for fmt in formats:
        folder = getattr(a, fmt)
        if folder is None:
            continue
        out[fmt] = {}
        try:
            bench(folder, out[fmt])
        except Exception as e:  # noqa: BLE001 - a folder ExLlamaV2 refuses is a finding
            traceback.print_exc()
            out[fmt]["error"] = repr(e)[:300]
    return out


def ratios(out: dict, a: argparse.Namespace, formats: tuple) -> None:
    """exl_core / ExLlamaV2 per metric into out (and the Generator's, GPTQ), printed as a table."""
    ours = json.loads(a.ours.read_text()) if a.ours and a.ours.exists() else {}
    gen = json.loads(a.ours_generator.read_text()) if a.ours_generator and a.ours_generator.exists() else {}
    gen_rows = {row["batch"]: row.get("graphs_lookahead_tok_s") or row.get("graphs_tok_s")
                for row in gen.get("rows", [])}
    out.pop("generator_metric", None)
    if gen_rows:
        out["generator_metric"] = "graphs_lookahead_tok_s (graphs_tok_s where absent)"
    for fmt in formats:                          # a saved run's ratios (--peer-json) are all made again below
        for k in [k for k in out.get(fmt, {}) if k.endswith("_ratio")]:
            del out[fmt][k]
    keys = ["bs1_decode_tok_s", "bs8_decode_tok_s", "bs32_decode_tok_s", "prompt2048_tok_s"]
    print(f"\n{'metric':20s} {'fmt':12s} {'ExLlamaV2':>10s} {'exl_core':>10s} {'ratio':>7s} {'exl_core Generator':>19s}")
    for fmt in formats:
        if fmt not in out:
            continue
        mine_fmt = "gptq" if fmt == "gptq_no_gidx" else fmt        # the same weights for exl_core
        for k in keys:
            peer, mine = out[fmt].get(k), ours.get(mine_fmt, {}).get(k)
            ratio = mine / peer if peer and mine else None
            if ratio is not None:
                out[fmt][k.replace("_tok_s", "_ratio")] = ratio
            b = int(k[2:k.index("_")]) if k.startswith("bs") else None
            g = gen_rows.get(b) if mine_fmt == "gptq" and b else None
            if g and peer:
                out[fmt][k.replace("_tok_s", "_generator_ratio")] = g / peer
            cell = lambda v, w: f"{v:{w}.1f}" if isinstance(v, float) else f"{'-':>{w}s}"  # noqa: E731
            print(f"{k:20s} {fmt:12s} {cell(peer, 10)} {cell(mine, 10)} "
                  f"{(f'{ratio:7.3f}' if ratio else '      -')} {cell(g, 19)}")


if __name__ == "__main__":
    main()
