// CUDA implementations of the small ops whose schemas live in csrc/cpu (norm.cpp, activation.cpp,
// rope.cpp): one launch each instead of the 5-10 kernels of their torch references, which
// matters at batch 1 where every decode step is dominated by launch count.
// Rounding follows the torch references (HF semantics): values are rounded to x's dtype at the
// same points, math in fp32.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include "act_device.cuh"
#include "cp_async_device.cuh"
#include "pdl.cuh"

namespace {

using exl_act::cvt;
using exl_act::f32;

constexpr int kNormThreads = 256;

// rsqrt(mean(h^2) + eps) of a row from each thread's sum of squares (one block of kNormThreads per row).
__device__ __forceinline__ float rms_scale(float ss, int64_t H, float eps) {
  __shared__ float part[kNormThreads / 32];
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) tot += part[i];
  return rsqrtf(tot / static_cast<float>(H) + eps);
}

// One block per row. h = x (+ residual, rounded to T); y = w * T(h * rsqrt(mean(h^2) + eps)).
template <typename T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                                 const T* __restrict__ w, int64_t H, float eps,
                                                                 T* __restrict__ y, T* __restrict__ h_out,
                                                                 bool /*early_w: weight read after the wait here*/,
                                                                 const int32_t* /*perm, P: rms_norm_vec_kernel's only*/,
                                                                 int64_t, bool /*late: rms_norm_vec_kernel's only*/) {
  exl_pdl::pdl_wait();      // inputs come from the previous kernel (PDL, pdl.cuh)
  exl_pdl::pdl_trigger();
  const int64_t row = blockIdx.x;
  const T* xr = x + row * H;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < H; i += kNormThreads) {
    float v = f32<T>(xr[i]);
    if (res) {
      const T h = cvt<T>(v + f32<T>(res[row * H + i]));
      h_out[row * H + i] = h;
      v = f32<T>(h);
    }
    ss += v * v;
  }
  const float r = rms_scale(ss, H, eps);
  // With a residual, re-read h from h_out: the block's own writes are visible after the barrier.
  const T* src = res ? h_out + row * H : xr;
  for (int64_t i = threadIdx.x; i < H; i += kNormThreads)
    y[row * H + i] = cvt<T>(f32<T>(w[i]) * f32<T>(cvt<T>(f32<T>(src[i]) * r)));
}

// The same with 16-byte vectors kept in registers between the two passes (H * sizeof(T) % 16 == 0,
// aligned rows, H <= kNormThreads * NV * 16 / sizeof(T)): one read of x and residual instead of
// scalar loads and a re-read; per element the same roundings as rms_norm_kernel.
// PERM (exl_core::rms_norm_perm): y's row is written in the order perm (int32 [P]) gives,
// y[j] = norm(h)[perm[j]] -- the input order of act-order weights sharing perm, which then read x as it is instead of
// gathering it per launch or per block (P > H: weights with extra rows, formats/uniform4.py, whose perm repeats
// columns).  The values pass through shared memory (H values of T); perm's vectors are read before the PDL wait, as
// load-time data (pdl.cuh).
// late (PERM only): no early trigger, so the launch after it (PDL) starts as this one's blocks exit -- see
// ops/cuda_norm_perm.py.
// LEAN (PERM only): perm's entries go to shared memory by cp.async before the PDL wait (after the row's values, P
// int32) and into registers only once x's and the weight's vectors are dead: 48 registers a thread against 88 (see
// ops/cuda_norm_perm.py).
// An int16 perm read into registers (P16, stop 65) lost to this regular instance on the H200: EXL2 batch 32 0.9755x-
// 0.9843x (csrc/cuda/NOTES.md "forty-sixth"), and was removed.
template <typename T, int NV, bool PERM = false, bool LEAN = false>
__global__ void __launch_bounds__(kNormThreads) rms_norm_vec_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                                                     const T* __restrict__ w, int64_t H, float eps,
                                                                     T* __restrict__ y, T* __restrict__ h_out,
                                                                     bool early_w, const int32_t* __restrict__ perm,
                                                                     int64_t P, bool late) {
  constexpr int V = 16 / sizeof(T);
  const int64_t row = blockIdx.x, nvec = H / V, pvec = P / V;   // P: y's row length (H without PERM)
  static_assert(!LEAN || PERM, "lean: the permuted norm");
  int4 pv[PERM ? NV : 1][V / 4];                              // perm's entries for this thread's output vectors
  extern __shared__ __align__(16) unsigned char norm_smem[];
  T* ys = reinterpret_cast<T*>(norm_smem);                   // PERM: the row in natural order
  int4* ps = reinterpret_cast<int4*>(norm_smem + ((H * sizeof(T) + 15) & ~size_t(15)));   // LEAN: perm's entries
  // A thread's own vectors of perm: straight into registers, or (LEAN) into shared memory, read back by the same
  // thread (no barrier) after cp_async_wait_all.
  auto load_perm = [&](bool to_smem) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * kNormThreads;
#pragma unroll
      for (int q = 0; q < V / 4; ++q) {
        if (to_smem) {
          if (vi < pvec) cp_async16(ps + vi * (V / 4) + q, reinterpret_cast<const int4*>(perm + vi * V) + q);
        } else {
          pv[i][q] = vi < pvec ? (LEAN ? ps[vi * (V / 4) + q] : reinterpret_cast<const int4*>(perm + vi * V)[q])
                               : make_int4(0, 0, 0, 0);
        }
      }
    }
  };
  if constexpr (PERM) load_perm(LEAN);
  uint4 wv[NV];
  auto load_w = [&]() {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * kNormThreads;
      wv[i] = vi < nvec ? reinterpret_cast<const uint4*>(w)[vi] : make_uint4(0, 0, 0, 0);
    }
  };
  // early_w (exl_core::rms_norm_static: a model's norm weight, which no kernel of the step writes): the weight is
  // read before the PDL wait, its round trip overlapping the previous kernel instead of following the reduction.
  if (early_w) load_w();
  exl_pdl::pdl_wait();      // x and the residual come from the previous kernel (PDL, pdl.cuh)
  if (!PERM || !late) exl_pdl::pdl_trigger();
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * H);
  uint4 hv[NV];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * kNormThreads;
    if (vi >= nvec) break;
    hv[i] = xr[vi];
    T* hp = reinterpret_cast<T*>(&hv[i]);
    if (res) {
      const uint4 rv = reinterpret_cast<const uint4*>(res + row * H)[vi];
      const T* rp = reinterpret_cast<const T*>(&rv);
#pragma unroll
      for (int e = 0; e < V; ++e) hp[e] = cvt<T>(f32<T>(hp[e]) + f32<T>(rp[e]));
      reinterpret_cast<uint4*>(h_out + row * H)[vi] = hv[i];
    }
#pragma unroll
    for (int e = 0; e < V; ++e) ss += f32<T>(hp[e]) * f32<T>(hp[e]);
  }
  const float r = rms_scale(ss, H, eps);
  if (!early_w) load_w();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * kNormThreads;
    if (vi >= nvec) break;
    const T* wp = reinterpret_cast<const T*>(&wv[i]);
    T* hp = reinterpret_cast<T*>(&hv[i]);
#pragma unroll
    for (int e = 0; e < V; ++e) hp[e] = cvt<T>(f32<T>(wp[e]) * f32<T>(cvt<T>(f32<T>(hp[e]) * r)));
    if constexpr (PERM) reinterpret_cast<uint4*>(ys)[vi] = hv[i];
    else reinterpret_cast<uint4*>(y + row * H)[vi] = hv[i];
  }
  if constexpr (PERM) {
    if constexpr (LEAN) {                                     // x's and the weight's vectors are dead here
      cp_async_wait_all();
      load_perm(false);
    }
    __syncthreads();                                          // the row's values, all threads'
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * kNormThreads;
      if (vi >= pvec) break;
      uint4 o;
      T* op = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int e = 0; e < V; ++e) {                          // clamped: a bad perm gives wrong values, not a fault
        const unsigned j = static_cast<unsigned>(reinterpret_cast<const int*>(&pv[i][0])[e]);
        op[e] = ys[min(j, static_cast<unsigned>(H - 1))];
      }
      reinterpret_cast<uint4*>(y + row * P)[vi] = o;
    }
  }
}
constexpr int kNormVecs = 4;   // vectors per thread of rms_norm_vec_kernel

template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ g, const T* __restrict__ u, int64_t n, T* __restrict__ y) {
  exl_pdl::pdl_wait();      // inputs come from the previous kernel (PDL, pdl.cuh)
  exl_pdl::pdl_trigger();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = exl_act::silu_mul<T>(g[i], u[i]);                // F.silu rounds to T, then the product
}

// The same, 16 bytes of gate and up per thread (n % (16 / sizeof(T)) == 0, 16-byte aligned buffers).
template <typename T>
__global__ void silu_mul_vec_kernel(const T* __restrict__ g, const T* __restrict__ u, int64_t n_vec,
                                    T* __restrict__ y) {
  exl_pdl::pdl_wait();      // inputs come from the previous kernel (PDL, pdl.cuh)
  exl_pdl::pdl_trigger();
  constexpr int V = 16 / sizeof(T);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_vec) return;
  const uint4 gv = reinterpret_cast<const uint4*>(g)[i], uv = reinterpret_cast<const uint4*>(u)[i];
  uint4 out;
  const T* gp = reinterpret_cast<const T*>(&gv);
  const T* up = reinterpret_cast<const T*>(&uv);
  T* op = reinterpret_cast<T*>(&out);
#pragma unroll
  for (int k = 0; k < V; ++k) op[k] = exl_act::silu_mul<T>(gp[k], up[k]);
  reinterpret_cast<uint4*>(y)[i] = out;
}

// x (T, H, D) -> out: pairs (i, i + D/2) rotated by cos_sin[positions[t]] (fp32 table [P, D]).
template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, int64_t rows, int64_t H, int64_t D,
                            const int64_t* __restrict__ pos, const float* __restrict__ cs, int64_t max_pos,
                            T* __restrict__ out) {
  exl_pdl::pdl_wait();      // inputs come from the previous kernel (PDL, pdl.cuh)
  exl_pdl::pdl_trigger();
  const int64_t half = D / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;   // over rows*H*half
  if (idx >= rows * H * half) return;
  const int64_t i = idx % half, th = idx / half, t = th / H;
  // The host does not range-check positions on the GPU (a sync per layer): a position outside
  // the table gives NaN rows instead of an out-of-bounds read.
  const int64_t p = pos[t];
  const bool ok = p >= 0 && p < max_pos;
  const float* c = cs + (ok ? p : 0) * D;
  const float cv = ok ? c[i] : __int_as_float(0x7fc00000), sv = c[half + i];
  const T* xr = x + th * D;
  const float x1 = f32<T>(xr[i]), x2 = f32<T>(xr[half + i]);
  out[th * D + i] = cvt<T>(exl_act::rope_lo(x1, x2, cv, sv));
  out[th * D + half + i] = cvt<T>(exl_act::rope_hi(x1, x2, cv, sv));
}

// q and k in one launch, 4 pairs per thread (8- or 16-byte loads): (T, Hq, D) and (T, Hk, D) contiguous,
// D % 8 == 0, rows aligned to 4 elements.  Same math and roundings as rope_kernel.
// With `slots` (exl_core::rope_kv_write, decode's K/V write fused in): k's rotated rows go to their cache slots
// (kc, (slots, Hk, D)) instead of ko, and a third range of threads copies v's rows to vc the same way; rows whose
// slot is outside the cache are skipped, as exl_core::kv_write skips them.
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };

template <typename T>
__global__ void rope_qk_vec_kernel(const T* __restrict__ q, T* __restrict__ qo, int64_t q_heads, int64_t Hq,
                                   const T* __restrict__ k, T* __restrict__ ko, int64_t k_heads, int64_t Hk, int D,
                                   const int64_t* __restrict__ pos, int64_t pos_stride, const float* __restrict__ cs,
                                   int64_t max_pos, const T* __restrict__ v, const int64_t* __restrict__ slots,
                                   int64_t num_slots,
                                   T* __restrict__ kc, T* __restrict__ vc) {
  exl_pdl::pdl_wait();      // inputs come from the previous kernel (PDL, pdl.cuh)
  exl_pdl::pdl_trigger();
  const int per_head = D / 8, half = D / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t head = idx / per_head;
  const int j = static_cast<int>(idx - head * per_head) * 4;
  const T* x = q;
  T* orow;                                                   // this head's output row
  int64_t H = Hq;
  if (head < q_heads) {
    orow = qo + head * D;
  } else {
    head -= q_heads;
    const bool is_v = head >= k_heads;
    if (is_v) head -= k_heads;
    if (head >= k_heads || (is_v && slots == nullptr)) return;
    x = is_v ? v : k, H = Hk;
    if (slots != nullptr) {
      const int64_t t = head / Hk, slot = slots[t];
      if (slot < 0 || slot >= num_slots) return;
      orow = (is_v ? vc : kc) + (slot * Hk + (head - t * Hk)) * D;
    } else {
      orow = ko + head * D;
    }
    if (is_v) {                                              // v: copied as it is
      *reinterpret_cast<Vec4<T>*>(orow + j) = *reinterpret_cast<const Vec4<T>*>(x + head * D + j);
      *reinterpret_cast<Vec4<T>*>(orow + half + j) = *reinterpret_cast<const Vec4<T>*>(x + head * D + half + j);
      return;
    }
  }
  const int64_t p = pos[head / H * pos_stride];              // stride 0: one position broadcast over the rows
  const bool ok = p >= 0 && p < max_pos;                     // out of the table: NaN rows (see rope_kernel)
  const float* c = cs + (ok ? p : 0) * D;
  const float4 cv = ok ? *reinterpret_cast<const float4*>(c + j) : make_float4(NAN, NAN, NAN, NAN);
  const float4 sv = *reinterpret_cast<const float4*>(c + half + j);
  const Vec4<T> a = *reinterpret_cast<const Vec4<T>*>(x + head * D + j);
  const Vec4<T> b = *reinterpret_cast<const Vec4<T>*>(x + head * D + half + j);
  Vec4<T> oa, ob;
  const float cc[4] = {cv.x, cv.y, cv.z, cv.w}, ss[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float x1 = f32<T>(a.v[e]), x2 = f32<T>(b.v[e]);
    oa.v[e] = cvt<T>(exl_act::rope_lo(x1, x2, cc[e], ss[e]));
    ob.v[e] = cvt<T>(exl_act::rope_hi(x1, x2, cc[e], ss[e]));
  }
  *reinterpret_cast<Vec4<T>*>(orow + j) = oa;
  *reinterpret_cast<Vec4<T>*>(orow + half + j) = ob;
}

#define EXL_PW_DISPATCH(dtype, NAME, ...)                                                   \
  [&] {                                                                                     \
    if ((dtype) == at::kHalf) { using scalar_t = __half; return __VA_ARGS__(); }            \
    if ((dtype) == at::kBFloat16) { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); } \
    TORCH_CHECK((dtype) == at::kFloat, NAME, ": dtype must be float16, bfloat16 or float32, got ", dtype); \
    using scalar_t = float; return __VA_ARGS__();                                           \
  }()

template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Every defined tensor's data is 16-byte aligned (the vector kernels' precondition).
bool aligned16(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts)
    if (t->defined() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  return true;
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* op, const char* na, const char* nb) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.device() == b.device(), op, ": ", na, " and ", nb,
              " must be on the same GPU");
  TORCH_CHECK(a.dtype() == b.dtype(), op, ": ", na, " is ", a.dtype(), " but ", nb, " is ", b.dtype());
}

// early_w: the weight is no output of the kernel just before (rms_norm_static) and is read before the PDL wait.
// perm (rms_norm_perm): int32 [P], P >= H, y's P columns written in that order (the vector kernel only: the caller
// checks its conditions).
// late / lean (perm only): no early PDL trigger / the LEAN instance -- the caller's policy (ops/cuda_norm_perm.py).
std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x_, const c10::optional<at::Tensor>& res_,
                                              const at::Tensor& w_, double eps, bool early_w = false,
                                              const at::Tensor* perm = nullptr, bool late = false, bool lean = false) {
  const char* op = perm ? "exl_core::rms_norm_perm (CUDA)" : "exl_core::rms_norm (CUDA)";
  check_same(x_, w_, op, "x", "weight");
  const int64_t H = x_.size(-1);
  TORCH_CHECK(w_.numel() == H, op, ": weight has ", w_.numel(), " elements, x's last dim is ", H);
  const auto x = x_.contiguous(), w = w_.contiguous();
  at::Tensor res, h;
  if (res_) {
    check_same(x_, *res_, op, "x", "residual");
    TORCH_CHECK(res_->sizes() == x_.sizes(), op, ": residual shape ", res_->sizes(), " differs from x ", x_.sizes());
    res = res_->contiguous();
    h = at::empty_like(x);
  }
  // perm: y's last dim is perm's length P (>= 1; weights with extra rows read some columns twice)
  std::vector<int64_t> yshape = x.sizes().vec();
  const int64_t P = perm ? perm->numel() : H;
  yshape.back() = P;
  auto y = perm ? at::empty(yshape, x.options()) : at::empty_like(x);
  const int64_t rows = H ? x.numel() / H : 0;
  if (rows == 0) return {y, h};
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = x.device().index();
  EXL_PW_DISPATCH(x.scalar_type(), op, [&] {
    constexpr int V = 16 / sizeof(scalar_t);
    bool vec = H % V == 0 && H <= static_cast<int64_t>(kNormThreads) * kNormVecs * V;
    vec = vec && aligned16({&x, &w, &y, &res, &h});
    const auto* xp = static_cast<const scalar_t*>(ptr<scalar_t>(x));
    const auto* rp = static_cast<const scalar_t*>(res_ ? ptr<scalar_t>(res) : nullptr);
    const auto* wp = static_cast<const scalar_t*>(ptr<scalar_t>(w));
    scalar_t* hp = res_ ? ptr<scalar_t>(h) : nullptr;
    const bool ew = early_w && w_.is_contiguous();
    if (perm) {
      const int64_t lim = static_cast<int64_t>(kNormThreads) * kNormVecs * V;
      TORCH_CHECK(vec && perm->is_cuda() && perm->device() == x.device() && perm->scalar_type() == at::kInt &&
                      perm->dim() == 1 && P % V == 0 && P <= lim && perm->is_contiguous() && aligned16({perm}),
                  op, ": needs contiguous, 16-byte aligned int32 perm on x's GPU of a length",
                  " P (", P, ") and H (", H, ") that are multiples of ", V, " up to ", lim, ", and aligned rows");
      // lean only where the row and perm fit the dynamic shared memory a launch gets without opting in (the
      // kernel's own 32 bytes aside): a request that does not fit takes the regular instance, the same bits
      const size_t row_smem = (static_cast<size_t>(H) * sizeof(scalar_t) + 15) & ~size_t(15);
      lean = lean && row_smem + static_cast<size_t>(P) * sizeof(int32_t) <= 48 * 1024 - 64;
      const size_t smem = row_smem + (lean ? static_cast<size_t>(P) * sizeof(int32_t) : 0);
      auto* kern = lean ? rms_norm_vec_kernel<scalar_t, kNormVecs, true, true>
                        : rms_norm_vec_kernel<scalar_t, kNormVecs, true>;
      exl_pdl::launch_pdl(kern, dim3(static_cast<unsigned>(rows)), dim3(kNormThreads), smem, stream, dev, xp, rp, wp, H,
                          static_cast<float>(eps), ptr<scalar_t>(y), hp, ew,
                          perm->data_ptr<int32_t>(), P, late);
      return;
    }
    auto* kern = vec ? rms_norm_vec_kernel<scalar_t, kNormVecs> : rms_norm_kernel<scalar_t>;
    exl_pdl::launch_pdl(kern, dim3(static_cast<unsigned>(rows)), dim3(kNormThreads), 0, stream, dev, xp, rp, wp, H,
                        static_cast<float>(eps), ptr<scalar_t>(y), hp, ew, static_cast<const int32_t*>(nullptr), H,
                        false);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {y, h};
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& w, double eps) {
  return std::get<0>(norm_impl(x, c10::nullopt, w, eps));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_residual_cuda(const at::Tensor& x, const at::Tensor& res,
                                                          const at::Tensor& w, double eps) {
  return norm_impl(x, res, w, eps);
}

// rms_norm / rms_norm_residual for a weight no kernel of the step writes (a model's RMSNorm weight; the caller says
// so): [y] or [y, h], the same bits; the weight is read before the PDL wait (pdl.cuh's contract).
std::vector<at::Tensor> rms_norm_static_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                             const at::Tensor& w, double eps) {
  auto [y, h] = norm_impl(x, res, w, eps, true);
  if (res) return {y, h};
  return {y};
}

// rms_norm_static with y's columns in perm's order: [y] or [y, h], y[..., j] = rms_norm(...)[..., perm[j]] bit for bit
// (y's last dim is perm's length).
std::vector<at::Tensor> rms_norm_perm_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                           const at::Tensor& w, double eps, const at::Tensor& perm, bool late,
                                           bool lean) {
  auto [y, h] = norm_impl(x, res, w, eps, true, &perm, late, lean);
  if (res) return {y, h};
  return {y};
}

at::Tensor silu_mul_cuda(const at::Tensor& g_, const at::Tensor& u_) {
  const char* op = "exl_core::silu_mul (CUDA)";
  check_same(g_, u_, op, "gate", "up");
  TORCH_CHECK(g_.sizes() == u_.sizes(), op, ": gate ", g_.sizes(), " and up ", u_.sizes(), " differ in shape");
  const auto g = g_.contiguous(), u = u_.contiguous();
  auto y = at::empty_like(g);
  const int64_t n = g.numel();
  if (!n) return y;
  const c10::cuda::CUDAGuard guard(g.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int dev = g.device().index();
  EXL_PW_DISPATCH(g.scalar_type(), op, [&] {
    constexpr int V = 16 / sizeof(scalar_t);
    const bool vec = n % V == 0 && reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(u.data_ptr()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
    if (vec)
      exl_pdl::launch_pdl(silu_mul_vec_kernel<scalar_t>, dim3(static_cast<unsigned>((n / V + 255) / 256)), dim3(256), 0,
                          stream, dev, static_cast<const scalar_t*>(ptr<scalar_t>(g)),
                          static_cast<const scalar_t*>(ptr<scalar_t>(u)), n / V, ptr<scalar_t>(y));
    else
      exl_pdl::launch_pdl(silu_mul_kernel<scalar_t>, dim3(static_cast<unsigned>((n + 255) / 256)), dim3(256), 0, stream,
                          dev, static_cast<const scalar_t*>(ptr<scalar_t>(g)),
                          static_cast<const scalar_t*>(ptr<scalar_t>(u)), n, ptr<scalar_t>(y));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor rope_one(const at::Tensor& x_, const at::Tensor& pos, const at::Tensor& cs, cudaStream_t stream) {
  const auto x = x_.contiguous();
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t n = rows * H * (D / 2);
  if (!n) return out;
  EXL_PW_DISPATCH(x.scalar_type(), "exl_core::rope (CUDA)", [&] {
    exl_pdl::launch_pdl(rope_kernel<scalar_t>, dim3(static_cast<unsigned>((n + 255) / 256)), dim3(256), 0, stream,
                        x.device().index(), static_cast<const scalar_t*>(ptr<scalar_t>(x)), rows, H, D,
                        static_cast<const int64_t*>(pos.data_ptr<int64_t>()), static_cast<const float*>(cs.data_ptr<float>()),
                        cs.size(0), ptr<scalar_t>(out));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                             const at::Tensor& cos_sin) {
  const char* op = "exl_core::rope (CUDA)";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              op, ": q (T, Hq, D) and k (T, Hkv, D) must share T and an even D, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && positions.is_cuda() && cos_sin.is_cuda(), op, ": all tensors must be on the GPU");
  TORCH_CHECK(positions.numel() == q.size(0), op, ": positions has ", positions.numel(), " entries, q has ", q.size(0), " rows");
  TORCH_CHECK(cos_sin.dtype() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == q.size(2), op,
              ": cos_sin must be float32 [P, ", q.size(2), "]");
  const c10::cuda::CUDAGuard guard(q.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto pos = positions.to(at::kLong).contiguous();
  const auto cs = cos_sin.contiguous();
  const int64_t D = q.size(2);
  const auto qc = q.contiguous(), kc = k.contiguous();
  // fresh outputs are 16-byte aligned (caching allocator); the inputs and the table may not be
  if (D % 8 != 0 || q.scalar_type() != k.scalar_type() || !aligned16({&qc, &kc, &cs}))
    return {rope_one(qc, pos, cs, stream), rope_one(kc, pos, cs, stream)};
  auto qo = at::empty_like(qc), ko = at::empty_like(kc);
  const int64_t q_heads = qc.size(0) * qc.size(1), k_heads = kc.size(0) * kc.size(1);
  const int64_t n = (q_heads + k_heads) * (D / 8);
  if (!n) return {qo, ko};
  EXL_PW_DISPATCH(q.scalar_type(), op, [&] {
    exl_pdl::launch_pdl(rope_qk_vec_kernel<scalar_t>, dim3(static_cast<unsigned>((n + 255) / 256)), dim3(256), 0, stream,
                        q.device().index(), static_cast<const scalar_t*>(ptr<scalar_t>(qc)), ptr<scalar_t>(qo), q_heads,
                        qc.size(1), static_cast<const scalar_t*>(ptr<scalar_t>(kc)), ptr<scalar_t>(ko), k_heads,
                        kc.size(1), static_cast<int>(D), static_cast<const int64_t*>(pos.data_ptr<int64_t>()), int64_t{1},
                        static_cast<const float*>(cs.data_ptr<float>()), cs.size(0), static_cast<const scalar_t*>(nullptr),
                        static_cast<const int64_t*>(nullptr), int64_t{0}, static_cast<scalar_t*>(nullptr),
                        static_cast<scalar_t*>(nullptr));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {qo, ko};
}

// rope of q and k, with k's rotated rows and v's rows written to their cache slots (one launch for decode's rope
// and K/V write; ops/attention.rope_write_kv sends only calls that meet these conditions and otherwise runs the
// two ops, whose results this equals bit for bit).  Returns the rotated q.
at::Tensor rope_kv_write_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                              const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slots) {
  const char* op = "exl_core::rope_kv_write (CUDA)";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(2) % 8 == 0,
              op, ": q (T, Hq, D), k and v (T, Hkv, D) with D % 8 == 0, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              op, ": caches must be contiguous (pages, page_size, Hkv, D) matching k");
  const auto dt = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && k_cache.scalar_type() == dt &&
                  v_cache.scalar_type() == dt && q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              op, ": q, k, v and the caches must be contiguous and of one dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.numel() == q.size(0) &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == q.size(0),
              op, ": positions must be int64 [T] (any stride), slots contiguous int64 [T]");
  TORCH_CHECK(cos_sin.dtype() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == q.size(2) &&
                  cos_sin.is_contiguous(), op, ": cos_sin must be contiguous float32 [P, D]");
  for (const at::Tensor* t : {&q, &k, &v, &positions, &cos_sin, &k_cache, &v_cache, &slots})
    TORCH_CHECK(t->device() == q.device(), op, ": every tensor must be on q's GPU");
  TORCH_CHECK(aligned16({&q, &k, &v, &cos_sin, &k_cache, &v_cache}), op, ": tensors must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(q.device());
  auto qo = at::empty_like(q);
  const int64_t D = q.size(2), q_heads = q.size(0) * q.size(1), k_heads = k.size(0) * k.size(1);
  const int64_t n = (q_heads + 2 * k_heads) * (D / 8);
  if (!n) return qo;
  EXL_PW_DISPATCH(dt, op, [&] {
    exl_pdl::launch_pdl(rope_qk_vec_kernel<scalar_t>, dim3(static_cast<unsigned>((n + 255) / 256)), dim3(256), 0,
                        c10::cuda::getCurrentCUDAStream(), q.device().index(),
                        static_cast<const scalar_t*>(ptr<scalar_t>(q)), ptr<scalar_t>(qo), q_heads, q.size(1),
                        static_cast<const scalar_t*>(ptr<scalar_t>(k)), static_cast<scalar_t*>(nullptr), k_heads,
                        k.size(1), static_cast<int>(D), static_cast<const int64_t*>(positions.data_ptr<int64_t>()),
                        positions.stride(0), static_cast<const float*>(cos_sin.data_ptr<float>()), cos_sin.size(0),
                        static_cast<const scalar_t*>(ptr<scalar_t>(v)),
                        static_cast<const int64_t*>(slots.data_ptr<int64_t>()), k_cache.size(0) * k_cache.size(1),
                        ptr<scalar_t>(k_cache), ptr<scalar_t>(v_cache));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return qo;
}

}  // namespace

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rms_norm_residual", &rms_norm_residual_cuda);
  m.impl("silu_mul", &silu_mul_cuda);
  m.impl("rope", &rope_cuda);
  m.impl("rope_kv_write", &rope_kv_write_cuda);
  m.impl("rms_norm_static", &rms_norm_static_cuda);
  m.impl("rms_norm_perm", &rms_norm_perm_cuda);
}

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("rms_norm_static(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.def("rms_norm_perm(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor perm, bool late=False, "
        "bool lean=False) -> Tensor[]");
  m.def("rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots) -> Tensor");
}
