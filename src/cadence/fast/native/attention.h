// Row-consistent attention over listed keys (``attention.cpp``).
#pragma once

#include <torch/extension.h>

namespace cadence {

// q: (b, H, n, D); k, v: (b, KV, L, D), H a multiple of KV; prefix, count: (b, n) int32;
// extra: (b, n, E) int32. Row (bi, r) attends keys [0, prefix) then extra[bi, r, :count],
// in that order -> (b, H, n, D) in q's dtype.
at::Tensor listed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prefix,
                            const at::Tensor& extra, const at::Tensor& count, double scale);

}  // namespace cadence
