// Small-row bf16 matrix products on AMX tiles (``gemm_amx.cpp``).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace cadence {

// Whether this build and process can run ``amx_linear``: built for a CPU with AMX and
// AVX512-BF16, the kernel granted tile data, CADENCE_AMX not 0.
bool amx_gemm_available();

// x (..., K) bf16 times the weight W (N, K) that ``kernels.amx_pack`` laid out as packed
// (N/32 rounded up, K/32 rounded up, 2, 16, 32) bf16, plus bias (N) if given -> (..., N) bf16.
// swiglu: W is [gate; up] interleaved by ``kernels.swiglu_rows`` (N a multiple of 32) ->
// (..., N / 2) = silu(gate) * up, the bits of the plain product then ``silu_mul``.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out, bool swiglu = false);

}  // namespace cadence
