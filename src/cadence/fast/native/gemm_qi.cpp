// y = x W^T (+ b) with W in a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks and x rounded to 8 bits per
// block of 32 (as llama.cpp does): integer dot products per block, scaled and summed in fp32.
//
// Why: the fp32 kernel (``gemm_q.cpp``) decodes every weight to fp32 on every call and is slower
// than a dense fp32 product. Here a block of 32 weights costs a few byte operations per row:
// AVX2 ``vpmaddubsw`` / ``vpmaddwd`` (u8 x s8 -> s16 pairs -> s32), AVX-512BW the same on 64
// bytes, AVX512-VNNI ``vpdpbusd`` where the build has it; every integer sum is exact, so which
// of these ran never changes a bit.
//
// Weights, repacked once at load (``q_pack``; the same bytes, rows the same length as the file's):
//   a row = [quants][d: nb fp16][m: nb fp16, Q4_1 only], nb = K / 32 blocks, nb even.
//   Blocks go in "regions" of 4 (the last one of 2 when nb % 4 == 2). Q4_*: a region's quants are
//   its blocks' 16 nibble bytes in order (64 bytes), so the low nibbles of the region are weights
//   0..15 of blocks 0, 1, 2, 3 and the high nibbles weights 16..31. Q8_0: a region is 128 bytes,
//   weights 0..15 of blocks 0..3 then weights 16..31 of blocks 0..3 (half regions: 32 + 32).
// Activations, per call and row (``quantize_row``): per block, amax = max |x|, d = amax / 127,
//   id = 1 / d (0 if d = 0), q = x * id rounded to nearest even (|q| <= 127), s = d * sum(q);
//   the quants in the Q8_0 weights' region order, d spread to 16 lanes per region (``sx``), s
//   at lane 4 i of its region (``ss``).
// Arithmetic of one output y[r][j] (16 fp32 lanes; l = 4 i + t: block i of a region, t 0..3):
//   isum[l] = the exact integer sum of the 8 products q_w q_x of block i's weights 4t..4t+3 and
//   16+4t..16+4t+3; region by region from 0, acc[l] = fma(float(isum[l]), d_w * d_x, acc[l]),
//   then for Q4_*, acc[l] = fma(mv[l], ss[l], acc[l]) with mv[l] block i's m (Q4_1) or d (Q4_0)
//   and ss[l] its s (Q4_0: -8 s; exact) at t = 0, 0 elsewhere (a half region updates lanes 0..7
//   only); then y = total(acc) + bias, total adding lanes 8, 4, 2, 1 apart (``gemm_q.cpp``'s
//   order). So y is the fp32-rounded product of the file's weights with the row's 8-bit
//   activations (Q4_1 with Q8_1's block sums, as llama.cpp).
// Nothing depends on the other rows, the tile or the thread, and the AVX2 and AVX-512 builds
// compute the same lanes with the same operations: the same bits (tests/test_gemm_qi.py checks
// them against a numpy model of the arithmetic above).
//
// Work: columns split across threads in ranges of 8; a range runs in column tiles, each tile
// against every row tile (AVX-512: 1 or 2 rows x 8 columns, 3 or 4 rows x 4; AVX2: 1 x 4,
// 2 x 2, 3 or 4 x 1), so the weights stream from memory once per call.

#include "gemm_q.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace cadence {
namespace {

constexpr int64_t QK = 32;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QI_ON 1
#endif

// where things lie in a packed weight row and a quantized activation row of K inputs
struct Geo {
  int64_t nb, quads;  // blocks; whole regions of 4
  bool half;          // a last region of 2 blocks
  int64_t wq;         // weight quant bytes in a row
  int64_t x_sx, x_ss, x_bytes;  // activation row: quants at 0, sx and ss at x_sx, x_ss; its bytes
};

Geo geo(int64_t type, int64_t K) {
  Geo g;
  g.nb = K / QK;
  g.quads = g.nb / 4;
  g.half = g.nb % 4 != 0;
  g.wq = g.nb * (type == Q_Q8_0 ? 32 : 16);
  const int64_t regions = g.quads + (g.half ? 1 : 0);
  g.x_sx = g.nb * 32;
  g.x_ss = g.x_sx + regions * 64;
  g.x_bytes = g.x_ss + regions * 64;
  return g;
}

bool is_q(int64_t type) { return type == Q_Q4_0 || type == Q_Q4_1 || type == Q_Q8_0; }
int64_t file_block_bytes(int64_t type) { return type == Q_Q4_0 ? 18 : type == Q_Q4_1 ? 20 : 34; }

// byte offset of weight half h (0: weights 0..15, 1: 16..31) of block b in a Q8_0-ordered region
// row (the activations' order too): region base + 16 (b % 4) + (second half: 64, or 32 in a half region)
inline int64_t q8_offset(const Geo& g, int64_t b, int h) {
  const int64_t region = b / 4, i = b % 4;
  const bool short_region = region == g.quads;
  return region * 128 + 16 * i + (h ? (short_region ? 32 : 64) : 0);
}

#if defined(QI_ON)
// 32 floats -> 32 int8 (to[0..15] weights 0..15, to[16..31] 16..31 at the two pointers); returns d
inline float quantize_block(const float* x, int8_t* first, int8_t* second, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // nearest even (MXCSR default)
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *sum = _mm_cvtsi128_si32(s4);
  // int32 -> int8 in order: the packs interleave 4-lane groups, the permutation undoes it
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i o = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(first), _mm256_castsi256_si128(o));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(second), _mm256_extracti128_si256(o, 1));
  return d;
}

// ``type``: Q4_0 stores -8 s in ``ss`` (its m_b = -8 d_b, applied exactly on this side)
void quantize_row(const float* x, const Geo& g, int64_t type, uint8_t* out) {
  int8_t* q = reinterpret_cast<int8_t*>(out);
  float* sx = reinterpret_cast<float*>(out + g.x_sx);
  float* ss = reinterpret_cast<float*>(out + g.x_ss);
  std::memset(out + g.x_sx, 0, g.x_bytes - g.x_sx);
  for (int64_t b = 0; b < g.nb; ++b) {
    int32_t sum;
    const float d = quantize_block(x + b * QK, q + q8_offset(g, b, 0), q + q8_offset(g, b, 1), &sum);
    for (int t = 0; t < 4; ++t) sx[16 * (b / 4) + 4 * (b % 4) + t] = d;
    const float s = d * static_cast<float>(sum);
    ss[16 * (b / 4) + 4 * (b % 4)] = type == Q_Q4_0 ? -8.0f * s : s;
  }
}

// lanes 0..7 + 8..15, then 4, 2, 1 apart (``gemm_q.cpp``'s ``total``)
inline float total(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  float f[4];
  _mm_storeu_ps(f, s4);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

// 2 fp16 scales -> [a x4, b x4]
inline __m256 scales8(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(v))),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// 8 lanes of one region half: the integer sums of weights (lo: 0..15 of 2 blocks, hi: 16..31)
// with activations xl, xh. Q4: lo, hi are nibbles 0..15; Q8: |w| and the sign moved onto x.
template <int64_t Q>
inline __m256i isum8(__m256i lo, __m256i hi, __m256i wl, __m256i wh, const uint8_t* xl, const uint8_t* xh) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xl));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xh));
  if constexpr (Q == Q_Q8_0) {
    a = _mm256_sign_epi8(a, wl);
    b = _mm256_sign_epi8(b, wh);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, a), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, b), ones));
  } else {  // pairs of nibble products fit int16 (2 * 15 * 127), and so do two of them
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, b)), ones);
  }
}

// one half region of a column: (lo, hi, raw lo, raw hi) for ``isum8``
template <int64_t Q>
inline void weights8(const uint8_t* wl_p, const uint8_t* wh_p, __m256i& lo, __m256i& hi, __m256i& wl, __m256i& wh) {
  if constexpr (Q == Q_Q8_0) {
    wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl_p));
    wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh_p));
    lo = _mm256_abs_epi8(wl);
    hi = _mm256_abs_epi8(wh);
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl_p));
    lo = _mm256_and_si256(z, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), m4);
    wl = wh = lo;
  }
}

struct Args {
  const uint8_t* w;  // packed rows
  const uint8_t* x;  // quantized activation rows
  const float* bias;
  float* y;
  int64_t m, N, rb;  // rows, outputs, packed row bytes
  Geo g;
};

inline void finish(const Args& a, int64_t r, int64_t j, float t) { a.y[r * a.N + j] = a.bias ? t + a.bias[j] : t; }
inline void finish4(const Args& a, int64_t r, int64_t j, __m128 t) {
  _mm_storeu_ps(a.y + r * a.N + j, a.bias ? _mm_add_ps(t, _mm_loadu_ps(a.bias + j)) : t);
}

// in each 128-bit lane [s0, s1, s2, s3] -> lane 0 = (s0 + s2) + (s1 + s3), ``total``'s last additions
template <typename V>
inline V last_adds(V z) {
  if constexpr (sizeof(V) == 64) {
    const __m512 t = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  } else {
    const __m256 t = _mm256_add_ps(z, _mm256_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  }
}

// ``total`` of four accumulators (8 lanes each after their lo + hi), as one vector
inline __m128 totals4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = last_adds(_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
  const __m256 cd = last_adds(_mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31)));
  const __m256 x = _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(0, 0, 0, 0));  // [a a c c | b b d d]
  return _mm_blend_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1), 0b1010);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int RMAX = 4;
constexpr int cols(int r) { return r <= 2 ? 8 : 4; }

template <int64_t Q>
inline __m512i isum16(__m512i lo, __m512i hi, __mmask64 nl, __mmask64 nh, const uint8_t* xp) {
  __m512i a = _mm512_loadu_si512(xp), b = _mm512_loadu_si512(xp + 64);
  if constexpr (Q == Q_Q8_0) {  // the weight's sign onto x (|x| <= 127: no overflow)
    a = _mm512_mask_sub_epi8(a, nl, _mm512_setzero_si512(), a);
    b = _mm512_mask_sub_epi8(b, nh, _mm512_setzero_si512(), b);
  }
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, a), hi, b);
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (Q == Q_Q8_0)
    return _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(lo, a), ones),
                            _mm512_madd_epi16(_mm512_maddubs_epi16(hi, b), ones));
  else
    return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, a), _mm512_maddubs_epi16(hi, b)), ones);
#endif
}

// ``total`` of z[0..3], as one vector: lanes 8, then 4 apart by 128-bit shuffles, then ``last_adds``
inline __m128 totals4(const __m512* z) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2)));  // [a_8 | b_8]
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(z[2], z[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));  // [a_4 b_4 c_4 d_4]
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                                                      last_adds(s4)));
}

// rows [r0, r0 + R) x columns [j0, j0 + C)
template <int64_t Q, int R, int C>
void tile(const Args& a, int64_t r0, int64_t j0) {
  const Geo& g = a.g;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t q = 0; q < g.quads; ++q) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const uint8_t* wr = a.w + (j0 + c) * a.rb;
      const __m512 sw = _mm512_permutexvar_ps(
          spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + g.wq + 8 * q)))));
      __m512 mv = sw;  // Q4_1: its m's spread as the d's; Q4_0: the d's (ss holds -8 s)
      if constexpr (Q == Q_Q4_1)
        mv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + g.wq + 2 * g.nb + 8 * q)))));
      __m512i lo, hi;
      __mmask64 nl = 0, nh = 0;
      if constexpr (Q == Q_Q8_0) {
        lo = _mm512_loadu_si512(wr + 128 * q);
        hi = _mm512_loadu_si512(wr + 128 * q + 64);
        nl = _mm512_movepi8_mask(lo);
        nh = _mm512_movepi8_mask(hi);
        lo = _mm512_abs_epi8(lo);
        hi = _mm512_abs_epi8(hi);
      } else {
        const __m512i m4 = _mm512_set1_epi8(0x0f), z = _mm512_loadu_si512(wr + 64 * q);
        lo = _mm512_and_si512(z, m4);
        hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = a.x + (r0 + r) * g.x_bytes;
        const __m512i is = isum16<Q>(lo, hi, nl, nh, xr + 128 * q);
        const __m512 dd = _mm512_mul_ps(sw, _mm512_loadu_ps(reinterpret_cast<const float*>(xr + g.x_sx) + 16 * q));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), dd, acc[r][c]);
        if constexpr (Q != Q_Q8_0)
          acc[r][c] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(reinterpret_cast<const float*>(xr + g.x_ss) + 16 * q), acc[r][c]);
      }
    }
  }
  if (g.half) {  // 2 blocks: 256-bit lanes 0..7 (the AVX2 code's operations), lanes 8..15 kept
    const int64_t q = g.quads;
    for (int c = 0; c < C; ++c) {
      const uint8_t* wr = a.w + (j0 + c) * a.rb;
      const __m256 sw = scales8(wr + g.wq + 8 * q);
      const __m256 mv = Q == Q_Q4_1 ? scales8(wr + g.wq + 2 * g.nb + 8 * q) : sw;
      __m256i lo, hi, wl, wh;
      if constexpr (Q == Q_Q8_0) weights8<Q>(wr + 128 * q, wr + 128 * q + 32, lo, hi, wl, wh);
      else weights8<Q>(wr + 64 * q, nullptr, lo, hi, wl, wh);
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = a.x + (r0 + r) * g.x_bytes;
        const __m256i is = isum8<Q>(lo, hi, wl, wh, xr + 128 * q, xr + 128 * q + 32);
        const __m256 dd = _mm256_mul_ps(sw, _mm256_loadu_ps(reinterpret_cast<const float*>(xr + g.x_sx) + 16 * q));
        acc[r][c] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_cvtepi32_ps(is)), _mm512_castps256_ps512(dd),
                                          acc[r][c], 0x00ff);
        if constexpr (Q != Q_Q8_0)
          acc[r][c] = _mm512_mask3_fmadd_ps(
              _mm512_castps256_ps512(mv),
              _mm512_castps256_ps512(_mm256_loadu_ps(reinterpret_cast<const float*>(xr + g.x_ss) + 16 * q)), acc[r][c],
              0x00ff);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (C % 4 == 0) {
      for (int c = 0; c < C; c += 4) finish4(a, r0 + r, j0 + c, totals4(acc[r] + c));
    } else {
      for (int c = 0; c < C; ++c) {
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
        finish(a, r0 + r, j0 + c, total(_mm512_castps512_ps256(acc[r][c]), hi));
      }
    }
  }
}
#else
constexpr int RMAX = 4;
constexpr int cols(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }

template <int64_t Q, int R, int C>
void tile(const Args& a, int64_t r0, int64_t j0) {
  const Geo& g = a.g;
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const int64_t regions = g.quads + (g.half ? 1 : 0);
  for (int64_t q = 0; q < regions; ++q) {
    const bool whole = q < g.quads;
    for (int h = 0; h < (whole ? 2 : 1); ++h) {
      // weights: Q4 bytes 32 h of the region; Q8 / x: 32 h and (64 or 32) + 32 h
      const int64_t second = whole ? 64 : 32;
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* wr = a.w + (j0 + c) * a.rb;
        const __m256 sw = scales8(wr + g.wq + 8 * q + 4 * h);
        const __m256 mv = Q == Q_Q4_1 ? scales8(wr + g.wq + 2 * g.nb + 8 * q + 4 * h) : sw;
        __m256i lo, hi, wl, wh;
        if constexpr (Q == Q_Q8_0) weights8<Q>(wr + 128 * q + 32 * h, wr + 128 * q + second + 32 * h, lo, hi, wl, wh);
        else weights8<Q>(wr + 64 * q + 32 * h, nullptr, lo, hi, wl, wh);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const uint8_t* xr = a.x + (r0 + r) * g.x_bytes;
          const __m256i is = isum8<Q>(lo, hi, wl, wh, xr + 128 * q + 32 * h, xr + 128 * q + second + 32 * h);
          const __m256 dd =
              _mm256_mul_ps(sw, _mm256_loadu_ps(reinterpret_cast<const float*>(xr + g.x_sx) + 16 * q + 8 * h));
          acc[r][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), dd, acc[r][c][h]);
          if constexpr (Q != Q_Q8_0)
            acc[r][c][h] = _mm256_fmadd_ps(
                mv, _mm256_loadu_ps(reinterpret_cast<const float*>(xr + g.x_ss) + 16 * q + 8 * h), acc[r][c][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {
      __m256 s8[4];
      for (int c = 0; c < 4; ++c) s8[c] = _mm256_add_ps(acc[r][c][0], acc[r][c][1]);
      finish4(a, r0 + r, j0, totals4(s8[0], s8[1], s8[2], s8[3]));
    } else {
      for (int c = 0; c < C; ++c) finish(a, r0 + r, j0 + c, total(acc[r][c][0], acc[r][c][1]));
    }
  }
}
#endif

template <int64_t Q, int R>
void row_tile(const Args& a, int64_t r0, int64_t j0, int64_t nc) {
  constexpr int C = cols(R);
  if (nc == C) tile<Q, R, C>(a, r0, j0);
  else
    for (int64_t c = 0; c < nc; ++c) tile<Q, R, 1>(a, r0, j0 + c);
}

template <int64_t Q>
void run(const Args& a, int64_t j0, int64_t j1) {
  constexpr int CT = cols(1);  // column tile: the widest one
  for (int64_t j = j0; j < j1; j += CT) {
    const int64_t nc = std::min<int64_t>(CT, j1 - j);
    int64_t r = 0;
    for (; r + RMAX <= a.m; r += RMAX)
      for (int64_t c = 0; c < nc; c += cols(RMAX)) row_tile<Q, RMAX>(a, r, j + c, std::min<int64_t>(cols(RMAX), nc - c));
    const int64_t left = a.m - r;
    if (left == 3)
      for (int64_t c = 0; c < nc; c += cols(3)) row_tile<Q, 3>(a, r, j + c, std::min<int64_t>(cols(3), nc - c));
    if (left == 2)
      for (int64_t c = 0; c < nc; c += cols(2)) row_tile<Q, 2>(a, r, j + c, std::min<int64_t>(cols(2), nc - c));
    if (left == 1) row_tile<Q, 1>(a, r, j, nc);
  }
}
#endif  // QI_ON

}  // namespace

int64_t q_packed_type(int64_t type, int64_t K) {
#if defined(QI_ON)
  if (is_q(type) && K % (2 * QK) == 0 && K > 0) return type | Q_PACKED;
#endif
  (void)K;
  return type;
}

at::Tensor q_pack(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "q_pack: (out, row bytes) uint8");
  const int64_t pt = q_packed_type(type, K);
  if (pt == type) return w;
  const Geo g = geo(type, K);
  const int64_t n = w.size(0), rb = w.size(1), bb = file_block_bytes(type);
  TORCH_CHECK(rb == g.nb * bb, "q_pack: rows of ", rb, " bytes for ", K, " inputs of type ", type);
  at::Tensor out = at::empty_like(w);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 256, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* in = src + j * rb;
      uint8_t* o = dst + j * rb;
      for (int64_t b = 0; b < g.nb; ++b, in += bb) {
        std::memcpy(o + g.wq + 2 * b, in, 2);                                     // d
        if (type == Q_Q4_1) std::memcpy(o + g.wq + 2 * g.nb + 2 * b, in + 2, 2);  // m
        if (type == Q_Q8_0) {
          std::memcpy(o + q8_offset(g, b, 0), in + 2, 16);
          std::memcpy(o + q8_offset(g, b, 1), in + 18, 16);
        } else {
          std::memcpy(o + 16 * b, in + (type == Q_Q4_1 ? 4 : 2), 16);
        }
      }
    }
  });
  return out;
}

at::Tensor q_unpack(const at::Tensor& w, int64_t packed, int64_t K) {
  const int64_t type = packed & ~Q_PACKED;
  const Geo g = geo(type, K);
  const int64_t n = w.size(0), rb = w.size(1), bb = file_block_bytes(type);
  at::Tensor out = at::empty_like(w);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* in = src + j * rb;
    uint8_t* o = dst + j * rb;
    for (int64_t b = 0; b < g.nb; ++b, o += bb) {
      std::memcpy(o, in + g.wq + 2 * b, 2);
      if (type == Q_Q4_1) std::memcpy(o + 2, in + g.wq + 2 * g.nb + 2 * b, 2);
      if (type == Q_Q8_0) {
        std::memcpy(o + 2, in + q8_offset(g, b, 0), 16);
        std::memcpy(o + 18, in + q8_offset(g, b, 1), 16);
      } else {
        std::memcpy(o + (type == Q_Q4_1 ? 4 : 2), in + 16 * b, 16);
      }
    }
  }
  return out;
}

at::Tensor q_linear_packed(const at::Tensor& x2, const at::Tensor& w, int64_t packed, int64_t out, const float* bias,
                           at::Tensor y) {
#if defined(QI_ON)
  const int64_t type = packed & ~Q_PACKED, K = x2.size(1), m = x2.size(0);
  const Geo g = geo(type, K);
  at::Tensor xq = at::empty({m, g.x_bytes}, x2.options().dtype(at::kByte));
  const float* xs = x2.data_ptr<float>();
  uint8_t* xd = xq.data_ptr<uint8_t>();
  for (int64_t r = 0; r < m; ++r) quantize_row(xs + r * K, g, type, xd + r * g.x_bytes);
  const Args a{w.data_ptr<uint8_t>(), xd, bias, y.data_ptr<float>(), m, out, w.size(1), g};
  const int64_t groups = (out + 7) / 8;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, groups, (groups + threads - 1) / threads, [&](int64_t g0, int64_t g1) {
    const int64_t j0 = g0 * 8, j1 = std::min<int64_t>(out, g1 * 8);
    if (type == Q_Q4_0) run<Q_Q4_0>(a, j0, j1);
    else if (type == Q_Q4_1) run<Q_Q4_1>(a, j0, j1);
    else run<Q_Q8_0>(a, j0, j1);
  });
  return y;
#else
  (void)x2, (void)w, (void)packed, (void)out, (void)bias;
  TORCH_CHECK(false, "q_linear: packed weights need an AVX2 + FMA + F16C build");
  return y;
#endif
}

}  // namespace cadence
