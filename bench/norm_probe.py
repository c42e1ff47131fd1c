"""The decode norms alone (GPU): exl_core::rms_norm_static (GPTQ's plain norm) against exl_core::rms_norm_perm (EXL2's
norm writing its consumer's act-order), lean and regular instances (P16, stop 65, lost and removed), random and
identity perm, P = H and P > H, at 1 / 8 / 32 rows of H = 4096 with a residual -- us a launch in a CUDA graph of
back-to-back launches (each launch's PDL wait holds it until the one before has finished, so the figure is a launch's
own span, not the step's).

Why: at batch 32 the EXL2 step's two permuted norms add ~2 us a layer each over GPTQ's plain norms (stop 59's
timeline: 4.63 / 5.08 against 2.65 / 3.26); this says whether the kernel itself costs that or its neighbours do.
--between-wg (sm_90): the same norms at 32 rows between two launches of the batch-32 stream-K kernel
(exl_core::qgemm_wg_decode, three 4,096 x 4,096 uniform 4-bit weights, as q/k/v), against the two launches alone: what
a norm adds next to the kernels it sits between in a decode step (stop 61: alone the permuted norm costs 0.32-0.58 us
more than the plain one, in the step ~1.8 us more).

    python bench/norm_probe.py [--between-wg] [--json bench/results/norm_probe_h200.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us, truncate as trunc  # noqa: E402

from exl_core.ops.dispatch import has_cuda_kernel  # noqa: E402


def per_iteration_us(fns, n: int = 200) -> float:
    """us an iteration of fns (launched in order) in a CUDA graph of n iterations (bench/common.py graph_us). Stop 61's
    committed figures (norm_probe_h200_stop61_call2_44d0e6e.json) came from this file's earlier timer: the median of
    15 replays instead of the mean of 30."""
    return graph_us(list(fns) * n) * len(fns)


def between_wg(H: int, w: torch.Tensor, perms: dict, gen: torch.Generator) -> list[dict]:
    """us an iteration of [stream-K launch, norm, stream-K launch] minus [stream-K launch, stream-K launch], 32 rows."""
    from exl_core.ops.cuda_candidates import chunk_table
    if torch.cuda.get_device_capability()[0] != 9 or not has_cuda_kernel("qgemm_wg_decode"):
        print("between-wg: needs an sm_90 GPU and exl_core::qgemm_wg_decode")
        return []
    dev, G, N = torch.device("cuda"), H // 128, 4096
    groups = torch.tensor([(4, 128 * g, 128, 16 * g) for g in range(G)], dtype=torch.int32)
    chunks = [chunk_table(groups, dev)] * 3
    qs = [torch.randint(-2**31, 2**31, (H // 8, N), generator=gen, dtype=torch.int64).to(torch.int32).to(dev)
          for _ in range(3)]
    scales = [(torch.rand(G, N, generator=gen) * 0.002 + 0.001).to(dev) for _ in range(3)]
    zeros = [torch.full((G, N), 8.0, device=dev) for _ in range(3)]
    x = torch.randn(32, H, generator=gen).half().to(dev)
    res = torch.randn(32, H, generator=gen).half().to(dev)
    ops = torch.ops.exl_core
    wg = lambda: ops.qgemm_wg_decode(x, qs, chunks, scales, zeros, 1)      # the ordered finish, the default
    norms = {"plain (rms_norm_static)": lambda: ops.rms_norm_static(x, res, w, 1e-5)}
    for pname, p in perms.items():
        norms[f"perm lean {pname}"] = lambda p=p: ops.rms_norm_perm(x, res, w, 1e-5, p, False, True)
    big = perms[max(perms, key=lambda k: perms[k].numel())]
    # the other instances there (stop 64; its call 3 also padded the plain norm with unused shared memory, 8 and 25
    # KB: +0.09-0.13 us, so that knob was removed -- NOTES.md, "forty-fourth")
    norms["perm regular (P max)"] = lambda: ops.rms_norm_perm(x, res, w, 1e-5, big, False, False)
    out, base = [], per_iteration_us([wg, wg], n=50)
    print(f"  32  two stream-K launches alone            {trunc(base):>10.2f} (us an iteration)")
    for name, fn in norms.items():
        us = per_iteration_us([wg, fn, wg], n=50) - base
        out.append({"rows": 32, "case": f"between stream-K: {name}", "us_per_launch": trunc(us),
                    "two_wg_alone_us": trunc(base)})
        print(f"  32  between stream-K: {name:<22} {trunc(us):>10.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--extra", type=int, default=256,
                    help="P - H of the P > H cases (the uniform-4 rewrite's extra rows)")
    ap.add_argument("--between-wg", action="store_true", help="also at 32 rows between two stream-K launches")
    args = ap.parse_args()
    H, dev = args.hidden, torch.device("cuda")
    for op in ("rms_norm_static", "rms_norm_perm"):     # also loads the extension (exl_core.ops.dispatch)
        if not has_cuda_kernel(op):
            raise SystemExit(f"norm_probe: the extension has no CUDA kernel for exl_core::{op}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.rand(H, generator=gen) + 0.5).half().to(dev)
    ident = torch.arange(H, dtype=torch.int32, device=dev)
    rand = torch.randperm(H, generator=gen).to(torch.int32).to(dev)
    extra = torch.randint(0, H, (args.extra,), generator=gen).to(torch.int32).to(dev)
    perms = {"ident_P=H": ident, "rand_P=H": rand, f"rand_P=H+{args.extra}": torch.cat([rand, extra])}
    ops = torch.ops.exl_core
    rows_out = []
    print(f"{'rows':>4}  {'case':<34} {'us/launch':>10}")
    for rows in (1, 8, 32):
        x = torch.randn(rows, H, generator=gen).half().to(dev)
        res = torch.randn(rows, H, generator=gen).half().to(dev)
        cases = {"plain (rms_norm_static)": lambda: ops.rms_norm_static(x, res, w, 1e-5)}
        for pname, p in perms.items():
            for lean in (True, False):
                cases[f"perm {'lean' if lean else 'regular'} {pname}"] = (
                    lambda p=p, lean=lean: ops.rms_norm_perm(x, res, w, 1e-5, p, False, lean))
        for name, fn in cases.items():
            us = per_iteration_us([fn])
            rows_out.append({"rows": rows, "case": name, "us_per_launch": trunc(us)})
            print(f"{rows:>4}  {name:<34} {trunc(us):>10.2f}")
    if args.between_wg:
        rows_out += between_wg(H, w, perms, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": H,
                       "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
