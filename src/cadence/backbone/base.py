"""The frozen causal LM as cadence sees it: one forward over new positions against a KV
cache, with an optional tree mask, returning last-layer hidden states and logits.

Knows: the transformers model it wraps, its tokenizer, dtypes and devices, tree masks as
additive attention masks, and tapped layers. Does not know: where models come from
(``cadence.backbone.load``), heads, trees beyond their mask, verification, or scheduling.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cadence.backbone.kv_cache import HFCache, check_supported
from cadence.errors import CadenceError

def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Map 'float32' | 'bfloat16' | 'float16' | None (auto) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name is None or name == "auto":  # on CPU, load_backbone may still pick bf16 (``lossless_bf16``)
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in table:
        raise CadenceError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]

def resolve_device(name: str | None) -> torch.device:
    """'auto' picks cuda when available, else cpu."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

def cache_kwarg(decoder: nn.Module) -> str:
    """The name under which this transformers decoder takes a KV cache: ``cache`` in
    transformers 5.x, ``past_key_values`` in 4.x (where a ``cache=`` keyword would be
    swallowed by ``**kwargs`` and nothing cached)."""
    params = inspect.signature(decoder.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise CadenceError(f"{type(decoder).__name__}.forward takes no KV cache (neither `cache` "
                       "nor `past_key_values`); this transformers model is not supported")


def _additive_mask(tree_mask: torch.Tensor, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(n, n) bool tree mask -> (1, 1, n, past + n) additive mask: 0 where allowed (the
    whole cache, and the tree's own ancestors), dtype-min elsewhere."""
    n = tree_mask.shape[-1]
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device)
    allowed[:, past:] = tree_mask.to(device)
    out = torch.zeros(n, past + n, dtype=dtype, device=device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[None, None]


def check_taps(taps, num_layers: int) -> None:
    """Taps name decoder layers 1 .. num_layers - 1 (the last layer's output is ``hidden``,
    after the final norm), strictly increasing."""
    if any(not isinstance(j, int) or j < 1 or j >= num_layers for j in taps) or list(taps) != sorted(set(taps)):
        raise CadenceError(f"taps {list(taps)} must be increasing decoder layers between 1 and {num_layers - 1}")


@dataclass
class ForwardOut:
    """Result of one backbone forward over n new positions."""

    hidden: torch.Tensor  # (batch, n, d_model) last layer, after the final norm
    # (batch, n, vocab) float32; bfloat16 from a bf16 fast backbone's ``forward`` on CPU (exact head
    # outputs: widen with .float() before arithmetic; argmax, probs and entropy take either)
    logits: torch.Tensor
    # (batch, n, len(taps), d_model): the residual stream after decoder layer j (1-based) for each
    # requested tap j, unnormed; None when no taps were asked for (EAGLE-3-style drafter inputs)
    taps: torch.Tensor | None = None


class Backbone(nn.Module):
    """A frozen causal LM reached through a small interface.

    ``forward(ids, cache, positions, mask)`` runs the decoder layers and returns the
    final hidden states; ``logits(hidden)`` applies the LM head. Heads use
    ``embed`` and ``lm_head`` (shared, frozen).
    """

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "model"):
        super().__init__()
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.gguf_path: Path | None = None  # the GGUF file the weights were dequantized from, if any (``--quant gguf``)
        self.dtype_reason = ""  # why ``--dtype auto`` took this dtype (``load.auto_precision``), "" when not auto
        cfg = model.config
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise CadenceError(f"{name} has no causal LM head")
        check_supported(cfg)
        self._cache_kwarg = cache_kwarg(model.model)

    @property
    def chains_only(self) -> bool:
        """True when a branching tree costs far more to verify than a chain of as many nodes
        (the fast path's row-consistent bf16 without ``listed_attention`` attends per
        root-to-leaf path): trees are then grown as chains and the latency probe measures chains."""
        return False

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.model.config.eos_token_id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}

    def new_cache(self) -> HFCache:
        """An empty KV cache for this backbone (see ``cadence.backbone.kv_cache``)."""
        return HFCache(self.model.config)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HFCache | None = None,
                position_ids: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                need_logits: bool = True, attention_mask: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOut:
        """One forward of new tokens on top of ``cache`` (mutated in place).

        input_ids: (batch, n). position_ids: (batch, n) absolute positions, or None for
        contiguous positions after the cache. tree_mask: None (causal) or (n, n) bool,
        True where new token i may attend new token j; every new token sees the whole cache.
        attention_mask: (batch, n) 1/0 padding mask for batched full-sequence forwards
        without a cache (training, distillation); not combined with ``tree_mask``.
        taps: decoder layers (1-based) whose outputs come back in ``ForwardOut.taps``
        (``check_taps``); e.g. (3, 15) on a 30-layer model: after the 3rd and the 15th layer.
        """
        check_taps(taps, self.config.num_hidden_layers)
        past = cache.length() if cache is not None else 0
        if tree_mask is not None:
            attention_mask = _additive_mask(tree_mask, past, self.dtype, self.device)
        kwargs = {self._cache_kwarg: cache.hf} if cache is not None else {}
        out = self.model.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=cache is not None, output_hidden_states=bool(taps), **kwargs)
        hidden = out.last_hidden_state
        logits = self.logits(hidden) if need_logits else None
        tapped = torch.stack([out.hidden_states[j] for j in taps], dim=2) if taps else None
        return ForwardOut(hidden=hidden, logits=logits, taps=tapped)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on hidden states (..., d_model) -> float32 logits (..., vocab)."""
        return self.lm_head(hidden).float()

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """Tokenize a prompt, through the chat template when ``chat`` and one exists."""
        if not prompt or not prompt.strip():
            raise CadenceError("empty prompt")
        tok = self.tokenizer
        if tok is None:
            raise CadenceError("this backbone has no tokenizer")
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return tok(prompt, add_special_tokens=True)["input_ids"]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)
