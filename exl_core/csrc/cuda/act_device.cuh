// Device-side value conversions (float <-> float / half / bfloat16, round to nearest) and the pointwise ops'
// rounding rule for SwiGLU's product, without torch headers: pointwise_cuda.cu, qmatmul_cuda.cu and the decode
// kernel that fuses the product into its staging of x (qgemm_kslice_kernel.cuh) share them.
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

}  // namespace exl_act
