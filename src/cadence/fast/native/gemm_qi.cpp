// y = x W^T (+ b) with W in a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks and x rounded to 8 bits per
// block of 32 (as llama.cpp does): integer dot products per block, scaled and summed in fp32.
//
// Why: the fp32 kernel (``gemm_q.cpp``) decodes every weight to fp32 on every call and is slower
// than a dense fp32 product. Here a block of 32 weights costs a few byte operations per row, and
// a tree of n rows streams the weights once: the fp32 work is one multiply and one or two fused
// multiply-adds per block and *16 columns* (one vector lane per column), so at 8 rows the
// integer work, not the scaling, sets the pace. Integer sums are exact, so which instructions
// ran (AVX2 ``vpmaddubsw`` / ``vpmaddwd`` on 8 columns, AVX-512BW the same on 16, AVX512-VNNI
// ``vpdpbusd``) never changes a bit.
//
// Weights, repacked once at load (``q_pack``; the same bytes, the tensor the same shape): output
// columns go in groups of 16 (the last one of G = N % 16 when N is not a multiple), and a group
// of G columns keeps, over the same G rows of bytes,
//   [quants: block by block, each block as chunks v of G x 4 bytes: column c's quant bytes
//    4v..4v+3 at 4 c (Q4_*: 4 chunks of the block's 16 nibble bytes; Q8_0: 8 chunks of 32)]
//   [d: block by block, G fp16]  [m: block by block, G fp16; Q4_1 only].
//   Worked example, Q4_1, K = 64 (2 blocks), a full group: block 1's chunk 2 starts at byte
//   1 * 16 * 16 + 2 * 16 * 4 = 384 of the group, column 5's 4 bytes there at 384 + 20; d of
//   block 1, column 5 at 2 * 16 * 16 + 2 * (16 + 5) = 554; its m at 554 + 2 * 2 * 16 = 618.
//   A byte of a Q4 chunk holds weight 4v + i in its low nibble and 16 + 4v + i in its high one
//   (the file's order), so chunk v pairs with activations 4v..4v+3 and 16+4v..16+4v+3.
// Activations, per call and row (``quantize_row``): per block, amax = max |x|, d = amax / 127,
//   id = 1 / d (0 if d = 0), q = x * id rounded to nearest even (|q| <= 127), S = sum(q) (int),
//   s = d * S (fp32; Q4_0 stores -8 s, exact). A row holds [q: 32 per block][d][s][S] per block.
// Arithmetic of one output y[r][j]: acc = 0; for each block b in order,
//   isum = the exact integer sum of its 32 products q_w q_x;
//   acc = fma(float(isum), d_w * d_x, acc);  then for Q4_*: acc = fma(mv, s, acc) with mv the
//   block's m (Q4_1) or d (Q4_0, whose s holds -8 s);
//   then y = acc + bias. So y is the fp32-rounded product of the file's weights with the row's
//   8-bit activations (Q4_1 with Q8_1's block sums, as llama.cpp).
// Nothing depends on the other rows, the tile, the thread or the vector width (a column is one
// lane, in order over the blocks; the last group's columns run the same arithmetic in scalar
// code): the AVX2 and AVX-512 builds give the same bits (tests/test_gemm_qi.py checks them
// against a numpy model of the arithmetic above).
//
// Work: groups split across threads; a group runs its column tiles (AVX-512: 16 columns, AVX2: 8)
// against every row tile (AVX-512: up to 8 rows, AVX2: up to 4), so the weights stream from
// memory once per call. Calls of 16 rows or more run on AMX int8 tiles where the CPU has them
// (below), with the same bits.

#include "gemm_q.h"

#include "amx.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>

namespace cadence {
namespace {

constexpr int64_t QK = 32;
constexpr int64_t GW = 16;  // columns in a group

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QI_ON 1
#endif

bool is_q(int64_t type) { return type == Q_Q4_0 || type == Q_Q4_1 || type == Q_Q8_0; }
int64_t file_block_bytes(int64_t type) { return type == Q_Q4_0 ? 18 : type == Q_Q4_1 ? 20 : 34; }
int64_t quant_bytes(int64_t type) { return type == Q_Q8_0 ? 32 : 16; }

// where things lie in a group of G packed columns and in a quantized activation row of K inputs
struct Geo {
  int64_t nb;                   // blocks in a row
  int64_t qb;                   // quant bytes of a block
  int64_t x_d, x_s, x_S, x_bytes;  // activation row: q at 0, then d, s, S (4 bytes each per block)
  int64_t quants(int64_t G) const { return nb * G * qb; }                     // d of the group at
  int64_t q_at(int64_t G, int64_t b, int64_t v, int64_t c) const { return b * G * qb + v * G * 4 + 4 * c; }
  int64_t d_at(int64_t G, int64_t b, int64_t c) const { return quants(G) + 2 * (b * G + c); }
  int64_t m_at(int64_t G, int64_t b, int64_t c) const { return quants(G) + 2 * nb * G + 2 * (b * G + c); }
};

Geo geo(int64_t type, int64_t K) {
  Geo g;
  g.nb = K / QK;
  g.qb = quant_bytes(type);
  g.x_d = g.nb * QK;
  g.x_s = g.x_d + 4 * g.nb;
  g.x_S = g.x_s + 4 * g.nb;
  g.x_bytes = g.x_S + 4 * g.nb;
  return g;
}

#if defined(QI_ON)
// 32 floats -> 32 int8 at ``to``; returns d, the int sum in ``sum``
inline float quantize_block(const float* x, int8_t* to, int32_t* sum) {
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
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}

// ``type``: Q4_0 stores -8 s (its m_b = -8 d_b, applied exactly on this side)
void quantize_row(const float* x, const Geo& g, int64_t type, uint8_t* out) {
  float* xd = reinterpret_cast<float*>(out + g.x_d);
  float* xs = reinterpret_cast<float*>(out + g.x_s);
  int32_t* xS = reinterpret_cast<int32_t*>(out + g.x_S);
  for (int64_t b = 0; b < g.nb; ++b) {
    const float d = quantize_block(x + b * QK, reinterpret_cast<int8_t*>(out) + b * QK, xS + b);
    const float s = d * static_cast<float>(xS[b]);
    xd[b] = d;
    xs[b] = type == Q_Q4_0 ? -8.0f * s : s;
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline int32_t load32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Args {
  const uint8_t* w;  // packed rows
  const uint8_t* x;  // quantized activation rows
  const float* bias;
  float* y;
  int64_t m, N, rb;  // rows, outputs, packed row bytes
  Geo g;
  int64_t pf;  // prefetch distance in bytes (0: none; ``q_prefetch``)
};

// column c of a group of G at ``grp`` against activation row ``xr``: the header's arithmetic, one
// column at a time (the last group's columns, when N % 16 != 0)
// (kept scalar: vectorized by GCC 12.2 with -march=native on an AMX Xeon, this loop summed Q8_0's
// int8 weights as if unsigned; tests/test_gemm_qi.py's last-group columns catch it)
template <int64_t Q>
__attribute__((optimize("no-tree-vectorize"))) float column(const Geo& g, const uint8_t* grp, int64_t G, int64_t c, const uint8_t* xr) {
  const int8_t* xq = reinterpret_cast<const int8_t*>(xr);
  const float* xd = reinterpret_cast<const float*>(xr + g.x_d);
  const float* xs = reinterpret_cast<const float*>(xr + g.x_s);
  float acc = 0.0f;
  for (int64_t b = 0; b < g.nb; ++b) {
    int32_t is = 0;
    const int8_t* xb = xq + b * QK;
    for (int64_t v = 0; v < g.qb / 4; ++v) {
      const uint8_t* w = grp + g.q_at(G, b, v, c);
      for (int i = 0; i < 4; ++i) {
        if constexpr (Q == Q_Q8_0) {
          is += static_cast<int8_t>(w[i]) * xb[4 * v + i];
        } else {
          is += (w[i] & 15) * xb[4 * v + i] + (w[i] >> 4) * xb[16 + 4 * v + i];
        }
      }
    }
    const float dw = fp16(grp + g.d_at(G, b, c));
    acc = std::fma(static_cast<float>(is), dw * xd[b], acc);
    if constexpr (Q != Q_Q8_0) acc = std::fma(Q == Q_Q4_1 ? fp16(grp + g.m_at(G, b, c)) : dw, xs[b], acc);
  }
  return acc;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int RMAX = 8;
constexpr int64_t CW = 16;  // columns in a vector
using VF = __m512;
using VI = __m512i;
inline VI bcast(const uint8_t* p) { return _mm512_set1_epi32(load32(p)); }
inline VI loadw(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VF scales(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF fset(float f) { return _mm512_set1_ps(f); }
inline VF fma_(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul_(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline VI izero() { return _mm512_setzero_si512(); }
inline void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
inline VF addf(VF a, VF b) { return _mm512_add_ps(a, b); }

// Q4 chunk: lo / hi nibbles (u8) against broadcast activations xl, xh, into p
inline VI q4_dot(VI p, VI lo, VI hi, VI xl, VI xh) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(p, lo, xl), hi, xh);  // int32 sums
#else
  return _mm512_add_epi16(p, _mm512_add_epi16(_mm512_maddubs_epi16(lo, xl), _mm512_maddubs_epi16(hi, xh)));  // int16
#endif
}
inline VI q4_total(VI p) {
#if defined(__AVX512VNNI__)
  return p;
#else
  return _mm512_madd_epi16(p, _mm512_set1_epi16(1));
#endif
}
#else
constexpr int RMAX = 4;
constexpr int64_t CW = 8;
using VF = __m256;
using VI = __m256i;
inline VI bcast(const uint8_t* p) { return _mm256_set1_epi32(load32(p)); }
inline VI loadw(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VF scales(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF fset(float f) { return _mm256_set1_ps(f); }
inline VF fma_(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF mul_(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline VI izero() { return _mm256_setzero_si256(); }
inline void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF loadf(const float* p) { return _mm256_loadu_ps(p); }
inline VF addf(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VI q4_dot(VI p, VI lo, VI hi, VI xl, VI xh) {  // int16: 4 chunks of pairs fit (4 * 2 * 2 * 15 * 127)
  return _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
}
inline VI q4_total(VI p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
#endif

// the nibbles of a Q4 chunk
inline void nibbles(VI z, VI& lo, VI& hi) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const VI m4 = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(z, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
#else
  const VI m4 = _mm256_set1_epi8(0x0f);
  lo = _mm256_and_si256(z, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), m4);
#endif
}

// Q8 chunk z (int8 weights) against R broadcast activations, into int32 sums p[r]
template <int R>
inline void q8_chunk(VI z, const uint8_t* const* xb, int64_t off, VI* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)  // (w + 128) x as u8 x s8; 128 S is taken off per block
  const VI u = _mm512_xor_si512(z, _mm512_set1_epi8(static_cast<char>(0x80)));
  for (int r = 0; r < R; ++r) p[r] = _mm512_dpbusd_epi32(p[r], u, bcast(xb[r] + off));
#else  // |w| x sign(w) x (|x| <= 127: no overflow); a pair of products fits int16
  const __mmask64 neg = _mm512_movepi8_mask(z);
  const VI a = _mm512_abs_epi8(z), ones = _mm512_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    const VI x = bcast(xb[r] + off);
    const VI xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    p[r] = _mm512_add_epi32(p[r], _mm512_madd_epi16(_mm512_maddubs_epi16(a, xs), ones));
  }
#endif
#else
  const VI a = _mm256_abs_epi8(z), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    const VI xs = _mm256_sign_epi8(bcast(xb[r] + off), z);
    p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs), ones));
  }
#endif
}

// rows [r0, r0 + R) x columns [c0, c0 + CW) of a full group at ``grp`` (its first column j)
template <int64_t Q, int R>
void tile(const Args& a, const uint8_t* grp, int64_t j, int64_t c0, int64_t r0) {
  const int64_t pf = (c0 == 0 && r0 == 0) ? a.pf : 0;  // one tile per group prefetches
  const int64_t share = GW * a.rb / a.g.nb;  // the group's bytes per block
  const Geo& g = a.g;
  const uint8_t* xb[R];
  const float *xd[R], *xs[R];
  const int32_t* xS[R];
  for (int r = 0; r < R; ++r) {
    xb[r] = a.x + (r0 + r) * g.x_bytes;
    xd[r] = reinterpret_cast<const float*>(xb[r] + g.x_d);
    xs[r] = reinterpret_cast<const float*>(xb[r] + g.x_s);
    xS[r] = reinterpret_cast<const int32_t*>(xb[r] + g.x_S);
  }
  (void)xS;  // read by the VNNI build's Q8_0 only
  VF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t b = 0; b < g.nb; ++b) {
    if (pf > 0) {  // the stream pf bytes ahead, one block's share of the group at a time
      const char* at = reinterpret_cast<const char*>(grp) + b * share + pf;
      for (int64_t o = 0; o < share; o += 64) _mm_prefetch(at + o, _MM_HINT_T0);
    }
    VI p[R];
    for (int r = 0; r < R; ++r) p[r] = izero();
    if constexpr (Q == Q_Q8_0) {
#pragma GCC unroll 1  // one chunk at a time: unrolled, GCC hoists every load and spills
      for (int64_t v = 0; v < 8; ++v) q8_chunk<R>(loadw(grp + g.q_at(GW, b, v, c0)), xb, b * QK + 4 * v, p);
    } else {
#pragma GCC unroll 1
      for (int64_t v = 0; v < 4; ++v) {
        VI lo, hi;
        nibbles(loadw(grp + g.q_at(GW, b, v, c0)), lo, hi);
        for (int r = 0; r < R; ++r)
          p[r] = q4_dot(p[r], lo, hi, bcast(xb[r] + b * QK + 4 * v), bcast(xb[r] + b * QK + 16 + 4 * v));
      }
    }
    const VF dw = scales(grp + g.d_at(GW, b, c0));
    const VF mv = Q == Q_Q4_1 ? scales(grp + g.m_at(GW, b, c0)) : dw;
    for (int r = 0; r < R; ++r) {
      VI is;
      if constexpr (Q == Q_Q8_0) {
#if defined(__AVX512VNNI__)
        is = _mm512_sub_epi32(p[r], _mm512_set1_epi32(128 * xS[r][b]));
#else
        is = p[r];
#endif
      } else {
        is = q4_total(p[r]);
      }
      acc[r] = fma_(cvt(is), mul_(dw, fset(xd[r][b])), acc[r]);
      if constexpr (Q != Q_Q8_0) acc[r] = fma_(mv, fset(xs[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = a.y + (r0 + r) * a.N + j + c0;
    store(y, a.bias ? addf(acc[r], loadf(a.bias + j + c0)) : acc[r]);
  }
}

template <int64_t Q, int R>
void tiles(const Args& a, const uint8_t* grp, int64_t j, int64_t r0) {
  for (int64_t c0 = 0; c0 < GW; c0 += CW) tile<Q, R>(a, grp, j, c0, r0);
}

// group gi's weights toward L2 (the hardware prefetcher stops at every 4 KiB page; a group of
// 16 columns is 5.6 KiB at K = 576 in Q4_1)
inline void prefetch_group(const Args& a, int64_t gi, int64_t g1) {
  if (gi >= g1) return;
  const int64_t j = gi * GW, bytes = std::min<int64_t>(GW, a.N - j) * a.rb;
  const char* p = reinterpret_cast<const char*>(a.w + j * a.rb);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

template <int64_t Q>
void run(const Args& a, int64_t g0, int64_t g1) {
  for (int64_t gi = g0; gi < g1; ++gi) {
    const int64_t j = gi * GW, G = std::min<int64_t>(GW, a.N - j);
    const uint8_t* grp = a.w + j * a.rb;
    if (G < GW) {  // the last group of a matrix whose N is not a multiple of 16
      for (int64_t r = 0; r < a.m; ++r)
        for (int64_t c = 0; c < G; ++c) {
          const float t = column<Q>(a.g, grp, G, c, a.x + r * a.g.x_bytes);
          a.y[r * a.N + j + c] = a.bias ? t + a.bias[j + c] : t;
        }
      continue;
    }
    int64_t r = 0;
    for (; r + RMAX <= a.m; r += RMAX) tiles<Q, RMAX>(a, grp, j, r);
    switch (a.m - r) {
      case 1: tiles<Q, 1>(a, grp, j, r); break;
      case 2: tiles<Q, 2>(a, grp, j, r); break;
      case 3: tiles<Q, 3>(a, grp, j, r); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      case 4: tiles<Q, 4>(a, grp, j, r); break;
      case 5: tiles<Q, 5>(a, grp, j, r); break;
      case 6: tiles<Q, 6>(a, grp, j, r); break;
      case 7: tiles<Q, 7>(a, grp, j, r); break;
#endif
      default: break;
    }
  }
}
#endif  // QI_ON

#if defined(QI_ON) && defined(CADENCE_AMX) && defined(__AMX_INT8__)
#define QI_AMX 1
// AMX int8 tiles, for calls of at least AMX_ROWS rows (big tree verifies). Per full group of 16
// columns and block b of 32 inputs: C (M rows x 16 int32) = A (M activation rows' 32 bytes of block b) x B (the
// block's weights as 8 tile rows, row v holding inputs 4v..4v+3 of the 16 columns, 4 bytes a
// column): exactly the group's chunk layout for Q8_0 (``TDPBSSD``, s8 x s8), and for Q4_* the
// low nibbles of chunks 0-3 (inputs 0-15) then the high ones (16-31), unpacked per call into
// a 512-byte buffer (``TDPBSUD``, s8 activations x u8 nibbles). Each C row is the block's exact
// integer sum isum of the vector code, and the epilogue is the vector code's (the same
// intrinsics on the same values in the same block order), so a row's bits are those of the
// vector kernel's: which kernel ran, and how many rows, changes nothing (tests/test_gemm_qi.py).
// Tiles: 0-1 A, 2-3 B, 4-7 C of up to four blocks in flight. Rows go 16 at a time (the
// activation rows are padded with zeros to a multiple of 16 past 16 rows).
// Why only from 16 rows: a block's scales differ per block, so each tile product covers one
// block of 32 inputs and its C tile is stored and scaled by vector code before the next; those
// fixed costs per block make the tiles slower than VNNI below about 12 rows. Measured
// (2026-12-06, AMX Xeon, 2 threads, in-process A/B, us per call, vector / tiles, with the
// tiles also allowed at 2-8 rows): Q4_1 576 -> 3072 at 2/8/16/32 rows 20/49, 44/56, 79/74,
// 160/145; the Q8_0 LM head (576 -> 49152) 626/828, 853/977, 1531/1177, 2780/1894. At 16+ rows:
// ``benchmarks/kernels/gguf_amx.py`` (docs/fast-path.md).
constexpr int64_t AMX_ROWS = 16;
constexpr int AMX_M = 16;  // rows in a tile

void configure_qi(int M) {
  const uint8_t r = static_cast<uint8_t>(M);
  load_tile_rows({r, r, 8, 8, r, r, r, r}, {32, 32, 64, 64, 64, 64, 64, 64});
}

// a Q4 block's 4 chunks (at q) -> B's 8 rows at ``to``: low nibbles (inputs 4v..) then high (16 + 4v..)
inline void unpack_q4(const uint8_t* q, uint8_t* to) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  for (int v = 0; v < 4; ++v) {
    const __m512i z = _mm512_loadu_si512(q + 64 * v);
    _mm512_store_si512(to + 64 * v, _mm512_and_si512(z, m4));
    _mm512_store_si512(to + 256 + 64 * v, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4));
  }
}

struct alignas(64) AmxScratch {
  int32_t c[4][AMX_M][16];  // C tiles of up to four blocks
  uint8_t b[4][512];         // unpacked Q4 blocks
};

// block b's weights as a B tile's rows (Q4: unpacked into ``to``)
template <int64_t Q>
inline const uint8_t* b_rows(const Geo& g, const uint8_t* grp, int64_t b, uint8_t* to) {
  const uint8_t* w = grp + g.q_at(GW, b, 0, 0);
  if constexpr (Q == Q_Q8_0) return w;
  unpack_q4(w, to);
  return to;
}

// block b's product into C tile CT, through A tile AT and B tile BT (GCC's tile intrinsics
// paste the tile number into the instruction: literals only)
#define QI_BLOCK(AT, BT, CT, BLK)                                            \
  do {                                                                       \
    const uint8_t* w_ = b_rows<Q>(g, grp, (BLK), s.b[CT - 4]);               \
    _tile_loadd(AT, xr + (BLK) * QK, g.x_bytes);                             \
    _tile_loadd(BT, w_, 64);                                                 \
    _tile_zero(CT);                                                          \
    if constexpr (Q == Q_Q8_0) _tile_dpbssd(CT, AT, BT);                     \
    else _tile_dpbsud(CT, AT, BT);                                           \
  } while (0)

// rows [r0, r0 + M) of a full group at ``grp`` (its first column j); rows past a.m are padding
template <int64_t Q>
void group_amx(const Args& a, const uint8_t* grp, int64_t j, int64_t r0, int M, AmxScratch& s) {
  const Geo& g = a.g;
  const uint8_t* xr = a.x + r0 * g.x_bytes;
  __m512 acc[AMX_M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < g.nb; b0 += 4) {
    const int nt = static_cast<int>(std::min<int64_t>(4, g.nb - b0));
    QI_BLOCK(0, 2, 4, b0);
    if (nt > 1) QI_BLOCK(1, 3, 5, b0 + 1);
    if (nt > 2) QI_BLOCK(0, 2, 6, b0 + 2);
    if (nt > 3) QI_BLOCK(1, 3, 7, b0 + 3);
    _tile_stored(4, s.c[0], 64);
    if (nt > 1) _tile_stored(5, s.c[1], 64);
    if (nt > 2) _tile_stored(6, s.c[2], 64);
    if (nt > 3) _tile_stored(7, s.c[3], 64);
    for (int t = 0; t < nt; ++t) {  // the vector tile's epilogue, block by block in order
      const int64_t b = b0 + t;
      const VF dw = scales(grp + g.d_at(GW, b, 0));
      const VF mv = Q == Q_Q4_1 ? scales(grp + g.m_at(GW, b, 0)) : dw;
      for (int r = 0; r < M; ++r) {
        const uint8_t* row = xr + r * g.x_bytes;
        const VI is = _mm512_load_si512(s.c[t][r]);
        acc[r] = fma_(cvt(is), mul_(dw, fset(reinterpret_cast<const float*>(row + g.x_d)[b])), acc[r]);
        if constexpr (Q != Q_Q8_0) acc[r] = fma_(mv, fset(reinterpret_cast<const float*>(row + g.x_s)[b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < M && r0 + r < a.m; ++r) {
    float* y = a.y + (r0 + r) * a.N + j;
    store(y, a.bias ? addf(acc[r], loadf(a.bias + j)) : acc[r]);
  }
}

// groups [g0, g1) on AMX tiles; the last group of a matrix whose N is not a multiple of 16 in
// scalar code, as ``run``
template <int64_t Q>
void run_amx(const Args& a, int64_t g0, int64_t g1) {
  const int M = static_cast<int>(std::min<int64_t>(AMX_M, a.m));
  configure_qi(M);
  AmxScratch s;
  for (int64_t gi = g0; gi < g1; ++gi) {
    const int64_t j = gi * GW, G = std::min<int64_t>(GW, a.N - j);
    const uint8_t* grp = a.w + j * a.rb;
    if (G < GW) {
      for (int64_t r = 0; r < a.m; ++r)
        for (int64_t c = 0; c < G; ++c) {
          const float t = column<Q>(a.g, grp, G, c, a.x + r * a.g.x_bytes);
          a.y[r * a.N + j + c] = a.bias ? t + a.bias[j + c] : t;
        }
      continue;
    }
    prefetch_group(a, gi + 1, g1);
    for (int64_t r0 = 0; r0 < a.m; r0 += AMX_M) group_amx<Q>(a, grp, j, r0, M, s);
  }
  _tile_release();
}

#undef QI_BLOCK

int amx_state = -1;  // -1 undecided, 0 off, 1 on
#endif  // QI_AMX

// Software prefetch of the weight stream, PREFETCH_BYTES ahead of the block being multiplied:
// the hardware prefetcher alone left a one-row product waiting on memory (EPYC Zen 4, 2
// threads, 2026-12-07: the 30 gate_up matrices cycled, 69 -> 38 us a call, the Q8_0 LM head
// 1,345 -> 850 us; whole one-token forward 7.3 -> 6.1 ms, 8-node verify 12.6 -> 9.4 ms;
// 4-32 KiB all helped, 8 KiB best). Only timing changes, never a bit.
constexpr int64_t PREFETCH_BYTES = 8192;
int64_t prefetch_bytes = -1;  // -1: not yet read from CADENCE_GGUF_PREFETCH

// copies a column's blocks between the file's layout (``file``) and a group's (``grp``, G columns)
void move_column(const Geo& g, int64_t type, int64_t G, int64_t c, uint8_t* file, uint8_t* grp, bool to_group) {
  const int64_t bb = file_block_bytes(type), qoff = type == Q_Q4_1 ? 4 : 2;
  auto mv = [to_group](uint8_t* f, uint8_t* p, size_t n) { to_group ? std::memcpy(p, f, n) : std::memcpy(f, p, n); };
  for (int64_t b = 0; b < g.nb; ++b) {
    uint8_t* blk = file + b * bb;
    mv(blk, grp + g.d_at(G, b, c), 2);
    if (type == Q_Q4_1) mv(blk + 2, grp + g.m_at(G, b, c), 2);
    for (int64_t v = 0; v < g.qb / 4; ++v) mv(blk + qoff + 4 * v, grp + g.q_at(G, b, v, c), 4);
  }
}

void repack(const at::Tensor& from, at::Tensor& to, int64_t type, int64_t K, bool to_group) {
  const Geo g = geo(type, K);
  const int64_t n = from.size(0), rb = from.size(1);
  uint8_t* src = const_cast<uint8_t*>(from.data_ptr<uint8_t>());
  uint8_t* dst = to.data_ptr<uint8_t>();
  at::parallel_for(0, (n + GW - 1) / GW, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t gi = g0; gi < g1; ++gi) {
      const int64_t j = gi * GW, G = std::min<int64_t>(GW, n - j);
      for (int64_t c = 0; c < G; ++c) {
        if (to_group) move_column(g, type, G, c, src + (j + c) * rb, dst + j * rb, true);
        else move_column(g, type, G, c, dst + (j + c) * rb, src + j * rb, false);
      }
    }
  });
}

}  // namespace

int64_t q_prefetch() {
  if (prefetch_bytes < 0) {
    const char* e = std::getenv("CADENCE_GGUF_PREFETCH");
    prefetch_bytes = e && *e ? std::max<int64_t>(0, std::atoll(e)) : PREFETCH_BYTES;
  }
  return prefetch_bytes;
}

int64_t set_q_prefetch(int64_t bytes) {
  const int64_t was = q_prefetch();
  prefetch_bytes = std::max<int64_t>(0, bytes);
  return was;
}

bool q_amx_on() {
#if defined(QI_AMX)
  if (amx_state < 0) amx_state = amx_env_allows() && amx_permitted() ? 1 : 0;
  return amx_state == 1;
#else
  return false;
#endif
}

bool set_q_amx(bool on) {
  const bool was = q_amx_on();
#if defined(QI_AMX)
  amx_state = on && amx_permitted() ? 1 : 0;
#else
  (void)on;
#endif
  return was;
}

int64_t q_packed_type(int64_t type, int64_t K) {
#if defined(QI_ON)
  if (is_q(type) && K % QK == 0 && K > 0) return type | Q_PACKED;
#endif
  (void)K;
  return type;
}

at::Tensor q_pack(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "q_pack: (out, row bytes) uint8");
  const int64_t pt = q_packed_type(type, K);
  if (pt == type) return w;
  TORCH_CHECK(w.size(1) == K / QK * file_block_bytes(type), "q_pack: rows of ", w.size(1), " bytes for ", K,
              " inputs of type ", type);
  at::Tensor out = at::empty_like(w);
  repack(w, out, type, K, true);
  return out;
}

at::Tensor q_unpack(const at::Tensor& w, int64_t packed, int64_t K) {
  const int64_t type = packed & ~Q_PACKED;
  at::Tensor out = at::empty_like(w);
  repack(w, out, type, K, false);
  return out;
}

at::Tensor q_linear_packed(const at::Tensor& x2, const at::Tensor& w, int64_t packed, int64_t out, const float* bias,
                           at::Tensor y) {
#if defined(QI_ON)
  const int64_t type = packed & ~Q_PACKED, K = x2.size(1), m = x2.size(0);
  const Geo g = geo(type, K);
#if defined(QI_AMX)
  const bool amx = m >= AMX_ROWS && q_amx_on();
  const int64_t rows = amx && m > AMX_M ? (m + AMX_M - 1) / AMX_M * AMX_M : m;  // whole tiles past 16 rows
#else
  const int64_t rows = m;
#endif
  at::Tensor xq = at::empty({rows, g.x_bytes}, x2.options().dtype(at::kByte));
  const float* xs = x2.data_ptr<float>();
  uint8_t* xd = xq.data_ptr<uint8_t>();
  for (int64_t r = 0; r < m; ++r) quantize_row(xs + r * K, g, type, xd + r * g.x_bytes);
  if (rows > m) std::memset(xd + m * g.x_bytes, 0, (rows - m) * g.x_bytes);
  const Args a{w.data_ptr<uint8_t>(), xd, bias, y.data_ptr<float>(), m, out, w.size(1), g, q_prefetch()};
  const int64_t groups = (out + GW - 1) / GW;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
#if defined(QI_AMX)
  if (amx) {
    at::parallel_for(0, groups, (groups + threads - 1) / threads, [&](int64_t g0, int64_t g1) {
      if (type == Q_Q4_0) run_amx<Q_Q4_0>(a, g0, g1);
      else if (type == Q_Q4_1) run_amx<Q_Q4_1>(a, g0, g1);
      else run_amx<Q_Q8_0>(a, g0, g1);
    });
    return y;
  }
#endif
  at::parallel_for(0, groups, (groups + threads - 1) / threads, [&](int64_t g0, int64_t g1) {
    if (type == Q_Q4_0) run<Q_Q4_0>(a, g0, g1);
    else if (type == Q_Q4_1) run<Q_Q4_1>(a, g0, g1);
    else run<Q_Q8_0>(a, g0, g1);
  });
  return y;
#else
  (void)x2, (void)w, (void)packed, (void)out, (void)bias;
  TORCH_CHECK(false, "q_linear: packed weights need an AVX2 + FMA + F16C build");
  return y;
#endif
}

}  // namespace cadence
