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
//            staged in shared memory already in that order (stage_x_frag, qmma_common.cuh), fp16.
//   split-K: the grid's y dimension splits K; on sm_90 those blocks form one thread-block
//            cluster and reduce their partial tiles through distributed shared memory, so the
//            result is deterministic and written once (with bias) by one launch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qmma_common.cuh"

namespace {
using namespace exl_mma;

constexpr int kColWarps = 4, kKWarps = 2, kThreads = 32 * kColWarps * kKWarps;
constexpr int kTileN = 32 * kColWarps;   // 128 output columns per block
constexpr int kStageChunks = 32;          // x staged 32 chunks (1024 K rows) at a time
constexpr int kPad = 8;                   // halves of row padding: conflict-free A loads

struct Chunk {      // one chunk's words for a lane's 4 columns, with its table entry
  Raw w;
  int bits;         // 0: no chunk (past the end)
  int grp;
};

__device__ __forceinline__ void load_chunk(Chunk& r, bool exists, const int32_t* tab, const QPtr& qw, int64_t col,
                                           bool valid, int t) {
  r.bits = exists ? tab[0] : 0;
  r.grp = exists ? tab[1] : 0;
  load_raw<false>(r.w, exists, tab, qw, col, valid, t);
}

// acc[mt][v] += x_chunk @ W_chunk with W = (q - z) * s applied after the mma:
//   d = x . (1024 + q)   (tensor cores, B straight from the packed bits: no fp16 dequant math)
//   acc += s * (d - (1024 + z) * sum(x))      per output column, sum(x) over the chunk's 32 k.
// d holds ~7 bits of cancellation at most (|q| <= 255 against 1024) within fp32: far below fp16.
// The D fragment's columns are 8t..8t+7 of the warp's 32, so the lane reads those scales/zeros.
template <int BITS, int MT>
__device__ __forceinline__ void mma_chunk_mt(const Chunk& r, const __half* xc, int xs_stride, const float* xsum_c,
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
    const uint32_t wl = comp(r.w.lo, v), wh = comp(r.w.hi, v);
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
__device__ __forceinline__ void mma_chunk_any(const Chunk& r, const __half* xc, int xs_stride, const float* xsum_c,
                                              int xsum_stride, const float* __restrict__ scale,
                                              const float* __restrict__ zero, int64_t N, int64_t scol, int g, int t,
                                              int M, float (&acc)[MT][4][4]) {
#define EXL_MMA_CASE(B) \
  case B: mma_chunk_mt<B, MT>(r, xc, xs_stride, xsum_c, xsum_stride, scale, zero, N, scol, g, t, M, acc); break;
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

// grid (total column tiles, splits).
template <int MT>
__global__ void __launch_bounds__(kThreads, 2) qgemm_mma_kernel(const __half* __restrict__ x, int M, int64_t K,
                                                                 int n_chunks, int cpb, const Mats mats) {
  const Mat& mat = block_mat(mats);
  const int32_t* __restrict__ chunks = mat.chunks;
  const QPtr qw = mat.qw;
  const float* __restrict__ scale = mat.scale;
  const float* __restrict__ zero = mat.zero;
  const int64_t* __restrict__ perm = mat.perm;
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
  Chunk cur0, cur1, nxt0, nxt1;
  load_chunk(cur0, c < c_end, chunks + 3 * c, qw, col, valid, t);
  load_chunk(cur1, c + kKWarps < c_end, chunks + 3 * (c + kKWarps), qw, col, valid, t);
  for (int i = threadIdx.x; i < (c_end - c_begin) * 3; i += kThreads) tab[i] = __ldg(chunks + 3 * c_begin + i);
  exl_pdl::pdl_wait();                                        // x comes from the previous kernel (PDL)
  exl_pdl::pdl_trigger();

  for (int s0 = c_begin; s0 < c_end; s0 += kStageChunks) {
    const int s1 = min(c_end, s0 + kStageChunks), L = (s1 - s0) * 32;
    if (s0 != c_begin) __syncthreads();                       // previous stage fully consumed
    stage_x_frag(xs, xs_stride, x, M, M, K, static_cast<int64_t>(s0) * 32, L, perm);   // real rows only
    __syncthreads();
    for (int idx = threadIdx.x; idx < M * (s1 - s0); idx += kThreads) {   // sum of each staged chunk row
      const int m = idx / (s1 - s0), cl = idx - m * (s1 - s0);
      xsum[m * kStageChunks + cl] = chunk_x_sum(xs + m * xs_stride + cl * 32);
    }
    __syncthreads();
    for (; c < s1; c += 2 * kKWarps) {
      const int c2 = c + 2 * kKWarps, c3 = c + 3 * kKWarps;
      load_chunk(nxt0, c2 < c_end, tab + 3 * (c2 - c_begin), qw, col, valid, t);
      load_chunk(nxt1, c3 < c_end, tab + 3 * (c3 - c_begin), qw, col, valid, t);
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
  cluster_store(red, E, kTileN, kThreads, tile, mat);
}

// ----------------------------------------------------------------------------- host side

size_t smem_bytes(int mt, int cpb) {
  const size_t xs = tab_bytes(cpb) + static_cast<size_t>(mt) * 16 * kStageChunks * sizeof(float) +
                    static_cast<size_t>(mt) * 16 * xs_stride_of() * sizeof(__half);
  const size_t red = static_cast<size_t>(kKWarps) * mt * 16 * kTileN * sizeof(float);
  return std::max(xs, red);
}

// Largest S <= kMaxSplits (>= 4 chunks per block) whose grid of tiles x S blocks fits in one wave;
// 1 if none does (then the grid has enough blocks by itself).
template <int MT>
int best_splits(int64_t tiles, int C, int dev) {
  const size_t smem = smem_bytes(MT, C);                      // upper bound over S (table bytes)
  for (int S = std::min(kMaxSplits, std::max(1, C / 4)); S > 1; --S)
    if (tiles * S <= resident_blocks(qgemm_mma_kernel<MT>, kThreads, S, smem, dev)) return S;
  return 1;
}

template <int MT>
void launch(const __half* x, int M, int64_t K, Mats mats, int dev, int splits, cudaStream_t stream) {
  const int C = static_cast<int>(K / 32);
  const int64_t tiles = assign_tiles(mats, kTileN);
  // Split K into S blocks (one cluster per column tile) for as large an S as still fits the
  // whole grid in one wave of co-resident clusters: a second, partial wave costs a full block time.
  int S = 1;
  if (device_sm(dev, true) >= 9) {
    S = splits > 0 ? std::min<int>(static_cast<int>(splits), kMaxSplits) : best_splits<MT>(tiles, C, dev);
  }
  const int cpb = (C + S - 1) / S;
  S = (C + cpb - 1) / cpb;
  const size_t smem = smem_bytes(MT, cpb);
  ensure_smem(qgemm_mma_kernel<MT>, smem, dev);
  launch_split(qgemm_mma_kernel<MT>, tiles, S, kThreads, smem, stream, dev, x, M, K, C, cpb, mats);
}

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i) for up to kMaxMats weights with the same K, one
// launch per 32 rows of x. x fp16 [M, K]; N_i % 4 == 0; 16-byte aligned qweight/scale/zero.
std::vector<at::Tensor> qgemm_mma_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                        at::TensorList scale, at::TensorList zero,
                                        const c10::List<c10::optional<at::Tensor>>& perm,
                                        const c10::List<c10::optional<at::Tensor>>& bias, int64_t splits) {
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  const Mats mats = build_mats("exl_core::qgemm_mma", x, qweight, chunks, scale, zero, perm, bias, ys);
  const int64_t M = x.size(0), K = x.size(1);
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
