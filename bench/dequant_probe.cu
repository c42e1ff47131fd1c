// Probe for the prompt path's dequantise (packed weight -> fp16 W [K, N] for cuBLAS): the extension's kernel
// (exl_core/csrc/cuda/dequant_kernel.cuh, no torch headers) built with plain nvcc, launched with programmatic dependent
// launch as the extension launches it, over four Llama-2-7B-shaped decoder layers of distinct weights in one CUDA graph.
// Three schedules of a layer's dequantise launches (see `plan`): one weight (or 4096-column slice) per launch, as
// the extension did; q|k|v and gate|up side by side in one launch each; everything in two launches before the GEMMs.
// Each is timed alone and, with -DWITH_CUBLAS (-lcublas), followed by its GEMMs on 2048 rows of x (cublasGemmEx, fp32
// accumulate), against the GEMMs alone. Formats: GPTQ 4-bit g128 (the bench's: no act-order) and the bench's EXL2
// widths (5/4/3-bit segments) with a random act-order. Every part of the first layer is checked bit for bit against a
// host computation of the kernel's formula (fp32 fma, one rounding to fp16).
//   nvcc -O3 -arch=sm_90 -o /tmp/dequant_probe bench/dequant_probe.cu [-DWITH_CUBLAS -lcublas] && /tmp/dequant_probe [check]
// (bench/gpu.sh phase `dequant`.)  bench/results/dequant_probe_h200.json has the runs.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../exl_core/csrc/cuda/dequant_kernel.cuh"   // the extension's kernels (no torch headers)
#include "probe_common.cuh"

using namespace exl_dequant;

using DW = PackedDev;                // one packed weight (probe_common.cuh)

#ifndef DEQUANT_SCHEDULES
#define DEQUANT_SCHEDULES 2          // -DDEQUANT_SCHEDULES=1: the per-weight schedule only (the extension's)
#endif
#ifndef DEQUANT_OVERLAP
#define DEQUANT_OVERLAP 1            // -DDEQUANT_OVERLAP=0: no side-stream overlap rows
#endif

// One dequantise launch: columns [col0, col0 + N) of each of its weights, side by side in W (row stride ldw).
struct Part {
  DW* w;
  int col0, N;
};
struct Launch {
  std::vector<Part> parts;
  __half* W;
  int ldw() const {
    int n = 0;
    for (const auto& p : parts) n += p.N;
    return ldw_override ? ldw_override : n;
  }
  int ldw_override = 0;           // W wider than these parts (all-first: every K = 4096 weight in one W)
  int w_col0 = 0;                 // the first part's column in W
};

// Timing control: the dequantise's stores without its loads or math (the same threads, rows -- through perm -- and
// 16-byte stores as dequant_kernel<T, 8>; garbage values).  A variant writing one contiguous 32 KB piece per block
// timed the same after the GEMMs (bench/results/dequant_probe_h200.json): the row pattern is not the cost.
__global__ void store_only_kernel(const __grid_constant__ DequantMats mats) {
  const DequantMat& m = mats.m[blockIdx.z];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  if (col >= m.N) return;
  const int64_t c = blockIdx.y;
  const uint4 v = make_uint4(static_cast<uint32_t>(c), static_cast<uint32_t>(col), 0u, 0u);
  __half* W = static_cast<__half*>(m.W);
#pragma unroll 4
  for (int i = 0; i < 32; ++i) {
    const int64_t row = m.perm ? m.perm[c * 32 + i] : c * 32 + i;
    *reinterpret_cast<uint4*>(W + row * mats.ldw + col) = v;
  }
}

// What a dequantise slot of a schedule runs: the kernels, the stores alone (store_only_kernel), or a memset of W.
// (A warp-per-8-rows kernel, dequant_rows8_kernel in `git show e060c29:exl_core/csrc/cuda/dequant_kernel.cuh`, lost
// alone and after the GEMMs: bench/results/dequant_probe_h200.json.)
enum Kind { kV8 = 0, kStoresOnly, kMemset };
const char* kind_name[] = {"dequant_kernel<half, 8>", "stores only", "memset"};
const char* kind_key[] = {"v8", "stores_only", "memset"};

size_t g_dq_window = 0;           // mode l2: the persisting L2 set-aside, when the dequantise launches get a window

void launch(const Launch& l, cudaStream_t st, int kind) {
  DequantMats mats{};
  mats.n = static_cast<int>(l.parts.size());
  mats.ldw = l.ldw();
  int64_t max_n = 0, col = l.w_col0, elems = 0;
  for (int i = 0; i < mats.n; ++i) {
    const Part& p = l.parts[i];
    DequantMat& m = mats.m[i];
    m.chunks = p.w->chunks;
    m.qweight = p.w->qw + p.col0;
    m.scale = p.w->s + p.col0;
    m.zero = p.w->z + p.col0;
    m.perm = p.w->perm;
    m.twin = p.w->twin;
    m.W = l.W + col;
    m.ldq = p.w->ldq;
    m.N = p.N;
    col += p.N;
    max_n = std::max<int64_t>(max_n, p.N);
    elems += static_cast<int64_t>(p.w->K) * p.N;
  }
  if (kind == kMemset) {
    CK(cudaMemsetAsync(l.W + l.w_col0, 0, elems * 2, st));
    return;
  }
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = pdl_config(dim3(static_cast<unsigned>((max_n + 511) / 512), l.parts[0].w->K / 32,
                                           mats.n), dim3(64), 0, st, attr);
  cudaLaunchAttribute attrs[2];
  if (g_dq_window > 0) {     // mode l2: this launch's W persisting in L2 (the set-aside over W's bytes as hitRatio)
    attrs[0] = attr[0];
    attrs[1].id = cudaLaunchAttributeAccessPolicyWindow;
    cudaAccessPolicyWindow& w = attrs[1].val.accessPolicyWindow;
    w.base_ptr = l.W + l.w_col0;
    w.num_bytes = static_cast<size_t>(l.parts[0].w->K) * l.ldw() * 2;
    w.hitRatio = std::min(1.f, static_cast<float>(g_dq_window) / w.num_bytes);
    w.hitProp = cudaAccessPropertyPersisting;
    w.missProp = cudaAccessPropertyNormal;
    cfg.attrs = attrs;
    cfg.numAttrs = 2;
  }
  void (*kern)(DequantMats) = kind != kV8 ? store_only_kernel
                              : l.parts[0].w->twin ? dequant_kernel<__half, 8, kTwin4> : dequant_kernel<__half, 8>;
  CK(cudaLaunchKernelEx(&cfg, kern, mats));
}

// A GEMM of the prompt: y (row stride ldy, from column y_col) = x[:, :K] (2048 rows) times N columns of W from w_col.
struct Gemm {
  int K, N;
  const __half* W;
  int ldw, w_col;
  int y_col, ldy;
};

struct Layer {
  Layer() = default;
  Layer(const Layer&) = delete;
  DW m[7];                        // q, k, v, o, gate, up, down
};

// In place: launches point at L.m, so a Layer is never copied or moved after this.
void fill_layer(Layer& L, bool mixed, bool act_order, bool keep_host, int twin_every) {
  for (int i = 0; i < 4; ++i) L.m[i] = make_packed(4096, 4096, mixed, act_order, keep_host, twin_every);
  for (int i = 4; i < 6; ++i) L.m[i] = make_packed(4096, 11008, mixed, act_order, keep_host, twin_every);
  L.m[6] = make_packed(11008, 4096, mixed, act_order, keep_host, twin_every);
}

// The three schedules of a layer's dequantise launches and GEMMs:
//   per weight: 11 x (dequantise one weight or 4096-column slice into one scratch, GEMM) -- the extension today;
//   grouped:    q|k|v, o, gate|up, down: each group dequantised side by side in one launch, then one GEMM;
//   all first:  the six K = 4096 weights in one launch, down in a second, then the four grouped GEMMs.
enum Sched { kPerWeight = 0, kGrouped = 1, kAllFirst = 2 };
const char* sched_name[] = {"per_weight", "grouped", "all_first"};

struct Plan {
  std::vector<Launch> dq;
  std::vector<Gemm> gemm;
  std::vector<std::pair<int, int>> order;   // (0 = dequantise / 1 = GEMM, index)
};

Plan plan(Layer& L, Sched s, __half* W, __half* W2, int slice = 4096, int slice_down = 4096) {
  Plan p;
  auto dq = [&](std::vector<Part> parts, __half* w, int ldw = 0, int w_col0 = 0) {
    Launch l;
    l.parts = std::move(parts);
    l.W = w;
    l.ldw_override = ldw;
    l.w_col0 = w_col0;
    p.dq.push_back(l);
    p.order.push_back({0, static_cast<int>(p.dq.size()) - 1});
  };
  auto gemm = [&](int K, int N, const __half* w, int ldw, int w_col, int y_col, int ldy) {
    p.gemm.push_back({K, N, w, ldw, w_col, y_col, ldy});
    p.order.push_back({1, static_cast<int>(p.gemm.size()) - 1});
  };
  if (s == kPerWeight) {        // slices of `slice` columns (the extension: 4096, gate/up 4096 + 4096 + 2816)
    for (int i = 0; i < 7; ++i) {
      const int K = L.m[i].K, N = L.m[i].ldq, sl = i == 6 ? slice_down : slice;
      for (int c0 = 0; c0 < N; c0 += sl) {
        const int n = std::min(sl, N - c0);
        dq({{&L.m[i], c0, n}}, W), gemm(K, n, W, n, 0, c0, N);
      }
    }
  } else if (s == kGrouped) {
    dq({{&L.m[0], 0, 4096}, {&L.m[1], 0, 4096}, {&L.m[2], 0, 4096}}, W), gemm(4096, 12288, W, 12288, 0, 0, 12288);
    dq({{&L.m[3], 0, 4096}}, W), gemm(4096, 4096, W, 4096, 0, 0, 4096);
    dq({{&L.m[4], 0, 11008}, {&L.m[5], 0, 11008}}, W), gemm(4096, 22016, W, 22016, 0, 0, 22016);
    dq({{&L.m[6], 0, 4096}}, W), gemm(11008, 4096, W, 4096, 0, 0, 4096);
  } else {
    const int ld = 3 * 4096 + 4096 + 2 * 11008;
    dq({{&L.m[0], 0, 4096}, {&L.m[1], 0, 4096}, {&L.m[2], 0, 4096}, {&L.m[3], 0, 4096}, {&L.m[4], 0, 11008},
        {&L.m[5], 0, 11008}}, W, ld);
    dq({{&L.m[6], 0, 4096}}, W2);
    gemm(4096, 12288, W, ld, 0, 0, 12288);
    gemm(4096, 4096, W, ld, 12288, 0, 4096);
    gemm(4096, 22016, W, ld, 16384, 0, 22016);
    gemm(11008, 4096, W2, 4096, 0, 0, 4096);
  }
  return p;
}

int64_t dq_bytes(const Plan& p) {   // read (words, scale, zero of the parts) + write
  int64_t b = 0;
  for (const auto& l : p.dq)
    for (const auto& q : l.parts) b += q.w->bytes * q.N / q.w->ldq + static_cast<int64_t>(q.w->K) * q.N * 2;
  return b;
}

// Host reference of one part: the kernels' formula (fp32 fma of q, s and -z s, one rounding to fp16).
bool check(const Part& pt, const __half* Wcol, int ldw) {
  const DW& w = *pt.w;
  std::vector<__half> got(static_cast<size_t>(w.K) * ldw);
  CK(cudaMemcpy(got.data(), Wcol, (static_cast<size_t>(w.K - 1) * ldw + pt.N) * 2, cudaMemcpyDeviceToHost));
  for (int c = 0; c < w.K / 32; ++c) {
    const int bits = w.hch[3 * c], g = w.hch[3 * c + 1], qrow = w.hch[3 * c + 2];
    for (int n = 0; n < pt.N; ++n) {
      const int col = pt.col0 + n;
      const float s = w.hs[static_cast<size_t>(g) * w.ldq + col], zs = w.hz[static_cast<size_t>(g) * w.ldq + col] * s;
      for (int j = 0; j < 32; ++j) {
        const int pos = j * bits, wi = pos >> 5, off = pos & 31;
        uint64_t win = static_cast<uint32_t>(w.hq[static_cast<size_t>(qrow + wi) * w.ldq + col]);
        if (off + bits > 32) win |= static_cast<uint64_t>(static_cast<uint32_t>(
                                        w.hq[static_cast<size_t>(qrow + wi + 1) * w.ldq + col])) << 32;
        const uint32_t q = static_cast<uint32_t>((win >> off) & ((1u << bits) - 1u));
        const int64_t k = 32 * c + j, row = w.hperm.empty() ? k : w.hperm[k];
        const __half want = __float2half_rn(std::fmaf(static_cast<float>(q), s, -zs));
        const __half have = got[static_cast<size_t>(row) * ldw + n];
        if (memcmp(&want, &have, 2) != 0) {
          printf("MISMATCH K %d ldq %d col %d k %lld: %f vs %f\n", w.K, w.ldq, col, (long long)k,
                 __half2float(want), __half2float(have));
          return false;
        }
      }
    }
  }
  return true;
}


// The L2 experiment (mode `l2`): every kernel node of a captured graph gets an access-policy window over the
// dequantise's scratch W, its lines persisting in L2 (hitRatio: the persisting set-aside over the window's bytes), so
// that a GEMM reads the W its dequantise just wrote from L2 and the next dequantise overwrites it there.
cudaAccessPolicyWindow g_win{};
void window_on_kernels(cudaGraph_t graph) {
  size_t n = 0;
  CK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CK(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (auto node : nodes) {
    cudaGraphNodeType t;
    CK(cudaGraphNodeGetType(node, &t));
    if (t != cudaGraphNodeTypeKernel) continue;
    cudaKernelNodeAttrValue v{};
    v.accessPolicyWindow = g_win;
    CK(cudaGraphKernelNodeSetAttribute(node, cudaKernelNodeAttributeAccessPolicyWindow, &v));
  }
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);   // a crash keeps what was printed
  const bool check_only = argc > 1 && strcmp(argv[1], "check") == 0;   // the bit-for-bit checks, no timings
  const bool l2_mode = argc > 1 && strcmp(argv[1], "l2") == 0;         // the L2 window rows only (needs cuBLAS)
  srand(1234);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  {
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, dequant_kernel<__half, 8>));
    printf("dequant_kernel<half, 8>: %d registers, %zu B local\n", a.numRegs, a.localSizeBytes);
  }
  const size_t w_max = static_cast<size_t>(4096) * (3 * 4096 + 4096 + 2 * 11008);   // all first: 315 MB
  __half *W, *W2, *W3;             // W3: the overlap's second scratch
  CK(cudaMalloc(&W, w_max * 2));
  CK(cudaMalloc(&W3, static_cast<size_t>(11008) * 4096 * 2));
  CK(cudaMalloc(&W2, static_cast<size_t>(11008) * 4096 * 2));
  {
    const size_t n = static_cast<size_t>(11008) * 4096;
    const float cus = time_seq([&](cudaStream_t st) { CK(cudaMemcpyAsync(W2, W, n * 2, cudaMemcpyDeviceToDevice, st)); });
    printf("copy: %.2f us for %zu MB, %.1f GB/s read+write\n", cus, n * 2 >> 20, 2.0 * n * 2 / cus / 1e3);
    printf("JSON {\"row\": \"copy\", \"us\": %.3f, \"gb_s_rw\": %.1f}\n", cus, 2.0 * n * 2 / cus / 1e3);
  }
  const int n_layers = 4;
  // u4_ao: GPTQ-like 4-bit with a random act-order (the rows scattered); u4_twin: that plus a twin for 1 chunk in 16
  // (EXL2 rewritten as uniform 4-bit rows: the bench's 5-bit rows, 256 of 4,096, have their high halves in twins)
  struct Fmt { const char* name; bool mixed, act_order; int twin_every; };
  const Fmt fmts[] = {{"gptq", false, false, 0}, {"u4_ao", false, true, 0}, {"u4_twin", false, true, 16},
                      {"exl2", true, true, 0}};
  printf("L2 %d B, persisting max %d B, access-policy window max %d B\n", prop.l2CacheSize,
         prop.persistingL2CacheMaxSize, prop.accessPolicyMaxWindowSize);

#ifdef WITH_CUBLAS
  cublasHandle_t h;
  CB(cublasCreate(&h));
  const int M = 2048;
  __half *x, *y;
  CK(cudaMalloc(&x, static_cast<size_t>(M) * 11008 * 2));
  CK(cudaMalloc(&y, static_cast<size_t>(M) * 22016 * 2));
  {
    std::vector<__half> hx(static_cast<size_t>(M) * 11008);
    for (auto& v : hx) v = __float2half(rand() / static_cast<float>(RAND_MAX) - 0.5f);
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  }
  auto gemm = [&](const Gemm& g, cudaStream_t st) {     // row-major y = x W as cuBLAS's column-major y^T = W^T x^T
    const float one = 1.f, zero = 0.f;
    CB(cublasSetStream(h, st));
    CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, g.N, M, g.K, &one, g.W + g.w_col, CUDA_R_16F, g.ldw, x, CUDA_R_16F,
                    11008, &zero, y + g.y_col, CUDA_R_16F, g.ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
#endif

#ifdef WITH_CUBLAS
  if (l2_mode) {
    CK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, prop.persistingL2CacheMaxSize));
    size_t persist = 0;
    CK(cudaDeviceGetLimit(&persist, cudaLimitPersistingL2CacheSize));
    printf("persisting set-aside %zu B\n", persist);
    for (const Fmt& f : {fmts[0], fmts[2]}) {       // GPTQ, and the rewritten EXL2 (u4 with twins)
      std::vector<Layer> layers(n_layers);
      for (int r = 0; r < n_layers; ++r) fill_layer(layers[r], f.mixed, f.act_order, false, f.twin_every);
      const std::pair<int, int> slicings[] = {{4096, 4096}, {4096, 1536}, {4096, 2048}, {2048, 2048}};
      for (auto [slice, slice_down] : slicings) {
        std::vector<Plan> plans;
        for (auto& L : layers) plans.push_back(plan(L, kPerWeight, W, W2, slice, slice_down));
        auto gemms = [&](cudaStream_t st) { for (auto& p : plans) for (const auto& g : p.gemm) gemm(g, st); };
        auto both = [&](cudaStream_t st) {
          for (auto& p : plans)
            for (auto [k, i] : p.order)
              if (k == 1) gemm(p.gemm[i], st); else launch(p.dq[i], st, kV8);
        };
        std::string row = std::string("{\"row\": \"l2\", \"format\": \"") + f.name + "\", \"slice\": " +
                          std::to_string(slice) + ", \"slice_down\": " + std::to_string(slice_down);
        printf("%-7s slices %4d / down %4d, us a layer:", f.name, slice, slice_down);
        // per round: the GEMMs alone; dequantise + GEMMs without a window; with a window on each dequantise launch
        // (its W); with that window on every kernel node (the GEMMs' too: the whole scratch)
        for (int round = 0; round < 3; ++round) {
          const float g0 = time_seq(gemms) / n_layers, d0 = time_seq(both) / n_layers;
          g_dq_window = persist;
          const float d1 = time_seq(both) / n_layers;
          CK(cudaCtxResetPersistingL2Cache());
          g_win.base_ptr = W;
          g_win.num_bytes = static_cast<size_t>(11008) * std::max(slice, slice_down) * 2;
          g_win.hitRatio = std::min(1.f, static_cast<float>(persist) / g_win.num_bytes);
          g_win.hitProp = cudaAccessPropertyPersisting;
          g_win.missProp = cudaAccessPropertyNormal;
          g_dq_window = 0;
          g_after_capture = window_on_kernels;
          const float d2 = time_seq(both) / n_layers;
          g_after_capture = nullptr;
          CK(cudaCtxResetPersistingL2Cache());
          printf("  [GEMMs %.2f, both %.2f, dq window %.2f, all window %.2f]", g0, d0, d1, d2);
          const std::string r = std::to_string(round);
          row += ", \"gemm_us_" + r + "\": " + std::to_string(g0) + ", \"both_us_" + r + "\": " + std::to_string(d0) +
                 ", \"dqwin_both_us_" + r + "\": " + std::to_string(d1) + ", \"allwin_both_us_" + r + "\": " +
                 std::to_string(d2);
        }
        printf("\n");
        printf("JSON %s}\n", row.c_str());
      }
      for (auto& L : layers)
        for (auto& m : L.m) free_packed(m);
    }
    printf("done\n");
    return 0;
  }
#endif
  for (const Fmt& f : fmts) {
    std::vector<Layer> layers(n_layers);
    for (int r = 0; r < n_layers; ++r) fill_layer(layers[r], f.mixed, f.act_order, r == 0, f.twin_every);
    for (int s = 0; s < DEQUANT_SCHEDULES; ++s) {       // per weight, grouped (all-first lost: bench/results)
      std::vector<Plan> plans;
      for (auto& L : layers) plans.push_back(plan(L, static_cast<Sched>(s), W, W2));
      // bit-for-bit check of every part of the first layer's launches, every dequantise kernel
      bool ok = true;
      for (int kind : {kV8})
        for (const auto& l : plans[0].dq) {
          if (f.twin_every) break;                      // the twins' sums: tests/test_cuda_uniform4.py checks them
          CK(cudaMemset(l.W, 0xFF, (l.W == W ? w_max : static_cast<size_t>(11008) * 4096) * 2));
          launch(l, 0, kind);
          CK(cudaDeviceSynchronize());
          int col = l.w_col0;
          for (const auto& p : l.parts) {
            ok = ok && check(p, l.W + col, l.ldw());
            col += p.N;
          }
        }
      printf("%s %s: check %s\n", f.name, sched_name[s], f.twin_every ? "skipped (twins)" : ok ? "ok" : "FAILED");
      if (!ok) exit(1);
      if (check_only) continue;
      std::string row = std::string("{\"row\": \"schedule\", \"format\": \"") + f.name + "\", \"schedule\": \"" +
                        sched_name[s] + "\"";
      for (int kind : {kV8, kStoresOnly}) {
        const float us = time_seq([&](cudaStream_t st) {
                           for (auto& p : plans)
                             for (const auto& l : p.dq) launch(l, st, kind);
                         }) / n_layers;
        printf("%-5s %-10s %-28s alone %8.2f us a layer (%zu launches, %.1f GB/s)\n", f.name, sched_name[s],
               kind_name[kind], us, plans[0].dq.size(), dq_bytes(plans[0]) / us / 1e3);
        row += std::string(", \"") + kind_key[kind] + "_alone_us\": " + std::to_string(us);
      }
#ifdef WITH_CUBLAS
      // three interleaved rounds: the GEMMs alone, and after each dequantise variant / the stores alone / a memset of
      // the same W bytes (write traffic without loads or math)
      for (int round = 0; round < 3; ++round) {
        const float g_us = time_seq([&](cudaStream_t st) {
                             for (auto& p : plans)
                               for (const auto& g : p.gemm) gemm(g, st);
                           }) / n_layers;
        printf("   round %d: GEMMs alone %8.2f;", round, g_us);
        row += ", \"gemm_us_" + std::to_string(round) + "\": " + std::to_string(g_us);
        for (int kind : {kV8, kStoresOnly, kMemset}) {
          const float us = time_seq([&](cudaStream_t st) {
                             for (auto& p : plans)
                               for (auto [k, i] : p.order)
                                 if (k == 1) gemm(p.gemm[i], st); else launch(p.dq[i], st, kind);
                           }) / n_layers;
          printf(" %s +%.2f", kind_key[kind], us - g_us);
          row += std::string(", \"") + kind_key[kind] + "_gemm_us_" + std::to_string(round) + "\": " + std::to_string(us);
        }
        printf("\n");
      }
      // Overlap (per weight only): the dequantise of the next weight on a side stream into the other of two scratch
      // buffers while this weight's GEMM runs, cuBLAS told to leave `free` SMs to it (cublasSetSmCountTarget).
      if (s == kPerWeight && DEQUANT_OVERLAP) {
        std::vector<std::pair<Launch, Gemm>> seq;
        for (auto& p : plans) {
          int d = 0, g = 0;
          for (auto [k, i] : p.order) (void)i, k == 0 ? ++d : ++g;
          for (int i = 0; i < d; ++i) seq.push_back({p.dq[i], p.gemm[i]});
        }
        const int n = static_cast<int>(seq.size());
        std::vector<cudaEvent_t> dq_done(n), gemm_done(n);
        for (int i = 0; i < n; ++i) {
          CK(cudaEventCreateWithFlags(&dq_done[i], cudaEventDisableTiming));
          CK(cudaEventCreateWithFlags(&gemm_done[i], cudaEventDisableTiming));
        }
        cudaStream_t side;
        CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
        cudaEvent_t fork, join;
        CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
        __half* bufs[2] = {W, W3};
        for (int free : {0, 8, 16, 24}) {
          CB(cublasSetSmCountTarget(h, free ? prop.multiProcessorCount - free : 0));
          const float us = time_seq([&](cudaStream_t st) {
                             CK(cudaEventRecord(fork, st));
                             CK(cudaStreamWaitEvent(side, fork));
                             for (int i = 0; i < n; ++i) {
                               Launch l = seq[i].first;
                               Gemm g = seq[i].second;
                               l.W = bufs[i % 2];
                               g.W = bufs[i % 2];
                               if (i >= 2) CK(cudaStreamWaitEvent(side, gemm_done[i - 2]));
                               launch(l, side, kV8);
                               CK(cudaEventRecord(dq_done[i], side));
                               CK(cudaStreamWaitEvent(st, dq_done[i]));
                               gemm(g, st);
                               CK(cudaEventRecord(gemm_done[i], st));
                             }
                             CK(cudaEventRecord(join, side));
                             CK(cudaStreamWaitEvent(st, join));
                           }) / n_layers;
          printf("   overlap, %2d SMs left to the dequantise: %8.2f us a layer\n", free, us);
          row += ", \"overlap_free" + std::to_string(free) + "_us\": " + std::to_string(us);
        }
        CB(cublasSetSmCountTarget(h, 0));
        const float g_us = time_seq([&](cudaStream_t st) {
                             for (auto& p : plans)
                               for (const auto& g : p.gemm) gemm(g, st);
                           }) / n_layers;
        printf("   GEMMs alone again %8.2f\n", g_us);
        for (int i = 0; i < n; ++i) {
          CK(cudaEventDestroy(dq_done[i]));
          CK(cudaEventDestroy(gemm_done[i]));
        }
        CK(cudaStreamDestroy(side));
      }
#endif
      printf("JSON %s}\n", row.c_str());
    }
    for (auto& L : layers)
      for (auto& m : L.m) free_packed(m);
  }
  printf("done\n");
  return 0;
}
