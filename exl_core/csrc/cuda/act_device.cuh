// Device-side value conversions (float <-> float / half / bfloat16, round to nearest) and the pointwise ops'
// rounding rules for SwiGLU's product and rope's rotation, without torch headers: pointwise_cuda.cu, qmatmul_cuda.cu,
// paged_attention_kernel.cuh (rope), the decode kernel that fuses the product into its staging of x
// (qgemm_kslice_kernel.cuh) and the one that computes it in its epilogue (qmma_device.cuh, cluster_store_swiglu)
// share them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace exl_act {

template <typename T> __device__ __forceinline__ float f32(T v);
template <> __device__ __forceinline__ float f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T cvt(float v);
template <> __device__ __forceinline__ float cvt<float>(float v) { return v; }
template <> __device__ __forceinline__ __half cvt<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// silu(g) * u as HF's act_fn(gate) * up in T: F.silu's result rounded to T, then the product rounded.
template <typename T>
__device__ __forceinline__ T silu_mul(T g, T u) {
  const float a = f32<T>(g);
  return cvt<T>(f32<T>(cvt<T>(a / (1.f + __expf(-a)))) * f32<T>(u));
}

// One rope pair rotated (HF rotate_half: x1 = element i of a head, x2 = element i + D/2; c, s the table's cos and
// sin of i) with the fp32 roundings pinned -- a multiply, then one fused multiply-add, instead of whatever
// contraction the compiler picks per kernel -- so that every kernel that rotates (exl_core::rope, rope_kv_write,
// paged_attention_rope) gives the same bits.
__device__ __forceinline__ float rope_lo(float x1, float x2, float c, float s) {
  return __fmaf_rn(x1, c, -__fmul_rn(x2, s));
}
__device__ __forceinline__ float rope_hi(float x1, float x2, float c, float s) {
  return __fmaf_rn(x2, c, __fmul_rn(x1, s));
}

}  // namespace exl_act
