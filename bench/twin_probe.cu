// Probe for the prompt dequantise of EXL2 weights rewritten as uniform 4-bit rows (exl_core/formats/uniform4.py): a
// 5..8-bit row is a 4-bit row plus a "twin" row of high halves in an extra chunk after all K rows, reading the same x
// column.  A prompt whose GEMMs run over K (GPTQ's cost) needs W's K rows with each twin's values added in.  Stop 33
// lost that in the dequantise (csrc/cuda/NOTES.md, session "fourteenth": 202.24 / 167.73 us a 7B layer against
// 143.24 without twins); stop 34 kept it (session "fifteenth") with `loop` below as the extension's kTwin4 instance
// (153.36-154.01 us alone once its words were read before the PDL wait, against 131.06-132.26 for `plain`).  Variants
// here, each the 11 per-weight launches of a 7B layer (gate/up in 4096-column slices), alone and with -DWITH_CUBLAS
// each launch followed by its GEMM on 2048 rows of x (the prompt's order), four layers of distinct weights in one
// graph:
//   plain      the extension's dequant_kernel<half, 8> over the K rows, twins ignored (the floor to reach)
//   plain4     the same loop in the extension's 4-bit-only instance, dequant_kernel<half, 8, kUniform4>, twins
//              ignored (slower alone than plain, 173.66-178.18 us, yet ahead of it after the GEMMs in every round
//              of stop 34 calls 5 and 7)
//   loop       every chunk adds its twin in the same loop, zero words where none: the extension's
//              dequant_kernel<half, 8, kTwin4>
//   rmw        the plain loop for every chunk, then a twinned chunk's thread reads back the 32 rows it stored, adds
//              the twin's values (one word row = 8 rows at a time, 8 loads in flight) and stores them again
//   rmw_first  rmw with the twinned chunks first in launch order (their longer blocks start in the first wave)
//   sep        plain, then a second launch over the twinned chunks only doing rmw's pass
//   split      a launch of loop's kernel over the twinned chunks only, then the plain loop over the others (each
//              launch one hot loop, no read-back, one rounding)
//   plain4_o9  plain4 held to the width switch's 9 blocks an SM by dynamic shared memory: whether plain4's lead
//              after the GEMMs is its occupancy (70 registers against 110) or its code
//   loop_lazy  loop with the twin's words loaded one word row at a time inside the loop and one merged offset:
//              fewer registers than loop's 121 (ptxas), the twin's loads after the wait
// Each variant of the first layer is checked against the host formula within 2^-11 of |main| + |sum| (rmw and sep
// round the main value first, loop once).  Five rounds after the GEMMs (three in every stop 34 call).  Stop 35 call 1
// (bench/results/twin_probe_rows_h200_stop35_call1_2960967.jsonl): loop_lazy alone 176.95 us against loop's 153.01
// and no better with the GEMMs (not ported); plain4_o9 stayed ahead of loop in 4 of 5 rounds with the GEMMs, so
// plain4's lead is not only its occupancy (csrc/cuda/NOTES.md, session "sixteenth").
//   nvcc -O3 -arch=sm_90 [-DWITH_CUBLAS -lcublas] -o /tmp/twin_probe bench/twin_probe.cu && /tmp/twin_probe
// (bench/gpu.sh phase `twin`.)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../exl_core/csrc/cuda/dequant_kernel.cuh"   // the extension's kernel and helpers (no torch headers)
#include "probe_common.cuh"

using namespace exl_dequant;

constexpr int kTwinEvery = 16;       // the bench's EXL2 rewrite: 256 twinned rows of 4,096

// A 4-bit act-order weight with twins: PackedDev (main chunks 0..C-1, extra chunks C.. in the chunk table) plus the
// twin table (per main chunk: its twin's chunk-table row or -1), the twinned chunks' list, and a launch order with
// them first.
struct TwinW {
  PackedDev w;
  int* twin = nullptr;
  int* twinned = nullptr;           // main chunks with a twin
  int* order = nullptr;             // twinned chunks first
  int n_twinned = 0;
  std::vector<int> htwin;
};

TwinW make_twin(int K, int ldq, bool keep_host) {
  TwinW t;
  const int C = K / 32;
  // the main rows' words and groups, then the twins' words appended: one make_packed over K + extra rows, its chunk
  // table's extra entries repointed at their main chunk's group (a twin shares its row's group)
  const int extra = (C + kTwinEvery - 1) / kTwinEvery;
  t.w = make_packed(32 * (C + extra), ldq, false, false, keep_host);   // 4 word rows a chunk; scale rows to spare
  t.w.K = K;
  std::vector<int> ch(static_cast<size_t>(C + extra) * 3), tw(C, -1), twinned, order;
  for (int c = 0; c < C; ++c) ch[3 * c] = 4, ch[3 * c + 1] = c / 4, ch[3 * c + 2] = 4 * c;
  for (int e = 0; e < extra; ++e) {
    const int c = e * kTwinEvery, row = C + e;
    ch[3 * row] = 4, ch[3 * row + 1] = c / 4, ch[3 * row + 2] = 4 * row;
    tw[c] = row;
    twinned.push_back(c);
  }
  order = twinned;
  for (int c = 0; c < C; ++c)
    if (tw[c] < 0) order.push_back(c);
  CK(cudaMemcpy(t.w.chunks, ch.data(), ch.size() * 4, cudaMemcpyHostToDevice));
  t.w.perm = random_perm(K);
  auto up = [](const std::vector<int>& v) {
    int* d;
    CK(cudaMalloc(&d, v.size() * 4));
    CK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
  };
  t.twin = up(tw), t.twinned = up(twinned), t.order = up(order);
  t.n_twinned = static_cast<int>(twinned.size());
  if (keep_host) {
    t.w.hch = ch, t.htwin = tw;
    t.w.hperm.resize(K);
    CK(cudaMemcpy(t.w.hperm.data(), t.w.perm, static_cast<size_t>(K) * 8, cudaMemcpyDeviceToHost));
  }
  return t;
}

// One launch: columns [col0, col0 + N) of one weight into W (row stride N).
struct Slice {
  const TwinW* t;
  int col0, N;
  __half* W;
};
struct Args {
  const int32_t *chunks, *qweight;
  const float *scale, *zero;
  const int64_t* perm;
  const int *twin, *twinned, *order;
  __half* W;
  int64_t ldq, N;
  int n_twinned;
};

Args args_of(const Slice& s) {
  const PackedDev& w = s.t->w;
  return Args{w.chunks, w.qw + s.col0, w.s + s.col0, w.z + s.col0, w.perm, s.t->twin, s.t->twinned, s.t->order,
              s.W, w.ldq, s.N, s.t->n_twinned};
}

// A 4-bit chunk's 4 word rows of 8 columns (two 16-byte loads each); q null: zeros.
__device__ __forceinline__ void load_words(const int32_t* q, int64_t ldq, uint32_t (&w)[4][8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int4 v = q ? __ldg(reinterpret_cast<const int4*>(q + j * ldq + 4 * h)) : make_int4(0, 0, 0, 0);
      w[j][4 * h] = v.x, w[j][4 * h + 1] = v.y, w[j][4 * h + 2] = v.z, w[j][4 * h + 3] = v.w;
    }
}

// rmw's pass: the thread's 32 stored rows of chunk c (8 columns from col) read back, twin chunk tc's values added.
__device__ __forceinline__ void add_twin(const Args& a, int64_t c, int tc, int64_t col, bool waited) {
  float s[8], zs[8];
  group_scale_zero<8>(a.scale, a.zero, a.chunks[tc * 3 + 1], a.ldq, col, s, zs);
  const int32_t* tq = a.qweight + static_cast<int64_t>(a.chunks[tc * 3 + 2]) * a.ldq + col;
  uint32_t tw[4][8];
  load_words(tq, a.ldq, tw);
  if (!waited) {
    exl_pdl::pdl_wait();
    exl_pdl::pdl_trigger();
  }
  __half* Wc = a.W + col;
#pragma unroll 1
  for (int j = 0; j < 4; ++j) {                 // one word row: 8 rows, their loads in flight together
    int64_t rows[8];
    uint4 old[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) rows[r] = a.perm[c * 32 + 8 * j + r];
#pragma unroll
    for (int r = 0; r < 8; ++r) old[r] = *reinterpret_cast<const uint4*>(Wc + rows[r] * a.N);
    uint32_t w8[8];
#pragma unroll
    for (int v = 0; v < 8; ++v) w8[v] = j == 0 ? tw[0][v] : j == 1 ? tw[1][v] : j == 2 ? tw[2][v] : tw[3][v];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const __half* o = reinterpret_cast<const __half*>(&old[r]);
      float f[8];
#pragma unroll
      for (int v = 0; v < 8; ++v) f[v] = __half2float(o[v]) + fmaf(q_to_f((w8[v] >> (4 * r)) & 15u), s[v], -zs[v]);
      *reinterpret_cast<uint4*>(Wc + rows[r] * a.N) =
          make_uint4(pack2<__half>(f[0], f[1]), pack2<__half>(f[2], f[3]), pack2<__half>(f[4], f[5]),
                     pack2<__half>(f[6], f[7]));
    }
  }
}

// The thread's first of 8 columns; false past N, after the PDL wait (every block waits: completion stays transitive).
__device__ __forceinline__ bool column_of(int64_t N, int64_t& col) {
  col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (col < N) return true;
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
  return false;
}

// Which chunk block row y takes: y (kAll), a.order[y] (kFirst: twinned chunks first), the y-th chunk without a twin
// (kRest, grid K / 32 - n_twinned), the y-th twinned chunk (kTwinned, grid n_twinned).
enum Sel { kAll = 0, kFirst, kRest, kTwinned };
template <int SEL>
__device__ __forceinline__ int64_t chunk_of(const Args& a) {
  const int y = blockIdx.y;
  return SEL == kFirst ? a.order[y] : SEL == kRest ? a.order[a.n_twinned + y] : SEL == kTwinned ? a.twinned[y] : y;
}

// grid (N / 512, chunks of SEL), 64 threads of 8 columns: the plain 4-bit loop, then (RMW) a twinned chunk's pass.
template <int SEL, bool RMW>
__global__ void rmw_kernel(const __grid_constant__ Args a) {
  int64_t col;
  if (!column_of(a.N, col)) return;
  const int64_t c = chunk_of<SEL>(a);
  float s[8], zs[8];
  group_scale_zero<8>(a.scale, a.zero, a.chunks[c * 3 + 1], a.ldq, col, s, zs);
  dequant_chunk<__half, 4, 8>(a.qweight + static_cast<int64_t>(a.chunks[c * 3 + 2]) * a.ldq + col, a.ldq, a.N, s, zs,
                              a.perm, c * 32, a.W + col);
  const int tc = a.twin[c];
  if (RMW && tc >= 0) add_twin(a, c, tc, col, true);
}

// sep's second launch: grid (N / 512, twinned chunks).
__global__ void twin_add_kernel(const __grid_constant__ Args a) {
  int64_t col;
  if (!column_of(a.N, col)) return;
  const int c = a.twinned[blockIdx.y];
  add_twin(a, c, a.twin[c], col, false);
}

// A chunk's scale and offset and its twin's (zeros where it has none); its words' and its twin's first word (null:
// no twin), for the thread's 8 columns from col.
struct ChunkTwin {
  float s[8], zs[8], ts[8], tzs[8];
  const int32_t *qw, *tq;
};
__device__ __forceinline__ ChunkTwin chunk_twin(const Args& a, int64_t c, int64_t col) {
  ChunkTwin r;
  const int tc = a.twin[c];
  group_scale_zero<8>(a.scale, a.zero, a.chunks[c * 3 + 1], a.ldq, col, r.s, r.zs);
  if (tc >= 0) {
    group_scale_zero<8>(a.scale, a.zero, a.chunks[tc * 3 + 1], a.ldq, col, r.ts, r.tzs);
  } else {
#pragma unroll
    for (int v = 0; v < 8; ++v) r.ts[v] = r.tzs[v] = 0.f;
  }
  r.qw = a.qweight + static_cast<int64_t>(a.chunks[c * 3 + 2]) * a.ldq + col;
  r.tq = tc >= 0 ? a.qweight + static_cast<int64_t>(a.chunks[tc * 3 + 2]) * a.ldq + col : nullptr;
  return r;
}

// split's twinned launch: every chunk's loop adds a twin (a copy of the extension's kTwin4 loop, the chunks of
// SEL).
template <int SEL>
__global__ void loop_kernel(const __grid_constant__ Args a) {
  int64_t col;
  if (!column_of(a.N, col)) return;
  const int64_t c = chunk_of<SEL>(a);
  const ChunkTwin t = chunk_twin(a, c, col);
  uint32_t w[4][8], w2[4][8];
  load_words(t.qw, a.ldq, w);
  load_words(t.tq, a.ldq, w2);
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    float f[8];
#pragma unroll
    for (int v = 0; v < 8; ++v)
      f[v] = chunk_value<4, 8>(w, i, v, t.s[v], t.zs[v]) + chunk_value<4, 8>(w2, i, v, t.ts[v], t.tzs[v]);
    *reinterpret_cast<uint4*>(a.W + col + a.perm[c * 32 + i] * a.N) =
        make_uint4(pack2<__half>(f[0], f[1]), pack2<__half>(f[2], f[3]), pack2<__half>(f[4], f[5]),
                   pack2<__half>(f[6], f[7]));
  }
}

// loop_lazy: loop with the twin's words loaded a word row (8 rows' worth) at a time inside the loop, after the wait,
// and the two offsets merged: fewer live registers (ptxas), the twin's loads exposed in twinned blocks only.
__global__ void lazy_kernel(const __grid_constant__ Args a) {
  int64_t col;
  if (!column_of(a.N, col)) return;
  const int64_t c = blockIdx.y;
  ChunkTwin t = chunk_twin(a, c, col);
#pragma unroll
  for (int v = 0; v < 8; ++v) t.zs[v] += t.tzs[v];       // one offset: q s + t ts - (z s + tz ts)
  uint32_t w[4][8];
  load_words(t.qw, a.ldq, w);
  exl_pdl::pdl_wait();
  exl_pdl::pdl_trigger();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t t8[8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int4 v = t.tq ? __ldg(reinterpret_cast<const int4*>(t.tq + j * a.ldq + 4 * h)) : make_int4(0, 0, 0, 0);
      t8[4 * h] = v.x, t8[4 * h + 1] = v.y, t8[4 * h + 2] = v.z, t8[4 * h + 3] = v.w;
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int i = 8 * j + r;
      float f[8];
#pragma unroll
      for (int v = 0; v < 8; ++v)
        f[v] = fmaf(q_to_f((w[j][v] >> (4 * r)) & 15u), t.s[v],
                    fmaf(q_to_f((t8[v] >> (4 * r)) & 15u), t.ts[v], -t.zs[v]));
      *reinterpret_cast<uint4*>(a.W + col + a.perm[c * 32 + i] * a.N) =
          make_uint4(pack2<__half>(f[0], f[1]), pack2<__half>(f[2], f[3]), pack2<__half>(f[4], f[5]),
                     pack2<__half>(f[6], f[7]));
    }
  }
}

enum Kind { kPlain = 0, kPlain4, kLoop, kRmw, kRmwFirst, kSep, kSplit, kPlain4O9, kLazy, kKinds };
const char* kind_key[] = {"plain", "plain4", "loop", "rmw", "rmw_first", "sep", "split", "plain4_o9", "loop_lazy"};
constexpr int kO9Smem = 24 * 1024;   // plain4_o9: dynamic shared memory that leaves 9 blocks an SM (228 KB, 1 KB each
                                     // reserved), the width switch's instance's register-bound occupancy

void launch(const Slice& s, cudaStream_t st, int kind) {
  const Args a = args_of(s);
  const int K = s.t->w.K;
  cudaLaunchAttribute attr[1];
  const dim3 grid(static_cast<unsigned>((s.N + 511) / 512), K / 32);
  cudaLaunchConfig_t cfg = pdl_config(grid, dim3(64), 0, st, attr);
  if (kind == kPlain4 || kind == kPlain4O9) {   // the extension's uniform 4-bit instance (twins ignored)
    DequantMats m{};
    m.n = 1, m.ldw = s.N;
    m.m[0] = DequantMat{a.chunks, a.qweight, a.scale, a.zero, a.perm, s.W, a.ldq, s.N, nullptr};
    if (kind == kPlain4O9) cfg.dynamicSmemBytes = kO9Smem;
    CK(cudaLaunchKernelEx(&cfg, dequant_kernel<__half, 8, kUniform4>, m));
  } else if (kind == kLazy) {
    CK(cudaLaunchKernelEx(&cfg, lazy_kernel, a));
  } else if (kind == kPlain || kind == kSep || kind == kLoop) {
    DequantMats m{};
    m.n = 1, m.ldw = s.N;
    m.m[0] =
        DequantMat{a.chunks, a.qweight, a.scale, a.zero, a.perm, s.W, a.ldq, s.N, kind == kLoop ? a.twin : nullptr};
    CK(cudaLaunchKernelEx(&cfg, kind == kLoop ? dequant_kernel<__half, 8, kTwin4> : dequant_kernel<__half, 8>, m));
    if (kind == kSep) {
      cudaLaunchConfig_t c2 = pdl_config(dim3(grid.x, s.t->n_twinned), dim3(64), 0, st, attr);
      CK(cudaLaunchKernelEx(&c2, twin_add_kernel, a));
    }
  } else if (kind == kSplit) {
    cudaLaunchConfig_t c1 = pdl_config(dim3(grid.x, s.t->n_twinned), dim3(64), 0, st, attr);
    CK(cudaLaunchKernelEx(&c1, loop_kernel<kTwinned>, a));
    cudaLaunchConfig_t c2 = pdl_config(dim3(grid.x, K / 32 - s.t->n_twinned), dim3(64), 0, st, attr);
    CK(cudaLaunchKernelEx(&c2, rmw_kernel<kRest, false>, a));
  } else {
    CK(cudaLaunchKernelEx(&cfg, kind == kRmwFirst ? rmw_kernel<kFirst, true> : rmw_kernel<kAll, true>, a));
  }
}

// The host formula: plain bit for bit (fp32 fma, one rounding to fp16, as dequant_probe checks it); the twin kinds
// within 2^-11 (|main| + |sum|) + 1e-6.  A row a kernel never wrote stays NaN (the 0xFF fill) and fails too.
bool check(const Slice& s, int kind) {
  const TwinW& t = *s.t;
  const PackedDev& w = t.w;
  std::vector<__half> got(static_cast<size_t>(w.K) * s.N);
  CK(cudaMemcpy(got.data(), s.W, got.size() * 2, cudaMemcpyDeviceToHost));
  auto value = [&](int chunk, int j, int col) {
    const int g = w.hch[3 * chunk + 1], qrow = w.hch[3 * chunk + 2];
    const float sc = w.hs[static_cast<size_t>(g) * w.ldq + col], zs = w.hz[static_cast<size_t>(g) * w.ldq + col] * sc;
    const uint32_t word = static_cast<uint32_t>(w.hq[static_cast<size_t>(qrow + j / 8) * w.ldq + col]);
    return static_cast<double>(std::fmaf(static_cast<float>((word >> (4 * (j % 8))) & 15u), sc, -zs));
  };
  int bad = 0;
  for (int c = 0; c < w.K / 32; ++c)
    for (int n = 0; n < s.N; ++n)
      for (int j = 0; j < 32; ++j) {
        const int col = s.col0 + n;
        const bool twins = kind != kPlain && kind != kPlain4 && kind != kPlain4O9;
        const double main = value(c, j, col), sum = main + (twins && t.htwin[c] >= 0 ? value(t.htwin[c], j, col) : 0.0);
        const __half raw = got[static_cast<size_t>(w.hperm[32 * c + j]) * s.N + n];
        const double have = __half2float(raw);
        const __half want = __float2half_rn(static_cast<float>(main));   // main is a float fma's result
        const double tol = std::ldexp(std::fabs(main) + std::fabs(sum), -11) + 1e-6;
        const bool ok = twins ? std::fabs(have - sum) <= tol : memcmp(&raw, &want, 2) == 0;
        if (!ok && bad++ < 4)
          printf("MISMATCH %s chunk %d col %d j %d: %f vs %f\n", kind_key[kind], c, col, j, have, sum);
      }
  return bad == 0;
}


int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  srand(4321);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const int n_layers = 4;
  __half* W;
  CK(cudaMalloc(&W, static_cast<size_t>(11008) * 4096 * 2));
  // a layer: q, k, v, o, gate, up, down -- gate and up in 4096-column slices, as the extension launches them
  std::vector<TwinW> ws;
  std::vector<std::vector<Slice>> layers(n_layers);
  ws.reserve(7 * n_layers);
  for (int l = 0; l < n_layers; ++l) {
    for (int i = 0; i < 7; ++i) ws.push_back(make_twin(i == 6 ? 11008 : 4096, i == 4 || i == 5 ? 11008 : 4096, l == 0));
    for (int i = 0; i < 7; ++i) {
      const TwinW* t = &ws[7 * l + i];
      for (int c0 = 0; c0 < t->w.ldq; c0 += 4096) layers[l].push_back({t, c0, std::min(4096, t->w.ldq - c0), W});
    }
  }
  {                                                     // plain4_o9's premise: 9 blocks an SM against plain4's
    int b_sw = 0, b_u4 = 0, b_o9 = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b_sw, dequant_kernel<__half, 8>, 64, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b_u4, dequant_kernel<__half, 8, kUniform4>, 64, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b_o9, dequant_kernel<__half, 8, kUniform4>, 64, kO9Smem));
    printf("blocks an SM: width switch %d, plain4 %d, plain4_o9 %d\n", b_sw, b_u4, b_o9);
  }
  for (int kind = 0; kind < kKinds; ++kind) {          // the first layer, each slice
    bool ok = true;
    for (const Slice& s : layers[0]) {
      CK(cudaMemset(W, 0xFF, static_cast<size_t>(11008) * 4096 * 2));
      launch(s, 0, kind);
      CK(cudaDeviceSynchronize());
      ok = ok && check(s, kind);
    }
    printf("check %-10s %s\n", kind_key[kind], ok ? "ok" : "FAILED");
    if (!ok) exit(1);                                   // no timings of a wrong kernel
  }
#ifdef WITH_CUBLAS
  const int M = 2048;
  cublasHandle_t h;
  CB(cublasCreate(&h));
  __half *x, *y;
  CK(cudaMalloc(&x, static_cast<size_t>(M) * 11008 * 2));
  CK(cudaMalloc(&y, static_cast<size_t>(M) * 11008 * 2));
  {                                                     // as dequant_probe's x: the GEMMs' power and clocks alike
    std::vector<__half> hx(static_cast<size_t>(M) * 11008);
    for (auto& v : hx) v = __float2half(rand() / static_cast<float>(RAND_MAX) - 0.5f);
    CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  }
  auto gemm = [&](const Slice& s, cudaStream_t st) {   // y [M, N] = x [M, K] W [K, N], cuBLAS column-major
    const float one = 1.f, zero = 0.f;
    CB(cublasSetStream(h, st));
    CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, s.N, M, s.t->w.K, &one, s.W, CUDA_R_16F, s.N, x, CUDA_R_16F,
                    s.t->w.K, &zero, y, CUDA_R_16F, s.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
#endif
  std::string row = "{\"row\": \"twin\", \"twin_every\": " + std::to_string(kTwinEvery);
  for (int kind = 0; kind < kKinds; ++kind) {
    const float us = time_seq([&](cudaStream_t st) {
                       for (auto& L : layers)
                         for (const Slice& s : L) launch(s, st, kind);
                     }) / n_layers;
    printf("%-10s alone %8.2f us a layer\n", kind_key[kind], us);
    row += std::string(", \"") + kind_key[kind] + "_alone_us\": " + std::to_string(us);
  }
#ifdef WITH_CUBLAS
  for (int round = 0; round < 5; ++round) {            // interleaved: GEMMs alone, then each kind before its GEMMs
    const float g_us = time_seq([&](cudaStream_t st) {
                         for (auto& L : layers)
                           for (const Slice& s : L) gemm(s, st);
                       }) / n_layers;
    printf("round %d: GEMMs alone %8.2f;", round, g_us);
    row += ", \"gemm_us_" + std::to_string(round) + "\": " + std::to_string(g_us);
    for (int kind = 0; kind < kKinds; ++kind) {
      const float us = time_seq([&](cudaStream_t st) {
                         for (auto& L : layers)
                           for (const Slice& s : L) launch(s, st, kind), gemm(s, st);
                       }) / n_layers;
      printf(" %s +%.2f", kind_key[kind], us - g_us);
      row += std::string(", \"") + kind_key[kind] + "_gemm_us_" + std::to_string(round) + "\": " + std::to_string(us);
    }
    printf("\n");
  }
#endif
  printf("JSON %s}\n", row.c_str());
  printf("done\n");
  return 0;
}
