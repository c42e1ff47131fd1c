// exl_core.DecoderStack: every decoder layer of a Llama-family model in one call on the CPU.
//
// Per layer, exactly the kernel sequence of the Python path (exl_core/model/llama.py), through
// the same C++ functions (kernels.h), so the results are bit-identical to it:
//
//   x, res = rms_norm(h) / rms_norm_residual(h, res)      q, k, v = linears(x, {q, k, v})
//   q, k = rope(q, k)   k, v rows -> their page slots     o = paged_attention(q, pages)
//   a = linears(o, {o_proj})   x, res = rms_norm_residual(a, res)
//   g, u = linears(x, {gate, up})   h = linears(silu_mul(g, u), {down})
//
// What it saves is the host work between kernels: ~10 Python dispatcher calls per layer.
// Every projection goes through `linears`, the one place another matmul kernel plugs in; for
// decode-sized x, q|k|v and gate|up go through one fused weight each when the caller handed
// them over (set_fused; same columns, same bits).
// Shapes: h, res (T, hidden); q (T, Hq, D); k, v (T, Hkv, D); K/V pages (P, page_size, Hkv, D).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "qmatmul.h"

namespace {

namespace kops = exl_cpu::ops;

// One projection: packed (qmatmul layout, formats/packed.py) or dense pre-transposed w_t [K, N].
struct Linear {
  bool packed = false;
  bool int8 = false;        // packed, with int8 activations requested (ops/qmatmul.py wants_int8)
  at::Tensor qweight, groups, scale, zero, w_t;
  at::Tensor zero_i8;  // what the int8 kernel reads: [G] when every column shares its group's zero, else zero
  // Panel-major copies for the int8 kernel (DecoderStack::set_panel_major; undefined: row-major):
  // qweight [N/32, Q, 32], scale and a [G, N] zero_i8 as [N/32, G, 32].
  at::Tensor qweight_pm, scale_pm, zero_pm;
  std::optional<at::Tensor> perm, bias;
  const at::Tensor& q8() const { return qweight_pm.defined() ? qweight_pm : qweight; }
  const at::Tensor& s8() const { return qweight_pm.defined() ? scale_pm : scale; }
  const at::Tensor& z8() const { return qweight_pm.defined() ? zero_pm : zero_i8; }
};

// [R, N] -> [N/32, R, 32]: each 32-column panel's rows contiguous.
at::Tensor to_panels(const at::Tensor& t) {
  return t.view({t.size(0), t.size(1) / exl_cpu::kPanel, exl_cpu::kPanel}).permute({1, 0, 2}).contiguous();
}

// Projections that read the same x, packed side by side along N into one weight (q|k|v,
// gate|up): one matrix streams as one set of rows where three cold ones each start their own
// (SmolLM2 decode, int8: q/k/v 36.2 -> 23.6 us, gate/up 56.9 -> 48.0 us per layer). Each output
// column is computed exactly as in its own weight, so the split outputs are bit-identical.
struct Fused {
  Linear w;
  std::vector<int64_t> sizes;  // output columns of each part, in order
  bool defined() const { return !sizes.empty(); }
};

struct Layer {
  at::Tensor in_norm, post_norm;
  Linear q, k, v, o, gate, up, down;
  Fused qkv, gate_up;
};


bool same_perm(const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a.has_value() || a->unsafeGetTensorImpl() == b->unsafeGetTensorImpl();
}

// y_i = x @ W_i (+ bias_i) for projections reading the same x, as the Python path computes them
// (model/linear.py linear_many, QuantLinear.forward, ops/qmatmul.py's dispatchers): all packed with
// one permutation -> one multi call (int8 activations when every weight asks for them and x has at
// most `int8_rows` rows, else exact; bit-identical to one call each); otherwise each on its own
// kernel, int8 where that weight asks and the rows allow.
// panel_reads counts the int8 weights served from panel-major copies (DecoderStack::panel_reads).
std::vector<at::Tensor> linears(const at::Tensor& x, std::initializer_list<const Linear*> ws, int64_t int8_rows,
                                int64_t& panel_reads) {
  const Linear& first = **ws.begin();
  const bool small = x.size(0) <= int8_rows;
  bool multi = ws.size() > 1, all_int8 = small;
  for (const Linear* w : ws) {
    multi = multi && w->packed && same_perm(w->perm, first.perm);
    all_int8 = all_int8 && w->int8;
  }
  if (multi) {
    std::vector<at::Tensor> qw, gr, sc, ze;
    c10::List<std::optional<at::Tensor>> bias;
    for (const Linear* w : ws) {
      panel_reads += all_int8 && w->qweight_pm.defined();
      qw.push_back(all_int8 ? w->q8() : w->qweight);
      gr.push_back(w->groups);
      sc.push_back(all_int8 ? w->s8() : w->scale);
      ze.push_back(all_int8 ? w->z8() : w->zero);
      bias.push_back(w->bias);
    }
    return all_int8 ? kops::qmatmul_int8_multi(x, qw, gr, sc, ze, first.perm, bias)
                    : kops::qmatmul_multi(x, qw, gr, sc, ze, first.perm, bias);
  }
  std::vector<at::Tensor> out;
  for (const Linear* w : ws) {
    if (!w->packed) out.push_back(kops::dense_matmul(x, w->w_t, w->bias));
    else if (small && w->int8) {
      panel_reads += w->qweight_pm.defined();
      out.push_back(kops::qmatmul_int8(x, w->q8(), w->groups, w->s8(), w->z8(), w->perm, w->bias));
    }
    else out.push_back(kops::qmatmul(x, w->qweight, w->groups, w->scale, w->zero, w->perm, w->bias));
  }
  return out;
}

// K/V rows of the new tokens into their page slots: ops.attention.write_kv's index_copy_, as a
// plain row copy when the dtypes match (same bytes; index_copy_ costs ~5 us a call here).
// src (T, Hkv, D); pages (P, page_size, Hkv, D) contiguous; slots int64 [T].
void write_pages(at::Tensor& pages, const at::Tensor& src, const at::Tensor& slots, int64_t layer) {
  const int64_t row = pages.size(2) * pages.size(3), n_slots = pages.size(0) * pages.size(1);
  if (src.scalar_type() != pages.scalar_type() || !src.is_contiguous()) {
    pages.view({n_slots, pages.size(2), pages.size(3)}).index_copy_(0, slots, src.to(pages.scalar_type()));
    return;
  }
  const int64_t* sl = slots.data_ptr<int64_t>();
  const size_t bytes = (size_t)row * src.element_size();
  char* dst = static_cast<char*>(pages.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < src.size(0); ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < n_slots, "exl_core.DecoderStack: layer ", layer, ": slot ", sl[t],
                " of token ", t, " outside the page pool's ", n_slots, " slots");
    std::memcpy(dst + sl[t] * bytes, from + t * bytes, bytes);
  }
}

// Wall time per stage of forward(), summed over layers and calls while enabled (bench only:
// bench/cpu_decode_breakdown.py reads it; off by default, then one branch per stage).
enum Stage { kNorm, kQKV, kRope, kAttention, kO, kGateUp, kSiluMul, kDown, kStages };
constexpr std::array<const char*, kStages> kStageNames{"norm", "qkv", "rope_kv_write", "attention",
                                                       "o_proj", "gate_up", "silu_mul", "down"};

class StageClock {
 public:
  bool on = false;
  std::array<double, kStages> seconds{};
  void start() {
    if (on) t_ = std::chrono::steady_clock::now();
  }
  void stop(Stage s) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    seconds[s] += std::chrono::duration<double>(now - t_).count();
    t_ = now;
  }

 private:
  std::chrono::steady_clock::time_point t_;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale), window_(window) {
    TORCH_CHECK(hq_ > 0 && hkv_ > 0 && d_ > 0 && hq_ % hkv_ == 0, "exl_core.DecoderStack: heads ", hq_, "/", hkv_,
                " and head dim ", d_, " must be positive, query heads a multiple of kv heads");
    TORCH_CHECK(window_ >= 0, "exl_core.DecoderStack: window must be >= 0 (0 = none)");
  }

  // Projections are added in layer order q, k, v, o, gate, up, down; add_layer takes the last 7.
  // zero_i8: the int8 kernel's zero ([G] per-group points, ops/qmatmul.py int8_zero); None: zero.
  void add_packed(at::Tensor qweight, at::Tensor groups, at::Tensor scale, at::Tensor zero,
                  std::optional<at::Tensor> perm, std::optional<at::Tensor> bias, bool int8,
                  std::optional<at::Tensor> zero_i8) {
    pending_.push_back(packed_linear(qweight, groups, scale, zero, perm, bias, int8, zero_i8));
  }

  void add_dense(at::Tensor w_t, std::optional<at::Tensor> bias) {
    Linear l;
    l.w_t = w_t, l.bias = bias;
    pending_.push_back(std::move(l));
  }

  void add_layer(at::Tensor in_norm, at::Tensor post_norm) {
    TORCH_CHECK(!panels_, "exl_core.DecoderStack: add_layer after set_panel_major(true): the new layer would have "
                "no panel-major copies; add every layer first");
    TORCH_CHECK(pending_.size() == 7, "exl_core.DecoderStack: add_layer needs 7 projections added before it "
                "(q, k, v, o, gate, up, down), got ", pending_.size());
    auto& p = pending_;
    layers_.push_back(Layer{in_norm, post_norm, p[0], p[1], p[2], p[3], p[4], p[5], p[6]});
    windows_.push_back(window_);
    p.clear();
  }

  // The last added layer's sliding window (0: none), where it differs from the stack's (Qwen2's
  // max_window_layers: full attention below it, the window from it on).
  void set_layer_window(int64_t window) {
    TORCH_CHECK(!layers_.empty(), "exl_core.DecoderStack: set_layer_window before add_layer");
    TORCH_CHECK(window >= 0, "exl_core.DecoderStack: window must be >= 0 (0 = none)");
    windows_.back() = window;
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // The last added layer's q|k|v (which == 0) or gate|up (which == 1) as one packed weight whose
  // output columns are the parts' in order (sizes); serves calls of up to `fused_rows` rows.
  void set_fused(int64_t which, at::Tensor qweight, at::Tensor groups, at::Tensor scale, at::Tensor zero,
                 std::optional<at::Tensor> perm, std::optional<at::Tensor> bias, bool int8,
                 std::optional<at::Tensor> zero_i8, std::vector<int64_t> sizes) {
    TORCH_CHECK(!panels_, "exl_core.DecoderStack: set_fused after set_panel_major(true): the fused weight would "
                "have no panel-major copy; fuse first");
    TORCH_CHECK(!layers_.empty() && (which == 0 || which == 1), "exl_core.DecoderStack: set_fused(", which,
                ") needs an added layer and which in {0: q|k|v, 1: gate|up}");
    Layer& ly = layers_.back();
    const std::vector<const Linear*> parts = which == 0 ? std::vector<const Linear*>{&ly.q, &ly.k, &ly.v}
                                                        : std::vector<const Linear*>{&ly.gate, &ly.up};
    TORCH_CHECK(sizes.size() == parts.size(), "exl_core.DecoderStack: set_fused(", which, ") needs ", parts.size(),
                " sizes, got ", sizes.size());
    int64_t total = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      TORCH_CHECK(parts[i]->packed && parts[i]->qweight.size(1) == sizes[i], "exl_core.DecoderStack: set_fused(",
                  which, ") part ", i, " has ", parts[i]->packed ? parts[i]->qweight.size(1) : 0,
                  " packed columns, sizes says ", sizes[i]);
      total += sizes[i];
    }
    TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == total, "exl_core.DecoderStack: fused qweight ",
                qweight.sizes(), " does not have the ", total, " columns of its parts");
    Fused f;
    f.w = packed_linear(qweight, groups, scale, zero, perm, bias, int8, zero_i8);
    f.sizes = std::move(sizes);
    (which == 0 ? ly.qkv : ly.gate_up) = std::move(f);
  }

  void set_fused_rows(int64_t rows) { fused_rows_ = rows; }

  // Per-stage wall seconds since the last call (stage name -> seconds); `enable` turns the
  // clock on or off for the calls that follow.
  c10::Dict<std::string, double> stage_times(bool enable) {
    c10::Dict<std::string, double> out;
    for (int i = 0; i < kStages; ++i) out.insert(kStageNames[i], clock_.seconds[i]);
    clock_.seconds.fill(0.0);
    clock_.on = enable;
    return out;
  }

  // Rows up to which projections added with int8=true use int8 activations (ops/qmatmul.py INT8_MAX_M).
  void set_int8_rows(int64_t rows) { int8_rows_ = rows; }

  // on: the int8 kernel reads panel-major copies (each thread's columns one contiguous stream
  // instead of one short stream per qweight row) of the weights decode uses: the fused q|k|v and
  // gate|up where set, their parts where not, o and down; only int8 projections whose columns are
  // whole panels.  Same results bit for bit.  Returns the bytes the copies take (0 when off).
  // Call it after the last add_layer / set_fused (those refuse while it is on), and not while
  // another thread runs forward (the copies it frees may be in use).
  int64_t set_panel_major(bool on) {
    int64_t bytes = 0;
    auto apply = [&](Linear& l) {
      l.qweight_pm = l.scale_pm = l.zero_pm = at::Tensor();
      if (!on || !l.packed || !l.int8 || l.qweight.size(1) % exl_cpu::kPanel) return;
      at::Tensor q = to_panels(l.qweight), sc = to_panels(l.scale);   // all three or none
      at::Tensor z = l.zero_i8.dim() == 2 ? to_panels(l.zero_i8) : l.zero_i8;
      bytes += q.numel() * q.element_size() + sc.numel() * sc.element_size() +
               (l.zero_i8.dim() == 2 ? z.numel() * z.element_size() : 0);
      l.qweight_pm = std::move(q), l.scale_pm = std::move(sc), l.zero_pm = std::move(z);
    };
    auto apply_fused = [&](Fused& f, std::initializer_list<Linear*> parts) {
      if (f.defined()) apply(f.w);
      for (Linear* l : parts) {
        if (f.defined()) l->qweight_pm = l->scale_pm = l->zero_pm = at::Tensor();   // decode takes f
        else apply(*l);
      }
    };
    for (Layer& ly : layers_) {
      apply_fused(ly.qkv, {&ly.q, &ly.k, &ly.v});
      apply_fused(ly.gate_up, {&ly.gate, &ly.up});
      apply(ly.o);
      apply(ly.down);
    }
    panels_ = on;
    return bytes;
  }

  // int8 weight reads served from the panel-major copies since the last call (tests: the copies
  // are really read).
  int64_t panel_reads() {
    const int64_t n = panel_reads_;
    panel_reads_ = 0;
    return n;
  }

  // h (T, hidden): the embeddings (residual None) or the previous block's output with its
  // residual stream. Returns (h, residual) after the last layer, like the Python loop.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor h, std::optional<at::Tensor> residual, at::Tensor positions,
                                             at::Tensor cos_sin, at::Tensor slots, at::Tensor block_table,
                                             at::Tensor cu_seqlens, at::Tensor seq_lens_k,
                                             std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches) {
    const int64_t L = num_layers();
    TORCH_CHECK((int64_t)k_caches.size() == L && (int64_t)v_caches.size() == L,
                "exl_core.DecoderStack: ", L, " layers but ", k_caches.size(), " k and ", v_caches.size(),
                " v cache tensors");
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "exl_core.DecoderStack: h must be a contiguous (T, hidden) tensor");
    const int64_t t = h.size(0);
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t && slots.scalar_type() == at::kLong && slots.is_contiguous(),
                "exl_core.DecoderStack: slots must be contiguous int64 [T=", t, "]");
    at::Tensor res = residual.has_value() ? *residual : at::Tensor();
    for (int64_t i = 0; i < L; ++i) {
      const Layer& ly = layers_[i];
      at::Tensor x;
      clock_.start();
      if (res.defined()) {
        std::tie(x, res) = kops::rms_norm_residual(h, res, ly.in_norm, eps_);
      } else {
        res = h;
        x = kops::rms_norm(h, ly.in_norm, eps_);
      }
      clock_.stop(kNorm);
      auto qkv = project(x, ly.qkv, {&ly.q, &ly.k, &ly.v});
      clock_.stop(kQKV);
      auto [q, k] = kops::rope(qkv[0].view({t, hq_, d_}), qkv[1].view({t, hkv_, d_}), positions, cos_sin);
      const at::Tensor v = qkv[2].view({t, hkv_, d_});
      at::Tensor& kc = k_caches[i];
      at::Tensor& vc = v_caches[i];
      TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(2) == hkv_ && kc.size(3) == d_ &&
                      kc.is_contiguous() && vc.is_contiguous(),
                  "exl_core.DecoderStack: layer ", i, " K/V pages must be contiguous (pages, page_size, ", hkv_, ", ",
                  d_, "), got ", kc.sizes(), " / ", vc.sizes());
      write_pages(kc, k, slots, i);
      write_pages(vc, v, slots, i);
      clock_.stop(kRope);
      const at::Tensor o = kops::paged_attention(q, kc, vc, block_table, cu_seqlens, seq_lens_k, scale_,
                                                   windows_[i]);
      clock_.stop(kAttention);
      const at::Tensor a = linears(o.reshape({t, hq_ * d_}), {&ly.o}, int8_rows_, panel_reads_)[0];
      clock_.stop(kO);
      std::tie(x, res) = kops::rms_norm_residual(a, res, ly.post_norm, eps_);
      clock_.stop(kNorm);
      auto gu = project(x, ly.gate_up, {&ly.gate, &ly.up});
      clock_.stop(kGateUp);
      const at::Tensor act = kops::silu_mul(gu[0], gu[1]);
      clock_.stop(kSiluMul);
      h = linears(act, {&ly.down}, int8_rows_, panel_reads_)[0];
      clock_.stop(kDown);
    }
    return {h, res};
  }

 private:
  static Linear packed_linear(at::Tensor qweight, at::Tensor groups, at::Tensor scale, at::Tensor zero,
                              std::optional<at::Tensor> perm, std::optional<at::Tensor> bias, bool int8,
                              std::optional<at::Tensor> zero_i8) {
    Linear l;
    l.packed = true;
    l.int8 = int8;
    l.qweight = qweight, l.groups = groups, l.scale = scale, l.zero = zero, l.perm = perm, l.bias = bias;
    l.zero_i8 = zero_i8.value_or(zero);
    return l;
  }

  // x through projections sharing it: their fused weight for decode-sized x, else one by one.
  std::vector<at::Tensor> project(const at::Tensor& x, const Fused& fused, std::initializer_list<const Linear*> ws) {
    if (!fused.defined() || x.size(0) > fused_rows_) return linears(x, ws, int8_rows_, panel_reads_);
    const at::Tensor y = linears(x, {&fused.w}, int8_rows_, panel_reads_)[0];
    std::vector<at::Tensor> out;
    int64_t off = 0;
    for (int64_t n : fused.sizes) {
      out.push_back(y.narrow(1, off, n).contiguous());  // a view when x has one row
      off += n;
    }
    return out;
  }

  int64_t hq_, hkv_, d_;
  double eps_, scale_;
  int64_t window_;
  int64_t int8_rows_ = 0;
  int64_t fused_rows_ = 0;
  bool panels_ = false;          // set_panel_major(true) is in force
  int64_t panel_reads_ = 0;
  std::vector<Linear> pending_;
  std::vector<Layer> layers_;
  std::vector<int64_t> windows_;     // per layer
  StageClock clock_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl_core, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_packed", &DecoderStack::add_packed)
      .def("add_dense", &DecoderStack::add_dense)
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_layer_window", &DecoderStack::set_layer_window)
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_int8_rows", &DecoderStack::set_int8_rows)
      .def("set_panel_major", &DecoderStack::set_panel_major)
      .def("panel_reads", &DecoderStack::panel_reads)
      .def("set_fused", &DecoderStack::set_fused)
      .def("set_fused_rows", &DecoderStack::set_fused_rows)
      .def("stage_times", &DecoderStack::stage_times)
      .def("forward", &DecoderStack::forward);
}
