// SwiGLU gate: silu(gate) * up with HF semantics (exl_core::silu_mul).
//
//   gate, up (..., I) same dtype and shape -> (..., I)
// Like torch on bf16 tensors, silu(gate) is rounded to the input dtype before the product,
// and the product is rounded again; fp32 math in between. Elementwise, so chunking over
// threads cannot change any value.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_util.h"
#include "kernels.h"

namespace {

using namespace exl_cpu;

template <typename T>
EXL_AVX512 void span_avx512(const T* g, const T* u, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
    const __m512 x = load16(g + i, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));       // exp(-x)
    const __m512 s = round_as(_mm512_div_ps(x, _mm512_add_ps(one, e)), (T*)nullptr);
    store16(out + i, _mm512_mul_ps(s, load16(u + i, m)), m);
  }
}

template <typename T>
void span_scalar(const T* g, const T* u, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f(g[i]);
    const float s = to_f(from_f<T>(x / (1.0f + std::exp(-x))));
    out[i] = from_f<T>(s * to_f(u[i]));
  }
}

template <typename T>
void run(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const T* g = reinterpret_cast<const T*>(gate.data_ptr());
  const T* u = reinterpret_cast<const T*>(up.data_ptr());
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const bool avx512 = cpu_isa() >= ISA_AVX512;
  constexpr int64_t CHUNK = 4096;  // multiple of 16: every chunk but the last is whole vectors
  const int64_t n = gate.numel(), chunks = (n + CHUNK - 1) / CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * CHUNK, len = std::min(CHUNK, n - i0);
      if (avx512)
        span_avx512<T>(g + i0, u + i0, o + i0, len);
      else
        span_scalar<T>(g + i0, u + i0, o + i0, len);
    }
  });
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "exl_core::silu_mul: gate ", gate.sizes(), " and up ", up.sizes(),
              " shapes differ");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              "exl_core::silu_mul: gate and up must both be float32 or both bfloat16");
  TORCH_CHECK(gate.is_contiguous() && up.is_contiguous(), "exl_core::silu_mul: gate and up must be contiguous");
  at::Tensor out = at::empty_like(gate);
  if (gate.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(gate, up, out);
  else
    run<float>(gate, up, out);
  return out;
}

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry point (kernels.h)
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) { return silu_mul_cpu(gate, up); }
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) { m.def("silu_mul(Tensor gate, Tensor up) -> Tensor"); }

TORCH_LIBRARY_IMPL(exl_core, CPU, m) { m.impl("silu_mul", &silu_mul_cpu); }
