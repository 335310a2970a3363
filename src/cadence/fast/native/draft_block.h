// One Llama decoder block for drafting (``draft_block.cpp``).
#pragma once

#include <torch/extension.h>

#include "linear.h"

#include <optional>
#include <vector>

namespace cadence {

class DraftBlock {
 public:
  // ln1: the input RMSNorm's weight (none: EAGLE's layer 0); ln2: the post-attention one
  DraftBlock(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, std::optional<at::Tensor> ln1,
             at::Tensor ln2);
  // the fused projections qkv, o, gate_up, down (``fast.kernels.Linear``; ``fast.kernels.linear_ints``)
  void set_linears(std::vector<at::Tensor> weights, std::vector<std::optional<at::Tensor>> scales,
                   std::vector<std::optional<at::Tensor>> biases, std::vector<int64_t> ints);
  // x (P, d) at rope tables cos, sin (P, 1, D) float32 -> (P, d); the new keys/values go to
  // rows [at, at + P) of kbuf, vbuf (capacity, G, D) and the block attends rows [0, at + P)
  // where mask (P, at + P) bool allows (none: all of them)
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kbuf,
                     at::Tensor vbuf, int64_t at, const std::optional<at::Tensor>& mask) const;

 private:
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const;
  bool fused_here(const at::Tensor& x, const at::Tensor& kbuf) const;
  at::Tensor forward_fused(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kbuf,
                           at::Tensor vbuf, int64_t at, const std::optional<at::Tensor>& mask) const;
  at::Tensor attend(const at::Tensor& q, const at::Tensor& kbuf, const at::Tensor& vbuf, int64_t n,
                    const std::optional<at::Tensor>& mask) const;
  int64_t heads_, kv_, hd_;
  double eps_;
  std::optional<at::Tensor> ln1_;
  at::Tensor ln2_;
  Lin qkv_, o_, gate_up_, down_;
};

}  // namespace cadence
