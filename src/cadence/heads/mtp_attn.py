"""MTP modules with attention (DeepSeek-V3 / MiMo): docs/methods.md section 2, ``mtp``.

    g_0 = h;  g_k[j] = Block_k( P_k [ RMSNorm(g_{k-1}[j]) ; RMSNorm(E(x_{j+k})) ] )
    logits_k[j] = W_lm( RMSNorm_k(g_k[j]) )     (a prediction of x_{j+1+k})

Block_k is one pre-norm Llama block (causal self-attention over the sequence of module-k
states, its own KV cache, SwiGLU). A separate kind from the MLP ``mtp`` (kept as the
baseline): it needs a per-request drafter state and sequence training, and the shipped
``mtp`` checkpoints keep loading unchanged.

Which module-k entries a query sees **(choice)**: entry j of module k reads x_{j+k}, so
while drafting at position t (committed x_0..x_t, root x_{t+1}) module k holds committed
entries only up to j = t+1-k; the node's own entry sits at t. Training uses exactly that
mask: module k at t sees j <= t+1-k and j = t (for k <= 2 that is plain causal attention;
module 3 does not see j = t-1, whose token is a draft at decoding time). Siblings in a
tree never see each other (each node adds one entry at t to its own module).

Does not know: trees, the engine (``drafter`` owns the per-request state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.heads.attn_block import KV, Block, segment_causal, shape_from_config
from cadence.heads.base import DraftHeads, HeadConfig
from cadence.heads.mtp import RMSNorm


class AttnMTPModule(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_eps
        self.norm_g, self.norm_e = RMSNorm(d, eps), RMSNorm(d, eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():  # start by passing g_{k-1} through (the block starts as the identity)
            self.proj.weight.zero_()
            self.proj.weight[:, :d] = torch.eye(d)
        self.block = Block(shape_from_config(cfg), input_norm=True)
        self.norm_out = RMSNorm(d, eps)

    def merge(self, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([self.norm_g(g), self.norm_e(e)], dim=-1))


def delayed_mask(n: int, k: int, device) -> torch.Tensor:
    """(n, n) bool: module k's query t sees entry j iff j <= t+1-k or j == t.
    Example, k = 3, n = 4: query 3 sees entries 0, 1 and 3."""
    t = torch.arange(n, device=device)
    return (t[None, :] <= t[:, None] + 1 - k) | (t[None, :] == t[:, None])


@dataclass
class _Tree:
    t: int  # position of the root's parent state h_t
    root: torch.Tensor  # (d,) g_1 of the root entry
    cache: "MTPAttnCache"


class MTPAttnCache:
    """Per-request drafter cache: per module its KV over committed entries and their outputs g."""

    def __init__(self, heads: "MTPAttnHeads", start: int):
        p = next(heads.parameters())
        self.kv = [KV(m.block.shape, start, p.device, p.dtype) for m in heads.modules_]
        self.g = [torch.zeros(0, heads.cfg.hidden_size, device=p.device, dtype=p.dtype) for _ in heads.modules_]

    @property
    def end(self) -> int:
        return self.kv[0].end


class MTPAttnHeads(DraftHeads):
    attends = True  # drafts need the per-request state (drafter.new_state / commit)

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        if not cfg.num_attention_heads:
            raise CadenceError("mtp-attn heads need the attention shape (num_attention_heads, ...) in their config")
        self.modules_ = nn.ModuleList(AttnMTPModule(cfg) for _ in range(cfg.num_heads))

    # ------------------------------------------------------------------ training
    def train_features(self, hidden, ids, seg=None):
        """Module k over positions t = 0..T-1-k; returns norm_out(g_k) for t = 0..T-2-k."""
        B, T = ids.shape
        g = hidden.to(self._param_dtype())
        emb = self.embed(ids)
        seg = torch.zeros_like(ids) if seg is None else seg
        pos = torch.arange(T, device=ids.device).expand(B, T)
        feats = []
        for k in range(1, self.K + 1):
            n = T - k
            mod = self.modules_[k - 1]
            mask = segment_causal(seg[:, :n]) & delayed_mask(n, k, ids.device)
            g, _, _ = mod.block.forward_masked(mod.merge(g[:, :n], emb[:, k:k + n]), pos[:, :n], mask)
            feats.append(mod.norm_out(g[:, :T - 1 - k]))
        return feats

    # ------------------------------------------------------------------ drafting
    def new_cache(self, start: int = 0) -> MTPAttnCache:
        return MTPAttnCache(self, start)

    def begin_draft(self, cache: MTPAttnCache, pending: torch.Tensor, seq: list[int]) -> _Tree:
        """Extend every module's cache with the committed entries it lacks.

        seq = x_0..x_{t+1} (root last), pending (m, d) = h_j for j = cache.end..t. Module k
        then holds entries up to t+1-k. Example (K = 3): after a draft at t = 7 the caches end
        at 8 / 7 / 6 (last entries 7 / 6 / 5); at t = 9 pending is h_8, h_9 and module 1 adds
        entries 8, 9, module 2 adds 7, 8, module 3 adds 6, 7; entry j of module k reads
        g_{k-1}[j] and x_{j+k}."""
        t = len(seq) - 2
        m = pending.shape[0]
        if cache.end + m != t + 1:
            raise CadenceError(f"mtp-attn drafter state out of step: cache ends at {cache.end}, {m} new "
                               f"states, but the root's parent is at {t}")
        dev = pending.device
        prev_g, prev_start = pending.to(self._param_dtype()), cache.end  # g_0 rows for the new positions
        for k, mod in enumerate(self.modules_, start=1):
            kv = cache.kv[k - 1]
            lo, hi = kv.end, t + 1 - k
            if hi >= lo:
                g_in = prev_g[lo - prev_start:hi + 1 - prev_start]
                toks = torch.tensor(seq[lo + k:hi + k + 1], device=dev)
                pos = torch.arange(lo, hi + 1, device=dev)
                cached = torch.arange(kv.start, lo, device=dev)
                mask = torch.cat([cached[None, :] <= pos[:, None] + 1 - k, delayed_mask(hi + 1 - lo, k, dev)], dim=1)
                out = mod.block.draft_forward(mod.merge(g_in, self.embed(toks)), pos, kv, kv.n, mask, top=hi)
                kv.advance(hi + 1 - lo)
                cache.g[k - 1] = torch.cat([cache.g[k - 1], out])
            prev_g, prev_start = cache.g[k - 1], kv.start
        if cache.kv[0].end != t + 1:
            raise CadenceError("mtp-attn drafter state is empty: commit the prompt's states first")
        return _Tree(t, cache.g[0][-1], cache)

    def tree_step(self, k: int, prev: torch.Tensor, tokens: torch.Tensor, ctx, nodes: list[int],
                  parents: list[int]):
        """Depth k-1 nodes (tokens (P,), parents' g_{k-1} prev (P, d)) -> their g_k (P, d)."""
        tree, cache = ctx, ctx.cache
        if k == 1:
            return tree.root[None].expand(len(nodes), -1)
        mod, kv = self.modules_[k - 1], cache.kv[k - 1]
        dev = tokens.device
        P = len(nodes)
        pos = torch.full((P,), tree.t, device=dev)
        # the committed entries, then its own (siblings never see each other): written to scratch rows
        mask = torch.cat([torch.ones(P, kv.n, dtype=torch.bool, device=dev),
                          torch.eye(P, dtype=torch.bool, device=dev)], dim=1)
        return mod.block.draft_forward(mod.merge(prev, self.embed(tokens)), pos, kv, kv.n, mask, top=tree.t)

    def tree_logits_features(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """Features for the LM head from a node's state g_k."""
        return self.modules_[k - 1].norm_out(state)

    def step_features(self, k, state, token):
        raise CadenceError("mtp-attn heads draft through HeadDrafter (they need the request's context); "
                           "this scheduler steps heads on their own and supports MLP heads only")
