// Probe for the batch-1 decode GEMV (bs1 decode): the extension's qgemm_kslice kernel
// (exl_core/csrc/cuda/qgemm_kslice_kernel.cuh, no torch headers) built in seconds with plain nvcc and timed, with
// programmatic dependent launch as the extension launches it, both per launch and as a chain of decode layers
// (q/k/v -> o -> gate/up -> down, 8 layers of distinct weights in one CUDA graph): a chain shows how much of
// the next launch's weight stream overlaps the previous launch (weights are read before the PDL wait).
//   nvcc -O3 -arch=sm_90 -o /tmp/gemv_probe bench/gemv_probe.cu && /tmp/gemv_probe
// (bench/gpu.sh phase `gemv`.)  Per-launch figures: 8 layers' distinct weights back to back in one CUDA graph,
// median of 10 replays, us per launch.  err: max |y - fp32 reference| / max |reference| on poisoned output.
// The floor: a read-only kernel over the same bytes (words, scale, zero) launched the same way.
// Rows: GPTQ (ring 8 as shipped, ring 4); where the mixed-width (EXL2) penalty comes from -- 4-bit words through the
// mixed-width path, mixed widths without and with an act-order permutation, the shared-memory gather of act-order x
// (sg) -- and GPTQ act-order with and without sg.  `ncu` launches, per layer, GPTQ q/k/v, 4-bit q/k/v through the
// mixed-width path and EXL2-like q/k/v (bench/gpu.sh GEMV_NCU=1).
// Variants measured and dropped (results in bench/results/gemv_probe_h200.json): fp16 scale before the mma and
// registers capped at 64 (`git show 166985b:bench/gemv_probe.cu`); a stream-K GEMV (`git show 4cfbdd6`); the chunk
// table passed as runs in the launch's parameters instead of loaded (chain within 0.8 us); a loop per width run
// with the width a template argument (the kernel grew to 240 KB of code: slower than the per-chunk switch); a launch
// before each projection asking L2 for the next projection's weights, by cp.async.bulk.prefetch.L2 or per-line
// prefetch.global.L2 (`git show 64b59b5:bench/gemv_probe.cu`, mode l2pf; bench/results/gemv_probe_l2pf_h200_stop39_*);
// a one-wave GEMV that triggers its dependants first and stages its first chunks before the wait (mode `stream`,
// bench/stream_gemv_kernel.cuh; bench/results/gemv_probe_stream_h200_stop40_*).
// Modes of stop 49 (the trace modes' device hooks in gemv_probe_hooks.cuh, their host side in gemv_probe_trace.cuh):
// `stamps` (built with -DKSLICE_STAMPS; STAMP_CSV=file.csv): every warp's phase times in the chain
// (bench/stamps_report.py reads the CSV; bench/results/gemv_stamps_*_stop49_*); `ring`: ring depths per launch in the
// chain; `tailpf` (built with -DKSLICE_TAIL_PREFETCH): the chain with each launch's warps, done with their loop, asking
// L2 for the next launch's first ring of weights, against without, rounds alternated -- written after stop 49's last
// call, compiled, not yet run (`PHASES=gemv PROBE_FLAGS=-DKSLICE_TAIL_PREFETCH PROBE_ARGS=tailpf bash bench/gpu.sh`;
// with the stamps: PROBE_FLAGS="-DKSLICE_STAMPS -DKSLICE_TAIL_PREFETCH" PROBE_ARGS=stamps STAMP_TAILPF=1).
// Mode `chain` (stop 50): the extension's chain and the read floor, 3 rounds, for builds with other flags
// (-DKSLICE_PREWAIT=P, -DKSLICE_X_BULK: gemv_probe_hooks.cuh) run in turn (gpu.sh phase `gemvab`); `fit`: o and down
// on 12 or 8 warps a block, so that a block of the next launch fits beside theirs.  Both run before the mixed-width
// weights are made (with them made first, each run of call 1 of stop 50 took ~40 s: 7 of 8 chain runs in 420 s).
// Modes of stop 53 (gemv_probe_chains.cuh): `fold`, the chain with the folded-norm consumers (KsLauncher's FOLD,
// probe_fold) against the plain ones; `cap`, gate/up's one-wave blocks capped at 6 or 5 an SM by padded shared memory
// (KsLauncher's CAP; the extension's wave_cap_smem); the stamps' STAMP_CHAIN=k4 | k4cap6 | fold chains.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>
#include <type_traits>

#include "gemv_probe_hooks.cuh"          // the trace modes' device hooks (before the kernel header)
#include "../exl_core/csrc/cuda/qgemm_kslice_kernel.cuh"   // the extension's kernels (no torch headers)
#include "../exl_core/csrc/cuda/qgemm_skinny_kernel.cuh"
#include "probe_common.cuh"
#include "stream_gemv_kernel.cuh"           // the one-wave GEMV of the F rows (bench/persist_probe.cu)

using namespace exl_mma;
using namespace exl_kslice;

// fp32 reference over the chunk table (any width; value j of a chunk sits at bits j*bits.. of its word rows):
// y[n] = sum_k x[perm[k]] * (q - z) * s, M = 1
__global__ void ref_kernel(const __half* x, int K, int N, const int* qw, const int* chunks, const float* scale,
                           const float* zero, const int64_t* perm, float* y) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float a = 0.f;
  for (int c = 0; c < K / 32; ++c) {
    const int bits = chunks[3 * c], gi = chunks[3 * c + 1], qrow = chunks[3 * c + 2];
    for (int j = 0; j < 32; ++j) {
      const int pos = j * bits, w = pos >> 5, off = pos & 31;
      uint64_t win = static_cast<uint32_t>(qw[static_cast<size_t>(qrow + w) * N + n]);
      if (off + bits > 32)
        win |= static_cast<uint64_t>(static_cast<uint32_t>(qw[static_cast<size_t>(qrow + w + 1) * N + n])) << 32;
      const int q = static_cast<int>((win >> off) & ((1u << bits) - 1u));
      const int k = 32 * c + j;
      a += __half2float(x[perm ? perm[k] : k]) * (q - zero[static_cast<size_t>(gi) * N + n]) *
           scale[static_cast<size_t>(gi) * N + n];
    }
  }
  y[n] = a;
}

struct W {                      // one weight [K, N]: GPTQ 4-bit g128, or EXL2-like mixed widths with a permutation
  int K, N;
  int* qw;
  float *s, *z;
  __half* y;
  int* chunks;                  // [K/32, 3]: bits, group c/4, first word row
  int64_t* perm;                // or null
  float* h2 = nullptr;          // mode h2: [G, N] half2 (s, z), made by make_h2
  float* h2mul = nullptr;       // and its multipliers [G], all 1 (the probe's scales are rounded to fp16)
};

// Each group and column's (scale, zero) as one half2 (qgemm_kslice's H2 instances).
__global__ void h2_kernel(const float* s, const float* z, int64_t n, __half2* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __floats2half2_rn(s[i], z[i]);
}
void make_h2(W& w) {                                        // the probe's weights have groups of 128 rows
  const int64_t n = static_cast<int64_t>(w.K / 128) * w.N;
  CK(cudaMalloc(&w.h2, n * 4));
  h2_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(w.s, w.z, n, reinterpret_cast<__half2*>(w.h2));
  CK(cudaGetLastError());
  const std::vector<float> ones(w.K / 128, 1.f);
  CK(cudaMalloc(&w.h2mul, ones.size() * 4));
  CK(cudaMemcpy(w.h2mul, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
}

// The folded-norm launchers' norm (modes fold, stamps with STAMP_CHAIN=fold): sums of squares all 0 and eps 1 (r = 1), the norm weight all 1 -- the staged x equals x, so
// the fp32 reference checks the folded launches too (their timing is what the mode measures)
float* g_fold_ss = nullptr;
__half* g_fold_nw = nullptr;
NormFold probe_fold(int K) {
  if (!g_fold_ss) {
    CK(cudaMalloc(&g_fold_ss, 4096 * 4));
    CK(cudaMemset(g_fold_ss, 0, 4096 * 4));
    const std::vector<__half> ones(16384, __float2half(1.f));
    CK(cudaMalloc(&g_fold_nw, ones.size() * 2));
    CK(cudaMemcpy(g_fold_nw, ones.data(), ones.size() * 2, cudaMemcpyHostToDevice));
  }
  NormFold nf{};
  nf.ss_in = g_fold_ss, nf.nw = g_fold_nw, nf.ss_tiles = K / 32, nf.eps = 1.f;
  return nf;
}

// mixed: the bench's EXL2 layout (bench/make_7b_checkpoint.py exl2_segments): the first ~K/11 rows 5-bit, the last
// ~K/11 3-bit, the rest 4-bit, groups of 128 rows, and a random act-order permutation.
W make_weight(int K, int N, bool mixed = false, int act = -1) {
  const PackedDev p = make_packed(K, N, mixed, act < 0 ? mixed : act != 0);
  W w{K, N, p.qw, p.s, p.z, nullptr, p.chunks, p.perm};
#ifdef KSLICE_LAUNCH_IDS
  static char* arena = nullptr;                               // y in 64 KB slots: the launch id
  static int used = 0;
  if (!arena) {
    CK(cudaMalloc(&arena, static_cast<size_t>(launch_ids::kIds) << 16));
    CK(cudaMemcpyToSymbol(launch_ids::g_arena, &arena, sizeof arena));
  }
  if (used >= launch_ids::kIds || N * 2 > (1 << 16)) {
    printf("FAILED: the launch-id arena holds %d outputs of at most 32768 halves\n", launch_ids::kIds);
    exit(2);
  }
  w.y = reinterpret_cast<__half*>(arena + (static_cast<size_t>(used++) << 16));
#else
  CK(cudaMalloc(&w.y, static_cast<size_t>(N) * 2));
#endif
  return w;
}

// One launch: several weights on one x (q/k/v, gate/up), as the extension's multi-weight launch.
using Op = std::vector<W*>;

// The kernels' multi-weight table for one launch (tile0 set by the launcher's assign_tiles).
Mats mats_of(const Op& op, bool h2 = false) {
  Mats mats{};
  mats.n = static_cast<int>(op.size());
  for (int i = 0; i < mats.n; ++i) {
    Mat& m = mats.m[i];
    m.qw = QPtr{op[i]->qw, op[i]->N, 128};
    m.chunks = op[i]->chunks;
    m.scale = h2 ? op[i]->h2 : op[i]->s;
    m.zero = h2 ? op[i]->h2mul : op[i]->z;
    m.perm = op[i]->perm;
    m.y = op[i]->y;
    m.N = op[i]->N;
  }
  return mats;
}

#include "gemv_probe_launchers.cuh"      // ReadLauncher, KsLauncher, SkLauncher, StLauncher

// max |y - fp32 reference| / max |reference| over every weight of one launch (several weights on one x: q/k/v).
template <class L>
double max_rel_err(const Op& op, const __half* x) {
  double num = 0, den = 0;
  std::vector<float*> refs;
  for (W* w : op) {
    float* ref;
    CK(cudaMalloc(&ref, sizeof(float) * w->N));
    ref_kernel<<<(w->N + 127) / 128, 128>>>(x, w->K, w->N, w->qw, w->chunks, w->s, w->z, w->perm, ref);
    CK(cudaMemset(w->y, 0xFF, sizeof(__half) * w->N));   // poisoned: NaN where nothing is written
    refs.push_back(ref);
  }
  L::go(op, x, 0);
  CK(cudaDeviceSynchronize());
  for (size_t i = 0; i < op.size(); ++i) {
    W& w = *op[i];
    std::vector<float> r(w.N);
    std::vector<__half> o(w.N);
    CK(cudaMemcpy(r.data(), refs[i], sizeof(float) * w.N, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(o.data(), w.y, sizeof(__half) * w.N, cudaMemcpyDeviceToHost));
    for (int n = 0; n < w.N; ++n) {
      const double d = static_cast<double>(__half2float(o[n])) - r[n];
      num = std::max(num, std::isnan(d) ? 1e30 : std::fabs(d));
      den = std::max(den, static_cast<double>(std::fabs(r[n])));
    }
    CK(cudaFree(refs[i]));
  }
  return num / den;
}

constexpr int kLayers = 8;
constexpr double kLayerParams = 4.0 * 4096 * 4096 + 2.0 * 4096 * 11008 + 11008.0 * 4096;   // a 7B layer's weights
struct Layer {
  W q, k, v, o, gate, up, down;
};
std::vector<Layer> g_layers, g_layers_mixed, g_layers_u4perm, g_layers_mixed_noperm;
__half *g_x4096, *g_x11008;

// Launchers per op of a layer: q/k/v, o, gate/up, down.
template <class Lqkv, class Lo, class Lgu, class Ld>
void layer_row(const char* name, std::vector<Layer>& layers = g_layers, double sz_bytes = 8.0) {
  // per-launch times: each op over the 8 layers' weights back to back (the same op, distinct weights)
  auto op_us = [&](auto launcher, auto pick, const __half* x) {
    using L = decltype(launcher);
    return time_seq([&](cudaStream_t st) {
             for (auto& l : layers) L::go(pick(l), x, st);
           }) / kLayers;
  };
  const float t_qkv = op_us(Lqkv{}, [](Layer& l) { return Op{&l.q, &l.k, &l.v}; }, g_x4096);
  const float t_o = op_us(Lo{}, [](Layer& l) { return Op{&l.o}; }, g_x4096);
  const float t_gu = op_us(Lgu{}, [](Layer& l) { return Op{&l.gate, &l.up}; }, g_x4096);
  const float t_d = op_us(Ld{}, [](Layer& l) { return Op{&l.down}; }, g_x11008);
  const float chain = time_seq([&](cudaStream_t st) {
                        for (auto& l : layers) {
                          Lqkv::go(Op{&l.q, &l.k, &l.v}, g_x4096, st);
                          Lo::go(Op{&l.o}, g_x4096, st);
                          Lgu::go(Op{&l.gate, &l.up}, g_x4096, st);
                          Ld::go(Op{&l.down}, g_x11008, st);
                        }
                      }) / kLayers;
  // bytes a layer reads: words K*N/2, scale + zero sz_bytes (fp32: 8) per 128 rows and column
  const double bytes = kLayerParams * (0.5 + sz_bytes / 128);
  printf("%-34s qkv %6.2f  o %6.2f  gu %6.2f  down %6.2f  sum %6.2f | chain %6.2f us/layer (%.0f GB/s)\n", name,
         t_qkv, t_o, t_gu, t_d, t_qkv + t_o + t_gu + t_d, chain, bytes / chain / 1e3);
  printf("JSON {\"variant\": \"%s\", \"qkv_us\": %.2f, \"o_us\": %.2f, \"gu_us\": %.2f, \"down_us\": %.2f, "
         "\"chain_us_per_layer\": %.2f, \"chain_gb_s\": %.0f}\n",
         name, t_qkv, t_o, t_gu, t_d, chain, bytes / chain / 1e3);
}

template <class L>
void check_row(std::vector<Layer>& layers = g_layers) {
  Layer& l = layers[0];
  const double e1 = max_rel_err<L>(Op{&l.o}, g_x4096), e2 = max_rel_err<L>(Op{&l.down}, g_x11008);
  printf("%-22s regs %3d  blocks/SM (K 4096) %d  err 4096x4096 %.2e  11008x4096 %.2e\n", L::name().c_str(), L::regs(),
         L::occ(4096), e1, e2);
  printf("JSON {\"check\": \"%s\", \"regs\": %d, \"blocks_per_sm\": %d, \"err_o\": %.3e, \"err_down\": %.3e}\n",
         L::name().c_str(), L::regs(), L::occ(4096), e1, e2);
  if (!(e1 < 1e-2 && e2 < 1e-2)) {                      // fp16 output of fp32 sums: ~5e-4 measured
    printf("FAILED: %s disagrees with the fp32 reference\n", L::name().c_str());
    exit(2);
  }
}

#include "gemv_probe_trace.cuh"          // the trace modes' host side (stamps, tailpf)
#include "gemv_probe_chains.cuh"         // the chain modes (h2, ring, chain, fit, wave, sg, fold, cap)

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  srand(1);
  CK(cudaMalloc(&ReadLauncher::sink, 4));
  for (int i = 0; i < kLayers; ++i)
    g_layers.push_back({make_weight(4096, 4096), make_weight(4096, 4096), make_weight(4096, 4096),
                        make_weight(4096, 4096), make_weight(4096, 11008), make_weight(4096, 11008),
                        make_weight(11008, 4096)});
  std::vector<__half> hx(11008);
  for (auto& v : hx) v = __float2half(2.f * rand() / RAND_MAX - 1.f);
  CK(cudaMalloc(&g_x4096, 4096 * 2));
  CK(cudaMalloc(&g_x11008, 11008 * 2));
  CK(cudaMemcpy(g_x4096, hx.data(), 4096 * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g_x11008, hx.data(), 11008 * 2, cudaMemcpyHostToDevice));
#ifdef KSLICE_TAIL_PREFETCH
  if (argc > 1 && std::string(argv[1]) == "tailpf") return tailpf_run();
  set_tail_prefetch(getenv("STAMP_TAILPF") != nullptr);   // stamps with the tail prefetches on (-D both)
#endif
#ifdef KSLICE_STAMPS
  if (argc > 1 && std::string(argv[1]) == "stamps") return stamp_run();
#endif
  if (argc > 1 && std::string(argv[1]) == "chain") return chain_run();
  if (argc > 1 && std::string(argv[1]) == "fit") return fit_run();
  if (argc > 1 && std::string(argv[1]) == "wave") return wave_run();
  if (argc > 1 && std::string(argv[1]) == "sg") return sg_run();
  if (argc > 1 && std::string(argv[1]) == "fold") return fold_run();
  if (argc > 1 && std::string(argv[1]) == "cap") return cap_run();
  for (int i = 0; i < kLayers; ++i)
    g_layers_mixed.push_back({make_weight(4096, 4096, true), make_weight(4096, 4096, true),
                              make_weight(4096, 4096, true), make_weight(4096, 4096, true),
                              make_weight(4096, 11008, true), make_weight(4096, 11008, true),
                              make_weight(11008, 4096, true)});
  // where the mixed-width penalty comes from: 4-bit with a permutation, mixed widths without one
  for (int i = 0; i < kLayers; ++i) {
    g_layers_u4perm.push_back({make_weight(4096, 4096, false, 1), make_weight(4096, 4096, false, 1),
                               make_weight(4096, 4096, false, 1), make_weight(4096, 4096, false, 1),
                               make_weight(4096, 11008, false, 1), make_weight(4096, 11008, false, 1),
                               make_weight(11008, 4096, false, 1)});
    g_layers_mixed_noperm.push_back({make_weight(4096, 4096, true, 0), make_weight(4096, 4096, true, 0),
                                     make_weight(4096, 4096, true, 0), make_weight(4096, 4096, true, 0),
                                     make_weight(4096, 11008, true, 0), make_weight(4096, 11008, true, 0),
                                     make_weight(11008, 4096, true, 0)});
  }

  // a few launches for Nsight Compute, per layer: GPTQ q/k/v, 4-bit q/k/v through the mixed-width path, EXL2-like q/k/v
  if (argc > 1 && std::string(argv[1]) == "ncu") {
    for (int i = 0; i < 3; ++i) {
      Layer& l = g_layers[i];
      Layer& lm = g_layers_mixed[i];
      KsLauncher<8, 4>::go(Op{&l.q, &l.k, &l.v}, g_x4096, 0);
      KsLauncher<8, 4, false>::go(Op{&l.q, &l.k, &l.v}, g_x4096, 0);
      KsLauncher<8, 4, false>::go(Op{&lm.q, &lm.k, &lm.v}, g_x4096, 0);
    }
    CK(cudaDeviceSynchronize());
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "h2") return h2_run();
  if (argc > 1 && std::string(argv[1]) == "ring") return ring_run();
  if (argc > 1 && std::string(argv[1]) == "stream") {   // the one-wave GEMV against the extension's, same run
    check_row<StLauncher<8, 8, true>>();
    check_row<StLauncher<0, 8, true>>();
    check_row<StLauncher<12, 4, true>>();
    {                                             // several weights a launch: a block's tiles cross matrices
      Layer& l = g_layers[1];
      const double eq = max_rel_err<StLauncher<8, 8, true>>(Op{&l.q, &l.k, &l.v}, g_x4096);
      const double eg = max_rel_err<StLauncher<8, 8, true>>(Op{&l.gate, &l.up}, g_x4096);
      printf("stream pre8 r8 early: err q/k/v %.2e  gate/up %.2e\n", eq, eg);
      printf("JSON {\"check\": \"stream multi\", \"err_qkv\": %.3e, \"err_gu\": %.3e}\n", eq, eg);
      if (!(eq < 1e-2 && eg < 1e-2)) {
        printf("FAILED: stream multi-weight disagrees with the fp32 reference\n");
        return 2;
      }
    }
    check_row<StLauncher<8, 8, true, 2>>();
    for (int round = 0; round < 2; ++round) {
      layer_row<ReadLauncher, ReadLauncher, ReadLauncher, ReadLauncher>("read floor");
      layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<16, 8>>("GPTQ as the extension");
      using S = StLauncher<8, 8, true>;
      layer_row<S, S, S, S>("stream pre8 r8 early");
      using S0 = StLauncher<0, 8, true>;
      layer_row<S0, S0, S0, S0>("stream pre0 r8 early");
      using SL = StLauncher<8, 8, false>;
      layer_row<SL, SL, SL, SL>("stream pre8 r8 late");
      using S12 = StLauncher<12, 4, true>;
      layer_row<S12, S12, S12, S12>("stream pre12 r4 early");
      using S2 = StLauncher<8, 8, true, 2>;
      layer_row<S2, S2, S2, S2>("stream pre8 r8 early 2/SM");
      using S2L = StLauncher<8, 8, false, 2>;
      layer_row<S2L, S2L, S2L, S2L>("stream pre8 r8 late 2/SM");
      // the extension's kernels where one wave would leave SMs idle or imbalanced (o, down: 128 tiles)
      layer_row<S, KsLauncher<16, 4>, S, KsLauncher<16, 8>>("stream q/k/v, gate/up; kslice o, down");
    }
    return 0;
  }
  check_row<KsLauncher<16, 8>>();
  check_row<KsLauncher<8, 4>>();
  check_row<KsLauncher<16, 4, false>>(g_layers_mixed);
  check_row<KsLauncher<8, 4, false>>(g_layers_mixed);
  check_row<KsLauncher<8, 8, false>>(g_layers_mixed);
  check_row<KsLauncher<16, 4, false, 2, true>>(g_layers_mixed);
  check_row<KsLauncher<16, 8, true, 2, true>>(g_layers_u4perm);
  check_row<KsLauncher<16, 4, false>>(g_layers);
  check_row<SkLauncher<true>>();
  check_row<SkLauncher<false>>(g_layers_mixed);
  layer_row<ReadLauncher, ReadLauncher, ReadLauncher, ReadLauncher>("read floor");
  layer_row<KsLauncher<8, 8>, KsLauncher<16, 8>, KsLauncher<8, 8>, KsLauncher<16, 8>>("kslice r8 (k8 k16 k8 k16)");
  layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<16, 4>>("kslice r4 (k8 k16 k8 k16)");
  auto mixed = [](const char* name, std::vector<Layer>& layers, auto ring, auto sg) {
    constexpr int R = decltype(ring)::value;
    constexpr bool SG = decltype(sg)::value;
    using A = KsLauncher<8, R, false, 2, SG>;
    using B = KsLauncher<16, R, false, 2, SG>;
    layer_row<A, B, A, B>(name, layers);
  };
  using R4 = std::integral_constant<int, 4>;
  using R8 = std::integral_constant<int, 8>;
  using Y = std::true_type;
  using N = std::false_type;
  mixed("4-bit via the mixed path r4", g_layers, R4{}, N{});
  mixed("mixed, no perm r4", g_layers_mixed_noperm, R4{}, N{});
  mixed("mixed r4 (EXL2-like)", g_layers_mixed, R4{}, N{});
  mixed("mixed r4 sg", g_layers_mixed, R4{}, Y{});
  mixed("mixed r8 sg", g_layers_mixed, R8{}, Y{});
  // the extension's kernels at M = 1 (its down adds the SwiGLU, not modelled here): GPTQ ring 4 but the down
  // projection (the fused instance keeps ring 8), gate/up on kslice; EXL2 gate/up on qgemm_skinny
  layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<16, 8>>("GPTQ as the extension");
  // where the chain loses against its read floor (stop 33: the step's projections at ~2.2 TB/s against 3.2 for plain
  // reads): that chain with one stage at a time replaced by the read of its bytes
  layer_row<ReadLauncher, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<16, 8>>("GPTQ ext, q/k/v read only");
  layer_row<KsLauncher<8, 4>, ReadLauncher, KsLauncher<8, 4>, KsLauncher<16, 8>>("GPTQ ext, o read only");
  layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, ReadLauncher, KsLauncher<16, 8>>("GPTQ ext, gate/up read only");
  layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, ReadLauncher>("GPTQ ext, down read only");
  {
    using A = KsLauncher<8, 4, false, 2, true>;
    using B = KsLauncher<16, 4, false, 2, true>;
    layer_row<A, B, SkLauncher<false>, B>("EXL2-like as the extension (gu skinny)", g_layers_mixed);
  }
  layer_row<KsLauncher<8, 8>, KsLauncher<16, 8>, KsLauncher<8, 8>, KsLauncher<16, 8>>("4-bit + perm, U4 r8", g_layers_u4perm);
  {
    using A = KsLauncher<8, 8, true, 2, true>;
    using B = KsLauncher<16, 8, true, 2, true>;
    layer_row<A, B, A, B>("4-bit + perm, U4 r8 sg", g_layers_u4perm);
  }
  return 0;
}
