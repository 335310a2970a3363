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
// Knows: float32 and bfloat16 rows whose last dimension is contiguous.

#include "fused.h"

#include <ATen/Parallel.h>

#include "vec16.h"

#include <cmath>

namespace cadence {

namespace {

constexpr int LANES = 16;  // partial sums of a row, added in a fixed order

template <typename T>
float sum_squares(const T* x, int64_t D) {
  float part[LANES] = {0};
  int64_t j = 0;
  for (; j + LANES <= D; j += LANES) {
    for (int l = 0; l < LANES; ++l) {
      const float v = static_cast<float>(x[j + l]);
      part[l] += v * v;
    }
  }
  for (int l = 0; j < D; ++j, ++l) {
    const float v = static_cast<float>(x[j]);
    part[l] += v * v;
  }
  float s = 0.0f;
  for (int l = 0; l < LANES; ++l) s += part[l];
  return s;
}

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    T* yr = y + r * D;
    const float rstd = 1.0f / std::sqrt(sum_squares(xr, D) / static_cast<float>(D) + eps);
    for (int64_t j = 0; j < D; ++j) {
      const T normed = static_cast<T>(static_cast<float>(xr[j]) * rstd);  // rounded first, as .to(x.dtype)
      yr[j] = static_cast<T>(static_cast<float>(w[j]) * static_cast<float>(normed));
    }
  }
}

// xs = x + d (rounded to T, as ATen's add), then y = rms_rows of xs
template <typename T>
void add_rms_rows(const T* x, const T* d, const T* w, T* xs, T* y, int64_t rows, int64_t D, float eps) {
  for (int64_t j = 0; j < rows * D; ++j) xs[j] = static_cast<T>(static_cast<float>(x[j]) + static_cast<float>(d[j]));
  rms_rows(xs, w, y, rows, D, eps);
}

// x: rows of (heads, D) at row stride sx (last two dims contiguous); cos/sin: (rows, D)
template <typename T>
void rope_rows(const T* x, int64_t sx, const T* cos, const T* sin, T* y, int64_t rows, int64_t heads,
               int64_t D) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * D;
    const T* s = sin + r * D;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xr = x + r * sx + h * D;
      T* yr = y + (r * heads + h) * D;
      for (int64_t j = 0; j < D; ++j) {
        const T swapped = xr[j < half ? j + half : j - half];
        const T a = static_cast<T>(static_cast<float>(xr[j]) * static_cast<float>(c[j]));
        const T b = static_cast<T>(static_cast<float>(swapped) * static_cast<float>(s[j]));
        yr[j] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
      }
    }
  }
}

// 16 lanes -> T (bf16: round to nearest even on the bits, finite inputs; fp32 as is)
inline void put(float* out, vec::v16 x) { vec::store(out, x); }
inline void put(at::BFloat16* out, vec::v16 x) {
  vec::u16w u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  const vec::h16 h = __builtin_convertvector(u >> 16, vec::h16);
  std::memcpy(out, &h, sizeof h);
}

// silu(a) = a * sigmoid(a), sigmoid from e = exp(-|a|): 1 / (1 + e) for a >= 0, e / (1 + e)
// below; lane-wise IEEE operations only (the same bits for any vector width)
inline vec::v16 silu16(vec::v16 a) {
  const vec::v16 neg = a < 0 ? a : -a;  // -|a|
  const vec::v16 e = vec::exp_(neg);
  const vec::v16 one = vec::splat(1.0f);
  const vec::v16 sig = (a >= 0 ? one : e) / (one + e);
  return a * sig;
}

// gu rows (gate I | up I) -> rows of I: T(T(silu(gate)) * up), the roundings of
// ``F.silu(g) * u`` in T
template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    T pad[2][vec::LANES];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * I;
      const T* u = g + I;
      T* yr = y + r * I;
      for (int64_t j = 0; j < I; j += vec::LANES) {
        const int64_t w = std::min<int64_t>(vec::LANES, I - j);
        const T *gj = g + j, *uj = u + j;
        if (w < vec::LANES) {  // the row's last, partial block: padded copies
          for (int64_t l = 0; l < vec::LANES; ++l) pad[0][l] = l < w ? gj[l] : T(0), pad[1][l] = l < w ? uj[l] : T(0);
          gj = pad[0], uj = pad[1];
        }
        T s[vec::LANES], out[vec::LANES];
        put(s, silu16(vec::load(gj)));
        put(out, vec::load(s) * vec::load(uj));
        std::memcpy(yr + j, out, w * sizeof(T));
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
    mx = v > mx ? v : mx;
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
