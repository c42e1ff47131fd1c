# Generates the register-A wgmma wrappers (m64nNk16, f32 += f16 x f16) for qgemm_wg_kernel.cuh.
def wrapper(n):
    nacc = n // 2
    d = ", ".join(f"%{i}" for i in range(nacc))
    a = ", ".join(f"%{nacc + i}" for i in range(4))
    desc, sd = nacc + 4, nacc + 5
    lines = [f"__device__ __forceinline__ void wgmma_n{n}(float (&d)[{nacc}], const uint32_t (&a)[4], uint64_t desc, int accumulate) {{",
             "  asm volatile(",
             '      "{\\n.reg .pred p;\\n"',
             f'      "setp.ne.b32 p, %{sd}, 0;\\n"',
             f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 "']
    # the operand list, 8 per line
    ops = [f"%{i}" for i in range(nacc)]
    chunks = [", ".join(ops[i:i + 16]) for i in range(0, nacc, 16)]
    lines.append('      "{"')
    for j, c in enumerate(chunks):
        lines.append(f'      "{c}{"," if j < len(chunks) - 1 else ""}"')
    lines.append(f'      "}}, {{{a}}}, %{desc}, p, 1, 1, 0;\\n}}\\n"')
    outs = [f'"+f"(d[{i}])' for i in range(nacc)]
    lines.append("      : " + ",\n        ".join(", ".join(outs[i:i + 8]) for i in range(0, nacc, 8)))
    lines.append('      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));')
    lines.append("}")
    return "\n".join(lines)
if __name__ == "__main__":
    print(wrapper(128)); print(); print(wrapper(256))
