// The prompt's quantized GEMM with the dequantise fused in (sm_90a): y[M, N] (+)= x[M, K] W[K, N] for uniform 4-bit
// weights (GPTQ 4-bit, EXL2 rewritten as uniform 4-bit rows with twins, formats/uniform4.py), W never written.
//
// Why: the dequantise + cuBLAS path writes each W (fp16) before its GEMM reads it; between GEMMs that costs 11.2 % of
// a 7B layer's projections (bench/wgmma_probe.cu, stop 44 call 5: 1,238.39 us against 1,113.52 for cuBLAS
// alone).  Here the product runs transposed, y^T = W^T x^T,
// so the quantized operand is wgmma's A, which may come from registers: each thread dequantises its fragment straight
// from the packed words (a byte of a word is two values of one column), and only x goes through shared memory (B:
// K-major, 128-byte swizzle, as x's rows are K-contiguous).
//
// Block: two consumer warpgroups, each 64 W columns ("features") x NT tokens (wgmma m64nNTk16), and a producer
// warpgroup that hands its registers to them (setmaxnreg: 40 / 232).  A stage holds x's tile [NT, 64], the 8 word
// rows [8, 128] of the 64 K rows, each 32-row chunk's scale and zero [2, 128] (and, TW, the twin chunks' words and
// zeros), brought by the copy engine: the producer issues a stage's boxes once both warpgroups released it (its
// `empty` barrier), they complete on its `full` barrier.  Each tile's wgmmas run while the next tile's fragments are
// dequantised (wgmma.wait_group 1); no block-wide barrier in the loop.  A thread's two A rows (g and g + 8 of its
// warp's 16) are adjacent columns, so it reads their words, scales and zeros as pairs.  No torch headers:
// bench/wgmma_probe.cu builds it with nvcc.
//
// Status (NOTES.md "twenty-fourth" and "twenty-fifth"): correct, not in the extension.  Against dequantise + cuBLAS
// over a 7B layer's projections, GPTQ: 1.05 % ahead in stop 45 call 1 (variants in sequence), 3.04 % and 7.00 % behind
// in calls 3 and 4 (7 interleaved rounds); the EXL2 rewrite's twins 5.80 / 13.27 / 14.35 % behind.  Skipping its y
// stores (skip_store) cut 10.79 % of the layer in call 3 (on a variant with a group's scales converted once, removed
// since) and 9.34 % in call 4: with one block an SM and a tile a block, nothing overlaps a block's stores.
#pragma once
#include <cuda.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "pdl_device.cuh"
#include "tma_device.cuh"
#include "wgmma_device.cuh"

namespace exl_wg {

constexpr int kBK = 64;                 // K rows a stage
constexpr int kBF = 128;                // W columns a block
constexpr int kThreads = 384;          // two consumer warpgroups and a producer warpgroup (one thread of it issues)
// Probe builds at 32 tokens without twins (bench/wgmma_probe.cu decode32, NOTES.md stop 57), each off by default:
//   EXL_WG_DECODE_PAIRS=2: two pairs of consumer warpgroups, pair p taking the tiles i with i % 2 == p, their sums
//     added through shared memory at the end (twice the tile chains on one block an SM);
//   EXL_WG_PRODUCER_WARPS: the producer's four warps issue a stage's boxes side by side (x, words, scales, zeros),
//     each arriving on the stage's barrier with its own bytes (from one thread the six took ~0.17 of ~0.32 us a tile);
//   EXL_WG_SZ_ONCE: one scale / zero box pair a tile, as both chunks of a 64-row tile share a group (groups of 64
//     rows or more only: GPTQ g128 here).
#ifndef EXL_WG_DECODE_PAIRS
#define EXL_WG_DECODE_PAIRS 1
#endif
template <int NT>
__host__ __device__ constexpr int pairs_of() { return NT == 32 ? EXL_WG_DECODE_PAIRS : 1; }
template <int NT>
__host__ __device__ constexpr int threads_of() { return 256 * pairs_of<NT>() + 128; }
#if defined(EXL_WG_PRODUCER_WARPS)
constexpr bool kProducerWarpsBuild = true;
#else
constexpr bool kProducerWarpsBuild = false;
#endif
#if defined(EXL_WG_SZ_ONCE)
constexpr bool kSzOnceBuild = true;
#else
constexpr bool kSzOnceBuild = false;
#endif
template <int NT, bool TW>
__host__ __device__ constexpr bool producer_warps() { return kProducerWarpsBuild && NT == 32 && !TW; }
template <int NT, bool TW>
__host__ __device__ constexpr bool sz_once() { return kSzOnceBuild && NT == 32 && !TW; }
constexpr int kMaxWeights = 3;          // weights of one launch (q/k/v, gate/up) on the same x
constexpr int kMaxChunks = 512;         // K / 32 the chunk-group table in shared memory holds (K <= 16,384)

// A stage: x's tile, the words, scales and zeros, (TW: the twins' words and zeros).
template <int NT, bool TW>
struct Layout {
  static constexpr int kX = NT * kBK * 2;             // x tile, 128-byte rows (a multiple of 1024)
  static constexpr int kW = kBK / 8 * kBF * 4;        // 8 word rows of 128 columns
  static constexpr int kSZ = 2 * 2 * kBF * 4;         // [chunk][scale, zero][128] fp32
  static constexpr int kOffW = kX, kOffSZ = kOffW + kW, kOffTW = kOffSZ + kSZ, kOffTZ = kOffTW + kW;
  static constexpr int kTW = TW ? kW + 2 * kBF * 4 : 0;   // twins: 8 word rows, [chunk][128] zeros
  static constexpr int kStage = (kX + kW + kSZ + kTW + 1023) / 1024 * 1024;
  static constexpr uint32_t kBytes = kX + kW + kSZ;   // what a stage's copies bring without twins
};

// Tensor maps (host: cuTensorMapEncodeTiled) over x [M, K] fp16 (box 64 x NT, 128-byte swizzle), qweight [rows / 8,
// N] int32 (box 128 x 8, and 128 x 4 for twins), scale and zero [groups, N] fp32 (box 128 x 1).  Boxes past an edge
// come back as zeros (the M, N and K tails).
struct WgArgs {
  CUtensorMap xmap, wmap, twmap, smap, zmap;
  const int32_t* chunks;                // [rows / 32, 3]: (bits, group, first word row); chunk c in word rows 4c..
  const int32_t* twin;                  // TW: [K / 32] chunk-table row of each chunk's twin, or -1
  const __half* bias;                   // [N] or null
  __half* y;                            // [M, N], rows ldy apart
  int64_t ldy;
  int M, N, K, groups;                  // groups: scale/zero rows (a box at row `groups` is zeros)
  int add;                              // y += x W (the residual stream), else y = x W (+ bias)
  // Timing knobs of bench/wgmma_probe.cu (0 in the extension; y is wrong with any): skip_x, x's box only for the
  // first tiles (its L2 traffic gone); skip_deq, the words as A without the dequantise arithmetic; ss (NT 256), no A
  // fragments at all: wgmmas with A from shared memory (rows of x's tile), as a dense fp16 GEMM would issue them.
  // skip_store: no y stores (the epilogue's cost).
  int skip_x, skip_deq, ss, skip_store;
};
// Up to kMaxWeights weights on the same x in one launch (blockIdx.z): one grid, fewer partial waves.
struct WgBatch {
  WgArgs w[kMaxWeights];
  int n;
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

// Tile kt's boxes into stage st (one thread): x, the words, each chunk's scale and zero (a chunk past K: zeros), the
// twins' words and zeros; the barrier expects their bytes.
template <int NT, bool TW>
__device__ __forceinline__ void issue_stage(const WgArgs& a, uint8_t* st, uint64_t* bar, const int* groups, int kt,
                                            int m0, int f0) {
  using L = Layout<NT, TW>;
  const int k0 = kt * kBK, nchunks = a.K / 32;
  const bool load_x = !a.skip_x || kt < 8;
  uint32_t bytes = L::kBytes - (load_x ? 0 : L::kX);
  int tq[2] = {-1, -1}, tg[2] = {-1, -1};
  if constexpr (TW) {
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      const int c = k0 / 32 + ch;
      if (c < nchunks && groups[2 * kMaxChunks + c] >= 0) {
        tq[ch] = groups[2 * kMaxChunks + c], tg[ch] = groups[3 * kMaxChunks + c];
        bytes += 4 * kBF * 4 + kBF * 4;
      }
    }
  }
  constexpr int kSzChunks = sz_once<NT, TW>() ? 1 : 2;
  bytes -= (2 - kSzChunks) * 2 * kBF * 4;
  exl_tma::mbar_arrive_expect(bar, bytes);
  if (load_x) exl_tma::tma_load_2d(st, &a.xmap, k0, m0, bar);
  exl_tma::tma_load_2d(st + L::kOffW, &a.wmap, f0, k0 / 8, bar);
#pragma unroll
  for (int ch = 0; ch < kSzChunks; ++ch) {
    const int c = k0 / 32 + ch, g = c < nchunks ? groups[c] : a.groups;
    exl_tma::tma_load_2d(st + L::kOffSZ + (ch * 2) * kBF * 4, &a.smap, f0, g, bar);
    exl_tma::tma_load_2d(st + L::kOffSZ + (ch * 2 + 1) * kBF * 4, &a.zmap, f0, g, bar);
    if constexpr (TW) {
      if (tq[ch] >= 0) {
        exl_tma::tma_load_2d(st + L::kOffTW + ch * 4 * kBF * 4, &a.twmap, f0, tq[ch], bar);
        exl_tma::tma_load_2d(st + L::kOffTZ + ch * kBF * 4, &a.zmap, f0, tg[ch], bar);
      }
    }
  }
}

// One tile's A fragments (4 k16 steps x 4 registers) of this thread's A rows g and g + 8, block-local columns fp and
// fp + 1; twin_row: per chunk of the tile, its twin's chunk-table row or -1 (TW).
// SZ1: the stage holds one scale / zero pair for both chunks (sz_once; the stream-K kernel's stages always do).
template <int NT, bool TW, bool SZ1 = sz_once<NT, TW>()>
__device__ __forceinline__ void tile_fragments(const uint8_t* st, int fp, uint32_t sel, const int (&twin_row)[2],
                                               uint32_t (&A)[4][4]) {
  using L = Layout<NT, TW>;
  const uint2* ws = reinterpret_cast<const uint2*>(st + L::kOffW);            // [8][64] column pairs
  const float2* sz = reinterpret_cast<const float2*>(st + L::kOffSZ);         // [chunk][scale, zero][64] pairs
  const int pr = fp >> 1;
  const __half2 mul = __floats2half2_rn(1.f, 0.0625f);
#pragma unroll
  for (int ch = 0; ch < 2; ++ch) {
    const int cs = SZ1 ? 0 : ch;
    const float2 s = sz[(cs * 2) * (kBF / 2) + pr], z = sz[(cs * 2 + 1) * (kBF / 2) + pr];
    const __half2 s2[2] = {__float2half2_rn(s.x), __float2half2_rn(s.y)};
    __half2 sub[2] = {__floats2half2_rn(-1024.f - z.x, -64.f - z.x), __floats2half2_rn(-1024.f - z.y, -64.f - z.y)};
    if constexpr (TW) {
      if (twin_row[ch] >= 0) {       // block-uniform: main row r (zero 8), twin h (zero (z0 - 8) / 16), q = r + 16 h
        const uint2* tws = reinterpret_cast<const uint2*>(st + L::kOffTW);
        const float2 tz = reinterpret_cast<const float2*>(st + L::kOffTZ)[ch * (kBF / 2) + pr];
        const __half2 one = __float2half2_rn(1.f);
        sub[0] = __float2half2_rn(-1024.f - (16.f * tz.x + 8.f));
        sub[1] = __float2half2_rn(-1024.f - (16.f * tz.y + 8.f));
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {     // word rows 4 ch + s4: step 2 ch + s4 / 2, k 2t.. (s4 even) or 2t + 8..
          const int row = 4 * ch + s4;
          const uint2 w = ws[row * (kBF / 2) + pr], h = tws[row * (kBF / 2) + pr];
          A[row >> 1][2 * (row & 1)] = dequant_pair(twin_pair(w.x, h.x, sel), one, sub[0], s2[0]);
          A[row >> 1][2 * (row & 1) + 1] = dequant_pair(twin_pair(w.y, h.y, sel), one, sub[1], s2[1]);
        }
        continue;
      }
    }
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
      const int row = 4 * ch + s4;
      const uint2 w = ws[row * (kBF / 2) + pr];
      A[row >> 1][2 * (row & 1)] = dequant_pair(nibble_pair(w.x, sel), mul, sub[0], s2[0]);
      A[row >> 1][2 * (row & 1) + 1] = dequant_pair(nibble_pair(w.y, sel), mul, sub[1], s2[1]);
    }
  }
}

template <int NT>
__device__ __forceinline__ void mma_tile(float (&acc)[NT / 2], const uint32_t (&A)[4][4], const uint8_t* xs) {
  const uint64_t desc = exl_wgmma::sw128_desc(xs);
  exl_wgmma::fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if constexpr (NT == 256) exl_wgmma::wgmma_rs_n256(acc, A[s], desc + 2 * s, 1);
    else if constexpr (NT == 32) exl_wgmma::wgmma_rs_n32(acc, A[s], desc + 2 * s, 1);
    else exl_wgmma::wgmma_rs_n128(acc, A[s], desc + 2 * s, 1);
  }
  exl_wgmma::commit();
}

// This thread's y values: acc rows g / g + 8 are columns f / f + 1, tokens tok0 + 8 j + {0, 1} (+ bias, or added to
// y: the residual stream), straight from registers (a warp's store covers 4 tokens x 32 contiguous bytes).
template <int NT>
__device__ __forceinline__ void store_tile(const WgArgs& a, const float (&acc)[NT / 2], int tok0, int f) {
  if (f >= a.N) return;
  __half2 b2 = __float2half2_rn(0.f);
  if (a.bias && !a.add) b2 = *reinterpret_cast<const __half2*>(a.bias + f);
  constexpr int kJ = NT / 8 < 8 ? NT / 8 : 8;                // n8 tiles a pass
#pragma unroll
  for (int j0 = 0; j0 < NT / 8; j0 += kJ) {                  // 16 loads of the residual in flight, then their stores
    __half2 old[kJ][2];
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tok = tok0 + 8 * (j0 + j) + r;
        old[j][r] = a.add && tok < a.M ? *reinterpret_cast<const __half2*>(a.y + tok * a.ldy + f) : b2;
      }
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tok = tok0 + 8 * (j0 + j) + r;
        if (tok < a.M) {
          const float* c = acc + 4 * (j0 + j) + r;
          *reinterpret_cast<__half2*>(a.y + tok * a.ldy + f) = __hadd2(__floats2half2_rn(c[0], c[2]), old[j][r]);
        }
      }
  }
}

// producer_warps: producer warp pw's share of every stage (0: x, 1: the words, 2: scales, 3: zeros), each warp
// arriving on the stage's full barrier with its own bytes (so no complete-tx can precede its expect-tx).
template <int NT, int STAGES, bool TW>
__device__ __forceinline__ void produce_boxes(const WgArgs& a, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                              const int* groups, int pw, int KT, int m0, int f0) {
  using L = Layout<NT, TW>;
  constexpr int kSzBoxes = sz_once<NT, TW>() ? 1 : 2;
  const int nchunks = a.K / 32;
  for (int kt = 0; kt < KT; ++kt) {
    const int slot = kt % STAGES, k0 = kt * kBK;
    if (kt >= STAGES) exl_tma::mbar_wait(empty + slot, ((kt / STAGES) - 1) & 1);
    uint8_t* st = smem + slot * L::kStage;
    const bool load_x = !a.skip_x || kt < 8;
    if (pw == 0) {
      exl_tma::mbar_arrive_expect(full + slot, load_x ? L::kX : 0);
      if (load_x) exl_tma::tma_load_2d(st, &a.xmap, k0, m0, full + slot);
    } else if (pw == 1) {
      exl_tma::mbar_arrive_expect(full + slot, L::kW);
      exl_tma::tma_load_2d(st + L::kOffW, &a.wmap, f0, k0 / 8, full + slot);
    } else {
      exl_tma::mbar_arrive_expect(full + slot, kSzBoxes * kBF * 4);
#pragma unroll
      for (int ch = 0; ch < kSzBoxes; ++ch) {
        const int c = k0 / 32 + ch, g = c < nchunks ? groups[c] : a.groups;
        exl_tma::tma_load_2d(st + L::kOffSZ + (ch * 2 + pw - 2) * kBF * 4, pw == 3 ? &a.zmap : &a.smap, f0, g,
                             full + slot);
      }
    }
  }
}

// grid (ceil(max N / 128), ceil(M / NT), batch.n), kThreads, dynamic shared memory smem_bytes().  Requires
// K % 32 == 0, K / 32 <= kMaxChunks, N % 8 == 0, 16-byte aligned x, qweight, scale, zero and y rows, uniform 4-bit
// chunks with chunk c in word rows 4c..4c+3.
// Blocks an SM at 32 tokens (bench/wgmma_probe.cu decode32; probe builds set it): 2 caps ptxas at 85 registers.
#ifndef EXL_WG_DECODE_MIN_BLOCKS
#define EXL_WG_DECODE_MIN_BLOCKS 2
#endif
template <int NT, int STAGES, bool TW>
__global__ void __launch_bounds__(threads_of<NT>(), NT <= 32 ? EXL_WG_DECODE_MIN_BLOCKS : 1)
    qgemm_wg_kernel(const __grid_constant__ WgBatch batch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<NT, TW>;
  const WgArgs& a = batch.w[blockIdx.z];
  const int tid = threadIdx.x, f0 = blockIdx.x * kBF, m0 = blockIdx.y * NT;
  if (f0 >= a.N) {                                           // a narrower weight of the batch
    exl_pdl::pdl_wait();                                     // every block waits: completion stays transitive
    return;
  }
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // stages 1024-aligned (the 128-byte swizzle's atoms), then the stages' full and empty barriers, then per chunk its
  // group (TW: also its twin's chunk-table row, first word row and group, or -1)
  uint8_t* smem = smem_raw + ((1024 - (exl_tma::smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * L::kStage);
  uint64_t* empty = full + STAGES;
  int* groups = reinterpret_cast<int*>(empty + STAGES);
  const int nchunks = a.K / 32;
  for (int c = tid; c < nchunks; c += threads_of<NT>()) {  // load-time data: read before the PDL wait
    groups[c] = a.chunks[c * 3 + 1];
    if constexpr (TW) {
      const int tc = a.twin ? a.twin[c] : -1;
      groups[kMaxChunks + c] = tc;
      groups[2 * kMaxChunks + c] = tc >= 0 ? a.chunks[tc * 3 + 2] : -1;
      groups[3 * kMaxChunks + c] = tc >= 0 ? a.chunks[tc * 3 + 1] : -1;
    }
  }
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      exl_tma::mbar_init(full + s, producer_warps<NT, TW>() ? 4 : 1);   // each producer warp with its own bytes
      exl_tma::mbar_init(empty + s, 2);                      // one arrival a consumer warpgroup
    }
    exl_tma::mbar_init_fence();
  }
  __syncthreads();
  exl_pdl::pdl_wait();                                       // x is the kernel before's output
  const int KT = (a.K + kBK - 1) / kBK;
  const int warp = tid >> 5, lane = tid & 31;
  constexpr int P = pairs_of<NT>(), kPw = 8 * P;            // consumer warpgroup pairs, the producer's first warp
  if (warp >= kPw) {                                         // producer: a stage's boxes once both released it
    if constexpr (NT > 32) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");   // to the consumers
    if constexpr (producer_warps<NT, TW>()) {
      if (lane == 0) produce_boxes<NT, STAGES, TW>(a, smem, full, empty, groups, warp - kPw, KT, m0, f0);
    } else if (warp == kPw && lane == 0) {
      for (int kt = 0; kt < KT; ++kt) {
        const int slot = kt % STAGES;
        if (kt >= STAGES) exl_tma::mbar_wait(empty + slot, ((kt / STAGES) - 1) & 1);
        issue_stage<NT, TW>(a, smem + slot * L::kStage, full + slot, groups, kt, m0, f0);
      }
    }
    exl_pdl::pdl_trigger();
    return;
  }
  if constexpr (NT > 32) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int wg = tid >> 7, g = lane >> 2, t = lane & 3, pair = P > 1 ? wg >> 1 : 0;
  const int fp = (P > 1 ? wg & 1 : wg) * 64 + (warp & 3) * 16 + 2 * g;   // A rows g, g + 8 -> columns fp, fp + 1
  const uint32_t sel = static_cast<uint32_t>(t | 0x40 | (t << 8) | 0x4000);
  const bool releaser = (warp & 3) == 0 && lane == 0;        // arrives on a stage's empty barrier for its warpgroup
  float acc[NT / 2];
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;
  uint32_t A0[4][4], A1[4][4];
  // One tile: its stage full, its fragments dequantised while tile i - 1's wgmmas run, its wgmmas issued; then tile
  // i - 1 complete (wait_group 1), so its stage goes back to the producer.
  auto step = [&](int i, uint32_t(&A)[4][4]) {
    const int slot = i % STAGES;
    exl_tma::mbar_wait(full + slot, (i / STAGES) & 1);
    const uint8_t* st = smem + slot * L::kStage;
    int twin_row[2] = {-1, -1};
    if constexpr (TW) {
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) twin_row[ch] = 2 * i + ch < nchunks ? groups[kMaxChunks + 2 * i + ch] : -1;
    }
    exl_wgmma::fence_operands(acc);
    if (a.ss) {                                              // timing knob: A from x's tile, no fragments
      if constexpr (NT == 256) {
        const uint64_t da = exl_wgmma::sw128_desc(st + wg * 64 * 128), db = exl_wgmma::sw128_desc(st);
        exl_wgmma::fence();
#pragma unroll
        for (int s = 0; s < 4; ++s) exl_wgmma::wgmma_ss_n256(acc, da + 2 * s, db + 2 * s, 1);
        exl_wgmma::commit();
      }
    } else {
      if (a.skip_deq) {                                      // timing knob: the words as A
        const uint2* ws = reinterpret_cast<const uint2*>(st + L::kOffW);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const uint2 w = ws[r * (kBF / 2) + (fp >> 1)];
          A[r >> 1][2 * (r & 1)] = w.x & 0x3FFF3FFFu, A[r >> 1][2 * (r & 1) + 1] = w.y & 0x3FFF3FFFu;
        }
      } else {
        tile_fragments<NT, TW>(st, fp, sel, twin_row, A);
      }
      mma_tile<NT>(acc, A, st);
    }
    exl_wgmma::fence_operands(acc);
    exl_wgmma::wait<1>();
    if (releaser && i >= P) exl_tma::mbar_arrive(empty + (i - P) % STAGES);   // the pair's tile before
  };
  int i = pair;
  for (; i + P < KT; i += 2 * P) {                           // two register sets, each in one place
    step(i, A0);
    step(i + P, A1);
  }
  if (i < KT) step(i, A0);
  exl_wgmma::wait<0>();
  exl_wgmma::fence_operands(acc);
  if constexpr (P == 2) {            // pair 1's sums to pair 0 through shared memory ([half][element][thread])
    float* red = reinterpret_cast<float*>(groups + (TW ? 4 : 1) * kMaxChunks) + (wg & 1) * (NT / 2) * 128;
    const int tw = tid & 127;
    if (pair == 1) {
#pragma unroll
      for (int e = 0; e < NT / 2; ++e) red[e * 128 + tw] = acc[e];
    }
    asm volatile("bar.sync 1, 512;\n" ::: "memory");        // the consumers of both pairs
    if (pair == 1) {
      exl_pdl::pdl_trigger();
      return;
    }
#pragma unroll
    for (int e = 0; e < NT / 2; ++e) acc[e] += red[e * 128 + tw];
  }
  exl_pdl::pdl_trigger();
  if (!a.skip_store) store_tile<NT>(a, acc, m0 + 2 * t, f0 + fp);
#endif
}

// Lost (stop 45 call 3, `git show 346df0d:exl_core/csrc/cuda/qgemm_wg_kernel.cuh`): a group's scales and zeros
// converted once for its two tiles: a 7B layer 1,426.81 us against 1,393.29 without (GPTQ, interleaved rounds).
// Lost (stop 45 call 1, `git show 1cb7ea8:...`): two blocks an SM without a producer warpgroup (consumer thread 0
// issuing the copies, 128 registers): ptxas serialized the wgmmas for lack of registers; 2,725.70 against 1,216.00.
// Lost (stop 44 call 14, `git show f1b3fc3:exl_core/csrc/cuda/qgemm_wg_kernel.cuh`): a persistent launch (a block an
// SM walking the tiles, stages and barrier phases running on, a tile's last stage released before its stores): a 7B
// layer 1,382.92 us against 1,322.95 for a block a tile in the same run (GPTQ).
// Lost (stop 44 call 13, `git show 792033c:exl_core/csrc/cuda/qgemm_wg_kernel.cuh`): column-tile pairs in a cluster
// of 2, each block bringing half of x's tile to both by multicast (a stage released by all four MMA warpgroups):
// a 7B layer 1,686.12 us against 1,284.96 without -- x's L2 traffic was not the limit.
// Lost (bench/wgmma_probe.cu, H200, stop 44 call 6; `git show 1ea603f:exl_core/csrc/cuda/qgemm_wg_kernel.cuh`):
// the dequantise in a warpgroup of its own writing A by stmatrix for A-from-shared-memory wgmmas ran 1.88x slower a
// layer -- ptxas compiles every branch within the launch bound's registers, so 128 accumulators a thread leave room
// for one such warpgroup only, and its four warps, each with twice the dequantise, became the bottleneck.

template <int NT, int STAGES, bool TW>
constexpr int smem_bytes() {
  return STAGES * Layout<NT, TW>::kStage + 1024 + STAGES * 16 + (TW ? 4 : 1) * kMaxChunks * 4 +
         (pairs_of<NT>() > 1 ? 2 * (NT / 2) * 128 * 4 : 0);
}

}  // namespace exl_wg
