// The lane arithmetic the fused kernels share with the GEMM epilogues (``fused.cpp``,
// ``gemm_amx.cpp``): rounding float lanes to bf16 as c10 does, and the SwiGLU gate's
// silu. One definition, so a gate computed in a GEMM's epilogue has the bits of the
// stand-alone ``silu_mul``.
#pragma once

#include <torch/extension.h>

#include "vec16.h"

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cadence {
namespace fm {

// x rounded to T, as float lanes: bf16 rounds to nearest even on the bits (NaN -> 0x7FC0,
// as c10::BFloat16 does); fp32 as is
inline vec::v16 round_to(vec::v16 x, float*) { return x; }
inline vec::u16w bf16_bits_slow(vec::v16 x) {  // the rounding as integer lanes (any input)
  const vec::u16w u = vec::as_u16(x);
  const vec::u16w rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return vec::select(x != x, vec::u16w{} + 0x7FC00000u, rounded);
}
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define CADENCE_BF16_CVT 1
// AVX512-BF16's conversion rounds normal numbers (and zeros, infinities) to nearest even as
// above in one instruction; it flushes denormals to zero and keeps NaN payloads, so vectors
// holding those take the integer path (the same bits either way)
inline bool ordinary(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) == 0; }  // no NaN, denormal
#endif
inline vec::v16 round_to(vec::v16 x, at::BFloat16*) {
#if defined(CADENCE_BF16_CVT)
  const __m512 v = reinterpret_cast<__m512>(x);
  if (ordinary(v)) {
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))), 16);
    return reinterpret_cast<vec::v16>(w);
  }
#endif
  return vec::as_float(bf16_bits_slow(x));
}
template <typename T>
inline vec::v16 round_to(vec::v16 x) { return round_to(x, static_cast<T*>(nullptr)); }

// 16 lanes -> T at out (bf16: rounded as round_to)
inline void put(float* out, vec::v16 x) { vec::store(out, x); }
inline void put(at::BFloat16* out, vec::v16 x) {
#if defined(CADENCE_BF16_CVT)
  const __m512 v = reinterpret_cast<__m512>(x);
  if (ordinary(v)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  vec::store_u16(reinterpret_cast<uint16_t*>(out), bf16_bits_slow(x) >> 16);
}

// exp(x) for x <= 0: n = round(x / ln 2), r = x - n ln 2 (Cephes' two-part constant),
// Taylor to degree 6 in r by FMAs (about 1e-7 relative), times 2^n. Arguments below -87
// are clamped there (n >= -126: 2^n stays a normal number); NaN stays NaN. On AVX-512 the
// rounding and the scaling are one instruction each (roundscale, scalef); elsewhere the
// same values by a round-to-nearest shift and an exponent built from n: the same bits.
inline vec::v16 exp_fused(vec::v16 x) {
  using vec::fma;
  using vec::splat;
#if defined(__AVX512F__)
  const __m512 xv = _mm512_max_ps(_mm512_set1_ps(-87.0f), reinterpret_cast<__m512>(x));  // NaN: x
  x = reinterpret_cast<vec::v16>(xv);
  const vec::v16 n = reinterpret_cast<vec::v16>(_mm512_roundscale_ps(
      _mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  x = vec::select(x < -87.0f, splat(-87.0f), x);  // NaN compares false: stays
  const vec::v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
#endif
  vec::v16 r = fma(n, splat(-0.693359375f), x);
  r = fma(n, splat(2.12194440e-4f), r);
  vec::v16 y = fma(splat(1.0f / 720), r, splat(1.0f / 120));
  y = fma(y, r, splat(1.0f / 24));
  y = fma(y, r, splat(1.0f / 6));
  y = fma(y, r, splat(0.5f));
  y = fma(y, r, splat(1.0f));
  y = fma(y, r, splat(1.0f));
#if defined(__AVX512F__)
  return reinterpret_cast<vec::v16>(_mm512_scalef_ps(reinterpret_cast<__m512>(y), reinterpret_cast<__m512>(n)));
#else
  return y * vec::as_float((vec::to_int(n) + 127) << 23);  // NaN lanes: y is NaN already
#endif
}

// silu(a) = a * sigmoid(a), sigmoid from e = exp(-|a|): 1 / (1 + e) for a >= 0, e / (1 + e)
// below; lane-wise IEEE operations only (the same bits for any vector width)
inline vec::v16 silu16(vec::v16 a) {
  const vec::v16 e = exp_fused(vec::as_float(vec::as_u16(a) | 0x80000000u));  // exp(-|a|)
  const vec::v16 s = 1.0f / (e + 1.0f);
  return a * vec::select(a >= 0, s, e * s);
}

}  // namespace fm
}  // namespace cadence
