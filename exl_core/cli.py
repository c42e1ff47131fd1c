"""The `exl` command: run | chat | convert | eval | bench | import-gguf | plugins.

Subcommands that belong to a package (convert, eval) parse their own arguments there; this
module only routes and keeps the user-facing run/chat loops.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

from .errors import ExlError


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (thread and token counts)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def _model_path(arg: Optional[str]) -> Path:
    if arg:
        return Path(arg)
    from .default_model import default_model_path
    return default_model_path(progress=True)


def _load(args):
    import torch
    from .loader import load_model
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    path = _model_path(args.model)
    if getattr(args, "tensor_parallel", False):
        if getattr(args, "activations", "exact") != "exact":
            raise ExlError("--activations int8 is not supported with --tensor-parallel (the shards keep "
                           "the exact path); drop one of the two")
        if getattr(args, "prefill", "exact") != "exact":
            raise ExlError("--prefill bf16 is not supported with --tensor-parallel (the shards keep "
                           "the exact path); drop one of the two")
        from .parallel.tensor_parallel import load_model_tp
        model, tok = load_model_tp(path)
        if model.tensor_parallel.rank != 0:      # every rank runs the same job; rank 0 speaks
            sys.stdout = sys.stderr = open(os.devnull, "w")
        return model, tok
    model, tok = load_model(path, device=args.device, progress=True,
                            activations=getattr(args, "activations", "exact"),
                            prefill=getattr(args, "prefill", "exact"))
    return model, tok


def _sampler(args):
    from .generation.sampling import SamplerSettings
    s = SamplerSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repetition_penalty=args.repetition_penalty)
    s.validate()
    return s


def _add_sampling_args(p):
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_model_args(p):
    p.add_argument("-m", "--model", default=None, help="model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--activations", default="exact", choices=["exact", "int8"],
                   help="int8 (CPU only): quantized layers multiply calls of <= 8 rows (decode steps, and "
                        "prompts or prompt chunks that short) with activations rounded to int8 per 32 values "
                        "(faster, not exact); longer calls stay exact. Default: exact fp32")
    p.add_argument("--prefill", default="exact", choices=["exact", "bf16"],
                   help="bf16 (CPU with AVX512_BF16 only): quantized layers multiply calls of >= 9 rows "
                        "(prompts, and batched decode steps of 9+ sequences) with activations rounded to bf16, "
                        "weights exact (faster, ~1e-3 relative error); independent of --activations, which covers "
                        "the shorter calls. Default: exact fp32")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="shard over torch.distributed ranks (launch with torchrun --nproc-per-node N; "
                        "NCCL on GPUs, gloo on CPUs)")


def cmd_run(args) -> int:
    from .cache import Cache
    from .generation import Generator, Job
    if not args.prompt.strip():
        raise ExlError("the prompt is empty: pass text with -p")
    sampler = _sampler(args)                # bad settings are refused before the model loads
    model, tok = _load(args)
    if not args.raw and tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True)
    else:
        ids = tok.encode(args.prompt)
    try:
        cache = Cache(model, max_tokens=len(ids) + args.max_new_tokens + 256)
    except ExlError as e:     # its message speaks of Cache(max_tokens=...), a setting `exl run` makes itself
        raise ExlError(f"--max-new-tokens {args.max_new_tokens}: a cache for the prompt ({len(ids)} tokens) and "
                       f"that many new tokens does not fit ({e})") from None
    gen = Generator(model, cache, tok)
    job = Job(ids, max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed,
              stop_on_eos=not args.ignore_eos)
    t0 = time.perf_counter()
    t_first, n_new = None, 0
    gen.enqueue(job)
    while gen.has_work():
        for r in gen.iterate():
            if r.token_ids and t_first is None:
                t_first = time.perf_counter()
            n_new += len(r.token_ids)
            if r.text:
                sys.stdout.write(r.text)
                sys.stdout.flush()
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    t_first = t_first or t1
    decode_tps = (n_new - 1) / (t1 - t_first) if n_new > 1 and t1 > t_first else 0.0
    print(f"prompt: {len(ids)} tokens, {len(ids) / (t_first - t0):.1f} tokens/s | "
          f"decode: {n_new} tokens, {decode_tps:.1f} tokens/s", file=sys.stderr)
    return 0


def fit_history(tok, messages: list, budget: int) -> tuple[list, list, int]:
    """(messages kept, their prompt ids, turns dropped): the chat templated within `budget` prompt tokens, the oldest
    turns (a user message and its reply) dropped first; the system message and the newest user message always stay.
    Raises ExlError where those two alone do not fit."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(head):]
    dropped = 0
    while True:
        ids = tok.apply_chat_template(head + turns, add_generation_prompt=True, tokenize=True)
        if len(ids) <= budget:
            return head + turns, ids, dropped
        if len(turns) <= 1:
            raise ExlError(f"the message{' and the system prompt' if head else ''} take {len(ids)} tokens, more "
                           f"than the {budget} that --max-tokens leaves after --max-new-tokens: raise --max-tokens "
                           "or lower --max-new-tokens")
        cut = next((i for i in range(1, len(turns)) if turns[i]["role"] == "user"), len(turns) - 1)
        del turns[:cut]
        dropped += 1


def cmd_chat(args) -> int:
    from .cache import Cache
    from .generation import Generator, Job
    sampler = _sampler(args)                # bad settings are refused before the model loads
    model, tok = _load(args)
    cache = Cache(model, max_tokens=args.max_tokens)
    # the generator shortens a reply to what the cache holds: keep the prompt within what leaves the whole reply room
    budget = cache.max_tokens + 1 - args.max_new_tokens
    if budget < 1:
        raise ExlError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in a cache of "
                       f"{cache.max_tokens} tokens (--max-tokens)")
    gen = Generator(model, cache, tok)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    try:        # a tokenizer without a (working) chat template refuses every turn: say so once, before the first
        tok.apply_chat_template(messages + [{"role": "user", "content": "hello"}])
    except ExlError as e:
        why = ("exl chat needs one" if not getattr(tok, "chat_template", None) else
               "with --system" if args.system else "on a user message")
        raise ExlError(f"{e} ({why}; exl run --raw takes a plain prompt)") from None
    print("exl chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        try:
            messages, ids, dropped = fit_history(tok, messages, budget)
        except ExlError as e:           # this message alone is too long: say so, keep the session and its history
            messages.pop()
            print(f"exl chat: {e}", file=sys.stderr)
            continue
        if dropped:
            pages = "" if cache.max_tokens == args.max_tokens else ", rounded up to whole pages"
            print(f"exl chat: dropped the oldest {dropped} turn{'s' * (dropped > 1)} to fit the cache's "
                  f"{cache.max_tokens} tokens (--max-tokens {args.max_tokens}{pages})", file=sys.stderr)
        job = Job(ids, max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed)
        gen.enqueue(job)
        reply = []
        while gen.has_work():
            for r in gen.iterate():
                if r.text:
                    reply.append(r.text)
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_bench(args) -> int:
    import json
    from .benchmark import check_sizes, format_table, machine_info, measure
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise ExlError(f"--batch {args.batch!r}: a comma-separated list of batch sizes, e.g. 1,8") from None
    for b in batches:                       # refused before the model loads
        check_sizes(b, args.prompt_tokens, args.new_tokens)
    if args.json and not Path(args.json).resolve().parent.is_dir():     # not after the whole benchmark ran
        raise ExlError(f"--json {args.json}: folder {Path(args.json).resolve().parent} does not exist")
    if args.json and Path(args.json).is_dir():
        raise ExlError(f"--json {args.json}: is a folder; name the file to write "
                       f"(e.g. {Path(args.json) / 'bench.json'})")
    model, tok = _load(args)
    rows = [measure(model, tok, b, args.prompt_tokens, args.new_tokens, seed=args.seed) for b in batches]
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "exl bench", "model": str(_model_path(args.model)),
                                               "machine": machine_info(model.device),
                                               "rows": [r.as_dict() for r in rows]}, indent=1))
    return 0


def cmd_import_gguf(args) -> int:
    from .formats.gguf_import import import_gguf
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise ExlError(f"{out}: already exists and is not an empty folder; choose another one or pass --force "
                       "to replace it")
    out = import_gguf(args.file, args.out_dir)
    print(f"imported {args.file} -> {out}")
    return 0


def cmd_plugins(args) -> int:
    from .plugins import list_plugins
    plugins = list_plugins()
    if not plugins:
        print("no exl_core plugins installed")
    for p in plugins:
        kind = (p.get("integration") or {}).get("kind", "")
        status = f"error: {p['error']}" if p.get("error") else kind
        print(f"{p.get('name')}\t{p.get('version', '?')}\t{p.get('distribution', '')}\t{status}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="exl", description="exl_core: fast EXL2/GPTQ inference")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="generate text from a prompt, streamed")
    _add_model_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _add_model_args(p)
    p.add_argument("--system", default=None)
    p.add_argument("--max-new-tokens", type=positive_int, default=512)
    p.add_argument("--max-tokens", type=positive_int, default=8192,
                   help="KV cache size in tokens; the oldest turns are dropped to keep a prompt within it")
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("bench", help="prompt and decode tokens/s of a model through the generator")
    _add_model_args(p)
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (default 1)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, help="random prompt ids a job (default 512)")
    p.add_argument("--new-tokens", type=positive_int, default=128, help="greedy tokens a job, EOS ignored")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, help="also write the rows and the machine to this JSON file")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("import-gguf", help="import a Llama-family GGUF into an HF-style folder")
    p.add_argument("file")
    p.add_argument("out_dir")
    p.add_argument("--force", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(fn=cmd_import_gguf)

    p = sub.add_parser("plugins", help="list discovered exl_core plugins")
    p.set_defaults(fn=cmd_plugins)

    # convert / eval own their argument parsers (exl_core.quantize / exl_core.eval)
    sub.add_parser("convert", help="convert FP16 -> EXL2/GPTQ, GPTQ -> EXL2 (see exl convert -h)", add_help=False)
    sub.add_parser("eval", help="evaluate: perplexity, variants side by side, task accuracy (exl eval -h)",
                   add_help=False)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "convert":
            from .quantize.convert import convert_main
            return convert_main(argv[1:]) or 0
        if argv and argv[0] == "eval":
            from .eval.cli import eval_main
            return eval_main(argv[1:]) or 0
        args = build_parser().parse_args(argv)
        return args.fn(args) or 0
    except ExlError as e:
        print(f"exl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                    # an output path that is a file, a missing folder, no permission...
        print(f"exl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nexl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
