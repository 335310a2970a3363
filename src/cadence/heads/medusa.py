"""Medusa heads (parallel, independent): head_k(h) = W_lm(ResBlock_k(h)). Head k sees only h_t."""

from __future__ import annotations

from torch import nn

from cadence.heads.base import DraftHeads, HeadConfig, ResBlock


class MedusaHeads(DraftHeads):
    """K ResBlocks on h_t sharing the backbone's frozen LM head (the allowed memory saving)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(ResBlock(cfg.hidden_size) for _ in range(cfg.num_heads))

    def step_features(self, k, state, token):
        # state is h_t (B, d); the path token is ignored: medusa heads are independent.
        return self.blocks[k - 1](state), state

    def train_features(self, hidden, ids):
        T = hidden.shape[1]
        h = hidden.to(self._param_dtype())
        return [self.blocks[k - 1](h[:, :T - 1 - k]) for k in range(1, self.K + 1)]
