// The large-M path's dequantise (packed weights -> W [K, N] in x's dtype, rows back in their original order through
// the act-order permutation, for cuBLAS) and the helpers qmatmul_cuda.cu's GEMV shares with it, without torch headers
// so bench/dequant_probe.cu builds the same kernels with plain nvcc.
//
// A chunk is 32 rows of K stored in `bits` consecutive qweight rows (value j of a column at bits j*bits.. of them);
// the chunk table int32 [K/32, 3] gives each chunk's (bits, group, first qweight row).  The kernel (V = 1 and V = 8
// columns per thread) is launched with PDL: the words, scales and zeros (load-time data) are read before pdl_wait
// (ld_early), W (which the GEMM before may still read: the allocator hands the same block to each slice) is written
// after it, each row's permutation entry read as it is stored.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "act_device.cuh"
#include "pdl_device.cuh"

namespace exl_dequant {

// Exact int -> float for q < 2^23 without the slow I2F path: 2^23 + q as float bits, minus 2^23.
__device__ __forceinline__ float q_to_f(uint32_t q) { return __uint_as_float(q | 0x4B000000u) - 8388608.0f; }

// Loads of load-time data (words, scales, zeros) meant to run before the PDL wait: coherent loads, which ptxas keeps
// above griddepcontrol.wait; with __ldg (ld.global.nc) it moved the wait above them in the 4-bit and width-switch
// instances (SASS, stop 34), so the words were read only after the kernel before had finished.  EXL_DEQUANT_LDG=1:
// __ldg (A/B builds of the probes).
#ifndef EXL_DEQUANT_LDG
#define EXL_DEQUANT_LDG 0
#endif
template <typename P>
__device__ __forceinline__ P ld_early(const P* p) {
#if EXL_DEQUANT_LDG
  return __ldg(p);
#else
  return *p;
#endif
}

// Value i (0..31) of a chunk's column v as float, scaled: its BITS bits start at bit i*BITS of the chunk's
// BITS words w[.][v] (a value may straddle two words).  i and BITS are constants after unrolling.
template <int BITS, int V>
__device__ __forceinline__ float chunk_value(const uint32_t (&w)[BITS][V], int i, int v, float s, float zs) {
  const int pos = i * BITS, wi = pos >> 5, off = pos & 31;
  uint32_t q = w[wi][v] >> off;
  if (off + BITS > 32) q |= w[(wi + 1) < BITS ? wi + 1 : wi][v] << (32 - off);
  return fmaf(q_to_f(q & ((1u << BITS) - 1u)), s, -zs);
}

// Scale and scale * zero of V adjacent columns from `col` of group g (scale/zero rows ldq apart).
template <int V>
__device__ __forceinline__ void group_scale_zero(const float* scale, const float* zero, int64_t g, int64_t ldq,
                                                 int64_t col, float (&s)[V], float (&zs)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) {
    s[v] = ld_early(scale + g * ldq + col + v);
    zs[v] = ld_early(zero + g * ldq + col + v) * s[v];
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
// A chunk's BITS word rows of V adjacent columns (rows ldq apart); zeros where !live (qw is not read then).
template <int BITS, int V>
__device__ __forceinline__ void load_chunk(const int32_t* qw, int64_t ldq, uint32_t (&w)[BITS][V], bool live = true) {
#pragma unroll
  for (int j = 0; j < BITS; ++j) {
    if constexpr (V == 1) {
      w[j][0] = live ? ld_early(qw + j * ldq) : 0;
    } else {
#pragma unroll
      for (int h = 0; h < V / 4; ++h) {
        const int4 a = live ? ld_early(reinterpret_cast<const int4*>(qw + j * ldq + 4 * h)) : make_int4(0, 0, 0, 0);
        w[j][4 * h] = a.x, w[j][4 * h + 1] = a.y, w[j][4 * h + 2] = a.z, w[j][4 * h + 3] = a.w;
      }
    }
  }
}

// The twin of a 4-bit chunk (formats/uniform4.py: a 5..8-bit value q = r + 16 h stored as two 4-bit rows that read one
// x column, the high halves h in an extra chunk after all K rows, with scale 16 s and zero z_h): its words and zero
// term, so the thread dequantises (r | h << 4) once, with the chunk's scale s and the two zero terms summed -- W has K
// rows and the prompt's GEMM runs over K.  twins_of (ops/cuda_dequant.py) gives a table only where every twin's scale
// is exactly 16 s.  A chunk without a twin takes the same code with zero words and zero term: one copy of the unrolled
// loop, in a 4-bit-only instance (dequant_kernel kTwin4).  H200, bench/twin_probe.cu, a twin for 1 chunk in 16, us a 7B
// layer alone: 154.01 / 153.36 against 132.26 / 131.06 for the width switch's instance over the same chunks (stop 34
// calls 5 / 7, when the twin's values were dequantised apart and added: two extractions, two FMAs and an add a value);
// a second unrolled copy for twinned chunks, or this loop inside the switch's instance, ran 202.24 / 167.73 (stop 33).
template <int V>
struct Twin {
  const int32_t* qw;              // null: no twin (zero words)
  float zs[V];                    // z_h * 16 s, or 0
};

// Value i (0..31) of a twinned 4-bit chunk's column v: r from the chunk's words, h from the twin's.
template <int V>
__device__ __forceinline__ uint32_t twin_q(const uint32_t (&w)[4][V], const uint32_t (&w2)[4][V], int i, int v) {
  const int wi = i >> 3, off = (i & 7) * 4;
  return ((w[wi][v] >> off) & 15u) | (((w2[wi][v] >> off) & 15u) << 4);
}

// One thread per (chunk, V adjacent columns): 32 dequantised values per column written to rows perm[k] of W (rows
// ldw apart) at Wc (the thread's first column); word rows are ldq apart.  V = 8 (16-bit W, aligned): two 16-byte
// loads per word row and one 16-byte store per W row (a warp stores 512 contiguous bytes, not 64).  TW (4-bit): plus
// the twin's values (Twin).  Launched with PDL: the words (load-time data) are read before pdl_wait, W (which the
// GEMM before may still read: the allocator hands the same block to each slice) is written after it.
template <typename T, int BITS, int V, bool TW = false>
__device__ __forceinline__ void dequant_chunk(const int32_t* qw, int64_t ldq, int64_t ldw, const float (&s)[V],
                                              const float (&zs)[V], const int64_t* perm, int64_t k0, T* Wc,
                                              const Twin<V>& twin = Twin<V>{}) {
  static_assert(!TW || BITS == 4, "twins are 4-bit chunks of 4-bit weights");
  uint32_t w[BITS][V], w2[TW ? 4 : 1][V];
  load_chunk<BITS, V>(qw, ldq, w);
  if constexpr (TW) load_chunk<4, V>(twin.qw, ldq, w2, twin.qw != nullptr);   // a select per load, not a branch
  float zt[V];                                                  // the zero terms, the twin's added in
#pragma unroll
  for (int v = 0; v < V; ++v) zt[v] = TW ? zs[v] + twin.zs[v] : zs[v];
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    float f[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if constexpr (TW) f[v] = fmaf(q_to_f(twin_q<V>(w, w2, i, v)), s[v], -zt[v]);
      else f[v] = chunk_value<BITS, V>(w, i, v, s[v], zt[v]);
    }
    const int64_t k = k0 + i;
    const int64_t row = perm ? perm[k] : k;
    if constexpr (V == 1) {
      Wc[row * ldw] = exl_act::cvt<T>(f[0]);
    } else {
      static_assert(V == 8, "16-byte stores of 8 16-bit values");
      *reinterpret_cast<uint4*>(Wc + row * ldw) =
          make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
    }
  }
}

// Up to kMaxDequantMats weights of the same K side by side in one W [K, ldw] (q|k|v or gate|up for one GEMM), each
// from columns [0, N) of its qweight/scale/zero whose rows are ldq apart (the caller offsets them to a column slice).
constexpr int kMaxDequantMats = 8;
struct DequantMat {
  const int32_t* chunks;
  const int32_t* qweight;
  const float* scale;
  const float* zero;
  const int64_t* perm;            // or null
  void* W;                        // its first column in the shared W
  int64_t ldq, N;
  const int32_t* twin;            // or null: per chunk of W's K rows, the chunk table row of its twin or -1 (4-bit)
};
struct DequantMats {
  DequantMat m[kMaxDequantMats];
  int64_t ldw;
  int n;
};

// Which chunks an instance takes: any width (a switch over bits), uniform 4-bit (no switch: 70 registers against
// the switch's 110, sm_90; the host knows, ops/cuda_dequant.py uniform4), or uniform 4-bit with twin tables.
enum DequantKind { kAnyWidth = 0, kUniform4 = 1, kTwin4 = 2 };

// grid (ceil(max N / (blockDim V)), K / 32, n), K W's rows (with twins fewer than the chunk table's).  V = 8: every
// N % 8 == 0 and ldq % 4 == 0, ldw % 8 == 0, 16-byte aligned qweight and W.  kTwin4 reads the mats' twin tables.
// Instances of their own, so neither the twin's registers nor the switch reach the uniform 4-bit kernel.
template <typename T, int V, int KIND = kAnyWidth>
__global__ void dequant_kernel(const __grid_constant__ DequantMats mats) {
  const DequantMat& m = mats.m[blockIdx.z];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (col >= m.N) {
    exl_pdl::pdl_wait();                                        // every block waits: completion stays transitive
    exl_pdl::pdl_trigger();
    return;
  }
  const int64_t c = blockIdx.y;
  const int g = m.chunks[c * 3 + 1], qrow = m.chunks[c * 3 + 2];
  float s[V], zs[V];
  group_scale_zero<V>(m.scale, m.zero, g, m.ldq, col, s, zs);
  const int32_t* qw = m.qweight + static_cast<int64_t>(qrow) * m.ldq + col;
  T* Wc = static_cast<T*>(m.W) + col;
  const int64_t ldq = m.ldq, ldw = mats.ldw;
  const int64_t* perm = m.perm;
  if constexpr (KIND == kTwin4) {
    Twin<V> tw;
    const int tc = m.twin ? ld_early(m.twin + c) : -1;
    tw.qw = tc >= 0 ? m.qweight + static_cast<int64_t>(m.chunks[tc * 3 + 2]) * m.ldq + col : nullptr;
    const int64_t tg = tc >= 0 ? m.chunks[tc * 3 + 1] : 0;
#pragma unroll
    for (int v = 0; v < V; ++v) tw.zs[v] = tc >= 0 ? ld_early(m.zero + tg * m.ldq + col + v) * (16.f * s[v]) : 0.f;
    dequant_chunk<T, 4, V, true>(qw, ldq, ldw, s, zs, perm, c * 32, Wc, tw);
  } else if constexpr (KIND == kUniform4) {
    dequant_chunk<T, 4, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc);
  } else {
    switch (m.chunks[c * 3]) {
      case 4: dequant_chunk<T, 4, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc); break;
      case 2: dequant_chunk<T, 2, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc); break;
      case 3: dequant_chunk<T, 3, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc); break;
      case 5: dequant_chunk<T, 5, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc); break;
      case 6: dequant_chunk<T, 6, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc); break;
      default: dequant_chunk<T, 8, V>(qw, ldq, ldw, s, zs, perm, c * 32, Wc); break;
    }
  }
}

}  // namespace exl_dequant
