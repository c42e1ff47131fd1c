"""Speculative decoding on CPU with SmolLM2-135M: does it pay, and with which drafter?

Question: with greedy decoding, how many draft tokens does the main model accept, how many
main-model forward passes does each generated token cost, and what is the wall-clock
speed-up over plain decoding, for (a) a low-bit RTN conversion of the same model as the
draft and (b) n-gram prompt lookup? Outputs are checked token-identical to plain decoding.

    python bench/speculative.py [--new-tokens 32] [--k 4] [--main dense|gptq] [--threads 1]
                                [--drafts gptq4,exl2-4bit] [--prompts story,copy] [--batches 1,4]

Main model: SmolLM2-135M-Instruct (dense fp32 by default, or 4-bit GPTQ RTN). Drafts: RTN
conversions of it (made once, cached; see DRAFTS). Writes bench/results/speculative_cpu.json.
"""
from __future__ import annotations

import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--main", choices=["dense", "gptq"], default="dense")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--drafts", default="gptq4", help=f"comma-separated, of {sorted(DRAFTS)}")
    ap.add_argument("--prompts", default="story,copy", help=f"comma-separated, of {sorted(PROMPTS)}")
    ap.add_argument("--batches", default="1,4")
    args = ap.parse_args()
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
