// RMSNorm with HF Llama semantics (exl_core::rms_norm, exl_core::rms_norm_residual).
//
//   x (rows, H), weight (H), same dtype   ->   weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
//   residual variant: h = x + residual (rounded to x's dtype) -> (rms_norm(h), h)
//
// One row per task; the sum of squares of a row is accumulated in a fixed lane order that
// depends only on H, so a row's result never depends on the other rows (batch invariance).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_util.h"
#include "kernels.h"

namespace {

using namespace exl_cpu;

// AVX-512 row: two accumulators over 32-wide steps, masked tail.
template <typename T>
EXL_AVX512 void row_avx512(const T* x, const T* res, const T* w, T* out, T* hout, int64_t H, float eps) {
  const T* src = x;
  if (res != nullptr) {  // h = x + residual, rounded to T, stored first (then re-read from L1)
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1u);
      store16(hout + i, _mm512_add_ps(load16(x + i, m), load16(res + i, m)), m);
    }
    src = hout;
  }
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= H; i += 32) {
    const __m512 v0 = load16(src + i), v1 = load16(src + i + 16);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  for (; i < H; i += 16) {
    const __mmask16 m = H - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - i)) - 1u);
    const __m512 v = load16(src + i, m);
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  const float ss = hsum16(_mm512_add_ps(a0, a1));
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(ss / (float)H + eps));
  for (int64_t j = 0; j < H; j += 16) {
    const __mmask16 m = H - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (H - j)) - 1u);
    const __m512 y = round_as(_mm512_mul_ps(load16(src + j, m), r), (T*)nullptr);  // HF: .to(dtype) first
    store16(out + j, _mm512_mul_ps(load16(w + j, m), y), m);
  }
}

// AVX2 row: two 8-wide accumulators, then a scalar tail (fixed order for a given H).
template <typename T>
EXL_AVX2 void row_avx2(const T* x, const T* res, const T* w, T* out, T* hout, int64_t H, float eps) {
  const T* src = x;
  const int64_t H8 = H - H % 8;
  if (res != nullptr) {
    for (int64_t i = 0; i < H8; i += 8) store8(hout + i, _mm256_add_ps(load8(x + i), load8(res + i)));
    for (int64_t i = H8; i < H; ++i) hout[i] = from_f<T>(to_f(x[i]) + to_f(res[i]));
    src = hout;
  }
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256 v0 = load8(src + i), v1 = load8(src + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  for (; i < H8; i += 8) {
    const __m256 v = load8(src + i);
    a0 = _mm256_fmadd_ps(v, v, a0);
  }
  float ss = hsum8(_mm256_add_ps(a0, a1));
  for (; i < H; ++i) ss += to_f(src[i]) * to_f(src[i]);
  const float rs = 1.0f / std::sqrt(ss / (float)H + eps);
  const __m256 r = _mm256_set1_ps(rs);
  for (int64_t j = 0; j < H8; j += 8) {
    const __m256 y = round_as8(_mm256_mul_ps(load8(src + j), r), (T*)nullptr);  // HF: .to(dtype) first
    store8(out + j, _mm256_mul_ps(load8(w + j), y));
  }
  for (int64_t j = H8; j < H; ++j) out[j] = from_f<T>(to_f(w[j]) * to_f(from_f<T>(to_f(src[j]) * rs)));
}

template <typename T>
void row_scalar(const T* x, const T* res, const T* w, T* out, T* hout, int64_t H, float eps) {
  const T* src = x;
  if (res != nullptr) {
    for (int64_t i = 0; i < H; ++i) hout[i] = from_f<T>(to_f(x[i]) + to_f(res[i]));
    src = hout;
  }
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += to_f(src[i]) * to_f(src[i]);
  const float r = 1.0f / std::sqrt(ss / (float)H + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(src[i]) * r)));
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor* res, const at::Tensor& w, at::Tensor& out, at::Tensor* hout,
         double eps) {
  const int64_t H = x.size(-1), rows = H ? x.numel() / H : 0;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* rp = res ? reinterpret_cast<const T*>(res->data_ptr()) : nullptr;
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  T* hp = hout ? reinterpret_cast<T*>(hout->data_ptr()) : nullptr;
  const int isa = cpu_isa();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t o = r * H;
      if (isa >= ISA_AVX512)
        row_avx512<T>(xp + o, rp ? rp + o : nullptr, wp, op + o, hp ? hp + o : nullptr, H, (float)eps);
      else if (isa >= ISA_AVX2)
        row_avx2<T>(xp + o, rp ? rp + o : nullptr, wp, op + o, hp ? hp + o : nullptr, H, (float)eps);
      else
        row_scalar<T>(xp + o, rp ? rp + o : nullptr, wp, op + o, hp ? hp + o : nullptr, H, (float)eps);
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), op, ": x must be contiguous with hidden size last");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(), op, ": weight must be [H=", x.size(-1),
              "], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), op, ": weight dtype ", w.scalar_type(), " differs from x ",
              x.scalar_type());
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "exl_core::rms_norm");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(x, nullptr, weight, out, nullptr, eps);
  else
    run<float>(x, nullptr, weight, out, nullptr, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_residual_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                        const at::Tensor& weight, double eps) {
  check(x, weight, "exl_core::rms_norm_residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "exl_core::rms_norm_residual: residual must be contiguous with x's shape and dtype");
  at::Tensor out = at::empty_like(x), h = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16)
    run<c10::BFloat16>(x, &residual, weight, out, &h, eps);
  else
    run<float>(x, &residual, weight, out, &h, eps);
  return {out, h};
}

}  // namespace

namespace exl_cpu::ops {  // plain C++ entry points (kernels.h)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_cpu(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  return rms_norm_residual_cpu(x, residual, weight, eps);
}
}  // namespace exl_cpu::ops

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_residual(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(exl_core, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_residual", &rms_norm_residual_cpu);
}
