"""Draft heads: medusa (parallel), hydra (sequential), mtp (chained modules), and the
attention-bearing eagle (one decoder layer) and mtp-attn (chained transformer blocks); save/load."""

from cadence.heads.base import DraftHeads, HeadConfig
from cadence.heads.eagle import EagleHeads
from cadence.heads.hydra import HydraHeads
from cadence.heads.io import load_heads, new_heads, save_heads
from cadence.heads.medusa import MedusaHeads
from cadence.heads.mtp import MTPHeads
from cadence.heads.mtp_attn import MTPAttnHeads

__all__ = ["DraftHeads", "EagleHeads", "HeadConfig", "HydraHeads", "MedusaHeads", "MTPAttnHeads", "MTPHeads",
           "load_heads", "new_heads", "save_heads"]
