// Products of fp32 activations with weights kept in a GGUF file's own blocks (``gemm_q.cpp``).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>

namespace cadence {

// GGML type ids (``gguf.GGMLQuantizationType``) of the block formats these kernels read
enum QType : int64_t { Q_F32 = 0, Q_F16 = 1, Q_Q4_0 = 2, Q_Q4_1 = 3, Q_Q8_0 = 8 };
// or'ed onto Q4_0 / Q4_1 / Q8_0: the rows are ``q_pack``ed and ``q_linear`` runs the integer kernel
constexpr int64_t Q_PACKED = 256;

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

// The type ``q_pack`` makes of rows of K weights of ``type``: type | Q_PACKED where the integer
// kernel (``gemm_qi.cpp``) runs them (Q4_0, Q4_1, Q8_0, any K the
// file holds, an AVX2 + FMA + F16C build), else ``type`` itself (the fp32 kernel of this file).
int64_t q_packed_type(int64_t type, int64_t K);

// w (N, q_row_bytes(type, K)) in the file's layout -> the same bytes in ``gemm_qi.cpp``'s layout
// (rows of the same length), or w itself where ``q_packed_type`` keeps ``type``.
at::Tensor q_pack(const at::Tensor& w, int64_t type, int64_t K);

// ``q_pack``'s inverse: packed rows (type ``packed``) -> the file's layout.
at::Tensor q_unpack(const at::Tensor& w, int64_t packed, int64_t K);

// ``q_linear`` on packed rows (``gemm_qi.cpp``): x2 (m, K) fp32 contiguous, y (m, out) to fill.
at::Tensor q_linear_packed(const at::Tensor& x2, const at::Tensor& w, int64_t packed, int64_t out, const float* bias,
                           at::Tensor y);

// q_linear's software prefetch distance in bytes (``gemm_qi.cpp``; 0: off;
// CADENCE_GGUF_PREFETCH, default 8192). Timing only: the bits never depend on it.
int64_t q_prefetch();
// benchmarks and tests: set it (negative: 0); returns the previous
int64_t set_q_prefetch(int64_t bytes);

// Whether ``q_linear`` runs calls of 2 rows or more on AMX int8 tiles (``gemm_qi.cpp``: a build
// with AMX-INT8, Linux's permission, CADENCE_AMX not 0); the bits are those of the vector code.
bool q_amx_on();
// tests only: the AMX int8 path on / off (where it can run); returns the previous setting.
bool set_q_amx(bool on);

// Which vector code ``q_linear`` was compiled to: "avx512", "avx2" or "generic".
std::string q_isa();

}  // namespace cadence
