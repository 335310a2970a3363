// Fused RMSNorm and RoPE (``fused.cpp``).
#pragma once

#include <torch/extension.h>

namespace cadence {

// weight * rms_norm(x) over the last dimension, in x's dtype (float32 or bfloat16).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// x * cos + rotate_half(x) * sin for x (b, n, heads, head_dim), cos/sin (b, n, 1, head_dim).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace cadence
