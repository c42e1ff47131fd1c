// Device hooks of bench/gemv_probe.cu's trace modes, defined before it includes qgemm_kslice_kernel.cuh (whose
// EXL_KSLICE_STAMP / EXL_KSLICE_TAIL hooks are empty in the extension): a launch's id from its first weight's y
// (gemv_probe.cu's make_weight puts every y in one arena), the phase stamps (-DKSLICE_STAMPS) and the tail prefetch of
// the next launch's first weights (-DKSLICE_TAIL_PREFETCH); the ramp's x staging variants (stop 50): fewer ring slots
// before the PDL wait (-DKSLICE_PREWAIT=P) and x staged by one bulk copy a row and warp (-DKSLICE_X_BULK); the folded
// norm's staging without the producer's sums (-DKSLICE_FOLD_NO_SS) or the norm weight's copy (-DKSLICE_FOLD_NO_NW; stop
// 53).  Host side: gemv_probe_trace.cuh.
#pragma once
#include <cuda_runtime.h>

#if defined(KSLICE_STAMPS) || defined(KSLICE_TAIL_PREFETCH)
#include <cstdint>
#define KSLICE_LAUNCH_IDS
namespace launch_ids {                  // a launch's id: the slot of its first weight's y in one arena (make_weight)
constexpr int kIds = 64;
__constant__ const char* g_arena;       // every weight's y sits in a 64 KB slot of this arena: id = slot
__device__ __forceinline__ int64_t id_of(const void* y) { return (static_cast<const char*>(y) - g_arena) >> 16; }
}  // namespace launch_ids
#endif

#ifdef KSLICE_STAMPS   // mode `stamps`: the kernel's phase hooks store each warp's globaltimer and clock64
namespace stamps {
using launch_ids::kIds;
constexpr int kBlocks = 704, kWarps = 16, kPhases = 8;
__constant__ unsigned long long* g_t;   // [id][block][warp][phase] globaltimer, ns (0: not stamped)
__constant__ long long* g_c;            // the same slots: clock64
__constant__ unsigned* g_sm;            // [id][block]: the SM
__device__ __forceinline__ void stamp(int phase, const void* y) {
  if ((threadIdx.x & 31) != 0) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  const long long c = clock64();
  const int64_t id = launch_ids::id_of(y);
  const int64_t slot = ((id * kBlocks + blockIdx.x) * kWarps + (threadIdx.x >> 5)) * kPhases + phase;
  g_t[slot] = t;
  g_c[slot] = c;
  if (phase == 0 && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    g_sm[id * kBlocks + blockIdx.x] = sm;
  }
}
}  // namespace stamps
#define EXL_KSLICE_STAMP(phase) stamps::stamp(phase, mats.m[0].y)
#endif

#ifdef KSLICE_TAIL_PREFETCH   // mode `tailpf`: a launch's warps, done with their loop, ask L2 for the next launch's
// first ring of weights (what its warps load before their PDL wait), spread over every thread of the launch: the
// next launch's blocks enter only as this one's leave (phase stamps, stop 49), so its first loads would then hit L2.
namespace tailpf {
struct NextMat {
  const int32_t* qw;
  int64_t ldq;
  int tile0;
};
struct NextOp {                         // the launch after, as its plan: kw warps a tile, a ring of `ring` chunks
  NextMat m[3];
  int n, kw, ring, n_chunks, tiles;     // n = 0: no prefetch
};
__constant__ NextOp c_next[launch_ids::kIds];
__device__ __forceinline__ void prefetch_next(const void* y) {
  const NextOp& nx = c_next[launch_ids::id_of(y)];
  if (nx.n == 0) return;
  const int64_t lines = static_cast<int64_t>(nx.tiles) * nx.kw * nx.ring * 4;   // 128 B: 4 word rows a chunk
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < lines; j += step) {
    const int r = static_cast<int>(j & 3);
    int64_t q = j >> 2;
    const int ci = static_cast<int>(q % nx.ring);
    q /= nx.ring;
    const int w = static_cast<int>(q % nx.kw), T = static_cast<int>(q / nx.kw);
    const int c = nx.n_chunks * w / nx.kw + ci;
    if (c >= nx.n_chunks * (w + 1) / nx.kw) continue;
    int mi = 0;
    while (mi + 1 < nx.n && T >= nx.m[mi + 1].tile0) ++mi;
    const NextMat& m = nx.m[mi];
    const int32_t* p = m.qw + (4 * static_cast<int64_t>(c) + r) * m.ldq + 32 * static_cast<int64_t>(T - m.tile0);
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
  }
}
}  // namespace tailpf
#define EXL_KSLICE_TAIL() tailpf::prefetch_next(mats.m[0].y)
#endif

#ifdef KSLICE_PREWAIT   // the first P ring slots before the PDL wait, the rest once x is staged (R if P >= R)
#define EXL_KSLICE_PREWAIT(R) ((KSLICE_PREWAIT) < (R) ? (KSLICE_PREWAIT) : (R))
#endif

#ifdef KSLICE_X_BULK   // a warp's plain x rows staged by lane 0's bulk copies (the TMA unit, completing on an
// mbarrier in the warp's partial-sum area, free until its loop ends), not by every lane's cp.async: the question is
// whether x, an L2 hit, then arrives ahead of the weight loads the SM already has in flight (stamps: 0.86-2.41 us).
#include "../exl_core/csrc/cuda/tma_device.cuh"
namespace xbulk {
__device__ __forceinline__ void copy_1d(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   exl_tma::smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(exl_tma::smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ bool stage(__half* xs, const __half* x, int M, int64_t K, int xs_stride, int kw0, int kwl,
                                      float* scratch, int lane) {
  uint64_t* bar = reinterpret_cast<uint64_t*>(scratch);
  if (lane == 0) {
    exl_tma::mbar_init(bar, 1);
    exl_tma::mbar_init_fence();
    exl_tma::mbar_arrive_expect(bar, static_cast<uint32_t>(M) * kwl * 2);
    for (int m = 0; m < M; ++m) copy_1d(xs + m * xs_stride + kw0, x + m * K + kw0, kwl * 2, bar);
  }
  __syncwarp();
  exl_tma::mbar_wait(bar, 0);
  __syncwarp();
  if (lane == 0) asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(exl_tma::smem_addr(bar)) : "memory");
  __syncwarp();
  return true;
}
}  // namespace xbulk
#define EXL_KSLICE_STAGE_X() xbulk::stage(xs, x, M, K, xs_stride, kw0, kwl, red + warp * M * kTile, lane)
#endif

// The folded norm's staging parts (stop 53; mode `fold` built with them, gpu.sh gemvab GEMV_AB_MODE=fold): r taken as 1
// without reading the producer's sums (probe_fold's sums and eps give exactly 1), and the norm weight's pieces stored as
// 1 (probe_fold's weight) instead of copied -- the same results, so the checks still hold.
#ifdef KSLICE_FOLD_NO_SS
#define EXL_KSLICE_FOLD_RMS0() 1.f
#define EXL_KSLICE_FOLD_RMS(m) 1.f
#endif
// r's sums loaded after the x copies are issued, as before stop 55 (the extension loads row 0's first, FoldSums0).
#ifdef KSLICE_FOLD_RMS_LATE
#define EXL_KSLICE_FOLD_RMS0() fold_rms(mats.nf, M, 0, K, lane)
#endif
// Stop 54's probe variant on the extension's early loads: every row's r from row 0's 4 sums a lane (the probe's chain:
// M = 1, K <= 4096), no tail loop.  Stop 55 call 2 (the extension then took r0 in the row loop): this form's chain
// 49.70-50.05 us a layer, the extension's 50.26-50.74, late 50.26-50.82.
#ifdef KSLICE_FOLD_RMS_EARLY54
#define EXL_KSLICE_FOLD_RMS0() fold_rms_from(((ss0.v[0] + ss0.v[1]) + ss0.v[2]) + ss0.v[3], mats.nf, K)
#define EXL_KSLICE_FOLD_RMS(m) EXL_KSLICE_FOLD_RMS0()
#endif
#ifdef KSLICE_FOLD_NO_NW
#define EXL_KSLICE_FOLD_NW_PIECE(dst, src) \
  (*reinterpret_cast<uint4*>(dst) = make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u))
#endif
