"""Speculative decoding on CPU with SmolLM2-135M: does it pay, and with which drafter?

Question: with greedy decoding, how many draft tokens does the main model accept, how many
main-model forward passes does each generated token cost, and what is the wall-clock
speed-up over plain decoding, for (a) a low-bit RTN conversion of the same model as the
draft and (b) n-gram prompt lookup? Outputs are checked token-identical to plain decoding.

    python bench/speculative.py [--new-tokens 32] [--k 4] [--main dense|gptq] [--threads 1]
                                [--drafts gptq4,exl2-4bit] [--prompts story,copy] [--batches 1,4]
    python bench/speculative.py --gpu-7b /tmp/exl_bench/gptq     # on the H200 (bench/gpu.sh runs it)

Main model: SmolLM2-135M-Instruct (dense fp32 by default, or 4-bit GPTQ RTN). Drafts: RTN
conversions of it (made once, cached; see DRAFTS). Writes bench/results/speculative_cpu.json.

With --gpu-7b the main model is bench/make_7b_checkpoint.py's random-weight Llama-2-7B-shaped
checkpoint on CUDA (fp16). Random weights have no smaller relative, so the draft is the main
model's own first L layers (shared weights, same embedding/norm/head: self-speculative layer
skipping), plus n-gram lookup; the prompt is a random 64-token sequence said twice, so the
n-gram drafter has something to copy. Acceptance rates of a random model say little about a
trained one; the row measures the machinery's cost (verify passes, rollback) on the GPU.
Writes bench/results/speculative_h200.json (and $OUT/speculative_h200.json when OUT is set).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import print_table, write_results  # noqa: E402
from exl_core.cache import Cache  # noqa: E402
from exl_core.default_model import default_dense_path, exl_home  # noqa: E402
from exl_core.generation import Generator, Job  # noqa: E402
from exl_core.generation.sampling import SamplerSettings  # noqa: E402
from exl_core.loader import load_model  # noqa: E402

GREEDY = SamplerSettings(temperature=0.0)
ARTICLE = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
           "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
           "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the coast "
           "of Queensland, Australia. It can be seen from outer space and is the world's biggest single "
           "structure made by living organisms.")
PROMPTS = {
    "story": "Write a short story about a robot who learns to paint.",
    "copy": f"Here is a paragraph:\n\n{ARTICLE}\n\nRepeat the paragraph above word for word.",
}


# RTN conversions usable as drafts. Without calibration 3-bit and 2-bit RTN wreck a 135M model
# (measured greedy acceptance: GPTQ 3-bit g128 5 %, EXL2 2-bit g32 0 %), so the default
# drafts are 4-bit; pass --drafts to try the others.
DRAFTS = {
    "gptq4": dict(fmt="gptq", bits=4, group_size=128),
    "exl2-4bit": dict(fmt="exl2", bits=4, group_size=32),
    "gptq3": dict(fmt="gptq", bits=3, group_size=128),
    "exl2-2bit": dict(fmt="exl2", bits=2, group_size=32),
}


def draft_folder(kind: str) -> Path:
    from exl_core.quantize.rtn import quantize_model_rtn
    out = exl_home() / "bench" / f"smollm2-135m-{kind}-rtn"
    if not (out / "config.json").exists():
        quantize_model_rtn(default_dense_path(progress=False), out, **DRAFTS[kind])
    return out


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False, special=True)


def run(model, tok, prompts, new_tokens, **spec) -> dict:
    cache = Cache(model, max_tokens=4096, page_size=256)
    kw = dict(spec)
    if "draft_model" in kw:
        kw["draft_cache"] = Cache(kw["draft_model"], max_tokens=4096, page_size=256)
    gen = Generator(model, cache, tok, **kw)
    jobs = [Job(p, max_new_tokens=new_tokens, sampler=GREEDY, stop_on_eos=False) for p in prompts]
    gen.enqueue(jobs)
    while any(j.fed < j.prompt_len for j in jobs) or gen.waiting:   # prefill is not what we measure
        gen.iterate()
    passes0, gen0 = gen.stats.forward_passes, gen.stats.generated_tokens
    t0 = time.perf_counter()
    while gen.has_work():
        gen.iterate()
    dt = time.perf_counter() - t0
    n = gen.stats.generated_tokens - gen0
    out = {"tokens": n, "seconds": dt, "tok_s": n / dt, "main_passes": gen.stats.forward_passes - passes0,
           "outputs": [j.generated for j in jobs]}
    if gen.spec is not None:
        st = gen.spec.stats
        out.update(acceptance=st.acceptance_rate, drafted=st.drafted, accepted=st.accepted,
                   draft_passes=st.draft_forward_passes)
    return out


def layer_skip_draft(model, n_layers: int):
    """The first n_layers blocks of `model` with its embedding, final norm and head (shared tensors)."""
    import dataclasses
    from exl_core.model.llama import Model
    cfg = dataclasses.replace(model.config, num_hidden_layers=n_layers)
    return Model(cfg, model.embed_weight, list(model.layers[:n_layers]), model.norm, model.lm_head, model.rope)


def gpu_7b(folder: Path, new_tokens: int, k: int, draft_layers: list[int], device: str) -> None:
    model, _ = load_model(folder, device=device, dtype=torch.float16 if device == "cuda" else torch.float32,
                          load_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    half = torch.randint(100, model.config.vocab_size, (64,), generator=g).tolist()
    prompts = [half + half]
    configs = [("plain", {})] + \
              [(f"layer-skip draft {n}/{model.config.num_hidden_layers}",
                {"draft_model": layer_skip_draft(model, n), "num_draft_tokens": k}) for n in draft_layers] + \
              [("ngram", {"ngram_draft": True, "num_draft_tokens": k})]
    rows, base = [], None
    for cname, kw in configs:
        run(model, None, prompts, 8, **kw)                          # warm-up (kernels, allocator)
        r = run(model, None, prompts, new_tokens, **kw)
        base = base or r
        rows.append({"mode": cname, "tok_s": r["tok_s"], "speedup": r["tok_s"] / base["tok_s"],
                     "passes_per_tok": r["main_passes"] / r["tokens"], "acceptance": r.get("acceptance"),
                     "draft_passes": r.get("draft_passes"), "identical": r["outputs"] == base["outputs"]})
        print_table(rows[-1:], list(rows[-1]))
    cols = ["mode", "tok_s", "speedup", "passes_per_tok", "acceptance", "draft_passes", "identical"]
    print()
    print_table(rows, cols)
    res = {"model": f"random-weight Llama-2-7B-shaped checkpoint {folder.name}, {device}", "batch": 1,
           "new_tokens": new_tokens, "num_draft_tokens": k, "sampler": "greedy", "prompt_tokens": len(prompts[0]),
           "rows": rows, "notes": "plain decode replays CUDA graphs where the Generator uses them (its default on CUDA); "
                                  "speculative draft and verify passes run eagerly; prefill excluded from timing; "
                                  "drafts share the main model's weights (first layers) or use n-gram lookup"}
    path = write_results("speculative_h200" if device == "cuda" else "speculative_7b_dryrun", res)
    if os.environ.get("OUT"):
        shutil.copy(path, os.environ["OUT"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-7b", type=Path, default=None, help="7B-shaped checkpoint folder: run the H200 rows")
    ap.add_argument("--draft-layers", default="4,8", help="with --gpu-7b: layer-skip draft depths")
    ap.add_argument("--device", default="cuda", help="with --gpu-7b: cuda, or cpu for a dry run on small shapes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--main", choices=["dense", "gptq"], default="dense")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--drafts", default="gptq4", help=f"comma-separated, of {sorted(DRAFTS)}")
    ap.add_argument("--prompts", default="story,copy", help=f"comma-separated, of {sorted(PROMPTS)}")
    ap.add_argument("--batches", default="1,4")
    args = ap.parse_args()
    if args.gpu_7b is not None:
        gpu_7b(args.gpu_7b, args.new_tokens, args.k, [int(n) for n in args.draft_layers.split(",")], args.device)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.main == "dense":
        main_dir, main_name = default_dense_path(progress=False), "SmolLM2-135M-Instruct dense fp32"
    else:
        from quantized_models import quantized_smollm2
        main_dir, main_name = quantized_smollm2("gptq"), "SmolLM2-135M-Instruct GPTQ 4-bit g128 (RTN)"
    model, tok = load_model(main_dir, dtype=torch.float32)
    drafts = {name: load_model(draft_folder(name), dtype=torch.float32, load_tokenizer=False)[0]
              for name in args.drafts.split(",")}
    rows = []
    for pname in args.prompts.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [chat_ids(tok, PROMPTS[pname])] * batch
            base = run(model, tok, prompts, args.new_tokens)
            configs = [("plain", {})] + [(f"draft {d}", {"draft_model": m, "num_draft_tokens": args.k})
                                         for d, m in drafts.items()] + \
                      [("ngram", {"ngram_draft": True, "num_draft_tokens": args.k})]
            for cname, kw in configs:
                r = base if cname == "plain" else run(model, tok, prompts, args.new_tokens, **kw)
                rows.append({"prompt": pname, "batch": batch, "mode": cname, "tok_s": r["tok_s"],
                             "speedup": r["tok_s"] / base["tok_s"],
                             "passes_per_tok": r["main_passes"] * batch / r["tokens"],
                             "acceptance": r.get("acceptance"), "draft_passes": r.get("draft_passes"),
                             "identical": r["outputs"] == base["outputs"]})
                print_table(rows[-1:], list(rows[-1]))
    cols = ["prompt", "batch", "mode", "tok_s", "speedup", "passes_per_tok", "acceptance", "draft_passes", "identical"]
    print()
    print_table(rows, cols)
    write_results("speculative_cpu", {"model": main_name, "new_tokens": args.new_tokens, "num_draft_tokens": args.k,
                                      "sampler": "greedy", "rows": rows,
                                      "notes": "passes_per_tok = main-model forward passes x batch / generated "
                                               "tokens (plain decoding: 1.0); prefill excluded from timing; "
                                               "drafts are RTN conversions of the same model"})


if __name__ == "__main__":
    main()
