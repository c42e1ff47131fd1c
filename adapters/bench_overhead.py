"""What do the integrations cost on top of the native generator? (SmolLM2-135M-Instruct, CPU)

    python adapters/bench_overhead.py [--tokens 64] [--exl2] [--json out.json]

Rows (same prompt, greedy, same process; after one warm-up call each path is timed once per
round, --repeat interleaved rounds, fastest kept):
  native        exl_core.Generator.generate on its own Cache
  engine        exl_core.plugins.SharedEngine.stream (worker thread + queue)
  langchain     ChatExl.stream
  llamaindex    Exl.stream_complete
  hf-dense      transformers generate() on the dense folder (the peer)
  --exl2 adds:  native and transformers+exl-core-hf on an RTN 4-bit EXL2 copy of the model
Also: wall time of `python -c "import exl_core; exl_core.plugins.activate_plugins()"`.
Ratios are to `native`; on a shared machine only the ratios of one run mean much.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

PROMPT = "Write a short paragraph about the history of the bicycle."


def best(fn, repeat: int) -> tuple[float, int]:
    """(seconds, generated tokens) of the fastest of `repeat` runs."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        n = fn()
        out.append((time.perf_counter() - t, n))
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--exl2", action="store_true", help="also quantize (RTN 4-bit EXL2) and compare the HF path")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = args.tokens

    import exl_core
    from exl_core.default_model import default_model_path
    from exl_core.plugins import activate_plugins, shared_engine
    activate_plugins()
    path = str(default_model_path(progress=False))
    greedy = exl_core.SamplerSettings(temperature=0)
    paths: dict = {}          # name -> callable returning generated tokens

    eng = shared_engine(path)
    tok = eng.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_bos=False, special=True)

    def job():   # no EOS stop: every row generates exactly n tokens
        return exl_core.Job(ids, max_new_tokens=n, sampler=greedy, stop_on_eos=False)

    gen = exl_core.Generator(eng.model, exl_core.Cache(eng.model, max_tokens=4096), tok)

    def native():
        j = job()
        gen.enqueue(j)
        while not j.done:
            gen.iterate()
        return len(j.generated)
    paths["native"] = native

    def engine():
        j = job()
        for _ in eng.stream(j):
            pass
        return len(j.generated)
    paths["engine"] = engine

    from langchain_exl import ChatExl
    chat = ChatExl(model=path, temperature=0, max_tokens=n)

    def langchain():
        return sum(1 for c in chat.stream(PROMPT) if c.content) or 1
    paths["langchain"] = langchain

    from llama_index.llms.exl import Exl
    li = Exl(model=path, temperature=0, max_new_tokens=n)

    def llamaindex():
        return sum(1 for r in li.stream_chat([_li_msg(PROMPT)]) if r.delta) or 1
    paths["llamaindex"] = llamaindex

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])

    def hf_run(model):
        def run():
            with torch.inference_mode():
                out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     pad_token_id=tok.eos_token_ids and min(tok.eos_token_ids))
            return out.shape[1] - x.shape[1]
        return run
    paths["hf-dense"] = hf_run(hf)

    if args.exl2:
        try:
            exl2_rows(args, path, job, hf_run, paths)
        except Exception as e:  # noqa: BLE001 - report what broke, keep the other rows
            print(f"exl2 comparison failed: {type(e).__name__}: {e}", flush=True)

    rows = Rows()
    for name, fn in paths.items():    # warm-up: first-call dispatch, allocations
        fn()
    times: dict = {name: [] for name in paths}
    for _ in range(args.repeat):       # interleaved rounds: load drift hits every path alike
        for name, fn in paths.items():
            times[name].append(best(fn, 1))
    for name in paths:
        rows[name] = min(times[name])

    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import exl_core, exl_core.plugins as p; p.activate_plugins()"], check=True)
    import_s = time.perf_counter() - t
    print(f"import exl_core + activate_plugins (fresh process): {import_s * 1000:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps({"rows": {k: {"seconds": s, "tokens": t} for k, (s, t) in rows.items()},
                                         "import_activate_s": import_s, "torch_threads": torch.get_num_threads(),
                                         "model": path}, indent=2))


class Rows(dict):
    """Prints each measurement as it lands (ratios to the first row, `native`)."""

    def __setitem__(self, name, value):
        super().__setitem__(name, value)
        sec, toks = value
        if len(self) == 1:
            print(f"{'path':24s} {'tokens':>6s} {'seconds':>8s} {'tok/s':>8s} {'vs native':>9s}", flush=True)
        base = next(iter(self.values()))
        print(f"{name:24s} {toks:6d} {sec:8.2f} {toks / sec:8.1f} {toks / sec / (base[1] / base[0]):9.2f}",
              flush=True)


def exl2_rows(args, path, job, hf_run, paths) -> None:
    import exl_core
    from transformers import AutoModelForCausalLM

    from exl_core.plugins import shared_engine
    from exl_core.quantize.rtn import quantize_model_rtn
    q = Path(path).parent / (Path(path).name + "-rtn-exl2-4b")
    if not (q / "config.json").exists():
        quantize_model_rtn(path, q, fmt="exl2", bits=4, group_size=128)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(path) / f).exists() and not (q / f).exists():
                (q / f).write_bytes((Path(path) / f).read_bytes())
    qeng = shared_engine(q)
    qgen = exl_core.Generator(qeng.model, exl_core.Cache(qeng.model, max_tokens=4096), qeng.tokenizer)

    def native_q():
        j = job()
        qgen.enqueue(j)
        while not j.done:
            qgen.iterate()
        return len(j.generated)
    paths["native-exl2"] = native_q
    hfq = AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.float32).eval()
    paths["hf-exl2 (exl-core-hf)"] = hf_run(hfq)


def _li_msg(text):
    from llama_index.core.base.llms.types import ChatMessage
    return ChatMessage(role="user", content=text)


if __name__ == "__main__":
    main()
