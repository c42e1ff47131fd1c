"""The hot loop of a CUDA kernel from its SASS, without a GPU: the largest backward branch's body, with an
instruction histogram (or the body itself), so a kernel change can be judged by the instructions a chunk costs
before device time is spent on it.

    nvcc -O3 -arch=sm_90 -cubin -o /tmp/k.cubin bench/gemv_probe.cu
    cuobjdump -sass -fun <mangled kernel name> /tmp/k.cubin > /tmp/k.sass
    python bench/sass_loop.py /tmp/k.sass [--print]

cuobjdump is not in the nvcc image used here; the PyPI wheels `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm`
carry it (pip download --no-deps, unzip, nvidia/cu13/bin). Counts are static: branches inside the loop (a group
change, a partial ring turn) are counted whole; read the body (--print) for the path a chunk executes.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,6})\*/\s*(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def parse(lines):
    """[(address, instruction text)] of a cuobjdump -sass listing."""
    out = []
    for line in lines:
        m = _INSTR.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def largest_loop(instrs):
    """The body [(address, text)] of the backward branch that spans the most instructions, or []."""
    best = None
    for addr, text in instrs:
        m = _BRANCH.search(text)
        if m:
            target = int(m.group(1), 16)
            if target < addr and (best is None or addr - target > best[0] - best[1]):
                best = (addr, target)
    if best is None:
        return []
    return [(a, t) for a, t in instrs if best[1] <= a <= best[0]]


def opcode(text: str) -> str:
    """The opcode without its predicate and modifiers: '@!P0 LDG.E.128.CONSTANT R4, ...' -> 'LDG'."""
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass", help="cuobjdump -sass output of one kernel")
    ap.add_argument("--print", action="store_true", help="print the loop body")
    args = ap.parse_args(argv)
    with open(args.sass) as f:
        body = largest_loop(parse(f))
    if not body:
        print(f"{args.sass}: no backward branch", file=sys.stderr)
        return 1
    if args.print:
        for addr, text in body:
            print(f"{addr:#06x}  {text}")
    counts = collections.Counter(opcode(t) for _, t in body)
    print(f"loop {body[0][0]:#x}..{body[-1][0]:#x}: {len(body)} instructions, "
          + ", ".join(f"{op} {n}" for op, n in counts.most_common(14)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
