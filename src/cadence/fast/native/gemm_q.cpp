// y = x W^T (+ b) for fp32 activations of a few rows, W read from a GGUF file's own blocks
// (Q4_0, Q4_1, Q8_0; F16 and F32 rows too), the weights streamed once for all rows.
//
// Why: on CPUs without native bf16 the fast decoder runs fp32. A Q4_1 file expanded to fp32
// streams 4 bytes per weight per token; its blocks stream 0.625 (Q4_1), 0.5625 (Q4_0) or
// 1.0625 (Q8_0). Stock PyTorch's small-row fp32 products are slow on such CPUs besides.
//
// Block layouts (``gguf.quants``; 32 weights per block, fp16 little-endian scales):
//   Q4_0: d (2 bytes), qs (16 bytes): weight i = (q_i - 8) * d, where q_i is the low nibble
//         of qs[i] for i < 16 and the high nibble of qs[i - 16] for i >= 16;
//   Q4_1: d, m (2 + 2 bytes), qs (16 bytes): weight i = q_i * d + m (nibbles as Q4_0);
//   Q8_0: d (2 bytes), qs (32 int8): weight i = qs[i] * d.
// Worked example (Q4_1, K = 576: 18 blocks of 20 bytes, 360 bytes a row): weight (j, 37) is
// in row j's block 1 (bytes 20..39 of the row) at i = 37 - 32 = 5 < 16: the low nibble of
// qs[5], byte 20 + 4 + 5 = 29 of the row; weight (j, 53) is at i = 21 >= 16: the high nibble
// of qs[21 - 16] = qs[5], the same byte 29.
// Every weight is decoded to fp32 with the same operations as ``gguf.quants.dequantize``
// (fp16 -> fp32 exactly, then one multiply, and for Q4_1 one add, each rounded on its own; the
// build has -ffp-contract=off), so the weights are those of the dequantized file, bit for bit
// (``q_dequantize``, tests/test_gemm_q.py).
//
// Arithmetic of one output y[r][j] (fp32 throughout):
//   16 lane sums: lane l accumulates x[r][k] * w[j][k] for k = l, l + 16, l + 32, ... in
//   order by fused multiply-add from 0; then the lanes are added pairwise 8, 4, 2 and 1 apart
//   (``total``, the additions of ``vec::lane_total``); then + bias[j] if there is one.
// Nothing in it depends on the other rows, the row tile a row falls in, the column group or
// the thread: a row's bits are those of a one-row call. The lanes are the lanes of ``vec::v16``
// (one AVX-512 register, two AVX2 ones, or scalars with std::fma), so AVX-512, AVX2 + FMA and
// plain x86-64 builds give the same bits too.
//
// Work: columns in groups of G = 8. A thread takes a contiguous range of groups; per group it
// decodes the 8 weight rows to an fp32 scratch (8 x K floats: 18 KiB for K = 576), once per
// call, then runs every row of x against them in tiles of R rows x C columns (R x C vector
// accumulators held in registers: AVX-512 up to 4 x 4 or 2 x 8, AVX2 2 x 2 or 1 x 4). Example:
// N = 49152 (SmolLM2's LM head), 2 threads: 6144 groups, groups 0..3071 to thread 0; m = 7
// rows on AVX-512: row tiles [0, 4) and [4, 7) (R = 4 then 3). F32 weights are read in place.
//
// Knows: the block formats above, fp32 activations. Does not know which weights these are or
// where they came from: ``fast.gguf`` reads the file and ``kernels.Linear`` (kind ``gguf``) calls this.

#include "gemm_q.h"

#define CADENCE_VEC_GENERIC  // byte vectors converted by __builtin_convertvector: GCC's vector form
#include "vec16.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace cadence {

namespace {

using vec::v16;
using vec::i16;
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t s8x16 __attribute__((vector_size(16)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t G = 8;    // columns decoded together

// fp16 bits -> fp32, exactly (every fp16 value is an fp32 value)
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    const float f = static_cast<float>(m) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q_Q4_0: return 18;
    case Q_Q4_1: return 20;
    case Q_Q8_0: return 34;
    case Q_F16: return 64;
    case Q_F32: return 128;
    default: return -1;
  }
}

// 16 nibbles as int32 lanes: the low ones (weights 0..15 of a block) and the high ones (16..31)
inline void nibbles(const uint8_t* qs, i16& lo, i16& hi) {
  u8x16 q;
  std::memcpy(&q, qs, 16);
  const i16 v = __builtin_convertvector(q, i16);
  lo = v & 15;
  hi = v >> 4;
}

// one block of 32 weights -> out[0..31], the operations of ``gguf.quants`` (see the top)
inline void decode_block(int64_t type, const uint8_t* b, float* out) {
  switch (type) {
    case Q_Q4_0: {
      const float d = half_to_float(u16_at(b));
      i16 lo, hi;
      nibbles(b + 2, lo, hi);
      vec::store(out, __builtin_convertvector(lo - 8, v16) * d);
      vec::store(out + 16, __builtin_convertvector(hi - 8, v16) * d);
      return;
    }
    case Q_Q4_1: {
      const float d = half_to_float(u16_at(b)), m = half_to_float(u16_at(b + 2));
      i16 lo, hi;
      nibbles(b + 4, lo, hi);
      vec::store(out, __builtin_convertvector(lo, v16) * d + m);  // two roundings (no contraction)
      vec::store(out + 16, __builtin_convertvector(hi, v16) * d + m);
      return;
    }
    case Q_Q8_0: {
      const float d = half_to_float(u16_at(b));
      s8x16 q0, q1;
      std::memcpy(&q0, b + 2, 16);
      std::memcpy(&q1, b + 18, 16);
      vec::store(out, __builtin_convertvector(__builtin_convertvector(q0, i16), v16) * d);
      vec::store(out + 16, __builtin_convertvector(__builtin_convertvector(q1, i16), v16) * d);
      return;
    }
    case Q_F16: {
#if defined(__AVX512F__)
      _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
      _mm512_storeu_ps(out + 16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32))));
#elif defined(__F16C__)
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(out + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i))));
#else
      for (int i = 0; i < 32; ++i) out[i] = half_to_float(u16_at(b + 2 * i));
#endif
      return;
    }
    default:  // Q_F32
      std::memcpy(out, b, 128);
  }
}

// one row of K weights (K / 32 blocks) -> out[0..K)
inline void decode_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
  const int64_t bb = block_bytes(type);
  for (int64_t k = 0; k < K; k += QK, row += bb) decode_block(type, row, out + k);
}

// the lanes of x added pairwise 8, 4, 2 and 1 apart: ``vec::lane_total``'s additions
inline float total(v16 x) {
  v8 a[2];
  std::memcpy(a, &x, sizeof x);
  const v8 s8 = a[0] + a[1];  // lane l + lane l + 8
  v4 b[2];
  std::memcpy(b, &s8, sizeof s8);
  const v4 s4 = b[0] + b[1];  // + 4 apart
  const float l0 = s4[0] + s4[2], l1 = s4[1] + s4[3];  // + 2 apart
  return l0 + l1;
}

#if defined(__AVX512F__)
constexpr int RMAX = 4;  // rows per tile; columns per tile below (``cols``)
constexpr int cols(int r) { return r <= 2 ? 8 : 4; }
#else
constexpr int RMAX = 2;  // a v16 is two AVX2 registers: at most 8 registers of accumulators
constexpr int cols(int r) { return r == 1 ? 4 : 2; }
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA: a v16 accumulator as two ymm registers, lanes 0-7 and 8-15 (GCC keeps
// generic 64-byte vectors on the stack here, a load and a store per fused multiply-add);
// the same lanes, the same operations, the same order as the generic ``tile`` below
inline float total(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);  // lane l + lane l + 8
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // + 4 apart
  float f[4];
  _mm_storeu_ps(f, s4);
  return (f[0] + f[2]) + (f[1] + f[3]);  // + 2 apart, then + 1
}

template <int R, int C>
inline void tile(const float* x, int64_t K, const float* const* w, const float* bias, float* y, int64_t N) {
  __m256 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m256 xl[R], xh[R];
    for (int r = 0; r < R; ++r) xl[r] = _mm256_loadu_ps(x + r * K + k), xh[r] = _mm256_loadu_ps(x + r * K + k + 8);
    for (int c = 0; c < C; ++c) {
      const __m256 wl = _mm256_loadu_ps(w[c] + k), wh = _mm256_loadu_ps(w[c] + k + 8);
      for (int r = 0; r < R; ++r) {
        lo[r][c] = _mm256_fmadd_ps(xl[r], wl, lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xh[r], wh, hi[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float t = total(lo[r][c], hi[r][c]);
      y[r * N + c] = bias ? t + bias[c] : t;
    }
}
#else
// y[r0 + r][c0 + c] for r < R, c < C: x rows at x (stride K), weight rows w[c]
template <int R, int C>
inline void tile(const float* x, int64_t K, const float* const* w, const float* bias, float* y, int64_t N) {
  v16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = v16{};
  for (int64_t k = 0; k < K; k += 16) {
    v16 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vec::load(x + r * K + k);
    for (int c = 0; c < C; ++c) {
      const v16 wv = vec::load(w[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = vec::fma(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * N + c] = bias ? total(acc[r][c]) + bias[c] : total(acc[r][c]);
}
#endif

// rows [r0, r0 + R) against the group's nc weight rows: tiles of C columns, then one at a time
template <int R>
inline void rows_against(const float* x, int64_t K, const float* const* w, int64_t nc, const float* bias, float* y,
                         int64_t N) {
  constexpr int C = cols(R);
  int64_t c = 0;
  for (; c + C <= nc; c += C) tile<R, C>(x, K, w + c, bias ? bias + c : nullptr, y + c, N);
  for (; c < nc; ++c) tile<R, 1>(x, K, w + c, bias ? bias + c : nullptr, y + c, N);
}

struct Problem {
  const float* x;     // (m, K)
  const uint8_t* w;   // (N, row bytes)
  const float* bias;  // (N) or null
  float* y;           // (m, N)
  int64_t m, N, K, type, row_bytes;
};

// column groups [g0, g1)
void run_groups(const Problem& p, int64_t g0, int64_t g1) {
  std::vector<float> scratch(p.type == Q_F32 ? 0 : G * p.K);
  const float* w[G];
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t j0 = g * G, nc = std::min<int64_t>(G, p.N - j0);
    for (int64_t c = 0; c < nc; ++c) {
      const uint8_t* row = p.w + (j0 + c) * p.row_bytes;
      if (p.type == Q_F32) {
        w[c] = reinterpret_cast<const float*>(row);
      } else {
        decode_row(p.type, row, p.K, scratch.data() + c * p.K);
        w[c] = scratch.data() + c * p.K;
      }
    }
    const float* bias = p.bias ? p.bias + j0 : nullptr;
    int64_t r = 0;
    for (; r + RMAX <= p.m; r += RMAX) rows_against<RMAX>(p.x + r * p.K, p.K, w, nc, bias, p.y + r * p.N + j0, p.N);
    const int64_t left = p.m - r;
    const float* xr = p.x + r * p.K;
    float* yr = p.y + r * p.N + j0;
#if defined(__AVX512F__)
    if (left == 3) rows_against<3>(xr, p.K, w, nc, bias, yr, p.N);
    if (left == 2) rows_against<2>(xr, p.K, w, nc, bias, yr, p.N);
#endif
    if (left == 1) rows_against<1>(xr, p.K, w, nc, bias, yr, p.N);
  }
}

void check_weights(const at::Tensor& w, int64_t type, int64_t K) {
  if (type & Q_PACKED) {
    const int64_t base = type & ~Q_PACKED;
    TORCH_CHECK(q_packed_type(base, K) == type, "q_linear: packed type ", type, " does not run here for ", K, " inputs");
    type = base;
  }
  TORCH_CHECK(block_bytes(type) > 0, "q_linear: GGML type ", type, " is not one of F32, F16, Q4_0, Q4_1, Q8_0");
  TORCH_CHECK(K % QK == 0, "q_linear: the input size ", K, " is not a multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "q_linear: weights must be a contiguous (out, row bytes) uint8 CPU tensor");
  TORCH_CHECK(w.size(1) == q_row_bytes(type, K), "q_linear: rows of ", w.size(1), " bytes for ", K,
              " inputs of type ", type, " (expected ", q_row_bytes(type, K), ")");
}

}  // namespace

int64_t q_row_bytes(int64_t type, int64_t K) {
  const int64_t bb = block_bytes(type & ~Q_PACKED);
  return bb < 0 ? -1 : K / QK * bb;
}

at::Tensor q_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out,
                    const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1);
  check_weights(w, type, K);
  TORCH_CHECK(w.size(0) == out, "q_linear: ", w.size(0), " weight rows for ", out, " outputs");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "q_linear: fp32 CPU input expected");
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t m = x2.size(0);
  auto lead = x.sizes().vec();
  lead.back() = out;
  at::Tensor y = at::empty({m, out}, x.options());
  if (m == 0 || out == 0) return y.view(lead);
  at::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->numel() == out, "q_linear: bias of ", bias->numel(), " for ", out, " outputs");
    b32 = bias->to(at::kFloat).contiguous();
  }
  if (type & Q_PACKED) return q_linear_packed(x2, w, type, out, bias ? b32.data_ptr<float>() : nullptr, y).view(lead);
  const Problem p{x2.data_ptr<float>(), w.data_ptr<uint8_t>(), bias ? b32.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), m, out, K, type, w.size(1)};
  const int64_t groups = (out + G - 1) / G;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, groups, (groups + threads - 1) / threads, [&](int64_t g0, int64_t g1) { run_groups(p, g0, g1); });
  return y.view(lead);
}

at::Tensor q_dequantize(const at::Tensor& w, int64_t type, int64_t K) {
  check_weights(w, type, K);
  if (type & Q_PACKED) return q_dequantize(q_unpack(w, type, K), type & ~Q_PACKED, K);
  const int64_t n = w.size(0), rb = w.size(1);
  at::Tensor out = at::empty({n, K}, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) decode_row(type, src + j * rb, K, dst + j * K);
  });
  return out;
}

std::string q_isa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return q_amx_on() ? "avx512-vnni-amx" : "avx512-vnni";  // -amx: trees on AMX int8 tiles (gemm_qi.cpp)
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace cadence
