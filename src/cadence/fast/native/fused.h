// Fused RMSNorm, RoPE and SwiGLU gate (``fused.cpp``).
#pragma once

#include <torch/extension.h>

namespace cadence {

// weight * rms_norm(x) over the last dimension, in x's dtype (float32 or bfloat16).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// [x + d, weight * rms_norm(x + d)]: the residual add (rounded to x's dtype, as ATen's) and the
// next norm in one call (the same bits as the two calls).
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& weight, double eps);

// x * cos + rotate_half(x) * sin for x (b, n, heads, head_dim), cos/sin (b, n, 1, head_dim).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// silu(gate) * up for gu (..., 2 * I) = [gate | up] -> (..., I), in gu's dtype (the SwiGLU MLP).
at::Tensor silu_mul(const at::Tensor& gu);

// x.argmax(-1) for CPU float32 / bfloat16 rows: index of each row's first maximum (NaN counts as
// the maximum). torch's CPU argmax takes about 1.3 ns a value; this one a vector pass and a scan.
at::Tensor argmax_rows(const at::Tensor& x);

// to[i] = float16(clamp(from[i], -65504, 65504)) for i < n, rounded to nearest even: a float16
// KV cache's store (``FastBackbone`` kv_dtype float16). Saturating, so a value past float16's range
// stays finite (NaN stays NaN); the same bits as torch's x.clamp(-65504, 65504).to(torch.float16).
void to_half_saturated(const float* from, at::Half* to, int64_t n);

// x (float32) -> float16 through ``to_half_saturated``, same shape (contiguous)
at::Tensor kv_half(const at::Tensor& x);

}  // namespace cadence
