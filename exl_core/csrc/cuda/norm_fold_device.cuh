// The RMSNorm between two decode projections folded into them (Mats::nf, exl_core::qgemm_kslice_add_ and the
// norm_* arguments of qgemm_kslice_multi / qgemm_wide_multi; exl_core/ops/norm_fold.py).
//
// Why: in a graphed decode step the norm was its own launch twice a layer, a one-block-per-row kernel between the
// o (down) projection and the q/k/v (gate/up) one; on the H200 each added 3.85 / 4.64 us on average to the step's
// critical path (bench/decode_timeline.py: 250.4 us of a 2,010.3 us GPTQ batch-1 step, 302.2 of 3,905.9 at batch 32).
//
// Producer (o and down, qgemm_kslice): y is the residual stream and the epilogue adds into it, then writes the sum of
// squares of the values it stored per (output tile, row) to ss_out.  Consumer (q/k/v and gate/up, qgemm_kslice's
// staged rows and qgemm_wide): x is the residual; r = rsqrt(sum(ss_in[:, m]) / K + eps) from those partial sums in a
// fixed order (every block gets the same r).  qgemm_kslice stages x as w * fp16(x * r) rounded to fp16 -- the
// roundings of rms_norm_vec_kernel -- instead of x; qgemm_wide stages fp16(x * w) and scales its outputs by r (the
// same product up to fp16 rounding; every column tile stages the same x, so the per-value work is kept to one
// HMUL2 a pair).  A block then needs neither the whole row of x nor a norm launch before it.
#pragma once
#include <cuda_fp16.h>

#include "qmma_device.cuh"

namespace exl_mma {

// r from each lane's part of a row's sums (one warp; every lane returns the same value: a butterfly's pairs add in
// either order alike).
__device__ __forceinline__ float fold_rms_from(float s, const NormFold& nf, int64_t K) {
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return rsqrtf(s / static_cast<float>(K) + nf.eps);
}

// r of row m (one warp).
__device__ __forceinline__ float fold_rms(const NormFold& nf, int M, int m, int64_t K, int lane) {
  float s = 0.f;
  for (int t = lane; t < nf.ss_tiles; t += 32) s += __ldg(nf.ss_in + static_cast<int64_t>(t) * M + m);
  return fold_rms_from(s, nf, K);
}

// Row 0's sums, a lane's first 4 (every one while K / 32 <= 128 tiles), loaded before the staged rows' x copies are
// issued (my reading: after them they queued behind the copies; stop 54's probe, gate/up uncapped at 7 blocks an SM:
// r's reading cost the folded chain 1.84-1.88 us a layer, loaded first 0.94-1.00 of that less; at the extension's 6
// the probe read no difference, stop 55 call 3; the model gained 0.64-0.84 % at batch 1).  rms() adds them in
// fold_rms's order (0 + v0 = v0; the masked ones add 0 to a sum of squares), so r keeps its bits (by construction;
// the tests check values); past 128 tiles it is fold_rms itself (the early loads unused).
struct FoldSums0 {
  float v[4];
  __device__ __forceinline__ void load(const NormFold& nf, int M, int lane) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = lane + 32 * i;
      v[i] = t < nf.ss_tiles ? __ldg(nf.ss_in + static_cast<int64_t>(t) * M) : 0.f;
    }
  }
  __device__ __forceinline__ float rms(const NormFold& nf, int M, int64_t K, int lane) const {
    if (nf.ss_tiles > 128) return fold_rms(nf, M, 0, K, lane);
    return fold_rms_from(((v[0] + v[1]) + v[2]) + v[3], nf, K);
  }
};

// 8 values of a row of x normalised: fp16(w * fp16(x * r)).
__device__ __forceinline__ uint4 fold_norm8(const uint4& xv, const uint4& wv, float r) {
  uint4 o;
  const __half *xp = reinterpret_cast<const __half*>(&xv), *wp = reinterpret_cast<const __half*>(&wv);
  __half* op = reinterpret_cast<__half*>(&o);
#pragma unroll
  for (int e = 0; e < 8; ++e)
    op[e] = __float2half_rn(__half2float(wp[e]) * __half2float(__float2half_rn(__half2float(xp[e]) * r)));
  return o;
}

// 8 values of a row of x times the norm weight's (qgemm_wide: r then scales the outputs, cluster_store's row_scale).
__device__ __forceinline__ uint4 fold_weight8(const uint4& xv, const uint4& wv) {
  return make_uint4(h2u(__hmul2(u2h(xv.x), u2h(wv.x))), h2u(__hmul2(u2h(xv.y), u2h(wv.y))),
                    h2u(__hmul2(u2h(xv.z), u2h(wv.z))), h2u(__hmul2(u2h(xv.w), u2h(wv.w))));
}

// Producer epilogue of one output value: y (+)= a, rounded; returns the stored value's square (0 past N).
__device__ __forceinline__ float fold_store(const NormFold& nf, __half* y, float a) {
  if (nf.add) a += __half2float(*y);
  const __half v = __float2half_rn(a);
  *y = v;
  const float f = __half2float(v);
  return f * f;
}

// Sum of a warp's squares into ss_out[tile, m] (the warp holds one row's 32 columns of the tile).
__device__ __forceinline__ void fold_row_ss(const NormFold& nf, float sq, int64_t tile, int M, int m, int lane) {
  for (int o = 16; o; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  if (lane == 0) nf.ss_out[tile * M + m] = sq;
}

}  // namespace exl_mma
