// Stream-K form of qgemm_wg_kernel at 32 tokens: the batch-decode GEMM on Hopper's wgmma (sm_90a), y_i = x W_i for
// up to three uniform 4-bit weights of one shape, or SwiGLU's silu(x W_gate) * (x W_up) (qgemm_wg_decode_cuda.cu;
// bench/wgmma_probe.cu decode32 times the plain form; NOTES.md stops 57-58).
// Why: at one block an SM, the register-A kernel's grid of one block a 128-column tile leaves SMs idle (q/k/v: 96
// tiles on 132 SMs) or takes two waves (gate/up: 172). Here the grid is one block an SM and each block takes a
// contiguous range of the launch's (column tile, k-tile) items, so every SM streams the same share. Inside a block as
// the probe builds EXL_WG_DECODE_PAIRS=2 + EXL_WG_PRODUCER_WARPS + EXL_WG_SZ_ONCE: two pairs of consumer warpgroups
// (pair p takes the block's items j with j % 2 == p, their sums added through shared memory at each tile's end), the
// producer's four warps issuing an item's boxes side by side, one scale and one zero box an item.
// A tile whose items span blocks is finished through an fp32 workspace (finish_split), by default deterministically:
// every contributor stores its partial sums in its own slot (a block has at most two such tiles: its first and its
// last), fences and counts itself in; the last one adds the slots in block order (the same bits whichever block comes
// last), stores y and zeroes the counter for the next launch (no block waits for another). Deterministic variants
// that did not beat it and were removed: the slots through shared memory by cp.async (stops 59-61), fixed-point
// atomics, two slots a round (stop 60), the tails' slots through the idle stages (stops 60-61): NOTES.md.
// kFinishAtomic: fp32 atomics into a zeroed sum instead (stop 57's form; the order of the adds varies from run to run).
// SwiGLU (sk.h set, two weights): the tiles go gate c, up c, gate c + 1, ...; a finished tile's fp16 values (rounded
// as y would be) go to a pair slot, and the second of the twins to finish writes h = silu(gate) * up
// (exl_act::silu_mul, as silu_mul rounds it), also at a chunk's tail columns where tails say (ops/swiglu.py).
// early_w: the producer's weight warps issue their first stages before the PDL wait (the words, scales and zeros are
// load-time data, pdl.cuh); x's warp and the consumers wait.
// Limits: every weight of the batch has the same K (a multiple of 64), N and group table, groups of 64 rows or more
// starting at multiples of 64, no twins, y = x W (no bias, no add); the host op checks what it can without a sync.
#pragma once
#include "act_device.cuh"
#include "qgemm_wg_kernel.cuh"

namespace exl_wg_sk {
using namespace exl_wg;

constexpr int kNT = 32, kThreads = 640;                 // two consumer warpgroup pairs and the producer's warpgroup
constexpr int kPerTile = (kNT / 2) * 256;               // a tile's sums: 16 a thread of the 256 of pair 0
constexpr int kRed = 2 * 2 * (kNT / 2) * 128;           // pair 1's sums: [buffer][half][element][thread] fp32

struct SkArgs {
  WgBatch batch;
  float* ws;                            // exact: [2 * blocks][kPerTile], block b's partial sums of its first, last tile
  float* sum;                           // not exact: [tiles][kPerTile], zero (each finisher re-zeroes its own)
  int* count;                           // [tiles], zero before the first launch (each finisher re-zeroes its own)
  uint32_t* pair_ws;                    // SwiGLU: [column tiles][2][kPerTile / 2] half2 of finished tiles
  int* pair_count;                      // SwiGLU: [column tiles], zero likewise
  __half* h;                            // SwiGLU: silu(x W_0) * (x W_1), [M, ldh]; null: y_i = x W_i
  const int* tails;                     // SwiGLU: [N / 32] column a chunk is also written at, or -1; may be null
  int64_t ldh;
  int early_w;                          // weight boxes before the PDL wait
  int finish;                           // split tiles: kFinishAtomic, kFinishOrdered
};
enum Finish { kFinishAtomic = 0, kFinishOrdered = 1 };

// The first item of block b among `items` shared by `blocks`; the block that holds item u.
__host__ __device__ inline int64_t range_start(int64_t b, int64_t items, int64_t blocks) { return items * b / blocks; }
__host__ __device__ inline int64_t block_of(int64_t u, int64_t items, int64_t blocks) {
  return ((u + 1) * blocks - 1) / items;
}

// Column tile `tile` of the launch: its weight and its first column. SwiGLU interleaves gate and up tiles so that
// twins finish close together; plain launches take the weights one after the other.
struct TileAt {
  int w, f0;
};
__device__ __forceinline__ TileAt tile_at(int tile, int tiles_w, bool swiglu) {
  return swiglu ? TileAt{tile & 1, (tile >> 1) * kBF} : TileAt{tile / tiles_w, (tile % tiles_w) * kBF};
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Pair 0's 256 threads: after each stored its share (to global memory), count the block in on `counter`; true in
// the block that makes it `need` + 1 contributions (its threads then see the others' stores).
__device__ __forceinline__ bool count_in(int* counter, int need, int* flag) {
  __threadfence();
  named_barrier(3, 256);
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1) == need;
  named_barrier(3, 256);
  const bool last = *flag;
  if (last) __threadfence();
  return last;
}

// A tile whose items span blocks first..last (pair 0's 256 threads, acc this block's sums): true in the block that
// counts in last, acc then the tile's total. kFinishOrdered: each block's sums in its own slot (first: the block's
// first tile), added in block order, so the bits do not depend on which block finishes, a slot's loads at a time
// (more registers here spill the main loop's). kFinishAtomic: atomics into sk.sum, which the finisher reads and
// re-zeroes.
__device__ __forceinline__ bool finish_split(const SkArgs& sk, float (&acc)[kNT / 2], int tile, int64_t first,
                                             int64_t last, bool first_seg, int KT, int64_t items, int64_t G,
                                             int* flag) {
  const int tid = threadIdx.x, need = static_cast<int>(last - first);
  if (sk.finish == kFinishAtomic) {
    float* wt = sk.sum + static_cast<size_t>(tile) * kPerTile + tid;
#pragma unroll
    for (int e = 0; e < kNT / 2; ++e) atomicAdd(wt + e * 256, acc[e]);
    if (!count_in(sk.count + tile, need, flag)) return false;
#pragma unroll
    for (int e = 0; e < kNT / 2; ++e) {
      acc[e] = __ldcg(wt + e * 256);
      wt[e * 256] = 0.f;
    }
    if (tid == 0) sk.count[tile] = 0;
    return true;
  }
  auto slot = [&](int64_t b, bool b_first) {
    return sk.ws + static_cast<size_t>(2 * b + (b_first ? 0 : 1)) * kPerTile;
  };
  // Block b's slot of this tile: its first-tile slot for every contributor after `first` (their ranges start inside
  // the tile), and for `first` where its range starts at the tile's start -- one 64-bit division a finish, not two a
  // slot (each a ~100-instruction subroutine call on the finisher's serial path; its gain not measured apart).
  const bool first_owns = range_start(first, items, G) == static_cast<int64_t>(tile) * KT;
  auto slot_of = [&](int64_t b) { return slot(b, b != first || first_owns); };
  float* mine = slot(blockIdx.x, first_seg) + tid;
#pragma unroll
  for (int e = 0; e < kNT / 2; ++e) __stcg(mine + e * 256, acc[e]);
  if (!count_in(sk.count + tile, need, flag)) return false;
  if (tid == 0) sk.count[tile] = 0;
#pragma unroll
  for (int e = 0; e < kNT / 2; ++e) acc[e] = 0.f;
  for (int64_t b = first; b <= last; ++b) {                  // block order: the same sums whoever finishes
    const float* p = slot_of(b) + tid;
#pragma unroll
    for (int e = 0; e < kNT / 2; ++e) acc[e] += __ldcg(p + e * 256);
  }
  return true;
}

// SwiGLU: a finished tile's values rounded to fp16 (as store_tile rounds y) into its pair slot; the second twin to
// finish writes h = silu(gate) * up at rows tok0 + 8 j + r, columns f, f + 1 (and their tail copies).
__device__ __forceinline__ void finish_swiglu(const SkArgs& sk, const float (&acc)[kNT / 2], TileAt at, int tid,
                                              int tok0, int f, int* flag) {
  const int c = at.f0 / kBF;
  uint32_t v[kNT / 4];
#pragma unroll
  for (int i = 0; i < kNT / 4; ++i) {                        // i = 2 j + r: acc[4 j + r] (column f), [4 j + r + 2]
    const __half2 p = __floats2half2_rn(acc[4 * (i >> 1) + (i & 1)], acc[4 * (i >> 1) + (i & 1) + 2]);
    v[i] = *reinterpret_cast<const uint32_t*>(&p);
  }
  uint32_t* slot = sk.pair_ws + (static_cast<size_t>(c) * 2 + at.w) * (kPerTile / 2);
#pragma unroll
  for (int i = 0; i < kNT / 4; ++i) __stcg(slot + i * 256 + tid, v[i]);
  if (!count_in(sk.pair_count + c, 1, flag)) return;
  if (tid == 0) sk.pair_count[c] = 0;
  const uint32_t* twin = sk.pair_ws + (static_cast<size_t>(c) * 2 + (at.w ^ 1)) * (kPerTile / 2);
  const int M = sk.batch.w[0].M, N = sk.batch.w[0].N;
  if (f >= N) return;
  const int tail = sk.tails ? sk.tails[f >> 5] : -1;
#pragma unroll
  for (int i = 0; i < kNT / 4; ++i) {
    const int tok = tok0 + 8 * (i >> 1) + (i & 1);
    const uint32_t o = __ldcg(twin + i * 256 + tid);
    const __half2 g = *reinterpret_cast<const __half2*>(at.w == 0 ? &v[i] : &o);
    const __half2 u = *reinterpret_cast<const __half2*>(at.w == 0 ? &o : &v[i]);
    const __half2 hv = __halves2half2(exl_act::silu_mul<__half>(__low2half(g), __low2half(u)),
                                      exl_act::silu_mul<__half>(__high2half(g), __high2half(u)));
    if (tok < M) {
      *reinterpret_cast<__half2*>(sk.h + tok * sk.ldh + f) = hv;
      if (tail >= 0) *reinterpret_cast<__half2*>(sk.h + tok * sk.ldh + tail + (f & 31)) = hv;
    }
  }
}

template <int STAGES>
constexpr int smem_bytes() {
  return STAGES * Layout<kNT, false>::kStage + 1024 + STAGES * 16 + kMaxChunks * 4 + kRed * 4 + 16;
}

// 1 where this build has the kernel's sm_90a code (wgmma), else 0: without it the kernel's body is empty, so the host
// op asks once a device before its first launch (qgemm_wg_decode_cuda.cu).
__global__ void wg_streamk_built(int* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

// grid min(SMs, items): every block at least one item (a tile's finisher counts on each block between its first and
// last contributor adding to it), kThreads, dynamic shared memory smem_bytes<STAGES>().
template <int STAGES>
__global__ void __launch_bounds__(kThreads, 1) qgemm_wg_streamk(const __grid_constant__ SkArgs sk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<kNT, false>;
  const WgArgs& a0 = sk.batch.w[0];
  const int tid = threadIdx.x;
  const int KT = a0.K / kBK, tiles_w = (a0.N + kBF - 1) / kBF;
  const int64_t items = static_cast<int64_t>(tiles_w) * sk.batch.n * KT, G = gridDim.x;
  const int64_t u0 = range_start(blockIdx.x, items, G);
  const int n = static_cast<int>(range_start(blockIdx.x + 1, items, G) - u0);
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (exl_tma::smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * L::kStage);
  uint64_t* empty = full + STAGES;
  int* groups = reinterpret_cast<int*>(empty + STAGES);
  float* red = reinterpret_cast<float*>(groups + kMaxChunks);
  int* last_flag = reinterpret_cast<int*>(red + kRed);
  for (int c = tid; c < a0.K / 32; c += kThreads) groups[c] = a0.chunks[c * 3 + 1];   // load-time data
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      exl_tma::mbar_init(full + s, 4);                       // each producer warp arrives with its own bytes
      exl_tma::mbar_init(empty + s, 2);                      // the item's pair: one arrival a warpgroup
    }
    exl_tma::mbar_init_fence();
  }
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  const bool swiglu = sk.h != nullptr;
  if (warp >= 16) {                                          // producer: warp 16 + pw issues box pw of every item
    const int pw = warp - 16;
    if (pw == 0 || !sk.early_w) {                            // x is the kernel before's output; weights are not
      exl_pdl::pdl_wait();
      exl_pdl::pdl_trigger();
    }
    if (lane == 0) {
      int tile = static_cast<int>(u0 / KT), kt = static_cast<int>(u0 % KT);   // stepped, not divided, an item
      TileAt at = tile_at(tile, tiles_w, swiglu);
      for (int j = 0; j < n; ++j, ++kt) {
        if (kt == KT) {                                      // the next column tile
          kt = 0, ++tile;
          at = tile_at(tile, tiles_w, swiglu);
        }
        const WgArgs* a = &sk.batch.w[at.w];
        const int k0 = kt * kBK, slot = j % STAGES;
        if (j >= STAGES) exl_tma::mbar_wait(empty + slot, ((j / STAGES) - 1) & 1);
        uint8_t* st = smem + slot * L::kStage;
        if (pw == 0) {
          exl_tma::mbar_arrive_expect(full + slot, L::kX);
          exl_tma::tma_load_2d(st, &a->xmap, k0, 0, full + slot);
        } else if (pw == 1) {
          exl_tma::mbar_arrive_expect(full + slot, L::kW);
          exl_tma::tma_load_2d(st + L::kOffW, &a->wmap, at.f0, k0 / 8, full + slot);
        } else {
          exl_tma::mbar_arrive_expect(full + slot, kBF * 4);
          exl_tma::tma_load_2d(st + L::kOffSZ + (pw - 2) * kBF * 4, pw == 3 ? &a->zmap : &a->smap, at.f0,
                               groups[k0 / 32], full + slot);
        }
      }
    }
    return;
  }
  exl_pdl::pdl_wait();                                       // before the workspace and the stores
  exl_pdl::pdl_trigger();
  const int wg = tid >> 7, g = lane >> 2, t = lane & 3, pair = wg >> 1, half = wg & 1;
  const int fp = half * 64 + (warp & 3) * 16 + 2 * g;        // A rows g, g + 8 -> block-local columns fp, fp + 1
  const uint32_t sel = static_cast<uint32_t>(t | 0x40 | (t << 8) | 0x4000);
  const bool releaser = (warp & 3) == 0 && lane == 0;
  const int twin_row[2] = {-1, -1};
  float acc[kNT / 2];
  uint32_t A0[4][4], A1[4][4];
  int pending = -1;                                          // this pair's item whose stage is not yet released
  auto step = [&](int j, uint32_t(&A)[4][4]) {
    const int slot = j % STAGES;
    exl_tma::mbar_wait(full + slot, (j / STAGES) & 1);
    const uint8_t* st = smem + slot * L::kStage;
    exl_wgmma::fence_operands(acc);
    tile_fragments<kNT, false, true>(st, fp, sel, twin_row, A);
    mma_tile<kNT>(acc, A, st);
    exl_wgmma::fence_operands(acc);
    exl_wgmma::wait<1>();                                    // this pair's item before is complete: release it
    if (releaser && pending >= 0) exl_tma::mbar_arrive(empty + pending % STAGES);
    pending = j;
  };
  int seg = 0;
  for (int s0 = 0; s0 < n; ++seg) {                          // one column tile's items of this block: [s0, s1)
    const int tile = static_cast<int>((u0 + s0) / KT);
    const int s1 = static_cast<int>(min(static_cast<int64_t>(n), static_cast<int64_t>(tile + 1) * KT - u0));
#pragma unroll
    for (int e = 0; e < kNT / 2; ++e) acc[e] = 0.f;
    int j = s0 + ((pair - s0) & 1);                          // this pair's first item of the tile
    for (; j + 2 < s1; j += 4) {                             // two register sets, each in one place
      step(j, A0);
      step(j + 2, A1);
    }
    if (j < s1) step(j, A0);
    exl_wgmma::wait<0>();
    exl_wgmma::fence_operands(acc);
    if (releaser && pending >= 0) exl_tma::mbar_arrive(empty + pending % STAGES);
    pending = -1;
    float* rb = red + (seg & 1) * (kRed / 2) + half * (kNT / 2) * 128;   // pair 1's sums, a buffer a tile in turn
    if (pair == 1) {
#pragma unroll
      for (int e = 0; e < kNT / 2; ++e) rb[e * 128 + (tid & 127)] = acc[e];
    }
    named_barrier(1, 512);                                   // both pairs' consumers
    if (pair == 0) {
#pragma unroll
      for (int e = 0; e < kNT / 2; ++e) acc[e] += rb[e * 128 + (tid & 127)];
      const int64_t first = block_of(static_cast<int64_t>(tile) * KT, items, G);
      const int64_t last = block_of(static_cast<int64_t>(tile + 1) * KT - 1, items, G);
      const bool done =
          first == last || finish_split(sk, acc, tile, first, last, seg == 0, KT, items, G, last_flag);
      if (done) {
        const TileAt at = tile_at(tile, tiles_w, swiglu);
        if (!swiglu)
          store_tile<kNT>(sk.batch.w[at.w], acc, 2 * t, at.f0 + fp);
        else
          finish_swiglu(sk, acc, at, tid, 2 * t, at.f0 + fp, last_flag);
      }
    }
    s0 = s1;
  }
#endif
}

}  // namespace exl_wg_sk
