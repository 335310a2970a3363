// Fused RMSNorm and RoPE for the fast decoder: one pass per row instead of the 9 ATen
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

}  // namespace

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
