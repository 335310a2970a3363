"""Per-head training losses, the AdaMTP mask, and held-out accuracy; vocabulary-chunked.

Indexing (as in ``cadence.heads.base``): a row holds tokens x_0..x_{T-1}; ``hidden[:, t]``
is the backbone state after x_t. Head k (1..K) at position t sees h_t and x_{t+1}..x_{t+k}
and predicts x_{t+1+k}; its features come as ``feats[k-1][:, t]`` for t = 0..T-2-k.

Targets of head k at position t:

* ``ce`` with target ``token``: the data token ``ids[:, t+1+k]``;
* ``ce`` with target ``backbone``: ``argmax[:, t+k]``, the backbone's own greedy choice for
  that position (``argmax[:, s]`` is the argmax of p_B(. | x_<=s), a prediction of x_{s+1});
* ``kl``: KL(p_B(. | x_<=t+k) || q_k), the backbone distribution at index t+k, from the
  LM head applied to ``hidden[:, t+k]`` (teacher ``full``) or from stored top-k logits
  (teacher ``topk``: the k largest logits, renormalised; the rest of the vocabulary
  carries no teacher mass).

Only positions whose target lies in the reply count (``reply[:, t+1+k]``, i.e. the target's
index in its sequence is >= prompt_len) and whose target is in the same packed sequence
(``seg[:, t] == seg[:, t+1+k]``). Head k's mean loss is weighted lambda^(k-1).

Memory: the vocabulary can be large (49152), so the valid positions of each head are
gathered into a flat (N, d) matrix and pushed through the LM head ``chunk`` rows at a time,
each chunk under activation checkpointing; the (B, T, K, V) logits never exist at once,
nor does more than one chunk's logits during the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cadence.errors import CadenceError

LOSSES = ("ce", "kl", "ce+adamtp", "kl+adamtp")
TARGETS = ("token", "backbone")
TEACHERS = ("full", "topk")


def parse_loss(name: str) -> tuple[str, bool]:
    """'ce' | 'kl' | 'ce+adamtp' | 'kl+adamtp' -> (base loss, adamtp on)."""
    if name not in LOSSES:
        raise CadenceError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    base, _, extra = name.partition("+")
    return base, extra == "adamtp"


def head_weights(num_heads: int, lam: float) -> list[float]:
    """lambda^(k-1) for k = 1..K."""
    return [lam ** (k - 1) for k in range(1, num_heads + 1)]


# --------------------------------------------------------------------------- entropy / AdaMTP

def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the last axis (float32)."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# rows of logits per chunk: 32 x 49152 fp32 logits (6 MiB) stay in cache through the softmax,
# exp, product and sum; 512 rows ran 3,047 positions/s, 32 rows 4,303-4,519 (SmolLM2, AMX Xeon)
STATS_CHUNK = 32


@torch.no_grad()
def logits_stats(lm: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, chunk: int = STATS_CHUNK,
                 want_entropy: bool = True, want_argmax: bool = True
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backbone entropy and argmax at every position of ``hidden`` (..., d), ``chunk`` rows at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    ent = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device) if want_entropy else None
    arg = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device) if want_argmax else None
    for i in range(0, flat.shape[0], chunk):
        z = lm(flat[i:i + chunk]).float()
        if ent is not None:
            ent[i:i + chunk] = entropy_from_logits(z)
        if arg is not None:
            arg[i:i + chunk] = z.argmax(-1)
    shape = hidden.shape[:-1]
    return (ent.view(shape) if ent is not None else None, arg.view(shape) if arg is not None else None)


def entropy_boundaries(entropy: torch.Tensor, window: int = 16, c: float = 2.0,
                       min_history: int = 2) -> torch.Tensor:
    """AdaMTP boundaries of one or more sequences: bool tensor shaped like ``entropy`` (..., T).

    ``entropy[..., s]`` is H_s, the backbone's entropy at index s (its uncertainty about
    x_{s+1}). Over the trailing window of the ``window`` values strictly before s,
    H_{s-w}..H_{s-1} (fewer at the start of the sequence), take the mean mu_s and the
    population standard deviation sigma_s. Index s is a boundary when
    ``H_s > mu_s + c * sigma_s`` (plus 1e-6 against rounding); with fewer than ``min_history``
    earlier values it is not.
    A boundary at entropy index s means token x_{s+1} was unpredictable; see
    ``adamtp_mask`` for how it masks the heads. Each row is one whole sequence (the window
    never reaches across sequences).
    """
    if window < 1:
        raise CadenceError("the AdaMTP window must be at least 1")
    h = entropy.double()
    T = h.shape[-1]
    zero = torch.zeros(h.shape[:-1] + (1,), dtype=h.dtype, device=h.device)
    cs = torch.cat([zero, h.cumsum(-1)], -1)  # cs[i] = sum of h[:i]
    cs2 = torch.cat([zero, (h * h).cumsum(-1)], -1)
    s = torch.arange(T, device=h.device)
    lo = (s - window).clamp(min=0)
    n = (s - lo).to(h.dtype)  # values in the window before s
    tot = cs[..., s] - cs[..., lo]
    tot2 = cs2[..., s] - cs2[..., lo]
    nn_ = n.clamp(min=1)
    mu = tot / nn_
    var = (tot2 / nn_ - mu * mu).clamp(min=0)
    return (h > mu + c * var.sqrt() + 1e-6) & (n >= min_history)


def adamtp_mask(boundary: torch.Tensor, k: int) -> torch.Tensor:
    """Positions where head k's loss is MASKED, shape (..., T-1-k), from boundaries (..., T).

    Head k at position t drafts, along its chain, the tokens x_{t+2}..x_{t+1+k} (x_{t+1}
    is the backbone's own token at decoding time). Its loss is masked when a boundary
    token falls inside the token interval (t+1, t+1+k], i.e. when some
    ``boundary[s]`` is set for entropy index s in {t+1, ..., t+k} (token x_{s+1}).

    Worked example (window 16, c = 2): H = [2, 2, 2, 2, 2, 2, 9, 2, 2, 2] (T = 10).
    s = 0, 1 have too little history; s = 2..5 see a constant window (sigma 0) and H_s
    equals mu_s, so no boundary; s = 6: 9 > 2 + 0, a boundary (token x_7 was
    unpredictable); s = 7: window [2 x 6, 9] gives mu 3, sigma 2.45, and 2 is below 7.9.
    So boundary = {6}, and the masked positions are
    head 1: t = 5 (it predicts x_7);
    head 2: t = 4, 5 (targets x_7 and x_8; the chain for x_8 runs through x_7);
    head 3: t = 3, 4, 5.
    Head 1 at t = 6 (target x_8, chain (7, 8]) is kept.
    """
    T = boundary.shape[-1]
    n = T - 1 - k
    if n <= 0:
        return boundary.new_zeros(boundary.shape[:-1] + (max(n, 0),))
    b = boundary.long()
    zero = torch.zeros(b.shape[:-1] + (1,), dtype=b.dtype, device=b.device)
    cs = torch.cat([zero, b.cumsum(-1)], -1)  # cs[i] = boundaries among indices < i
    t = torch.arange(n, device=b.device)
    return (cs[..., t + k + 1] - cs[..., t + 1]) > 0


# --------------------------------------------------------------------------- masks and targets

def valid_mask(seg: torch.Tensor, reply: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T-1-k) bool: head k at t has a reply target in the same packed sequence."""
    T = seg.shape[-1]
    n = max(T - 1 - k, 0)
    s0, s1 = seg[..., :n], seg[..., k + 1:k + 1 + n]
    return (s0 >= 0) & (s0 == s1) & reply[..., k + 1:k + 1 + n]


def decode_mask(seg: torch.Tensor, reply: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T-1-k) bool: positions a decoder would query head k at (t >= prompt_len - 1, i.e.
    x_{t+1} is a reply token) with head k's target still inside the sequence."""
    T = seg.shape[-1]
    n = max(T - 1 - k, 0)
    s0, s1 = seg[..., :n], seg[..., k + 1:k + 1 + n]
    return (s0 >= 0) & (s0 == s1) & reply[..., 1:1 + n]


@dataclass
class Batch:
    """One packed micro-batch on the training device.

    ids, seg, reply: (B, T). seg is the packed-sequence id (-1 = padding); reply marks
    tokens of the reply (index in its sequence >= prompt_len). hidden: (B, T, d) backbone
    states. argmax: (B, T) backbone argmax (target 'backbone'). boundary: (B, T) AdaMTP
    boundaries. topk_ids / topk_logits: (B, T, k) stored teacher (teacher 'topk'),
    topk_ok: (B, T) where it exists. taps: (B, T, n_taps, d) the backbone's tapped layers
    (drafters with ``HeadConfig.taps``).
    """

    ids: torch.Tensor
    seg: torch.Tensor
    reply: torch.Tensor
    hidden: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    boundary: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logits: torch.Tensor | None = None
    topk_ok: torch.Tensor | None = None
    taps: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int((self.seg >= 0).sum())


def head_targets(batch: Batch, k: int, target: str) -> torch.Tensor:
    """(B, T-1-k) class targets of head k: the data token or the backbone argmax."""
    n = max(batch.ids.shape[-1] - 1 - k, 0)
    if target == "token":
        return batch.ids[..., k + 1:k + 1 + n]
    if target == "backbone":
        if batch.argmax is None:
            raise CadenceError("target 'backbone' needs the backbone argmax (hidden cache or backbone pass)")
        return batch.argmax[..., k:k + n]
    raise CadenceError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")


# --------------------------------------------------------------------------- chunked losses

def _ce_sum(lm, f, tgt):
    return F.cross_entropy(lm(f).float(), tgt, reduction="sum")


def _kl_full_sum(lm, f, teacher_h):
    logq = torch.log_softmax(lm(f).float(), -1)
    with torch.no_grad():
        logp = torch.log_softmax(lm(teacher_h).float(), -1)
    return (logp.exp() * (logp - logq)).sum()


def _kl_topk_sum(lm, f, t_ids, t_logits):
    logq = torch.log_softmax(lm(f).float(), -1).gather(-1, t_ids)
    logp = torch.log_softmax(t_logits.float(), -1)
    return (logp.exp() * (logp - logq)).sum()


def _chunked(fn, lm, feats: torch.Tensor, *aux: torch.Tensor, chunk: int) -> torch.Tensor:
    total = feats.new_zeros((), dtype=torch.float32)
    use_ckpt = torch.is_grad_enabled() and feats.requires_grad
    for i in range(0, feats.shape[0], chunk):
        args = (feats[i:i + chunk],) + tuple(a[i:i + chunk] for a in aux)
        part = checkpoint(fn, lm, *args, use_reentrant=False) if use_ckpt else fn(lm, *args)
        total = total + part
    return total


def chunked_ce(lm, feats: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Sum of cross-entropy of lm(feats) (N, d) against targets (N,), ``chunk`` rows at a time."""
    return _chunked(_ce_sum, lm, feats, targets, chunk=chunk)


def chunked_kl(lm, feats: torch.Tensor, teacher_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Sum over rows of KL(softmax(lm(teacher_hidden)) || softmax(lm(feats)))."""
    return _chunked(_kl_full_sum, lm, feats, teacher_hidden, chunk=chunk)


def chunked_kl_topk(lm, feats: torch.Tensor, t_ids: torch.Tensor, t_logits: torch.Tensor,
                    chunk: int = 1024) -> torch.Tensor:
    """Sum over rows of KL(p_topk || q), p = softmax over the stored top-k logits only."""
    return _chunked(_kl_topk_sum, lm, feats, t_ids, t_logits, chunk=chunk)


# --------------------------------------------------------------------------- fused LM head + loss

_WEIGHT_CACHE: dict = {}


def _weight_as(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (frozen) LM-head weight in ``dtype``, converted once and kept while unchanged."""
    if weight.dtype == dtype:
        return weight
    key = (weight.data_ptr(), weight._version, dtype, tuple(weight.shape))
    if _WEIGHT_CACHE.get("key") != key:
        _WEIGHT_CACHE.clear()
        _WEIGHT_CACHE.update(key=key, value=weight.detach().to(dtype))
    return _WEIGHT_CACHE["value"]


def _log_softmax_(z: torch.Tensor) -> torch.Tensor:
    """In-place log-softmax over the last axis (float32), in few passes over memory."""
    z.sub_(z.amax(-1, keepdim=True))
    lse = z.exp().sum(-1, keepdim=True).log_()
    return z.sub_(lse)


class _FusedHeadLoss(torch.autograd.Function):
    """Sum of a per-row loss of ``feats @ W.T (+ b)`` with its gradient computed in the forward.

    Each chunk's logits live only inside the loop: the forward computes the loss and
    d loss / d feats (two matmuls per chunk), the backward only scales the stored gradient.
    Modes: ``ce`` (aux = targets, and optionally extra rows (U, d) with a visibility mask
    (N, U): the context vocabulary, columns V'.. of the logits, -inf where not visible),
    ``kl`` (aux = teacher features through the same head), ``topk`` (aux = teacher ids,
    teacher logits).
    """

    @staticmethod
    def forward(ctx, feats, weight, bias, mode, chunk, compute_dtype, *aux):
        W = _weight_as(weight, compute_dtype)
        extra = mode == "ce" and len(aux) > 2 and aux[1] is not None
        if extra:  # the context vocabulary's rows after the draft vocabulary's
            n_main = W.shape[0]
            W = torch.cat([W, aux[1].to(compute_dtype)])
        grad = torch.empty(feats.shape, dtype=torch.float32, device=feats.device)
        total = torch.zeros((), dtype=torch.float64, device=feats.device)
        dev_type = feats.device.type
        with torch.autocast(dev_type, enabled=False):
            for i in range(0, feats.shape[0], chunk):
                f = feats[i:i + chunk].to(compute_dtype)
                z = (f @ W.T).float()
                if bias is not None:
                    z[:, :bias.shape[0]] += bias.float()
                if extra:
                    z[:, n_main:].masked_fill_(~aux[2][i:i + chunk], float("-inf"))
                if mode == "ce":
                    tgt = aux[0][i:i + chunk]
                    z.sub_(z.amax(-1, keepdim=True))
                    zt = z.gather(-1, tgt[:, None])[:, 0]
                    z.exp_()
                    s = z.sum(-1, keepdim=True)
                    total += (s[:, 0].log() - zt).sum().double()
                    z.mul_(1.0 / s)  # q
                    z[torch.arange(z.shape[0], device=z.device), tgt] -= 1.0  # q - onehot
                elif mode == "kl":
                    tz = (aux[0][i:i + chunk].to(compute_dtype) @ W.T).float()
                    if bias is not None:
                        tz += bias.float()
                    logp = _log_softmax_(tz)
                    logq = _log_softmax_(z)
                    p = logp.exp()
                    total += (p * (logp - logq)).sum().double()
                    z = logq.exp_().sub_(p)  # q - p
                else:  # topk
                    ids, tl = aux[0][i:i + chunk], aux[1][i:i + chunk]
                    logp = torch.log_softmax(tl.float(), -1)
                    p = logp.exp()
                    logq = _log_softmax_(z)
                    total += (p * (logp - logq.gather(-1, ids))).sum().double()
                    z = logq.exp_()
                    z.scatter_add_(-1, ids, -p)  # q - p (p renormalised over the stored top-k)
                grad[i:i + chunk] = (z.to(compute_dtype) @ W).float()
        ctx.save_for_backward(grad)
        ctx.feats_dtype = feats.dtype
        ctx.n_aux = len(aux)
        return total.float()

    @staticmethod
    def backward(ctx, gout):
        (grad,) = ctx.saved_tensors
        return (grad * gout).to(ctx.feats_dtype), None, None, None, None, None, *([None] * ctx.n_aux)


def fused_loss(lm_head: nn.Linear, feats: torch.Tensor, mode: str, *aux: torch.Tensor,
               chunk: int = 1024) -> torch.Tensor:
    """Sum over rows of the ``mode`` loss (ce | kl | topk) of ``lm_head(feats)``.

    Same value and gradient as ``chunked_ce`` / ``chunked_kl`` / ``chunked_kl_topk``, but the
    gradient is formed chunk by chunk in the forward (two LM-head matmuls per chunk instead of
    three, no logits kept). Matmuls run in the autocast dtype when autocast is on (bf16 uses
    AMX on recent Xeons), softmax arithmetic in float32.
    """
    dev_type = feats.device.type
    if torch.is_autocast_enabled(dev_type):
        compute = torch.get_autocast_dtype(dev_type)
    else:
        compute = lm_head.weight.dtype
    aux = tuple(aux) + (None,) * (3 - len(aux))
    return _FusedHeadLoss.apply(feats, lm_head.weight, lm_head.bias, mode, chunk, compute, *aux)


@dataclass
class LossSpec:
    """What ``head_losses`` computes."""

    loss: str = "ce"  # ce | kl | ce+adamtp | kl+adamtp
    target: str = "token"  # ce target: token | backbone
    teacher: str = "full"  # kl teacher: full | topk
    lam: float = 0.8  # head k weighted lam^(k-1)
    chunk: int = 1024  # positions per LM-head chunk
    # (V,) full id -> draft-vocabulary column, -1 outside. ce: targets outside are skipped; kl (teacher
    # full): ``lm`` is then the draft rows of the LM head, so the teacher is p_B renormalised over them
    vocab_map: torch.Tensor | None = None
    # ce with a draft vocabulary: also score the context's tokens outside it (rows of ``lm_rows``,
    # the frozen LM head), as ``HeadDrafter(context_vocab=...)`` drafts them, instead of skipping them
    context_vocab: bool = False
    lm_rows: torch.Tensor | None = None  # (V, d) full LM-head weight, for the context columns


def head_masks(batch: Batch, k: int, adamtp: bool) -> torch.Tensor:
    """Training mask of head k (B, T-1-k): valid target, not masked by AdaMTP."""
    m = valid_mask(batch.seg, batch.reply, k)
    if adamtp:
        if batch.boundary is None:
            raise CadenceError("AdaMTP needs backbone entropies (hidden cache or backbone pass)")
        m = m & ~adamtp_mask(batch.boundary, k)
    return m


def context_seen(ids: torch.Tensor, seg: torch.Tensor, vocab_map: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's tokens outside the draft vocabulary, uniq (U,) sorted, and seen (B, T, U)
    bool: uniq[u] occurs in row b at or before t within t's packed sequence. A draft made at
    t (root x[t+1]) may propose uniq[u] iff seen[b, t + 1, u] (``HeadDrafter``'s context
    vocabulary, without its recency limit). None when every token is inside.
    Example: row [5, 90, 7 | 90], 90 outside, seg [0, 0, 0, 1]: seen[.., u(90)] = [F, T, T, T]
    (the second sequence has its own 90 at its first position)."""
    out = (vocab_map[ids] < 0) & (seg >= 0)
    if not bool(out.any()):
        return None
    uniq = torch.unique(ids[out])
    occ = ((ids[..., None] == uniq) & (seg[..., None] >= 0)).to(torch.int32)  # (B, T, U)
    cum = occ.cumsum(1)
    T = ids.shape[1]
    pos = torch.arange(T, device=ids.device).expand_as(ids)
    first = torch.ones_like(seg, dtype=torch.bool)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(1).values  # first index of t's sequence
    before = cum.gather(1, (start - 1).clamp(min=0)[..., None].expand_as(cum)) * (start > 0)[..., None]
    return uniq, (cum - before) > 0


def _context_targets(tgt: torch.Tensor, mask: torch.Tensor, ctx, vocab_map: torch.Tensor):
    """Targets over [draft vocabulary ; context columns] for head k's masked positions: (targets
    (N,), kept (N,) bool, visibility (N, U)). A target outside the draft vocabulary is kept when
    it is a visible context token."""
    uniq, seen = ctx
    m = vocab_map[tgt]
    T1 = mask.shape[-1]
    vis = seen[:, 1:1 + T1][mask]  # (N, U): the context at t is x[..t+1]
    u = torch.searchsorted(uniq, tgt).clamp(max=uniq.numel() - 1)
    found = (uniq[u] == tgt) & vis.gather(1, u[:, None])[:, 0]
    n_main = int((vocab_map >= 0).sum())
    return torch.where(m >= 0, m, n_main + u), (m >= 0) | found, vis


def head_losses(lm, feats: list[torch.Tensor], batch: Batch, spec: LossSpec
                ) -> tuple[torch.Tensor, list[float], list[int]]:
    """Weighted total loss, per-head mean losses (floats) and per-head position counts.

    ``lm`` is the shared LM head: an ``nn.Linear`` takes the fused path (``fused_loss``), any
    other callable mapping features (N, d) to logits (N, V) the checkpointed one. The total is
    sum_k lam^(k-1) * mean_k; a head with no valid position contributes 0 (but keeps its
    parameters in the graph, which DDP needs).
    """
    base, adamtp = parse_loss(spec.loss)
    weights = head_weights(len(feats), spec.lam)
    total = sum(f.float().sum() for f in feats) * 0.0
    means, counts = [], []
    ctx = None  # the context vocabulary of this batch (ce over a draft vocabulary, fused path)
    if (spec.context_vocab and base == "ce" and spec.vocab_map is not None and spec.lm_rows is not None
            and isinstance(lm, nn.Linear)):
        ctx = context_seen(batch.ids, batch.seg, spec.vocab_map)
    for k, f in enumerate(feats, start=1):
        mask = head_masks(batch, k, adamtp)
        n = int(mask.sum())
        counts.append(n)
        if n == 0:
            means.append(float("nan"))
            continue
        fk = f[mask]
        T = batch.ids.shape[-1]
        fused = isinstance(lm, nn.Linear)
        if base == "ce":
            tgt = head_targets(batch, k, spec.target)[mask]
            if ctx is not None:  # draft vocabulary plus the visible context tokens outside it
                tgt, keep, vis = _context_targets(tgt, mask, ctx, spec.vocab_map)
                n = int(keep.sum())
                if n == 0:
                    means.append(float("nan"))
                    continue
                rows = spec.lm_rows.index_select(0, ctx[0])
                s = fused_loss(lm, fk[keep], "ce", tgt[keep], rows, vis[keep], chunk=spec.chunk)
                mean = s / n
                means.append(float(mean.detach()))
                total = total + weights[k - 1] * mean
                continue
            if spec.vocab_map is not None:  # train over the draft vocabulary; skip targets outside it
                tgt = spec.vocab_map[tgt]
                inside = tgt >= 0
                fk, tgt, n = fk[inside], tgt[inside], int(inside.sum())
                if n == 0:
                    means.append(float("nan"))
                    continue
            s = fused_loss(lm, fk, "ce", tgt, chunk=spec.chunk) if fused else chunked_ce(lm, fk, tgt, spec.chunk)
        elif spec.teacher == "full":
            th = batch.hidden[:, k:T - 1][mask]  # backbone state at t+k
            s = fused_loss(lm, fk, "kl", th, chunk=spec.chunk) if fused else chunked_kl(lm, fk, th, spec.chunk)
        elif spec.teacher == "topk":
            if batch.topk_ids is None:
                raise CadenceError("teacher 'topk' needs shards written with --topk-logits")
            ok = batch.topk_ok[:, k:T - 1]
            if not bool(ok[mask].all()):
                raise CadenceError("stored top-k logits do not cover every reply position")
            ids = batch.topk_ids[:, k:T - 1][mask].long()
            tl = batch.topk_logits[:, k:T - 1][mask]
            s = (fused_loss(lm, fk, "topk", ids, tl, chunk=spec.chunk) if fused
                 else chunked_kl_topk(lm, fk, ids, tl, spec.chunk))
        else:
            raise CadenceError(f"unknown KL teacher {spec.teacher!r}; choose one of {', '.join(TEACHERS)}")
        mean = s / n
        means.append(float(mean.detach()))
        total = total + weights[k - 1] * mean
    return total, means, counts


def feature_regression(feats: list[torch.Tensor], batch: Batch, lam: float = 0.8) -> torch.Tensor:
    """EAGLE's feature loss: sum_k lam^(k-1) * mean smooth-L1(f_k[t], h[t+k]) over head k's
    training positions (``valid_mask``). f_k[t] stands for the backbone state after x_{t+k}
    (depth k's features feed depth k+1 in place of that state). Example: k = 1, t = 0 compares
    f_1[0] with hidden[:, 1]."""
    total = feats[0].float().sum() * 0.0
    T = batch.ids.shape[-1]
    for k, f in enumerate(feats, start=1):
        mask = valid_mask(batch.seg, batch.reply, k)
        if not bool(mask.any()):
            continue
        target = batch.hidden[:, k:T - 1][mask].float()
        total = total + lam ** (k - 1) * F.smooth_l1_loss(f[mask].float(), target)
    return total


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def topk_correct(lm, feats: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                 ks: tuple[int, ...] = (1, 5)) -> dict[int, torch.Tensor]:
    """For each k in ``ks``: bool (N,) whether the target is among lm(feats)'s top-k."""
    out = {k: torch.zeros(feats.shape[0], dtype=torch.bool, device=feats.device) for k in ks}
    top = max(ks)
    for i in range(0, feats.shape[0], chunk):
        idx = lm(feats[i:i + chunk]).float().topk(top, dim=-1).indices
        hit = idx == targets[i:i + chunk, None]
        for k in ks:
            out[k][i:i + chunk] = hit[:, :k].any(-1)
    return out


@torch.no_grad()
def chain_counts(lm, feats: list[torch.Tensor], batch: Batch, target: str, chunk: int = 1024,
                 vocab_map: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Held-out counts over decoding positions (``decode_mask``), float64 tensors of length K.

    n[k]: positions where head k has a target; top1[k], top5[k]: hits of head k there;
    chain[k]: positions where heads 1..k are all right (top-1), counted over the same
    positions as n[k]. P(chain k) = chain[k] / n[k] is the conditional chain acceptance:
    expected tau of a top-1 chain = 1 + sum_k P(chain k). With ``vocab_map`` (draft
    vocabulary), ``lm`` gives draft-vocabulary logits and targets outside it count as misses.
    """
    K = len(feats)
    dev = batch.ids.device
    n = torch.zeros(K, dtype=torch.float64, device=dev)
    top1, top5, chain = n.clone(), n.clone(), n.clone()
    right_prev: torch.Tensor | None = None  # (B, T-1-(k-1)) all heads < k right
    for k, f in enumerate(feats, start=1):
        mask = decode_mask(batch.seg, batch.reply, k)
        tgt = head_targets(batch, k, target)
        if vocab_map is not None:
            tgt = vocab_map[tgt]
        right1 = torch.zeros_like(mask)
        if mask.any():
            hits = topk_correct(lm, f[mask], tgt[mask], chunk)
            right1[mask] = hits[1]
            top1[k - 1] = hits[1].sum()
            top5[k - 1] = hits[5].sum()
        n[k - 1] = mask.sum()
        all_right = right1 if right_prev is None else right1 & right_prev[..., :right1.shape[-1]]
        chain[k - 1] = (all_right & mask).sum()
        right_prev = all_right
    return {"n": n, "top1": top1, "top5": top5, "chain": chain}


def summarize_counts(c: dict[str, torch.Tensor]) -> dict:
    """Accuracies and expected tau from (reduced) ``chain_counts``."""
    n = c["n"].clamp(min=1)
    acc1 = (c["top1"] / n).tolist()
    acc5 = (c["top5"] / n).tolist()
    chain = (c["chain"] / n).tolist()
    indep, prod = 1.0, 1.0
    for a in acc1:
        prod *= a
        indep += prod
    return {"top1": acc1, "top5": acc5, "chain": chain, "tau": 1.0 + sum(chain), "tau_independent": indep,
            "positions": [int(x) for x in c["n"].tolist()]}


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
