"""MTP modules (DeepSeek-V3 / MiMo style, chained).

g_0 = h_t;  g_k = Block_k( P_k [ RMSNorm(g_{k-1}) ; RMSNorm(E(x_{t+k})) ] );
logits_k = W_lm( RMSNorm_k(g_k) ).

Block_k is a pre-norm residual SwiGLU block applied per position **(choice)**: the
backbone state already carries the context, and an attention layer over the draft
path would need its own KV cache in the engine. E and W_lm are shared and frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from cadence.heads.base import DraftHeads, HeadConfig, drafting_linear


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class MTPModule(nn.Module):
    """One chained module: merge (g_{k-1}, E(x)) into g_k."""

    def __init__(self, d: int, ratio: float, eps: float):
        super().__init__()
        hidden = int(d * ratio)
        self.norm_g, self.norm_e = RMSNorm(d, eps), RMSNorm(d, eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.norm_mlp = RMSNorm(d, eps)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        nn.init.zeros_(self.down.weight)
        self.norm_out = RMSNorm(d, eps)
        with torch.no_grad():  # start by passing g_{k-1} through
            self.proj.weight.zero_()
            self.proj.weight[:, :d] = torch.eye(d)

    def forward(self, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = drafting_linear(self.proj, torch.cat([self.norm_g(g), self.norm_e(e)], dim=-1))
        y = self.norm_mlp(x)
        act = nn.functional.silu(drafting_linear(self.gate, y)) * drafting_linear(self.up, y)
        return x + drafting_linear(self.down, act)


class MTPHeads(DraftHeads):
    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        self.modules_ = nn.ModuleList(MTPModule(cfg.hidden_size, cfg.mlp_ratio, cfg.rms_eps)
                                      for _ in range(cfg.num_heads))

    def step_features(self, k, state, token):
        # state: g_{k-1} (B, d); token: x_{t+k}.
        mod = self.modules_[k - 1]
        g = mod(state, self.embed(token))
        return mod.norm_out(g), g

    def train_features(self, hidden, ids):
        T = hidden.shape[1]
        g = hidden.to(self._param_dtype())
        emb = self.embed(ids)
        feats = []
        for k in range(1, self.K + 1):
            n = T - 1 - k
            mod = self.modules_[k - 1]
            g = mod(g[:, :n], emb[:, k:k + n])  # g_k at t uses g_{k-1} at t and x_{t+k}
            feats.append(mod.norm_out(g))
        return feats
