"""What steps really cost on this engine, against what the latency curve predicted.

Knows: the predicted and the observed seconds of every step an engine's requests
took alone (not sharing a batch forward), kept apart for root-alone steps and
speculative ones. Does not know trees, acceptance or which tree to pick.

The verify latency curve (``cadence.costs.latency``) is probed in isolation: a scored tree
on a fixed context. A real step also drafts, verifies, compacts the cache and commits,
and the machine may have changed since the probe (a curve cached while another job
ran). Only the *relative* cost of speculating matters to a scheduler, and it is biased
one way here: in a traced request on the Zen 5 EPYC a 2-node step cost 1.29 root steps where the curve plus the
drafting estimate said 1.15, so requests whose drafts mostly miss kept paying for
tries. ``factor(spec)`` is the running mean of observed / predicted for that kind of
step; schedulers multiply a candidate's predicted seconds by it. Until a kind has
``min_steps`` observations it borrows the other kind's factor (relative cost as
predicted), or 1.

Shared by every request of one engine (``adaptive``'s factory owns one); a single
thread drives an engine, so there is no locking.

Example: root steps predicted 17.4 ms ran 16.3 (factor 0.94), 2-node steps predicted
20.1 ran 21.0 (1.04): a 2-node candidate now costs 21.0 / 16.3 = 1.29 root steps.
"""

from __future__ import annotations

import math


class StepCosts:
    """Running observed / predicted seconds ratios for root and speculative steps."""

    def __init__(self, window: int = 32, min_steps: int = 8, clip: float = 3.0):
        self.window = window  # mean over the first steps, then an exponential average of this span
        self.min_steps = min_steps  # observations before a kind's own factor is used
        self.clip = clip  # a ratio counts at most this far from 1 (a step stalled by the OS)
        self.mean = {False: 1.0, True: 1.0}  # kind (speculative?) -> running mean of observed / predicted
        self.count = {False: 0, True: 0}

    def record(self, spec: bool, observed: float, predicted: float) -> None:
        """One step of that kind took ``observed`` seconds where ``predicted`` were expected."""
        if not (predicted > 0 and observed > 0 and math.isfinite(observed)):
            return
        ratio = min(max(observed / predicted, 1.0 / self.clip), self.clip)
        self.count[spec] += 1
        w = 1.0 / min(self.count[spec], self.window)
        self.mean[spec] += w * (ratio - self.mean[spec])

    def factor(self, spec: bool) -> float:
        """Multiplier for predicted seconds of a step of that kind."""
        if self.count[spec] >= self.min_steps:
            return self.mean[spec]
        other = not spec
        return self.mean[other] if self.count[other] >= self.min_steps else 1.0
