// exl_core::qgemm_kslice: the batch-1 decode kernel (1..8 rows of fp16 x) over the PackedWeight chunk
// table, built so that a launch is one memory latency of prologue, an unbroken stream of weight loads
// per warp, and one block barrier per 32 output columns.
//
// Why not qgemm_skinny: its blocks split K across a thread-block cluster, stage x for all column warps
// behind two block barriers and reduce through two cluster barriers; under ncu its warps spend most
// cycles at those barriers (0.30 issued warps per scheduler, DRAM 15 %), so a 4096x4096 4-bit matrix
// costs ~8.8 us against ~4.1 us for a plain read of its bytes (bench/read_bw.cu, same pattern).  Here:
//   tile       32 output columns (one warp's width) x KW warps; warp w owns chunks [c0, c1) of K, so
//              each warp streams its own weights and needs only its own slice of x; the KW partial
//              sums are added behind one __syncthreads per tile (fixed order: deterministic).
//   persistent a launch has at most one wave of blocks; each block serves one matrix (blocks are
//              shared out among the matrices of a multi-weight launch by their tile counts) and a
//              contiguous range of its tiles.  The per-warp ring of R chunks of words in registers runs
//              on across tile boundaries, so the next tile's loads are in flight while this tile's
//              partial sums are reduced, and x and the chunk table are staged once per block.  (One
//              block per tile, the first version, paid prologue and epilogue per tile: gate/up ran at
//              half the plain-read rate.)
//   prologue   the ring's first loads go out before anything else (uniform 4-bit needs no table),
//              all before the PDL wait (weights are fixed at load time); after it x's slice is staged
//              (16-byte loads, or a gather under act-order) and one __syncwarp makes it visible.
//   scales     a chunk that starts a group prefetches the group's scale/zero (the lane's 4 columns)
//              into L1 when its words are requested; they are read when the group starts, R chunks
//              later.  Weights are loaded with L1::no_allocate so the stream does not evict them.
//   mma        as in qgemm_skinny: weights are the A operand of m16n8k16 (a lane's 16-byte load = 4
//              columns x 8 k, fp16 1024 + q by one LOP3 per pair), x is B; lane t's B pairs are its own
//              8 values of x (one 16-byte shared load, 4 PRMT), and a second mma with A = 1 sums x over
//              the chunk in fp32 for the zero term: acc += s * (x.(1024 + q) - (1024 + z) * sum(x)).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qmma_common.cuh"

namespace {
using namespace exl_mma;

constexpr int kTile = 32;        // output columns per block
constexpr int kMaxRows = 8;      // one mma n-tile
constexpr int kXPad = 32;        // halves of padding per staged x row: rows g, g+1 on other banks

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ int4 ld_stream(const int32_t* p) {   // read once: keep it out of L1
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Shared memory of one block: [chunk table n_chunks x 3 int32][x rows x xs_stride fp16]
// [partial sums 2 x KW x M x kTile fp32 (double-buffered: one barrier per tile)].
struct Smem {
  size_t tab, xs, red, total;
  __host__ __device__ Smem(int n_chunks, int kw, int M, int xs_stride) {
    tab = 0;
    xs = (static_cast<size_t>(n_chunks) * 12 + 15) & ~size_t(15);
    red = xs + ((static_cast<size_t>(M) * xs_stride * 2 + 15) & ~size_t(15));
    total = red + 2 * static_cast<size_t>(kw) * M * kTile * 4;
  }
};

// Lane t's B fragments from its 8 values x[8t..8t+7] of a chunk: pair p = (x_p, x_p+4), the order
// pair_bits gives the weights.
__device__ __forceinline__ void b_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = __byte_perm(v.x, v.z, 0x5410);
  b[1] = __byte_perm(v.x, v.z, 0x7632);
  b[2] = __byte_perm(v.y, v.w, 0x5410);
  b[3] = __byte_perm(v.y, v.w, 0x7632);
}

// d[u] += A(tile u of the chunk's words) x B, both k16 steps of the chunk.
template <int BITS>
__device__ __forceinline__ void chunk_mma_b(const Raw& r, const uint32_t (&b)[4], int t, float (&d)[2][1][4]) {
  const int sh = (8 * t * BITS) & 31;
  uint32_t a[4][4];                                           // [column 4g+v][pair p]
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint32_t wl = comp(r.lo, v), wh = comp(r.hi, v);
#pragma unroll
    for (int p = 0; p < 4; ++p) a[v][p] = pair_bits<BITS>(wl, wh, sh, p);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u)
      mma16816(d[u][0], a[2 * u][2 * j], a[2 * u + 1][2 * j], a[2 * u][2 * j + 1], a[2 * u + 1][2 * j + 1],
               b[2 * j], b[2 * j + 1]);
}

__device__ __forceinline__ void chunk_mma_b_any(int bits, const Raw& r, const uint32_t (&b)[4], int t,
                                                float (&d)[2][1][4]) {
  switch (bits) {
    case 4: chunk_mma_b<4>(r, b, t, d); break;
    case 2: chunk_mma_b<2>(r, b, t, d); break;
    case 3: chunk_mma_b<3>(r, b, t, d); break;
    case 5: chunk_mma_b<5>(r, b, t, d); break;
    case 6: chunk_mma_b<6>(r, b, t, d); break;
    default: chunk_mma_b<8>(r, b, t, d); break;
  }
}

// Blocks of matrix i are mats.m[i].tile0 .. (+ nblk_i): Mat.tile0 holds the first block here (see
// assign_blocks); block j of matrix i serves its tiles [T_i j / nblk_i, T_i (j + 1) / nblk_i).
template <int KW, bool U4, int R>
__global__ void __launch_bounds__(32 * KW)
    qgemm_kslice_kernel(const __half* __restrict__ x, int M, int64_t K, int n_chunks, int xs_stride, const Mats mats,
                        const int4 nblk) {
  const Mat& mat = block_mat(mats);
  int mi = 0;
#pragma unroll
  for (int i = 1; i < kMaxMats; ++i)
    if (i < mats.n && static_cast<int>(blockIdx.x) >= mats.m[i].tile0) mi = i;
  const int nb = mi == 0 ? nblk.x : mi == 1 ? nblk.y : mi == 2 ? nblk.z : nblk.w;
  const int64_t N = mat.N, T = (N + kTile - 1) / kTile;
  const int j = static_cast<int>(blockIdx.x) - mat.tile0;
  const int64_t ta = T * j / nb, tb = T * (j + 1) / nb;      // this block's tiles
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t ldq = mat.qw.ldq;
  const int c0 = static_cast<int>(static_cast<int64_t>(n_chunks) * warp / KW);
  const int c1 = static_cast<int>(static_cast<int64_t>(n_chunks) * (warp + 1) / KW);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem lay(n_chunks, KW, M, xs_stride);
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw + lay.tab);
  __half* xs = reinterpret_cast<__half*>(smem_raw + lay.xs);
  float* red = reinterpret_cast<float*>(smem_raw + lay.red);

  // The lane's first column in tile tl (lanes past N read the last 4 columns, never stored; N % 4 == 0).
  auto lcol_of = [&](int64_t tl) {
    const int64_t col = tl * kTile + 4 * g;
    return col < N ? col : N - 4;
  };
  // Work item = (tile, chunk): the consume cursor (ct, cc) and the issue cursor (it, ic) walk the
  // warp's chunks of each tile in turn.
  int64_t it = ta;
  int ic = c0;
  const int32_t* ibase = mat.qw.at(0, lcol_of(it));
  auto advance_issue = [&]() {
    if (++ic == c1) {
      ic = c0;
      ++it;
      ibase = mat.qw.at(0, lcol_of(it < tb ? it : ta));
    }
  };
  // Loads the words of the issue cursor's item into r, and prefetches its group's scale/zero into L1
  // when the chunk starts a group (the table must be staged unless U4).
  auto issue = [&](Raw& r, bool prefetch) {
    if constexpr (U4) {
      r.lo = ld_stream(ibase + static_cast<int64_t>(4 * ic + t) * ldq);
    } else {
      const int32_t* e = tab + 3 * ic;
      const int bits = e[0], start = 8 * t * bits;
      const int32_t* p = ibase + static_cast<int64_t>(e[2] + (start >> 5)) * ldq;
      r.lo = ld_stream(p);
      r.hi = (start & 31) + 8 * bits > 32 ? ld_stream(p + ldq) : make_int4(0, 0, 0, 0);
    }
    if (prefetch) {
      const int32_t* e = tab + 3 * ic;
      if (ic == c0 || e[1] != e[-2]) {
        const int64_t off = static_cast<int64_t>(e[1]) * N + lcol_of(it);
        prefetch_l1(mat.scale + off);
        prefetch_l1(mat.zero + off);
      }
    }
  };

  const int cw = c1 - c0;
  const int64_t items = cw > 0 ? (tb - ta) * cw : 0;
  Raw ring[R];
#pragma unroll
  for (int i = 0; i < R; ++i) ring[i].lo = ring[i].hi = make_int4(0, 0, 0, 0);
  if constexpr (U4) {                                         // first weight loads need no table
    for (int i = 0; i < R; ++i) {
      if (i < items) {
        issue(ring[i], false);
        advance_issue();
      }
    }
  }
  for (int i = lane; i < cw * 3; i += 32) tab[3 * c0 + i] = __ldg(mat.chunks + 3 * c0 + i);
  __syncwarp();
  if constexpr (!U4) {
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (i < items) {
        issue(ring[i], true);
        advance_issue();
      }
  } else {                                                    // the scales of the items already issued
    int64_t pt = ta;
    int pc = c0;
    for (int i = 0; i < R && i < items; ++i) {
      const int32_t* e = tab + 3 * pc;
      if (pc == c0 || e[1] != e[-2]) {
        const int64_t off = static_cast<int64_t>(e[1]) * N + lcol_of(pt);
        prefetch_l1(mat.scale + off);
        prefetch_l1(mat.zero + off);
      }
      if (++pc == c1) { pc = c0; ++pt; }
    }
  }

  exl_pdl::pdl_wait();                                        // x is the previous kernel's output
  exl_pdl::pdl_trigger();
  const int kw0 = c0 * 32, kwl = cw * 32;
  const int64_t* perm = mat.perm;
  if (perm == nullptr && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    for (int jj = lane; jj < M * (kwl >> 3); jj += 32) {
      const int m = jj / (kwl >> 3), k = kw0 + 8 * (jj - m * (kwl >> 3));
      cp_async16(xs + m * xs_stride + k, x + m * K + k);
    }
  } else {
    const unsigned short* __restrict__ xu = reinterpret_cast<const unsigned short*>(x);
    unsigned short* xsu = reinterpret_cast<unsigned short*>(xs);
    for (int k0 = kw0 + lane; k0 < kw0 + kwl; k0 += 8 * 32) {  // 8 gathers in flight per lane and row
      int src[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int k = k0 + 32 * i;
        src[i] = k < kw0 + kwl ? static_cast<int>(perm ? __ldg(perm + k) : k) : -1;
      }
      for (int m = 0; m < M; ++m) {
        unsigned short h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = src[i] >= 0 ? __ldg(xu + m * K + src[i]) : 0;
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (src[i] >= 0) xsu[m * xs_stride + k0 + 32 * i] = h[i];
      }
    }
  }
  cp_async_wait_all();
  __syncwarp();

  float d[2][1][4], acc[2][1][4], dx[4] = {0.f, 0.f, 0.f, 0.f}, xg[1][2] = {{0.f, 0.f}};
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) d[u][0][i] = acc[u][0][i] = 0.f;
  float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f), z4 = s4;
  int grp = -1, parity = 0;
  const __half* xrow = xs + (g < M ? g : 0) * xs_stride + 8 * t;   // B column g = x row g
  constexpr uint32_t kOnes = 0x3C003C00u;                     // fp16 (1, 1)

  auto flush = [&]() {
    xg[0][0] = dx[0];
    xg[0][1] = dx[1];
    flush_group<1>(s4, z4, xg, d, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) dx[i] = 0.f;
  };
  // Tile tl done by every warp: add the KW partial sums (double-buffered, one barrier), store y.
  auto finish_tile = [&](int64_t tl) {
    float* rp = red + parity * KW * M * kTile;
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {                           // acc[u][0][i]: column 4g+2u+(i>>1), row 2t+(i&1)
        const int row = 2 * t + (i & 1);
        if (row < M) rp[(warp * M + row) * kTile + 4 * g + 2 * u + (i >> 1)] = acc[u][0][i];
        acc[u][0][i] = 0.f;
      }
    __syncthreads();
    for (int idx = threadIdx.x; idx < M * kTile; idx += 32 * KW) {
      const int m = idx / kTile, cl = idx - m * kTile;
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < KW; ++w) a += rp[(w * M + m) * kTile + cl];
      const int64_t n = tl * kTile + cl;
      if (n < N) {
        if (mat.bias) a += __half2float(mat.bias[n]);
        mat.y[m * N + n] = __float2half_rn(a);
      }
    }
    parity ^= 1;
  };

  if (cw == 0) {                                              // no chunks (K < KW chunks): zeros, barriers
    for (int64_t tl = ta; tl < tb; ++tl) finish_tile(tl);
    return;
  }
  int64_t ct = ta;
  int cc = c0;
  auto step = [&](const Raw& r) {
    const int32_t* e = tab + 3 * cc;
    const int ge = e[1];
    if (ge != grp) {                                          // warp-uniform
      if (grp >= 0) flush();
      grp = ge;
      const int64_t off = static_cast<int64_t>(ge) * N + lcol_of(ct);
      s4 = __ldg(reinterpret_cast<const float4*>(mat.scale + off));
      z4 = __ldg(reinterpret_cast<const float4*>(mat.zero + off));
    }
    uint32_t b[4];
    b_pairs(*reinterpret_cast<const uint4*>(xrow + cc * 32), b);
    mma16816(dx, kOnes, kOnes, kOnes, kOnes, b[0], b[1]);
    mma16816(dx, kOnes, kOnes, kOnes, kOnes, b[2], b[3]);
    if constexpr (U4) chunk_mma_b<4>(r, b, t, d);
    else chunk_mma_b_any(e[0], r, b, t, d);
    if (++cc == c1) {                                         // the tile's last chunk for this warp
      flush();
      grp = -1;
      finish_tile(ct);
      cc = c0;
      ++ct;
    }
  };

  int64_t f = 0;
  for (; f + R <= items; f += R) {                            // full ring turns: refill each slot after use
#pragma unroll
    for (int i = 0; i < R; ++i) {
      step(ring[i]);
      if (f + i + R < items) {
        issue(ring[i], true);
        advance_issue();
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i)                                 // the last partial turn
    if (f + i < items) step(ring[i]);
}

// ----------------------------------------------------------------------------- host side

constexpr size_t kSmemMax = 160 * 1024;   // beyond this the launch is refused (qgemm_skinny takes it)

struct Plan {
  int kw, ring, xs_stride;
  size_t smem;
};

// Warps per block: few column tiles (one 4096-wide matrix: 128 tiles on 132 SMs) take 16 warps along K
// so every SM streams with many loads in flight; more tiles take 8 (two or more blocks per SM, each
// walking a few tiles).  Ring depth 8 chunks for uniform 4-bit (16 measured no better), 4 for mixed
// widths (two words per chunk: 8 costs 156 registers and measured slower).
Plan plan_for(int M, int64_t K, int64_t tiles, int kw, int ring, bool u4, int dev) {
  if (kw <= 0) kw = tiles <= device_sm(dev, false) ? 16 : 8;
  if (ring <= 0) ring = u4 ? 8 : 4;
  const int xs_stride = static_cast<int>(K) + (M > 1 ? kXPad : 0);
  return {kw, ring, xs_stride, Smem(static_cast<int>(K / 32), kw, M, xs_stride).total};
}

// Shares `blocks` out among the matrices by their tile counts (at least one each, never more than its
// tiles); Mat.tile0 becomes the matrix's first block.  Returns the blocks per matrix.
int4 assign_blocks(Mats& mats, int64_t blocks) {
  int64_t T[kMaxMats] = {0, 0, 0, 0}, total = 0;
  for (int i = 0; i < mats.n; ++i) total += T[i] = (mats.m[i].N + kTile - 1) / kTile;
  blocks = std::max<int64_t>(mats.n, std::min(blocks, total));
  int nb[kMaxMats] = {0, 0, 0, 0};
  int64_t used = 0;
  for (int i = 0; i < mats.n; ++i) {
    nb[i] = static_cast<int>(std::max<int64_t>(1, std::min(T[i], blocks * T[i] / total)));
    used += nb[i];
  }
  for (int i = 0; used < blocks; i = (i + 1) % mats.n)      // hand out the rounding remainder
    if (nb[i] < T[i]) { ++nb[i]; ++used; }
  int first = 0;
  for (int i = 0; i < mats.n; ++i) {
    mats.m[i].tile0 = first;
    first += nb[i];
  }
  return make_int4(nb[0], nb[1], nb[2], nb[3]);
}

template <int KW, bool U4, int R>
void launch_one(const __half* x, int M, int64_t K, int64_t tiles, const Plan& p, Mats& mats, int dev,
                cudaStream_t stream) {
  auto* kern = qgemm_kslice_kernel<KW, U4, R>;
  const int64_t resident = resident_blocks(kern, 32 * KW, 1, p.smem, dev);   // also raises the smem limit
  const int4 nb = assign_blocks(mats, std::min(tiles, resident));
  const int blocks = mats.m[mats.n - 1].tile0 + (mats.n == 1 ? nb.x : mats.n == 2 ? nb.y : mats.n == 3 ? nb.z : nb.w);
  exl_pdl::launch_pdl(kern, dim3(static_cast<unsigned>(blocks)), dim3(32 * KW), p.smem, stream, dev, x, M, K,
                      static_cast<int>(K / 32), p.xs_stride, mats, nb);
}

template <bool U4, int R>
bool launch_kw(const __half* x, int M, int64_t K, int64_t tiles, const Plan& p, Mats& mats, int dev,
               cudaStream_t stream) {
  switch (p.kw) {
    case 8: launch_one<8, U4, R>(x, M, K, tiles, p, mats, dev, stream); return true;
    case 16: launch_one<16, U4, R>(x, M, K, tiles, p, mats, dev, stream); return true;
    default: return false;
  }
}

bool valid_ring(int ring, bool u4) { return ring == 0 || ring == 4 || ring == 8 || (u4 && ring == 16); }

// Launches for 1..8 rows where shared memory allows; false (nothing launched) otherwise.
bool launch_kslice(const __half* x, int M, int64_t K, Mats& mats, bool u4, int kw, int ring, int dev,
                   cudaStream_t stream) {
  if (M < 1 || M > kMaxRows || !valid_ring(ring, u4)) return false;
  int64_t tiles = 0;
  for (int i = 0; i < mats.n; ++i) tiles += (mats.m[i].N + kTile - 1) / kTile;
  const Plan p = plan_for(M, K, tiles, kw, ring, u4, dev);
  if (p.smem > kSmemMax) return false;
  switch (p.ring * 2 + (u4 ? 1 : 0)) {
    case 9: return launch_kw<true, 4>(x, M, K, tiles, p, mats, dev, stream);
    case 17: return launch_kw<true, 8>(x, M, K, tiles, p, mats, dev, stream);
    case 33: return launch_kw<true, 16>(x, M, K, tiles, p, mats, dev, stream);
    case 8: return launch_kw<false, 4>(x, M, K, tiles, p, mats, dev, stream);
    case 16: return launch_kw<false, 8>(x, M, K, tiles, p, mats, dev, stream);
    default: return false;
  }
}

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i), x fp16 [M <= 8, K], up to kMaxMats weights on one
// x in one launch.  kw (warps along K: 8, 16) and ring (chunks in flight per warp: 4, 8, and 16 for
// uniform 4-bit) 0 = chosen here.  Raises where the shape does not fit (ask qgemm_kslice_fits first).
std::vector<at::Tensor> qgemm_kslice_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                           at::TensorList scale, at::TensorList zero,
                                           const c10::List<c10::optional<at::Tensor>>& perm,
                                           const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4,
                                           int64_t kw, int64_t ring) {
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  Mats mats = build_mats("exl_core::qgemm_kslice", x, qweight, chunks, scale, zero, perm, bias, ys);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= kMaxRows, "exl_core::qgemm_kslice: at most ", kMaxRows, " rows of x, got ", M);
  if (M == 0) return ys;
  const int dev = x.device().index();
  TORCH_CHECK(launch_kslice(reinterpret_cast<const __half*>(x.data_ptr()), static_cast<int>(M), K, mats, uniform4,
                            static_cast<int>(kw), static_cast<int>(ring), dev, c10::cuda::getCurrentCUDAStream()),
              "exl_core::qgemm_kslice: no kernel for M = ", M, ", K = ", K, ", kw = ", kw, ", ring = ", ring,
              " (shared memory or an unknown kw/ring)");
  return ys;
}

at::Tensor qgemm_kslice(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks,
                        const at::Tensor& scale, const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                        const c10::optional<at::Tensor>& bias, bool uniform4, int64_t kw, int64_t ring) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  return qgemm_kslice_multi(x, {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, kw, ring)[0];
}

// Whether qgemm_kslice takes M rows of K over `tiles` column tiles with this kw and ring (0: its policy's);
// a call it refuses raises, which on some images kills the process (see NOTES.md), so callers ask first.
bool qgemm_kslice_fits(int64_t rows, int64_t K, int64_t tiles, bool uniform4, int64_t device, int64_t kw,
                       int64_t ring) {
  if (rows < 1 || rows > kMaxRows || K % 32 != 0 || (kw != 0 && kw != 8 && kw != 16) ||
      !valid_ring(static_cast<int>(ring), uniform4))
    return false;
  return plan_for(static_cast<int>(rows), K, tiles, static_cast<int>(kw), static_cast<int>(ring), uniform4,
                  static_cast<int>(device)).smem <= kSmemMax;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_kslice(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias, bool uniform4=False, int kw=0, int ring=0) -> Tensor");
  m.def("qgemm_kslice_multi(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor?[] perm, Tensor?[] bias, bool uniform4=False, int kw=0, int ring=0) -> Tensor[]");
  m.def("qgemm_kslice_fits(int rows, int K, int tiles, bool uniform4, int device, int kw=0, int ring=0) -> bool",
        &qgemm_kslice_fits);
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_kslice", &qgemm_kslice);
  m.impl("qgemm_kslice_multi", &qgemm_kslice_multi);
}
