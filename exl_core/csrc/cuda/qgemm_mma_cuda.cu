// exl_core::qgemm_mma: fused dequantise + tensor-core GEMM for fp16 x with 1..32 rows per launch
// (more rows: 32-row slices), over the PackedWeight chunk table (see qmatmul_cuda.cu).
//
// Each weight word is read once from device memory with 16-byte loads and dequantised to fp16
// in registers straight into mma.sync.m16n8k16 B fragments; no atomics, no zeroing pass.
//
//   block  = 8 warps = 4 column warps x 2 K warps; 128 output columns per block.
//   warp   = 32 columns: lane (g = lane/4, t = lane%4) loads the int4 of columns 4g..4g+3 of
//            the qweight row holding values 8t..8t+7 of the 32-row chunk (two rows when the
//            values straddle words), so each lane owns 8 K values x 4 columns per chunk.
//            Column tile v (0..3) of the mma is the strided column set {4g + v}.
//   K order: k is a reduction index, so the mma's k slots may map to any real k as long as
//            A and B agree. B takes pairs (q_p, q_p+4) (one shift + LOP3 for 4-bit); x is
//            staged in shared memory already in that order (frag_to_real below), fp16.
//   split-K: the grid's y dimension splits K; on sm_90 those blocks form one thread-block
//            cluster and reduce their partial tiles through distributed shared memory, so the
//            result is deterministic and written once (with bias) by one launch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

constexpr int kColWarps = 4, kKWarps = 2, kThreads = 32 * kColWarps * kKWarps;
constexpr int kTileN = 32 * kColWarps;   // 128 output columns per block
constexpr int kStageChunks = 32;          // x staged 32 chunks (1024 K rows) at a time
constexpr int kPad = 8;                   // halves of row padding: conflict-free A loads
constexpr int kMaxSplits = 8;             // portable cluster size

// Real k (0..31 inside a chunk) held by shared-memory slot j*16 + f (j: k16 step, f: mma k slot).
// Lane t's B pairs are (q_p, q_p+4) of its values 8t..8t+7: step j uses p = 2j (k slots 2t, 2t+1)
// and p = 2j + 1 (k slots 2t+8, 2t+9).
__device__ __forceinline__ int frag_to_real(int j, int f) {
  return 8 * ((f & 7) >> 1) + 2 * j + (f >> 3) + 4 * (f & 1);
}

struct Raw {        // one chunk's words for a lane's 4 columns
  int4 lo, hi;
  int bits;         // 0: no chunk (past the end)
  int grp;
};

// `tab` points at chunk c's (bits, group, qrow): the block's table copy in shared memory, or the
// global table for the first loads that are issued before that copy exists.
__device__ __forceinline__ void load_raw(Raw& r, bool exists, const int32_t* tab, const int32_t* __restrict__ qweight,
                                         int64_t N, int64_t col, bool valid, int t) {
  r.bits = 0;
  if (!exists) return;
  const int bits = tab[0], qrow = tab[2];
  r.bits = bits;
  r.grp = tab[1];
  r.lo = r.hi = make_int4(0, 0, 0, 0);
  if (!valid) return;
  const int start = 8 * t * bits;
  const int32_t* p = qweight + static_cast<int64_t>(qrow + (start >> 5)) * N + col;
  r.lo = __ldg(reinterpret_cast<const int4*>(p));
  if ((start & 31) + 8 * bits > 32) r.hi = __ldg(reinterpret_cast<const int4*>(p + N));
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Pair p of a lane's 8 values as fp16x2 bits of (1024 + q_p, 1024 + q_p+4), exact for q < 1024.
template <int BITS>
__device__ __forceinline__ uint32_t pair_bits(uint32_t wl, uint32_t wh, int sh, int p) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  if constexpr (BITS == 4) {
    return ((wl >> (4 * p)) & 0x000F000Fu) | 0x64006400u;   // 8 values in one word, sh == 0
  } else if constexpr (BITS * 8 <= 32) {                      // 2, 3 bits: 16 / 24-bit window
    const uint32_t w = __funnelshift_r(wl, wh, sh);
    return ((w >> (BITS * p)) & mask) | (((w >> (BITS * (p + 4))) & mask) << 16) | 0x64006400u;
  } else {                                                    // 5, 6, 8 bits: up to 64-bit window
    const uint64_t w = ((static_cast<uint64_t>(wh) << 32) | wl) >> sh;
    const uint32_t a = static_cast<uint32_t>(w >> (BITS * p)) & mask;
    const uint32_t b = static_cast<uint32_t>(w >> (BITS * (p + 4))) & mask;
    return a | (b << 16) | 0x64006400u;
  }
}

__device__ __forceinline__ uint32_t comp(const int4& v, int i) {
  return static_cast<uint32_t>(i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w);
}

// acc[mt][v] += x_chunk @ W_chunk with W = (q - z) * s applied after the mma:
//   d = x . (1024 + q)   (tensor cores, B straight from the packed bits: no fp16 dequant math)
//   acc += s * (d - (1024 + z) * sum(x))      per output column, sum(x) over the chunk's 32 k.
// d holds ~7 bits of cancellation at most (|q| <= 255 against 1024) within fp32: far below fp16.
// The D fragment's columns are 8t..8t+7 of the warp's 32, so the lane reads those scales/zeros.
template <int BITS, int MT>
__device__ __forceinline__ void mma_chunk(const Raw& r, const __half* xc, int xs_stride, const float* xsum_c,
                                          int xsum_stride, const float* __restrict__ scale,
                                          const float* __restrict__ zero, int64_t N, int64_t scol, int g, int t, int M,
                                          float (&acc)[MT][4][4]) {
  float sz[16];                                               // s[8], then -(1024 + z)[8]
  {
    const int64_t off = static_cast<int64_t>(r.grp) * N + scol;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float4 sv = make_float4(0.f, 0.f, 0.f, 0.f), zv = sv;
      if (scol + 4 * h < N) {
        sv = __ldg(reinterpret_cast<const float4*>(scale + off + 4 * h));
        zv = __ldg(reinterpret_cast<const float4*>(zero + off + 4 * h));
      }
      sz[4 * h] = sv.x; sz[4 * h + 1] = sv.y; sz[4 * h + 2] = sv.z; sz[4 * h + 3] = sv.w;
      sz[8 + 4 * h] = -1024.f - zv.x; sz[9 + 4 * h] = -1024.f - zv.y;
      sz[10 + 4 * h] = -1024.f - zv.z; sz[11 + 4 * h] = -1024.f - zv.w;
    }
  }
  const int sh = (8 * t * BITS) & 31;
  uint32_t b[4][4];                                           // [column tile v][pair p]
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint32_t wl = comp(r.lo, v), wh = comp(r.hi, v);
#pragma unroll
    for (int p = 0; p < 4; ++p) b[v][p] = pair_bits<BITS>(wl, wh, sh, p);
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const bool h0 = mt * 16 + g < M, h1 = mt * 16 + g + 8 < M;   // unstaged rows are zero
    float d[4][4];
#pragma unroll
    for (int v = 0; v < 4; ++v)
#pragma unroll
      for (int i = 0; i < 4; ++i) d[v][i] = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half* r0 = xc + (mt * 16 + g) * xs_stride + j * 16 + 2 * t;
      const __half* r1 = r0 + 8 * xs_stride;
      const uint32_t a0 = h0 ? *reinterpret_cast<const uint32_t*>(r0) : 0u;
      const uint32_t a1 = h1 ? *reinterpret_cast<const uint32_t*>(r1) : 0u;
      const uint32_t a2 = h0 ? *reinterpret_cast<const uint32_t*>(r0 + 8) : 0u;
      const uint32_t a3 = h1 ? *reinterpret_cast<const uint32_t*>(r1 + 8) : 0u;
#pragma unroll
      for (int v = 0; v < 4; ++v) mma16816(d[v], a0, a1, a2, a3, b[v][2 * j], b[v][2 * j + 1]);
    }
    const float x0 = h0 ? xsum_c[(mt * 16 + g) * xsum_stride] : 0.f;
    const float x1 = h1 ? xsum_c[(mt * 16 + g + 8) * xsum_stride] : 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {                             // d[v]: (g, 8t+v) (g, 8t+4+v) (g+8, ..) (g+8, ..)
      acc[mt][v][0] = fmaf(sz[v], fmaf(sz[8 + v], x0, d[v][0]), acc[mt][v][0]);
      acc[mt][v][1] = fmaf(sz[4 + v], fmaf(sz[12 + v], x0, d[v][1]), acc[mt][v][1]);
      acc[mt][v][2] = fmaf(sz[v], fmaf(sz[8 + v], x1, d[v][2]), acc[mt][v][2]);
      acc[mt][v][3] = fmaf(sz[4 + v], fmaf(sz[12 + v], x1, d[v][3]), acc[mt][v][3]);
    }
  }
}

template <int MT>
__device__ __forceinline__ void mma_chunk_any(const Raw& r, const __half* xc, int xs_stride, const float* xsum_c,
                                              int xsum_stride, const float* __restrict__ scale,
                                              const float* __restrict__ zero, int64_t N, int64_t scol, int g, int t,
                                              int M, float (&acc)[MT][4][4]) {
#define EXL_MMA_CASE(B) \
  case B: mma_chunk<B, MT>(r, xc, xs_stride, xsum_c, xsum_stride, scale, zero, N, scol, g, t, M, acc); break;
  switch (r.bits) {
    EXL_MMA_CASE(4) EXL_MMA_CASE(2) EXL_MMA_CASE(3) EXL_MMA_CASE(5) EXL_MMA_CASE(6) EXL_MMA_CASE(8)
    default: break;                                           // 0: no chunk
  }
#undef EXL_MMA_CASE
}

// Shared memory: [chunk table cpb x 3 ints][x sums kRows x kStageChunks fp32][x stage kRows x xs_stride fp16];
// after the K loop the same bytes hold the partial tiles [kKWarps][kRows][kTileN] fp32.
__host__ __device__ constexpr int xs_stride_of() { return kStageChunks * 32 + kPad; }
__host__ __device__ inline size_t tab_bytes(int cpb) { return (static_cast<size_t>(cpb) * 12 + 15) & ~size_t(15); }

// Several weights that read the same x (q/k/v, gate/up) run in one launch: the grid's x dimension
// walks the column tiles of matrix 0, then matrix 1, ...; every block serves one matrix.
constexpr int kMaxMats = 4;
struct Mat {
  const int32_t* qweight;
  const int32_t* chunks;      // [K/32, 3]
  const float* scale;
  const float* zero;
  const int64_t* perm;        // or null
  const __half* bias;         // or null
  __half* y;                  // [M, N]
  int64_t N;
  int tile0;                  // first blockIdx.x of this matrix
};
struct Mats {
  Mat m[kMaxMats];
  int n;
};

// grid (total column tiles, splits).
template <int MT>
__global__ void __launch_bounds__(kThreads, 2) qgemm_mma_kernel(const __half* __restrict__ x, int M, int64_t K,
                                                                 int n_chunks, int cpb, const Mats mats) {
  int mi = 0;
#pragma unroll
  for (int i = 1; i < kMaxMats; ++i)
    if (i < mats.n && static_cast<int>(blockIdx.x) >= mats.m[i].tile0) mi = i;
  const Mat& mat = mats.m[mi];
  const int32_t* __restrict__ chunks = mat.chunks;
  const int32_t* __restrict__ qweight = mat.qweight;
  const float* __restrict__ scale = mat.scale;
  const float* __restrict__ zero = mat.zero;
  const int64_t* __restrict__ perm = mat.perm;
  const __half* __restrict__ bias = mat.bias;
  __half* __restrict__ y = mat.y;
  const int64_t N = mat.N;
  const int tile = static_cast<int>(blockIdx.x) - mat.tile0;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kRows = MT * 16;
  constexpr int xs_stride = xs_stride_of();
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw);
  float* xsum = reinterpret_cast<float*>(smem_raw + tab_bytes(cpb));                  // [kRows][kStageChunks]
  __half* xs = reinterpret_cast<__half*>(xsum + kRows * kStageChunks);                // [kRows][xs_stride]
  float* red = reinterpret_cast<float*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int nw = warp % kColWarps, kw = warp / kColWarps;
  const int64_t wcol = static_cast<int64_t>(tile) * kTileN + nw * 32;
  const int64_t col = wcol + 4 * g;                           // this lane's B columns (4 words)
  const int64_t scol = wcol + 8 * t;                          // this lane's D columns (8 scales)
  const bool valid = col < N;                                 // N % 4 == 0: all 4 columns or none
  const int c_begin = blockIdx.y * cpb, c_end = min(n_chunks, c_begin + cpb);

  float acc[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int v = 0; v < 4; ++v)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][v][i] = 0.f;

  // The first two chunks' words are requested before x is staged, so their latency overlaps it.
  // Each K warp takes every kKWarps-th chunk; loads then run two chunks ahead of the math.
  int c = c_begin + kw;
  Raw cur0, cur1, nxt0, nxt1;
  load_raw(cur0, c < c_end, chunks + 3 * c, qweight, N, col, valid, t);
  load_raw(cur1, c + kKWarps < c_end, chunks + 3 * (c + kKWarps), qweight, N, col, valid, t);
  for (int i = threadIdx.x; i < (c_end - c_begin) * 3; i += kThreads) tab[i] = __ldg(chunks + 3 * c_begin + i);

  for (int s0 = c_begin; s0 < c_end; s0 += kStageChunks) {
    const int s1 = min(c_end, s0 + kStageChunks), L = (s1 - s0) * 32;
    if (s0 != c_begin) __syncthreads();                       // previous stage fully consumed
    for (int idx = threadIdx.x; idx < M * L; idx += kThreads) {   // real rows only
      const int m = idx / L, pos = idx - m * L;
      const int within = pos & 31;
      const int64_t k = static_cast<int64_t>(s0) * 32 + (pos & ~31) + frag_to_real(within >> 4, within & 15);
      xs[m * xs_stride + pos] = x[m * K + (perm ? __ldg(perm + k) : k)];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < M * (s1 - s0); idx += kThreads) {   // sum of each staged chunk row
      const int m = idx / (s1 - s0), cl = idx - m * (s1 - s0);
      const __half2* p = reinterpret_cast<const __half2*>(xs + m * xs_stride + cl * 32);
      float a = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float2 f = __half22float2(p[i]);
        a += f.x + f.y;
      }
      xsum[m * kStageChunks + cl] = a;
    }
    __syncthreads();
    for (; c < s1; c += 2 * kKWarps) {
      const int c2 = c + 2 * kKWarps, c3 = c + 3 * kKWarps;
      load_raw(nxt0, c2 < c_end, tab + 3 * (c2 - c_begin), qweight, N, col, valid, t);
      load_raw(nxt1, c3 < c_end, tab + 3 * (c3 - c_begin), qweight, N, col, valid, t);
      mma_chunk_any<MT>(cur0, xs + (c - s0) * 32, xs_stride, xsum + (c - s0), kStageChunks, scale, zero, N, scol, g, t,
                        M, acc);
      mma_chunk_any<MT>(cur1, xs + (c + kKWarps - s0) * 32, xs_stride, xsum + (c + kKWarps - s0), kStageChunks, scale,
                        zero, N, scol, g, t, M, acc);
      cur0 = nxt0;
      cur1 = nxt1;
    }
  }
  __syncthreads();                                            // x stage dead: reuse as `red`
  // acc[mt][v]: rows g / g+8 of m-tile mt, columns 8t+v and 8t+4+v of the warp's 32.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      float* r = red + (kw * kRows + mt * 16 + g) * kTileN + nw * 32 + 8 * t + v;
      r[0] = acc[mt][v][0];
      r[4] = acc[mt][v][1];
      r[8 * kTileN] = acc[mt][v][2];
      r[8 * kTileN + 4] = acc[mt][v][3];
    }
  __syncthreads();
  const int E = M * kTileN;                                   // only real rows
  for (int idx = threadIdx.x; idx < E; idx += kThreads) {
    float a = red[idx];
#pragma unroll
    for (int w = 1; w < kKWarps; ++w) a += red[w * kRows * kTileN + idx];
    red[idx] = a;
  }
  const int S = gridDim.y;
  auto store = [&](int idx, float a) {
    const int m = idx / kTileN;
    const int64_t n = static_cast<int64_t>(tile) * kTileN + idx % kTileN;
    if (n < N) {
      if (bias) a += __half2float(bias[n]);
      y[m * N + n] = __float2half_rn(a);
    }
  };
  if (S == 1) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < E; idx += kThreads) store(idx, red[idx]);
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The S blocks of this column tile are one cluster: block `rank` sums slice `rank` of the tile.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();                                             // every block's `red` is final
  const int rank = static_cast<int>(cluster.block_rank());
  for (int idx = rank * kThreads + threadIdx.x; idx < E; idx += S * kThreads) {
    float a = 0.f;
    for (int q = 0; q < S; ++q) a += cluster.map_shared_rank(red, q)[idx];
    store(idx, a);
  }
  cluster.sync();                                             // keep `red` alive until all reads are done
#endif
}

// ----------------------------------------------------------------------------- host side

int device_sm(int dev, bool want_major) {
  static int sms[64] = {0}, major[64] = {0};
  if (dev < 0 || dev >= 64) dev = 0;
  if (!sms[dev]) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev));
  }
  return want_major ? major[dev] : sms[dev];
}

size_t smem_bytes(int mt, int cpb) {
  const size_t xs = tab_bytes(cpb) + static_cast<size_t>(mt) * 16 * kStageChunks * sizeof(float) +
                    static_cast<size_t>(mt) * 16 * xs_stride_of() * sizeof(__half);
  const size_t red = static_cast<size_t>(kKWarps) * mt * 16 * kTileN * sizeof(float);
  return std::max(xs, red);
}

// Co-resident blocks of qgemm_mma_kernel<MT> with clusters of S blocks (cached per device and S).
template <int MT>
int64_t resident_blocks(int S, size_t smem, int dev) {
  static std::map<std::tuple<int, int, size_t>, int64_t> cache;
  static std::mutex mu;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, S, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  static size_t attr = 0;
  if (smem > attr) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(qgemm_mma_kernel<MT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    attr = smem;
  }
  int64_t blocks = 0;
  if (S == 1) {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qgemm_mma_kernel<MT>, kThreads, smem));
    blocks = static_cast<int64_t>(per_sm) * device_sm(dev, false);
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1, static_cast<unsigned>(S), 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr_c[1];
    attr_c[0].id = cudaLaunchAttributeClusterDimension;
    attr_c[0].val.clusterDim.x = 1;
    attr_c[0].val.clusterDim.y = static_cast<unsigned>(S);
    attr_c[0].val.clusterDim.z = 1;
    cfg.attrs = attr_c;
    cfg.numAttrs = 1;
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, qgemm_mma_kernel<MT>, &cfg));
    blocks = static_cast<int64_t>(clusters) * S;
  }
  cache[key] = blocks;
  return blocks;
}

// Largest S <= kMaxSplits (>= 4 chunks per block) whose grid of tiles x S blocks fits in one wave;
// 1 if none does (then the grid has enough blocks by itself).
template <int MT>
int best_splits(int64_t tiles, int C, int dev) {
  const size_t smem = smem_bytes(MT, C);                      // upper bound over S (table bytes)
  for (int S = std::min(kMaxSplits, std::max(1, C / 4)); S > 1; --S)
    if (tiles * S <= resident_blocks<MT>(S, smem, dev)) return S;
  return 1;
}

template <int MT>
void launch(const __half* x, int M, int64_t K, Mats mats, int dev, int splits, cudaStream_t stream) {
  const int C = static_cast<int>(K / 32);
  int64_t tiles = 0;
  for (int i = 0; i < mats.n; ++i) {
    mats.m[i].tile0 = static_cast<int>(tiles);
    tiles += (mats.m[i].N + kTileN - 1) / kTileN;
  }
  // Split K into S blocks (one cluster per column tile) for as large an S as still fits the
  // whole grid in one wave of co-resident clusters: a second, partial wave costs a full block time.
  int S = 1;
  if (device_sm(dev, true) >= 9) {
    S = splits > 0 ? std::min<int>(static_cast<int>(splits), kMaxSplits) : best_splits<MT>(tiles, C, dev);
  }
  const int cpb = (C + S - 1) / S;
  S = (C + cpb - 1) / cpb;
  const size_t smem = smem_bytes(MT, cpb);
  static size_t attr_set[2] = {0, 0};                         // largest dynamic smem granted so far
  if (smem > attr_set[MT - 1]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(qgemm_mma_kernel<MT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    attr_set[MT - 1] = smem;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(S), 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = static_cast<unsigned>(S);
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = S > 1 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, qgemm_mma_kernel<MT>, x, M, K, C, cpb, mats));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i) for up to kMaxMats weights with the same K, one
// launch per 32 rows of x. x fp16 [M, K]; N_i % 4 == 0; 16-byte aligned qweight/scale/zero.
std::vector<at::Tensor> qgemm_mma_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                        at::TensorList scale, at::TensorList zero,
                                        const c10::List<c10::optional<at::Tensor>>& perm,
                                        const c10::List<c10::optional<at::Tensor>>& bias, int64_t splits) {
  const char* op = "exl_core::qgemm_mma";
  const size_t n = qweight.size();
  TORCH_CHECK(n >= 1 && n <= static_cast<size_t>(kMaxMats), op, ": 1..", kMaxMats, " weights per call, got ", n);
  TORCH_CHECK(chunks.size() == n && scale.size() == n && zero.size() == n && perm.size() == n && bias.size() == n,
              op, ": qweight, chunks, scale, zero, perm and bias lists must have the same length");
  TORCH_CHECK(x.is_cuda() && x.dtype() == at::kHalf && x.dim() == 2 && x.is_contiguous(), op,
              ": x must be contiguous float16 [M, K] on the GPU, got ", x.dtype(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, op, ": K = ", K, " must be a multiple of 32");
  Mats mats{};
  mats.n = static_cast<int>(n);
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &q = qweight[i], &ch = chunks[i], &s = scale[i], &z = zero[i];
    TORCH_CHECK(q.is_cuda() && ch.is_cuda() && s.is_cuda() && z.is_cuda() && q.device() == x.device(), op,
                ": weight ", i, " must be on x's GPU");
    const int64_t N = q.size(1);
    TORCH_CHECK(q.dtype() == at::kInt && q.dim() == 2 && q.is_contiguous() && aligned16(q), op, ": qweight ", i,
                " must be contiguous, 16-byte aligned int32 [rows, N]");
    TORCH_CHECK(N % 4 == 0, op, ": weight ", i, " has N = ", N, "; N must be a multiple of 4 (16-byte column loads)");
    TORCH_CHECK(ch.dtype() == at::kInt && ch.dim() == 2 && ch.size(1) == 3 && ch.is_contiguous() &&
                    ch.size(0) * 32 == K, op, ": chunk table ", i, " must be int32 [K/32 = ", K / 32, ", 3], got ",
                ch.sizes());
    for (const at::Tensor* t : {&s, &z})
      TORCH_CHECK(t->dtype() == at::kFloat && t->dim() == 2 && t->size(1) == N && t->is_contiguous() && aligned16(*t),
                  op, ": scale/zero ", i, " must be contiguous, 16-byte aligned float32 [G, ", N, "]");
    const c10::optional<at::Tensor> p = perm.get(i), b = bias.get(i);
    if (p) TORCH_CHECK(p->is_cuda() && p->dtype() == at::kLong && p->numel() == K && p->is_contiguous(), op,
                       ": perm ", i, " must be contiguous int64 [", K, "] on the GPU");
    if (b) TORCH_CHECK(b->is_cuda() && b->dtype() == at::kHalf && b->numel() == N && b->is_contiguous(), op,
                       ": bias ", i, " must be contiguous float16 [", N, "] on the GPU");
    ys.push_back(at::empty({M, N}, x.options()));
    mats.m[i] = Mat{q.data_ptr<int32_t>(), ch.data_ptr<int32_t>(), s.data_ptr<float>(), z.data_ptr<float>(),
                    p ? p->data_ptr<int64_t>() : nullptr,
                    b ? reinterpret_cast<const __half*>(b->data_ptr()) : nullptr,
                    reinterpret_cast<__half*>(ys.back().data_ptr()), N, 0};
  }
  if (M == 0) return ys;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int dev = x.device().index();
  const auto* xp = reinterpret_cast<const __half*>(x.data_ptr());
  for (int64_t r0 = 0; r0 < M; r0 += 32) {
    const int r = static_cast<int>(std::min<int64_t>(32, M - r0));
    Mats mr = mats;
    for (int i = 0; i < mats.n; ++i) mr.m[i].y = mats.m[i].y + r0 * mats.m[i].N;
    if (r <= 16) launch<1>(xp + r0 * K, r, K, mr, dev, static_cast<int>(splits), stream);
    else launch<2>(xp + r0 * K, r, K, mr, dev, static_cast<int>(splits), stream);
  }
  return ys;
}

at::Tensor qgemm_mma(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                     const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                     const c10::optional<at::Tensor>& bias, int64_t splits) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  return qgemm_mma_multi(x, {qweight}, {chunks}, {scale}, {zero}, p, b, splits)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_mma(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias, int splits=0) -> Tensor");
  m.def("qgemm_mma_multi(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, Tensor?[] perm, "
        "Tensor?[] bias, int splits=0) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_mma", &qgemm_mma);
  m.impl("qgemm_mma_multi", &qgemm_mma_multi);
}
