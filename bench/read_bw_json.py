"""Turns bench/read_bw.cu's printed table (stdin) into bench/results/read_bw_h200.json (and $OUT/).

    /tmp/read_bw | python bench/read_bw_json.py [--gpu NAME]      # bench/gpu.sh phase readbw
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROW = re.compile(r"(?P<what>ldg|gptq|bulk)\b(?P<cfg>[^:]*):(?P<rest>.*)")
CELL = re.compile(r"(?:(?P<name>[A-Za-z0-9=]+)\s+)?(?P<us>[0-9.]+) us\s+(?P<gbs>[0-9.]+)(?: GB/s)?")


def parse(lines) -> list[dict]:
    rows, size_mb = [], None
    for line in lines:
        if line.startswith("--- "):
            size_mb = int(line.split()[1])
            continue
        m = ROW.match(line.strip())
        if not m:
            continue
        for part in m["rest"].split("|"):
            c = CELL.search(part)
            if c:
                rows.append({"mb_per_call": size_mb, "method": m["what"], "config": (m["cfg"].strip() + " " +
                             (c["name"] or "")).strip(), "us": float(c["us"]), "gb_s": float(c["gbs"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default=None, help="GPU name when not run on it (default: torch's device name)")
    a = ap.parse_args()
    text = sys.stdin.read()
    sys.stdout.write(text)
    gpu = a.gpu
    if gpu is None:
        import torch
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown"
    out = {"benchmark": "read_bw", "gpu": gpu, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "what": "read-only GB/s by access method, 16 distinct buffers per CUDA graph, median of 10 replays",
           "rows": parse(text.splitlines())}
    body = json.dumps(out, indent=1) + "\n"
    path = Path(__file__).parent / "results" / "read_bw_h200.json"
    path.write_text(body)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(body)


if __name__ == "__main__":
    main()
