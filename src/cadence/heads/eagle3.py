"""EAGLE-3 drafter: fused low / mid / high taps, one 2d-input decoder layer, its own LM head.

    g_j   = fc[ l_j^{a} ; l_j^{b} ; l_j^{c} ]                      (3d -> d; the taps only)
    f_j   = Layer( [ E(x_{j+1}) ; g_j ] )                           entry j, at position j
    logits over the draft vocabulary for x_{j+2} = W_draft( Norm(f_j) )

``l_j^{a..c}``: the backbone's residual stream after decoder layers a < b < c (1-based,
``HeadConfig.taps``; default 2, L/2, L-3 of L layers, vLLM's and SGLang's default), raw (no
norm), at position j. ``Layer`` is one Llama decoder layer whose attention reads
``[input_layernorm(E) ; hidden_norm(g)]`` (q / k / v take 2d inputs) and whose residual stream
is g itself (un-normed), as vLLM's / SGLang's ``llama_eagle3`` build it; f is the layer's output
before the final ``Norm`` (the reference's "pre-norm" hidden state). The drafter has its own
``Norm`` and its own LM head over a reduced draft vocabulary (``draft_vocab``: V' target ids,
sorted; exported as ``d2t`` = id - index and ``t2d`` = a bool mask over the target vocabulary).

Drafting (EAGLE-3's rule): a tree node at depth d >= 1 is the entry ``Layer([E(its token) ;
f_parent])`` at position t + d: the drafter's own pre-norm output replaces the fused taps, so it
drafts autoregressively to any depth. Committed entries (the request's context) read the
backbone's taps, which the engine commits as [h ; taps] rows (``decode.request.drafter_states``); h
itself is not read. Cache, tree masks, shadows and entry bookkeeping are ``EagleHeads``'
(``eagle.EagleCache``, ``_Tree``): this class changes only what an entry is made of.

Training (``train_features``): the training-time test over K steps. Step 1 reads the fused
taps at every position; step k reads step k-1's pre-norm outputs of the same chain, **not
detached** (gradients flow through the unrolled chain, as in the EAGLE-3 reference training
code), and its query sees the step-1 keys up to t plus the deeper keys of its own chain, the
keys it sees in a drafted tree (``Block.forward_ttt``). The loss is the cross-entropy of the
drafter's own logits over the draft vocabulary; targets outside it are skipped (trainer).

Initialisation (``init_from_backbone``, fresh drafters only): ``fc`` passes the highest tap
through, ``norm`` copies the backbone's final norm and ``lm_head`` the backbone's LM-head rows of
the draft vocabulary, so step 1 starts as the logit lens of the highest tap.

Does not know: the context vocabulary (its logits are the backbone LM head's on backbone-space
features; this drafter's features are its own, so ``HeadDrafter`` turns it off); KL against a
full backbone teacher (the trainer refuses it); trees and the engine (``drafter``).
"""

from __future__ import annotations

import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.heads.attn_block import Block, BlockShape, segment_causal, shape_from_config
from cadence.heads.base import DraftHeads, HeadConfig, packed
from cadence.heads.eagle import EagleHeads
from cadence.heads.mtp import RMSNorm


def default_taps(num_layers: int) -> list[int]:
    """Low / middle / high taps of a backbone of ``num_layers`` decoder layers (1-based, after
    that layer): vLLM's and SGLang's EAGLE-3 default (2, L // 2, L - 3), kept within 1..L-1.
    Example: 30 layers -> [2, 15, 27]; 2 layers -> [1]."""
    return sorted({min(max(j, 1), num_layers - 1) for j in (2, num_layers // 2, num_layers - 3)})


class Eagle3Layer(Block):
    """A Llama decoder layer over x = [E ; g] (..., 2d): attention reads [input_layernorm(E) ;
    hidden_norm(g)] (q / k / v projections 2d -> heads), the residual stream is g. Parameter
    names are transformers' plus ``hidden_norm``, those of the reference's ``midlayer``."""

    native = False  # the C++ twin knows d-wide q / k / v only

    def __init__(self, s: BlockShape):
        super().__init__(s, input_norm=True)
        a = self.self_attn
        a.q_proj = nn.Linear(2 * s.d, s.heads * s.head_dim, bias=False)
        a.k_proj = nn.Linear(2 * s.d, s.kv_heads * s.head_dim, bias=False)
        a.v_proj = nn.Linear(2 * s.d, s.kv_heads * s.head_dim, bias=False)
        self.hidden_norm = RMSNorm(s.d, s.eps)

    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        d = self.shape.d
        return torch.cat([self.input_layernorm(x[..., :d]), self.hidden_norm(x[..., d:])], dim=-1)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.shape.d:]


class Eagle3Heads(EagleHeads):
    """``EagleHeads``' drafting (``begin_draft``: pending rows (m, d * (1 + n_taps)) = [h_j ;
    taps_j], of which only the taps are read; ``tree_step``; ``entry_features``) over entries
    made by ``_input``, with the layer, training and logits of EAGLE-3."""

    attends = True
    any_depth = True  # the same layer serves every depth
    regress_features = False  # EAGLE-3 drops the feature regression: token loss only
    own_lm_head = True  # logits come from the drafter's norm and LM head, not the backbone's

    def __init__(self, cfg: HeadConfig):
        DraftHeads.__init__(self, cfg)  # binding and the draft_vocab buffer; not EagleHeads' layers
        if not cfg.num_attention_heads:
            raise CadenceError("eagle3 heads need the attention shape (num_attention_heads, ...) in their config")
        if cfg.num_layers != 1:
            raise CadenceError(f"eagle3 heads have one decoder layer (num_layers {cfg.num_layers})")
        if not cfg.taps:
            raise CadenceError("eagle3 heads read backbone taps: their config needs taps (e.g. [2, 15, 27])")
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.taps) * d, d, bias=False)
        self.midlayer = Eagle3Layer(shape_from_config(cfg))
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size or cfg.vocab_size, bias=False)

    @property
    def layers(self) -> list[Eagle3Layer]:
        """The decoder layers in order (one): what ``EagleCache`` and ``tree_step`` walk."""
        return [self.midlayer]

    def add_layers(self, n: int):
        raise CadenceError("eagle3 heads have exactly one decoder layer")

    def add_taps(self, taps: list[int]):
        raise CadenceError(f"eagle3 heads read taps {self.cfg.taps} from the start; they cannot be changed")

    # ------------------------------------------------------------------ vocabulary and logits
    def set_draft_vocab(self, ids: torch.Tensor | None) -> "Eagle3Heads":
        """Draft over target ids ``ids`` (V',) sorted (None: the whole vocabulary). The LM head
        is resized to V' rows when it has another size (then, when bound, its rows start as the
        backbone's LM-head rows of those ids) and ``cfg.draft_vocab_size`` records V'."""
        n = self.cfg.vocab_size if ids is None else int(ids.numel())
        if ids is not None and (ids.dim() != 1 or bool((ids[1:] <= ids[:-1]).any())):
            raise CadenceError("an eagle3 draft vocabulary must be increasing target ids (d2t offsets)")
        if self.lm_head.out_features != n:
            p = self.lm_head.weight
            self.lm_head = nn.Linear(self.cfg.hidden_size, n, bias=False).to(p.device, p.dtype)
            if self._shared is not None:
                w = self._shared[1].weight.detach()
                rows = w if ids is None else w.index_select(0, ids.to(w.device))
                with torch.no_grad():
                    self.lm_head.weight.copy_(rows.to(p.dtype))
        self.cfg.draft_vocab_size = 0 if ids is None else n
        self.draft_vocab = None if ids is None else ids.long().to(self._device())
        return self

    def _refresh_draft_weight(self) -> None:  # no rows of the backbone's LM head are used
        self._draft_weight = self._draft_kernel = None

    def init_from_backbone(self, backbone) -> "Eagle3Heads":
        """A fresh drafter's start (module docstring): fc = the highest tap, norm = the
        backbone's final norm (when it has one), LM head = its LM-head rows of the vocabulary."""
        d = self.cfg.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, -d:] = torch.eye(d)
            inner = getattr(getattr(backbone, "model", None), "model", None)
            norm = getattr(inner, "norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == (d,):
                self.norm.weight.copy_(norm.weight.detach().float())
            w = backbone.lm_head.weight.detach()
            rows = w if self.draft_vocab is None else w.index_select(0, self.draft_vocab.to(w.device))
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
        return self

    def draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """(..., d) pre-norm features -> float32 logits (..., V') of the drafter's own head."""
        x = self.norm(feats.to(self._param_dtype()))
        if torch.is_inference_mode_enabled():
            kern = packed(self.lm_head, {"lm": [self.lm_head]})
            if kern is not None:
                return kern["lm"](x.contiguous()).float()
        return self.lm_head(x).float()

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) pre-norm features -> float32 logits over the whole target vocabulary (-inf
        outside the draft vocabulary)."""
        z = self.draft_logits(x)
        if self.draft_vocab is None:
            return z
        out = z.new_full((*z.shape[:-1], self.cfg.vocab_size), float("-inf"))
        out[..., self.draft_vocab.to(z.device)] = z
        return out

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise CadenceError("eagle3 heads score with their own norm and LM head: no context vocabulary")

    # ------------------------------------------------------------------ entries
    def _input(self, tokens: torch.Tensor, feats: torch.Tensor, taps: torch.Tensor | None = None) -> torch.Tensor:
        """[E(tokens) ; g] (..., 2d): g = fc(taps (..., n_taps, d)) when taps are given, else
        ``feats`` (..., d): the parent's pre-norm output (drafted nodes) or, for committed
        entries committed without tap columns, the backbone's state as a stand-in."""
        dt = self._param_dtype()
        if taps is not None:
            x = taps.flatten(-2).to(dt)
            kern = packed(self, {"fc": [self.fc]}) if torch.is_inference_mode_enabled() else None
            g = kern["fc"](x.contiguous()) if kern is not None else self.fc(x)
        else:
            g = feats.to(dt)
        return torch.cat([self.embed(tokens), g], dim=-1)

    # ------------------------------------------------------------------ training
    def train_features(self, hidden, ids, seg=None, taps=None):
        """Training-time test: pre-norm outputs f_k[t] (predicting x_{t+1+k}), list over k of
        (B, T-1-k, d). hidden (B, T, d): unused (EAGLE-3 reads the taps only); taps (B, T,
        n_taps, d): the backbone's tapped layers; seg (B, T): packed-sequence ids.

        Step m's entry of chain t sits at position t+m-1 and reads x_{t+m} and step m-1's output
        of chain t (not detached); beyond the row end the token is padding (never in the loss).
        Example, T = 5, K = 2: step 1 has entries t = 0..3 (tokens x_1..x_4), depth 1 returns
        t = 0..2; step 2 of chain t reads f_1[t] and x_{t+2}, depth 2 returns t = 0..1."""
        if taps is None:
            raise CadenceError(f"eagle3 heads read backbone taps {self.cfg.taps}: train them with those taps")
        B, T = ids.shape
        L = T - 1
        pos = torch.arange(L, device=ids.device).expand(B, L)
        seg = torch.zeros_like(ids) if seg is None else seg
        mask1 = segment_causal(seg[:, :L])
        layer = self.midlayer
        f, k1, v1 = layer.forward_masked(self._input(ids[:, 1:], None, taps[:, :L]), pos, mask1)
        feats = [f[:, :T - 2]]
        dk, dv = [], []  # keys / values of the deeper steps (one per step), same positions
        for m in range(2, self.K + 1):
            tok = torch.cat([ids[:, m:], ids.new_zeros(B, m - 1)], dim=1)  # x_{t+m}, padded
            f, k, v = layer.forward_ttt(self._input(tok, f), pos + (m - 1), k1, v1, mask1, dk, dv)
            dk, dv = dk + [k], dv + [v]
            feats.append(f[:, :T - 1 - m])
        return feats
