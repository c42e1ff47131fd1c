// Design probe for the 9..32-row decode GEMM (bs8-32 decode): a standalone kernel, built in seconds with nvcc,
// timed on the 7B decode shapes before it goes into the extension (whose build takes minutes).
//   nvcc -O3 -arch=sm_90 -o /tmp/wide_probe bench/wide_probe.cu && /tmp/wide_probe
// (bench/gpu.sh phase `wide`.)  Every figure: 16 distinct weight sets launched back to back in one CUDA graph
// (together beyond the 50 MB L2), median of 10 replays, us per launch.
//
// Why a new kernel: qgemm_kslice at 32 rows (a block = 32 columns x KW warps along K) runs at ~0.7 TB/s; each
// block re-reads all of x from L2 with 4 16-byte loads per lane per chunk (4x the weight bytes) and runs 24 mma
// per chunk (8 of them sum x for the zero term) at ~2 warps per scheduler (213-222 registers).
// Here ("wide"):
//   block   CW warps side by side = 32*CW columns of one K range; x's rows for that range go to shared memory
//           once per block (cp.async, NSTAGE stages of R chunks), read by every warp: x leaves L2 once per
//           32*CW columns instead of once per 32.
//   A       the weights, scaled in fp16 before the mma: pair (1024+q) by one LOP3, -1024 exact (HSUB2), then
//           q*s - z*s (HFMA2): 16 mma per chunk and one accumulator set (no x sums, no fp32 d/acc split).
//   split-K grid y, clusters (1, S, 1) reduced through distributed shared memory, as qgemm_skinny.
// What the probe found (H200, this file's calls in one session; bench/results/wide_probe_h200.json):
//   v1 (per-chunk global loads of scale/zero, runtime divisions in the loops): 4096x4096 18.3, q/k/v 35.9,
//      gate/up 59.0, 11008x4096 40.7 us at 32 rows (qgemm_kslice 12.9 / 38.4 / 66.0 / 30.2).
//   scale/zero staged in shared memory by cp.async, zero-fill only for rows >= M: 14.9 / 30.1 / 50.1 / 33.9.
//   v2 loop (pointer increments, full stages without per-chunk bounds checks, compile-time divisors in the x
//      staging): cw4 r4 st3 13.0 / 26.5 / 39.9 / 27.3 -- the kernel qgemm_wide_cuda.cu ports.  ncu (cw4 r8 st3,
//      4096x4096, 8 splits): 12.8 instructions per HMMA, stall samples prologue 28 % / loop 46 % / cluster
//      reduction 26 %; 5.7 cycles between a warp's instructions, 8 warps per SM.
//   not kept: two 32-column sets per warp (one x fragment for both; 168 registers) 15.4 / 27.5 / 36.7 / 31.9;
//      weights through the shared-memory stages by cp.async (more bytes in flight, fewer blocks per SM):
//      18.5 / 35.1 / 57.5 / 38.7 at best; split counts 3, 5, 6, 12, 16 (clusters above 8 non-portable) and
//      ring/stage depths r4 st2, r2 st4: within +-1 us of the best or worse.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

__device__ __forceinline__ void b_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = __byte_perm(v.x, v.z, 0x5410);
  b[1] = __byte_perm(v.x, v.z, 0x7632);
  b[2] = __byte_perm(v.y, v.w, 0x5410);
  b[3] = __byte_perm(v.y, v.w, 0x7632);
}

constexpr int kPad = 32;   // halves per staged x row: rows g, g+1 of one LDS.128 phase on other banks

// x [M, K] fp16 (M <= 8*NT), qw [K/8, N] int32 (8 k per word, row-major), scale/zero [K/gs, N] fp32, y [M, N].
// grid (N / TILE, S); block 32 CW; the block's K range = chunks [split*cps, +cps).  A warp covers CPW sets of 32
// columns (set h: columns h*32*CW + warp*32 + 4g..): one B fragment load serves CPW weight words.
template <int CW, int NT, int R, int NSTAGE, int CPW = 1>
__global__ void __launch_bounds__(32 * CW, (CPW == 1 ? 16 : 12) / CW) wide_kernel(const __half* __restrict__ x, int M, int K, int N,
                                                        const int* __restrict__ qw, const float* __restrict__ scale,
                                                        const float* __restrict__ zero, int gs, __half* __restrict__ y,
                                                        int cps) {
  constexpr int TILE = 32 * CW * CPW, ROWS = 8 * NT, SW = R * 32 + kPad;   // staged row width in halves
  constexpr int PIECES = ROWS * R * 4;                                     // 16-byte pieces of x per stage
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);                 // [NSTAGE][ROWS][SW]
  float* red = reinterpret_cast<float*>(smem_raw);                  // [M][TILE], after the K loop (aliases xs)
  const int xbytes = max(NSTAGE * ROWS * SW * 2, M * TILE * 4);
  float* szs = reinterpret_cast<float*>(smem_raw + xbytes);          // [groups][2][TILE]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_chunks = K / 32;
  const int c_begin = blockIdx.y * cps, c_end = min(n_chunks, c_begin + cps);
  const int nc = c_end - c_begin;

  // lane's word pointers (int4 units: a chunk is 4 rows = N int4 further)
  const int4* wp[CPW];
#pragma unroll
  for (int h = 0; h < CPW; ++h) {
    const int col = blockIdx.x * TILE + h * 32 * CW + warp * 32 + 4 * g;
    const int lcol = col < N ? col : N - 4;
    wp[h] = reinterpret_cast<const int4*>(qw + static_cast<size_t>(4 * c_begin + t) * N + lcol);
  }
  int4 ring[R][CPW];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int h = 0; h < CPW; ++h) ring[i][h] = i < nc ? __ldg(wp[h] + static_cast<size_t>(i) * N) : make_int4(0, 0, 0, 0);
#pragma unroll
  for (int h = 0; h < CPW; ++h) wp[h] += static_cast<size_t>(R) * N;     // next chunk to load: c_begin + R
  // scale/zero rows of the block's groups -> shared memory [ngr][scale TILE | zero TILE] fp32, by cp.async before
  // x (weights are fixed; a group change then reads shared memory instead of waiting on DRAM)
  const int gshift = 31 - __clz(gs / 32);                          // groups of 32 << gshift rows
  const int g_first = c_begin >> gshift, ngr = nc > 0 ? ((c_end - 1) >> gshift) - g_first + 1 : 0;
  for (int i = threadIdx.x; i < ngr * (TILE / 2); i += blockDim.x) {
    const int gr = i / (TILE / 2), r = i % (TILE / 2), half = r / (TILE / 4), q = r % (TILE / 4);
    int cq = blockIdx.x * TILE + 4 * q;
    cq = cq < N ? cq : N - 4;
    cp_async16(szs + (gr * 2 + half) * TILE + 4 * q, (half ? zero : scale) + static_cast<size_t>(g_first + gr) * N + cq);
  }
  // rows M..ROWS-1 of every stage stay zero (cp.async never writes them)
  if (M < ROWS) {
    for (int i = threadIdx.x; i < (ROWS - M) * (SW / 8); i += blockDim.x) {
      const int r = M + i / (SW / 8), q = i % (SW / 8);
#pragma unroll
      for (int st = 0; st < NSTAGE; ++st) reinterpret_cast<uint4*>(xs + (st * ROWS + r) * SW)[q] = make_uint4(0, 0, 0, 0);
    }
  }
  const int nst = (nc + R - 1) / R;
  // stage s: pieces (row m, 8 values at k8) of chunks c_begin + s*R ..; thread-fixed mapping (compile-time divisors)
  const __half* xsrc = x + static_cast<size_t>(c_begin) * 32;
  auto issue = [&](int s) {
    __half* dst = xs + (s % NSTAGE) * ROWS * SW;
    const int L = min(R, nc - s * R) * 32;
#pragma unroll
    for (int i0 = 0; i0 < PIECES; i0 += 32 * CW) {
      const int i = i0 + threadIdx.x;
      const int m = i / (R * 4), k = 8 * (i % (R * 4));
      if ((PIECES % (32 * CW) == 0 || i < PIECES) && m < M && k < L)
        cp_async16(dst + m * SW + k, xsrc + static_cast<size_t>(m) * K + s * R * 32 + k);
    }
  };
#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < nst) issue(s);
    cp_commit();
  }

  float acc[CPW][2][NT][4];
#pragma unroll
  for (int h = 0; h < CPW; ++h)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][u][nt][i] = 0.f;
  __half2 sh[CPW][4], zs[CPW][4];
  const __half2 k1024 = __float2half2_rn(1024.f);
  int grp = -1;

  auto chunk = [&](int i, int c, const __half* xb, bool reload) {
    const int gi = c >> gshift;
    if (gi != grp) {                                         // warp-uniform
      grp = gi;
#pragma unroll
      for (int h = 0; h < CPW; ++h) {
        const float* sp = szs + (gi - g_first) * 2 * TILE + h * 32 * CW + warp * 32 + 4 * g;
        const float4 s4 = *reinterpret_cast<const float4*>(sp), z4 = *reinterpret_cast<const float4*>(sp + TILE);
        const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, zv[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          sh[h][v] = __float2half2_rn(sv[v]);
          zs[h][v] = __float2half2_rn(-zv[v] * sv[v]);
        }
      }
    }
    uint32_t b[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) b_pairs(*reinterpret_cast<const uint4*>(xb + nt * 8 * SW + i * 32), b[nt]);
#pragma unroll
    for (int h = 0; h < CPW; ++h) {
      uint32_t a[4][4];
      const uint32_t w[4] = {static_cast<uint32_t>(ring[i][h].x), static_cast<uint32_t>(ring[i][h].y),
                             static_cast<uint32_t>(ring[i][h].z), static_cast<uint32_t>(ring[i][h].w)};
#pragma unroll
      for (int v = 0; v < 4; ++v)
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const uint32_t hb = ((w[v] >> (4 * p)) & 0x000F000Fu) | 0x64006400u;
          a[v][p] = h2u(__hfma2(__hsub2(u2h(hb), k1024), sh[h][v], zs[h][v]));
        }
      if (reload) ring[i][h] = __ldg(wp[h]);
      wp[h] += N;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            mma16816(acc[h][u][nt], a[2 * u][2 * j], a[2 * u + 1][2 * j], a[2 * u][2 * j + 1], a[2 * u + 1][2 * j + 1],
                     b[nt][2 * j], b[nt][2 * j + 1]);
    }
  };

  for (int s = 0; s < nst; ++s) {
    cp_wait<NSTAGE - 2>();
    __syncthreads();
    if (s + NSTAGE - 1 < nst) issue(s + NSTAGE - 1);
    cp_commit();
    const __half* xb = xs + (s % NSTAGE) * ROWS * SW + g * SW + 8 * t;
    const int cs = c_begin + s * R;
    if (cs + 2 * R <= c_end) {                                 // full stage, every reload exists
#pragma unroll
      for (int i = 0; i < R; ++i) chunk(i, cs + i, xb, true);
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (cs + i < c_end) chunk(i, cs + i, xb, cs + i + R < c_end);
    }
  }

  __syncthreads();                                                   // x stages dead: red aliases them
  // partial tile -> red [M][TILE]; accumulator (h, u, nt, i): column h*32*CW + warp*32 + 4g + 2u + (i >> 1),
  // row 8nt + 2t + (i & 1)
#pragma unroll
  for (int h = 0; h < CPW; ++h)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = 8 * nt + 2 * t + (i & 1);
          if (row < M) red[row * TILE + h * 32 * CW + warp * 32 + 4 * g + 2 * u + (i >> 1)] = acc[h][u][nt][i];
        }
  const int E = M * TILE, S = gridDim.y;
  auto store = [&](int idx, float v) {
    const int m = idx / TILE, n = blockIdx.x * TILE + idx % TILE;
    if (n < N) y[static_cast<size_t>(m) * N + n] = __float2half_rn(v);
  };
  if (S == 1) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < E; idx += blockDim.x) store(idx, red[idx]);
    return;
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int rank = static_cast<int>(cluster.block_rank());
  for (int idx = rank * blockDim.x + threadIdx.x; idx < E; idx += S * blockDim.x) {
    float v[16];
#pragma unroll
    for (int q = 0; q < 16; ++q) v[q] = q < S ? cluster.map_shared_rank(red, q)[idx] : 0.f;
    float a = 0.f;
#pragma unroll
    for (int q = 0; q < 16; ++q) a += v[q];
    store(idx, a);
  }
  cluster.sync();
}

// Variant "ws": the weights also go through the shared-memory stages by cp.async (each thread copies the 16 bytes
// it will read, so only x needs the block barrier): NSTAGE-1 stages of R chunks in flight per lane without
// registers, where the register ring held R.
template <int CW, int NT, int R, int NSTAGE>
__global__ void __launch_bounds__(32 * CW, 8 / CW) wide_ws_kernel(const __half* __restrict__ x, int M, int K, int N,
                                                                  const int* __restrict__ qw, const float* __restrict__ scale,
                                                                  const float* __restrict__ zero, int gs,
                                                                  __half* __restrict__ y, int cps) {
  constexpr int TILE = 32 * CW, ROWS = 8 * NT, SW = R * 32 + kPad, PIECES = ROWS * R * 4;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);                             // [NSTAGE][ROWS][SW]
  int4* wsm = reinterpret_cast<int4*>(smem_raw + NSTAGE * ROWS * SW * 2);         // [NSTAGE][R][TILE]
  float* red = reinterpret_cast<float*>(smem_raw);                              // [M][TILE] after the loop
  const int xbytes = max(NSTAGE * ROWS * SW * 2 + NSTAGE * R * TILE * 16, M * TILE * 4);
  float* szs = reinterpret_cast<float*>(smem_raw + xbytes);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_chunks = K / 32;
  const int c_begin = blockIdx.y * cps, c_end = min(n_chunks, c_begin + cps), nc = max(0, c_end - c_begin);
  const int col = blockIdx.x * TILE + warp * 32 + 4 * g, lcol = col < N ? col : N - 4;
  const int* wsrc = qw + static_cast<size_t>(4 * c_begin + t) * N + lcol;        // chunk c_begin's word
  const int gshift = 31 - __clz(gs / 32);
  const int g_first = c_begin >> gshift, ngr = nc > 0 ? ((c_end - 1) >> gshift) - g_first + 1 : 0;
  for (int i = threadIdx.x; i < ngr * (TILE / 2); i += blockDim.x) {
    const int gr = i / (TILE / 2), r = i % (TILE / 2), half = r / (TILE / 4), q = r % (TILE / 4);
    int cq = blockIdx.x * TILE + 4 * q;
    cq = cq < N ? cq : N - 4;
    cp_async16(szs + (gr * 2 + half) * TILE + 4 * q, (half ? zero : scale) + static_cast<size_t>(g_first + gr) * N + cq);
  }
  if (M < ROWS) {
    for (int i = threadIdx.x; i < (ROWS - M) * (SW / 8); i += blockDim.x) {
      const int r = M + i / (SW / 8), q = i % (SW / 8);
#pragma unroll
      for (int st = 0; st < NSTAGE; ++st) reinterpret_cast<uint4*>(xs + (st * ROWS + r) * SW)[q] = make_uint4(0, 0, 0, 0);
    }
  }
  const int nst = (nc + R - 1) / R;
  const __half* xsrc = x + static_cast<size_t>(c_begin) * 32;
  auto issue = [&](int s) {
    const int st = s % NSTAGE, L = min(R, nc - s * R);
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < L) cp_async16(wsm + (st * R + i) * TILE + threadIdx.x, wsrc + static_cast<size_t>(4 * (s * R + i)) * N);
    __half* dst = xs + st * ROWS * SW;
#pragma unroll
    for (int i0 = 0; i0 < PIECES; i0 += 32 * CW) {
      const int i = i0 + threadIdx.x, m = i / (R * 4), k = 8 * (i % (R * 4));
      if (m < M && k < L * 32) cp_async16(dst + m * SW + k, xsrc + static_cast<size_t>(m) * K + s * R * 32 + k);
    }
  };
#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    if (s < nst) issue(s);
    cp_commit();
  }
  float acc[2][NT][4];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
  __half2 sh[4], zs[4];
  const __half2 k1024 = __float2half2_rn(1024.f);
  int grp = -1;
  for (int s = 0; s < nst; ++s) {
    cp_wait<NSTAGE - 2>();
    __syncthreads();
    if (s + NSTAGE - 1 < nst) issue(s + NSTAGE - 1);
    cp_commit();
    const int st = s % NSTAGE;
    const __half* xb = xs + st * ROWS * SW + g * SW + 8 * t;
    const int cs = c_begin + s * R;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (cs + i >= c_end) break;
      const int gi = (cs + i) >> gshift;
      if (gi != grp) {
        grp = gi;
        const float* sp = szs + (gi - g_first) * 2 * TILE + warp * 32 + 4 * g;
        const float4 s4 = *reinterpret_cast<const float4*>(sp), z4 = *reinterpret_cast<const float4*>(sp + TILE);
        const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, zv[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          sh[v] = __float2half2_rn(sv[v]);
          zs[v] = __float2half2_rn(-zv[v] * sv[v]);
        }
      }
      const int4 wv = wsm[(st * R + i) * TILE + threadIdx.x];
      uint32_t b[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) b_pairs(*reinterpret_cast<const uint4*>(xb + nt * 8 * SW + i * 32), b[nt]);
      const uint32_t w[4] = {static_cast<uint32_t>(wv.x), static_cast<uint32_t>(wv.y), static_cast<uint32_t>(wv.z),
                             static_cast<uint32_t>(wv.w)};
      uint32_t a[4][4];
#pragma unroll
      for (int v = 0; v < 4; ++v)
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const uint32_t hb = ((w[v] >> (4 * p)) & 0x000F000Fu) | 0x64006400u;
          a[v][p] = h2u(__hfma2(__hsub2(u2h(hb), k1024), sh[v], zs[v]));
        }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            mma16816(acc[u][nt], a[2 * u][2 * j], a[2 * u + 1][2 * j], a[2 * u][2 * j + 1], a[2 * u + 1][2 * j + 1],
                     b[nt][2 * j], b[nt][2 * j + 1]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 8 * nt + 2 * t + (i & 1);
        if (row < M) red[row * TILE + warp * 32 + 4 * g + 2 * u + (i >> 1)] = acc[u][nt][i];
      }
  const int E = M * TILE, S = gridDim.y;
  auto store = [&](int idx, float v) {
    const int m = idx / TILE, n = blockIdx.x * TILE + idx % TILE;
    if (n < N) y[static_cast<size_t>(m) * N + n] = __float2half_rn(v);
  };
  if (S == 1) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < E; idx += blockDim.x) store(idx, red[idx]);
    return;
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int rank = static_cast<int>(cluster.block_rank());
  for (int idx = rank * blockDim.x + threadIdx.x; idx < E; idx += S * blockDim.x) {
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = q < S ? cluster.map_shared_rank(red, q)[idx] : 0.f;
    float a = 0.f;
#pragma unroll
    for (int q = 0; q < 8; ++q) a += v[q];
    store(idx, a);
  }
  cluster.sync();
}

// fp32 reference: y[m][n] = sum_k x[m][k] * (q - z) * s
__global__ void ref_kernel(const __half* x, int M, int K, int N, const int* qw, const float* scale, const float* zero,
                           int gs, float* y) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= N) return;
  float a = 0.f;
  for (int k = 0; k < K; ++k) {
    const int q = (qw[static_cast<size_t>(k / 8) * N + n] >> (4 * (k % 8))) & 15;
    const int gi = k / gs;
    a += __half2float(x[static_cast<size_t>(m) * K + k]) * (q - zero[static_cast<size_t>(gi) * N + n]) *
         scale[static_cast<size_t>(gi) * N + n];
  }
  y[static_cast<size_t>(m) * N + n] = a;
}

struct Set {
  int* qw;
  float *s, *z;
  __half* y;
};

template <int CW, int NT, int R, int NSTAGE, int CPW = 1, bool WS_ = false>
struct Launcher {
  static constexpr bool WS = WS_;
  static size_t smem(int M, int K = 4096, int S = 8) {
    const int cps = (K / 32 + S - 1) / S, ngr = cps * 32 / 128 + 2;
    const size_t stages = static_cast<size_t>(NSTAGE) * 8 * NT * (R * 32 + kPad) * 2 +
                          (WS ? static_cast<size_t>(NSTAGE) * R * 32 * CW * 16 : 0);
    return std::max(stages, static_cast<size_t>(M) * 32 * CW * CPW * 4) + static_cast<size_t>(ngr) * 2 * 32 * CW * CPW * 4;
  }
  static auto kern() {
    if constexpr (WS) return wide_ws_kernel<CW, NT, R, NSTAGE>;
    else return wide_kernel<CW, NT, R, NSTAGE, CPW>;
  }
  static void go(const __half* x, int M, int K, int N, const Set& w, int S, cudaStream_t st) {
    auto* k = kern();
    const size_t sm = smem(M, K, S);
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    if (S > 8) CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    const int n_chunks = K / 32, cps = (n_chunks + S - 1) / S;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((N + 32 * CW * CPW - 1) / (32 * CW * CPW), S, 1);
    cfg.blockDim = dim3(32 * CW, 1, 1);
    cfg.dynamicSmemBytes = sm;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = S;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = S > 1 ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k, x, M, K, N, static_cast<const int*>(w.qw), static_cast<const float*>(w.s),
                          static_cast<const float*>(w.z), 128, w.y, cps));
  }
  static int regs() {
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, kern()));
    return a.numRegs;
  }
};

template <class L>
float time_us(const __half* x, int M, int K, int N, std::vector<Set>& sets, int S) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  L::go(x, M, K, N, sets[0], S, st);   // warm, and surfaces launch errors
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (auto& w : sets) L::go(x, M, K, N, w, S, st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < 12; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 2) ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  return ts[ts.size() / 2] * 1000.f / sets.size();
}

template <class L>
double max_rel_err(const __half* x, int M, int K, int N, const Set& w) {
  float* ref;
  CK(cudaMalloc(&ref, sizeof(float) * M * N));
  ref_kernel<<<dim3((N + 127) / 128, M), 128>>>(x, M, K, N, w.qw, w.s, w.z, 128, ref);
  CK(cudaMemset(w.y, 0xFF, sizeof(__half) * M * N));   // poisoned: NaN where nothing is written
  L::go(x, M, K, N, w, 4, 0);
  CK(cudaDeviceSynchronize());
  std::vector<float> r(static_cast<size_t>(M) * N);
  std::vector<__half> o(static_cast<size_t>(M) * N);
  CK(cudaMemcpy(r.data(), ref, sizeof(float) * M * N, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.data(), w.y, sizeof(__half) * M * N, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double d = static_cast<double>(__half2float(o[i])) - r[i];
    num = std::max(num, std::isnan(d) ? 1e30 : std::fabs(d));
    den = std::max(den, static_cast<double>(std::fabs(r[i])));
  }
  CK(cudaFree(ref));
  return num / den;
}

template <class L>
void row(const char* name, const char* shape, const __half* x, int M, int K, int N, std::vector<Set>& sets) {
  float best = 1e30f;
  int best_s = 0;
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, L::kern(), 128, L::smem(M, K, 4)));
  printf("%-16s %-12s M=%2d regs=%3d smem=%6zu occ=%d err=%.2e |", name, shape, M, L::regs(), L::smem(M), per_sm,
         max_rel_err<L>(x, M, K, N, sets[0]));
  for (int S : {2, 3, 4, 5, 6, 8, 12, 16}) {
    if (L::smem(M, K, S) > 200 * 1024) continue;
    if (S > 8 && L::WS) continue;
    const float us = time_us<L>(x, M, K, N, sets, S);
    printf(" S%d %6.1f", S, us);
    if (us < best) { best = us; best_s = S; }
  }
  printf(" | best %.1f us (S%d)\n", best, best_s);
  printf("JSON {\"kernel\": \"%s\", \"shape\": \"%s\", \"M\": %d, \"us\": %.2f, \"S\": %d, \"regs\": %d}\n", name, shape,
         M, best, best_s, L::regs());
}

static bool g_one = false;   // `wide_probe one`: only 4096x4096, M=32, cw4 r8 st3 (for ncu)

int main(int argc, char** argv) {
  g_one = argc > 1;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  struct Shape { const char* name; int K, N; };
  // q/k/v and gate/up as one matrix of the summed width: the same bytes and columns as one multi-weight launch
  const Shape shapes[] = {{"4096x4096", 4096, 4096}, {"qkv 4096x12288", 4096, 12288},
                          {"gu 4096x22016", 4096, 22016}, {"11008x4096", 11008, 4096}};
  srand(1);
  for (const Shape& sh : shapes) {
    if (g_one && sh.K != 4096) continue;
    if (g_one && sh.N != 4096) continue;
    const int K = sh.K, N = sh.N, G = K / 128;
    const size_t wbytes = static_cast<size_t>(K) / 8 * N * 4;
    const int nsets = std::max<int>(2, static_cast<int>(std::min<size_t>(16, (400u << 20) / wbytes)));
    std::vector<Set> sets(nsets);
    std::vector<int> hq(static_cast<size_t>(K) / 8 * N);
    std::vector<float> hs(static_cast<size_t>(G) * N), hz(static_cast<size_t>(G) * N);
    for (auto& w : sets) {
      for (auto& v : hq) v = (rand() << 16) ^ rand();
      for (auto& v : hs) v = 0.002f + 0.002f * (rand() / static_cast<float>(RAND_MAX));
      for (auto& v : hz) v = static_cast<float>(rand() % 16);
      CK(cudaMalloc(&w.qw, hq.size() * 4));
      CK(cudaMalloc(&w.s, hs.size() * 4));
      CK(cudaMalloc(&w.z, hz.size() * 4));
      CK(cudaMalloc(&w.y, static_cast<size_t>(32) * N * 2));
      CK(cudaMemcpy(w.qw, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(w.s, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(w.z, hz.data(), hz.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<__half> hx(static_cast<size_t>(32) * K);
    for (auto& v : hx) v = __float2half(2.f * rand() / RAND_MAX - 1.f);
    __half* x;
    CK(cudaMalloc(&x, hx.size() * 2));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    if (g_one) {
      for (auto& w : sets) Launcher<4, 4, 4, 3>::go(x, 32, K, N, w, 16, 0);
      CK(cudaDeviceSynchronize());
      return 0;
    }
    for (int M : {32}) {
      row<Launcher<4, 4, 4, 3>>("cw4 r4 st3", sh.name, x, M, K, N, sets);
      row<Launcher<4, 4, 4, 2>>("cw4 r4 st2", sh.name, x, M, K, N, sets);
      row<Launcher<4, 4, 2, 4>>("cw4 r2 st4", sh.name, x, M, K, N, sets);
    }
    for (auto& w : sets) {
      CK(cudaFree(w.qw));
      CK(cudaFree(w.s));
      CK(cudaFree(w.z));
      CK(cudaFree(w.y));
    }
    CK(cudaFree(x));
  }
  return 0;
}
