"""Which transformers models the fast decoder can run, and their shape.

Knows: the Llama family as transformers configures it (``llama``, ``mistral`` without a
sliding window, ``qwen2`` with its q/k/v bias, ``qwen3`` with q/k RMSNorm), which config
fields change the computation (q/k norm, rope type, activation, tied head), and
why any other config is refused (``unsupported_reason``).
Does not know: weights (biases are read from the modules themselves, by ``model``), kernels,
caches; it reads the config only.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.errors import CadenceError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# rope types whose cos/sin depend on position only (a table can hold them); "dynamic" and
# "longrope" rescale with the current sequence length, so a fixed table would be wrong.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ArchSpec:
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_type: str


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def unsupported_reason(config) -> str | None:
    """None when the fast decoder computes exactly what transformers does for ``config``,
    else a sentence saying why not."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model type {family!r} is not one of {', '.join(FAMILIES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only SiLU-gated MLPs)"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window or other non-full attention layers"
    if family == "mistral" and getattr(config, "sliding_window", None):
        return f"Mistral sliding window {config.sliding_window} (only sliding_window=None)"
    if family in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
        return "use_sliding_window=True"
    rope = _rope_type(config)
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r} (supported: {', '.join(STATIC_ROPE)})"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


def check(config) -> ArchSpec:
    """The ArchSpec of ``config``, or CadenceError saying why the fast path cannot run it."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise CadenceError(f"the fast backend does not support this model: {reason}; "
                           "use --backend transformers (or auto)")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    family = config.model_type
    return ArchSpec(
        family=family, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=config.intermediate_size, eps=float(config.rms_norm_eps),
        qk_norm=family == "qwen3", rope_type=_rope_type(config))
