// The prompt's quantized GEMM with the dequantise fused in (sm_90a): y[M, N] (+)= x[M, K] W[K, N] for uniform 4-bit
// weights (GPTQ 4-bit, EXL2 rewritten as uniform 4-bit rows with twins, formats/uniform4.py), W never written.
//
// Why: the dequantise + cuBLAS path writes each W (fp16) before its GEMM reads it; between GEMMs that costs ~250-300
// us a 7B layer (~8-9 ms of a ~45 ms 2,048-token prompt, NOTES.md).  Here the product runs transposed, y^T = W^T x^T,
// so the quantized operand is wgmma's A, which may come from registers: each thread dequantises its fragment straight
// from the packed words (a byte of a word is two values of one column), and only x goes through shared memory (B:
// K-major, 128-byte swizzle, as x's rows are K-contiguous).
//
// Block: 256 threads, two warpgroups, each 64 W columns ("features") x NT tokens (wgmma m64nNTk16); a stage holds x's
// tile [NT, 64], the 8 word rows [8, 128] of the 64 K rows, each 32-row chunk's scale and zero [2, 128] (and, TW, the
// twin chunks' words and zeros), filled by cp.async STAGES - 2 tiles ahead; each tile's wgmmas run while the next
// tile's fragments are dequantised (wgmma.wait_group 1).  No torch headers: bench/wgmma_probe.cu builds it with nvcc.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "cp_async_device.cuh"
#include "pdl_device.cuh"
#include "wgmma_device.cuh"

namespace exl_wg {

constexpr int kBK = 64;                 // K rows a stage
constexpr int kBF = 128;                // W columns a block
constexpr int kThreads = 256;
constexpr int kMaxChunks = 512;         // K / 32 the chunk-group table in shared memory holds (K <= 16,384)

template <int NT, bool TW>
struct Layout {
  static constexpr int kX = NT * kBK * 2;             // x tile, 128-byte rows (a multiple of 1024)
  static constexpr int kW = kBK / 8 * kBF * 4;        // 8 word rows of 128 columns
  static constexpr int kSZ = 2 * 2 * kBF * 4;         // [chunk][scale, zero][128] fp32
  static constexpr int kTW = TW ? kW + 2 * kBF * 4 : 0;   // twins: 8 word rows, [chunk][128] zeros
  static constexpr int kStage = (kX + kW + kSZ + kTW + 1023) / 1024 * 1024;
};

struct WgArgs {
  const __half* x;                      // [M, K], rows ldx apart, in W's row order
  const int32_t* qweight;               // [rows / 8, ldq]: 4-bit, chunk c in word rows 4c..4c+3
  const float* scale;                   // [groups, ldq]
  const float* zero;
  const int32_t* chunks;                // [rows / 32, 3]: (bits, group, first word row)
  const int32_t* twin;                  // TW: [K / 32] chunk-table row of each chunk's twin, or -1
  const __half* bias;                   // [N] or null
  __half* y;                            // [M, N], rows ldy apart
  int64_t ldx, ldq, ldy;
  int M, N, K;
  int add;                              // y += x W (the residual stream), else y = x W (+ bias)
};

// Two values of a byte of w (byte `sel` picks, lane-constant: (t, 0, t, 0)) as half2 (1024 + lo, 1024 + 16 hi): the
// low nibble in the low half's mantissa, the high nibble 4 bits up in the high half's.
__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, uint32_t sel) {
  const uint32_t r = __byte_perm(w, 0u, sel);
  uint32_t v;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(v) : "r"(r), "r"(0x00F0000Fu), "r"(0x64006400u));   // (a & b) | c
  return v;
}

// (q - z) s for the pair: (v * mul + sub) is exact (small integers), one rounding in the product with s.
__device__ __forceinline__ uint32_t dequant_pair(uint32_t v, __half2 mul, __half2 sub, __half2 s) {
  const __half2 h = __hmul2(__hfma2(*reinterpret_cast<const __half2*>(&v), mul, sub), s);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A twinned pair: main nibbles r (v from nibble_pair's byte, before the magic) and twin nibbles h give q = r + 16 h
// per value: (1024 + q_lo, 1024 + q_hi) as half2.
__device__ __forceinline__ uint32_t twin_pair(uint32_t w, uint32_t tw, uint32_t sel) {
  const uint32_t r = __byte_perm(w, 0u, sel), h = __byte_perm(tw, 0u, sel);
  // low half: r_lo | h_lo << 4; high half: r_hi | h_hi << 4 (the high nibbles sit at bits 20..23 of r and h)
  const uint32_t lo = (r & 0x0000000Fu) | ((h << 4) & 0x000000F0u);
  const uint32_t hi = ((r >> 4) & 0x000F0000u) | (h & 0x00F00000u);
  return lo | hi | 0x64006400u;
}

template <int NT, int STAGES, bool TW>
__device__ __forceinline__ void load_stage(const WgArgs& a, uint8_t* st, const int* groups, int kt, int m0, int f0) {
  using L = Layout<NT, TW>;
  const int tid = threadIdx.x, k0 = kt * kBK;
  uint8_t* xs = st;
#pragma unroll
  for (int i = tid; i < NT * 8; i += kThreads) {           // x: NT rows of eight 16-byte units, swizzled
    const int r = i >> 3, u = i & 7, tok = m0 + r, k = k0 + u * 8;
    const bool ok = tok < a.M && k < a.K;
    cp_async16_zfill(xs + r * 128 + ((u ^ (r & 7)) << 4), ok ? a.x + tok * a.ldx + k : a.x, ok);
  }
  {                                                          // words: 8 rows x 32 units of 4 columns, one a thread
    const int r = tid >> 5, u = tid & 31, kw = k0 / 8 + r, f = f0 + 4 * u;
    const bool ok = kw < a.K / 8 && f < a.N;
    cp_async16_zfill(st + L::kX + r * 512 + u * 16, ok ? a.qweight + kw * a.ldq + f : a.qweight, ok);
  }
  if (tid < 128) {                                           // scale and zero of the tile's two chunks
    const int ch = tid >> 6, arr = (tid >> 5) & 1, u = tid & 31, c = k0 / 32 + ch, f = f0 + 4 * u;
    const bool ok = c < a.K / 32 && f < a.N;
    const float* src = (arr ? a.zero : a.scale) + (ok ? groups[c] * a.ldq + f : 0);
    cp_async16_zfill(st + L::kX + L::kW + (ch * 2 + arr) * 512 + u * 16, src, ok);
  }
  if constexpr (TW) {                                        // the twins' words and zeros (zero-filled: none)
    const int r = tid >> 5, u = tid & 31, c = k0 / 32 + (r >> 2), f = f0 + 4 * u;
    const int tq = c < a.K / 32 ? groups[2 * kMaxChunks + c] : -1;
    const bool ok = tq >= 0 && f < a.N;
    const int32_t* src = ok ? a.qweight + (tq + (r & 3)) * a.ldq + f : a.qweight;
    cp_async16_zfill(st + L::kX + L::kW + L::kSZ + r * 512 + u * 16, src, ok);
    if (tid < 64) {
      const int ch2 = tid >> 5, c2 = k0 / 32 + ch2;
      const int tg = c2 < a.K / 32 ? groups[3 * kMaxChunks + c2] : -1;
      const bool ok2 = tg >= 0 && f < a.N;
      const float* zsrc = ok2 ? a.zero + tg * a.ldq + f : a.zero;
      cp_async16_zfill(st + L::kX + L::kW + L::kSZ + L::kW + ch2 * 512 + u * 16, zsrc, ok2);
    }
  }
}

// One tile's A fragments (4 k16 steps x 4 registers) of this thread's two W columns fl and fl + 8 (block-local);
// twin_row: per chunk of the tile, its twin's chunk-table row or -1 (TW).
template <int NT, bool TW>
__device__ __forceinline__ void tile_fragments(const uint8_t* st, int fl, uint32_t sel, const int (&twin_row)[2],
                                               uint32_t (&A)[4][4]) {
  using L = Layout<NT, TW>;
  const uint32_t* ws = reinterpret_cast<const uint32_t*>(st + L::kX);
  const float* sz = reinterpret_cast<const float*>(st + L::kX + L::kW);
#pragma unroll
  for (int ch = 0; ch < 2; ++ch) {
    __half2 mul[2], sub[2], s2[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int f = fl + 8 * j;
      const float s = sz[(ch * 2) * kBF + f], z = sz[(ch * 2 + 1) * kBF + f];
      s2[j] = __float2half2_rn(s);
      mul[j] = __floats2half2_rn(1.f, 0.0625f);
      sub[j] = __floats2half2_rn(-1024.f - z, -64.f - z);
    }
    if constexpr (TW) {
      if (twin_row[ch] >= 0) {       // block-uniform: main row r (zero 8), twin h (zero (z0 - 8) / 16), q = r + 16 h
        const uint32_t* tws = reinterpret_cast<const uint32_t*>(st + L::kX + L::kW + L::kSZ);
        const float* tz = reinterpret_cast<const float*>(st + L::kX + L::kW + L::kSZ + L::kW);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float z0 = 16.f * tz[ch * kBF + fl + 8 * j] + 8.f;
          mul[j] = __float2half2_rn(1.f);
          sub[j] = __float2half2_rn(-1024.f - z0);
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int step = ch * 2 + s;
#pragma unroll
          for (int h = 0; h < 2; ++h) {      // h: k 2t, 2t + 1 (word row 2 step) or 2t + 8, 2t + 9 (2 step + 1)
            const int row = 2 * step + h;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int f = fl + 8 * j;
              const uint32_t v = twin_pair(ws[row * kBF + f], tws[row * kBF + f], sel);
              A[step][2 * h + j] = dequant_pair(v, mul[j], sub[j], s2[j]);
            }
          }
        }
        continue;
      }
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int step = ch * 2 + s;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 2 * step + h;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t v = nibble_pair(ws[row * kBF + fl + 8 * j], sel);
          A[step][2 * h + j] = dequant_pair(v, mul[j], sub[j], s2[j]);
        }
      }
    }
  }
}

template <int NT>
__device__ __forceinline__ void mma_tile(float (&acc)[NT / 2], const uint32_t (&A)[4][4], const uint8_t* xs) {
  const uint64_t desc = exl_wgmma::sw128_desc(xs);
  exl_wgmma::fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if constexpr (NT == 256) exl_wgmma::wgmma_n256(acc, A[s], desc + 2 * s, 1);
    else exl_wgmma::wgmma_n128(acc, A[s], desc + 2 * s, 1);
  }
  exl_wgmma::commit();
}

// grid (ceil(N / 128), ceil(M / NT)), dynamic shared memory smem_bytes().  Requires K % 32 == 0, K / 32 <= kMaxChunks,
// N % 8 == 0, 16-byte aligned x, qweight, scale, zero and y rows, uniform 4-bit chunks with chunk c in word rows 4c..
template <int NT, int STAGES, bool TW>
__global__ void __launch_bounds__(kThreads, 1) qgemm_wg_kernel(const __grid_constant__ WgArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<NT, TW>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  // per chunk: its group; TW: its twin's chunk-table row, first word row and group (-1: none)
  int* groups = reinterpret_cast<int*>(smem + STAGES * L::kStage);
  const int tid = threadIdx.x, f0 = blockIdx.x * kBF, m0 = blockIdx.y * NT;
  const int nchunks = a.K / 32;
  for (int c = tid; c < nchunks; c += kThreads) {          // load-time data: read before the PDL wait
    groups[c] = a.chunks[c * 3 + 1];
    if constexpr (TW) {
      const int tc = a.twin ? a.twin[c] : -1;
      groups[kMaxChunks + c] = tc;
      groups[2 * kMaxChunks + c] = tc >= 0 ? a.chunks[tc * 3 + 2] : -1;
      groups[3 * kMaxChunks + c] = tc >= 0 ? a.chunks[tc * 3 + 1] : -1;
    }
  }
  __syncthreads();
  exl_pdl::pdl_wait();                                       // x is the kernel before's output
  const int KT = (a.K + kBK - 1) / kBK;
  constexpr int P = STAGES - 2;                              // tiles loaded ahead
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (p < KT) load_stage<NT, STAGES, TW>(a, smem + p * L::kStage, groups, p, m0, f0);
    cp_async_commit();
  }
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int fl = wg * 64 + warp * 16 + g;
  const uint32_t sel = static_cast<uint32_t>(t | 0x40 | (t << 8) | 0x4000);
  float acc[NT / 2];
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;
  uint32_t A0[4][4], A1[4][4];
  // One tile: its stage ready for every thread, the load STAGES - 2 ahead issued, the fragments dequantised while the
  // tile before's wgmmas run, this tile's issued; then the tile before's wait (its stage and registers free again).
  auto step = [&](int i, uint32_t(&A)[4][4]) {
    cp_async_wait<P - 1>();
    exl_wgmma::fence_async_shared();
    __syncthreads();
    if (i + P < KT) load_stage<NT, STAGES, TW>(a, smem + ((i + P) % STAGES) * L::kStage, groups, i + P, m0, f0);
    cp_async_commit();
    const uint8_t* st = smem + (i % STAGES) * L::kStage;
    int twin_row[2] = {-1, -1};
    if constexpr (TW) {
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) twin_row[ch] = 2 * i + ch < nchunks ? groups[kMaxChunks + 2 * i + ch] : -1;
    }
    tile_fragments<NT, TW>(st, fl, sel, twin_row, A);
    exl_wgmma::fence_operands(acc);
    mma_tile<NT>(acc, A, st);
    exl_wgmma::fence_operands(acc);
    exl_wgmma::wait<1>();
  };
  int i = 0;
  for (; i + 1 < KT; i += 2) {                               // two register sets, each in one place
    step(i, A0);
    step(i + 1, A1);
  }
  if (i < KT) step(i, A0);
  exl_wgmma::wait<0>();
  cp_async_wait_all();
  exl_pdl::pdl_trigger();
  __syncthreads();                                           // every warpgroup done with the stages: reuse them
  // Epilogue through shared memory: out[token][feature] fp16 (rows padded by 8 halves), then 16-byte rows to y.
  constexpr int kLd = kBF + 8;
  __half* out = reinterpret_cast<__half*>(smem);
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    const int tok = 8 * j + 2 * t;
    out[tok * kLd + fl] = __float2half_rn(acc[4 * j]);
    out[(tok + 1) * kLd + fl] = __float2half_rn(acc[4 * j + 1]);
    out[tok * kLd + fl + 8] = __float2half_rn(acc[4 * j + 2]);
    out[(tok + 1) * kLd + fl + 8] = __float2half_rn(acc[4 * j + 3]);
  }
  __syncthreads();
  for (int i = tid; i < NT * (kBF / 8); i += kThreads) {
    const int r = i / (kBF / 8), u = i % (kBF / 8), tok = m0 + r, f = f0 + 8 * u;
    if (tok >= a.M || f >= a.N) continue;
    uint4 v = *reinterpret_cast<const uint4*>(out + r * kLd + 8 * u);
    __half2* h = reinterpret_cast<__half2*>(&v);
    __half* dst = a.y + tok * a.ldy + f;
    if (a.add) {
      const uint4 o = *reinterpret_cast<const uint4*>(dst);
      const __half2* oh = reinterpret_cast<const __half2*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) h[e] = __hadd2(h[e], oh[e]);
    } else if (a.bias) {
      const uint4 b = *reinterpret_cast<const uint4*>(a.bias + f);
      const __half2* bh = reinterpret_cast<const __half2*>(&b);
#pragma unroll
      for (int e = 0; e < 4; ++e) h[e] = __hadd2(h[e], bh[e]);
    }
    *reinterpret_cast<uint4*>(dst) = v;
  }
#endif
}

template <int NT, int STAGES, bool TW>
constexpr int smem_bytes() {
  return STAGES * Layout<NT, TW>::kStage + 1024 + (TW ? 4 : 1) * kMaxChunks * 4;
}

}  // namespace exl_wg
