// Row-consistent attention over listed keys on AMX tiles (bf16 only): the same contract as
// ``attention.cpp`` (a row's bits depend only on its query and the keys/values it lists, in
// order), with its matrix products on the CPU's tile unit instead of fp32 FMAs.
//
// Why the contract holds: a tile product C += A B computes row m of C from row m of A and
// column j from column j of B, by a fixed sequence of operations that does not depend on the
// other rows or columns. So
//   scores: S[i][slot] = dot(q_i, k_slot) over head_dim in steps of 32, one tile product per
//           step, for every slot up to the largest one listed (a dense product: a score is
//           one (query, key) pair's, wherever the key sits); row i's scores are then
//           gathered in list order;
//   softmax: fp32, max over the row's raw scores m, exp(s * scale - m * scale) (the
//           argument one fused multiply-subtract) by ``exp4`` (a degree-4 polynomial, about
//           3e-6 relative), the total over 16 lanes in two alternating accumulators then a
//           fixed lane reduction; each weight rounded to bf16 (as PyTorch's CPU flash
//           attention does before its P V product);
//   values: o_i = sum over ranks, in chunks of 32 ranks (0-31, 32-63, ...), accumulated in
//           fp32 in chunk order; a chunk's values are its ranks' keys in list order. Every
//           chunk but the last is one tile product per 16 output dims: those every row of a
//           work item has in its contiguous prefix for 16 rows at once from the cache's
//           values, the rest (a chunk that reaches into a row's tree ancestors) per row, from
//           its gathered values, continuing the same accumulators. The row's last chunk (the
//           one holding its list's last rank, the token itself: never shared) is added rank
//           by rank with FMAs (``last_chunk``): one token's work instead of a gathered
//           32-rank tile product per row, which cost a 32-node verify more than its softmax;
//   output: o_i * (1 / softmax total), rounded to bf16 once.
// A chunk therefore sees the same inputs in the same order whether it was computed shared or
// per row, in a tree of 32 nodes or in a one-token forward: the same bits. The arithmetic
// differs from ``attention.cpp``'s fp32 kernel (bf16 products, bf16 weights), so a process
// uses one of the two for every call (``amx_listed_on``), decided once.
//
// Work split: items of (batch, kv head, a share of the query rows), every row's grouped heads
// in one item, at least two items per thread where the rows allow it.
//
// Knows: Linux's permission request for tile data (arch_prctl), tile configuration, head
// sizes that are multiples of 32. Does not know trees or caches: the caller lists the keys.

#include "attention_amx.h"

#include "amx.h"

#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>


namespace cadence {

#ifdef CADENCE_AMX
namespace {

using namespace vec;

// palette 1, every tile 64 bytes a row: tiles 1-3 (B) 16 rows, tiles 0 (A) and 4-7 (C)
// ``rows`` rows (16 for the shared products; a row's g query heads for its own chunks, whose
// tile products then touch only the rows that are its: a tile row's result depends on that
// row alone, so the bits are those of a 16-row product)
void configure_tiles(int rows = 16) {
  const uint8_t r = static_cast<uint8_t>(rows);
  load_tile_rows({r, 16, 16, 16, r, r, r, r});
}

typedef uint16_t bf16;  // raw bits

// 64-byte aligned storage: every tile row the kernel loads or stores is then one cache line
// (with malloc's 16-byte alignment a process could draw buffers whose tile rows straddle two,
// and a 32-node forward ran 30% slower in such processes)
template <typename T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <typename U>
  Aligned(const Aligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned<U>&) const { return false; }
};
template <typename T>
using avec = std::vector<T, Aligned<T>>;

// 16 floats -> bf16, round to nearest even (finite inputs: x + 0x7FFF + its bit 16, top half)
inline void round16(__m512 v, bf16* out) {
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                        _mm512_set1_epi32(1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

// n floats (n a multiple of 16) times ``mul`` -> bf16, as ``round16``
inline void round_row(const float* x, bf16* out, int64_t n, float mul = 1.0f) {
  const __m512 f = _mm512_set1_ps(mul);
  for (int64_t j = 0; j < n; j += 16) round16(_mm512_mul_ps(_mm512_loadu_ps(x + j), f), out + j);
}

// 32 softmax weights (lo, hi: normal floats or zeros) -> bf16 at out, round to nearest even
// as ``round16``; only lo's 16 when ``both`` is false. One AVX512-BF16 conversion where the
// CPU has it (the same bits: the weights are never denormal, see ``exp4``).
inline void round32(__m512 lo, __m512 hi, bf16* out, bool both) {
#if defined(__AVX512BF16__)
  if (both) {
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    return;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
#else
  round16(lo, out);
  if (both) round16(hi, out + 16);
#endif
}

// 16 x 16 32-bit words: out row p = word p of every input row (rows[j] -> 16 words each)
inline void transpose16(const uint32_t* const* rows, uint32_t* out) {
  __m512i r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = rows[j] ? _mm512_loadu_si512(rows[j]) : _mm512_setzero_si512();
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {
    r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
    r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
    r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
    r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  // r[4a + b] now holds, per 128-bit lane L, words 4L + b' of rows 4a..4a+3 (b' the word index)
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 4; ++b) {
      t[8 * a + b] = _mm512_shuffle_i32x4(r[8 * a + b], r[8 * a + 4 + b], 0x88);
      t[8 * a + 4 + b] = _mm512_shuffle_i32x4(r[8 * a + b], r[8 * a + 4 + b], 0xDD);
    }
  for (int b = 0; b < 8; ++b) {
    r[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);
    r[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xDD);
  }
  for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + 16 * p, r[p]);
}

// exp(x) for x <= 0 on 16 lanes: n = round(x / ln 2), r = x - n ln 2 (one FMA; ln 2's fp32
// rounding adds at most 2.4e-7 at n = -126), a degree-4 polynomial in r fitted for the least
// largest relative error by FMAs, times 2^n (scalef): 2.9e-6 relative over [-87, 0] in an
// fp32 emulation (the degree-5 Taylor form with a two-part ln 2 before: 3.3e-6); the weights
// are rounded to bf16 anyway.
// Arguments below -87 are clamped there (the result is then about 1.4 * 2^-126: never a
// denormal, so bf16 conversions that flush denormals round it as ``round16`` does).
inline __m512 exp4(__m512 x, __mmask16 live = 0xFFFF) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);  // ln 2 in one part: n >= -126
  __m512 y = _mm512_set1_ps(0.041458610445261f);  // minimax on [-ln2/2, ln2/2] (relative error)
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.16790908575057983f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5000435709953308f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.9999634027481079f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_maskz_scalef_ps(live, y, n);  // lanes outside ``live``: 0
}

// One work item: rows [r0, r1) of batch bi against kv head kvh; vector i = (r - r0) * g + h
// (the g query heads of a row next to each other, so a row's tail is one tile product).
struct AmxItem {
  const bf16 *Q, *K, *V;      // q rows of head h: Q + h * qh + r * qr; K, V: this (bi, kvh)
  int64_t qh, qr, sk, sv, L;  // strides (elements); L: slots in the cache
  int64_t D, g, bi, n, r0, r1;
  float scale;
  const Lists* lists;
  bf16* O;      // output of head h, row r: O + h * oh + r * orow
  int64_t oh, orow;

  struct Buf {
    avec<bf16> q, kt, vt, p, tail;
    avec<float> s, sr, acc, inv;
    std::vector<int64_t> at;  // tails: row r's chunks are [at[r], at[r + 1])
  };

  int64_t row(int64_t i) const { return bi * n + r0 + i / g; }

  void operator()(Buf& b) const {
    const int64_t m = (r1 - r0) * g, m16 = (m + 15) / 16 * 16, steps = D / 32, dts = D / 16;
    int64_t lk = 0, longest = 0, shared = INT64_MAX;  // slots scored, longest list, shared prefix
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t rw = bi * n + r;
      lk = std::max<int64_t>(lk, lists->prefix[rw]);
      for (int64_t j = 0; j < lists->count[rw]; ++j) lk = std::max<int64_t>(lk, lists->extra[rw * lists->E + j] + 1);
      longest = std::max<int64_t>(longest, lists->size(rw));
      shared = std::min<int64_t>(shared, std::min<int64_t>(lists->prefix[rw], last_start(lists->size(rw))));
    }
    const int64_t lk16 = (lk + 15) / 16 * 16, width = (longest + 31) / 32 * 32, chunks = shared / 32;
    pack_queries(b, m, m16);
    pack_keys(b, lk16);
    scores(b, m16, lk16);
    weights(b, m, m16, lk16, width);
    pack_values(b, chunks);
    b.acc.resize((m16 + 16) * D);  // a tail's 16-row tiles may read past m16
    for (int64_t mt = 0; mt < m16 / 16; ++mt)  // shared chunks, 16 vectors at a time
      for (int64_t t0 = 0; t0 < dts; t0 += 4)
        values(b.p.data() + mt * 16 * width, width, b.vt.data(), chunks, dts, t0, std::min<int64_t>(4, dts - t0),
               b.acc.data() + mt * 16 * D, D, true);
    tails(b, chunks * 32, width);
  }

  // queries as A tiles: (m16, D) bf16, rows past m zero
  void pack_queries(Buf& b, int64_t m, int64_t m16) const {
    b.q.resize(m16 * D);
    std::memset(b.q.data() + m * D, 0, (m16 - m) * D * 2);
    for (int64_t i = 0; i < m; ++i) {  // D * 2 bytes a row, 64 at a time (D is a multiple of 32)
      const bf16* src = Q + (i % g) * qh + (r0 + i / g) * qr;
      for (int64_t d = 0; d < D; d += 32) _mm512_storeu_si512(b.q.data() + i * D + d, _mm512_loadu_si512(src + d));
    }
  }

  // keys as B tiles: block (kb, s) holds slots kb*16 + j (j < 16), dims s*32 + 2p + e at
  // [p][2j + e]: the 16 x 16 transpose of the block's 32-bit dim pairs; slots past L zero
  void pack_keys(Buf& b, int64_t lk16) const {
    const int64_t steps = D / 32;
    b.kt.resize(lk16 * D);
    uint32_t* out = reinterpret_cast<uint32_t*>(b.kt.data());
    for (int64_t kb = 0; kb < lk16 / 16; ++kb)
      for (int64_t s = 0; s < steps; ++s) {
        const uint32_t* rows[16];
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t slot = kb * 16 + j;
          rows[j] = slot < L ? reinterpret_cast<const uint32_t*>(K + slot * sk + s * 32) : nullptr;
        }
        transpose16(rows, out + (kb * steps + s) * 256);
      }
  }

  // b.s (m16, lk16) = Q K^T over slots [0, lk16), four key blocks at a time (four
  // accumulators in flight); a score is one tile element's, whichever block it is in
  void scores(Buf& b, int64_t m16, int64_t lk16) const {
    const int64_t steps = D / 32, kbs = lk16 / 16, blk = steps * 512;
    b.s.resize(m16 * lk16);
    for (int64_t mt = 0; mt < m16 / 16; ++mt)
      for (int64_t kb = 0; kb < kbs; kb += 4) {
        const int64_t nk = std::min<int64_t>(4, kbs - kb);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t s = 0; s < steps; ++s) {
          const bf16* kt = b.kt.data() + (kb * steps + s) * 512;
          _tile_loadd(0, b.q.data() + mt * 16 * D + s * 32, D * 2);
          _tile_loadd(1, kt, 64);
          _tile_dpbf16ps(4, 0, 1);
          if (nk > 1) {
            _tile_loadd(2, kt + blk, 64);
            _tile_dpbf16ps(5, 0, 2);
          }
          if (nk > 2) {
            _tile_loadd(3, kt + 2 * blk, 64);
            _tile_dpbf16ps(6, 0, 3);
          }
          if (nk > 3) {
            _tile_loadd(1, kt + 3 * blk, 64);
            _tile_dpbf16ps(7, 0, 1);
          }
        }
        float* out = b.s.data() + mt * 16 * lk16 + kb * 16;
        _tile_stored(4, out, lk16 * 4);
        if (nk > 1) _tile_stored(5, out + 16, lk16 * 4);
        if (nk > 2) _tile_stored(6, out + 32, lk16 * 4);
        if (nk > 3) _tile_stored(7, out + 48, lk16 * 4);
      }
  }

  // vector i's scores in list order -> softmax weights (of the scaled scores), rounded to bf16 into b.p
  // row i (zero past its list); b.inv[i] = 1 / the fp32 weights' total. The max is exact
  // whatever the order; the total adds 16-lane blocks alternately into two accumulators,
  // then the lanes' fixed reduction.
  void weights(Buf& b, int64_t m, int64_t m16, int64_t lk16, int64_t width) const {
    b.sr.resize(width + 16);
    b.p.resize((m16 + 16) * width);  // padding rows: their outputs are dropped
    b.inv.resize(m);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t rw = row(i), c = lists->size(rw), pre = lists->prefix[rw];
      const int64_t p16 = pre / 16 * 16;  // blocks of the prefix read straight from the scores
      const float* s = b.s.data() + i * lk16;
      const int32_t* extra = lists->extra + rw * lists->E;
      float* sr = b.sr.data();  // raw scores in list order from p16 on
      __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
      int64_t j = 0;
      for (; j + 32 <= p16; j += 32) {  // the max of the raw scores (scaling by sc > 0 keeps the order)
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
      }
      if (j < p16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
      // the rest in list order: the prefix's last partial block, then the listed slots
      // (gathered), into sr (raw); lanes past the list are -inf
      const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t jb = p16; jb < c; jb += 16) {
        const __m512i jv = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(jb)), iota);
        const __mmask16 live = _mm512_cmplt_epi32_mask(jv, _mm512_set1_epi32(static_cast<int32_t>(c)));
        const __mmask16 listed = live & ~_mm512_cmplt_epi32_mask(jv, _mm512_set1_epi32(static_cast<int32_t>(pre)));
        // lane l of the block (rank jb + l >= pre) takes extra[jb + l - pre]; the load's
        // base may sit before ``extra``, but only its listed lanes are read
        const auto base = reinterpret_cast<const int32_t*>(reinterpret_cast<uintptr_t>(extra) +
                                                           static_cast<intptr_t>(jb - pre) * 4);
        const __m512i idx = _mm512_mask_loadu_epi32(jv, listed, base);
        const __m512 x = _mm512_mask_i32gather_ps(_mm512_set1_ps(-INFINITY), live, idx, s, 4);
        _mm512_storeu_ps(sr + jb, x);
        m1 = _mm512_max_ps(m1, x);
      }
      // exp(s * scale - top) with top = max * scale, one rounding (a fused multiply-subtract)
      // whether the score came from the prefix or the list: a rank's bits do not depend on
      // which part of the list it sits in (a tree's ancestors are the prefix of plain decoding)
      const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) * scale);
      __m512 z[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      bf16* p = b.p.data() + i * width;
      const int64_t w16 = (c + 15) / 16 * 16;
      for (int64_t j0 = 0; j0 < w16; j0 += 32) {  // two blocks of 16 at a time (the second maybe past w16)
        __m512 e[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t at = j0 + 16 * h;
          const __mmask16 live = at + 16 <= c ? 0xFFFF : at >= c ? 0 : static_cast<__mmask16>((1u << (c - at)) - 1);
          if (at >= w16) {  // past the list: nothing to compute
            e[h] = _mm512_setzero_ps();
            continue;
          }
          const __m512 x = _mm512_loadu_ps(at < p16 ? s + at : sr + at);
          e[h] = exp4(_mm512_fmsub_ps(x, sc, t), live);
          z[h] = _mm512_add_ps(z[h], e[h]);
        }
        round32(e[0], e[1], p + j0, j0 + 32 <= w16);
      }
      std::memset(p + w16, 0, (width - w16) * 2);
      b.inv[i] = 1.0f / _mm512_reduce_add_ps(_mm512_add_ps(z[0], z[1]));
    }
  }

  // values of slots [0, chunks * 32) as B tiles: chunk c, dim tile t holds ranks 32c + 2p + e,
  // dims 16t + d at [p][2d + e]
  void pack_values(Buf& b, int64_t chunks) const {
    b.vt.resize(chunks * 32 * D);
    for (int64_t c = 0; c < chunks; ++c) interleave(V + c * 32 * sv, sv, nullptr, 32, b.vt.data() + c * 32 * D);
  }

  // 32 value rows (row j at base + j * stride, or base + slots[j] * stride) -> one chunk of
  // B tiles (D / 16 tiles of 512); rows from ``real`` on are zero
  void interleave(const bf16* base, int64_t stride, const int64_t* slots, int64_t real, bf16* out) const {
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t j = 2 * p;
      const bf16* a = j < real ? base + (slots ? slots[j] : j) * stride : nullptr;
      const bf16* b = j + 1 < real ? base + (slots ? slots[j + 1] : j + 1) * stride : nullptr;
      for (int64_t t = 0; t < D / 16; ++t) {
        const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * t)))
                             : _mm512_setzero_si512();
        const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * t)))
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(out + t * 512 + p * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }

  // every row's chunks past the shared ones (ranks [start, its list's end)): the full ones
  // (a tree whose ancestors reach past a 32-rank boundary) gathered into b.tail and
  // continued on tiles configured for the row's g vectors, then the last chunk (the one
  // holding the list's last rank) by FMAs (``last_chunk``), then every row's output.
  void tails(Buf& b, int64_t start, int64_t width) const {
    const int64_t rows = r1 - r0, dts = D / 16;
    b.at.resize(rows + 1);
    b.at[0] = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = lists->size(row(r * g));
      b.at[r + 1] = b.at[r] + (last_start(c) - start) / 32;
    }
    b.tail.resize(b.at[rows] * 32 * D);
    int64_t slots[32];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t rw = row(r * g);
      for (int64_t ch = 0; ch < b.at[r + 1] - b.at[r]; ++ch) {
        for (int64_t j = 0; j < 32; ++j) slots[j] = lists->key(rw, start + ch * 32 + j);
        interleave(V, sv, slots, 32, b.tail.data() + (b.at[r] + ch) * 32 * D);
      }
    }
    if (b.at[rows] > 0) {
      configure_tiles(static_cast<int>(g));
      for (int64_t r = 0; r < rows; ++r)
        if (b.at[r + 1] > b.at[r])
          for (int64_t t0 = 0; t0 < dts; t0 += 4)
            values(b.p.data() + r * g * width + start, width, b.tail.data() + b.at[r] * 32 * D, b.at[r + 1] - b.at[r],
                   dts, t0, std::min<int64_t>(4, dts - t0), b.acc.data() + r * g * D, D, false);
      configure_tiles();
    }
    for (int64_t r = 0; r < rows; ++r) {
      last_chunk(b, r, width);
      for (int64_t h = 0; h < g; ++h)
        round_row(b.acc.data() + (r * g + h) * D, O + h * oh + (r0 + r) * orow, D, b.inv[r * g + h]);
    }
  }

  // the first rank of the chunk that holds a list's last rank (c >= 1 ranks). Example: c = 201
  // (200 committed keys and the token itself) -> 192; c = 192 -> 160.
  static int64_t last_start(int64_t c) { return (c - 1) / 32 * 32; }

  // row r's last chunk (ranks [last_start(c), c)), added to its g vectors' accumulators rank
  // by rank in rank order, acc = fma(weight, value, acc) per dimension (a bf16 weight times a
  // bf16 value is exact in fp32: one rounding per rank). The chunk is the same ranks in the
  // same order in a one-token forward and in any tree (its list ends at the token itself),
  // and never a shared chunk, so this arithmetic is the chunk's in every forward.
  void last_chunk(Buf& b, int64_t r, int64_t width) const {
    const int64_t rw = row(r * g), c = lists->size(rw), l0 = last_start(c), real = c - l0;
    float w[16][32];  // the g vectors' weights of the chunk, widened
    for (int64_t h = 0; h < g; ++h) {
      const bf16* p = b.p.data() + (r * g + h) * width + l0;
      for (int64_t j = 0; j < real; ++j) {
        const uint32_t u = static_cast<uint32_t>(p[j]) << 16;
        std::memcpy(&w[h][j], &u, 4);
      }
    }
    const bf16* vrow[32];
    for (int64_t j = 0; j < real; ++j) vrow[j] = V + lists->key(rw, l0 + j) * sv;
    float* acc = b.acc.data() + r * g * D;  // the g vectors' accumulators, D floats each
    switch (D) {  // the head sizes with AMX kernels (multiples of 32, ``LISTED_HEAD_DIMS``)
      case 32: return fma_ranks<2>(acc, w, vrow, real);
      case 64: return fma_ranks<4>(acc, w, vrow, real);
      case 96: return fma_ranks<6>(acc, w, vrow, real);
      case 128: return fma_ranks<8>(acc, w, vrow, real);
      case 192: return fma_ranks<12>(acc, w, vrow, real);
      case 256: return fma_ranks<16>(acc, w, vrow, real);
      default: return;  // refused before the parallel region (``amx_listed_attention``)
    }
  }

  static __m512 load_bf16(const bf16* p) {  // 16 bf16 -> fp32 (exact)
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }

  // ``last_chunk``'s sums with D = 16 * DTS: heads in groups of max(1, 16 / DTS) whose
  // accumulators stay in registers, ranks outer (each value row read once per group); every
  // accumulator lane takes its FMAs in rank order
  template <int DTS>
  void fma_ranks(float* acc, const float (*w)[32], const bf16* const* vrow, int64_t real) const {
    constexpr int HG = DTS >= 16 ? 1 : 16 / DTS;
    const int64_t D16 = 16 * DTS;
    for (int64_t h0 = 0; h0 < g; h0 += HG) {
      const int64_t hn = std::min<int64_t>(HG, g - h0);
      __m512 a[HG][DTS];
#pragma GCC unroll 8
      for (int h = 0; h < HG; ++h)
#pragma GCC unroll 8
        for (int t = 0; t < DTS; ++t) a[h][t] = h < hn ? _mm512_loadu_ps(acc + (h0 + h) * D16 + 16 * t) : _mm512_setzero_ps();
      for (int64_t j = 0; j < real; ++j) {
        __m512 v[DTS];
#pragma GCC unroll 8
        for (int t = 0; t < DTS; ++t) v[t] = load_bf16(vrow[j] + 16 * t);
#pragma GCC unroll 8
        for (int h = 0; h < HG; ++h) {
          if (h >= hn) break;
          const __m512 wj = _mm512_set1_ps(w[h0 + h][j]);
#pragma GCC unroll 8
          for (int t = 0; t < DTS; ++t) a[h][t] = _mm512_fmadd_ps(wj, v[t], a[h][t]);
        }
      }
#pragma GCC unroll 8
      for (int h = 0; h < HG; ++h)
        if (h < hn)
#pragma GCC unroll 8
          for (int t = 0; t < DTS; ++t) _mm512_storeu_ps(acc + (h0 + h) * D16 + 16 * t, a[h][t]);
    }
  }

  // acc (the configured rows, row stride ``as`` floats), dim tiles [t0, t0 + nt), nt <= 4 += P
  // (as many rows, row stride ``ps``, chunk c at columns 32c) x the packed value chunks ``vt``
  // (dts tiles each); ``fresh``: from zero instead of acc
  static void values(const bf16* p, int64_t ps, const bf16* vt, int64_t nchunks, int64_t dts, int64_t t0, int64_t nt,
                     float* acc, int64_t as, bool fresh) {
    if (fresh) {  // accumulators start at zero
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
    } else {
      _tile_loadd(4, acc + (t0 + 0) * 16, as * 4);
      if (nt > 1) _tile_loadd(5, acc + (t0 + 1) * 16, as * 4);
      if (nt > 2) _tile_loadd(6, acc + (t0 + 2) * 16, as * 4);
      if (nt > 3) _tile_loadd(7, acc + (t0 + 3) * 16, as * 4);
    }
    for (int64_t c = 0; c < nchunks; ++c) {
      const bf16* v = vt + (c * dts + t0) * 512;
      _tile_loadd(0, p + c * 32, ps * 2);
      _tile_loadd(1, v, 64);
      _tile_dpbf16ps(4, 0, 1);
      if (nt > 1) {
        _tile_loadd(2, v + 512, 64);
        _tile_dpbf16ps(5, 0, 2);
      }
      if (nt > 2) {
        _tile_loadd(3, v + 1024, 64);
        _tile_dpbf16ps(6, 0, 3);
      }
      if (nt > 3) {
        _tile_loadd(1, v + 1536, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(4, acc + (t0 + 0) * 16, as * 4);
    if (nt > 1) _tile_stored(5, acc + (t0 + 1) * 16, as * 4);
    if (nt > 2) _tile_stored(6, acc + (t0 + 2) * 16, as * 4);
    if (nt > 3) _tile_stored(7, acc + (t0 + 3) * 16, as * 4);
  }
};

int state = -1;  // -1 undecided, 0 off, 1 on

}  // namespace

bool amx_listed_on() {
  if (state < 0) state = amx_env_allows() && amx_permitted() ? 1 : 0;
  return state == 1;
}

bool set_amx_listed(bool on) {
  const bool was = amx_listed_on();
  state = on && amx_permitted() ? 1 : 0;
  return was;
}

void amx_listed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const vec::Lists& lists,
                          at::Tensor& out, float scale) {
  const int64_t b = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), KV = k.size(1), g = H / KV;
  TORCH_CHECK((D == 32 || D == 64 || D == 96 || D == 128 || D == 192 || D == 256) && g <= 16 &&
                  q.scalar_type() == at::kBFloat16 && out.stride(3) == 1,
              "listed_attention (AMX): bf16, head_dim 32, 64, 96, 128, 192 or 256, at most 16 heads per kv head");
  const int64_t pieces = std::min<int64_t>(n, std::max<int64_t>(1, (2 * at::get_num_threads() + b * KV - 1) / (b * KV)));
  const bf16* qp = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  const bf16* kp = reinterpret_cast<const bf16*>(k.data_ptr<at::BFloat16>());
  const bf16* vp = reinterpret_cast<const bf16*>(v.data_ptr<at::BFloat16>());
  bf16* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, b * KV * pieces, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    thread_local AmxItem::Buf buf;  // reused across calls
    for (int64_t item = begin; item < end; ++item) {
      const int64_t piece = item % pieces, kvh = (item / pieces) % KV, bi = item / (pieces * KV);
      const int64_t r0 = piece * n / pieces, r1 = (piece + 1) * n / pieces;
      if (r0 == r1) continue;
      const AmxItem work{qp + bi * q.stride(0) + kvh * g * q.stride(1), kp + bi * k.stride(0) + kvh * k.stride(1),
                         vp + bi * v.stride(0) + kvh * v.stride(1), q.stride(1), q.stride(2), k.stride(2), v.stride(2),
                         k.size(2), D, g, bi, n, r0, r1, scale, &lists, op + bi * out.stride(0) + kvh * g * out.stride(1), out.stride(1), out.stride(2)};
      work(buf);
    }
    _tile_release();
  });
}

#else  // built without AMX

bool amx_listed_on() { return false; }
bool set_amx_listed(bool) { return false; }
void amx_listed_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const vec::Lists&, at::Tensor&,
                          float) {
  TORCH_CHECK(false, "listed_attention: built without AMX");
}

#endif

}  // namespace cadence
