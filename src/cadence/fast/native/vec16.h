// Lane-wise float vectors and the per-row pieces both attention kernels share
// (``attention.cpp``, ``attention_amx.cpp``): 16-float values whose operators are lane-wise
// IEEE operations, the exp polynomial, the fixed pairwise lane sums, a row's softmax, and
// the key lists. Built with -ffp-contract=off: no fused multiply-adds but explicit ones.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cadence {
namespace vec {

constexpr int LANES = 16;

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
  const i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  const v16 out = y * scale;
  const i16 under = x < -87.0f;
  i16 bits;
  std::memcpy(&bits, &out, sizeof bits);
  bits &= ~under;
  v16 res;
  std::memcpy(&res, &bits, sizeof res);
  return res;
}

// Lane totals of 16 vectors at once: out[i] = the lanes of p[i] added pairwise 8, 4, 2 and
// 1 apart, ((l + l+8) + (l+4 + l+12)) + ..., the same additions ``lane_total`` makes.
inline v16 totals(const v16* p) {
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
}

inline float lane_total(v16 x) {
  float part[LANES];
  store(part, x);
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

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

// scores s (width, a multiple of 16, the first c real) -> softmax weights exp(s - max) in
// place; returns 1 / their total (16 lanes by rank, added pairwise)
inline float softmax_row(float* s, int64_t c, int64_t width) {
  for (int64_t j = c; j < width; ++j) s[j] = -INFINITY;
  v16 mx = splat(-INFINITY);
  for (int64_t j0 = 0; j0 < width; j0 += LANES) {
    const v16 x = load(s + j0);
    mx = x > mx ? x : mx;
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

}  // namespace vec
}  // namespace cadence
