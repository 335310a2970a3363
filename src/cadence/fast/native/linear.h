// ``fast.kernels.Linear`` in C++: the projections' kinds (aten, oneDNN, int8, int4, AMX, GGUF blocks) with its row
// padding and blocking, for the C++ loops (``layers.cpp``, ``draft_block.cpp``). Same calls,
// same arguments as the Python class: same bits.
#pragma once

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include "gemm_amx.h"
#include "gemm_q.h"

#include <optional>
#include <string>
#include <vector>

namespace cadence {

// AMX_SWIGLU: [gate; up] -> silu(gate) * up; GGUF: fp32 x times a GGUF file's blocks, ``group`` the GGML type
enum Kind : int64_t { ATEN = 0, ONEDNN = 1, INT8 = 2, INT4 = 3, AMX = 4, AMX_SWIGLU = 5, GGUF = 6 };

inline const c10::OperatorHandle& onednn_linear() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

inline at::Tensor onednn_call(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  // boxed: the op's unboxed signature is private to ATen; a boxed call costs about 1 us
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  onednn_linear().callBoxed(&stack);
  return stack[0].toTensor();
}

struct Lin {
  int64_t kind = ATEN;
  at::Tensor w, scale;
  std::optional<at::Tensor> bias;
  int64_t in = 0, out = 0, min_rows = 1, max_rows = 0, group = 32;

  // GGUF blocks take fp32 activations: a bf16 caller (quantized drafting weights) is cast in and out
  at::Tensor gguf(const at::Tensor& x) const {
    if (x.scalar_type() == at::kFloat) return q_linear(x, w, group, out, bias);
    return q_linear(x.to(at::kFloat), w, group, out, bias).to(x.scalar_type());
  }

  // x2: (m, in) contiguous -> (m, out); padded to min_rows rows (``Linear._rows``)
  at::Tensor rows(at::Tensor x2) const {
    const int64_t m = x2.size(0);
    if (m < min_rows) {
      x2 = at::cat({x2, x2.narrow(0, m - 1, 1).expand({min_rows - m, -1})});
    }
    at::Tensor y;
    if (kind == AMX || kind == AMX_SWIGLU) return amx_linear(x2, w, bias, out, kind == AMX_SWIGLU);
    if (kind == GGUF) return gguf(x2);
    if (kind == INT8 || kind == INT4) {
      y = kind == INT8 ? at::_weight_int8pack_mm(x2.contiguous(), w, scale)
                       : at::_weight_int4pack_mm_for_cpu(x2.contiguous(), w, group, scale);
      if (bias) y = y + *bias;
    } else {
      y = onednn_call(x2.contiguous(), w, bias);
    }
    return y.narrow(0, 0, m);
  }

  // ``Linear.__call__``; ``blocked``: honour max_rows (``FastBackbone._block_rows``)
  at::Tensor operator()(const at::Tensor& x, bool blocked) const {
    if (kind == ATEN) return at::linear(x, w, bias);
    if (kind == AMX || kind == AMX_SWIGLU) return amx_linear(x, w, bias, out, kind == AMX_SWIGLU);  // any row count
    if (kind == GGUF) return gguf(x);  // any row count: rows are independent
    const int64_t cap = blocked ? max_rows : 0;
    const int64_t n = x.numel() / in;
    if (kind == ONEDNN && min_rows <= n && x.is_contiguous() && (!cap || n <= cap)) {
      return onednn_call(x, w, bias);
    }
    auto lead = x.sizes().vec();
    lead.back() = out;
    at::Tensor x2 = x.reshape({-1, in});
    if (!cap || n <= cap) return rows(x2).view(lead);
    at::Tensor y = x2.new_empty({n, out});
    for (int64_t i = 0; i < n; i += cap) {
      const int64_t len = std::min(cap, n - i);
      y.narrow(0, i, len).copy_(rows(x2.narrow(0, i, len)));
    }
    return y.view(lead);
  }
};

// Fill ``lins`` from Python's ``kernels.Linear`` fields: weights, scales and biases per
// projection, and 6 ints each (kind, in, out, min_rows, max_rows, group; ``native.linear_ints``)
inline void set_linears(Lin* const* lins, size_t n, const std::vector<at::Tensor>& weights,
                        const std::vector<std::optional<at::Tensor>>& scales,
                        const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& ints) {
  TORCH_CHECK(weights.size() == n && scales.size() == n && biases.size() == n && ints.size() == 6 * n,
              "set_linears: ", n, " projections");
  for (size_t j = 0; j < n; ++j) {
    Lin& l = *lins[j];
    l.w = weights[j];
    if (scales[j]) l.scale = *scales[j];
    l.bias = biases[j];
    const int64_t* v = ints.data() + 6 * j;
    l.kind = v[0], l.in = v[1], l.out = v[2], l.min_rows = v[3], l.max_rows = v[4], l.group = v[5];
  }
}

}  // namespace cadence
