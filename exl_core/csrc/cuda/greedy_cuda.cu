// CUDA implementation of exl_core::greedy_pick (schema and contract: csrc/cpu/greedy.cpp): a greedy decode step's
// argmax, row maximum, float64 log-sum-exp and chosen logprob in one launch, where torch's fallback on a GPU
// (sampling.py _plain_greedy: amax, argmax, sub, exp, sum, log, add, gather, sub) is nine, and torch's argmax alone
// over a 32,000-token row took 10.05 us of a 7B batch-1 step (bench/results/decode_timeline_h200_stop39_call5_*.json).
//
// One block per row.  Pass 1: each thread walks its float4s in index order keeping the first index of its maximum
// (strictly greater replaces), then the block keeps the larger value, the lower index on equal values: torch.argmax's
// first-max rule.  A NaN never wins a comparison; it only sets the row's flag, and the row's max is then NaN (the
// caller raises; ids, lse and logprob of such rows are unspecified, as on CPU).  Pass 2 (finite max only): the sum of
// exp(x - max), each term in float32 and summed in float64 in a fixed order (deterministic: the fast greedy path and
// chosen_logprobs get the same lse).  The row is re-read from L1/L2.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

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

__global__ void __launch_bounds__(kThreads) greedy_pick_kernel(const float* __restrict__ x, int64_t V, int64_t* ids,
                                                                double* lse, float* row_max, float* logprob) {
  __shared__ Best wbest[kWarps];
  __shared__ double wsum[kWarps];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * V;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Best b{-INFINITY, V};
  bool nan = false;
  const bool vec = V % 4 == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0;
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int64_t i = threadIdx.x; i < V / 4; i += kThreads) {
      const float4 v = __ldg(r4 + i);
      consider(b, nan, v.x, 4 * i);
      consider(b, nan, v.y, 4 * i + 1);
      consider(b, nan, v.z, 4 * i + 2);
      consider(b, nan, v.w, 4 * i + 3);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) consider(b, nan, __ldg(row + i), i);
  }
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
  const int64_t id = b.i < V ? b.i : 0;
  if (nan || !isfinite(m)) {                                    // NaN / +inf / all -inf: the caller raises
    if (threadIdx.x == 0) {
      ids[blockIdx.x] = id;
      row_max[blockIdx.x] = nan ? NAN : m;
      lse[blockIdx.x] = NAN;
      logprob[blockIdx.x] = NAN;
    }
    return;
  }
  double s = 0.0;
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int64_t i = threadIdx.x; i < V / 4; i += kThreads) {
      const float4 v = __ldg(r4 + i);
      s += static_cast<double>(expf(v.x - m)) + static_cast<double>(expf(v.y - m)) +
           static_cast<double>(expf(v.z - m)) + static_cast<double>(expf(v.w - m));
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) s += static_cast<double>(expf(__ldg(row + i) - m));
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) wsum[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double tot = 0.0;
    for (int w = 0; w < kWarps; ++w) tot += wsum[w];
    const double l = static_cast<double>(m) + log(tot);
    ids[blockIdx.x] = id;
    row_max[blockIdx.x] = m;
    lse[blockIdx.x] = l;
    logprob[blockIdx.x] = static_cast<float>(static_cast<double>(row[id]) - l);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_pick_cuda(const at::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "exl_core::greedy_pick: logits must be a contiguous float32 [B, V] CUDA tensor, got ",
              logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max(), "exl_core::greedy_pick: vocabulary size ", V,
              " out of range");
  TORCH_CHECK(B <= std::numeric_limits<int32_t>::max(), "exl_core::greedy_pick: ", B, " rows (at most 2^31 - 1)");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor ids = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({B}, logits.options().dtype(at::kDouble));
  at::Tensor mx = at::empty({B}, logits.options());
  at::Tensor lp = at::empty({B}, logits.options());
  if (B == 0) return {ids, lse, mx, lp};
  greedy_pick_kernel<<<static_cast<unsigned>(B), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      logits.data_ptr<float>(), V, ids.data_ptr<int64_t>(), lse.data_ptr<double>(), mx.data_ptr<float>(),
      lp.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ids, lse, mx, lp};
}

}  // namespace

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) { m.impl("greedy_pick", &greedy_pick_cuda); }
