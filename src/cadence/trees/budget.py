"""The node budget: how many nodes one step may verify. One ceiling for every tree (presets,
``auto-N``, dynamic trees, batched rows) and one place that checks a budget against it.

Knows: the ceiling (``MAX_NODES``, root included), which the batch cache keeps as room past the
model's positions, and the largest tree chosen from measured latency (``AUTO_NODES``). Does not know which tree pays (``cadence.costs.tree_choice``) or how a
budget is chosen (``--max-nodes``: ``cadence.schedulers.dynamic.DynamicOptions``; narrowing:
``cadence.batch.narrow``).
"""

from __future__ import annotations

from cadence.errors import CadenceError

MAX_NODES = 128  # most nodes (root included) one step verifies; the batch cache keeps this much room
AUTO_NODES = 64  # largest tree (root included) --tree auto / auto-N and the adaptive schedulers consider:
#                  the largest size of the verify-latency curve (``cadence.costs.latency.SIZES``)


def clamp_nodes(nodes: int) -> int:
    """``nodes`` (root included) cut to the ceiling; 0 = no budget of its own: the ceiling.
    Example: 0 -> 128, 200 -> 128, 17 -> 17."""
    return min(nodes or MAX_NODES, MAX_NODES)


def check_nodes(nodes: int, what: str, drafts: bool = False) -> int:
    """``nodes`` (root included) if 1 <= nodes <= MAX_NODES, else a CadenceError naming ``what``
    in the unit the user wrote (``drafts``: draft nodes, the root excluded)."""
    shown, top = (nodes - 1, MAX_NODES - 1) if drafts else (nodes, MAX_NODES)
    if not 1 + drafts <= nodes <= MAX_NODES:
        raise CadenceError(f"{what} must be between {1 if drafts else 1} and {top}, got {shown}")
    return nodes
