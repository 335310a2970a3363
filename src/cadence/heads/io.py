"""Create, save and load heads: ``heads.safetensors`` + ``config.json`` (+ ``draft_config.json``,
the calibration: ``cadence.heads.tables``) in one directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cadence.errors import CadenceError
from cadence.heads.base import DraftHeads, HeadConfig
from cadence.heads.eagle import EagleHeads
from cadence.heads.eagle3 import default_taps, Eagle3Heads
from cadence.heads.hydra import HydraHeads
from cadence.heads.medusa import MedusaHeads
from cadence.heads.mtp import MTPHeads
from cadence.heads.mtp_attn import MTPAttnHeads
from cadence.heads.tables import load_policy, save_policy
from cadence.system.atomic import atomic_write, atomic_write_json

KINDS = ("medusa", "hydra", "mtp", "eagle", "eagle3", "mtp-attn")
ATTENTION_KINDS = ("eagle", "eagle3", "mtp-attn")  # heads with their own KV cache over the request's context


def head_class(kind: str) -> type[DraftHeads]:
    table = {"medusa": MedusaHeads, "hydra": HydraHeads, "mtp": MTPHeads, "eagle": EagleHeads,
             "eagle3": Eagle3Heads, "mtp-attn": MTPAttnHeads}
    if kind not in table:
        raise CadenceError(f"unknown head type {kind!r}; choose one of {', '.join(KINDS)}")
    return table[kind]


def attention_shape(backbone) -> dict:
    """The attention block shape of ``backbone``'s own layers (HeadConfig fields): eagle and
    mtp-attn blocks copy it, so an exported EAGLE layer is a layer of the backbone's kind."""
    c = backbone.config
    heads = int(c.num_attention_heads)
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    return {"num_attention_heads": heads,
            "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            "intermediate_size": int(getattr(c, "intermediate_size", None) or 4 * c.hidden_size),
            "rope_theta": float(theta), "rms_eps": float(getattr(c, "rms_norm_eps", 1e-5))}


def new_heads(kind: str, backbone, num_heads: int = 3, random: bool = False, seed: int = 0,
              **extra) -> DraftHeads:
    """Fresh heads for ``backbone``; ``random=True`` gives random weights (drafts rarely accepted)."""
    if num_heads < 1:
        raise CadenceError("need at least one head")
    if kind in ATTENTION_KINDS:
        extra = {**attention_shape(backbone), **extra}
    if kind == "eagle3" and not extra.get("taps"):  # low / mid / high, as vLLM and SGLang default
        extra["taps"] = default_taps(int(backbone.config.num_hidden_layers))
    cfg = HeadConfig(kind=kind, num_heads=num_heads, hidden_size=backbone.hidden_size,
                     vocab_size=backbone.vocab_size, backbone=backbone.name, **extra)
    heads = head_class(kind)(cfg)
    if random:
        heads.randomize_(torch.Generator().manual_seed(seed))
    elif hasattr(heads, "init_from_backbone"):  # eagle3: starts from the backbone's own head
        heads.init_from_backbone(backbone)
    return heads.bind(backbone)


def save_heads(heads: DraftHeads, directory: str | Path, dtype: torch.dtype | None = None,
               extra_config: dict | None = None) -> Path:
    """Write heads.safetensors and config.json atomically; optionally cast (e.g. bf16)."""
    directory = Path(directory)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in heads.state_dict().items()}
    atomic_write(directory / "heads.safetensors", lambda tmp: save_file(state, str(tmp)))
    atomic_write_json(directory / "config.json", {**heads.cfg.to_dict(), **(extra_config or {})})
    policy = getattr(heads, "policy", None)
    if policy is not None and policy.calibrated:
        save_policy(directory, policy)
    return directory


HEADS_DTYPES = ("auto", "float32", "bfloat16")


def decode_dtype(backbone, choice: str = "auto") -> torch.dtype:
    """The dtype heads draft in. ``auto``: bfloat16 when the backbone computes in bfloat16
    (the heads' weights are then read at half the bytes: drafting is bound by reading them),
    else float32. Drafts only propose tokens, so this never changes the output, only what
    is proposed; ``cadence calibrate`` measures acceptance in the same dtype."""
    if choice not in HEADS_DTYPES:
        raise CadenceError(f"unknown heads dtype {choice!r}; choose one of {', '.join(HEADS_DTYPES)}")
    if choice == "auto":
        return torch.bfloat16 if getattr(backbone, "dtype", torch.float32) == torch.bfloat16 else torch.float32
    return getattr(torch, choice)


def load_heads(directory: str | Path, backbone, dtype: torch.dtype | None = None) -> DraftHeads:
    """Load heads saved by ``save_heads`` and bind them to ``backbone`` (checked to match)."""
    directory = Path(directory)
    cfg_path, w_path = directory / "config.json", directory / "heads.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise CadenceError(f"{directory} is not a heads directory (needs config.json and heads.safetensors)")
    try:
        raw = json.loads(cfg_path.read_text())
        fields = {k: raw[k] for k in HeadConfig.__dataclass_fields__ if k in raw}
        cfg = HeadConfig(**fields)
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise CadenceError(f"{cfg_path} is malformed: {exc}") from exc
    policy = load_policy(directory, raw)
    if (cfg.hidden_size, cfg.vocab_size) != (backbone.hidden_size, backbone.vocab_size):
        raise CadenceError(
            f"heads in {directory} were made for {cfg.backbone} (hidden {cfg.hidden_size}, vocab "
            f"{cfg.vocab_size}); this backbone {backbone.name} has hidden {backbone.hidden_size}, "
            f"vocab {backbone.vocab_size}")
    if cfg.backbone != backbone.name:
        raise CadenceError(f"heads in {directory} were trained for {cfg.backbone!r}, not {backbone.name!r}")
    try:
        heads = head_class(cfg.kind)(cfg)
    except (TypeError, ValueError) as exc:  # e.g. "num_heads": "two"
        raise CadenceError(f"{cfg_path} is malformed: {exc}") from exc
    except CadenceError as exc:  # e.g. attention heads without their block shape
        raise CadenceError(f"{cfg_path}: {exc}") from exc
    try:
        state = load_file(str(w_path))
        if "draft_vocab" in state:
            heads.set_draft_vocab(state["draft_vocab"])
        heads.load_state_dict({k: (v if k == "draft_vocab" else v.float()) for k, v in state.items()})
    except Exception as exc:
        raise CadenceError(f"{w_path} is corrupt or does not match its config: {exc}") from exc
    if dtype is not None:
        heads = heads.to(dtype)
    heads.source_dir = directory  # where calibration files beside the weights live (profiles.json, ...)
    heads.policy = policy
    return heads.bind(backbone).eval()
