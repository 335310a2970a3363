"""EAGLE-1 drafter: Llama decoder layers doing feature-level autoregression.

    f_j = Layers( fc[ E(x_{j+1}) ; h_j ] )        entry j, at position j
    logits for x_{j+2} = W_lm(f_j)

with causal self-attention over earlier entries (each layer its own KV cache). ``Layers`` is
one decoder layer (EAGLE-1, ``num_layers`` 1) or several in sequence (``num_layers`` N, as
vLLM's ``llama_eagle`` builds them: only layer 0 lacks the input RMSNorm). ``add_layers``
grows a trained drafter by identity layers (zero output projections), so training can
continue from a one-layer drafter without losing what it knows. Drafting feeds f back
in place of h: the entry of a tree node at depth d >= 1 is ``fc[E(its token) ; f_parent]`` at
position t + d (t the root's parent position), seeing the cached entries of the committed
context (root's entry included, it is always committed), its ancestors' entries and
itself (a tree mask over the draft's own entries). The same layer serves every depth; K
(``num_heads``) is only how deep the drafter goes.

**Taps** (``HeadConfig.taps``, EAGLE-3's feature fusion grafted onto this layout): the
level-1 entry also reads the backbone's residual stream after some decoder layers, each
RMS-normalised (no weight): ``fc[ E(x_{j+1}) ; h_j ; rms(l_j^1) ; ... ]``. Deeper levels have
no backbone states, so their tap slots are zeros (the drafter's own f stands in for h, as
in EAGLE-1). ``add_taps`` grows a trained drafter by zero columns, so it starts drafting
exactly what it drafted. Decoding: the engine taps the same layers in every backbone forward
(prefill and verify; the batched engine's ragged forward too) and commits [h ; taps] rows
(``decode.request.drafter_states``); export to vLLM (whose ``llama_eagle`` has no such input) refuses
such drafters.

Layout follows vLLM's ``llama_eagle`` (and SGLang's) so ``cadence export`` can hand the
weights over unchanged: ``fc`` takes ``[embedding ; hidden]`` in that order, layer 0 has no
input RMSNorm, and no norm follows the layer (features go straight to the shared LM head;
docs/methods.md writes ``W_lm(Norm(f))``: **(choice)** no learned norm, because vLLM's draft
model has none to load; the backbone's h is already normed, and f is trained towards it).

Training (``train_features``): teacher forcing over whole packed rows plus EAGLE-3-style
*training-time test*: depth 1 uses the true h at every position; depth k uses depth k-1's
features of the same chain, and its query sees the level-1 entries up to t plus the deeper
entries of its own chain, exactly the keys it sees in a drafted tree.

Does not know: trees or the engine (``drafter`` walks the tree and owns the per-request
state); the backbone (bound with ``bind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.fast.kernels import draft_linear
from cadence.heads.attn_block import KV, Block, segment_causal, shape_from_config
from cadence.heads.base import DraftHeads, HeadConfig, draft_format, packed


@dataclass
class _Tree:
    """One draft's scratch state: the cache, the root's features, the tree's own entries."""

    cache: list  # [KV] per layer (same rows in each)
    t: int  # position of the root's parent state h_t (root entry's position)
    root: torch.Tensor  # (d,) f of the root entry
    m: int = 0  # entries of drafted nodes (depth >= 1), in the cache's scratch rows [n, n + m)
    anc: dict = field(default_factory=dict)  # node -> scratch indices of its drafted ancestors and itself


KEEP = 256  # committed entries whose features a cache keeps (deferred shadow drafts read them)


class EagleCache:
    """Per-request drafter cache: KV of the committed entries and the outputs of the newest."""

    def __init__(self, heads: "EagleHeads", start: int):
        p = next(heads.parameters())
        self.kv = [KV(layer.shape, start, p.device, p.dtype) for layer in heads.layers]  # per layer
        self.last: torch.Tensor | None = None  # f of the newest entry
        self.recent: torch.Tensor | None = None  # (r, d) f of entries end - r .. end - 1 (r <= KEEP)

    @property
    def end(self) -> int:
        return self.kv[0].end

    def keep(self, out: torch.Tensor) -> None:
        """Remember the features of the entries just added (out (m, d), the newest last)."""
        both = out.clone() if self.recent is None else torch.cat([self.recent, out])  # out may be a reused buffer
        self.recent = both[-KEEP:]
        self.last = out[-1]


class EagleHeads(DraftHeads):
    attends = True  # drafts need the per-request state (drafter.new_state / commit)
    any_depth = True  # the same layers serve every depth: drafting may go past K (dynamic trees' --dyn-depth)
    regress_features = True  # features target the backbone's next hidden state (--feature-loss)

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg)
        if not cfg.num_attention_heads:
            raise CadenceError("eagle heads need the attention shape (num_attention_heads, ...) in their config")
        d = cfg.hidden_size
        self.fc = nn.Linear((2 + len(cfg.taps)) * d, d, bias=False)
        with torch.no_grad():  # start as "pass h through": f = h, drafts = the backbone's own guess at t
            self.fc.weight.zero_()
            self.fc.weight[:, d:2 * d] = torch.eye(d)
        if cfg.num_layers < 1:
            raise CadenceError(f"eagle heads need at least one layer (num_layers {cfg.num_layers})")
        s = shape_from_config(cfg)
        self.layers = nn.ModuleList([Block(s, input_norm=i > 0) for i in range(cfg.num_layers)])

    def add_layers(self, n: int) -> "EagleHeads":
        """Append n fresh layers after the last; each starts as the identity (``Block`` zeroes
        its output projections), so the drafts are unchanged until they are trained."""
        p = next(self.parameters())
        for _ in range(n):
            self.layers.append(Block(shape_from_config(self.cfg), input_norm=True).to(p.device, p.dtype))
        self.cfg.num_layers = len(self.layers)
        return self

    def add_taps(self, taps: list[int]) -> "EagleHeads":
        """Read the backbone's layers ``taps`` too: ``fc`` gains zero columns for them, so the
        drafts are unchanged until they are trained."""
        if self.cfg.taps:
            raise CadenceError(f"these eagle heads already read taps {self.cfg.taps}")
        old = self.fc.weight.detach()
        self.fc = nn.Linear((2 + len(taps)) * self.cfg.hidden_size, self.cfg.hidden_size, bias=False).to(
            old.device, old.dtype)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :old.shape[1]] = old
        self.cfg.taps = list(taps)
        return self

    def _input(self, tokens: torch.Tensor, feats: torch.Tensor, taps: torch.Tensor | None = None) -> torch.Tensor:
        """fc over [E(tokens) ; feats (..., d) ; taps (..., n_taps, d) normalised, or zeros]."""
        dt = self._param_dtype()
        parts = [self.embed(tokens), feats.to(dt)]
        n = len(self.cfg.taps)
        drafting = not torch.is_grad_enabled()
        if n and taps is None and drafting:  # zero tap slots: only fc's first 2d columns matter
            return self._fc_base(torch.cat(parts, dim=-1))
        if n:
            if taps is None:  # a deeper level: no backbone states to read
                parts.append(feats.new_zeros(*feats.shape[:-1], n * feats.shape[-1], dtype=dt))
            else:
                t = nn.functional.rms_norm(taps.float(), (taps.shape[-1],), eps=self.cfg.rms_eps)
                parts.append(t.flatten(-2).to(dt))
        x = torch.cat(parts, dim=-1)
        kern = packed(self, {"fc": [self.fc]}) if drafting else None
        return kern["fc"](x) if kern is not None else self.fc(x)

    def _fc_base(self, x: torch.Tensor) -> torch.Tensor:
        """fc restricted to [E ; f] (x (..., 2d)): a drafted node's entry, whose tap slots are zero."""
        w = self.fc.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device, draft_format(self))
        hit = self.__dict__.get("_base_fc")
        if hit is None or hit[0] != key:
            base = w.detach()[:, :2 * self.cfg.hidden_size].contiguous()
            self.__dict__["_base_fc"] = hit = (key, base, draft_linear(base, draft_format(self)))
        return hit[2](x) if hit[2] is not None else nn.functional.linear(x, hit[1])

    # ------------------------------------------------------------------ training
    def train_features(self, hidden, ids, seg=None, taps=None):
        """Depth k at position t: f_k[t] (predicts x_{t+1+k}); list of (B, T-1-k, d).
        taps: (B, T, n_taps, d), the backbone's tapped layers (heads with ``cfg.taps``).

        Level m's entry of chain t sits at position t+m-1 and reads x_{t+m}; beyond the row
        end the token is padding (those positions never reach the loss). Example, T = 5,
        K = 2: level 1 has entries t = 0..3 (tokens x_1..x_4), depth 1 returns t = 0..2;
        level 2 entry of chain t reads f_1[t] and x_{t+2}, depth 2 returns t = 0..1."""
        B, T = ids.shape
        L = T - 1
        if self.cfg.taps and taps is None:
            raise CadenceError(f"these eagle heads read backbone taps {self.cfg.taps}: train them with those taps")
        h = hidden[:, :L].to(self._param_dtype())
        pos = torch.arange(L, device=ids.device).expand(B, L)
        seg = torch.zeros_like(ids) if seg is None else seg
        mask1 = segment_causal(seg[:, :L])
        f = self._input(ids[:, 1:], h, taps[:, :L] if self.cfg.taps else None)
        k1, v1 = [], []  # per layer: level-1 keys / values (B, L, G, D)
        for layer in self.layers:
            f, k, v = layer.forward_masked(f, pos, mask1)
            k1.append(k), v1.append(v)
        feats = [f[:, :T - 2]]
        dk, dv = [[] for _ in self.layers], [[] for _ in self.layers]  # per layer: deeper levels' keys
        for m in range(2, self.K + 1):
            tok = torch.cat([ids[:, m:], ids.new_zeros(B, m - 1)], dim=1)  # x_{t+m}, padded
            f = self._input(tok, f)
            for i, layer in enumerate(self.layers):
                f, k, v = layer.forward_ttt(f, pos + (m - 1), k1[i], v1[i], mask1, dk[i], dv[i])
                dk[i], dv[i] = dk[i] + [k], dv[i] + [v]
            feats.append(f[:, :T - 1 - m])
        return feats

    # ------------------------------------------------------------------ drafting
    def new_cache(self, start: int = 0) -> EagleCache:
        return EagleCache(self, start)

    def begin_draft(self, cache: EagleCache, pending: torch.Tensor, seq: list[int]) -> _Tree:
        """Extend ``cache`` with the committed entries it lacks and return the draft's scratch.

        seq = committed tokens + [root] = x_0..x_{t+1}; pending (m, d) = h_j for j = cache.end
        .. t (the backbone states not consumed yet), or (m, d * (1 + n_taps)) = [h_j ; taps_j]
        for heads with taps (without the tap columns their inputs are zeros, as at deeper levels). Entry j = (x_{j+1}, h_j), so the root's
        entry (x_{t+1}, h_t) is the last one added. Example: cache.end 10, t = 12 -> pending
        holds h_10..h_12 and entries 10, 11, 12 are added (tokens x_11, x_12, root)."""
        t = len(seq) - 2
        m = pending.shape[0]
        if cache.end + m != t + 1:
            raise CadenceError(f"eagle drafter state out of step: cache ends at {cache.end}, {m} new "
                               f"states, but the root's parent is at {t}")
        if m:
            dev = pending.device
            n = cache.kv[0].n
            toks = torch.tensor(seq[cache.end + 1:t + 2], device=dev)
            pos = torch.arange(cache.end, t + 1, device=dev)
            # entry i sees the committed entries and the new ones up to itself
            mask = None if m == 1 else torch.ones(m, n + m, dtype=torch.bool, device=dev).tril(n)
            d, taps = self.cfg.hidden_size, None
            if self.cfg.taps and pending.shape[-1] > d:
                taps = pending[:, d:].reshape(m, len(self.cfg.taps), d)
            out = self._input(toks, pending[:, :d], taps)
            for layer, kv in zip(self.layers, cache.kv):
                out = layer.draft_forward(out, pos, kv, n, mask, top=t)
                kv.advance(m)
            cache.keep(out)
        if cache.last is None:
            raise CadenceError("eagle drafter state is empty: commit the prompt's states first")
        return _Tree(cache.kv, t, cache.last)

    def entry_features(self, cache: EagleCache, positions: list[int]) -> torch.Tensor | None:
        """Features (B, d) of committed entries at ``positions`` (entry j reads x_{j+1} and
        h_j, so its features draft x_{j+2}: depth 1 after the root x_{j+1}); None when one
        of them is not among the newest ``KEEP``. Example: end 50, 8 kept (entries 42..49)
        -> positions [44, 49] are rows 2 and 7; [40] -> None."""
        r = 0 if cache.recent is None else cache.recent.shape[0]
        first = cache.end - r
        if any(not first <= p < cache.end for p in positions):
            return None
        return cache.recent[[p - first for p in positions]]

    def tree_step(self, k: int, prev: torch.Tensor, tokens: torch.Tensor, ctx: _Tree, nodes: list[int],
                  parents: list[int]):
        """Depth k-1 nodes ``nodes`` (tokens (P,), parent features prev (P, d)) -> their own
        features (P, d), from which their children at depth k are drafted."""
        if k == 1:  # the root: its entry is already in the cache
            return ctx.root[None].expand(len(nodes), -1)
        dev, n, M, P = tokens.device, ctx.cache[0].n, ctx.m, len(nodes)
        # scratch entries a node sees: its drafted ancestors' (by index) and its own (M + i)
        own = [[False] * (M + P) for _ in range(P)]
        for i, p in enumerate(parents):
            for j in ctx.anc.get(p, []):
                own[i][j] = True
            own[i][M + i] = True
        mask = torch.ones(P, n + M + P, dtype=torch.bool, device=dev)
        mask[:, n:] = torch.tensor(own, dtype=torch.bool, device=dev)
        pos = torch.full((P,), ctx.t + k - 1, device=dev)
        out = self._input(tokens, prev)
        for layer, kv in zip(self.layers, ctx.cache):
            out = layer.draft_forward(out, pos, kv, n + M, mask, top=ctx.t + k - 1)
        ctx.m += P
        for i, (node, p) in enumerate(zip(nodes, parents)):
            ctx.anc[node] = ctx.anc.get(p, []) + [M + i]
        return out

    def tree_logits_features(self, k: int, state: torch.Tensor) -> torch.Tensor:
        """Features for the LM head from a node's state f (no norm: vLLM's layout)."""
        return state

    def step_features(self, k, state, token):
        raise CadenceError("eagle heads draft through HeadDrafter (they need the request's context); "
                           "this scheduler steps heads on their own and supports MLP heads only")
