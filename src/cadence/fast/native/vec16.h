// Lane-wise float vectors and the per-row pieces both attention kernels share
// (``attention.cpp``, ``attention_amx.cpp``): 16-float values whose operators are lane-wise
// IEEE operations, the exp polynomial, the fixed pairwise lane sums, a row's softmax, and
// the key lists. Built with -ffp-contract=off: no fused multiply-adds but explicit ones.
//
// Two forms of the 16-float value, the same bits: GCC's 64-byte vector type, and, on CPUs with
// AVX2 + FMA but no AVX-512, a pair of 256-bit registers. Without 512-bit registers GCC keeps
// a 64-byte vector in memory between operations (a store and a reload per value: listed
// attention ran 8x slower on the AVX2 build than on the AVX-512 one), so there the pair form
// is used. A file may ask for GCC's form anyway (``#define CADENCE_VEC_GENERIC`` before the
// include: ``gemm_q.cpp`` converts byte vectors with it); the forms live in different inline
// namespaces, so files built either way link together. Code that must build in both forms
// uses ``select`` instead of ``?:`` on vectors, ``to_int`` / ``to_float`` instead of
// ``__builtin_convertvector``, and ``as_i16`` / ``as_u16`` / ``as_float`` for bit casts.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cadence {
namespace vec {

constexpr int LANES = 16;

struct Lists {
  const int32_t* prefix;  // (b, n): keys [0, prefix) first
  const int32_t* extra;   // (b, n, E): then these slots, in order
  const int32_t* count;   // (b, n): how many of extra
  int64_t E;
  inline int64_t size(int64_t row) const { return prefix[row] + count[row]; }
  inline int64_t key(int64_t row, int64_t j) const {
    return j < prefix[row] ? j : extra[row * E + (j - prefix[row])];
  }
};

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(CADENCE_VEC_GENERIC)
#define CADENCE_VEC_PAIR 1
inline namespace pair256 {

// 16 floats as two 256-bit registers: lanes 0-7 in lo, 8-15 in hi
struct v16 {
  __m256 lo, hi;
  float operator[](int l) const {
    alignas(32) float t[16];
    _mm256_store_ps(t, lo), _mm256_store_ps(t + 8, hi);
    return t[l];
  }
};

// 16 int32 (U: uint32) lanes the same way; comparisons of v16 give an ivec<false> of 0 / -1
template <bool U>
struct ivec {
  __m256i lo, hi;
  auto operator[](int l) const {
    alignas(32) int32_t t[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), lo), _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8), hi);
    if constexpr (U) return static_cast<uint32_t>(t[l]); else return t[l];
  }
};
typedef ivec<false> i16;
typedef ivec<true> u16w;

inline v16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
#define CADENCE_V16_OP(op, fn)                                                                 \
  inline v16 operator op(v16 a, v16 b) { return {fn(a.lo, b.lo), fn(a.hi, b.hi)}; }           \
  inline v16 operator op(v16 a, float b) { return a op splat(b); }                           \
  inline v16 operator op(float a, v16 b) { return splat(a) op b; }
CADENCE_V16_OP(+, _mm256_add_ps)
CADENCE_V16_OP(-, _mm256_sub_ps)
CADENCE_V16_OP(*, _mm256_mul_ps)
CADENCE_V16_OP(/, _mm256_div_ps)
#undef CADENCE_V16_OP
// comparisons as GCC's vectors make them: quiet, false when either lane is NaN but for !=
#define CADENCE_V16_CMP(op, pred)                                                              \
  inline i16 operator op(v16 a, v16 b) {                                                       \
    return {_mm256_castps_si256(_mm256_cmp_ps(a.lo, b.lo, pred)),                              \
            _mm256_castps_si256(_mm256_cmp_ps(a.hi, b.hi, pred))};                             \
  }                                                                                            \
  inline i16 operator op(v16 a, float b) { return a op splat(b); }
CADENCE_V16_CMP(>, _CMP_GT_OQ)
CADENCE_V16_CMP(<, _CMP_LT_OQ)
CADENCE_V16_CMP(>=, _CMP_GE_OQ)
CADENCE_V16_CMP(<=, _CMP_LE_OQ)
CADENCE_V16_CMP(==, _CMP_EQ_OQ)
CADENCE_V16_CMP(!=, _CMP_NEQ_UQ)
#undef CADENCE_V16_CMP

template <bool U>
inline ivec<U> isplat(uint32_t x) {
  const __m256i v = _mm256_set1_epi32(static_cast<int32_t>(x));
  return {v, v};
}
#define CADENCE_IVEC_OP(op, fn)                                                                \
  template <bool U>                                                                            \
  inline ivec<U> operator op(ivec<U> a, ivec<U> b) { return {fn(a.lo, b.lo), fn(a.hi, b.hi)}; } \
  template <bool U>                                                                            \
  inline ivec<U> operator op(ivec<U> a, uint32_t b) { return a op isplat<U>(b); }             \
  template <bool U>                                                                            \
  inline ivec<U>& operator op##=(ivec<U>& a, ivec<U> b) { return a = a op b; }
CADENCE_IVEC_OP(+, _mm256_add_epi32)
CADENCE_IVEC_OP(-, _mm256_sub_epi32)
CADENCE_IVEC_OP(&, _mm256_and_si256)
CADENCE_IVEC_OP(|, _mm256_or_si256)
#undef CADENCE_IVEC_OP
template <bool U>
inline ivec<U> operator~(ivec<U> a) { return a ^ isplat<U>(~0u); }
template <bool U>
inline ivec<U> operator^(ivec<U> a, ivec<U> b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
template <bool U>
inline ivec<U> operator<<(ivec<U> a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
template <bool U>
inline ivec<U> operator>>(ivec<U> a, int n) {  // logical for uint32 lanes, arithmetic for int32 ones
  if constexpr (U) return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)};
  else return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)};
}

// lane-wise m ? a : b (m: lanes of 0 / -1, as comparisons give)
inline v16 select(i16 m, v16 a, v16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(m.lo)), _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(m.hi))};
}
template <bool U>
inline ivec<U> select(i16 m, ivec<U> a, ivec<U> b) {
  return {_mm256_blendv_epi8(b.lo, a.lo, m.lo), _mm256_blendv_epi8(b.hi, a.hi, m.hi)};
}
// float -> int32 toward zero (as __builtin_convertvector), int32 -> float
inline i16 to_int(v16 x) { return {_mm256_cvttps_epi32(x.lo), _mm256_cvttps_epi32(x.hi)}; }
inline v16 to_float(i16 x) { return {_mm256_cvtepi32_ps(x.lo), _mm256_cvtepi32_ps(x.hi)}; }
// the bits, unchanged
inline i16 as_i16(v16 x) { return {_mm256_castps_si256(x.lo), _mm256_castps_si256(x.hi)}; }
inline u16w as_u16(v16 x) { return {_mm256_castps_si256(x.lo), _mm256_castps_si256(x.hi)}; }
template <bool U>
inline v16 as_float(ivec<U> x) { return {_mm256_castsi256_ps(x.lo), _mm256_castsi256_ps(x.hi)}; }
// the low 16 bits of each lane -> out[0..15]
inline void store_u16(uint16_t* out, u16w x) {
  const __m256i m = _mm256_set1_epi32(0xFFFF);  // lanes in [0, 65535]: the saturating pack is exact
  const __m256i p = _mm256_packus_epi32(_mm256_and_si256(x.lo, m), _mm256_and_si256(x.hi, m));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(p, 0xD8));
}

inline v16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline v16 load(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits move up 16
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16))};
}
inline v16 load(const at::Half* p) {  // fp16 -> fp32 is exact (F16C: every AVX2 CPU has it)
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline void store(float* p, v16 x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
// a * b + c rounded once, lane-wise
inline v16 fma(v16 a, v16 b, v16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }

#else
inline namespace gnu {

// 16 floats as one value: GCC/Clang lower it to one AVX-512 register, two AVX2 ones or four
// SSE ones; its operators are lane-wise IEEE operations, so results do not depend on which.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16w __attribute__((vector_size(64)));
typedef uint16_t h16 __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i16{__VA_ARGS__})
#endif

template <typename V>
inline V select(i16 m, V a, V b) { return m ? a : b; }
inline i16 to_int(v16 x) { return __builtin_convertvector(x, i16); }
inline v16 to_float(i16 x) { return __builtin_convertvector(x, v16); }
template <typename To, typename From>
inline To bit_cast_(From x) {
  To r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
inline i16 as_i16(v16 x) { return bit_cast_<i16>(x); }
inline u16w as_u16(v16 x) { return bit_cast_<u16w>(x); }
inline v16 as_float(i16 x) { return bit_cast_<v16>(x); }
inline v16 as_float(u16w x) { return bit_cast_<v16>(x); }
inline void store_u16(uint16_t* out, u16w x) {
  const h16 h = __builtin_convertvector(x, h16);
  std::memcpy(out, &h, sizeof h);
}

inline v16 load(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline v16 load(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits move up 16
#if defined(__AVX512F__)
  // one widening load and a shift (GCC's generic form below takes six instructions)
  return reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  h16 h;
  std::memcpy(&h, p, sizeof h);
  const u16w w = __builtin_convertvector(h, u16w) << 16;
  v16 r;
  std::memcpy(&r, &w, sizeof r);
  return r;
#endif
}
inline v16 load(const at::Half* p) {  // fp16 -> fp32 is exact
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  v16 r;
  for (int l = 0; l < 16; ++l) r[l] = static_cast<float>(p[l]);
  return r;
#endif
}
inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// a * b + c rounded once, lane-wise: the instruction where there is one, else std::fma
inline v16 fma(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  typedef float v8 __attribute__((vector_size(32)));
  v8 a2[2], b2[2], c2[2];
  std::memcpy(a2, &a, sizeof a), std::memcpy(b2, &b, sizeof b), std::memcpy(c2, &c, sizeof c);
  for (int h = 0; h < 2; ++h)
    c2[h] = reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a2[h]), reinterpret_cast<__m256>(b2[h]),
                                                 reinterpret_cast<__m256>(c2[h])));
  v16 r;
  std::memcpy(&r, c2, sizeof r);
  return r;
#else
  for (int l = 0; l < 16; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}
inline v16 splat(float x) { return v16{} + x; }
#endif


// exp(x) for x <= 0 (softmax arguments), 0 below -87: Cephes' expf polynomial, about 1 ulp,
// lane-wise IEEE operations only (every lane takes the same path)
inline v16 exp_(v16 x) {
  const v16 t = x * 1.44269504088896341f;
  const v16 n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const v16 out = y * as_float((to_int(n) + 127) << 23);
  return as_float(as_i16(out) & ~(x < -87.0f));
}

// Lane totals of 16 vectors at once: out[i] = the lanes of p[i] added pairwise 8, 4, 2 and
// 1 apart, ((l + l+8) + (l+4 + l+12)) + ..., the same additions ``lane_total`` makes.
// The pair form makes the same additions as 256-bit steps (float addition commutes: the
// same bits); GCC would lower the 16-lane shuffles to one scalar move per lane there.
inline v16 totals(const v16* p) {
#if defined(CADENCE_VEC_PAIR)
  __m256 out[2];
  for (int half = 0; half < 2; ++half) {  // vectors 8 * half .. 8 * half + 7
    __m256 s[8];
    for (int i = 0; i < 8; ++i) s[i] = _mm256_add_ps(p[8 * half + i].lo, p[8 * half + i].hi);  // l + l+8, l < 8
    __m256 u[4];  // u[i] = [vector i: s[l] + s[l+4], l < 4 | vector i+4: the same]
    for (int i = 0; i < 4; ++i)
      u[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[i], s[i + 4], 0x20), _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
    // [v0: x0 + x2, x1 + x3; v1: the same | v4; v5], [v2; v3 | v6; v7]
    const __m256 m01 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
    const __m256 m23 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xEE));
    // [v0 v1 v2 v3 | v4 v5 v6 v7]: y0 + y1 of each
    out[half] = _mm256_add_ps(_mm256_shuffle_ps(m01, m23, 0x88), _mm256_shuffle_ps(m01, m23, 0xDD));
  }
  return {out[0], out[1]};
#else
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#endif
}

inline float lane_total(v16 x) {
  float part[LANES];
  store(part, x);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// scores s (width, a multiple of 16, the first c real) -> softmax weights exp(s - max) in
// place; returns 1 / their total (16 lanes by rank, added pairwise)
inline float softmax_row(float* s, int64_t c, int64_t width) {
  for (int64_t j = c; j < width; ++j) s[j] = -INFINITY;
  v16 mx = splat(-INFINITY);
  for (int64_t j0 = 0; j0 < width; j0 += LANES) {
    const v16 x = load(s + j0);
    mx = select(x > mx, x, mx);
  }
  float top = -INFINITY;
  for (int l = 0; l < LANES; ++l) top = mx[l] > top ? mx[l] : top;
  v16 z{};
  for (int64_t j0 = 0; j0 < width; j0 += LANES) {
    const v16 p = exp_(load(s + j0) - top);
    store(s + j0, p);
    z = z + p;
  }
  return 1.0f / lane_total(z);
}

}  // inline namespace pair256 / gnu
}  // namespace vec
}  // namespace cadence
