// The large-M path's dequantise (packed weight -> W [K, N] in x's dtype, rows back in their original order through
// the act-order permutation, for cuBLAS) and the helpers qmatmul_cuda.cu's GEMV shares with it, without torch headers
// so bench/dequant_probe.cu builds the same kernels with plain nvcc.
//
// A chunk is 32 rows of K stored in `bits` consecutive qweight rows (value j of a column at bits j*bits.. of them);
// the chunk table int32 [K/32, 3] gives each chunk's (bits, group, first qweight row).  Both kernels are launched
// with PDL: the words, scales and permutation (load-time data) are read before pdl_wait, W (which the GEMM before may
// still read: the allocator hands the same block to each slice) is written after it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "act_device.cuh"
#include "pdl_device.cuh"

namespace exl_dequant {

// Exact int -> float for q < 2^23 without the slow I2F path: 2^23 + q as float bits, minus 2^23.
__device__ __forceinline__ float q_to_f(uint32_t q) { return __uint_as_float(q | 0x4B000000u) - 8388608.0f; }

// Scale and scale * zero of V adjacent columns from `col` of group g (scale/zero rows ldq apart).
template <int V>
__device__ __forceinline__ void group_scale_zero(const float* scale, const float* zero, int64_t g, int64_t ldq,
                                                 int64_t col, float (&s)[V], float (&zs)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    s[v] = __ldg(scale + g * ldq + col + v);
    zs[v] = __ldg(zero + g * ldq + col + v) * s[v];
  }
}

// Two 16-bit values as one 32-bit word, a in the low half (the lower address).
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// -------------------------------------------------------------------------------- any dtype, any alignment
// One thread per (chunk, V adjacent columns): 32 dequantised values per column written to rows perm[k] of
// W [K, N] at Wc (the thread's first column); word rows are ldq apart.  V = 8 (16-bit W, aligned): two
// 16-byte loads per word row and one 16-byte store per W row (a warp stores 512 contiguous bytes, not 64).
// Launched with PDL: the words (load-time data) are read before pdl_wait, W (which the GEMM before may still
// read: the allocator hands the same block to each slice) is written after it.
template <typename T, int BITS, int V>
__device__ __forceinline__ void dequant_chunk(const int32_t* qw, int64_t ldq, int64_t N, const float (&s)[V],
                                              const float (&zs)[V], const int64_t* perm, int64_t k0, T* Wc) {
  uint32_t w[BITS][V];
#pragma unroll
  for (int j = 0; j < BITS; ++j) {
    if constexpr (V == 1) {
      w[j][0] = __ldg(qw + j * ldq);
    } else {
#pragma unroll
      for (int h = 0; h < V / 4; ++h) {
        const int4 a = __ldg(reinterpret_cast<const int4*>(qw + j * ldq + 4 * h));
        w[j][4 * h] = a.x, w[j][4 * h + 1] = a.y, w[j][4 * h + 2] = a.z, w[j][4 * h + 3] = a.w;
      }
    }
  }
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  constexpr uint32_t mask = (1u << BITS) - 1u;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int pos = i * BITS, wi = pos >> 5, off = pos & 31;
    float f[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      uint32_t q = w[wi][v] >> off;
      if (off + BITS > 32) q |= w[(wi + 1) < BITS ? wi + 1 : wi][v] << (32 - off);
      f[v] = fmaf(q_to_f(q & mask), s[v], -zs[v]);
    }
    const int64_t k = k0 + i;
    const int64_t row = perm ? perm[k] : k;
    if constexpr (V == 1) {
      Wc[row * N] = exl_act::cvt<T>(f[0]);
    } else {
      static_assert(V == 8, "16-byte stores of 8 16-bit values");
      *reinterpret_cast<uint4*>(Wc + row * N) =
          make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
    }
  }
}

// W [K, N] from columns [0, N) of qweight/scale/zero whose rows are ldq apart (the caller offsets them to a
// column slice); V columns per thread (V = 8: N % 8 == 0, ldq % 4 == 0, 16-byte aligned qweight and W).
template <typename T, int V>
__global__ void dequant_kernel(const int32_t* __restrict__ chunks, const int32_t* __restrict__ qweight, int64_t ldq,
                               int64_t N, const float* __restrict__ scale, const float* __restrict__ zero,
                               const int64_t* __restrict__ perm, T* __restrict__ W) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (col >= N) {
    exl_pdl::pdl_wait();                                        // every block waits: completion stays transitive
    exl_pdl::pdl_trigger();
    return;
  }
  const int64_t c = blockIdx.y;
  const int bits = chunks[c * 3], g = chunks[c * 3 + 1], qrow = chunks[c * 3 + 2];
  float s[V], zs[V];
  group_scale_zero<V>(scale, zero, g, ldq, col, s, zs);
  const int32_t* qw = qweight + static_cast<int64_t>(qrow) * ldq + col;
  T* Wc = W + col;
  switch (bits) {
    case 4: dequant_chunk<T, 4, V>(qw, ldq, N, s, zs, perm, c * 32, Wc); break;
    case 2: dequant_chunk<T, 2, V>(qw, ldq, N, s, zs, perm, c * 32, Wc); break;
    case 3: dequant_chunk<T, 3, V>(qw, ldq, N, s, zs, perm, c * 32, Wc); break;
    case 5: dequant_chunk<T, 5, V>(qw, ldq, N, s, zs, perm, c * 32, Wc); break;
    case 6: dequant_chunk<T, 6, V>(qw, ldq, N, s, zs, perm, c * 32, Wc); break;
    default: dequant_chunk<T, 8, V>(qw, ldq, N, s, zs, perm, c * 32, Wc); break;
  }
}

// -------------------------------------------------------------------------------- 16-bit W, 16-byte aligned
// The vectorised dequantise: 8 adjacent columns per lane (16-byte word and scale loads, one 16-byte store per W row:
// a warp stores 512 contiguous bytes of a row).  Before this, one thread walked all 32 rows of a chunk for its 8
// columns: 128 registers (the 8-bit case's 64 words), 16 warps per SM, one wave, each warp a chain of 32 stores.
// Now warp j of a block writes rows 8j..8j+7 of the chunk: their 8 x BITS bits start at bit 8 j BITS and lie in one
// or two word rows (8 BITS <= 64 and the start is a multiple of 8), so a lane holds at most 16 words.
constexpr int kRows8Threads = 128;   // 4 warps: the chunk's 4 groups of 8 rows
constexpr int kRows8Cols = 256;      // columns per block: 32 lanes x 8

template <int BITS>
__device__ __forceinline__ uint32_t field(uint32_t lo, uint32_t hi, int p) {   // p, BITS: constants after unrolling
  constexpr uint32_t mask = (1u << BITS) - 1u;
  if (p >= 32) return (hi >> (p - 32)) & mask;
  if (p + BITS > 32) return __funnelshift_r(lo, hi, p) & mask;
  return (lo >> p) & mask;
}

__device__ __forceinline__ void load8(const int32_t* p, uint32_t (&w)[8]) {
  const int4 a = __ldg(reinterpret_cast<const int4*>(p)), b = __ldg(reinterpret_cast<const int4*>(p) + 1);
  w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}

__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// Rows 8J..8J+7 of a chunk (k8: the first of them) for 8 columns; qw: the chunk's first word row at the lane's column.
template <typename T, int BITS, int J>
__device__ __forceinline__ void dequant_rows8(const int32_t* qw, int64_t ldq, const float (&s)[8], const float (&zs)[8],
                                              const int64_t* perm, int64_t k8, int64_t N, T* Wc) {
  constexpr int first = J * 8 * BITS, w0 = first >> 5, off = first & 31;
  constexpr bool two = off + 8 * BITS > 32;
  uint32_t lo[8], hi[8] = {};
  load8(qw + w0 * ldq, lo);
  if constexpr (two) load8(qw + (w0 + 1) * ldq, hi);
  int64_t rows[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) rows[i] = perm ? __ldg(perm + k8 + i) : k8 + i;
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float f[8];
#pragma unroll
    for (int v = 0; v < 8; ++v) f[v] = fmaf(q_to_f(field<BITS>(lo[v], hi[v], off + i * BITS)), s[v], -zs[v]);
    *reinterpret_cast<uint4*>(Wc + rows[i] * N) =
        make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
  }
}

template <typename T, int BITS>
__device__ __forceinline__ void dequant_rows8_any(int j, const int32_t* qw, int64_t ldq, const float (&s)[8],
                                                  const float (&zs)[8], const int64_t* perm, int64_t k0, int64_t N,
                                                  T* Wc) {
  switch (j) {                                                  // warp-uniform
    case 0: dequant_rows8<T, BITS, 0>(qw, ldq, s, zs, perm, k0, N, Wc); break;
    case 1: dequant_rows8<T, BITS, 1>(qw, ldq, s, zs, perm, k0 + 8, N, Wc); break;
    case 2: dequant_rows8<T, BITS, 2>(qw, ldq, s, zs, perm, k0 + 16, N, Wc); break;
    default: dequant_rows8<T, BITS, 3>(qw, ldq, s, zs, perm, k0 + 24, N, Wc); break;
  }
}

// grid (ceil(N / 256), K / 32), 128 threads.  Needs N % 8 == 0, ldq % 4 == 0 and 16-byte aligned qweight, scale,
// zero and W (at the slice's first column).
template <typename T>
__global__ void __launch_bounds__(kRows8Threads) dequant_rows8_kernel(
    const int32_t* __restrict__ chunks, const int32_t* __restrict__ qweight, int64_t ldq, int64_t N,
    const float* __restrict__ scale, const float* __restrict__ zero, const int64_t* __restrict__ perm,
    T* __restrict__ W) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + (threadIdx.x & 31)) * 8;
  if (col >= N) {
    exl_pdl::pdl_wait();
    exl_pdl::pdl_trigger();
    return;
  }
  const int64_t c = blockIdx.y;
  const int bits = chunks[c * 3], g = chunks[c * 3 + 1], qrow = chunks[c * 3 + 2];
  float s[8], zs[8];
  load8(scale + g * ldq + col, s);
  load8(zero + g * ldq + col, zs);
#pragma unroll
  for (int v = 0; v < 8; ++v) zs[v] *= s[v];
  const int32_t* qw = qweight + static_cast<int64_t>(qrow) * ldq + col;
  T* Wc = W + col;
  const int j = threadIdx.x >> 5;
  switch (bits) {
    case 4: dequant_rows8_any<T, 4>(j, qw, ldq, s, zs, perm, c * 32, N, Wc); break;
    case 2: dequant_rows8_any<T, 2>(j, qw, ldq, s, zs, perm, c * 32, N, Wc); break;
    case 3: dequant_rows8_any<T, 3>(j, qw, ldq, s, zs, perm, c * 32, N, Wc); break;
    case 5: dequant_rows8_any<T, 5>(j, qw, ldq, s, zs, perm, c * 32, N, Wc); break;
    case 6: dequant_rows8_any<T, 6>(j, qw, ldq, s, zs, perm, c * 32, N, Wc); break;
    default: dequant_rows8_any<T, 8>(j, qw, ldq, s, zs, perm, c * 32, N, Wc); break;
  }
}

}  // namespace exl_dequant
