"""One Llama decoder block with explicit keys / values, for the attention-bearing heads.

Knows: the block's arithmetic (RMSNorm, grouped-query attention with RoPE, SwiGLU),
laid out with the parameter names of transformers' ``LlamaDecoderLayer`` (``self_attn.
q_proj`` ..., ``mlp.gate_proj`` ..., ``input_layernorm``, ``post_attention_layernorm``) so
that the weights load unchanged into a Llama layer (see ``cadence.heads.export``); the three
ways the heads attend: over a whole packed row (training, causal within a segment, any
extra mask), over a drafter cache's rows (``KV``: committed entries, then a draft's own in
scratch rows; drafting a tree level, in C++ where the extension is built), and EAGLE's
training-time test (a causal prefix plus a few per-position "diagonal" keys). Does not know:
what the entries mean (``eagle`` and ``mtp_attn`` do).

Shapes: H query heads, G key/value heads (H % G == 0), D = head_dim; keys and values are
kept as (N, G, D) per sequence (drafting, ``KV``) or (B, T, G, D) (training), after RoPE.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from cadence.fast import native
from cadence.fast.kernels import Linear, linear_ints
from cadence.heads.base import draft_format, packed
from cadence.heads.mtp import RMSNorm


@dataclass(frozen=True)
class BlockShape:
    d: int  # model width
    heads: int  # H
    kv_heads: int  # G
    head_dim: int  # D
    inter: int  # SwiGLU width
    eps: float
    rope_theta: float


def shape_from_config(cfg) -> BlockShape:
    """The block shape recorded in a ``HeadConfig`` (attention fields)."""
    return BlockShape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                      cfg.intermediate_size, cfg.rms_eps, cfg.rope_theta)


@lru_cache(maxsize=16)
def _inv_freq(D: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))


_TABLES: dict = {}  # (D, theta, device) -> (cos, sin) float32 (positions, D), grown by doubling


def rope_tables(pos: torch.Tensor, D: int, theta: float, top: int | None = None):
    """cos, sin (..., N, 1, D) float32 of Llama's rotary embedding at positions pos (..., N),
    looked up in a table (the angle of position p is p * inv_freq in float32, as computed
    directly). ``top``: the largest position when the caller knows it (saves a reduction)."""
    key = (D, float(theta), pos.device)
    need = (top if top is not None else int(pos.max()) if pos.numel() else 0) + 1
    tab = _TABLES.get(key)
    if tab is None or tab[0].shape[0] < need:
        size = max(need, 2 * tab[0].shape[0] if tab is not None else 1024)
        ang = torch.arange(size, device=pos.device, dtype=torch.float32)[:, None] * _inv_freq(D, theta, pos.device)
        emb = torch.cat([ang, ang], dim=-1)
        tab = _TABLES[key] = (emb.cos(), emb.sin())
    return tab[0][pos][..., None, :], tab[1][pos][..., None, :]


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., N, heads, D) rotated (rotate-half, Llama's default RoPE) in float32 by cos, sin
    (..., N, 1, D) of ``rope_tables``. Example: position 0 (cos 1, sin 0) leaves x unchanged."""
    D = x.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :D // 2], xf[..., D // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, s: BlockShape):
        super().__init__()
        self.q_proj = nn.Linear(s.d, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.d, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.d, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.d, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: BlockShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.d, s.inter, bias=False)
        self.up_proj = nn.Linear(s.d, s.inter, bias=False)
        self.down_proj = nn.Linear(s.inter, s.d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """x -> r = x + Attn(norm1(x)); out = r + MLP(norm2(r)).

    ``input_norm=False`` drops norm1 (EAGLE's layer 0, as vLLM / SGLang build it). The
    output projections start at zero, so a fresh block is the identity.
    """

    native = True  # drafting may run the C++ twin (``_native_block``); False for blocks of another arithmetic

    def __init__(self, s: BlockShape, input_norm: bool = True):
        super().__init__()
        self.shape = s
        self.input_layernorm = RMSNorm(s.d, s.eps) if input_norm else None
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = RMSNorm(s.d, s.eps)
        self.mlp = _MLP(s)
        nn.init.zeros_(self.self_attn.o_proj.weight)
        nn.init.zeros_(self.mlp.down_proj.weight)

    def decode_kernels(self) -> dict[str, Linear] | None:
        """Fused, prepacked projections for drafting (``packed``): qkv, o, gate_up, down."""
        a, m = self.self_attn, self.mlp
        return packed(self, {"qkv": [a.q_proj, a.k_proj, a.v_proj], "o": [a.o_proj],
                             "gate_up": [m.gate_proj, m.up_proj], "down": [m.down_proj]})

    def qkv(self, x: torch.Tensor, pos: torch.Tensor, kern: dict | None = None, tables=None):
        """x (..., N, d), pos (..., N) -> q (..., N, H, D), k and v (..., N, G, D), RoPE applied.
        ``kern``: ``decode_kernels()`` (drafting) instead of the modules; ``tables``: pos's
        ``rope_tables`` when the caller has them."""
        s, a = self.shape, self.self_attn
        y = self.attn_input(x)
        lead = x.shape[:-1]
        if kern is not None:
            q, k, v = kern["qkv"](y.contiguous()).split(
                [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        else:
            q, k, v = a.q_proj(y), a.k_proj(y), a.v_proj(y)
        q = q.reshape(*lead, s.heads, s.head_dim)
        k = k.reshape(*lead, s.kv_heads, s.head_dim)
        v = v.reshape(*lead, s.kv_heads, s.head_dim)
        cos, sin = tables if tables is not None else rope_tables(pos, s.head_dim, s.rope_theta)
        return rope_apply(q, cos, sin), rope_apply(k, cos, sin), v

    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What q / k / v are projected from: norm1(x), or x without norm1."""
        return self.input_layernorm(x) if self.input_layernorm is not None else x

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream the attention output is added to: the input itself."""
        return x

    def finish(self, x: torch.Tensor, attn: torch.Tensor, kern: dict | None = None) -> torch.Tensor:
        """x (..., d) the block input, attn (..., H, D) the attention output -> block output."""
        x = self.residual(x)
        if kern is None:
            r = x + self.self_attn.o_proj(attn.flatten(-2))
            return r + self.mlp(self.post_attention_layernorm(r))
        r = x + kern["o"](attn.flatten(-2).contiguous())
        g, u = kern["gate_up"](self.post_attention_layernorm(r).contiguous()).chunk(2, dim=-1)
        return r + kern["down"](F.silu(g) * u)

    # ------------------------------------------------------------------ training views
    def forward_masked(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor):
        """Whole rows: x (B, T, d), pos (B, T), mask (B, T, T) bool (True = query t sees key j;
        every row must allow at least its diagonal). Returns (out (B, T, d), k, v (B, T, G, D))."""
        q, k, v = self.qkv(x, pos)
        rep = self.shape.heads // self.shape.kv_heads
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
            v.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=mask[:, None])
        return self.finish(x, o.transpose(1, 2)), k, v

    def forward_ttt(self, x: torch.Tensor, pos: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor,
                    mask1: torch.Tensor, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]):
        """EAGLE's training-time test for one level: query t (x (B, T, d) at pos (B, T)) sees
        the level-1 keys k1/v1 (B, T, G, D) where mask1 (B, T, T) allows, plus, for each
        earlier level m >= 2, only that level's entry of the same chain t (``diag_k[m-2]``,
        (B, T, G, D)), plus itself. Returns (out, k, v) of this level.

        Example (T = 4, level 3): query t = 1 scores level-1 keys j = 0, 1 (mask1), level-2
        key 1 and its own level-3 key, and softmaxes over those four."""
        q, k, v = self.qkv(x, pos)
        H, G = self.shape.heads, self.shape.kv_heads
        rep = H // G
        scale = self.shape.head_dim ** -0.5
        qh = q.transpose(1, 2).float()  # (B, H, T, D)
        main = qh @ k1.repeat_interleave(rep, 2).transpose(1, 2).float().transpose(-1, -2) * scale
        main = main.masked_fill(~mask1[:, None], float("-inf"))  # (B, H, T, T)
        ks, vs = diag_k + [k], diag_v + [v]
        diag = torch.stack([(qh * kk.repeat_interleave(rep, 2).transpose(1, 2).float()).sum(-1) * scale
                            for kk in ks], dim=-1)  # (B, H, T, L)
        p = torch.softmax(torch.cat([main, diag], dim=-1), dim=-1)
        T = main.shape[-1]
        o = p[..., :T] @ v1.repeat_interleave(rep, 2).transpose(1, 2).float()
        for i, vv in enumerate(vs):
            o = o + p[..., T + i, None] * vv.repeat_interleave(rep, 2).transpose(1, 2).float()
        return self.finish(x, o.transpose(1, 2).to(x.dtype)), k, v

    # ------------------------------------------------------------------ drafting view
    def draft_forward(self, x: torch.Tensor, pos: torch.Tensor, kv: "KV", at: int,
                      mask: torch.Tensor | None = None, top: int | None = None) -> torch.Tensor:
        """Drafting: P new entries x (P, d) at positions pos (P,) are written to
        rows [at, at + P) of ``kv``'s buffers (rows below ``at``: its committed entries, then
        the draft's own) and each attends rows [0, at + P) where mask (P, at + P) bool allows
        (None: all of them); ``top``: the largest of pos, when known. Returns (P, d). Without
        autograd the projections run through ``decode_kernels``, and the block in C++ where
        the extension is built (``fast/native/draft_block.cpp``: the same ATen calls, same bits).

        Example: a cache of 10 committed entries, a draft level of 3 nodes after 2 drafted
        entries: at = 12, the nodes' keys go to rows 12..14 and the mask is (3, 15)."""
        P, s = x.shape[0], self.shape
        kv.reserve_rows(at + P)
        cos, sin = rope_tables(pos, s.head_dim, s.rope_theta, top)
        kern = None if torch.is_grad_enabled() else self.decode_kernels()  # with autograd: the modules
        block = _native_block(self, kern) if self.native else None
        if block is not None:
            return block.forward(x, cos, sin, kv.kbuf, kv.vbuf, at, mask)
        q, kv.kbuf[at:at + P], kv.vbuf[at:at + P] = self.qkv(x, pos, kern, (cos, sin))
        K = kv.kbuf[:at + P].transpose(0, 1)[None]  # (1, G, N, D)
        V = kv.vbuf[:at + P].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K, V,
                                           attn_mask=None if mask is None else mask[None, None],
                                           enable_gqa=s.heads != s.kv_heads)[0]  # (H, P, D)
        return self.finish(x, o.transpose(0, 1), kern)


_NATIVE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _native_block(block: Block, kern: dict | None):
    """The C++ twin of ``block`` for ``draft_forward`` (``fast.native``'s ``DraftBlock``), made
    once per set of packed kernels; None without the extension or on CUDA (``kern`` None)."""
    if kern is None or any(lin.kind == "aten" for lin in kern.values()):
        return None
    hit = _NATIVE.get(block)
    if hit is not None and hit[0] is kern:
        return hit[1]
    mod = native.module()
    made = None
    if mod is not None:
        s = block.shape
        ln1 = block.input_layernorm.weight.detach() if block.input_layernorm is not None else None
        made = mod.DraftBlock(s.heads, s.kv_heads, s.head_dim, float(s.eps), ln1,
                              block.post_attention_layernorm.weight.detach())
        lins = [kern["qkv"], kern["o"], kern["gate_up"], kern["down"]]
        made.set_linears([lin.w for lin in lins], [lin.scale for lin in lins], [lin.bias for lin in lins],
                         [i for lin in lins for i in linear_ints(lin)])
    _NATIVE[block] = (kern, made)
    return made

class KV:
    """Keys and values of one block over consecutive positions ``start .. start+n-1`` (a
    per-request drafter cache of committed entries), in buffers with room to spare: rows
    [n, capacity) are scratch a draft writes its own entries to (``Block.draft_forward``)
    and the next ``append`` / ``advance`` overwrites. Capacity doubles when needed."""

    def __init__(self, shape: BlockShape, start: int, device, dtype, capacity: int = 256):
        self.start = start
        self.n = 0  # committed entries
        self.kbuf = torch.zeros(capacity, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
        self.vbuf = torch.zeros_like(self.kbuf)

    @property
    def k(self) -> torch.Tensor:
        """(n, G, D) committed keys (a view)."""
        return self.kbuf[:self.n]

    @property
    def v(self) -> torch.Tensor:
        return self.vbuf[:self.n]

    @property
    def end(self) -> int:
        """The next position (one past the last entry)."""
        return self.start + self.n

    def reserve_rows(self, rows: int) -> None:
        """Room for ``rows`` rows in all (scratch rows included: they are kept when it grows)."""
        cap = self.kbuf.shape[0]
        if rows <= cap:
            return
        while cap < rows:
            cap *= 2
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_zeros((cap,) + tuple(old.shape[1:]))
            new[:old.shape[0]] = old
            setattr(self, name, new)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        m = k.shape[0]
        self.reserve_rows(self.n + m)
        self.kbuf[self.n:self.n + m] = k
        self.vbuf[self.n:self.n + m] = v
        self.n += m

    def advance(self, m: int) -> None:
        """Commit the m entries a ``draft_forward`` at row ``n`` wrote."""
        if self.n + m > self.kbuf.shape[0]:
            raise ValueError(f"advance by {m}: only {self.kbuf.shape[0] - self.n} rows written past {self.n}")
        self.n += m


def segment_causal(seg: torch.Tensor) -> torch.Tensor:
    """(B, T) packed-sequence ids -> (B, T, T) bool: key j visible to query t iff j <= t and
    both are in the same sequence (padding, seg -1, sees only itself).
    Example: seg [0, 0, 1] -> query 2 sees only key 2; query 1 sees keys 0, 1."""
    T = seg.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    same = seg[:, :, None] == seg[:, None, :]
    eye = torch.eye(T, dtype=torch.bool, device=seg.device)
    return (causal & same & (seg[:, :, None] >= 0)) | eye


def narrow_mlp(block: Block, width: int) -> torch.Tensor:
    """Keep ``width`` of the block's SwiGLU units, in place; returns the kept indices (width,).

    A unit j is scored ||up_proj[j]|| * ||gate_proj[j]|| * ||down_proj[:, j]|| (its largest
    possible contribution, up to the gate's nonlinearity) and the top ``width`` are kept in
    their original order, so ``width`` = the current width changes nothing. Example: widths
    1536 -> 1408 drops the 128 weakest units; the block then needs fine-tuning."""
    mlp = block.mlp
    inter = mlp.up_proj.out_features
    if not 0 < width <= inter:
        raise ValueError(f"cannot narrow a {inter}-unit MLP to {width} units")
    with torch.no_grad():
        score = (mlp.up_proj.weight.float().norm(dim=1) * mlp.gate_proj.weight.float().norm(dim=1)
                 * mlp.down_proj.weight.float().norm(dim=0))
        keep = score.topk(width).indices.sort().values
        for name in ("gate_proj", "up_proj"):
            old = getattr(mlp, name)
            new = nn.Linear(old.in_features, width, bias=False, device=old.weight.device, dtype=old.weight.dtype)
            new.weight.copy_(old.weight[keep])
            setattr(mlp, name, new)
        old = mlp.down_proj
        new = nn.Linear(width, old.out_features, bias=False, device=old.weight.device, dtype=old.weight.dtype)
        new.weight.copy_(old.weight[:, keep])
        mlp.down_proj = new
    s = block.shape
    block.shape = BlockShape(s.d, s.heads, s.kv_heads, s.head_dim, width, s.eps, s.rope_theta)
    return keep
