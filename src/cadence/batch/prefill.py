"""Chunked prefill: a prompt enters the batch cache a few hundred tokens per engine step.

Knows: how to run one request's prompt through ``FastBackbone.forward_rows`` in pieces,
each piece written into the request's slot of the ``BatchKVCache`` after the pieces
before it (a causal mask over the row's earlier entries and the piece itself), and how
to hand the finished prompt to ``engine.Request.prefilled`` exactly as a one-forward
prefill does (the last position's state, every position's drafter state).
Does not know: which slot a row has (the batch engine moves it; ``Prefill.slot`` follows),
how many tokens a step may spend (the engine's ``prefill_chunk`` budget), scheduling.

Why: a 2,000-token prompt admitted in one forward stalls every running row for the
whole prefill (hundreds of ms on a CPU); in chunks of ``prefill_chunk`` tokens each step
costs at most one chunk more than a decode step, so running rows keep their
inter-token latency and the new request's first token comes a few steps later.

Worked example, prompt of 5 tokens, chunk 2: step 1 writes entries 0..1 (mask: query j
sees keys 0..j), step 2 entries 2..3 (query j sees keys 0..2+j), step 3 entry 4 (sees
0..4) and the request is prefilled: its root token is picked from entry 4's state.
"""

from __future__ import annotations

import time

import torch

from cadence.decode.request import Request, drafter_states


class Prefill:
    """One request's prompt on its way into the batch cache (``slot``), ``done`` tokens in."""

    def __init__(self, req: Request, slot: int):
        self.req, self.slot = req, slot
        self.done = 0  # prompt tokens already in the cache
        self.t0 = time.perf_counter()  # the request's wall time counts from its first chunk
        self._states: list[torch.Tensor] = []  # (n_i, d') drafter states of each chunk so far
        self._last: torch.Tensor | None = None  # (d,) state of the newest prompt position

    @property
    def remaining(self) -> int:
        return len(self.req.prompt_ids) - self.done

    def advance(self, backbone, cache, budget: int, taps: tuple[int, ...] = ()) -> int:
        """Write the next ``min(budget, remaining)`` prompt tokens into row ``slot``; the
        number written. ``budget`` <= 0 means the whole rest of the prompt."""
        n = self.remaining if budget <= 0 else min(budget, self.remaining)
        ids = torch.tensor([self.req.prompt_ids[self.done:self.done + n]], device=backbone.device)  # (1, n)
        if self.done == 0:  # the first chunk: an ordinary causal prefill from position 0
            out = backbone.forward_rows(ids, cache, self.slot, [0], need_logits=False, taps=taps)
        else:
            out = backbone.forward_rows(ids, cache, self.slot, [self.done], None, causal_mask(self.done, n),
                                        need_logits=False, taps=taps)
        self._states.append(drafter_states(out)[0])
        self._last = out.hidden[0, -1]
        self.done += n
        return n

    def finish(self) -> None:
        """Hand the whole prompt to the request (root token picked, drafter state committed)."""
        states = self._states[0] if len(self._states) == 1 else torch.cat(self._states, dim=0)  # (P, d')
        self.req.prefilled(self._last, self.t0, states)
        self._states = []


def causal_mask(past: int, n: int) -> torch.Tensor:
    """(1, 1, n, past + n) bool: new token j (at position past + j) sees keys 0..past + j.

    Example, past 2, n 2: [[1, 1, 1, 0], [1, 1, 1, 1]].
    """
    keys = torch.arange(past + n)
    return (keys[None, :] <= past + torch.arange(n)[:, None])[None, None]
