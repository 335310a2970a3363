"""Whole-step tokens/s, speculating or not, per batch size: what the narrowing policy's
price list leaves out.

Knows: the wall time and committed tokens of each batched step (drafting, the verify
forward, verification, commit and every row's bookkeeping; admissions left out), kept
per batch size as a moving average for steps that speculated and steps that ran the
root alone, and which of the two to run next: the faster, with a few steps of the other
every ``explore_every`` steps so a change (other prompts, other acceptance) is seen.
Does not know: trees, acceptance tables or why a step cost what it did.

Why: ``narrow.Narrowing`` prices a step from this machine's (batch, nodes) forward latency
and the drafter's per-level time, but on a CPU a speculative batched step also pays each
row's drafting and bookkeeping one row after another; on the AMX Xeon 8 speculating rows
took about 2.5x a plain step where the price list said 1.1x, and speculation served
0.79x plain decoding's tokens/s. Measuring whole steps catches what any model leaves out.
Outputs never depend on it: it only chooses between lossless caps.

Example, explore_every 32, probe 3: at batch 8 the first 3 steps speculate, the next 3 run
the root alone; if those ran 290 tok/s against 230, the next 32 run the root alone, then 3
speculate again (a moving average keeps both rates current), and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATE, ROOT = "speculate", "root"


@dataclass
class _Batch:
    rates: dict = field(default_factory=dict)  # mode -> moving average of tokens/s
    seen: dict = field(default_factory=lambda: {SPECULATE: 0, ROOT: 0})  # mode -> steps recorded
    since: int = 0  # steps since the other mode was last probed
    probing: int = 0  # steps of the other mode still to run


class StepRates:
    """Chooses, per batch size, between speculating and the root alone by measured tokens/s."""

    def __init__(self, explore_every: int = 32, probe: int = 3, alpha: float = 0.3):
        self.explore_every, self.probe, self.alpha = explore_every, probe, alpha
        self._batches: dict[int, _Batch] = {}

    def mode(self, batch: int) -> str:
        """What the next step at ``batch`` rows should do."""
        st = self._batches.setdefault(batch, _Batch())
        for m in (SPECULATE, ROOT):  # measure both first
            if st.seen[m] < self.probe:
                return m
        best = max(st.rates, key=st.rates.get)
        other = ROOT if best == SPECULATE else SPECULATE
        if st.probing:
            return other
        return best

    def record(self, batch: int, mode: str, tokens: int, seconds: float) -> None:
        """One step at ``batch`` rows that ran ``mode`` committed ``tokens`` in ``seconds``."""
        if seconds <= 0 or batch < 1:
            return
        st = self._batches.setdefault(batch, _Batch())
        rate = tokens / seconds
        old = st.rates.get(mode)
        st.rates[mode] = rate if old is None else old + self.alpha * (rate - old)
        st.seen[mode] += 1
        if min(st.seen.values()) < self.probe:
            return
        best = max(st.rates, key=st.rates.get)
        if mode != best and st.probing:
            st.probing -= 1
            return
        st.since += 1
        if st.since >= self.explore_every:
            st.since, st.probing = 0, self.probe

    def rates(self) -> dict[int, dict[str, float]]:
        """{batch: {mode: tokens/s}} measured so far (reports, tests)."""
        return {b: dict(st.rates) for b, st in sorted(self._batches.items())}
