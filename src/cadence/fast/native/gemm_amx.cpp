// y = x W^T (+ b) for bf16 activations of a few rows on AMX tiles, the weights streamed once.
//
// Why not oneDNN: on the AMX Xeon (2 threads, SmolLM2's projections, weights cycled through
// 30 copies as a forward meets them; ``benchmarks/kernels/gemm_cost.py``, 2026-12-03, 365b11d) oneDNN's
// prepacked bf16 product cost 42/30/127/58 us for 1 row of qkv/o/gate_up/down and 1.45 ms
// for the LM head; this kernel 25/16/91/40 us and 1.19 ms. At 32 rows both pay about the
// same extra (the tile arithmetic is not hidden behind the weight stream in either: 42 us
// for gate_up here, 38 for oneDNN). And its rows do not depend on the row count (below), so
// a one-token forward and a tree of any size give a token the same bits without padding or
// row blocks (``fast.consistent``).
//
// Layout (``kernels.amx_pack``): W (N, K) in blocks of 32 output columns by 32 inputs, each
// block two 1 KiB B tiles (columns 0-15, 16-31 of the block), a tile row r holding input
// pair (2r, 2r + 1) for its 16 columns: packed[nb][kb][j][r][2c + p] = W[32 nb + 16 j + c]
// [32 kb + 2 r + p] (zero past N or K). Blocks in nb-major order, so a thread's share of the
// columns is one contiguous stream.
//
// Per 32 columns (nb) and 32 rows (a row block): C (4 fp32 tiles, 16 rows x 16 columns
// each) = 0; for kb in 0..K/32: load A0 (rows 0-15, inputs 32 kb..32 kb+31) and A1 (rows
// 16-31, when there are any), B0 and B1, four tile products; store C, add the bias in fp32,
// round to bf16 (nearest even). Row i of C depends on row i of x and on the columns alone,
// by the same operations in the same kb order whatever the other rows are (a tile product
// computes each output row from its own A row), so the bits of a row are those of a
// one-row call. Tiles: 0-1 A, 2-3 B, 4-7 C. The rounding of a block's C (its epilogue) runs
// while the next block's weights stream in (``EPILOGUE_AT``).
//
// With ``swiglu`` the weights are [gate; up] with their rows interleaved by 16
// (``kernels.swiglu_rows``), so a column block holds gate and up of the same 16 outputs, and
// the epilogue writes silu(gate) * up with ``silu_mul``'s roundings: the same bits as the
// plain product followed by ``silu_mul``, without the gate/up rows going to memory and back.
//
// Threads split the column blocks (each a contiguous range); a call with more than 32 rows
// runs its row blocks inside each column block, rereading that block's weights from cache.
//
// Knows: tile configuration, the packed layout, bf16 rounding. Does not know which weights
// these are; ``kernels.Linear`` packs them and chooses this kernel (kind ``amx``).

#include "gemm_amx.h"

#include "amx.h"
#include "fused_math.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace cadence {

#ifdef CADENCE_AMX
namespace {

typedef uint16_t bf16;  // raw bits

// palette 1, 64-byte tile rows; A tiles 0-1 and C tiles 4-7 have r0 / r1 rows (rows 0-15 and
// 16-31 of the row block; r1 = 0 configures 1 row, unused), B tiles 2-3 16
void configure(int r0, int r1) {
  const uint8_t lo = static_cast<uint8_t>(r0), hi = static_cast<uint8_t>(std::max(r1, 1));
  load_tile_rows({lo, hi, 16, 16, lo, lo, hi, hi});
}

struct Problem {
  const bf16* x;     // (m, kp) rows, kp = 32 * KB
  const bf16* w;     // packed (NB, KB, 2, 16, 32)
  const float* bias; // (N) fp32 or null
  bf16* y;           // (m, n), or (m, n / 2) with swiglu
  int64_t m, n, kp, KB;
  bool swiglu;       // columns 32 j..32 j+15 are gate j*16.., 32 j+16.. up: y = silu(gate) * up
};

// bf16 lanes widened back to fp32, rounded as the plain store rounds them
inline vec::v16 as_stored(__m512 v) {
  return reinterpret_cast<vec::v16>(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))), 16));
}

// the SwiGLU epilogue: gate and up as the plain product would store them (bf16), then
// ``silu_mul``'s arithmetic (fused.cpp): bf16(bf16(silu(gate)) * up), 16 outputs a row
void store_swiglu(const Problem& p, const float* c, int64_t nb, int64_t m0, int64_t rows, __m512 bg, __m512 bu) {
  using namespace fm;
  const int64_t width = p.n / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const vec::v16 g = as_stored(_mm512_add_ps(_mm512_load_ps(c + r * 32), bg));
    const vec::v16 u = as_stored(_mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), bu));
    put(reinterpret_cast<at::BFloat16*>(p.y + (m0 + r) * width + nb * 16), round_to<at::BFloat16>(silu16(g)) * u);
  }
}

// C tiles of one (column block, row block) -> bf16 rows of y, bias added in fp32
void store_block(const Problem& p, const float* c, int64_t nb, int64_t m0, int64_t rows) {
  const int64_t n0 = nb * 32, cols = std::min<int64_t>(32, p.n - n0);
  const __mmask32 keep = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (p.bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep), p.bias + n0);
    b1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>(keep >> 16), p.bias + n0 + 16);
  }
  if (p.swiglu) return store_swiglu(p, c, nb, m0, rows, b0, b1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * 32), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1);
    _mm512_mask_storeu_epi16(p.y + (m0 + r) * p.n + n0, keep, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// The weights PREFETCH_STEPS steps (2 KiB each) ahead into L2: the tile loads wait for their
// data in order, and the hardware prefetcher alone left the 32-row products unoverlapped with
// the stream (``benchmarks/kernels/verify_cost.py``, 2026-12-03, 40de4f5). A prefetch past the end is harmless.
constexpr int64_t PREFETCH_STEPS = 4;
inline void prefetch_ahead(const bf16* w) {
  const char* at = reinterpret_cast<const char*>(w + PREFETCH_STEPS * 1024);
  for (int line = 0; line < 2048; line += 64) _mm_prefetch(at + line, _MM_HINT_T1);
}

// Past 16 rows the weight tiles load with the non-temporal hint (TILELOADDT1): a row block's
// activations (32 rows x K, 36 KiB for the gate/up product) are reread for every column
// block and stay in L1 only if the streamed weights do not push them out. Measured with both
// forms in one process (2026-12-04, 74609e8, AMX Xeon, alternating): a 32-node forward 13.66/13.51 ms
// against 14.27/14.08, a one-token forward unchanged (10.36/10.24 vs 10.33/10.20). One-row
// calls keep plain loads (the hint changed nothing there).

// A block's epilogue (its C tiles rounded into y) runs during the next block's loop, after
// that block's EPILOGUE_AT-th step (or its last), from a second C buffer, and the last
// block's after the loop. In its natural place, between the tile stores and the next block's
// first loads, it cost a one-token forward 0.17-0.33 ms, a 16-node one 0.47-0.61 and a
// 32-node one 0.32-0.41 (in-process A/B, alternating, four runs, 2026-12-04, 1e88e28, AMX Xeon; across
// processes the gain drowned in their spread); run early in the next block (step 1) it saved
// less at 32 rows. The bits do not change: the same epilogue on the same tiles.
constexpr int64_t EPILOGUE_AT = 16;

// column blocks [b0, b1) for every row
void run_blocks(const Problem& p, int64_t b0, int64_t b1) {
  alignas(64) float c[2][32 * 32];  // C tiles of this block and of the one whose epilogue waits
  int cur0 = -1, cur1 = -1, slot = 0;
  int64_t wait_nb = -1, wait_m0 = 0, wait_rows = 0;  // the block whose epilogue waits (-1: none)
  auto epilogue = [&]() {
    if (wait_nb >= 0) store_block(p, c[slot ^ 1], wait_nb, wait_m0, wait_rows), wait_nb = -1;
  };
  const int64_t stride = p.kp * 2;  // bytes per row of x
  const int64_t at = std::min<int64_t>(EPILOGUE_AT, p.KB - 1);
  for (int64_t nb = b0; nb < b1; ++nb) {
    for (int64_t m0 = 0; m0 < p.m; m0 += 32) {
      float* cs = c[slot];
      const int r0 = static_cast<int>(std::min<int64_t>(16, p.m - m0));
      const int r1 = static_cast<int>(std::clamp<int64_t>(p.m - m0 - 16, 0, 16));
      if (r0 != cur0 || r1 != cur1) configure(r0, r1), cur0 = r0, cur1 = r1;
      const bf16* a = p.x + m0 * p.kp;
      const bf16* w = p.w + nb * p.KB * 1024;
      _tile_zero(4);
      _tile_zero(5);
      if (r1 > 0) {  // two row tiles; the loop below is the same with one (kept apart: the hot loop)
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t kb = 0; kb < p.KB; ++kb, w += 1024) {
          prefetch_ahead(w);
          _tile_loadd(0, a + kb * 32, stride);
          _tile_stream_loadd(2, w, 64);  // weights: used once, kept out of L1 (above)
          _tile_stream_loadd(3, w + 512, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          _tile_loadd(1, a + 16 * p.kp + kb * 32, stride);
          _tile_dpbf16ps(6, 1, 2);
          _tile_dpbf16ps(7, 1, 3);
          if (kb == at) epilogue();
        }
        _tile_stored(6, cs + 16 * 32, 128);
        _tile_stored(7, cs + 16 * 32 + 16, 128);
      } else {
        for (int64_t kb = 0; kb < p.KB; ++kb, w += 1024) {
          prefetch_ahead(w);
          _tile_loadd(0, a + kb * 32, stride);
          _tile_loadd(2, w, 64);
          _tile_loadd(3, w + 512, 64);
          _tile_dpbf16ps(4, 0, 2);
          _tile_dpbf16ps(5, 0, 3);
          if (kb == at) epilogue();
        }
      }
      _tile_stored(4, cs, 128);
      _tile_stored(5, cs + 16, 128);
      wait_nb = nb, wait_m0 = m0, wait_rows = r0 + r1;
      slot ^= 1;
    }
  }
  epilogue();
  _tile_release();
}

int state = -1;  // -1 undecided, 0 off, 1 on

}  // namespace

bool amx_gemm_available() {
  if (state < 0) state = amx_env_allows() && amx_permitted() ? 1 : 0;
  return state == 1;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t out, bool swiglu) {
  TORCH_CHECK(amx_gemm_available(), "amx_linear: AMX unavailable in this process");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "amx_linear: bf16 CPU input expected");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear: weights not in kernels.amx_pack's layout");
  const int64_t K = x.size(-1), NB = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(K > 32 * (KB - 1) && K <= 32 * KB, "amx_linear: input size ", K, " does not match the weights' ", 32 * KB);
  TORCH_CHECK(out > 32 * (NB - 1) && out <= 32 * NB, "amx_linear: output size ", out, " does not match the weights");
  TORCH_CHECK(!swiglu || out % 32 == 0, "amx_linear: a SwiGLU product needs 2 x a multiple of 16 outputs, not ", out);
  auto lead = x.sizes().vec();
  lead.back() = swiglu ? out / 2 : out;
  at::Tensor x2 = x.reshape({-1, K});
  if (K != 32 * KB) x2 = at::constant_pad_nd(x2, {0, 32 * KB - K});  // zero inputs meet zero weights
  x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  at::Tensor y = at::empty({m, swiglu ? out / 2 : out}, x.options());
  if (m == 0) return y.view(lead);
  at::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->numel() == out, "amx_linear: bias of ", bias->numel(), " for ", out, " outputs");
    b32 = bias->to(at::kFloat).contiguous();
  }
  const Problem p{reinterpret_cast<const bf16*>(x2.data_ptr()), reinterpret_cast<const bf16*>(packed.data_ptr()),
                  bias ? b32.data_ptr<float>() : nullptr, reinterpret_cast<bf16*>(y.data_ptr()), m, out, 32 * KB, KB, swiglu};
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, NB, (NB + threads - 1) / threads, [&](int64_t b0, int64_t b1) { run_blocks(p, b0, b1); });
  return y.view(lead);
}

#else

bool amx_gemm_available() { return false; }
at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, bool) {
  TORCH_CHECK(false, "amx_linear: built without AMX");
}

#endif

}  // namespace cadence
