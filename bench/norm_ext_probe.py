"""Which producers and consumers of the extended copy (EXL_CORE_NORM_FOLD_EXT, ops/norm_fold.py) act in one eager
decode step of the bench's 7B-shaped EXL2 rewrite, and why the others refuse (the dispatchers' reasons).

Stop 38 call 1: with the copy on, EXL2 batch 1 read 0.9808x of the default and the Generator's CUDA test saw one fold a
step where it expected 2L - 1 (o's add with the copy never ran): this says which check refuses, per batch.
    python bench/norm_ext_probe.py --exl2 DIR [--batch 1 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
from unittest import mock

import torch

import gpu_bench
from exl_core.model import linear, llama
from exl_core.ops import norm_fold


def _short(why) -> str:
    return "; ".join(f"{n}: {r}" for n, r in why if r is not None)[:300]


@torch.inference_mode()
def probe(model, B: int) -> dict:
    """Counts of each decision over one eager decode step (layers summed), with the first reason seen for each."""
    seen = collections.Counter()
    reasons: dict = {}
    real_ext, real_add, real_run = llama.ext_fold, llama.linear_add_ss_, linear.ExtFold.run

    def note(key, why=None):
        seen[key] += 1
        if why and key not in reasons:
            reasons[key] = why

    def ext_fold(residual, weight, eps, layers):
        out = real_ext(residual, weight, eps, layers)
        what = "gate/up" if len(layers) == 2 else "q/k/v"
        if out is None:
            perm = linear.shared_perm(layers)
            why = "no shared act-order" if perm is None else None
            if perm is not None:
                views = [linear.Prepermuted(m) for m in layers]
                copy = residual.new_empty((residual.shape[0], perm.numel()))
                why = _short(norm_fold.DISPATCH_MANY_NORMED.reasons(
                    residual=copy, weight=weight[perm.long()].contiguous(), eps=eps, ss=norm_fold.FOLD_QUERY,
                    pws=[v.packed for v in views], count=residual.shape[1]))
            note(f"ext_fold {what}: None", why)
        else:
            note(f"ext_fold {what}: made")
        return out

    def add_ss(residual, x, layer, up=None, ext=None):
        out = real_add(residual, x, layer, up, ext)
        what = f"{type(layer).__name__}{' +up' if up is not None else ''}{' +ext' if ext is not None else ''}"
        why = None
        if out is None and linear._plain_packed(layer):
            why = _short(norm_fold.DISPATCH_ADD_SS.reasons(residual=residual, x=x, pw=layer.packed, up=up,
                                                           ext=None if ext is None else (ext.copy, ext.places)))
        note(f"linear_add_ss_ {what}: {'None' if out is None else 'added'}", why)
        return out

    def run(self, eps, ss):
        note(f"ExtFold.run width {self.width}")
        return real_run(self, eps, ss)

    step, _, _ = gpu_bench.decode_graph(model, B, graphs=False)
    step()                                              # the copies' places are made on a first eager step
    torch.cuda.synchronize()
    with mock.patch.object(llama, "ext_fold", ext_fold), mock.patch.object(llama, "linear_add_ss_", add_ss), \
            mock.patch.object(linear.ExtFold, "run", run):
        step()
    torch.cuda.synchronize()
    return {"batch": B, "layers": len(model.layers), "counts": dict(seen), "reasons": reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exl2", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json")
    a = ap.parse_args()
    from exl_core.loader import load_model
    with mock.patch.dict(os.environ, {"EXL_CORE_EXL2_AS_U4": "1"}):
        model, _ = load_model(a.exl2, device="cuda", dtype=torch.float16, load_tokenizer=False)
    out = []
    with mock.patch.object(norm_fold, "NORM_FOLD_EXT", True):
        for B in a.batch:
            r = probe(model, B)
            out.append(r)
            print(f"-- batch {B} ({r['layers']} layers)")
            for k, v in sorted(r["counts"].items()):
                print(f"{v:5d}  {k}")
            for k, v in r["reasons"].items():
                print(f"why  {k}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"probe": "norm_ext", "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
