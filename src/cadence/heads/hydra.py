"""Hydra heads (sequential): head k reads [h_t ; E(x_{t+1}) ; ... ; E(x_{t+k})]."""

from __future__ import annotations

import torch
from torch import nn

from cadence.heads.base import DraftHeads, HeadConfig, ResBlock, drafting_linear


class HydraHeads(DraftHeads):
    """Head k: Linear(d*(k+1) -> d) then a ResBlock, then the shared LM head.

    The input projection starts as the identity on h_t plus zero on the embeddings,
    so an untrained head k predicts what the backbone would predict at h_t.
    """

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        d = cfg.hidden_size
        self.proj = nn.ModuleList(nn.Linear(d * (k + 1), d) for k in range(1, cfg.num_heads + 1))
        for lin in self.proj:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
            with torch.no_grad():
                lin.weight[:, :d] = torch.eye(d)
        self.blocks = nn.ModuleList(ResBlock(d) for _ in range(cfg.num_heads))

    def step_features(self, k, state, token):
        # state: (B, d*k) = [h ; E(x_{t+1}) ; ... ; E(x_{t+k-1})]; token is x_{t+k}.
        new_state = torch.cat([state, self.embed(token)], dim=-1)
        return self.blocks[k - 1](drafting_linear(self.proj[k - 1], new_state)), new_state

    def train_features(self, hidden, ids):
        T = hidden.shape[1]
        h = hidden.to(self._param_dtype())
        emb = self.embed(ids)
        feats = []
        for k in range(1, self.K + 1):
            n = T - 1 - k  # positions t = 0..n-1
            parts = [h[:, :n]] + [emb[:, j:j + n] for j in range(1, k + 1)]
            feats.append(self.blocks[k - 1](self.proj[k - 1](torch.cat(parts, dim=-1))))
        return feats
