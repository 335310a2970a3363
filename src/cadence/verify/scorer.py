"""The scorer: one backbone forward over a drafted tree, on top of the committed cache.

Knows: how a compiled tree becomes positions and a tree mask for the backbone.
Does not know: how the tree was drafted, or which nodes will be accepted.
The engine, calibration and the latency probe all verify through ``score``, so the
forward that is timed is the forward that decodes.
"""

from __future__ import annotations

import torch

from cadence.trees.tree import CompiledTree


def score(backbone, cache, past: int, tree: CompiledTree, tokens: torch.Tensor, taps: tuple[int, ...] = ()):
    """Run the tree's N+1 nodes through the backbone; return its ``ForwardOut``
    (hidden (1, N+1, d), logits (1, N+1, V), and with ``taps`` the tapped layers' states
    (1, N+1, len(taps), d) for drafters that read them) and leave N+1 new entries in ``cache``.

    tokens: (N+1,) long, node 0 the root. A chain needs neither a mask nor positions
    (plain causal attention over contiguous positions); any other tree gets
    positions ``past + depth`` and its ancestor mask. Example: paths [(0,), (1,)] after
    10 committed tokens -> positions [10, 11, 11], node 2 does not see node 1.
    """
    kw = {"taps": taps} if taps else {}
    if tree.is_chain:
        return backbone.forward(tokens[None], cache, **kw)
    positions = (torch.tensor(tree.depths, device=tokens.device) + past)[None]
    return backbone.forward(tokens[None], cache, positions, tree.mask, **kw)
