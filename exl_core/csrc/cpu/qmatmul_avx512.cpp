// AVX-512 (F/BW/VL/DQ + FMA) instance of the matmul kernels in simd.h.  Only compiled-in code
// for this file gets the target; it runs only when cpu_isa_level() says the CPU has it.
// Nothing from torch or the standard library is instantiated after the pragma (no code of
// ours with AVX-512 instructions can be shared with baseline translation units).
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "qmatmul.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi2")

namespace exl_cpu {
namespace isa_avx512 {

#include "simd_avx512_v.h"

#include "simd.h"

}  // namespace isa_avx512
}  // namespace exl_cpu
