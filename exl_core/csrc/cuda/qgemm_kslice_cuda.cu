// exl_core::qgemm_kslice, host side: plan, checks, launch and op registration.  The kernel and its design notes:
// qgemm_kslice_kernel.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <cstdlib>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "qgemm_kslice_kernel.cuh"
#include "qmma_common.cuh"

namespace {
using namespace exl_mma;
using namespace exl_kslice;

// ----------------------------------------------------------------------------- host side

constexpr size_t kSmemMax = 160 * 1024;   // beyond this the launch is refused (qgemm_skinny takes it)

struct Plan {
  int kw, ring, nt, slots, xs_stride;
  size_t smem;
  int gshift;   // regular groups: chunk c in group c >> gshift (uniform 4-bit only), else -1 (the chunk table)
  int sgather;  // act-order x gathered from a shared-memory copy of x (smem includes the copy), else 0
  int n_chunks; // the weights' rows / 32 (x's K / 32 unless PackedWeight.rows)
  bool xchunks = false;   // x staged by chunk offsets (check_xchunks): the XC instances
};

// Shared memory a block may take for the shared-memory gather of act-order x: two blocks of 8 warps still fit an
// SM; a 16-warp block runs alone (register-bound) and may take up to kSmemMax.
constexpr size_t kGatherSmem = 100 * 1024;

// EXL_CORE_KSLICE_SGATHER=0: act-order x gathered from global memory by every block (A/B runs).
bool sgather_enabled() {
  static const bool on = exl_pdl::env_on("EXL_CORE_KSLICE_SGATHER");
  return on;
}

// EXL_CORE_KSLICE_U4_ONE_ROW=0: uniform 4-bit staged launches of more than ~3 tiles per SM (gate/up) take
// qgemm_kslice at 2..8 rows too, not only at one (A/B runs: bench/gpu.sh phase u4rows; csrc/cuda/NOTES.md, stop 23).
bool u4_one_row_only() {
  static const bool on = exl_pdl::env_on("EXL_CORE_KSLICE_U4_ONE_ROW");
  return on;
}

// EXL_CORE_KSLICE_MIXED_SKINNY=0: mixed-width staged launches of more than ~3 tiles per SM (EXL2 gate/up at 1..8 rows)
// take qgemm_kslice too (A/B runs: bench/gpu.sh phase mixks; the Python policy reads the same variable).
bool mixed_waves_to_skinny() {
  static const bool on = exl_pdl::env_on("EXL_CORE_KSLICE_MIXED_SKINNY");
  return on;
}

// Warps per block of staged launches with more column tiles than SMs (q/k/v, gate/up at 1..8 rows): 8 for uniform
// 4-bit weights (3 blocks of 76-97 registers a lane share an SM), 4 for mixed widths (128 registers: 4 blocks of 4
// warps an SM instead of 2 of 8, so q/k/v's 384 tiles run in one wave instead of 1.45).  Same call, separate processes
// (stop 29 call 3, bench --quick): EXL2 batch 1 362.0 tok/s with 4 against 354.2 with 8 and 343.2 with 16; GPTQ 457.2
// with 4 and 416.5 with 16 against 519.6 with 8.  EXL_CORE_KSLICE_WAVE_KW=4, 8 or 16 sets it for both (A/B runs:
// bench/gpu.sh phases wavekw4, wavekw8, wavekw16).
// One wave: uniform 4-bit launches of more tiles than three 8-warp blocks an SM hold (gate/up: 688 tiles, 1.73 waves of
// 396) run on 4-warp blocks, up to six an SM (ptxas: 72 and 78 registers for the folded-norm instances; since stop 53
// capped at ceil(tiles / SMs) an SM, wave_cap_smem below), in one wave
// instead of a full wave and a 73 % one (stop 49's phase stamps: the second wave's loops end ~11 us after the first's).
// H200, bench --quick, stop 51 call 3, processes in turn: batch 1 GPTQ 532.60 / 532.14 tok/s against 518.92 with 8
// warps, EXL2 466.84 / 466.28 against 461.44 (call 2, another machine: 527.84 / 528.26 against 515.87 / 515.92, 464.47
// / 464.25 against 458.34 / 459.21).  Batch 32 and the prompt do not take it; EXL2's batch 8 does (its rewritten
// gate/up runs here at 2..8 rows) with no gain (call 3: 2,240.54 / 2,240.47 against 2,251.31).  (The gemv probe's chain
// of plain instances, without the folded norm, read it 0.7-1.0 us a layer slower: 47.78-48.14 against 47.05-47.15, call
// 1.)
// EXL_CORE_KSLICE_ONE_WAVE=0 turns it off (A/B).
// More tiles than three 8-warp blocks an SM hold, at most six 4-warp ones: the one-wave launch's range (and its cap's).
bool one_wave_range(int64_t tiles, int64_t sms) { return tiles > 3 * sms && tiles <= 6 * sms; }

int wave_kw(bool u4, int64_t tiles, int64_t sms) {
  static const int env = [] {
    const char* v = std::getenv("EXL_CORE_KSLICE_WAVE_KW");
    const int k = v ? std::atoi(v) : 0;
    return k == 4 || k == 8 || k == 16 ? k : 0;
  }();
  static const bool one_wave = exl_pdl::env_on("EXL_CORE_KSLICE_ONE_WAVE");
  if (env) return env;
  if (!u4) return 4;
  return one_wave && one_wave_range(tiles, sms) ? 4 : 8;
}

// The one-wave launch's blocks an SM, capped at ceil(tiles / SMs) by padding each block's shared memory.  Under PDL its
// blocks enter while the launch before (o: one 16-warp block an SM) still runs: the gemv probe's stamps (stop 53 calls
// 2 and 4) put 7 of gate/up's 688 blocks on 71-83 SMs and 2 on 37-46 -- every SM with an o block took two gate/up
// blocks that entered before o's block left, and the 2-block SMs are those that kept only these -- and the 2-block SMs'
// loops ended ~4 us sooner.  My reading: the SMs whose o block leaves first fill to the register bound (seven
// 72-register blocks) while the rest of the grid is handed out.  Capped at 6, the probe's chain ran 46.89-47.13 us a
// layer against 47.94-48.29, and with the folded norm 49.38-49.62 against 50.88-51.14 (mode cap, call 4;
// bench/results/gemv_probe_cap_h200_stop53_call4_3d409d7.txt). The model, bench --quick, processes in turn on one
// machine (stop 53 call 6): GPTQ batch 1 540.14 / 540.33 tok/s against 530.05 uncapped (1.0190x / 1.0193x); EXL2 465.31
// / 465.29 against 465.65 -- its gate/up follows the permuted norm's one-block launch, not o, so its blocks found the
// SMs free alike (my reading, not stamped). The padding assumes the driver gives the kernel an SM's whole shared memory
// (no carveout preference is set; the probe's stamps showed 6 an SM on the H200).  plan_for applies it to every 4-warp
// uniform 4-bit staged launch of 3..6 blocks an SM, the EXL_CORE_KSLICE_WAVE_KW=4 override's included.
// EXL_CORE_KSLICE_WAVE_CAP=0 turns it off (A/B: bench/gpu.sh phase nowavecap).  Returns the padded size, or `smem`
// where no padding applies.
size_t wave_cap_smem(size_t smem, int64_t tiles, int64_t sms, int dev) {
  static const bool on = exl_pdl::env_on("EXL_CORE_KSLICE_WAVE_CAP");
  if (!on || sms <= 0) return smem;
  const int64_t cap = (tiles + sms - 1) / sms;
  // cap blocks fit an SM's shared memory, cap + 1 do not (256 bytes below the bound for the allocation granularity)
  const int64_t padded = exl_pdl::device_attr(dev, exl_pdl::kSmemPerSm) / cap -
                         exl_pdl::device_attr(dev, exl_pdl::kSmemReservedPerBlock) - 256;
  return padded > static_cast<int64_t>(smem) ? static_cast<size_t>(padded) : smem;
}

int n_tiles_for(int M) { return M <= kStagedRows ? 1 : M <= 16 ? 2 : 4; }

// Warps per block from the grid: one 4096-wide matrix (128 tiles on 132 SMs) takes 16 warps along K so
// every SM streams with many loads in flight; more tiles take wave_kw's (above: 8 for uniform 4-bit, 4 for mixed
// widths; measured on the H200, bench/cuda_probe.py kslice: 4096x4096 M=1 6.8 us with 16 warps, 7.5 with 8; q/k/v
// 3x4096 17.6 us with 8, 20.3 with 16).
// More than 8 rows: 8 warps, or 4 where the grid has several tiles per SM (2 n-tiles: more than one per SM;
// 4 n-tiles: more than three) -- 4-warp blocks then share an SM (GPTQ M=16 q/k/v 18.9 us with 4, 27.5 with 8,
// 4096x4096 9.3 with 8, 12.2 with 4; M=32 gate/up 66.0 with 4, 74.6 with 8, q/k/v 38.4 with 8, 44.2 with 4).
// Their accumulators and x ring take 160-222 registers a lane: no 16-warp instance.
// `min_group`: the smallest group (rows) of the weights, for the scale slots.
// Ring (chunks of words in flight per lane): 4, except 8 for uniform 4-bit above 8 rows and under the fused SwiGLU.
// Since the 4-bit extraction takes one LOP3 a pair instead of two (qmma_device.cuh and_or), ring 4 beats ring 8
// at one row (bench/gemv_probe.cu, H200, same call, us: q/k/v k8 12.59 vs 15.32, o k16 5.98 vs 6.35, gate/up k8
// 23.37 vs 25.16; down k16 13.61 vs 13.10 -- the fused down projection keeps ring 8).
Plan plan_for(int M, int64_t K, int64_t tiles, int kw, int ring, int64_t min_group, bool u4, int dev,
              bool act = false, bool fold = false) {
  const int nt = n_tiles_for(M);
  const int64_t sms = device_sm(dev, false);
  if (kw <= 0) kw = nt > 1 ? (tiles > (nt == 2 ? 1 : 3) * sms ? 4 : 8) : tiles <= sms ? 16 : wave_kw(u4, tiles, sms);
  if (ring <= 0) ring = u4 && (nt > 1 || act) ? 8 : 4;
  const int n_chunks = static_cast<int>(K / 32);
  const int cw = (n_chunks + kw - 1) / kw;                    // most chunks one warp owns
  const int per_group = static_cast<int>(std::max<int64_t>(1, (min_group > 0 ? min_group : 32) / 32));
  const int slots = std::max(1, std::min(cw, (cw + per_group - 1) / per_group + 1));
  const int xs_stride = nt > 1 ? 0 : static_cast<int>(K) + (M > 1 ? kXPad : 0);
  // fold (staged rows): the norm weight takes the xr region (xr_halves)
  const int64_t xr = xr_halves(0, fold && nt == 1, M, K, act);
  size_t smem = Smem(n_chunks, kw, slots, M, xs_stride, xr).total;
  if (nt == 1 && kw == 4 && u4 && one_wave_range(tiles, sms)) smem = wave_cap_smem(smem, tiles, sms, dev);
  return {kw, ring, nt, slots, xs_stride, smem, -1, 0, n_chunks};
}

// Takes the shared-memory gather where p stages x (one n-tile), some weight has a permutation and the copy of x
// still fits the block (a plan without it stays usable: the gather is an option, never a reason to refuse).
// Kx: x's columns (the copy's width).
void plan_sgather(Plan& p, int M, int64_t Kx, bool any_perm, bool act) {
  if (p.nt != 1 || !any_perm || !sgather_enabled()) return;
  const size_t with = Smem(p.n_chunks, p.kw, p.slots, M, p.xs_stride, gather_halves(M, Kx, act)).total;
  if (with <= (p.kw == 16 ? kSmemMax : kGatherSmem)) {
    p.sgather = 1;
    p.smem = std::max(with, p.smem);                          // (p.smem may hold wave_cap_smem's padding)
  }
}

// The instances: staged x (1 n-tile) with 4/8/16 warps and rings 4/8; x from global memory (2 or 4 n-tiles) with
// 4/8 warps and ring 8 (uniform 4-bit) or 4.
bool plan_has_kernel(const Plan& p, bool u4) {
  if (p.nt == 1) return (p.kw == 4 || p.kw == 8 || p.kw == 16) && (p.ring == 4 || p.ring == 8);
  return (p.kw == 4 || p.kw == 8) && p.ring == (u4 ? 8 : 4);
}

template <int KW, bool U4, int R, int NT, bool ACT, bool FOLD = false, bool XC = false, bool H2 = false>
void launch_one(const __half* x, const __half* up, int M, int64_t K, int64_t tiles, const Plan& p, const Mats& mats,
                int dev, cudaStream_t stream) {
  auto* kern = qgemm_kslice_kernel<KW, U4, R, NT, ACT, FOLD, XC, H2>;
  ensure_smem(kern, p.smem, dev);
  exl_pdl::launch_pdl(kern, dim3(static_cast<unsigned>(tiles)), dim3(32 * KW), p.smem, stream, dev, x, up, M, K,
                      p.n_chunks, p.slots, p.xs_stride, p.gshift, p.sgather, mats);
}

// The instance for p.kw (plan_has_kernel has checked that one exists).
template <bool U4, int R, int NT, bool ACT = false, bool FOLD = false, bool XC = false, bool H2 = false>
void launch_kw(const __half* x, const __half* up, int M, int64_t K, int64_t tiles, const Plan& p, const Mats& mats, int dev,
               cudaStream_t stream) {
  if (p.kw == 4) launch_one<4, U4, R, NT, ACT, FOLD, XC, H2>(x, up, M, K, tiles, p, mats, dev, stream);
  else if (p.kw == 8) launch_one<8, U4, R, NT, ACT, FOLD, XC, H2>(x, up, M, K, tiles, p, mats, dev, stream);
  else if constexpr (NT == 1) launch_one<16, U4, R, NT, ACT, FOLD, XC, H2>(x, up, M, K, tiles, p, mats, dev, stream);
}

// The launch of plan p (one that plan_usable accepts) over `tiles` column tiles.  h2: mats' weights carry half2
// scale/zero (check_half2: uniform 4-bit, staged rows).
void launch_plan(const __half* x, const __half* up, int M, int64_t K, int64_t tiles, const Plan& p, const Mats& mats, bool u4,
                 int dev, cudaStream_t stream, bool h2 = false) {
  if (mats.nf.nw != nullptr) {                                // kslice_run checked: staged uniform 4-bit rows, ring 4
    if (h2) launch_kw<true, 4, 1, false, true, false, true>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<true, 4, 1, false, true>(x, up, M, K, tiles, p, mats, dev, stream);
  } else if (h2) {                                            // kslice_run checked: staged rows, the default ring
    if (up != nullptr && p.xchunks) launch_kw<true, 8, 1, true, false, true, true>(x, up, M, K, tiles, p, mats, dev, stream);
    else if (up != nullptr) launch_kw<true, 8, 1, true, false, false, true>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<true, 4, 1, false, false, false, true>(x, up, M, K, tiles, p, mats, dev, stream);
  } else if (up != nullptr && p.xchunks) {                           // check_xchunks: one weight, staged rows
    if (u4) launch_kw<true, 8, 1, true, false, true>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<false, 4, 1, true, false, true>(x, up, M, K, tiles, p, mats, dev, stream);
  } else if (up != nullptr) {                                        // kslice_run checked: one n-tile, the default ring
    if (u4) launch_kw<true, 8, 1, true>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<false, 4, 1, true>(x, up, M, K, tiles, p, mats, dev, stream);
  } else if (p.nt == 1) {
    if (u4 && p.ring == 8) launch_kw<true, 8, 1>(x, up, M, K, tiles, p, mats, dev, stream);
    else if (u4) launch_kw<true, 4, 1>(x, up, M, K, tiles, p, mats, dev, stream);
    else if (p.ring == 4) launch_kw<false, 4, 1>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<false, 8, 1>(x, up, M, K, tiles, p, mats, dev, stream);
  } else if (p.nt == 2) {
    if (u4) launch_kw<true, 8, 2>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<false, 4, 2>(x, up, M, K, tiles, p, mats, dev, stream);
  } else {
    if (u4) launch_kw<true, 8, 4>(x, up, M, K, tiles, p, mats, dev, stream);
    else launch_kw<false, 4, 4>(x, up, M, K, tiles, p, mats, dev, stream);
  }
}

bool plan_usable(const Plan& p, bool u4) { return p.smem <= kSmemMax && plan_has_kernel(p, u4); }

// ys[i] [M, N_i] fp16 = x[:, perm_i] @ W_i (+ bias_i), x fp16 [M <= 32, K], up to kMaxMats weights on one
// x in one launch.  kw (warps along K: 4, 8, 16; 4 or 8 above 8 rows) and ring (chunks of words in registers
// per lane: 4 or 8; above 8 rows 8 for uniform 4-bit and 4 otherwise) 0 = chosen here; min_group:
// the weights' smallest group in rows (0 = unknown, assume 32).  Raises where the shape does not fit (see
// qgemm_kslice_fits).
// up (or undefined): x is the MLP's gate and the kernel multiplies silu(x) * up, staged rows only.
// The norm folds (norm_fold_device.cuh): add_to (one weight): y is add_to, the kernel adds into it and returns its sums
// of squares per 32-column tile and row as the one output; norm_weight / norm_ss (staged rows, no permutation): x is
// the residual stream, the kernel multiplies rmsnorm(x) * norm_weight.
struct Folds {
  const at::Tensor* add_to = nullptr;
  c10::optional<at::Tensor> norm_weight, norm_ss;
  double eps = 0.0;
  c10::optional<at::Tensor> xchunks;   // the SwiGLU-fused calls: x read through chunk offsets (check_xchunks)
  std::vector<at::Tensor> sz_half2, sz_mul;     // half2 scale/zero, one pair a weight, or none (check_half2)
};

// sz_half2[i] (int32 [G, N], each a half2 (scale / mul, zero)) and sz_mul[i] (float32 [G], mul per group): weight i's
// scale and zero in 4 bytes a group and column instead of 8 (the kernel's H2 instances), uniform 4-bit weights at
// most kStagedRows rows.  The values are the caller's promise (ops/cuda_scale_half2.py splits scale exactly); the
// shapes are checked.
void check_half2(const Folds& f, const at::Tensor& x, bool u4, at::TensorList scale, const Mats& mats) {
  TORCH_CHECK(f.sz_half2.size() == f.sz_mul.size(), "exl_core::qgemm_kslice: sz_half2 and sz_mul go together");
  TORCH_CHECK(static_cast<int64_t>(f.sz_half2.size()) == mats.n && u4 && x.size(0) <= kStagedRows,
              "exl_core::qgemm_kslice: half2 scale/zero need one pair a weight (", mats.n, ", got ",
              f.sz_half2.size(), "), uniform 4-bit weights and at most ", kStagedRows, " rows (got ", x.size(0), ")");
  for (int i = 0; i < mats.n; ++i) {
    const at::Tensor& h = f.sz_half2[i];
    const at::Tensor& m = f.sz_mul[i];
    const int64_t G = scale[i].size(0);
    TORCH_CHECK(h.is_cuda() && m.is_cuda() && h.device() == x.device() && m.device() == x.device() &&
                    h.dtype() == at::kInt && m.dtype() == at::kFloat && h.dim() == 2 && h.size(0) == G &&
                    h.size(1) == mats.m[i].N && m.dim() == 1 && m.size(0) == G && h.is_contiguous() &&
                    m.is_contiguous() && aligned16(h),
                "exl_core::qgemm_kslice: half2 scale/zero need contiguous int32 sz_half2 [", G, ", ", mats.m[i].N,
                "] (16-byte aligned) and float32 sz_mul [", G, "] on x's GPU for weight ", i, "; got ", h.dtype(), " ",
                h.sizes(), ", ", m.dtype(), " ", m.sizes());
  }
}

std::vector<at::Tensor> listed(const c10::optional<at::Tensor>& t) {
  return t ? std::vector<at::Tensor>{*t} : std::vector<at::Tensor>{};
}
std::vector<at::Tensor> listed(const c10::optional<at::TensorList>& t) {
  return t ? t->vec() : std::vector<at::Tensor>{};
}

// xchunks (int64 [K/32], one weight, no perm, staged rows with up): chunk c of the weight's K rows reads x's columns
// xchunks[c] .. + 31, each a multiple of 8 and within x (the caller's promise: the kernel cannot check without a
// sync) -- an act-order whose chunks read runs of consecutive columns, staged by 16-byte loads (the XC instances).
void check_xchunks(const at::Tensor& xc, const at::Tensor& x, const at::Tensor& up, int64_t K, const Mats& mats) {
  TORCH_CHECK(mats.n == 1 && mats.m[0].perm == nullptr && up.defined() && xc.is_cuda() && xc.device() == x.device() &&
                  xc.dtype() == at::kLong && xc.dim() == 1 && xc.numel() * 32 == K && xc.is_contiguous() &&
                  aligned16(x) && aligned16(up) && x.size(0) <= kStagedRows,
              "exl_core::qgemm_kslice: xchunks needs one weight without perm, up, at most ", kStagedRows,
              " rows of 16-byte aligned x and up, and contiguous int64 [K/32 = ", K / 32, "] on x's GPU; got ",
              xc.dtype(), " ", xc.sizes());
}

std::vector<at::Tensor> kslice_run(const at::Tensor& x, const at::Tensor& up, at::TensorList qweight,
                                   at::TensorList chunks, at::TensorList scale, at::TensorList zero,
                                   const c10::List<c10::optional<at::Tensor>>& perm,
                                   const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4, int64_t kw,
                                   int64_t ring, int64_t min_group, int64_t group_shift, const Folds& folds = {}) {
  std::vector<at::Tensor> ys;
  const c10::cuda::CUDAGuard guard(x.device());
  int64_t K = 0;                                              // the weights' rows (x's Kx unless PackedWeight.rows)
  Mats mats = build_mats("exl_core::qgemm_kslice", x, qweight, chunks, scale, zero, perm, bias, ys, &K,
                         folds.xchunks.has_value());
  if (folds.xchunks) {
    check_xchunks(*folds.xchunks, x, up, K, mats);
    mats.m[0].perm = folds.xchunks->data_ptr<int64_t>();   // read as chunk offsets by the XC instances
  }
  const bool h2 = !folds.sz_half2.empty() || !folds.sz_mul.empty();
  if (h2) {
    check_half2(folds, x, uniform4, scale, mats);
    for (int i = 0; i < mats.n; ++i) {
      mats.m[i].scale = reinterpret_cast<const float*>(folds.sz_half2[i].data_ptr());   // read as half2 pairs
      mats.m[i].zero = folds.sz_mul[i].data_ptr<float>();                              // read per group
    }
  }
  const int64_t M = x.size(0), Kx = x.size(1);
  TORCH_CHECK(M <= kMaxRows, "exl_core::qgemm_kslice: at most ", kMaxRows, " rows of x, got ", M);
  const int dev = x.device().index();
  // Checked before anything is launched (the act-order gather below): a refused call leaves no work behind.
  const int64_t tiles = assign_tiles(mats, kTile);
  const bool fold = set_norm_fold("exl_core::qgemm_kslice", x, folds.norm_weight, folds.norm_ss, folds.eps, mats);
  TORCH_CHECK(!fold || (!up.defined() && uniform4 && n_tiles_for(static_cast<int>(M)) == 1 && K == Kx),
              "exl_core::qgemm_kslice: the folded norm takes at most ", kStagedRows, " rows of x, uniform 4-bit ",
              "weights of x's K rows and no SwiGLU");
  at::Tensor ss;
  if (folds.add_to != nullptr) {
    const at::Tensor& r = *folds.add_to;
    TORCH_CHECK(mats.n == 1 && r.is_cuda() && r.device() == x.device() && r.dtype() == at::kHalf && r.dim() == 2 &&
                    r.size(0) == M && r.size(1) == mats.m[0].N && r.is_contiguous(),
                "exl_core::qgemm_kslice_add_: one weight, and the residual contiguous float16 [", M, ", ",
                mats.m[0].N, "] on x's GPU; got ", mats.n, " weights, residual ", r.dtype(), " ", r.sizes());
    ss = at::empty({tiles, M}, x.options().dtype(at::kFloat));
    mats.m[0].y = reinterpret_cast<__half*>(r.data_ptr());
    mats.nf.add = 1;
    mats.nf.ss_out = ss.data_ptr<float>();
    ys = {ss};
  }
  if (M == 0) return ys;                                      // after the add's checks: _add_ returns its [tiles, 0] sums
  Plan plan = plan_for(static_cast<int>(M), K, tiles, static_cast<int>(kw), static_cast<int>(ring), min_group,
                       uniform4, dev, up.defined(), fold);
  TORCH_CHECK(group_shift >= -1 && group_shift < 16, "exl_core::qgemm_kslice: group_shift ", group_shift,
              " (-1: the chunk table; s: chunk c in group c >> s)");
  plan.gshift = uniform4 ? static_cast<int>(group_shift) : -1;
  TORCH_CHECK(!fold || plan.ring == 4, "exl_core::qgemm_kslice: the folded norm runs ring 4 (got ", plan.ring, ")");
  TORCH_CHECK(plan_usable(plan, uniform4), "exl_core::qgemm_kslice: no kernel for M = ", M, ", K = ", K, ", kw = ", kw,
              ", ring = ", ring, " (shared memory or an unknown kw/ring)");
  TORCH_CHECK(!h2 || plan.ring == (up.defined() ? 8 : 4), "exl_core::qgemm_kslice: half2 scale/zero run the default ",
              "ring (got ", plan.ring, ")");
  bool any_perm = false;
  for (int i = 0; i < mats.n; ++i) any_perm = any_perm || mats.m[i].perm != nullptr;
  plan.xchunks = folds.xchunks.has_value();                   // no copy of x: the plan's shared memory as it is
  if (!plan.xchunks) plan_sgather(plan, static_cast<int>(M), Kx, any_perm, up.defined());
  if (up.defined())
    TORCH_CHECK(plan.nt == 1 && plan.ring == (uniform4 ? 8 : 4) && up.is_cuda() && up.device() == x.device() && up.dtype() == at::kHalf &&
                    up.sizes() == x.sizes() && up.is_contiguous(),
                "exl_core::qgemm_kslice_silu: up must be contiguous float16 like gate ", x.sizes(), " on its GPU, ",
                "at most ", kStagedRows, " rows, the default ring; got ", up.dtype(), " ", up.sizes(), ", ring ", ring);
  // Rows read from global memory (more than kStagedRows) come 16 bytes at a time: x aligned, and each
  // act-order weight gets its own permuted copy of x (a small gather, instead of one per element and block).
  at::Tensor xa = x;
  at::Tensor xperm;
  const bool xg = n_tiles_for(static_cast<int>(M)) > 1;
  if (xg) {
    if (!aligned16(x)) xa = x.clone();
    xperm = permute_x_per_weight(x, perm, mats, dev, K);
  }
  // The kernel's K is the row stride of the x it reads: staged rows read x (Kx columns) and gather through perm;
  // rows from global memory read x, or where K != Kx only the K-wide permuted copies (build_mats saw a perm on
  // every weight).
  launch_plan(reinterpret_cast<const __half*>(xa.data_ptr()),
              up.defined() ? reinterpret_cast<const __half*>(up.data_ptr()) : nullptr, static_cast<int>(M),
              xg ? K : Kx, tiles, plan, mats, uniform4, dev, c10::cuda::getCurrentCUDAStream(), h2);
  return ys;
}

std::vector<at::Tensor> qgemm_kslice_multi(const at::Tensor& x, at::TensorList qweight, at::TensorList chunks,
                                           at::TensorList scale, at::TensorList zero,
                                           const c10::List<c10::optional<at::Tensor>>& perm,
                                           const c10::List<c10::optional<at::Tensor>>& bias, bool uniform4,
                                           int64_t kw, int64_t ring, int64_t min_group, int64_t group_shift,
                                           const c10::optional<at::Tensor>& norm_weight,
                                           const c10::optional<at::Tensor>& norm_ss, double norm_eps,
                                           const c10::optional<at::TensorList> sz_half2 = c10::nullopt,
                                           const c10::optional<at::TensorList> sz_mul = c10::nullopt) {
  Folds f;
  f.norm_weight = norm_weight;
  f.norm_ss = norm_ss;
  f.eps = norm_eps;
  f.sz_half2 = listed(sz_half2);
  f.sz_mul = listed(sz_mul);
  return kslice_run(x, at::Tensor(), qweight, chunks, scale, zero, perm, bias, uniform4, kw, ring, min_group,
                    group_shift, f);
}

// residual [M, N] += x[:, perm] @ W (+ bias) in place (or (silu(x) * up)[:, perm] @ W with up, at most 8 rows), the o
// or down projection adding into the residual stream; returns the sums of squares of the new residual per 32-column
// tile and row, float32 [ceil(N / 32), M] (the norm_ss of the next projection: norm_fold_device.cuh).
at::Tensor qgemm_kslice_add_(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& chunks, const at::Tensor& scale, const at::Tensor& zero,
                             const c10::optional<at::Tensor>& perm, const c10::optional<at::Tensor>& bias,
                             bool uniform4, int64_t min_group, int64_t group_shift,
                             const c10::optional<at::Tensor>& up, const c10::optional<at::Tensor>& xchunks,
                             const c10::optional<at::Tensor>& sz_half2, const c10::optional<at::Tensor>& sz_mul) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  Folds f;
  f.add_to = &residual;
  f.xchunks = xchunks;
  f.sz_half2 = listed(sz_half2);
  f.sz_mul = listed(sz_mul);
  return kslice_run(x, up ? *up : at::Tensor(), {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, 0, 0, min_group,
                    group_shift, f)[0];
}

// y [M, N] = (silu(gate) * up)[:, perm] @ W (+ bias) for M <= 8 rows: the MLP's down projection with the SwiGLU
// product computed while x is staged (one launch fewer per layer in batch-1 decode).
at::Tensor qgemm_kslice_silu(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& qweight,
                             const at::Tensor& chunks, const at::Tensor& scale, const at::Tensor& zero,
                             const c10::optional<at::Tensor>& perm, const c10::optional<at::Tensor>& bias,
                             bool uniform4, int64_t kw, int64_t ring, int64_t min_group, int64_t group_shift,
                             const c10::optional<at::Tensor>& xchunks, const c10::optional<at::Tensor>& sz_half2,
                             const c10::optional<at::Tensor>& sz_mul) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  Folds f;
  f.xchunks = xchunks;
  f.sz_half2 = listed(sz_half2);
  f.sz_mul = listed(sz_mul);
  return kslice_run(gate, up, {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, kw, ring, min_group,
                    group_shift, f)[0];
}

at::Tensor qgemm_kslice(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& chunks,
                        const at::Tensor& scale, const at::Tensor& zero, const c10::optional<at::Tensor>& perm,
                        const c10::optional<at::Tensor>& bias, bool uniform4, int64_t kw, int64_t ring,
                        int64_t min_group, int64_t group_shift) {
  c10::List<c10::optional<at::Tensor>> p, b;
  p.push_back(perm);
  b.push_back(bias);
  return qgemm_kslice_multi(x, {qweight}, {chunks}, {scale}, {zero}, p, b, uniform4, kw, ring, min_group,
                            group_shift, c10::nullopt, c10::nullopt, 0.0)[0];
}

// Whether qgemm_kslice takes M rows of K over `tiles` column tiles with this kw and ring (kw 0: whether its
// policy wants the launch at all); a call it refuses raises, which on some images kills the process (see
// NOTES.md), so callers ask first.
bool qgemm_kslice_fits(int64_t rows, int64_t K, int64_t tiles, int64_t min_group, bool uniform4, int64_t device,
                       int64_t kw, int64_t ring, bool fold) {
  if (rows < 1 || rows > kMaxRows || K % 32 != 0 || kw < 0 || ring < 0) return false;
  // The policy (kw 0) declines staged-x launches of more than ~3 blocks per SM: one block per tile then runs in
  // waves and qgemm_skinny is faster (H200, bench/cuda_probe.py kslice, gate/up 2x11008, cuda_kslice_h200.json:
  // GPTQ M=1 27.3 vs 27.1 us, EXL2 M=1 37.6 vs 36.7, GPTQ M=8 31.3 vs 29.7) -- except uniform 4-bit at one row, where
  // ring 4 and the cheaper extraction made qgemm_kslice faster (cuda_kslice_h200_run_b5b4aff.json: 19.6 vs 24.2).
  // 2..8 uniform 4-bit rows stay refused: sparing them (EXL_CORE_KSLICE_U4_ONE_ROW=0) ran GPTQ batch-8 decode at
  // 2,459.4 tok/s against 2,574.8 (bench/results/gpu_h200_u4rows.json, same call).
  if (kw == 0 && (uniform4 ? rows > 1 && u4_one_row_only() : mixed_waves_to_skinny()) && rows <= kStagedRows &&
      tiles > 3 * device_sm(static_cast<int>(device), false))
    return false;
  if (fold && (rows > kStagedRows || !uniform4 || (ring != 0 && ring != 4)))   // the folded norm's instances
    return false;
  return plan_usable(plan_for(static_cast<int>(rows), K, tiles, static_cast<int>(kw), static_cast<int>(ring),
                               min_group, uniform4, static_cast<int>(device), false, fold),
                      uniform4);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.def("qgemm_kslice(Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, Tensor? perm, "
        "Tensor? bias, bool uniform4=False, int kw=0, int ring=0, int min_group=0, int group_shift=-1) -> Tensor");
  m.def("qgemm_kslice_multi(Tensor x, Tensor[] qweight, Tensor[] chunks, Tensor[] scale, Tensor[] zero, "
        "Tensor?[] perm, Tensor?[] bias, bool uniform4=False, int kw=0, int ring=0, int min_group=0, "
        "int group_shift=-1, Tensor? norm_weight=None, Tensor? norm_ss=None, float norm_eps=0.0, Tensor[]? sz_half2=None, "
        "Tensor[]? sz_mul=None) -> Tensor[]");
  m.def("qgemm_kslice_add_(Tensor(a!) residual, Tensor x, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, "
        "Tensor? perm, Tensor? bias, bool uniform4=False, int min_group=0, int group_shift=-1, Tensor? up=None, "
        "Tensor? xchunks=None, Tensor? sz_half2=None, Tensor? sz_mul=None) -> Tensor");
  m.def("qgemm_kslice_silu(Tensor gate, Tensor up, Tensor qweight, Tensor chunks, Tensor scale, Tensor zero, "
        "Tensor? perm, Tensor? bias, bool uniform4=False, int kw=0, int ring=0, int min_group=0, "
        "int group_shift=-1, Tensor? xchunks=None, Tensor? sz_half2=None, Tensor? sz_mul=None) -> Tensor");
  m.def("qgemm_kslice_fits(int rows, int K, int tiles, int min_group, bool uniform4, int device, int kw=0, "
        "int ring=0, bool fold=False) -> bool",
        &qgemm_kslice_fits);
}

TORCH_LIBRARY_IMPL(exl_core, CUDA, m) {
  m.impl("qgemm_kslice", &qgemm_kslice);
  m.impl("qgemm_kslice_multi", &qgemm_kslice_multi);
  m.impl("qgemm_kslice_silu", &qgemm_kslice_silu);
  m.impl("qgemm_kslice_add_", &qgemm_kslice_add_);
}
