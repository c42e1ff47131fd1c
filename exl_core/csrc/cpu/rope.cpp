// Rotary position embedding, HF Llama "rotate_half" convention (exl_core::rope).
//
//   q (T, Hq, D), k (T, Hkv, D), positions int64 [T], cos_sin fp32 [max_pos, D]
//   cos_sin[p] = cat(cos(p * inv_freq), sin(p * inv_freq)), each D/2 wide
//   out[i]       = x[i] * cos[i] - x[i + D/2] * sin[i]        (i < D/2)
//   out[i + D/2] = x[i + D/2] * cos[i] + x[i] * sin[i]
// fp32 math, result cast to x's dtype; new tensors are returned. Purely elementwise per
// token, so the result of a token never depends on the others.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_util.h"
#include "kernels.h"

namespace {

using namespace exl_cpu;

template <typename T>
EXL_AVX512 void heads_avx512(const T* x, T* out, const float* cs, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xr = x + h * D;
    T* o = out + h * D;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = half - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - i)) - 1u);
      const __m512 c = _mm512_maskz_loadu_ps(m, cs + i), s = _mm512_maskz_loadu_ps(m, cs + half + i);
      const __m512 x1 = load16(xr + i, m), x2 = load16(xr + half + i, m);
      // two products then the sum, as torch computes x*cos + rotate_half(x)*sin
      store16(o + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), m);
      store16(o + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), m);
    }
  }
}

template <typename T>
void heads_scalar(const T* x, T* out, const float* cs, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xr = x + h * D;
    T* o = out + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f(xr[i]), x2 = to_f(xr[half + i]), c = cs[i], s = cs[half + i];
      const float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
      o[i] = from_f<T>(a - b);
      o[half + i] = from_f<T>(e + f);
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const int64_t* pos, const float* cs, at::Tensor& qo,
         at::Tensor& ko) {
  const int64_t T_ = q.size(0), hq = q.size(1), hk = k.size(1), D = q.size(2);
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  T* qop = reinterpret_cast<T*>(qo.data_ptr());
  T* kop = reinterpret_cast<T*>(ko.data_ptr());
  const bool avx512 = cpu_isa() >= ISA_AVX512;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>((hq + hk) * D, 1));
  at::parallel_for(0, T_, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = cs + pos[t] * D;
      if (avx512) {
        heads_avx512<T>(qp + t * hq * D, qop + t * hq * D, row, hq, D);
        heads_avx512<T>(kp + t * hk * D, kop + t * hk * D, row, hk, D);
      } else {
        heads_scalar<T>(qp + t * hq * D, qop + t * hq * D, row, hq, D);
        heads_scalar<T>(kp + t * hk * D, kop + t * hk * D, row, hk, D);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                            const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.is_contiguous() && k.is_contiguous(),
              "exl_core::rope: q (T, Hq, D) and k (T, Hkv, D) must be contiguous 3-d tensors");
  const int64_t T_ = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T_ && k.size(2) == D, "exl_core::rope: k ", k.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(D % 2 == 0, "exl_core::rope: head dim ", D, " must be even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "exl_core::rope: q and k must both be float32 or both bfloat16");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T_ && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(), "exl_core::rope: positions must be contiguous int64 [T=", T_, "]");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) == D && cos_sin.scalar_type() == at::kFloat &&
                  cos_sin.is_contiguous(), "exl_core::rope: cos_sin must be contiguous float32 [max_pos, D=", D, "]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "exl_core::rope: position ", pos[t], " of token ", t,
                " outside the cos_sin table [0, ", max_pos, ")");
  at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);
  if (q.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(q, k, pos, cos_sin.data_ptr<float>(), qo, ko);
  else
    run<float>(q, k, pos, cos_sin.data_ptr<float>(), qo, ko);
  return {qo, ko};
}

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry point (kernels.h)
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                        const at::Tensor& cos_sin) {
  return rope_cpu(q, k, positions, cos_sin);
}
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("rope(Tensor q, Tensor k, Tensor positions, Tensor cos_sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) { m.impl("rope", &rope_cpu); }
