"""Drafters fill a compiled tree with candidate tokens; they never verify.

``HeadDrafter`` walks the tree depth by depth: at depth d it runs head d+1 once,
batched over every node that has children, on the state of that node's path.
At T = 0 children are the head's top-ranked tokens; at T > 0 they are independent
draws from the head's distribution q (the same sampling parameters as the backbone),
and q is returned so that verification can be lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cadence.sampling import SamplingParams, probs
from cadence.trees import CompiledTree


@dataclass
class Draft:
    tokens: torch.Tensor  # (N+1,) long: node 0 is the root token
    q: torch.Tensor | None  # (N+1, V) distribution each node's children were drawn from (T > 0)


class Drafter(Protocol):
    num_heads: int  # deepest tree this drafter can fill

    def draft(self, tree: CompiledTree, root: int, hidden: torch.Tensor, context: list[int],
              sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """hidden: (d,) backbone state that produced ``root``; context: committed ids."""
        ...


class HeadDrafter:
    """Drafts with trained (or random) MTP heads."""

    def __init__(self, heads):
        self.heads = heads
        self.num_heads = heads.K
        self.vocab_size = heads.cfg.vocab_size

    @torch.inference_mode()
    def draft(self, tree, root, hidden, context, sampling, generator) -> Draft:
        n = tree.size
        device = hidden.device
        tokens = torch.empty(n, dtype=torch.long, device=device)
        tokens[0] = root
        q = None
        state_of: dict[int, torch.Tensor] = {-1: self.heads.init_state(hidden[None])[0]}
        by_depth: dict[int, list[int]] = {}
        for node in range(n):
            if tree.children[node]:
                by_depth.setdefault(tree.depths[node], []).append(node)
        for depth in sorted(by_depth):
            nodes = by_depth[depth]
            prev = torch.stack([state_of[tree.parents[i]] for i in nodes])
            logits, vocab_ids, states = self.heads.draft_step(depth + 1, prev, tokens[nodes])
            for j, node in enumerate(nodes):
                state_of[node] = states[j]
            widths = [tree.width(i) for i in nodes]
            if sampling.greedy:
                cand = logits.topk(max(widths), dim=-1).indices  # (P, max width)
            else:
                dist = probs(logits, sampling)
                if q is None:
                    q = torch.zeros(n, self.vocab_size, device=device)
                if vocab_ids is None:
                    q[nodes] = dist
                else:  # q lives on the full vocabulary, zero outside the draft subset
                    q[nodes] = torch.zeros(len(nodes), self.vocab_size, device=device).index_copy_(
                        1, vocab_ids, dist)
                cand = torch.multinomial(dist, max(widths), replacement=True, generator=generator)
            if vocab_ids is not None:
                cand = vocab_ids[cand]
            for j, node in enumerate(nodes):
                for child in tree.children[node]:
                    tokens[child] = cand[j, tree.ranks[child]]
        return Draft(tokens=tokens, q=q)
