// Fused RMSNorm, RoPE and the SwiGLU gate for the fast decoder: one pass per row instead of the 9 ATen
// calls of ``weight * rms_norm(x.float()).to(x.dtype)`` and the 4 of ``x * cos +
// rotate_half(x) * sin``. At 1-32 rows those calls cost far more in dispatch than in work.
//
// Each output row depends only on its own input row, in a fixed order of operations, so a
// row gets the same bits whatever else is in the forward (``cadence.fast.consistent``).
// The roundings of the ATen form are kept (bf16: the normalised row is rounded before the
// weight multiplies it; each RoPE product is rounded before the sum): results stay within
// one bf16 step of it, and both fast-path loops (C++ and Python) call these kernels, so they
// agree bit for bit. fp32 differs from ATen's reduction order by about 1e-7 relative.
//
// Rows run 16 lanes at a time (bf16 <-> fp32 by AVX512-BF16 where the CPU has it, the same
// bits as the integer rounding) and, past 8 rows, split across threads: a verify forward's
// 32 rows cost these kernels 40 us a layer on the AMX Xeon, the scalar single-threaded
// code 72 (``benchmarks/kernels/fused_cost.py``).
//
// Knows: float32 and bfloat16 rows whose last dimension is contiguous.

#include "fused.h"

#include <ATen/Parallel.h>

#include "fused_math.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>

namespace cadence {

namespace {

constexpr int LANES = vec::LANES;  // partial sums of a row, added in a fixed order

// Rows of at most this many are done on the calling thread: below it a parallel region
// costs more than it saves. 32-node forwards with all rows on one thread ran about 1.4 ms
// slower than with this split (ad hoc A/B on the AMX Xeon, 2026-12-03, 4084f81; the kernels' own
// times: ``benchmarks/kernels/fused_cost.py``).
constexpr int64_t kRowGrain = 8;

using namespace fm;  // round_to, put, exp_fused, silu16 (fused_math.h)

// sum of x[j]^2 in LANES partial sums (lane l takes j = l mod LANES), then added in lane order
template <typename T>
float sum_squares(const T* x, int64_t D) {
  vec::v16 acc{};
  int64_t j = 0;
  for (; j + LANES <= D; j += LANES) {
    const vec::v16 v = vec::load(x + j);
    acc = acc + v * v;
  }
  float part[LANES];
  vec::store(part, acc);
  for (int l = 0; j < D; ++j, ++l) {
    const float v = static_cast<float>(x[j]);
    part[l] += v * v;
  }
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += part[l];
  return s;
}

// one row: y = T(w * T(x * rstd)) (the normalised row rounded first, as .to(x.dtype))
template <typename T>
void rms_row(const T* x, const T* w, T* y, int64_t D, float eps) {
  const float rstd = 1.0f / std::sqrt(sum_squares(x, D) / static_cast<float>(D) + eps);
  int64_t j = 0;
  for (; j + LANES <= D; j += LANES) put(y + j, vec::load(w + j) * round_to<T>(vec::load(x + j) * rstd));
  for (; j < D; ++j) {
    const T normed = static_cast<T>(static_cast<float>(x[j]) * rstd);
    y[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
  }
}

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(x + r * D, w, y + r * D, D, eps);
  });
}

// xs = T(x + d) (as ATen's add), then y = rms_row of xs, row by row
template <typename T>
void add_rms_rows(const T* x, const T* d, const T* w, T* xs, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *xr = x + r * D, *dr = d + r * D;
      T* sr = xs + r * D;
      int64_t j = 0;
      for (; j + LANES <= D; j += LANES) put(sr + j, vec::load(xr + j) + vec::load(dr + j));
      for (; j < D; ++j) sr[j] = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(dr[j]));
      rms_row(sr, w, y + r * D, D, eps);
    }
  });
}

// one head of one row: y = T(T(x * c) + T(rotate_half(x) * s)), each product rounded first
template <typename T>
void rope_head(const T* x, const T* c, const T* s, T* y, int64_t D) {
  const int64_t half = D / 2;
  if (half % LANES == 0) {
    for (int64_t j = 0; j < D; j += LANES) {
      const vec::v16 swapped = vec::load(x + (j < half ? j + half : j - half));
      const vec::v16 a = round_to<T>(vec::load(x + j) * vec::load(c + j));
      const vec::v16 b = round_to<T>(swapped * vec::load(s + j));
      put(y + j, a + b);
    }
    return;
  }
  for (int64_t j = 0; j < D; ++j) {
    const T swapped = x[j < half ? j + half : j - half];
    const T a = static_cast<T>(static_cast<float>(x[j]) * static_cast<float>(c[j]));
    const T b = static_cast<T>(static_cast<float>(swapped) * static_cast<float>(s[j]));
    y[j] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

// x: rows of (heads, D) at row stride sx (last two dims contiguous); cos/sin: (rows, D)
template <typename T>
void rope_rows(const T* x, int64_t sx, const T* cos, const T* sin, T* y, int64_t rows, int64_t heads,
               int64_t D) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads; ++h) rope_head(x + r * sx + h * D, cos + r * D, sin + r * D, y + (r * heads + h) * D, D);
  });
}

// gu rows (gate I | up I) -> rows of I: T(T(silu(gate)) * up), the roundings of
// ``F.silu(g) * u`` in T
template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, kRowGrain, [gu, y, I](int64_t begin, int64_t end) {
    T pad[3][LANES];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * I;
      const T* u = g + I;
      T* yr = y + r * I;
      int64_t j = 0;
      for (; j + LANES <= I; j += LANES) put(yr + j, round_to<T>(silu16(vec::load(g + j))) * vec::load(u + j));
      if (j < I) {  // the row's last, partial block: padded copies
        const int64_t w = I - j;
        for (int64_t l = 0; l < LANES; ++l) pad[0][l] = l < w ? g[j + l] : T(0), pad[1][l] = l < w ? u[j + l] : T(0);
        put(pad[2], round_to<T>(silu16(vec::load(pad[0]))) * vec::load(pad[1]));
        std::memcpy(yr + j, pad[2], w * sizeof(T));
      }
    }
  });
}

// index of the first maximum of x[0, V); NaN counts as the maximum (its first index), as in
// torch.argmax
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  vec::v16 mx = vec::splat(-INFINITY);
  vec::i16 nan{};
  int64_t j = 0;
  for (; j + vec::LANES <= V; j += vec::LANES) {
    const vec::v16 v = vec::load(x + j);
    mx = vec::select(v > mx, v, mx);
    nan |= v != v;
  }
  float top = -INFINITY;
  bool any_nan = false;
  for (int l = 0; l < vec::LANES; ++l) top = mx[l] > top ? mx[l] : top, any_nan |= nan[l] != 0;
  for (int64_t r = j; r < V; ++r) {
    const float v = static_cast<float>(x[r]);
    top = v > top ? v : top;
    any_nan |= v != v;
  }
  int64_t from = 0;  // the block holding the first hit, then a scalar scan from it
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(top);
  for (; from + vec::LANES <= V; from += vec::LANES) {
    const vec::v16 v = vec::load(x + from);
    const __m512 m = reinterpret_cast<const __m512&>(v);
    if (any_nan ? _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(m, t, _CMP_EQ_OQ)) break;
  }
#endif
  for (int64_t r = from; r < V; ++r) {
    const float v = static_cast<float>(x[r]);
    if (any_nan ? v != v : v == top) return r;
  }
  return 0;  // V == 0 is refused by the caller
}

template <typename T>
void argmax_rows_(const T* x, int64_t* out, int64_t rows, int64_t V) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * V, V);
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.size(-1) % 2 == 0, "silu_mul: CPU rows of 2 * intermediate");
  const int64_t I = gu.size(-1) / 2;
  at::Tensor x = gu.contiguous();
  auto shape = gu.sizes().vec();
  shape.back() = I;
  at::Tensor y = at::empty(shape, gu.options());
  const int64_t rows = I ? x.numel() / (2 * I) : 0;
  if (gu.scalar_type() == at::kBFloat16) {
    silu_mul_rows(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, I);
  } else {
    TORCH_CHECK(gu.scalar_type() == at::kFloat, "silu_mul: float32 or bfloat16");
    silu_mul_rows(x.data_ptr<float>(), y.data_ptr<float>(), rows, I);
  }
  return y;
}

void to_half_saturated(const float* from, at::Half* to, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  const __m256 lo = _mm256_set1_ps(-65504.0f), hi = _mm256_set1_ps(65504.0f);
  for (; i + 8 <= n; i += 8) {  // max / min return their second operand for NaN: NaN lanes are put back
    const __m256 x = _mm256_loadu_ps(from + i);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 y = _mm256_blendv_ps(c, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) {
    const float x = from[i];
    to[i] = static_cast<at::Half>(std::isnan(x) ? x : std::min(std::max(x, -65504.0f), 65504.0f));
  }
}

at::Tensor kv_half(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "kv_half: CPU float32");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kHalf));
  to_half_saturated(xc.data_ptr<float>(), out.data_ptr<at::Half>(), xc.numel());
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0, "argmax_rows: CPU rows of at least one value");
  const at::Tensor xc = x.contiguous();
  const int64_t V = x.size(-1), rows = xc.numel() / V;
  auto shape = x.sizes().vec();
  shape.pop_back();
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kBFloat16) {
    argmax_rows_(xc.data_ptr<at::BFloat16>(), out.data_ptr<int64_t>(), rows, V);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: float32 or bfloat16");
    argmax_rows_(xc.data_ptr<float>(), out.data_ptr<int64_t>(), rows, V);
  }
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(x.device().is_cpu(), "rms_norm: CPU only");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "rms_norm: weight size");
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t rows = D ? xc.numel() / D : 0;
  if (x.scalar_type() == at::kBFloat16) {
    rms_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, D,
             static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: float32 or bfloat16");
    rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, D, static_cast<float>(eps));
  }
  return y;
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& d, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == d.scalar_type() && x.scalar_type() == weight.scalar_type() && x.sizes() == d.sizes(),
              "add_rms_norm: x, d and weight of one dtype, x and d of one shape");
  TORCH_CHECK(x.device().is_cpu() && d.device().is_cpu(), "add_rms_norm: CPU only");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D, "add_rms_norm: weight size");
  at::Tensor xc = x.contiguous(), dc = d.contiguous(), wc = weight.contiguous();
  at::Tensor xs = at::empty(x.sizes(), x.options()), y = at::empty(x.sizes(), x.options());
  const int64_t rows = D ? xc.numel() / D : 0;
  if (x.scalar_type() == at::kBFloat16) {
    add_rms_rows(xc.data_ptr<at::BFloat16>(), dc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(),
                 xs.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, D, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "add_rms_norm: float32 or bfloat16");
    add_rms_rows(xc.data_ptr<float>(), dc.data_ptr<float>(), wc.data_ptr<float>(), xs.data_ptr<float>(),
                 y.data_ptr<float>(), rows, D, static_cast<float>(eps));
  }
  return {xs, y};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x (b, n, heads, D) with the last two dims contiguous (a slice of the fused qkv rows);
  // cos, sin (b, n, 1, D) -> (b, n, heads, D) contiguous
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu(), "rope: x (b, n, heads, head_dim) on CPU");
  const int64_t b = x.size(0), n = x.size(1), heads = x.size(2), D = x.size(3);
  at::Tensor xs = x;
  if (xs.stride(3) != 1 || xs.stride(2) != D || (b > 1 && xs.stride(0) != n * xs.stride(1))) xs = xs.contiguous();
  at::Tensor c = cos.expand({b, n, 1, D}).contiguous(), s = sin.expand({b, n, 1, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type(), "rope: dtypes differ");
  at::Tensor y = at::empty({b, n, heads, D}, x.options());
  const int64_t sx = xs.stride(1);
  if (x.scalar_type() == at::kBFloat16) {
    rope_rows(xs.data_ptr<at::BFloat16>(), sx, c.data_ptr<at::BFloat16>(), s.data_ptr<at::BFloat16>(),
              y.data_ptr<at::BFloat16>(), b * n, heads, D);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rope: float32 or bfloat16");
    rope_rows(xs.data_ptr<float>(), sx, c.data_ptr<float>(), s.data_ptr<float>(), y.data_ptr<float>(), b * n, heads,
              D);
  }
  return y;
}

}  // namespace cadence
