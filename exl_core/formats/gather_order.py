"""Rows of act-order weights reordered inside their quantization groups so that the permuted norm's gather reads
fewer shared-memory bank conflicts.

The norm before q/k/v and gate/up writes x in the act-order those weights read (ops/norm_perm.py; on the GPU
csrc/cuda/pointwise_cuda.cu rms_norm_vec_kernel PERM): it stages the row in shared memory and gathers entry perm[p]
for output p. A warp's 32 reads of one step ("a class" of positions p) cost as many shared-memory wavefronts as the
largest number of distinct 4-byte words one bank holds among them; a random act-order costs ~3.5 (stop 61,
bench/gather_bank_order.py). Swapping rows inside a group -- a row's packed values and its perm entry together --
changes no product (a group shares one scale and zero), only which index sits at which position, so a greedy choice
of that order cuts the wavefronts (bench/gather_bank_order.py, H 4,096, 128-row groups: to 2.03-2.05 under the
kernel's `block` mapping, 1.25-1.73 under a `spread` one, the higher figures with the uniform-4 rewrite's twins).

Where the layers of a group share a permutation (loader.share_input_perms), one order serves them all. A weight
rewritten as uniform 4-bit rows (formats/uniform4.py) has, for each 5..8-bit group, an extra group reading the same
x columns in the same order (its twin): both take the same order, so the twin relation (qgemm_wide's TWIN) and a LoRA
merge's re-quantization in the file's layout (lora_requant.requantize_like) still hold.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from .bitpack import pack_stream, unpack_stream
from .packed import PackedWeight
from .uniform4 import extra_group_pairs

VEC_BYTES = 16                      # a thread's vector of the norm kernel's output
MAPPINGS = ("block", "spread")


def gather_classes(rows: int, elem_bytes: int, mapping: str = "block") -> np.ndarray:
    """The class (one warp-wide read step of the gather) of each of a row's `rows` output positions. `block`: the
    kernel's mapping, thread t of warp w at step (i, e) writes position V v + e, v = 32 w + t + 256 i; `spread`: lane
    l at step (c, e) writes vector v = l C + c, C = ceil(vectors / 32) (a step spans the whole row)."""
    if mapping not in MAPPINGS:
        raise ValueError(f"gather_classes: mapping {mapping!r}, expected one of {MAPPINGS}")
    vec = VEC_BYTES // elem_bytes
    p = np.arange(rows)
    v, e = p // vec, p % vec
    if mapping == "block":
        return (v // 32) * vec + e
    vectors = -(-rows // vec)
    cols = -(-vectors // 32)
    return (v % cols) * vec + e


def mean_wavefronts(perm, elem_bytes: int, mapping: str = "block") -> float:
    """Mean shared-memory wavefronts a gather step costs for this permutation (1.0: no bank conflict)."""
    idx = np.asarray(torch.as_tensor(perm).cpu(), dtype=np.int64)
    cls = gather_classes(len(idx), elem_bytes, mapping)
    words = idx * elem_bytes // 4
    cost = []
    for c in np.unique(cls):
        w = np.unique(words[cls == c])
        cost.append(np.bincount(w & 31, minlength=32).max())
    return float(np.mean(cost))


def bank_order(perm, segments: list[tuple[int, int]], twins: Optional[dict[int, int]] = None, elem_bytes: int = 2,
               mapping: str = "block") -> torch.Tensor:
    """sigma (int64, new position -> old position) that keeps every segment's rows inside it. segments: (start,
    length) covering the permutation; twins: a segment's start -> its twin segment's start (the same length and
    entries), which is given the same order. Greedy, position by position: the entry of the segment's remaining ones
    whose bank the position's class (and its twin's) has used least; a word the class already holds costs nothing."""
    idx = np.asarray(torch.as_tensor(perm).cpu(), dtype=np.int64)
    twins = twins or {}
    lengths = dict(segments)
    for s0, t0 in twins.items():
        if s0 not in lengths or lengths.get(t0) != lengths[s0] or \
                not np.array_equal(idx[t0:t0 + lengths[s0]], idx[s0:s0 + lengths[s0]]):
            raise ValueError(f"bank_order: segment at {t0} is not a twin of the one at {s0}")
    cls = gather_classes(len(idx), elem_bytes, mapping)
    words = idx * elem_bytes // 4
    sigma = np.arange(len(idx))
    used: dict[int, dict[int, set]] = {}
    followers = set(twins.values())
    for s0, n in segments:
        if s0 in followers:
            continue
        t0 = twins.get(s0)
        pool: list[dict[int, list[int]]] = [dict() for _ in range(32)]   # bank -> word -> offsets in the segment
        for k in range(n):
            w = int(words[s0 + k])
            pool[w & 31].setdefault(w, []).append(k)
        left = [sum(len(v) for v in b.values()) for b in pool]
        for k in range(n):
            seen = [used.setdefault(int(cls[s0 + k]), {})]
            if t0 is not None:
                seen.append(used.setdefault(int(cls[t0 + k]), {}))
            best = None
            for b in range(32):
                if not left[b]:
                    continue
                score = 0
                for s in seen:
                    held = s.get(b, ())
                    if held and not any(w in held for w in pool[b]):
                        score += len(held)
                key = (score, -left[b])
                if best is None or key < best[0]:
                    best = (key, b)
            b = best[1]
            # the word held by the most of the position's classes (then the most left), so a twin's class gains too
            w = max(pool[b], key=lambda x: (sum(x in s.get(b, ()) for s in seen), len(pool[b][x])))
            q = pool[b][w].pop()
            if not pool[b][w]:
                del pool[b][w]
            left[b] -= 1
            for s in seen:
                s.setdefault(b, set()).add(w)
            sigma[s0 + k] = s0 + q
            if t0 is not None:
                sigma[t0 + k] = t0 + q
    return torch.from_numpy(sigma)


def segments_and_twins(pw: PackedWeight) -> Optional[tuple[list[tuple[int, int]], dict[int, int]]]:
    """The groups of a uniform 4-bit weight as segments, and (for a uniform-4 rewrite with extra rows) each 5..8-bit
    group's twin: the extra group as_uniform4 appended for it. None where the weight is not all 4-bit groups, has no
    permutation, or its extra rows do not read their main group's columns in order (a layout this module does not
    know)."""
    groups = pw.groups.tolist()
    if pw.perm is None or any(b != 4 or q * 8 != k for b, k, _n, q in groups):   # 4-bit, packed in row order
        return None
    segs = [(k, n) for _b, k, n, _q in groups]
    twins: dict[int, int] = {}
    if pw.rows is not None:
        pairs = extra_group_pairs(pw)
        if pairs is None:
            return None
        for i, e in pairs:
            main, extra = groups[i], groups[e]
            if main[2] != extra[2] or not torch.equal(pw.perm[main[1]:main[1] + main[2]],
                                                      pw.perm[extra[1]:extra[1] + extra[2]]):
                return None
            twins[main[1]] = extra[1]
    return segs, twins


def reorder_rows(pw: PackedWeight, sigma: torch.Tensor, perm: Optional[torch.Tensor] = None) -> PackedWeight:
    """pw with its rows (packed values and perm entries) in the order sigma gives (new position -> old position),
    every row inside its group; all groups 4-bit, packed in row order. The same weight: dequantize_reference is
    unchanged. perm: pw.perm[sigma] already made (one tensor for the layers that share it)."""
    sig = sigma.to(torch.int64)
    qweight = pw.qweight.clone()
    for _b, k, n, q0 in pw.groups.tolist():                 # a group at a time: its int64 values only
        local = sig[k:k + n] - k
        if not torch.equal(local.sort().values, torch.arange(n, device=local.device)):
            raise ValueError(f"reorder_rows: sigma does not permute the group at rows {k}..{k + n - 1} within itself")
        words = n // 8
        vals = unpack_stream(pw.qweight[q0:q0 + words], 4, n)
        qweight[q0:q0 + words] = pack_stream(vals[local.to(vals.device)], 4)
    if perm is None:
        perm = pw.perm[sig.to(pw.perm.device)].contiguous()
    return dataclasses.replace(pw, qweight=qweight, perm=perm, meta=pw.portable_meta()).validate("gather order")
