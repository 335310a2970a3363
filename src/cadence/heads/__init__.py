"""Draft heads: medusa (parallel), hydra (sequential), mtp (chained modules); save/load."""

from cadence.heads.base import DraftHeads, HeadConfig
from cadence.heads.hydra import HydraHeads
from cadence.heads.io import load_heads, new_heads, save_heads
from cadence.heads.medusa import MedusaHeads
from cadence.heads.mtp import MTPHeads

__all__ = ["DraftHeads", "HeadConfig", "HydraHeads", "MedusaHeads", "MTPHeads",
           "load_heads", "new_heads", "save_heads"]
