// exl_core::qmatmul on CUDA over the PackedWeight layout (exl_core/formats/packed.py).
//
// Every 32 rows of K ("a chunk") of one group occupy exactly `bits` consecutive qweight rows,
// so the kernels walk a chunk table int32 [K/32, 3] = (bits, group, first qweight row) that
// the host builds once per weight (ops/cuda_candidates.py caches it on the device).
//
//   small M (<= 16):  fused dequantise-GEMV, split-K.  grid (N / (128*VEC), K-slices);
//                     thread t owns VEC adjacent columns (one 16-byte load per qweight row when
//                     VEC = 4), walks the chunks of its K-slice, x[:, perm] of the slice gathered
//                     into shared memory as fp32; each slice writes its partial sums to fp32
//                     [slices, M, N] and the finish kernel adds them in slice order (no atomics:
//                     deterministic, and the slicing does not depend on M, so batch invariant).
//   large M:          dequantise to W [K, N] in x's dtype (rows scattered back to original
//                     order through perm) and let cuBLAS multiply.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "act_device.cuh"
#include "dequant_kernel.cuh"
#include "l2_persist.cuh"
#include "pdl.cuh"

namespace {

constexpr int kThreads = 128;

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using exl_act::cvt;   // value conversions of the pointwise ops (act_device.cuh)
using exl_act::f32;
using exl_dequant::group_scale_zero;   // shared with the dequantise (dequant_kernel.cuh)
using exl_dequant::dequant_kernel;

// Loads VEC adjacent words of one qweight row (16 / 8 / 4 bytes).
template <int VEC>
__device__ __forceinline__ void load_words(const int32_t* p, uint32_t (&w)[VEC]) {
  if constexpr (VEC == 4) {
    const int4 v = __ldg(reinterpret_cast<const int4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (VEC == 2) {
    const int2 v = __ldg(reinterpret_cast<const int2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = __ldg(p);
  }
}

// One chunk (32 K rows) of BITS-bit values for VEC columns: acc[m][v] += x[m][i] * w[i][v].
template <int BITS, int M, int VEC>
__device__ __forceinline__ void gemv_chunk(const int32_t* qw, int64_t N, const float* xs, int xs_stride,
                                           const float (&s)[VEC], const float (&zs)[VEC], float (&acc)[M][VEC]) {
  uint32_t w[BITS][VEC];
#pragma unroll
  for (int j = 0; j < BITS; ++j) load_words<VEC>(qw + j * N, w[j]);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    float xv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) xv[m] = xs[m * xs_stride + i];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float wf = exl_dequant::chunk_value<BITS, VEC>(w, i, v, s[v], zs[v]);
#pragma unroll
      for (int m = 0; m < M; ++m) acc[m][v] = fmaf(xv[m], wf, acc[m][v]);
    }
  }
}

template <typename T, int M, int VEC>
__global__ void __launch_bounds__(kThreads) gemv_kernel(
    const T* __restrict__ x, int64_t m_rows, int64_t K, const int32_t* __restrict__ chunks, int64_t n_chunks,
    const int32_t* __restrict__ qweight, int64_t N, const float* __restrict__ scale, const float* __restrict__ zero,
    const int64_t* __restrict__ perm, int cpb, float* __restrict__ out) {
  extern __shared__ float xs[];                 // [M][cpb*32] fp32 slice of x[:, perm]
  const int L = cpb * 32;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * cpb;
  const int nc = static_cast<int>(min(static_cast<int64_t>(cpb), n_chunks - c0));
  const int64_t k0 = c0 * 32;
  for (int idx = threadIdx.x; idx < M * L; idx += kThreads) {
    const int m = idx / L, i = idx % L;
    float v = 0.f;                              // padded rows (m >= m_rows) and tail stay zero
    if (m < m_rows && i < nc * 32) {
      const int64_t k = k0 + i;
      const int64_t src = perm ? perm[k] : k;
      v = f32<T>(x[m * K + src]);
    }
    xs[idx] = v;
  }
  __syncthreads();
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  if (col >= N) return;
  float acc[M][VEC];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[m][v] = 0.f;
  for (int c = 0; c < nc; ++c) {
    const int bits = chunks[(c0 + c) * 3], g = chunks[(c0 + c) * 3 + 1], qrow = chunks[(c0 + c) * 3 + 2];
    float s[VEC], zs[VEC];
    group_scale_zero<VEC>(scale, zero, g, N, col, s, zs);
    const int32_t* qw = qweight + static_cast<int64_t>(qrow) * N + col;
    const float* xc = xs + c * 32;
    switch (bits) {
      case 4: gemv_chunk<4, M, VEC>(qw, N, xc, L, s, zs, acc); break;
      case 2: gemv_chunk<2, M, VEC>(qw, N, xc, L, s, zs, acc); break;
      case 3: gemv_chunk<3, M, VEC>(qw, N, xc, L, s, zs, acc); break;
      case 5: gemv_chunk<5, M, VEC>(qw, N, xc, L, s, zs, acc); break;
      case 6: gemv_chunk<6, M, VEC>(qw, N, xc, L, s, zs, acc); break;
      default: gemv_chunk<8, M, VEC>(qw, N, xc, L, s, zs, acc); break;
    }
  }
  float* slice = out + static_cast<int64_t>(blockIdx.y) * m_rows * N;   // this K-slice's [m_rows, N]
#pragma unroll
  for (int m = 0; m < M; ++m)
    if (m < m_rows)
#pragma unroll
      for (int v = 0; v < VEC; ++v) slice[m * N + col + v] = acc[m][v];
}

// y = sum of the K-slices' partials in slice order (+ bias).
template <typename T>
__global__ void finish_kernel(const float* __restrict__ part, int64_t slices, const T* __restrict__ bias,
                              int64_t rows, int64_t N, T* __restrict__ y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * N) return;
  float v = 0.f;
  for (int64_t s = 0; s < slices; ++s) v += part[s * rows * N + i];
  if (bias) v += f32<T>(bias[i % N]);
  y[i] = cvt<T>(v);
}

// ----------------------------------------------------------------------------- host side

#define EXL_CHECK_CUDA_T(t, name) \
  TORCH_CHECK((t).is_cuda(), "exl_core::qmatmul (CUDA): ", name, " must be on the GPU, got ", (t).device())

void check_common(const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                  const at::Tensor& zero, const c10::optional<at::Tensor>& perm, int64_t K) {
  EXL_CHECK_CUDA_T(qweight, "qweight");
  EXL_CHECK_CUDA_T(chunks, "chunk table");
  EXL_CHECK_CUDA_T(scale, "scale");
  EXL_CHECK_CUDA_T(zero, "zero");
  TORCH_CHECK(qweight.dtype() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(),
              "exl_core::qmatmul (CUDA): qweight must be contiguous int32 [rows, N]");
  TORCH_CHECK(chunks.dtype() == at::kInt && chunks.dim() == 2 && chunks.size(1) == 3 && chunks.is_contiguous(),
              "exl_core::qmatmul (CUDA): chunk table must be contiguous int32 [K/32, 3]");
  TORCH_CHECK(chunks.size(0) * 32 == K, "exl_core::qmatmul (CUDA): chunk table covers ", chunks.size(0) * 32,
              " rows of K, x has K = ", K);
  const int64_t N = qweight.size(1);
  for (auto* t : {&scale, &zero})
    TORCH_CHECK(t->dtype() == at::kFloat && t->dim() == 2 && t->size(1) == N && t->is_contiguous(),
                "exl_core::qmatmul (CUDA): scale/zero must be contiguous float32 [G, ", N, "]");
  if (perm) {
    EXL_CHECK_CUDA_T(*perm, "perm");
    TORCH_CHECK(perm->dtype() == at::kLong && perm->numel() == K && perm->is_contiguous(),
                "exl_core::qmatmul (CUDA): perm must be contiguous int64 [", K, "]");
  }
}

constexpr int kMaxGemvRows = 16;

// K-slices of the GEMV: enough for ~4 blocks per SM, shared memory kMaxGemvRows*cpb*32*4 bytes under
// 32 KB. Independent of the number of rows, so every row is summed the same way whatever the batch.
int64_t gemv_chunks_per_slice(const at::Tensor& x, int64_t N, int64_t C) {
  const int sms = exl_pdl::device_sm(x.device().index(), false);
  const int64_t col_blocks = (N + kThreads * 4 - 1) / (kThreads * 4);
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(C, (4 * sms + col_blocks - 1) / col_blocks));
  return std::min<int64_t>((C + splits - 1) / splits, 32768 / (kMaxGemvRows * 32 * 4));
}

template <typename T, int M>
void launch_gemv_m(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                   const at::Tensor& zero, const int64_t* perm, int64_t cpb, at::Tensor& acc, cudaStream_t stream) {
  const int64_t K = x.size(1), N = qweight.size(1), C = chunks.size(0);
  // VEC = 4 needs 16-byte aligned rows; odd N falls back to one column per thread.
  const bool v4 = N % 4 == 0 && reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0;
  const int vec = v4 ? 4 : 1;
  const int64_t col_blocks = (N + kThreads * vec - 1) / (kThreads * vec);
  const int64_t splits = (C + cpb - 1) / cpb;
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits));
  const size_t smem = static_cast<size_t>(M) * cpb * 32 * sizeof(float);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  if (v4)
    gemv_kernel<T, M, 4><<<grid, kThreads, smem, stream>>>(xp, x.size(0), K, chunks.data_ptr<int32_t>(), C,
        qweight.data_ptr<int32_t>(), N, scale.data_ptr<float>(), zero.data_ptr<float>(), perm,
        static_cast<int>(cpb), acc.data_ptr<float>());
  else
    gemv_kernel<T, M, 1><<<grid, kThreads, smem, stream>>>(xp, x.size(0), K, chunks.data_ptr<int32_t>(), C,
        qweight.data_ptr<int32_t>(), N, scale.data_ptr<float>(), zero.data_ptr<float>(), perm,
        static_cast<int>(cpb), acc.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                 const at::Tensor& zero, const int64_t* perm, int64_t cpb, at::Tensor& acc, cudaStream_t stream) {
  const int64_t m = x.size(0);
  if (m <= 1) launch_gemv_m<T, 1>(x, qweight, chunks, scale, zero, perm, cpb, acc, stream);
  else if (m <= 2) launch_gemv_m<T, 2>(x, qweight, chunks, scale, zero, perm, cpb, acc, stream);
  else if (m <= 4) launch_gemv_m<T, 4>(x, qweight, chunks, scale, zero, perm, cpb, acc, stream);
  else if (m <= 8) launch_gemv_m<T, 8>(x, qweight, chunks, scale, zero, perm, cpb, acc, stream);
  else launch_gemv_m<T, kMaxGemvRows>(x, qweight, chunks, scale, zero, perm, cpb, acc, stream);
}

#define EXL_DISPATCH_FLOATS(dtype, NAME, ...)                                            \
  [&] {                                                                                  \
    if ((dtype) == at::kHalf) { using scalar_t = __half; return __VA_ARGS__(); }         \
    if ((dtype) == at::kBFloat16) { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); } \
    TORCH_CHECK((dtype) == at::kFloat, NAME, ": x must be float16, bfloat16 or float32, got ", dtype); \
    using scalar_t = float; return __VA_ARGS__();                                        \
  }()

// y [M, N] = x[:, perm] @ W_perm (+ bias) with the fused kernel, M <= 16 rows per launch.
at::Tensor qgemv_chunks(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks,
                        const at::Tensor& scale, const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                        const c10::optional<at::Tensor>& bias) {
  EXL_CHECK_CUDA_T(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "exl_core::qgemv_chunks: x must be contiguous [M, K]");
  check_common(qweight, chunks, scale, zero, perm, x.size(1));
  const int64_t M = x.size(0), N = qweight.size(1);
  if (bias) TORCH_CHECK(bias->numel() == N && bias->dtype() == x.dtype() && bias->is_cuda(),
                        "exl_core::qgemv_chunks: bias must be [", N, "] in x's dtype on the GPU");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t C = chunks.size(0), cpb = gemv_chunks_per_slice(x, N, C), slices = (C + cpb - 1) / cpb;
  auto part = at::empty({slices, std::min<int64_t>(M, kMaxGemvRows), N}, x.options().dtype(at::kFloat));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* pp = perm ? perm->data_ptr<int64_t>() : nullptr;
  EXL_DISPATCH_FLOATS(x.scalar_type(), "exl_core::qgemv_chunks", [&] {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxGemvRows) {
      const int64_t r = std::min<int64_t>(kMaxGemvRows, M - r0);
      launch_gemv<scalar_t>(x.narrow(0, r0, r), qweight, chunks, scale, zero, pp, cpb, part, stream);
      const int64_t total = r * N;
      finish_kernel<scalar_t><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
          part.data_ptr<float>(), slices, bias ? reinterpret_cast<const scalar_t*>(bias->data_ptr()) : nullptr, r,
          N, reinterpret_cast<scalar_t*>(y.data_ptr()) + r0 * N);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return y;
}

template <typename T>
void launch_dequant(bool vec8, int64_t n_chunks, cudaStream_t stream, int dev, const int32_t* ch, const int32_t* qp,
                    int64_t ldq, int64_t N, const float* sp, const float* zp, const int64_t* pp, T* out,
                    const int32_t* twin, bool uniform4, bool l2) {
  exl_dequant::DequantMats mats{};
  mats.n = 1;
  mats.ldw = N;
  mats.m[0] = exl_dequant::DequantMat{ch, qp, sp, zp, pp, out, ldq, N, twin};
  using namespace exl_dequant;
  cudaLaunchConfig_t cfg = {};
  cfg.stream = stream;
  cudaLaunchAttribute window;     // l2: W persisting in L2 until the GEMM after has read it (l2_persist.cuh)
  if (l2 && exl_l2::window(window, out, static_cast<size_t>(n_chunks) * 32 * N * sizeof(T), dev)) {
    cfg.attrs = &window;
    cfg.numAttrs = 1;
  }
  if constexpr (!std::is_same<T, float>::value) {
    if (vec8) {
      cfg.gridDim = dim3(static_cast<unsigned>((N + 511) / 512), static_cast<unsigned>(n_chunks));
      cfg.blockDim = dim3(64);
      exl_pdl::launch_ex(cfg, dev, twin       ? dequant_kernel<T, 8, kTwin4>
                                   : uniform4 ? dequant_kernel<T, 8, kUniform4>
                                              : dequant_kernel<T, 8, kAnyWidth>, mats);
      return;
    }
  }
  cfg.gridDim = dim3(static_cast<unsigned>((N + 127) / 128), static_cast<unsigned>(n_chunks));
  cfg.blockDim = dim3(128);
  exl_pdl::launch_ex(cfg, dev, twin       ? dequant_kernel<T, 1, kTwin4>
                               : uniform4 ? dequant_kernel<T, 1, kUniform4>
                                          : dequant_kernel<T, 1, kAnyWidth>, mats);
}

// Checks qdequant_chunks' / qdequant_mm's weight arguments; returns K (W's rows).
int64_t dequant_rows(const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                     const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                     const c10::optional<at::Tensor>& twin) {
  check_common(qweight, chunks, scale, zero, c10::nullopt, chunks.size(0) * 32);
  if (twin) {
    EXL_CHECK_CUDA_T(*twin, "twin");
    TORCH_CHECK(twin->dtype() == at::kInt && twin->dim() == 1 && twin->is_contiguous() &&
                twin->size(0) <= chunks.size(0), "exl_core::qdequant_chunks: twin must be contiguous int32 [K/32] "
                "with at most the chunk table's ", chunks.size(0), " entries");
  }
  const int64_t K = (twin ? twin->size(0) : chunks.size(0)) * 32;
  if (perm) {
    EXL_CHECK_CUDA_T(*perm, "perm");
    TORCH_CHECK(perm->dtype() == at::kLong && perm->numel() == K && perm->is_contiguous(),
                "exl_core::qdequant_chunks: perm must be contiguous int64 [", K, "]");
  }
  return K;
}

// Columns [col0, col0 + W.size(1)) of the dequantised weight into W (contiguous [K, cols], checked by the caller).
void dequant_into(at::Tensor& W, const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                  const at::Tensor& zero, const c10::optional<at::Tensor>& perm, int64_t col0,
                  const c10::optional<at::Tensor>& twin, bool uniform4, bool l2) {
  const int64_t K = W.size(0), N = W.size(1), ldq = qweight.size(1);
  if (K == 0 || N == 0) return;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int dev = qweight.device().index();
  const int64_t* pp = perm ? perm->data_ptr<int64_t>() : nullptr;
  const int32_t* qp = qweight.data_ptr<int32_t>() + col0;
  const float *sp = scale.data_ptr<float>() + col0, *zp = zero.data_ptr<float>() + col0;
  // 16-byte word loads (qp aligned, rows ldq % 4 words apart) and W row stores (N % 8); scale/zero go per value
  const bool vec8 = W.scalar_type() != at::kFloat && N % 8 == 0 && ldq % 4 == 0 && is_aligned16(qp);
  const int32_t* ch = chunks.data_ptr<int32_t>();
  const int32_t* tw = twin ? twin->data_ptr<int32_t>() : nullptr;
  EXL_DISPATCH_FLOATS(W.scalar_type(), "exl_core::qdequant_chunks", [&] {
    launch_dequant<scalar_t>(vec8, K / 32, stream, dev, ch, qp, ldq, N, sp, zp, pp,
                             reinterpret_cast<scalar_t*>(W.data_ptr()), tw, uniform4, l2);
  });
}

// W [K, cols] in the original row order, dtype `dtype`: columns [col0, col0 + cols) of the dequantised
// weight (cols -1: to the end) for cuBLAS.  Large-M callers take wide weights in L2-sized column slices.
// twin (int32 [K / 32], a weight rewritten as uniform 4-bit rows, formats/uniform4.py): W has K = 32 x its length
// rows, chunk c's values plus, where twin[c] >= 0, those of chunk-table row twin[c] (the extra rows reading the same
// x columns in the same order), rounded once; perm then has K entries.  The kernel reads only a twin's words and
// zero: it takes the twin's scale as exactly 16x its chunk's (formats/uniform4.py).  The caller (ops/cuda_dequant.py
// twins_of) checked that every chunk is 4-bit, every twin inside the table and every twin's scale 16x its chunk's.
// uniform4: every chunk is 4-bit (the caller knows: uniform4), the instance without the width switch.  l2: W's lines
// persist in L2 (a GEMM reads W next: l2_persist.cuh).
at::Tensor qdequant_chunks(const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                           const at::Tensor& zero, const c10::optional<at::Tensor>& perm, at::ScalarType dtype,
                           int64_t col0, int64_t cols, const c10::optional<at::Tensor>& twin, bool uniform4,
                           bool l2) {
  const int64_t K = dequant_rows(qweight, chunks, scale, zero, perm, twin), ldq = qweight.size(1);
  if (cols < 0) cols = ldq - col0;
  TORCH_CHECK(col0 >= 0 && cols >= 0 && col0 + cols <= ldq, "exl_core::qdequant_chunks: columns [", col0, ", ",
              col0 + cols, ") outside the weight's ", ldq);
  const c10::cuda::CUDAGuard guard(qweight.device());
  auto W = at::empty({K, cols}, qweight.options().dtype(dtype));
  dequant_into(W, qweight, chunks, scale, zero, perm, col0, twin, uniform4, l2);
  return W;
}

// x [M, K] @ W (+ bias) in one call: the prompt's dequantise + cuBLAS without a Python round trip a slice.  Weights
// wider than 2 x `slice` columns go in slices of `slice` columns through one scratch [K, slice] (the L2-sized block
// each slice's dequantise writes and its GEMM reads), the GEMMs writing y's columns in place; narrower ones as one W.
// add_to [M, N] (no bias): add_to += x @ W in place (the GEMM's beta 1: the residual stream) and returned.
at::Tensor qdequant_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks,
                       const at::Tensor& scale, const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                       const c10::optional<at::Tensor>& twin, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& add_to, int64_t slice, bool uniform4, bool l2) {
  EXL_CHECK_CUDA_T(x, "x");
  const int64_t K = dequant_rows(qweight, chunks, scale, zero, perm, twin), N = qweight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_contiguous() && x.device() == qweight.device(),
              "exl_core::qdequant_mm: x must be contiguous [M, ", K, "] on the weight's device");
  TORCH_CHECK(slice > 0, "exl_core::qdequant_mm: slice must be positive, got ", slice);
  const int64_t M = x.size(0);
  if (bias) TORCH_CHECK(!add_to && bias->dim() == 1 && bias->numel() == N && bias->dtype() == x.dtype() &&
                        bias->device() == x.device(), "exl_core::qdequant_mm: bias must be [", N,
                        "] in x's dtype on x's device, and not with add_to");
  if (add_to) TORCH_CHECK(add_to->dim() == 2 && add_to->size(0) == M && add_to->size(1) == N &&
                          add_to->dtype() == x.dtype() && add_to->device() == x.device(),
                          "exl_core::qdequant_mm: add_to must be [", M, ", ", N, "] in x's dtype on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t step = N <= 2 * slice ? N : slice;
  auto scratch = at::empty({K * step}, x.options());              // step <= N
  at::Tensor y = add_to ? *add_to : at::empty({M, N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += step) {
    const int64_t cols = std::min(step, N - n0);
    auto W = scratch.narrow(0, 0, K * cols).view({K, cols});
    dequant_into(W, qweight, chunks, scale, zero, perm, n0, twin, uniform4, l2);
    auto ys = step == N ? y : y.narrow(1, n0, cols);
    if (add_to) ys.addmm_(x, W);
    else if (bias) at::addmm_out(ys, bias->narrow(0, n0, cols), x, W);
    else at::mm_out(ys, x, W);
  }
  return y;
}

// groups int32 [G, 4] (bits, k_start, k_len, qrow_start), on any device -> chunk table on `dev`.
at::Tensor chunk_table_cuda(const at::Tensor& groups, int64_t K, int64_t q_rows, c10::Device dev) {
  const auto g = groups.to(at::kCPU).contiguous();
  TORCH_CHECK(g.dtype() == at::kInt && g.dim() == 2 && g.size(1) == 4, "exl_core::qmatmul (CUDA): groups must be int32 [G, 4]");
  const int32_t* p = g.data_ptr<int32_t>();
  std::vector<int32_t> rows;
  int64_t ek = 0, eq = 0;
  for (int64_t i = 0; i < g.size(0); ++i) {
    const int32_t bits = p[4 * i], k_start = p[4 * i + 1], k_len = p[4 * i + 2], q_start = p[4 * i + 3];
    TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8,
                "exl_core::qmatmul (CUDA): groups[", i, "] has bit width ", bits, " (supported: 2,3,4,5,6,8)");
    TORCH_CHECK(k_start == ek && k_len > 0 && k_len % 32 == 0 && q_start == eq,
                "exl_core::qmatmul (CUDA): groups[", i, "] breaks the layout (expected k_start ", ek, ", qrow ", eq, ")");
    for (int64_t c = 0; c < k_len / 32; ++c) {
      rows.push_back(bits);
      rows.push_back(static_cast<int32_t>(i));
      rows.push_back(static_cast<int32_t>(q_start + c * bits));
    }
    ek += k_len;
    eq += static_cast<int64_t>(k_len) * bits / 32;
  }
  TORCH_CHECK(ek == K, "exl_core::qmatmul (CUDA): groups cover ", ek, " rows of K but x has K = ", K);
  TORCH_CHECK(eq == q_rows, "exl_core::qmatmul (CUDA): groups need ", eq, " qweight rows, qweight has ", q_rows);
  auto t = at::from_blob(rows.data(), {static_cast<int64_t>(rows.size() / 3), 3}, at::kInt).clone();
  return t.to(dev);
}

// The shared op schema (CPU twin in csrc/cpu/qmatmul.cpp); builds the chunk table per call.
at::Tensor qmatmul_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& groups,
                        const at::Tensor& scale, const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                        const c10::optional<at::Tensor>& bias) {
  EXL_CHECK_CUDA_T(x, "x");
  TORCH_CHECK(x.dim() == 2, "exl_core::qmatmul (CUDA): x must be [M, K]");
  const auto chunks = chunk_table_cuda(groups, x.size(1), qweight.size(0), x.device());
  const auto xc = x.contiguous();
  if (x.size(0) <= 16) return qgemv_chunks(xc, qweight, chunks, scale, zero, perm, bias);
  auto W = qdequant_chunks(qweight, chunks, scale, zero, perm, x.scalar_type(), 0, -1, c10::nullopt, false, false);
  auto y = at::matmul(xc, W);
  if (bias) y.add_(*bias);
  return y;
}

// Every persisting L2 line of the current device back to normal and its set-aside back to 0 (qdequant_chunks' l2
// leaves the last W's lines persisting and the set-aside raised): for A/B timings that switch the window off in one
// process.  Not stream-ordered: takes effect when it returns.
void l2_reset() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(exl_l2::release(dev));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("l2_reset() -> ()", &l2_reset);
  m.def("qgemv_chunks(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias) -> Tensor");
  m.def("qdequant_chunks(Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "ScalarType dtype, int col0=0, int cols=-1, Tensor? twin=None, bool uniform4=False, "
        "bool l2=False) -> Tensor");
  m.def("qdequant_mm(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? twin, Tensor? bias, Tensor(a!)? add_to, int slice, bool uniform4=False, bool l2=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qmatmul", &qmatmul_cuda);
  m.impl("qgemv_chunks", &qgemv_chunks);
  m.impl("qdequant_chunks", &qdequant_chunks);
  m.impl("qdequant_mm", &qdequant_mm);
}
