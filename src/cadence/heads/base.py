"""What every draft-head family shares: K heads on a frozen backbone, stepped along a path.

A head family implements two views of the same computation:

* ``step(k, state, token)``: drafting. Given the state after depth k-1 and the token at
  depth k-1 (depth 0 is the backbone's root token), return head k's logits for the
  token at depth k and the new state. Batched over tree nodes.
* ``train_logits(hidden, ids)``: training. Teacher-forced over whole sequences.

Indexing (both views): ids x_0..x_{T-1}; ``hidden[:, t]`` is the backbone state after
x_t, whose LM head predicts x_{t+1}. Head k at position t sees h_t and x_{t+1}..x_{t+k}
and predicts x_{t+1+k}. Example, T=6, k=2: positions t=0..2 are trainable, and t=0
predicts x_3 from (h_0, x_1, x_2).

The backbone's embedding and LM head are shared and frozen; they are bound with
``bind(backbone)`` and never saved with the heads.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from cadence.errors import CadenceError
from cadence.fast.kernels import BLOCK_DRAFTS, DRAFT_FORMATS, Linear, draft_linear, resolve_draft_format
from cadence.heads.tables import DraftPolicy


def draft_format(module: nn.Module) -> str:
    """How ``module``'s drafting kernels hold their weights (``fast.kernels.DRAFT_FORMATS``),
    as ``DraftHeads.set_draft_format`` marked it; ``dense`` when unmarked (heads built or loaded
    directly; ``methods.resolve_heads`` marks them with ``MethodSpec.draft_weights``, ``auto``)."""
    return module.__dict__.get("draft_format", "dense")


_PACKED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def packed(owner: nn.Module, groups: dict[str, list[nn.Linear]]) -> dict[str, Linear] | None:
    """Drafting kernels for ``owner``'s linear layers, weights only (a caller adds any bias:
    ``drafting_linear``): each group's weights fused
    (rows stacked in the given order) into one ``fast.kernels.Linear`` in the device's
    fastest layout (prepacked oneDNN on CPU: one weight read for all rows; ``F.linear`` in
    bf16 at one row took 50 us for q/k/v against 30 us prepacked on the Zen 5 EPYC), or in
    Q8_0 blocks where ``owner`` is marked so (``draft_format``). None
    where that is plain ``F.linear`` anyway (CUDA). Rebuilt when any weight was replaced or
    changed in place (training, loading: the tensors' ``_version``), so a stale copy is never
    used. Only for inference (the packed copies carry no gradient).

    Example: ``packed(block, {"qkv": [q_proj, k_proj, v_proj]})["qkv"](y)`` = ``cat([q_proj(y),
    k_proj(y), v_proj(y)], -1)`` up to rounding."""
    weights = [lin.weight for group in groups.values() for lin in group]
    fmt = draft_format(owner)
    key = (fmt,) + tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    hit = _PACKED.get(owner)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        kernels = {name: draft_linear(torch.cat([lin.weight.detach() for lin in group]), fmt)
                   for name, group in groups.items()}
    if any(k is None for k in kernels.values()):
        kernels = None
    _PACKED[owner] = (key, kernels)
    return kernels


def drafting_linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)``, except while drafting (no autograd) where ``lin`` is marked a block format
    (``q8_0``, ``q4_1``, ``q4_0``, or ``auto`` with fp32 weights: ``q4_1``, ``resolve_draft_format``):
    then through its drafting kernel in GGUF blocks (``packed``), bias added after. An MLP head's
    weights (hydra's input projections, the ResBlocks of medusa and hydra, mtp's blocks) are read
    from memory once per draft level after the verify forward has evicted them, and Q8_0 holds
    about a quarter of fp32's bytes, Q4_1 an eighth. Unmarked modules (training, evaluation) and
    bf16 ones keep ``lin``. Drafts only: output unchanged."""
    if torch.is_grad_enabled() or resolve_draft_format(lin.weight, draft_format(lin)) not in BLOCK_DRAFTS:
        return lin(x)
    kern = packed(lin, {"w": [lin]})
    if kern is None:
        return lin(x)
    y = kern["w"](x)
    return y if lin.bias is None else y + lin.bias


@dataclass
class HeadConfig:
    """Shape and identity of a set of heads; saved as config.json next to the weights."""

    kind: str  # "medusa" | "hydra" | "mtp" | "eagle" | "eagle3" | "mtp-attn"
    num_heads: int  # K: how many tokens after the backbone's own are drafted
    hidden_size: int  # backbone d_model
    vocab_size: int  # backbone vocabulary
    backbone: str  # backbone name the heads were trained for (checked on load)
    mlp_ratio: float = 2.0  # mtp block MLP width / d_model
    rms_eps: float = 1e-5  # RMSNorm epsilon (mtp)
    # calibration (acceptance tables, trees) lives apart, in draft_config.json: ``heads.policy.DraftPolicy``
    # attention-bearing heads (eagle, mtp-attn): the block's shape, taken from the backbone's config
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    num_layers: int = 1  # eagle: decoder layers in the drafter (1 = EAGLE-1; more run in sequence)
    # eagle: backbone decoder layers (1-based) whose outputs the drafter also reads at level 1,
    # EAGLE-3-style feature fusion; [] = the last layer's state only (EAGLE-1)
    taps: list[int] = field(default_factory=list)
    # eagle3: rows of the drafter's own LM head (its draft vocabulary); 0 = the whole vocabulary
    draft_vocab_size: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("taps", "draft_vocab_size"):  # added later: configs without them stay as they were
            if not d[k]:
                d.pop(k)
        return d


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so a fresh block is the identity (Medusa)."""

    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(drafting_linear(self.linear, x))


class DraftHeads(nn.Module):
    """Base class: binding to the backbone, logits through the shared LM head.

    ``attends``: False for per-position heads (their drafts depend on h_t and the path only).
    True for heads with attention over the request's context (eagle, mtp-attn): those draft
    through ``new_cache`` / ``begin_draft`` / ``tree_step`` with a per-request drafter state
    (``drafter.HeadDrafter.new_state``), and ``train_features`` takes the packed-row ids ``seg``
    so that attention stays inside one sequence.
    """

    attends = False
    regress_features = False  # True: features are trained towards the backbone's next hidden state

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.policy = DraftPolicy()  # calibration (draft_config.json), set when loaded; none when fresh
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None  # not a submodule: never saved
        self._draft_weight: torch.Tensor | None = None  # (V', d) rows of W_lm for the draft vocabulary
        self._draft_kernel = None  # the same rows for decoding (no grad), in the device's fastest layout
        self.register_buffer("draft_vocab", None)  # (V',) long: token ids heads may draft; None = all

    def set_draft_vocab(self, ids: torch.Tensor | None) -> "DraftHeads":
        """Restrict drafting to token ids ``ids`` (e.g. the most frequent reply tokens).

        Drafting then multiplies by V' rows of the LM head instead of all V: on a CPU,
        where a decode step is bound by reading weights, this makes a head step several
        times cheaper. Verification still uses the full vocabulary, so output is unchanged;
        only drafts outside the subset become impossible. Saved with the heads.
        """
        self.draft_vocab = None if ids is None else ids.long().to(self._device())
        self._draft_weight = None
        if self._shared is not None:
            self._refresh_draft_weight()
        return self

    def set_draft_format(self, fmt: str) -> "DraftHeads":
        """Hold the drafting kernels' weights as ``fmt`` (``fast.kernels.DRAFT_FORMATS``):
        ``dense`` (the heads' dtype), ``q8_0`` / ``q4_1`` / ``q4_0`` (GGUF blocks on the integer
        kernel, on CPUs: Q8_0 about half bf16's bytes and a quarter of fp32's to read per draft, the
        4-bit ones half of that) or ``auto`` (``q4_1`` for fp32 heads, ``dense`` for bf16;
        ``kernels.resolve_draft_format``; what ``MethodSpec`` asks by default). Unmarked heads draft
        ``dense``. Marks every submodule, so the attention blocks' packed projections, eagle's
        ``fc`` and the draft-vocabulary LM head are rebuilt in it at their next drafting call.
        Drafts only: verification is unchanged, so output is too; only which tokens are proposed
        may differ (rounding)."""
        if fmt not in DRAFT_FORMATS:
            raise CadenceError(f"unknown draft weight format {fmt!r}; choose one of {', '.join(DRAFT_FORMATS)}")
        for m in self.modules():
            m.__dict__["draft_format"] = fmt
        self._refresh_draft_weight()
        return self

    def _refresh_draft_weight(self) -> None:
        if self.draft_vocab is not None and self._shared is not None:
            w = self._shared[1].weight
            self._draft_weight = w.index_select(0, self.draft_vocab.to(w.device)).contiguous()
            self._draft_kernel = draft_linear(self._draft_weight, draft_format(self))
        else:
            self._draft_weight = self._draft_kernel = None

    @property
    def K(self) -> int:
        return self.cfg.num_heads

    def bind(self, backbone) -> "DraftHeads":
        """Attach the frozen embedding and LM head of ``backbone``; move to its device."""
        self._shared = (backbone.embed, backbone.lm_head)
        self.to(backbone.device)
        self._refresh_draft_weight()
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        assert self._shared is not None, "call bind(backbone) first"
        return self._shared[0](ids).to(self._param_dtype())

    def lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) token ids -> their rows (n, d) of the frozen LM head (e.g. the context vocabulary)."""
        assert self._shared is not None, "call bind(backbone) first"
        w = self._shared[1].weight
        return w.index_select(0, ids.to(w.device))

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) -> float32 logits (..., vocab) through the frozen LM head."""
        assert self._shared is not None, "call bind(backbone) first"
        head = self._shared[1]
        return head(x.to(head.weight.dtype)).float()

    def _first_parameter(self) -> torch.Tensor:
        """``next(self.parameters())``, found through the names that lead to it (looked up once;
        the submodules and the parameter are read again each call, so ``.to()``, a replaced
        parameter or a replaced submodule is seen): walking the module tree cost about 12 us a
        call, several calls per draft level."""
        path = self.__dict__.get("_first_param_path")
        if path is not None:
            mod = self
            for name in path[:-1]:
                mod = mod._modules.get(name)
                if mod is None:
                    break
            else:
                p = mod._parameters.get(path[-1])
                if p is not None:
                    return p
        for prefix, mod in self.named_modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    self.__dict__["_first_param_path"] = (*prefix.split("."), name) if prefix else (name,)
                    return p
        raise StopIteration("heads without parameters")

    def _device(self) -> torch.device:
        return self._first_parameter().device

    def _param_dtype(self) -> torch.dtype:
        return self._first_parameter().dtype

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """State before depth 0 from the backbone hidden state (B, d)."""
        return hidden.to(self._param_dtype())

    def step(self, k: int, state: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head k (1..K): state (B, ...) and the token at depth k-1 (B,) ->
        (logits for depth k (B, vocab), state after depth k-1)."""
        feats, new_state = self.step_features(k, state, token)
        return self.lm_logits(feats), new_state

    def draft_step(self, k: int, state: torch.Tensor, token: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Like ``step`` but over the draft vocabulary: (logits (B, V'), ids (V',) or None
        when V' = V, new state). Column j of the logits is token ``ids[j]``."""
        feats, new_state = self.step_features(k, state, token)
        return self.draft_logits(feats), self.draft_vocab, new_state

    def draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """(..., d) features -> float32 logits over the draft vocabulary (all V when unset)."""
        if self._draft_weight is None:
            return self.lm_logits(feats)
        w = self._draft_weight
        if self._draft_kernel is not None and not torch.is_grad_enabled():
            # prepacked oneDNN on CPU: 8192 x 576 at one row, 0.3 ms against 1.2 ms for ``@``
            return self._draft_kernel(feats.to(w.dtype)).float()
        return (feats.to(w.dtype) @ w.T).float()

    def step_features(self, k: int, state, token):
        raise NotImplementedError

    def train_features(self, hidden: torch.Tensor, ids: torch.Tensor, seg: torch.Tensor | None = None
                       ) -> list[torch.Tensor]:
        """Teacher-forced features before the LM head: list over k=1..K of (B, T-1-k, d).
        seg (B, T): packed-sequence ids (attention heads only; per-position heads ignore it)."""
        raise NotImplementedError

    def train_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits: list over k=1..K of (B, T-1-k, vocab); targets ids[:, k+1:]."""
        return [self.lm_logits(f) for f in self.train_features(hidden, ids)]

    def new_cache(self, start: int = 0):
        """Attention heads: a per-request cache of committed entries from position ``start``."""
        raise NotImplementedError

    def randomize_(self, generator: torch.Generator | None = None, scale: float = 1.0) -> "DraftHeads":
        """Re-initialise every weight randomly (for ``--heads random``: drafts that rarely match)."""
        with torch.no_grad():
            for p in self.parameters():
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=generator) * scale / fan_in ** 0.5)
        return self


def teacher_features(heads: DraftHeads, backbone, ids: torch.Tensor):
    """One backbone forward over ids (1, T) and the heads' teacher-forced features on it
    (``train_features``; tapping the backbone for heads that read taps). Returns (the
    backbone's ``ForwardOut``, features per depth)."""
    taps = tuple(getattr(heads.cfg, "taps", ()) or ())
    out = backbone.forward(ids, need_logits=False, **({"taps": taps} if taps else {}))
    if taps:
        return out, heads.train_features(out.hidden, ids, taps=out.taps)
    return out, heads.train_features(out.hidden, ids)
