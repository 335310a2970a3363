// Row-consistent attention over listed keys: every query row attends to the keys its list
// names, reduced in list order with a fixed grouping, so a row's output depends only on its
// query and its keys/values, never on where they sit in the cache, how many keys other rows
// have, or how many rows the call holds.
//
// That is what lossless bf16 speculation needs (``cadence.fast.consistent``): a tree node
// must get the bits plain decoding gives it, although its ancestors sit at scattered cache
// slots. Through PyTorch's CPU attention the masked gaps move the real keys to other lanes
// of the kernel's reductions, so a branching tree attended once per root-to-leaf path
// (``PathAttention``). Here a node lists the context's keys then its ancestors' slots, the
// same keys in the same order as the one-token forward at its position: one call for any
// tree, and the one-token forward itself goes through the same code.
//
// Arithmetic of one row (fp32 throughout; bf16 inputs are widened exactly):
//   q' = q * scale                                          (one rounding per element)
//   s_j = dot(q', k_j): 16 lane sums over head_dim, lane l accumulating elements l, l+16,
//         ... in order by fused multiply-add, then the lanes added pairwise (8, 4, 2, 1 apart)
//   m = max_j s_j;  p_j = exp_(s_j - m)  (``exp_``: one polynomial, the same for every j)
//   z = 16 lane sums of p_j (lane j % 16, j in order), added pairwise as above
//   o = (sum_j p_j * v_j by fused multiply-add, j in order) * (1 / z), rounded to the
//       output dtype once
// Every operation is a lane-wise IEEE one on 16-float vectors (``v16``); fused multiply-adds
// are explicit (``fma``) and -ffp-contract=off keeps the compiler from fusing anything else,
// so the bits do not depend on the vector width the compiler picks: builds for AVX-512,
// AVX2 + FMA and plain x86-64 (``std::fma`` per lane) give the same bits
// (tests/test_listed_attention.py).
//
// Work: a block of 16 ranks that every row of a work item shares (the context) is widened
// to fp32 once (fp32 keys are read where they lie) and used by up to 4 query vectors at a time (``shared_scores``,
// ``shared_values``); a row's own ranks (its tree ancestors) are gathered per row. Items are
// (batch, kv head, a share of the query vectors of that kv head), at least two per thread.
//
// On a CPU with AMX, bf16 calls go to ``attention_amx.cpp`` instead (the same contract, other
// arithmetic; one of the two for every call of a process).
//
// Knows: float32 and bfloat16 inputs whose last dimension is contiguous (and float32 queries over
// a float16 cache, its keys and values widened exactly as they are read), grouped-query
// heads, head sizes 16 x {1, 2, 4, 6, 8, 12, 16}. Does not know trees or caches: the caller
// lists the keys.

#include "attention.h"
#include "attention_amx.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace cadence {

namespace {

using namespace vec;

// lane partial sums of q . k: lane l adds q[d] * k[d] for d = l, l + 16, ... in order
template <int C>
inline v16 partial(const v16* q, const float* k) {
  v16 p{};
  for (int c = 0; c < C; ++c) p = fma(q[c], load(k + 16 * c), p);
  return p;
}


// The query vectors of one work item: grouped-query heads sharing one kv head, each at one
// query row. Ranks [0, shared) name keys 0..shared-1 for every vector, so each block of 16
// of them is widened once for all; later ranks are gathered per vector. C = head_dim / 16.
template <typename T, typename KT, int C>  // T: queries and outputs; KT: keys and values
struct Item {
  static constexpr int64_t D = 16 * C;
  static constexpr int QB = C <= 4 ? 4 : 2;  // query vectors per register block
  // a shared block as the products read it: bf16 keys widened into a buffer first, float32 and
  // float16 ones read where they lie (a float16 chunk widens in the register it is loaded to)
  using BT = std::conditional_t<std::is_same_v<KT, at::BFloat16>, float, KT>;
  const KT* K;
  const KT* V;
  int64_t sk, sv;
  float scale;
  const Lists* lists;

  // qs: query rows (D each), rows: the list row of each, outs: where each output goes
  void operator()(const std::vector<const T*>& qs, const std::vector<int64_t>& rows, const std::vector<T*>& outs,
                  std::vector<float>& buf) const {
    const int64_t m = static_cast<int64_t>(qs.size());
    int64_t shared = INT64_MAX, longest = 0;
    for (int64_t row : rows) {
      shared = std::min<int64_t>(shared, lists->prefix[row]);
      longest = std::max<int64_t>(longest, lists->size(row));
    }
    shared = shared / LANES * LANES;
    const int64_t width = (longest + LANES - 1) / LANES * LANES;  // scores per vector, padded
    buf.resize(static_cast<size_t>(m * (width + 2 * D + 1) + LANES * D));
    float* scores = buf.data();      // (m, width)
    float* qf = scores + m * width;  // (m, D) scaled queries
    float* acc = qf + m * D;         // (m, D) weighted sums of values
    float* blk = acc + m * D;        // (16, D) one block of keys or values, widened
    float* inv = blk + LANES * D;    // (m,) 1 / softmax total
    for (int64_t i = 0; i < m; ++i)
      for (int c = 0; c < C; ++c) store(qf + i * D + 16 * c, load(qs[i] + 16 * c) * scale);
    v16 part[LANES], q[C], a[C];
    for (int64_t j0 = 0; j0 < shared; j0 += LANES) {  // scores over the shared blocks
      int64_t bs;
      const BT* kb = block(K + j0 * sk, sk, blk, bs);
      int64_t i = 0;
      for (; i + QB <= m; i += QB) shared_scores<QB>(qf + i * D, kb, bs, scores + i * width + j0, width);
      for (; i < m; ++i) shared_scores<1>(qf + i * D, kb, bs, scores + i * width + j0, width);
    }
    for (int64_t i = 0; i < m; ++i) {  // the rest, gathered (padding ranks read key 0, then get -inf)
      const int64_t c_i = lists->size(rows[i]);
      for (int c = 0; c < C; ++c) q[c] = load(qf + i * D + 16 * c);
      for (int64_t j0 = shared; j0 < width; j0 += LANES) {
        for (int r = 0; r < LANES; ++r) {
          const int64_t j = j0 + r;
          const KT* kj = K + (j < c_i ? lists->key(rows[i], j) : 0) * sk;
          for (int c = 0; c < C; ++c) store(blk + r * D + 16 * c, load(kj + 16 * c));
          part[r] = partial<C>(q, blk + r * D);
        }
        store(scores + i * width + j0, totals(part));
      }
      inv[i] = softmax_row(scores + i * width, c_i, width);
    }
    for (int64_t i = 0; i < m * D; ++i) acc[i] = 0.0f;
    for (int64_t j0 = 0; j0 < shared; j0 += LANES) {  // values over the shared blocks, ranks in order
      int64_t bs;
      const BT* vb = block(V + j0 * sv, sv, blk, bs);
      int64_t i = 0;
      for (; i + QB <= m; i += QB) shared_values<QB>(scores + i * width + j0, width, vb, bs, acc + i * D);
      for (; i < m; ++i) shared_values<1>(scores + i * width + j0, width, vb, bs, acc + i * D);
    }
    for (int64_t i = 0; i < m; ++i) {  // the rest, gathered
      const int64_t c_i = lists->size(rows[i]);
      const float* p = scores + i * width;
      for (int c = 0; c < C; ++c) a[c] = load(acc + i * D + 16 * c);
      for (int64_t j = shared; j < c_i; ++j) {
        const KT* vj = V + lists->key(rows[i], j) * sv;
        const v16 w = splat(p[j]);
        for (int c = 0; c < C; ++c) a[c] = fma(w, load(vj + 16 * c), a[c]);
      }
      float o[LANES];
      for (int c = 0; c < C; ++c) {
        store(o, a[c] * inv[i]);
        for (int l = 0; l < LANES; ++l) outs[i][16 * c + l] = static_cast<T>(o[l]);
      }
    }
  }

  // scores of Q query vectors (qf: (Q, D), scaled) against one block of 16 fp32 keys (row r
  // at blk + r * bs) -> out[i * width + r]; each key chunk is loaded once for the Q vectors
  template <int Q>
  static void shared_scores(const float* qf, const BT* blk, int64_t bs, float* out, int64_t width) {
    v16 q[Q][C], part[Q][LANES];
    for (int i = 0; i < Q; ++i)
      for (int c = 0; c < C; ++c) q[i][c] = load(qf + i * D + 16 * c);
    for (int r = 0; r < LANES; ++r) {
      v16 p[Q];
      for (int i = 0; i < Q; ++i) p[i] = v16{};
      for (int c = 0; c < C; ++c) {
        const v16 kc = load(blk + r * bs + 16 * c);
        for (int i = 0; i < Q; ++i) p[i] = fma(q[i][c], kc, p[i]);
      }
      for (int i = 0; i < Q; ++i) part[i][r] = p[i];
    }
    for (int i = 0; i < Q; ++i) store(out + i * width, totals(part[i]));
  }

  // acc (Q, D) += the 16 weights of each vector (p: (Q, width) from this block) times the
  // block's fp32 values (row r at blk + r * bs), in rank order; each value chunk is loaded
  // once for the Q vectors
  template <int Q>
  static void shared_values(const float* p, int64_t width, const BT* blk, int64_t bs, float* acc) {
    v16 a[Q][C];
    for (int i = 0; i < Q; ++i)
      for (int c = 0; c < C; ++c) a[i][c] = load(acc + i * D + 16 * c);
    for (int r = 0; r < LANES; ++r) {
      v16 w[Q];
      for (int i = 0; i < Q; ++i) w[i] = splat(p[i * width + r]);
      for (int c = 0; c < C; ++c) {
        const v16 vc = load(blk + r * bs + 16 * c);
        for (int i = 0; i < Q; ++i) a[i][c] = fma(w[i], vc, a[i][c]);
      }
    }
    for (int i = 0; i < Q; ++i)
      for (int c = 0; c < C; ++c) store(acc + i * D + 16 * c, a[i][c]);
  }

  // 16 rows of D at src (row stride ``stride``) as the shared products read them: float32 and
  // float16 ones where they lie (a copy would only double the traffic of keys that come from L2
  // or beyond; float16 widens as it loads), bf16 ones widened into blk (16, D); the row stride
  // of the result goes to ``bs``
  static const BT* block(const KT* src, int64_t stride, float* blk, int64_t& bs) {
    if constexpr (!std::is_same_v<KT, at::BFloat16>) {
      bs = stride;
      return src;
    } else {
      widen(src, stride, blk);
      bs = D;
      return blk;
    }
  }

  // 16 rows of D (row stride ``stride``) widened to fp32 into blk (16, D)
  static void widen(const KT* src, int64_t stride, float* blk) {
    for (int r = 0; r < LANES; ++r)
      for (int c = 0; c < C; ++c) store(blk + r * D + 16 * c, load(src + r * stride + 16 * c));
  }
};

template <typename T, typename KT, int C>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Lists& lists, at::Tensor& out,
         float scale) {
  const int64_t b = q.size(0), H = q.size(1), n = q.size(2), KV = k.size(1);
  const int64_t D = 16 * C, g = H / KV;
  const int64_t per = g * n;  // query vectors per kv head
  // at least two work items per thread where the vectors allow it
  const int64_t pieces =
      std::min<int64_t>(per, std::max<int64_t>(1, (2 * at::get_num_threads() + b * KV - 1) / (b * KV)));
  const T* qp = q.data_ptr<T>();
  const KT* kp = k.data_ptr<KT>();
  const KT* vp = v.data_ptr<KT>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::parallel_for(0, b * KV * pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    std::vector<const T*> qs;
    std::vector<int64_t> rows;
    std::vector<T*> outs;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t piece = item % pieces, kvh = (item / pieces) % KV, bi = item / (pieces * KV);
      const Item<T, KT, C> work{kp + bi * ks0 + kvh * ks1, vp + bi * vs0 + kvh * vs1, ks2, vs2, scale, &lists};
      qs.clear(), rows.clear(), outs.clear();
      for (int64_t x = piece * per / pieces; x < (piece + 1) * per / pieces; ++x) {  // x = head-in-group * n + row
        const int64_t h = kvh * g + x / n, r = x % n;
        qs.push_back(qp + bi * qs0 + h * qs1 + r * qs2);
        rows.push_back(bi * n + r);
        outs.push_back(op + bi * out.stride(0) + h * out.stride(1) + r * out.stride(2));
      }
      work(qs, rows, outs, buf);
    }
  });
}

template <typename T, typename KT = T>
void dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Lists& lists, at::Tensor& out,
              float scale) {
  switch (q.size(3) / LANES) {
    case 1: return run<T, KT, 1>(q, k, v, lists, out, scale);
    case 2: return run<T, KT, 2>(q, k, v, lists, out, scale);
    case 4: return run<T, KT, 4>(q, k, v, lists, out, scale);
    case 6: return run<T, KT, 6>(q, k, v, lists, out, scale);
    case 8: return run<T, KT, 8>(q, k, v, lists, out, scale);
    case 12: return run<T, KT, 12>(q, k, v, lists, out, scale);
    case 16: return run<T, KT, 16>(q, k, v, lists, out, scale);
    default: TORCH_CHECK(false, "listed_attention: head_dim 16, 32, 64, 96, 128, 192 or 256");
  }
}

}  // namespace

at::Tensor listed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prefix,
                            const at::Tensor& extra, const at::Tensor& count, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "listed_attention: q, k, v of 4 dims");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "listed_attention: CPU only");
  const bool half_kv = q.scalar_type() == at::kFloat && k.scalar_type() == at::kHalf;  // a float16 cache
  TORCH_CHECK((q.scalar_type() == k.scalar_type() || half_kv) && k.scalar_type() == v.scalar_type(),
              "listed_attention: q, k, v of one dtype, or float32 q over float16 k, v");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "listed_attention: last dim contiguous");
  const int64_t b = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3);
  TORCH_CHECK(D % LANES == 0, "listed_attention: head_dim a multiple of 16");
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && k.size(3) == D && v.size(3) == D && H % k.size(1) == 0 &&
                  v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "listed_attention: shapes");
  TORCH_CHECK(prefix.scalar_type() == at::kInt && extra.scalar_type() == at::kInt && count.scalar_type() == at::kInt,
              "listed_attention: int32 key lists");
  TORCH_CHECK(prefix.numel() == b * n && count.numel() == b * n && extra.dim() == 3 && extra.size(0) == b &&
                  extra.size(1) == n,
              "listed_attention: key lists (b, n) and (b, n, E)");
  const at::Tensor pc = prefix.contiguous(), ec = extra.contiguous(), cc = count.contiguous();
  const Lists lists{pc.data_ptr<int32_t>(), ec.data_ptr<int32_t>(), cc.data_ptr<int32_t>(), ec.size(2)};
  const int64_t L = k.size(2);
  for (int64_t row = 0; row < b * n; ++row) {  // every listed key inside the buffers: no stray reads
    TORCH_CHECK(lists.prefix[row] >= 0 && lists.count[row] >= 0 && lists.count[row] <= lists.E &&
                    lists.size(row) > 0 && lists.prefix[row] <= L,
                "listed_attention: bad key list");
    for (int64_t j = 0; j < lists.count[row]; ++j) {
      const int32_t key = lists.extra[row * lists.E + j];
      TORCH_CHECK(key >= 0 && key < L, "listed_attention: key slot out of range");
    }
  }
  // (b, H, n, D) over (b, n, H, D) memory: the caller's transpose(1, 2).reshape(b, n, H * D) is a view
  at::Tensor out = at::empty({b, n, H, D}, q.options()).transpose(1, 2);
  if (q.scalar_type() == at::kBFloat16 && D % 32 == 0 && H / k.size(1) <= 16 && amx_listed_on()) {
    amx_listed_attention(q, k, v, lists, out, static_cast<float>(scale));
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch<at::BFloat16>(q, k, v, lists, out, static_cast<float>(scale));
  } else if (half_kv) {
    dispatch<float, at::Half>(q, k, v, lists, out, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "listed_attention: float32 or bfloat16");
    dispatch<float>(q, k, v, lists, out, static_cast<float>(scale));
  }
  return out;
}

}  // namespace cadence
