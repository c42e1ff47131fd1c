// CUDA implementation of exl_core::greedy_pick (schema and contract: csrc/cpu/greedy.cpp): a greedy decode step's
// argmax, row maximum, float64 log-sum-exp and chosen logprob in one launch, where torch's fallback on a GPU
// (sampling.py _plain_greedy: amax, argmax, sub, exp, sum, log, add, gather, sub) is nine, and torch's argmax alone
// over a 32,000-token row took 10.04 us of a 7B batch-1 step (bench/results/decode_timeline_h200_stop39_call5_*.json).
// A first version with one block a row did not make the bench's batch-1 step faster than torch's argmax (stop 47
// call 2: 517.3 / 517.5 / 516.9 against 517.3 / 516.3 / 517.7 tok/s).
//
// A row is split into S slices, one block each (S = 1 to 8 by V; one block where clusters are not available): pass 1
// keeps each thread's first index of its maximum (strictly greater replaces, index order), then the block keeps the
// larger value, the lower index on equal values: torch.argmax's first-max rule.  A NaN never wins a comparison; it only
// sets the row's flag, and the row's max is then NaN (the caller raises; ids, lse and logprob of such rows are
// unspecified, as on CPU).  Pass 2 (the slice's max finite): the slice's sum of exp(x - slice max), each term in
// float32 and summed in float64 in a fixed order, re-reading the slice from L1/L2.  With S > 1 the row's blocks run as
// one thread-block cluster (sm_90) and rank 0 merges the slices in rank order through distributed shared memory:
// lse = max + log(sum_r s_r exp(m_r - max)).  Deterministic (S depends on V and the device only), so the fast greedy
// path and chosen_logprobs get the same lse.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "pdl.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSlices = 8;          // portable cluster size
constexpr int64_t kSliceMin = 8192;    // values a slice at least (~2 float4 a thread)
constexpr int kInFlight = 4;           // float4 loads a thread issues before it uses them
constexpr int64_t kMaxGridY = 65535;   // rows a launch

struct Best {
  float v;
  int64_t i;     // V: none yet (an all -inf row keeps it: id 0, as on CPU)
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ __forceinline__ void consider(Best& b, bool& nan, float v, int64_t i) {
  nan |= isnan(v);
  if (v > b.v) b = {v, i};
}

// r4[i], or -inf past the slice's end
__device__ __forceinline__ float4 load4(const float4* r4, int64_t i, int64_t end) {
  return i < end ? __ldg(r4 + i) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
}

// f(v, i) over the thread's values of the slice [lo, hi) in index order, v holding x[i..i+3] (rows of float4s: vec,
// kInFlight loads in flight a thread) or x[i] and three -inf (no maximum, exp terms of exactly 0); -inf past the end.
template <class F>
__device__ __forceinline__ void for_slice(const float* row, int64_t lo, int64_t hi, bool vec, F&& f) {
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int64_t i0 = lo / 4 + threadIdx.x; i0 < hi / 4; i0 += kInFlight * kThreads) {
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) v[u] = load4(r4, i0 + u * kThreads, hi / 4);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) f(v[u], 4 * (i0 + u * kThreads));
    }
  } else {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
      f(make_float4(__ldg(row + i), -INFINITY, -INFINITY, -INFINITY), i);
  }
}

struct Part {          // a slice's result, in its block's shared memory
  Best best;
  double sum;          // sum of exp(x - best.v) over the slice (0 where best.v is not finite)
  int nan;
};

__global__ void __launch_bounds__(kThreads) greedy_pick_kernel(const float* __restrict__ x, int64_t V, int64_t* ids,
                                                                double* lse, float* row_max, float* logprob) {
  __shared__ Best wbest[kWarps];
  __shared__ double wsum[kWarps];
  __shared__ Part part;
  const int64_t b_row = blockIdx.y;
  const float* row = x + b_row * V;
  const int S = static_cast<int>(gridDim.x), r = static_cast<int>(blockIdx.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool vec = V % 4 == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0;
  const int64_t per = ((V + 4 * S - 1) / (4 * S)) * 4;            // slice length, a multiple of 4
  const int64_t lo = r * per, hi = lo + per < V ? lo + per : V;
  Best b{-INFINITY, V};
  bool nan = false;
  for_slice(row, lo, hi, vec, [&](const float4& v, int64_t i) {        // in index order: the first maximum stays
    consider(b, nan, v.x, i);
    consider(b, nan, v.y, i + 1);
    consider(b, nan, v.z, i + 2);
    consider(b, nan, v.w, i + 3);
  });
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    const Best other{__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
    b = better(b, other);
  }
  if (lane == 0) wbest[warp] = b;
  nan = __syncthreads_or(nan);
  b = wbest[0];
#pragma unroll 4
  for (int w = 1; w < kWarps; ++w) b = better(b, wbest[w]);    // every thread: the same order, the same answer
  const float m = b.v;
  double s = 0.0;
  if (!nan && isfinite(m)) {                                    // block-uniform
    for_slice(row, lo, hi, vec, [&](const float4& v, int64_t) {
      s += static_cast<double>(expf(v.x - m)) + static_cast<double>(expf(v.y - m)) +
           static_cast<double>(expf(v.z - m)) + static_cast<double>(expf(v.w - m));
    });
#pragma unroll
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) wsum[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      s = 0.0;
      for (int w = 0; w < kWarps; ++w) s += wsum[w];
    }
  }
  if (threadIdx.x == 0) part = {b, s, nan ? 1 : 0};
  // rank 0's thread 0 merges the slices (its own alone when S == 1)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  if (S > 1) cg::this_cluster().sync();                         // every slice's part is in its shared memory
#else
  if (S > 1) __trap();                                          // the host splits rows only on sm_90 devices
#endif
  if (r == 0 && threadIdx.x == 0) {
    auto part_of = [&](int q) -> Part {                         // slice q's part (q > 0: another block's, by DSMEM)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (q > 0) return *cg::this_cluster().map_shared_rank(&part, q);
#endif
      return part;
    };
    Best all = part.best;
    bool any_nan = part.nan != 0;
    for (int q = 1; q < S; ++q) {
      const Part p = part_of(q);
      all = better(all, p.best);
      any_nan |= p.nan != 0;
    }
    const float mx = all.v;
    const int64_t id = all.i < V ? all.i : 0;
    ids[b_row] = id;
    row_max[b_row] = any_nan ? NAN : mx;
    if (any_nan || !isfinite(mx)) {                             // NaN / +inf / all -inf: the caller raises
      lse[b_row] = NAN;
      logprob[b_row] = NAN;
    } else {
      double tot = 0.0;
      for (int q = 0; q < S; ++q) {
        const Part p = part_of(q);
        if (isfinite(p.best.v)) tot += p.sum * exp(static_cast<double>(p.best.v) - static_cast<double>(mx));
      }
      const double l = static_cast<double>(mx) + log(tot);
      lse[b_row] = l;
      logprob[b_row] = static_cast<float>(static_cast<double>(row[id]) - l);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (S > 1) cg::this_cluster().sync();                         // the slices keep their shared memory until then
#endif
}

// Slices a row: enough blocks for a batch-1 row to stream on several SMs, one where clusters are not available.
int slices_for(int64_t V, int dev) {
  if (exl_pdl::device_sm(dev, true) < 9) return 1;            // cached per device (pdl.cuh)
  const int64_t s = (V + kSliceMin - 1) / kSliceMin;
  return static_cast<int>(s < 1 ? 1 : s > kMaxSlices ? kMaxSlices : s);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_pick_cuda(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "exl_core::greedy_pick: logits must be a contiguous float32 [B, V] CUDA tensor, got ",
              logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max(), "exl_core::greedy_pick: vocabulary size ", V,
              " out of range");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor ids = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({B}, logits.options().dtype(at::kDouble));
  at::Tensor mx = at::empty({B}, logits.options());
  at::Tensor lp = at::empty({B}, logits.options());
  if (B == 0) return {ids, lse, mx, lp};
  const int S = slices_for(V, logits.get_device());
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  if (S > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(S);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  for (int64_t r0 = 0; r0 < B; r0 += kMaxGridY) {            // rows on grid y: at most 65,535 a launch
    const int64_t nb = B - r0 < kMaxGridY ? B - r0 : kMaxGridY;
    cfg.gridDim = dim3(static_cast<unsigned>(S), static_cast<unsigned>(nb));
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, greedy_pick_kernel, logits.data_ptr<float>() + r0 * V, V,
                                      ids.data_ptr<int64_t>() + r0, lse.data_ptr<double>() + r0,
                                      mx.data_ptr<float>() + r0, lp.data_ptr<float>() + r0));
  }
  return {ids, lse, mx, lp};
}

}  // namespace

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) { m.impl("greedy_pick", &greedy_pick_cuda); }
