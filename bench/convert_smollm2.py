"""Does the converter keep SmolLM2-135M usable from 2.5 to 8 bpw, and does self-calibration hold up?

Converts the dense SmolLM2-135M-Instruct import on CPU to EXL2 at 2.5/3/4/5/6/8 bpw (one
measurement, reused with -m) and to GPTQ 4-bit g128, loads every folder with
exl_core.loader.load_model and measures perplexity on held-out text: the docstrings of a fixed
list of Python standard-library modules (text in neither calibration source: the default
self-sampled text, nor /work/shared/data). It also calibrates GPTQ 4-bit and EXL2 4.0 on
calib_c4.utf8 to compare the self-calibration default against real web text.

    python bench/convert_smollm2.py [--work DIR] [--rows 16] [--length 256] [--ctx 512] [--windows 8]

Every step's result is kept in bench/results/convert_smollm2.json; rerunning skips finished
steps (conversions are resumable too). Prints a table at the end.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from exl_core.default_model import default_dense_path  # noqa: E402
from exl_core.eval.perplexity import perplexity  # noqa: E402
from exl_core.loader import load_model  # noqa: E402
from exl_core.quantize.convert import ConvertSettings, convert  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "convert_smollm2.json"
C4 = Path("/work/shared/data/calib_c4.utf8")
DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
               "decimal", "difflib", "email.message", "enum", "fractions", "functools", "heapq",
               "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "os", "pathlib",
               "pickle", "random", "re", "shutil", "sqlite3", "statistics", "string", "subprocess",
               "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile")
EXL2_BPW = (2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
RUN_ORDER = (4.0, 2.5, 8.0, 3.0, 5.0, 6.0)   # acceptance extremes first


def heldout_text() -> str:
    """Module, class and function docstrings of DOC_MODULES, in a fixed order."""
    parts = []
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        if mod.__doc__:
            parts.append(mod.__doc__.strip())
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            doc = getattr(obj, "__doc__", None)
            if (callable(obj) or isinstance(obj, type)) and isinstance(doc, str) and len(doc) > 200 \
                    and getattr(obj, "__module__", "").startswith(name.split(".")[0]):
                parts.append(doc.strip())
    return "\n\n".join(dict.fromkeys(parts))


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.glob("*.safetensors"))


def load_results() -> dict:
    if RESULTS.is_file():
        return json.loads(RESULTS.read_text())
    return {}


def save_results(res: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, sort_keys=True))
    tmp.replace(RESULTS)


def ship_measurement(src: Path) -> None:
    """The default model's first-use conversion reuses this measurement (same dense import, same
    default calibration) and runs only the quantization pass; keep what allocation reads."""
    from exl_core.default_model import DEFAULT_CONVERSION, SHIPPED_MEASUREMENT
    data = json.loads(src.read_text())
    cal = data["info"].get("calibration", {})
    assert (cal.get("dataset"), cal.get("rows"), cal.get("length"), cal.get("seed")) == \
        ("self", DEFAULT_CONVERSION["rows"], DEFAULT_CONVERSION["length"], DEFAULT_CONVERSION["seed"]), cal
    keep = ("shape", "numel", "bits", "err", "fixed")
    data["layers"] = {n: {k: v for k, v in r.items() if k in keep} for n, r in data["layers"].items()}
    # the calibration tokens too (sampling them is most of a first use's time), and which import
    from exl_core.default_model import default_dense_path
    from exl_core.formats.gguf_import import MARKER_NAME
    from exl_core.quantize.calibration import cached_self_calibration
    from exl_core.quantize.source import DenseSource
    dense = default_dense_path(progress=False)
    c = DEFAULT_CONVERSION
    cal_tok = cached_self_calibration(DenseSource(dense), c["rows"], c["length"], seed=c["seed"], progress=False)
    assert cal_tok.info == cal, (cal_tok.info, cal)
    data["default_calibration"] = {"tokens": cal_tok.tokens.tolist(), "info": cal_tok.info,
                                   "dense": json.loads((dense / MARKER_NAME).read_text())}
    SHIPPED_MEASUREMENT.parent.mkdir(exist_ok=True)
    SHIPPED_MEASUREMENT.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")))
    print(f"wrote {SHIPPED_MEASUREMENT} ({SHIPPED_MEASUREMENT.stat().st_size} bytes)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/exl_bench/convert_smollm2")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="step names to run (default: all)")
    ap.add_argument("--ship-measurement", action="store_true",
                    help="copy the exl2_4.0 measurement (trimmed) to exl_core/data for the default model")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    dense = default_dense_path(progress=False)
    text = heldout_text()
    (work / "heldout.txt").write_text(text)

    res = load_results()
    setup = {"rows": a.rows, "length": a.length, "ctx": a.ctx, "windows": a.windows, "threads": a.threads}
    if res.get("setup") != setup:
        res = {"setup": setup}
    res["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}"
    res["eval_text"] = f"docstrings of {len(DOC_MODULES)} Python {platform.python_version()} stdlib modules, " \
                       f"{len(text)} chars"
    steps = res.setdefault("steps", {})
    ids_cache = {}

    def ppl_of(folder: Path) -> dict:
        model, tok = load_model(folder)
        if "ids" not in ids_cache:
            ids_cache["ids"] = tok.encode(text, add_bos=False, special=False)
        t = time.time()
        r = perplexity(model, ids_cache["ids"], ctx=a.ctx, max_windows=a.windows)
        return {"ppl": r.ppl, "tokens": r.tokens, "windows": r.windows, "eval_s": round(time.time() - t, 1)}

    def step(name, fn):
        if a.only and name not in a.only:
            return
        if name in steps:
            print(f"[skip] {name}: {steps[name]}")
            return
        t = time.time()
        print(f"[run] {name}", flush=True)
        steps[name] = dict(fn(), wall_s=round(time.time() - t, 1))
        save_results(res)
        print(f"[done] {name}: {steps[name]}", flush=True)

    def conv(name, **kw):
        out = work / name
        s = ConvertSettings(input=str(dense), output=str(out), rows=a.rows, length=a.length,
                            threads=a.threads, **kw)
        timing = work / f"{name}.convert_s.json"      # kept beside the folder: an eval rerun keeps it
        if not (out / "config.json").is_file():
            t = time.time()
            qc = convert(s)
            secs = round(time.time() - t, 1)
            timing.write_text(json.dumps(secs))
        else:
            qc = json.loads((out / "config.json").read_text())["quantization_config"]
            secs = json.loads(timing.read_text()) if timing.is_file() else None
        r = {"bpw_target": kw.get("bpw"), "real_bpw": qc["real_bpw"], "file_bytes": folder_bytes(out),
             "convert_s": secs, "calibration": qc["calibration"]}
        r.update(ppl_of(out))
        return r

    step("dense", lambda: dict(ppl_of(dense), file_bytes=folder_bytes(dense), real_bpw=16.0))
    step("exl2_4.0", lambda: conv("exl2_4.0", format="exl2", bpw=4.0))
    meas = str(work / "exl2_4.0" / "measurement.json")
    for b in RUN_ORDER:
        if b != 4.0:
            step(f"exl2_{b}", lambda b=b: conv(f"exl2_{b}", format="exl2", bpw=b, measurement=meas))
    step("gptq_4b_g128", lambda: conv("gptq_4b_g128", format="gptq", bits=4, group_size=128))
    step("gptq_4b_g128_c4", lambda: conv("gptq_4b_g128_c4", format="gptq", bits=4, group_size=128, calib=str(C4)))
    step("exl2_4.0_c4", lambda: conv("exl2_4.0_c4", format="exl2", bpw=4.0, calib=str(C4)))

    if a.ship_measurement:
        ship_measurement(work / "exl2_4.0" / "measurement.json")
    dense_ppl = steps.get("dense", {}).get("ppl")
    print(f"\n{'step':<18}{'bpw':>7}{'MB':>9}{'ppl':>10}{'vs dense':>10}{'conv s':>9}")
    for name, r in steps.items():
        rel = f"{(r['ppl'] / dense_ppl - 1) * 100:+.1f}%" if dense_ppl else "-"
        print(f"{name:<18}{r['real_bpw']:>7.3f}{r['file_bytes'] / 1e6:>9.1f}{r['ppl']:>10.3f}{rel:>10}"
              f"{str(r.get('convert_s', '-')):>9}")
    exl = [steps[f"exl2_{b}"]["ppl"] for b in EXL2_BPW if f"exl2_{b}" in steps]
    res["monotonic"] = all(x > y for x, y in zip(exl, exl[1:])) if len(exl) == len(EXL2_BPW) else None
    if dense_ppl:
        res["relative_ppl"] = {k: round(v["ppl"] / dense_ppl - 1, 4) for k, v in steps.items()}
    save_results(res)
    return 0 if all(math.isfinite(v["ppl"]) for v in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
