"""Shared benchmark plumbing: machine description, timing, table printing, JSON results."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    import torch
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds (synchronising CUDA when present)."""
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_us(fns: list[Callable[[], object]], reps: int = 30) -> float:
    """Mean us per callable of one CUDA graph that runs them all in order (warmed on a side stream first, so
    first-call allocations and caches stay out of the capture)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / reps / len(fns)


def truncate(v: float, places: int = 2) -> float:
    """v truncated (not rounded) to `places` decimals, as the notes quote figures."""
    return math.floor(v * 10 ** places) / 10 ** places


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **payload}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def greedy_decode_tok_s(gen, prompt: list[int], n_new: int) -> float:
    """Decode speed of one greedy job on a Generator: tokens after the first over the time since
    the first token arrived (the prompt's prefill is not counted)."""
    from exl_core.generation import Job
    from exl_core.generation.sampling import SamplerSettings
    gen.enqueue(Job(prompt, max_new_tokens=n_new, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False))
    t_first, n = None, 0
    while gen.has_work():
        for r in gen.iterate():
            n += len(r.token_ids)
            if t_first is None and r.token_ids:
                t_first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - t_first)


def spread(vals: list[float]) -> dict:
    """best (max), min and median of per-run values (higher is better)."""
    return {"best": max(vals), "min": min(vals), "median": statistics.median(vals)}


def repeated_runs_cli(script: str, runs: int, name: str) -> tuple:
    """Command line of a repeat driver: --runs, --name, then `-- ARGS` for bench/`script`.
    Returns (args, script arguments, the runs' JSON payloads)."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=runs)
    ap.add_argument("--name", default=name)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=f"arguments for {script} (after --)")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"]
    return args, rest, repeated_runs(script, rest, args.runs, args.name)


def repeated_runs(script: str, rest: list[str], runs: int, name: str) -> list[dict]:
    """Runs bench/`script` `runs` times, each a fresh process writing results NAME_runI (its
    `--out`); returns their JSON payloads."""
    import subprocess
    import sys
    out = []
    for i in range(1, runs + 1):
        subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *rest, "--out", f"{name}_run{i}"],
                       check=True)
        out.append(json.loads((RESULTS / f"{name}_run{i}.json").read_text()))
    return out


def spread_rows(runs: list[dict], id_key: str, keys: tuple[str, ...]) -> list[dict]:
    """One row per row id (`id_key`) of the first run: every run's value of each key, and their
    spread as KEY_best / KEY_min / KEY_median."""
    rows = []
    for rid in [r[id_key] for r in runs[0]["rows"]]:
        per = [next(r for r in run["rows"] if r[id_key] == rid) for run in runs]
        row = {id_key: rid}
        for key in keys:
            vals = [p[key] for p in per if key in p]
            if vals:
                row[key] = vals
                row.update({f"{key}_{k}": v for k, v in spread(vals).items()})
        rows.append(row)
    return rows


def gpu_model_cli(doc: str, **options: tuple) -> tuple:
    """(args, model): a GPU probe's command line -- --model and `options` (name=(type, default), as --name) -- and the
    model loaded in fp16 on CUDA (no tokenizer)."""
    import torch

    from exl_core.loader import load_model
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    for name, (typ, default) in options.items():
        ap.add_argument("--" + name.replace("_", "-"), type=typ, default=default)
    a = ap.parse_args()
    model, _ = load_model(a.model, device="cuda", dtype=torch.float16, load_tokenizer=False)
    return a, model
