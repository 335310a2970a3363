// Products of fp32 activations with weights kept in a GGUF file's own blocks (``gemm_q.cpp``).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

namespace cadence {

// GGML type ids (``gguf.GGMLQuantizationType``) of the block formats these kernels read
enum QType : int64_t { Q_F32 = 0, Q_F16 = 1, Q_Q4_0 = 2, Q_Q4_1 = 3, Q_Q8_0 = 8 };

// Bytes of one row of K weights in format ``type``; -1 for a type these kernels do not read.
int64_t q_row_bytes(int64_t type, int64_t K);

// x (..., K) fp32 times W (N, K) stored as blocks: w (N, q_row_bytes(type, K)) uint8, row j
// holding output j's weights in the file's block layout, plus bias (N) fp32 if given ->
// (..., N) fp32. A row's bits do not depend on the other rows of x, on the thread count or on
// the instruction set the extension was built for (AVX-512, AVX2 + FMA, plain x86-64).
at::Tensor q_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out,
                    const std::optional<at::Tensor>& bias);

// The weights w as fp32 (N, K): exactly ``gguf.quants.dequantize`` of the same bytes.
at::Tensor q_dequantize(const at::Tensor& w, int64_t type, int64_t K);

// Which vector code ``q_linear`` was compiled to: "avx512", "avx2" or "generic".
std::string q_isa();

}  // namespace cadence
