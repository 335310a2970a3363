// One Llama decoder block for drafting: ``heads.attn_block.Block.draft_forward`` without the
// Python interpreter between its ATen calls. A drafted tree level of EAGLE's layer makes
// about 60 calls, each a few microseconds of Python dispatch on top of its work: at 1-10
// rows the dispatch cost as much as the projections (SmolLM2-sized layer, bf16, 2 cores).
//
// bf16 blocks: the same ATen calls in the same order as the Python method (the heads' own
// RMSNorm and RoPE in float32, the projections through ``kernels.Linear``, one SDPA call over
// the cache buffer's rows), so the two give the same bits. fp32 blocks (the fp32 and GGUF paths,
// where drafting reads its weights from memory and every call counts): the fused kernels of
// ``fused.cpp`` instead (RMSNorm, q and k rotated in one call, the residual add with the second
// norm, SiLU-times-up), about half the calls; the same formulas with other reduction orders and
// SiLU's polynomial, so within float rounding of the Python method, not its bits
// (tests/test_attention_heads.py). Drafts only: verification decides what is emitted.
// Knows: the block's arithmetic and where the new entries go. Does not know: trees,
// positions or what the entries mean (the caller passes the rope tables and the mask).

#include "draft_block.h"
#include "fused.h"

#include <cmath>

namespace cadence {

namespace {

// ``attn_block.rope``: x (P, heads, D), cos/sin (P, 1, D) float32, rotate-half in float32
at::Tensor rope_f32(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t D = x.size(-1);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor rot = at::cat({xf.narrow(-1, D / 2, D - D / 2).neg(), xf.narrow(-1, 0, D / 2)}, -1);
  return (xf * cos + rot * sin).to(x.scalar_type());
}

}  // namespace

DraftBlock::DraftBlock(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, std::optional<at::Tensor> ln1,
                       at::Tensor ln2)
    : heads_(heads), kv_(kv_heads), hd_(head_dim), eps_(eps), ln1_(std::move(ln1)), ln2_(std::move(ln2)) {}

void DraftBlock::set_linears(std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> scales,
                             std::vector<std::optional<at::Tensor>> biases, std::vector<int64_t> ints) {
  Lin* lins[4] = {&qkv_, &o_, &gate_up_, &down_};
  cadence::set_linears(lins, 4, weights, scales, biases, ints);
}

// ``mtp.RMSNorm``: normalise in float32, cast back, then scale by the weight
at::Tensor DraftBlock::norm(const at::Tensor& x, const at::Tensor& weight) const {
  at::Tensor var = x.to(at::kFloat).pow(2).mean(-1, true);
  return (x.to(at::kFloat) * at::rsqrt(var + eps_)).to(x.scalar_type()) * weight;
}

at::Tensor DraftBlock::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kbuf,
                               at::Tensor vbuf, int64_t at, const std::optional<at::Tensor>& mask) const {
  c10::InferenceMode guard;
  const int64_t P = x.size(0);
  TORCH_CHECK(x.dim() == 2 && at >= 0 && at + P <= kbuf.size(0) && kbuf.sizes() == vbuf.sizes(),
              "DraftBlock.forward: x (P, d) and room for P entries at row ", at);
  if (fused_here(x, kbuf)) return forward_fused(x, cos, sin, kbuf, vbuf, at, mask);
  const int64_t H = heads_, G = kv_, D = hd_;
  const at::Tensor y = ln1_ ? norm(x, *ln1_) : x;
  auto parts = qkv_(y.contiguous(), false).split({H * D, G * D, G * D}, -1);
  const at::Tensor q = rope_f32(parts[0].reshape({P, H, D}), cos, sin);
  kbuf.narrow(0, at, P).copy_(rope_f32(parts[1].reshape({P, G, D}), cos, sin));
  vbuf.narrow(0, at, P).copy_(parts[2].reshape({P, G, D}));
  const at::Tensor r = x + o_(attend(q, kbuf, vbuf, at + P, mask), false);
  auto gu = gate_up_(norm(r, ln2_).contiguous(), false).chunk(2, -1);
  return r + down_(at::silu(gu[0]) * gu[1], false);
}

// float32 rows, float32 norms and cache: the fused kernels apply
bool DraftBlock::fused_here(const at::Tensor& x, const at::Tensor& kbuf) const {
  const auto f = at::kFloat;
  return x.device().is_cpu() && x.scalar_type() == f && kbuf.scalar_type() == f && ln2_.scalar_type() == f &&
         (!ln1_ || ln1_->scalar_type() == f);
}

at::Tensor DraftBlock::forward_fused(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                     at::Tensor kbuf, at::Tensor vbuf, int64_t at,
                                     const std::optional<at::Tensor>& mask) const {
  const int64_t P = x.size(0), H = heads_, G = kv_, D = hd_;
  const at::Tensor xc = x.contiguous();
  const at::Tensor y = ln1_ ? cadence::rms_norm(xc, *ln1_, eps_) : xc;
  const at::Tensor qkv = qkv_(y, false);  // (P, (H + 2G) D)
  // q and k rotated in one call: (1, P, H + G, D) over the first (H + G) D columns of each row;
  // the fused kernel takes rotate-half's sign in the sine (x * cos + swap_halves(x) * sin')
  at::Tensor signed_sin = sin.clone();
  signed_sin.narrow(-1, 0, D / 2).neg_();
  const at::Tensor qk = cadence::rope(qkv.narrow(-1, 0, (H + G) * D).view({1, P, H + G, D}), cos.unsqueeze(0),
                                      signed_sin.unsqueeze(0))[0];
  kbuf.narrow(0, at, P).copy_(qk.narrow(1, H, G));
  vbuf.narrow(0, at, P).copy_(qkv.narrow(-1, (H + G) * D, G * D).view({P, G, D}));
  auto rn = cadence::add_rms_norm(xc, o_(attend(qk.narrow(1, 0, H), kbuf, vbuf, at + P, mask), false), ln2_, eps_);
  return rn[0] + down_(cadence::silu_mul(gate_up_(rn[1], false)), false);
}

// q (P, H, D) over rows [0, n) of the cache buffers where mask (P, n) allows -> (P, H * D) contiguous
at::Tensor DraftBlock::attend(const at::Tensor& q, const at::Tensor& kbuf, const at::Tensor& vbuf, int64_t n,
                              const std::optional<at::Tensor>& mask) const {
  const at::Tensor K = kbuf.narrow(0, 0, n).transpose(0, 1).unsqueeze(0);  // (1, G, N, D)
  const at::Tensor V = vbuf.narrow(0, 0, n).transpose(0, 1).unsqueeze(0);
  std::optional<at::Tensor> m;
  if (mask) m = mask->unsqueeze(0).unsqueeze(0);
  const at::Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), K, V, m, 0.0, false,
                                                        std::nullopt, heads_ != kv_)
                           .squeeze(0);  // (H, P, D)
  return o.transpose(0, 1).flatten(-2).contiguous();
}

}  // namespace cadence
