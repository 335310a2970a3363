// One Llama decoder block for drafting: ``heads.attn_block.Block.draft_forward`` without the
// Python interpreter between its ATen calls. A drafted tree level of EAGLE's layer makes
// about 60 calls, each a few microseconds of Python dispatch on top of its work: at 1-10
// rows the dispatch cost as much as the projections (SmolLM2-sized layer, bf16, 2 cores).
//
// The same ATen calls in the same order as the Python method (the heads' own RMSNorm and
// RoPE in float32, the projections through ``kernels.Linear``, one SDPA call over the
// cache buffer's rows), so the two give the same bits (tests/test_attention_heads.py).
// Knows: the block's arithmetic and where the new entries go. Does not know: trees,
// positions or what the entries mean (the caller passes the rope tables and the mask).

#include "draft_block.h"

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
  const int64_t P = x.size(0), H = heads_, G = kv_, D = hd_;
  TORCH_CHECK(x.dim() == 2 && at >= 0 && at + P <= kbuf.size(0) && kbuf.sizes() == vbuf.sizes(),
              "DraftBlock.forward: x (P, d) and room for P entries at row ", at);
  const at::Tensor y = ln1_ ? norm(x, *ln1_) : x;
  auto parts = qkv_(y.contiguous(), false).split({H * D, G * D, G * D}, -1);
  const at::Tensor q = rope_f32(parts[0].reshape({P, H, D}), cos, sin);
  kbuf.narrow(0, at, P).copy_(rope_f32(parts[1].reshape({P, G, D}), cos, sin));
  vbuf.narrow(0, at, P).copy_(parts[2].reshape({P, G, D}));
  const at::Tensor K = kbuf.narrow(0, 0, at + P).transpose(0, 1).unsqueeze(0);  // (1, G, N, D)
  const at::Tensor V = vbuf.narrow(0, 0, at + P).transpose(0, 1).unsqueeze(0);
  std::optional<at::Tensor> m;
  if (mask) m = mask->unsqueeze(0).unsqueeze(0);
  const at::Tensor o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), K, V, m, 0.0, false,
                                                        std::nullopt, H != G)
                           .squeeze(0);  // (H, P, D)
  const at::Tensor r = x + o_(o.transpose(0, 1).flatten(-2).contiguous(), false);
  auto gu = gate_up_(norm(r, ln2_).contiguous(), false).chunk(2, -1);
  return r + down_(at::silu(gu[0]) * gu[1], false);
}

}  // namespace cadence
