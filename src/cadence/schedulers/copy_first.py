"""Copies first: where the root has a copy, a chain of copies alone may beat drafting with heads.

A head drafter already ranks a copy (``draft.context_copy``, ``draft.datastore``) first among a
node's candidates, but it still runs its heads every level, and their candidates widen the
verify. Where verify is steep or drafting costs a good part of a step (a GGUF model's integer
kernels, bf16 without AMX), a step whose root has a copy is often faster as the copy chain alone
(``copy_chain``: as deep as this request's copy acceptance and the verify curve pay), with no head
call. Where verify is nearly flat and the heads are good (bf16 on AMX), the heads' tree may
still win. Which one does is measured, not assumed: per request, among steps whose root had a
copy, this scheduler keeps the decayed tokens and seconds of each choice ("arm"), takes the
arm of more tokens per second, and tries the other one every ``explore_every`` such steps.
Steps whose root has no copy are the inner scheduler's (adaptive, dynamic, ...) as before.

Seconds are the step's wall time; in a batched step (``StepInfo.rows`` > 1) the wall time is
shared, so the step is valued by this machine's verify latency for its node count (plus the
heads' drafting cost on the heads arm) instead.

Worked example, explore_every 8, decay 0.9: the first copy step runs the copies (2 tokens in
6 ms), the second the heads (2.4 tokens in 9 ms): rates 333 against 267 tokens/s, so the
copies run until the 8th copy step, which tries the heads again.

Lossless: the arm is chosen before drafting and verification is unchanged. Knows: the step
results and the latency curve. Does not know how copies are found or how heads draft.
"""

from __future__ import annotations

from typing import Callable

from cadence.schedulers.base import Plan, StepInfo, StepState
from cadence.schedulers.copy_chain import CopyChainScheduler

HEADS, COPIES = 0, 1


class CopyFirst:
    """``inner``'s plans, except that a step whose root has a copy may run a copy chain alone."""

    wants_copy = True  # the request looks up the root's copy for ``StepState.copy``

    def __init__(self, inner, chain: CopyChainScheduler, latency: Callable[[int], float], draft_s: float = 0.0,
                 explore_every: int = 8, decay: float = 0.9):
        if explore_every < 2:
            raise ValueError(f"explore_every must be at least 2, got {explore_every}")
        self.inner = inner  # the scheduler of every other step (and of the heads arm)
        self.chain = chain  # how deep a copy chain goes (its own copy acceptance)
        self.latency = latency  # seconds to verify n nodes: values batched steps
        self.draft_s = draft_s  # seconds of one level of head drafting: added to batched heads steps
        self.explore_every = explore_every  # every this many copy steps, the arm not in the lead runs
        self.decay = decay  # weight an arm's earlier steps keep at each of its new ones
        self.tokens = [0.0, 0.0]  # decayed tokens committed per arm
        self.seconds = [0.0, 0.0]  # decayed seconds per arm
        self.runs = [0, 0]  # steps per arm
        self.copy_steps = 0  # steps whose root had a copy
        self._arm: int | None = None  # the arm of the step in flight (None: no copy at its root)

    def rate(self, arm: int) -> float:
        """Decayed tokens per second of ``arm`` so far (0 before it ran)."""
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0

    def pick(self) -> int:
        """The arm for a copy step: each once (copies first), then the faster one, the slower
        one every ``explore_every``-th copy step."""
        if not self.runs[COPIES]:
            return COPIES
        if not self.runs[HEADS]:
            return HEADS
        lead = COPIES if self.rate(COPIES) >= self.rate(HEADS) else HEADS
        return 1 - lead if self.copy_steps % self.explore_every == 0 else lead

    def choose(self, state: StepState) -> Plan:
        if state.copy is None:
            self._arm = None
            return self.inner.choose(state)
        self.copy_steps += 1
        self._arm = self.pick()
        if self._arm == HEADS:
            return self.inner.choose(state)
        return Plan(self.chain.choose(state).tree, copies_only=True)

    def observe(self, info: StepInfo) -> None:
        arm, self._arm = self._arm, None
        if arm is None or arm == HEADS:
            self.inner.observe(info)
        else:
            self.chain.observe(info)
        if arm is None:
            return
        seconds = info.seconds
        if info.rows > 1:  # shared wall time: this machine's verify cost for the nodes instead
            seconds = self.latency(info.nodes) + (self.draft_s * info.depth if arm == HEADS else 0.0)
        self.runs[arm] += 1
        self.tokens[arm] = self.tokens[arm] * self.decay + info.accepted + 1
        self.seconds[arm] = self.seconds[arm] * self.decay + seconds

    def __getattr__(self, name):  # the inner scheduler's own attributes (reports, tests)
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
