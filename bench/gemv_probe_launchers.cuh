// The launchers of bench/gemv_probe.cu: how each timed row launches its op (the read floor, qgemm_kslice, qgemm_skinny,
// stream_gemv), each with go(op, x, stream), name() and, for the kernels, regs() / occ(K).  Included by gemv_probe.cu
// after its weights (W, Op, mats_of, probe_fold); split out of it in stop 53.
#pragma once

// ----------------------------------------------------------------------------- the floor: read the same bytes
struct Bufs {
  const int4* p[12];
  int64_t n[12];                // 16-byte units
  int nb;
};

// Every block takes an equal share of the concatenated buffers; all of a thread's loads (U per pass) are issued
// before the PDL wait (as the GEMV's weight ring), the xor after it.
template <int U>
__global__ void __launch_bounds__(512) read_kernel(const Bufs b, int64_t total, int* out) {
  const int64_t per = (total + gridDim.x - 1) / gridDim.x, i0 = blockIdx.x * per, i1 = min(total, i0 + per);
  int acc = 0;
  bool waited = false;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += U * blockDim.x) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int64_t j = i + u * blockDim.x;
      v[u] = make_int4(0, 0, 0, 0);
      if (j < i1) {
        int k = 0;
        while (k + 1 < b.nb && j >= b.n[k]) j -= b.n[k++];
        v[u] = __ldg(b.p[k] + j);
      }
    }
    if (!waited) {
      exl_pdl::pdl_wait();
      exl_pdl::pdl_trigger();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (!waited) {
    exl_pdl::pdl_wait();
    exl_pdl::pdl_trigger();
  }
  if (acc == 0x12345678) out[0] = acc;
}

struct ReadLauncher {
  static int* sink;
  static void go(const Op& op, const __half*, cudaStream_t st) {
    Bufs b{};
    int64_t total = 0;
    for (W* w : op) {
      const int64_t words = static_cast<int64_t>(w->K) / 8 * w->N, sz = static_cast<int64_t>(w->K) / 128 * w->N;
      b.p[b.nb] = reinterpret_cast<const int4*>(w->qw), b.n[b.nb++] = words / 4;
      b.p[b.nb] = reinterpret_cast<const int4*>(w->s), b.n[b.nb++] = sz / 4;
      b.p[b.nb] = reinterpret_cast<const int4*>(w->z), b.n[b.nb++] = sz / 4;
      total += words / 4 + sz / 2;
    }
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = pdl_config(dim3(2 * sms), dim3(512), 0, st, attr);
    CK(cudaLaunchKernelEx(&cfg, read_kernel<8>, b, total, sink));
  }
  static std::string name() { return "read floor"; }
};
int* ReadLauncher::sink = nullptr;

// ----------------------------------------------------------------------------- qgemm_kslice, M = 1
// KW warps along K, ring R.
// GS: the group shift passed (2: GPTQ g128's regular groups, as the extension passes them; -1: the chunk table).
// SG: act-order x gathered from a shared-memory copy of x (the kernel's sgather).
// H2: scale and zero as one half2 a group and column (the weights' h2; mode h2).
// FOLD: the folded-norm instance (probe_fold: r = 1, weight 1; no gather: SG false).
// CAP: at most CAP blocks an SM, by padding the block's shared memory (mode cap: the greedy fill of SMs under PDL).
template <int KW, int R, bool U4 = true, int GS = 2, bool SG = false, bool H2 = false, bool FOLD = false, int CAP = 0>
struct KsLauncher {
  static auto kern() { return qgemm_kslice_kernel<KW, U4, R, 1, false, FOLD, false, H2>; }
  static size_t smem(int K) {
    const int n_chunks = K / 32, cw = (n_chunks + KW - 1) / KW;
    const int slots = std::max(1, std::min(cw, (cw + 3) / 4 + 1));
    const size_t need = Smem(n_chunks, KW, slots, 1, K, xr_halves(SG, FOLD, 1, K, false)).total;
    // an SM's 228 KB over CAP blocks, less the 1 KB each block reserves and a margin
    return CAP > 0 ? std::max(need, static_cast<size_t>(228 * 1024 / CAP - 1024 - 256)) : need;
  }
  static void go(const Op& op, const __half* x, cudaStream_t st) {
    const int K = op[0]->K, n_chunks = K / 32, cw = (n_chunks + KW - 1) / KW;
    const int slots = std::max(1, std::min(cw, (cw + 3) / 4 + 1));
    const size_t sm = smem(K);
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    Mats mats = mats_of(op, H2);
    if constexpr (FOLD) mats.nf = probe_fold(K);
    const int64_t tiles = assign_tiles(mats, kTile);
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = pdl_config(dim3(static_cast<unsigned>(tiles)), dim3(32 * KW), sm, st, attr);
    CK(cudaLaunchKernelEx(&cfg, kern(), x, static_cast<const __half*>(nullptr), 1, static_cast<int64_t>(K), n_chunks,
                          slots, K, U4 ? GS : -1, SG ? 1 : 0, mats));
  }
  static int regs() { return regs_of(kern()); }
  static int occ(int K) {
    int per_sm = 0;
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem(K))));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern(), 32 * KW, smem(K)));
    return per_sm;
  }
  static std::string name() {
    char b[64];
    snprintf(b, sizeof b, "k%d r%d%s%s%s%s%s", KW, R, !U4 ? " mixed" : GS < 0 ? " table" : "", SG ? " sg" : "",
             H2 ? " h2" : "", FOLD ? " fold" : "", CAP > 0 ? (" cap" + std::to_string(CAP)).c_str() : "");
    return b;
  }
};

// ----------------------------------------------------------------------------- qgemm_skinny, M = 1
// The extension's batch-1 gate/up kernel (its policy sends launches of more than 3 blocks per SM there), with the
// extension's split rule (qgemm_skinny_cuda.cu plan_splits): the most splits, up to a cluster of 8, whose grid
// still fits one wave of co-resident clusters.
template <bool U4>
struct SkLauncher {
  static auto kern() { return exl_skinny::qgemm_skinny_kernel<1, U4>; }
  static std::pair<int, int> plan(int C, int64_t tiles) {            // {splits, chunks per block}, planned once per
    static std::map<std::pair<int, int64_t>, std::pair<int, int>> cache;   // shape (not again while a graph captures)
    const auto hit = cache.find({C, tiles});
    if (hit != cache.end()) return hit->second;
    const int s_min = (C + exl_skinny::max_cpb(1) - 1) / exl_skinny::max_cpb(1);
    int S = s_min;
    for (int s = std::min(kMaxSplits, std::max(1, C / (2 * exl_skinny::kKWarps))); s > s_min; --s) {
      const size_t sm = exl_skinny::smem_bytes(1, (C + s - 1) / s);
      CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = split_config(1, s, exl_skinny::kThreads, sm, nullptr, attr);
      int clusters = 0;
      CK(cudaOccupancyMaxActiveClusters(&clusters, kern(), &cfg));
      if (tiles * s <= static_cast<int64_t>(clusters) * s) {
        S = s;
        break;
      }
    }
    const int cpb = (C + S - 1) / S;
    return cache[{C, tiles}] = {(C + cpb - 1) / cpb, cpb};
  }
  static void go(const Op& op, const __half* x, cudaStream_t st) {
    const int K = op[0]->K, C = K / 32;
    Mats mats = mats_of(op);
    const int64_t tiles = assign_tiles(mats, exl_skinny::kTileN);
    const auto [S, cpb] = plan(C, tiles);
    const size_t sm = exl_skinny::smem_bytes(1, cpb);
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    cudaLaunchAttribute attr[2];                                  // PDL, as the extension launches; a cluster of S
    cudaLaunchConfig_t cfg = pdl_config(dim3(static_cast<unsigned>(tiles), S), dim3(exl_skinny::kThreads), sm, st,
                                        reinterpret_cast<cudaLaunchAttribute(&)[1]>(attr[0]));
    if (S > 1) {
      attr[1].id = cudaLaunchAttributeClusterDimension;
      attr[1].val.clusterDim.x = 1;
      attr[1].val.clusterDim.y = static_cast<unsigned>(S);
      attr[1].val.clusterDim.z = 1;
      cfg.numAttrs = 2;
    }
    CK(cudaLaunchKernelEx(&cfg, kern(), x, 1, static_cast<int64_t>(K), C, cpb, mats));
  }
  static int regs() { return regs_of(kern()); }
  static int occ(int K) {
    const int C = K / 32, cpb = plan(C, 32).second;
    int per_sm = 0;
    const size_t sm = exl_skinny::smem_bytes(1, cpb);
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern(), exl_skinny::kThreads, sm));
    return per_sm;
  }
  static std::string name() {
    char b[64];
    snprintf(b, sizeof b, "skinny%s", U4 ? "" : " mixed");
    return b;
  }
};


// ------------------------------------------------------------------ stream_gemv (bench/stream_gemv_kernel.cuh)
// One block an SM (fewer where the launch has fewer tiles), PRE chunks a warp staged before the wait, ring R.
// GRID: blocks an SM (2: the kernel fills both of an SM's slots itself, as two waves' worth of warps).
template <int PRE, int R, bool EARLY, int GRID = 1>
struct StLauncher {
  static auto kern() { return exl_stream::stream_gemv_kernel<PRE, R, EARLY>; }
  static void go(const Op& op, const __half* x, cudaStream_t st) {
    const int K = op[0]->K;
    Mats mats = mats_of(op);
    const int64_t tiles = assign_tiles(mats, kTile);
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int grid = static_cast<int>(std::min<int64_t>(GRID * sms, tiles));
    const int tpb = static_cast<int>((tiles + grid - 1) / grid);   // tiles a block, at most
    const size_t sm = exl_stream::stream_smem(K, PRE, tpb);
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = pdl_config(dim3(grid), dim3(32 * exl_stream::KW), sm, st, attr);
    CK(cudaLaunchKernelEx(&cfg, kern(), x, static_cast<int64_t>(K), static_cast<int>(tiles), tpb, mats));
  }
  static int regs() { return regs_of(kern()); }
  static int occ(int K) {
    int per_sm = 0;
    const size_t sm = exl_stream::stream_smem(K, PRE, 1);
    CK(cudaFuncSetAttribute(kern(), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sm)));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern(), 32 * exl_stream::KW, sm));
    return per_sm;
  }
  static std::string name() {
    char b[64];
    snprintf(b, sizeof b, "stream pre%d r%d%s%s", PRE, R, EARLY ? " early" : "", GRID > 1 ? " 2/SM" : "");
    return b;
  }
};
