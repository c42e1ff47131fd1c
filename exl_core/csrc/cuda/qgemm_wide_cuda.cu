// exl_core::qgemm_wide: the decode GEMM for 9..32 rows of fp16 x (batch 8-32 decode steps) over the
// PackedWeight chunk table.
//
// Why not qgemm_kslice at these rows: its block is 32 output columns x KW warps along K, so every block reads
// all of x from L2 (4 16-byte loads per lane per chunk at 32 rows, 4x the weight bytes), and it keeps the
// scale for later (fp32 d/acc split plus 8 mma per chunk summing x for the zero term): 213-222 registers,
// ~2 warps per scheduler, ~0.7 TB/s at 32 rows.  Here (designed and tuned in bench/wide_probe.cu):
//   block      4 warps side by side = 128 output columns of one K range, so x leaves L2 once per 128
//              columns; its rows for the range go to shared memory by cp.async in kStages stages of kRing
//              chunks, every warp reads them (one 16-byte shared load per row group of 8 and chunk).
//   A          the weights, scaled before the mma: pairs of (1024 + q) by one LOP3 (a_frags), q exact by one
//              HSUB2, then q*s - z*s by one HFMA2 (fp16 weights as a dense fp16 GEMM would hold them): 16 mma
//              per chunk at 32 rows and one accumulator set.  s and z of the block's groups are staged in
//              shared memory by cp.async before the PDL wait.
//   weights    a ring of kRing chunks of words in registers per lane, refilled as each chunk is used.
//   split-K    grid y, a cluster (1, S, 1) per column tile reduced through distributed shared memory
//              (cluster_store: deterministic, bias fused).
// Act-order weights read x permuted by one gather launch (permute_x_per_weight).
// Measured (H200, 32 rows, us, 16 distinct weights per CUDA graph; bench/cuda_probe.py kslice, one call,
// bench/results/cuda_kslice_h200.json) against qgemm_kslice: GPTQ 4-bit g128 4096x4096 14.4 (13.0), q/k/v 27.6
// (38.9), gate/up 47.2 (66.1), 11008x4096 32.2 (30.5); EXL2 ~4.0 bpw act-order 18.7 (18.7), 52.3 (53.7), 56.4
// (87.3), 42.0 (44.7).  The standalone probe (no chunk table, no PDL) ran GPTQ at 13.0 / 26.5 / 39.9 / 27.3.
// Resource report (sm_90): uniform 4-bit 112 (4 n-tiles) / 111 (2) registers, mixed widths 168 / 142; no spills.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qmma_common.cuh"

namespace {
using namespace exl_mma;

constexpr int kWarps = 4, kThreads = 32 * kWarps, kTile = 32 * kWarps;   // 128 output columns per block
constexpr int kRing = 4;          // chunks of words in flight per lane = chunks per x stage
constexpr int kStages = 3;        // x stages in shared memory
constexpr int kXPad = 32;         // halves of padding per staged row: the two rows of one LDS.128 phase on other banks
constexpr int kStageW = kRing * 32 + kXPad;
constexpr int kMaxRows = 32;
constexpr size_t kSmemMax = 100 * 1024;   // two blocks per SM

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 u2h(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Shared memory of one block: [x stages kStages x rows x kStageW fp16 | after the K loop: partial tile M x kTile
// fp32][chunk table slice cps x 3 int32][scale/zero of the block's groups: groups x (scale kTile | zero kTile) fp32]
struct Smem {
  size_t tab, sz, total;
  __host__ __device__ Smem(int rows, int M, int cps, int groups) {
    const size_t xs = static_cast<size_t>(kStages) * rows * kStageW * 2, red = static_cast<size_t>(M) * kTile * 4;
    tab = xs > red ? xs : red;
    sz = tab + ((static_cast<size_t>(cps) * 12 + 15) & ~size_t(15));
    total = sz + static_cast<size_t>(groups) * 2 * kTile * 4;
  }
};

// Lane t's B fragments from its 8 values x[8t..8t+7] of a chunk: pair p = (x_p, x_p+4), the order a_frags
// gives the weights.
__device__ __forceinline__ void b_pairs(const uint4& v, uint32_t (&b)[4]) {
  b[0] = __byte_perm(v.x, v.z, 0x5410);
  b[1] = __byte_perm(v.x, v.z, 0x7632);
  b[2] = __byte_perm(v.y, v.w, 0x5410);
  b[3] = __byte_perm(v.y, v.w, 0x7632);
}

// The lane's scaled A fragments of one chunk: a[v][p] = (q - z) * s of pair p of column 4g+v, in fp16.
template <int BITS>
__device__ __forceinline__ void scaled_a(const Raw& r, int t, const __half2 (&sh)[4], const __half2 (&zs)[4],
                                         uint32_t (&a)[4][4]) {
  a_frags<BITS>(r, t, a);
  const __half2 k1024 = __float2half2_rn(1024.f);
#pragma unroll
  for (int v = 0; v < 4; ++v)
#pragma unroll
    for (int p = 0; p < 4; ++p) a[v][p] = h2u(__hfma2(__hsub2(u2h(a[v][p]), k1024), sh[v], zs[v]));
}

template <int NT>
__device__ __forceinline__ void chunk_mma(const uint32_t (&a)[4][4], const uint32_t (&b)[NT][4], float (&acc)[2][NT][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        mma16816(acc[u][nt], a[2 * u][2 * j], a[2 * u + 1][2 * j], a[2 * u][2 * j + 1], a[2 * u + 1][2 * j + 1],
                 b[nt][2 * j], b[nt][2 * j + 1]);
}

// grid (total column tiles, S); block kThreads; cluster (1, S, 1) when S > 1.  The block's K range is chunks
// [blockIdx.y * cps, + cps).  U4: every chunk 4-bit with its words in chunk order (no table read for the
// words).  x (or the weight's permuted copy mat.x) 16-byte aligned, K % 32 == 0.
template <int NT, bool U4>
__global__ void __launch_bounds__(kThreads, U4 ? 4 : 3)   // 128 / 168 registers: mixed widths hold 2 words a chunk
    qgemm_wide_kernel(const __half* __restrict__ x, int M, int64_t K, int n_chunks, int cps, int max_groups,
                      const Mats mats) {
  constexpr int kRows = 8 * NT, kPieces = kRows * kRing * 4;   // 16-byte pieces of x per stage
  const Mat& mat = block_mat(mats);
  const int64_t N = mat.N;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) - mat.tile0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int c_begin = static_cast<int>(blockIdx.y) * cps;
  const int c_end = min(n_chunks, c_begin + cps), nc = max(0, c_end - c_begin);
  const int64_t col = tile * kTile + warp * 32 + 4 * g;      // this lane's 4 columns
  // N % 4 == 0: a lane has all 4 columns or none; lanes past N read the last 4 columns, never stored.
  const int64_t lcol = col < N ? col : N - 4;
  const int32_t* base = mat.qw.at(0, lcol);
  const int64_t ldq = mat.qw.ldq;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem lay(kRows, M, cps, max_groups);
  __half* xs = reinterpret_cast<__half*>(smem_raw);                     // [kStages][kRows][kStageW]
  float* red = reinterpret_cast<float*>(smem_raw);                      // [M][kTile], after the K loop
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw + lay.tab);        // chunks [c_begin, c_end)
  float* szs = reinterpret_cast<float*>(smem_raw + lay.sz);             // [group - g_first][2][kTile]

  Raw ring[kRing];
  const int32_t* wnext = base + static_cast<int64_t>(4 * c_begin + t) * ldq;   // U4: chunk c's word, row 4c + t
  if constexpr (U4) {                                                   // the first loads need no table
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      ring[i].lo = i < nc ? __ldg(reinterpret_cast<const int4*>(wnext + static_cast<int64_t>(4 * i) * ldq))
                          : make_int4(0, 0, 0, 0);
      ring[i].hi = make_int4(0, 0, 0, 0);
    }
    wnext += static_cast<int64_t>(4 * kRing) * ldq;
  }
  for (int i = threadIdx.x; i < nc * 3; i += kThreads) tab[i] = __ldg(mat.chunks + 3 * c_begin + i);
  __syncthreads();
  if constexpr (!U4) {
#pragma unroll
    for (int i = 0; i < kRing; ++i) {
      ring[i].lo = ring[i].hi = make_int4(0, 0, 0, 0);
      if (i < nc) load_words<false>(ring[i], tab + 3 * i, c_begin + i, base, ldq, t);
    }
  }
  // scale/zero rows of the block's groups (consecutive along the chunks; at most max_groups, the host's bound)
  const int g_first = nc > 0 ? tab[1] : 0;
  const int ngr = nc > 0 ? min(max_groups, tab[3 * (nc - 1) + 1] - g_first + 1) : 0;
  for (int i = threadIdx.x; i < ngr * (kTile / 2); i += kThreads) {
    const int gr = i / (kTile / 2), r = i % (kTile / 2), half = r / (kTile / 4), q = r % (kTile / 4);
    int64_t cq = tile * kTile + 4 * q;
    cq = cq < N ? cq : N - 4;
    cp_async16(szs + (gr * 2 + half) * kTile + 4 * q,
               (half ? mat.zero : mat.scale) + static_cast<int64_t>(g_first + gr) * N + cq);
  }

  exl_pdl::pdl_wait();                                                  // x is the previous kernel's output
  exl_pdl::pdl_trigger();
  // rows M..kRows-1 of every stage stay zero (cp.async never writes them)
  if (M < kRows) {
    for (int i = threadIdx.x; i < (kRows - M) * (kStageW / 8); i += kThreads) {
      const int r = M + i / (kStageW / 8), q = i % (kStageW / 8);
#pragma unroll
      for (int st = 0; st < kStages; ++st)
        reinterpret_cast<uint4*>(xs + (st * kRows + r) * kStageW)[q] = make_uint4(0, 0, 0, 0);
    }
  }
  const __half* xsrc = (mat.x != nullptr ? mat.x : x) + static_cast<int64_t>(c_begin) * 32;
  const int nst = (nc + kRing - 1) / kRing;
  auto issue = [&](int s) {                                             // stage s: chunks c_begin + s*kRing ..
    __half* dst = xs + (s % kStages) * kRows * kStageW;
    const int L = min(kRing, nc - s * kRing) * 32;
#pragma unroll
    for (int i0 = 0; i0 < kPieces; i0 += kThreads) {
      const int i = i0 + threadIdx.x, m = i / (kRing * 4), k = 8 * (i % (kRing * 4));
      if (m < M && k < L) cp_async16(dst + m * kStageW + k, xsrc + m * K + s * kRing * 32 + k);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nst) issue(s);
    cp_commit();                                                        // group 0 also holds scale/zero
  }

  float acc[2][NT][4];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][nt][i] = 0.f;
  __half2 sh[4], zs[4];
  int grp = -1;

  // Chunk c (slot i of the ring, its x at xb): new group -> its s and -z*s in fp16; B from the stage; A scaled;
  // the slot refilled with chunk c + kRing when `reload`.
  auto chunk = [&](int i, int c, const __half* xb, bool reload) {
    const int32_t* e = tab + 3 * (c - c_begin);
    const int ge = e[1];
    if (ge != grp) {                                                    // warp-uniform
      grp = ge;
      const float* sp = szs + (ge - g_first) * 2 * kTile + warp * 32 + 4 * g;
      float4 s4, z4;
      if (ge - g_first < max_groups) {
        s4 = *reinterpret_cast<const float4*>(sp);
        z4 = *reinterpret_cast<const float4*>(sp + kTile);
      } else {                                                          // beyond the staged groups (not expected)
        s4 = __ldg(reinterpret_cast<const float4*>(mat.scale + static_cast<int64_t>(ge) * N + lcol));
        z4 = __ldg(reinterpret_cast<const float4*>(mat.zero + static_cast<int64_t>(ge) * N + lcol));
      }
      const float sv[4] = {s4.x, s4.y, s4.z, s4.w}, zv[4] = {z4.x, z4.y, z4.z, z4.w};
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        sh[v] = __float2half2_rn(sv[v]);
        zs[v] = __float2half2_rn(-zv[v] * sv[v]);
      }
    }
    uint32_t b[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) b_pairs(*reinterpret_cast<const uint4*>(xb + nt * 8 * kStageW + i * 32), b[nt]);
    uint32_t a[4][4];
    if constexpr (U4) {
      scaled_a<4>(ring[i], t, sh, zs, a);
      if (reload) ring[i].lo = __ldg(reinterpret_cast<const int4*>(wnext));
      wnext += 4 * ldq;
    } else {
      switch (e[0]) {
        case 4: scaled_a<4>(ring[i], t, sh, zs, a); break;
        case 2: scaled_a<2>(ring[i], t, sh, zs, a); break;
        case 3: scaled_a<3>(ring[i], t, sh, zs, a); break;
        case 5: scaled_a<5>(ring[i], t, sh, zs, a); break;
        case 6: scaled_a<6>(ring[i], t, sh, zs, a); break;
        default: scaled_a<8>(ring[i], t, sh, zs, a); break;
      }
      if (reload) load_words<false>(ring[i], e + 3 * kRing, c + kRing, base, ldq, t);
    }
    chunk_mma<NT>(a, b, acc);
  };

  for (int s = 0; s < nst; ++s) {
    cp_wait<kStages - 2>();
    __syncthreads();                                                    // stage s landed; stage s-1 is free
    if (s + kStages - 1 < nst) issue(s + kStages - 1);
    cp_commit();
    const __half* xb = xs + (s % kStages) * kRows * kStageW + g * kStageW + 8 * t;
    const int cs = c_begin + s * kRing;
    if (cs + 2 * kRing <= c_end) {                                      // a full stage whose refills all exist
#pragma unroll
      for (int i = 0; i < kRing; ++i) chunk(i, cs + i, xb, true);
    } else {
#pragma unroll
      for (int i = 0; i < kRing; ++i)
        if (cs + i < c_end) chunk(i, cs + i, xb, cs + i + kRing < c_end);
    }
  }

  __syncthreads();                                                      // x stages dead: red aliases them
  store_partials<NT>(acc, red + warp * 32, kTile, M, g, t);
  cluster_store(red, M * kTile, kTile, kThreads, tile, mat);
}

// ----------------------------------------------------------------------------- host side

struct Plan {
  int nt, splits, cps, groups;
  size_t smem;
};

int n_tiles_for(int M) { return M <= 16 ? 2 : 4; }

// Splits of K from the grid: ~320 blocks (2-3 per SM) measured best on the H200 (bench/wide_probe.cu: 4096x4096 32
// tiles -> 8 splits, q/k/v 96 -> 4, gate/up 172 -> 2, 11008x4096 -> 8), then more while shared memory is short.
Plan plan_for(int M, int64_t K, int64_t tiles, int splits, int64_t min_group) {
  const int nt = n_tiles_for(M), n_chunks = static_cast<int>(K / 32);
  int S = splits;
  if (S <= 0) {
    S = 1;
    while (S < kMaxSplits && tiles * S < 320) S *= 2;
  }
  S = std::max(1, std::min({S, kMaxSplits, n_chunks}));
  const int per_group = static_cast<int>(std::max<int64_t>(1, (min_group > 0 ? min_group : 32) / 32));
  for (;; S = std::min(kMaxSplits, S * 2)) {                           // an explicit split count is kept
    const int cps = (n_chunks + S - 1) / S;
    S = (n_chunks + cps - 1) / cps;                                     // no split without chunks
    const int groups = std::min(cps, (cps + per_group - 1) / per_group + 1);
    const size_t smem = Smem(8 * nt, M, cps, groups).total;
    if (smem <= kSmemMax || splits > 0 || S >= kMaxSplits || S >= n_chunks) return {nt, S, cps, groups, smem};
  }
}

bool plan_usable(const Plan& p, int64_t K) { return p.smem <= kSmemMax && p.cps >= 1 && K % 32 == 0; }

template <int NT, bool U4>
void launch_one(const __half* x, int M, int64_t K, int64_t tiles, const Plan& p, const Mats& mats, int dev) {
  auto* kern = qgemm_wide_kernel<NT, U4>;
  ensure_smem(kern, p.smem, dev);
  launch_split(kern, tiles, p.splits, kThreads, p.smem, c10::cuda::getCurrentCUDAStream(), dev, x, M, K,
               static_cast<int>(K / 32), p.cps, p.groups, mats);
}

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i), x fp16 [M <= 32, K], up to kMaxMats weights on one x in one
// launch.  splits 0 = chosen here; min_group: the weights' smallest group in rows (0 = unknown, assume 32).
// Raises where the shape does not fit (see qgemm_wide_fits).
std::vector<at::Tensor> qgemm_wide_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                         at::TensorList scale, at::TensorList zero,
                                         const c10::List<c10::optional<at::Tensor>>& perm,
                                         const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4,
                                         int64_t splits, int64_t min_group) {
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  Mats mats = build_mats("exl_core::qgemm_wide", x, qweight, chunks, scale, zero, perm, bias, ys);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= kMaxRows, "exl_core::qgemm_wide: at most ", kMaxRows, " rows of x, got ", M);
  if (M == 0) return ys;
  const int dev = x.device().index();
  const int64_t tiles = assign_tiles(mats, kTile);
  const Plan plan = plan_for(static_cast<int>(M), K, tiles, static_cast<int>(splits), min_group);
  TORCH_CHECK(plan_usable(plan, K), "exl_core::qgemm_wide: no plan for M = ", M, ", K = ", K, ", splits = ", splits,
              " (shared memory)");
  // checked before anything is launched: a refused call leaves no gather behind
  const at::Tensor xa = aligned16(x) ? x : x.clone();                   // cp.async reads 16 bytes
  const at::Tensor xperm = permute_x_per_weight(xa, perm, mats, dev);
  const __half* xp = reinterpret_cast<const __half*>(xa.data_ptr());
  if (plan.nt == 2) {
    if (uniform4) launch_one<2, true>(xp, static_cast<int>(M), K, tiles, plan, mats, dev);
    else launch_one<2, false>(xp, static_cast<int>(M), K, tiles, plan, mats, dev);
  } else {
    if (uniform4) launch_one<4, true>(xp, static_cast<int>(M), K, tiles, plan, mats, dev);
    else launch_one<4, false>(xp, static_cast<int>(M), K, tiles, plan, mats, dev);
  }
  return ys;
}

at::Tensor qgemm_wide(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks, const at::Tensor& scale,
                      const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                      const c10::optional<at::Tensor>& bias, bool uniform4, int64_t splits, int64_t min_group) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  return qgemm_wide_multi(x, {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, splits, min_group)[0];
}

// Whether qgemm_wide takes M rows of K over `tiles` 128-column tiles (splits 0: its own choice); a call it refuses
// raises, which on some images kills the process (see NOTES.md), so callers ask first.
bool qgemm_wide_fits(int64_t rows, int64_t K, int64_t tiles, int64_t min_group, int64_t splits) {
  if (rows < 1 || rows > kMaxRows || K < 32 || K % 32 != 0 || tiles < 1 || splits < 0 || splits > kMaxSplits)
    return false;
  return plan_usable(plan_for(static_cast<int>(rows), K, tiles, static_cast<int>(splits), min_group), K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_wide(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias, bool uniform4=False, int splits=0, int min_group=0) -> Tensor");
  m.def("qgemm_wide_multi(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor?[] perm, Tensor?[] bias, bool uniform4=False, int splits=0, int min_group=0) -> Tensor[]");
  m.def("qgemm_wide_fits(int rows, int K, int tiles, int min_group, int splits=0) -> bool", &qgemm_wide_fits);
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_wide", &qgemm_wide);
  m.impl("qgemm_wide_multi", &qgemm_wide_multi);
}
