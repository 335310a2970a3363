// The fast decoder's layer loop in C++: the same ATen calls, in the same order, as
// ``FastBackbone._layers_forward`` with ``FastBackbone._attention`` (Python), without the
// Python interpreter between them. A SmolLM2 forward makes about 4,000 ATen calls (30
// layers); from Python each costs a few microseconds of dispatch on top of its work.
//
// Knows: the projections' kernels (``kernels.Linear``'s kinds: aten, oneDNN, int8, int4,
// with its row padding and blocking), RMSNorm, RoPE from the looked-up table, the cache
// store and the attention forms the Python path uses (a folded grouped-query call with an
// additive mask, plain SDPA, or ``listed_attention`` over per-row key lists). Same ops,
// same arguments: same bits (tested).
// Does not know: trees, masks' meaning, row groups or paths: Python prepares the mask
// (already folded) and the key count and keeps the forwards this does not cover.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>

#include "attention.h"
#include "attention_amx.h"
#include "draft_block.h"
#include "fused.h"
#include "gemm_amx.h"
#include "gemm_q.h"
#include "linear.h"

#include <array>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using cadence::Lin;
using cadence::Kind;

struct Layer {
  at::Tensor ln1, ln2;
  std::optional<at::Tensor> q_norm, k_norm;
  Lin qkv, o, gate_up, down;
};

bool fusable(const at::Tensor& x) {
  return x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// transformers' RMSNorm: normalise in fp32, cast back, scale by the weight (``FastBackbone._norm``;
// on CPU the fused kernel of ``fused.cpp``, as the Python loop uses it)
at::Tensor rms(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (fusable(x)) return cadence::rms_norm(x, weight, eps);
  at::Tensor y = at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps);
  return weight * y.to(x.scalar_type());
}

// (x + d, rms(x + d)): the residual add and the next norm (``FastBackbone._add_norm``)
std::pair<at::Tensor, at::Tensor> add_rms(const at::Tensor& x, const at::Tensor& d, const at::Tensor& weight,
                                          double eps) {
  if (fusable(x) && d.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
      d.sizes() == x.sizes()) {
    auto r = cadence::add_rms_norm(x, d, weight, eps);
    return {r[0], r[1]};
  }
  at::Tensor s = x + d;
  return {s, rms(s, weight, eps)};
}

// x * cos + rotate_half(x) * sin for x (b, n, heads, head_dim) (``FastBackbone._rope``)
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (fusable(x)) return cadence::rope(x, cos, sin);
  const int64_t half = x.size(-1) / 2;
  at::Tensor swapped = at::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + swapped * sin;
}

// silu(gate) * up of gu = [gate | up]: the fused kernel where ``fusable``, else ATen
at::Tensor swiglu(const at::Tensor& gu) {
  if (fusable(gu)) return cadence::silu_mul(gu);
  auto parts = gu.chunk(2, -1);
  return at::silu(parts[0]) * parts[1];
}

// Wall time per phase of the layer loop, summed over layers and forwards, when switched on
// (``Layers.phase_times``; ``benchmarks/kernels/phase_cost.py``): where a verify forward's extra
// time over a one-token forward goes. Off, it costs one branch per phase.
struct PhaseClock {
  static constexpr int N = 9;
  static constexpr const char* names[N] = {"qkv", "rope", "attention", "o", "add_norm_1",
                                           "gate_up", "swiglu", "down", "add_norm_2"};
  bool on = false;
  std::array<double, N> total{};
  std::chrono::steady_clock::time_point last;
  void start() {
    if (on) last = std::chrono::steady_clock::now();
  }
  void lap(int phase) {  // the time since the last lap (or start) goes to ``phase``
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    total[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

class Layers {
 public:
  Layers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, bool qk_norm, at::Tensor embed,
         at::Tensor final_norm)
      : heads_(heads), kv_(kv_heads), hd_(head_dim), eps_(eps), qk_norm_(qk_norm), embed_(embed),
        final_norm_(final_norm) {}

  void add_layer(at::Tensor ln1, at::Tensor ln2, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> scales,
                 std::vector<std::optional<at::Tensor>> biases, std::vector<int64_t> ints) {
    // ints: per projection (qkv, o, gate_up, down) kind, in, out, min_rows, max_rows, group
    Layer layer;
    layer.ln1 = ln1;
    layer.ln2 = ln2;
    layer.q_norm = q_norm;
    layer.k_norm = k_norm;
    Lin* lins[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    cadence::set_linears(lins, 4, weights, scales, biases, ints);
    layers_.push_back(std::move(layer));
  }

  // input_ids: (b, n); cos, sin: (b, n, 1, head_dim); k_cache, v_cache: (layers, b, kv,
  // capacity, head_dim) or undefined (no cache: attend to the new tokens only); the new
  // keys/values go to [past, past + n) and attention reads [0, keys). mask: undefined, a
  // bool mask (plain) or an additive folded one (folded). folded: grouped-query attention
  // with the query heads folded into rows (``consistent.grouped_sdpa``), queries padded to
  // min_queries rows (``consistent.attend``). attend: None for the above, else a Python
  // callable ``attend(layer, q, k, v)`` (``FastBackbone._attention`` / ``_path_attention``,
  // ``forward_rows``' forms) that stores and attends itself; the cache arguments are then
  // unused. lists: (prefix, extra, count) of ``consistent.key_lists``: the new entries are
  // stored at [past, past + n) and each row attends its listed slots (``listed_attention``);
  // mask, keys, folded and min_queries are then unused. taps / tap_out: tap_out (b, n,
  // len(taps), hidden) receives the residual stream after each layer taps[j] (1-based) in
  // column j (``FastBackbone`` taps); an empty list and None tap nothing. Returns (b, n,
  // hidden) after the final norm.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& cos, const at::Tensor& sin,
                     const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                     int64_t past, int64_t keys, const std::optional<at::Tensor>& mask, bool folded, bool causal,
                     int64_t min_queries, bool blocked, const pybind11::object& attend,
                     const std::optional<std::vector<at::Tensor>>& lists, const std::vector<int64_t>& taps,
                     const std::optional<at::Tensor>& tap_out) const {
    c10::InferenceMode guard;
    const int64_t b = input_ids.size(0), n = input_ids.size(1);
    const int64_t H = heads_, KV = kv_, hd = hd_;
    at::Tensor x = at::embedding(embed_, input_ids);
    at::Tensor h = rms(x, layers_.empty() ? final_norm_ : layers_[0].ln1, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      clock_.start();
      at::Tensor qkv = L.qkv(h, blocked);
      clock_.lap(0);
      at::Tensor q, k;
      if (qk_norm_) {
        q = rope(rms(qkv.narrow(-1, 0, H * hd).view({b, n, H, hd}), *L.q_norm, eps_), cos, sin);
        k = rope(rms(qkv.narrow(-1, H * hd, KV * hd).view({b, n, KV, hd}), *L.k_norm, eps_), cos, sin);
      } else {
        at::Tensor qk = rope(qkv.narrow(-1, 0, (H + KV) * hd).view({b, n, H + KV, hd}), cos, sin);
        q = qk.narrow(2, 0, H);
        k = qk.narrow(2, H, KV);
      }
      at::Tensor v = qkv.narrow(-1, (H + KV) * hd, KV * hd).view({b, n, KV, hd});
      q = q.transpose(1, 2);
      k = k.transpose(1, 2);
      v = v.transpose(1, 2);
      clock_.lap(1);
      const at::Tensor att = attend.is_none()
          ? (lists ? listed(i, q, k, v, *k_cache, *v_cache, past, *lists)
                   : attention(i, q, k, v, k_cache, v_cache, past, keys, mask, folded, causal, min_queries))
          : attend(static_cast<int64_t>(i), q, k, v).cast<at::Tensor>();
      clock_.lap(2);
      const at::Tensor o = L.o(att.transpose(1, 2).reshape({b, n, H * hd}), blocked);
      clock_.lap(3);
      std::tie(x, h) = add_rms(x, o, L.ln2, eps_);
      clock_.lap(4);
      const at::Tensor gu = L.gate_up(h, blocked);  // AMX_SWIGLU: already silu(gate) * up
      clock_.lap(5);
      const at::Tensor act = L.gate_up.kind == cadence::AMX_SWIGLU ? gu : swiglu(gu);
      clock_.lap(6);
      const at::Tensor down = L.down(act, blocked);
      clock_.lap(7);
      // the residual add and the next layer's first norm (the final norm after the last)
      std::tie(x, h) = add_rms(x, down, i + 1 < layers_.size() ? layers_[i + 1].ln1 : final_norm_, eps_);
      clock_.lap(8);
      for (size_t j = 0; j < taps.size(); ++j) {
        if (tap_out && taps[j] == static_cast<int64_t>(i) + 1) tap_out->select(2, static_cast<int64_t>(j)).copy_(x);
      }
    }
    return h;
  }

  // on: start summing wall time per phase (from zero); off: stop. Returns the sums so far in
  // seconds, by phase name (empty before the first switch on).
  std::vector<std::pair<std::string, double>> phase_times(bool on) {
    std::vector<std::pair<std::string, double>> out;
    for (int p = 0; p < PhaseClock::N; ++p) out.emplace_back(PhaseClock::names[p], clock_.total[p]);
    clock_.total = {};
    clock_.on = on;
    return out;
  }

 private:
  mutable PhaseClock clock_;  // ``phase_times``
  // the store, then attention of each row over its listed keys (``attention.cpp``): lists
  // = (prefix, extra, count) as ``listed_attention`` takes them, over the whole cache buffer
  at::Tensor listed(size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, int64_t past, const std::vector<at::Tensor>& lists) const {
    at::Tensor K = k_cache.select(0, i), V = v_cache.select(0, i);
    const int64_t n = q.size(2);
    store_rows(K, past, k);
    store_rows(V, past, v);
    return cadence::listed_attention(q, K, V, lists[0], lists[1], lists[2], 1.0 / std::sqrt(static_cast<double>(hd_)));
  }

  // cache (b, KV, capacity, hd) rows [past, past + n) = x (b, KV, n, hd): one memcpy per row
  // where the dtypes match and rows are contiguous (ATen's copy_ costs about 5 us a call, 0.3
  // ms a forward), else copy_; the same values either way
  static void store_rows(const at::Tensor& cache, int64_t past, const at::Tensor& x) {
    const int64_t b = x.size(0), KV = x.size(1), n = x.size(2), hd = x.size(3);
    TORCH_CHECK(cache.size(0) == b && cache.size(1) == KV && cache.size(3) == hd && past >= 0 &&
                    past + n <= cache.size(2),
                "kv cache: rows [", past, ", ", past + n, ") do not fit a cache of ", cache.size(2));
    if (cache.scalar_type() == at::kHalf && x.scalar_type() == at::kFloat && x.stride(3) == 1 && cache.stride(3) == 1) {
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t h = 0; h < KV; ++h)
          for (int64_t r = 0; r < n; ++r)
            cadence::to_half_saturated(x.data_ptr<float>() + bi * x.stride(0) + h * x.stride(1) + r * x.stride(2),
                                       cache.data_ptr<at::Half>() + bi * cache.stride(0) + h * cache.stride(1) +
                                           (past + r) * cache.stride(2),
                                       hd);
      return;
    }
    if (x.scalar_type() != cache.scalar_type() || x.stride(3) != 1 || cache.stride(3) != 1) {
      cache.narrow(2, past, n).copy_(x);
      return;
    }
    const int64_t bytes = hd * x.element_size();
    char* to = static_cast<char*>(cache.data_ptr());
    const char* from = static_cast<const char*>(x.data_ptr());
    const int64_t es = x.element_size();
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t h = 0; h < KV; ++h)
        for (int64_t r = 0; r < n; ++r)
          std::memcpy(to + es * (bi * cache.stride(0) + h * cache.stride(1) + (past + r) * cache.stride(2)),
                      from + es * (bi * x.stride(0) + h * x.stride(1) + r * x.stride(2)), bytes);
  }

  // the store and the attention of ``FastBackbone._native_forward``'s forms (see ``forward``);
  // q: (b, H, n, hd), k, v: (b, KV, n, hd) -> (b, H, n, hd)
  at::Tensor attention(size_t i, const at::Tensor& q, at::Tensor k, at::Tensor v,
                       const std::optional<at::Tensor>& k_cache, const std::optional<at::Tensor>& v_cache,
                       int64_t past, int64_t keys, const std::optional<at::Tensor>& mask, bool folded, bool causal,
                       int64_t min_queries) const {
    const int64_t b = q.size(0), n = q.size(2), H = heads_, KV = kv_, hd = hd_;
    const bool gqa = H != KV;
    if (k_cache) {
      at::Tensor K = k_cache->select(0, i), V = v_cache->select(0, i);
      store_rows(K, past, k);
      store_rows(V, past, v);
      k = K.narrow(2, 0, keys);
      v = V.narrow(2, 0, keys);
      if (k.scalar_type() != q.scalar_type()) {  // a float16 cache: attend to what it holds, widened
        k = k.to(q.scalar_type());
        v = v.to(q.scalar_type());
      }
    }
    if (!folded) return at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, std::nullopt, gqa);
    at::Tensor qq = q;
    if (n < min_queries) qq = at::cat({q, q.narrow(2, n - 1, 1).expand({-1, -1, min_queries - n, -1})}, 2);
    const int64_t m = qq.size(2);
    at::Tensor att = gqa ? at::scaled_dot_product_attention(qq.reshape({b, KV, H / KV * m, hd}), k, v, mask)
                               .view({b, H, m, hd})
                         : at::scaled_dot_product_attention(qq, k, v, mask);
    return m != n ? att.narrow(2, 0, n) : att;
  }

  int64_t heads_, kv_, hd_;
  double eps_;
  bool qk_norm_;
  at::Tensor embed_, final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Layers>(m, "Layers", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, double, bool, at::Tensor, at::Tensor>())
      .def("add_layer", &Layers::add_layer)
      .def("phase_times", &Layers::phase_times)
      .def("forward", &Layers::forward);
  // module_local: builds for other instruction sets (``native.build_variant``) load beside this one
  pybind11::class_<cadence::DraftBlock>(m, "DraftBlock", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, double, std::optional<at::Tensor>, at::Tensor>())
      .def("set_linears", &cadence::DraftBlock::set_linears)
      .def("forward", &cadence::DraftBlock::forward);
  m.def("add_rms_norm", &cadence::add_rms_norm, "[x + d, weight * rms_norm(x + d)] in one call (fused.cpp)");
  m.def("rms_norm", &cadence::rms_norm, "weight * rms_norm(x) in x's dtype, one pass per row (fused.cpp)");
  m.def("listed_attention_amx", &cadence::amx_listed_on,
        "whether bf16 listed_attention runs on AMX tiles in this process (attention_amx.cpp)");
  m.def("set_listed_attention_amx", &cadence::set_amx_listed, "tests only: AMX path on/off; returns the previous");
  m.def("listed_attention", &cadence::listed_attention,
        "attention of each row over its listed keys, row-consistent (attention.cpp)");
  m.def("amx_gemm_available", &cadence::amx_gemm_available, "whether amx_linear runs here (gemm_amx.cpp)");
  m.def("amx_linear", &cadence::amx_linear, "x W^T (+ b) on AMX tiles, W in kernels.amx_pack's layout; swiglu: "
        "silu(gate) * up of swiglu_rows-interleaved [gate; up] (gemm_amx.cpp)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), pybind11::arg("out"),
        pybind11::arg("swiglu") = false);
  m.def("q_linear", &cadence::q_linear, "x W^T (+ b) for fp32 x, W in a GGUF file's blocks (gemm_q.cpp)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("out"), pybind11::arg("bias"));
  m.def("q_dequantize", &cadence::q_dequantize, "GGUF blocks -> fp32, gguf.quants.dequantize's bits (gemm_q.cpp)");
  m.def("q_row_bytes", &cadence::q_row_bytes, "bytes of a row of K weights of a GGML type, -1 if unread (gemm_q.cpp)");
  m.def("q_pack", &cadence::q_pack, "GGUF blocks -> the integer kernel's layout, or as they are (gemm_qi.cpp)");
  m.def("q_unpack", &cadence::q_unpack, "q_pack's inverse (gemm_qi.cpp)");
  m.def("q_packed_type", &cadence::q_packed_type, "the type q_pack makes of a GGML type's rows (gemm_qi.cpp)");
  m.def("q_prefetch", &cadence::q_prefetch, "q_linear's software prefetch distance in bytes (gemm_qi.cpp)");
  m.def("set_q_prefetch", &cadence::set_q_prefetch, "benchmarks: q_linear's prefetch distance (0: off); returns the previous");
  m.def("q_amx", &cadence::q_amx_on, "whether q_linear runs calls of 2+ rows on AMX int8 tiles (gemm_qi.cpp)");
  m.def("set_q_amx", &cadence::set_q_amx, "tests only: q_linear's AMX int8 path on/off; returns the previous");
  m.def("q_isa", &cadence::q_isa, "the vector code q_linear was built to: avx512, avx2 or generic (gemm_q.cpp)");
  m.def("argmax_rows", &cadence::argmax_rows, "x.argmax(-1) of CPU rows, one vector pass (fused.cpp)");
  m.def("kv_half", &cadence::kv_half, "float32 -> float16, saturated: a float16 KV cache's store (fused.cpp)");
  m.def("silu_mul", &cadence::silu_mul, "silu(gate) * up of [gate | up] rows, one pass (fused.cpp)");
  m.def("rope", &cadence::rope, "x * cos + rotate_half(x) * sin, one pass per row (fused.cpp)");
}
