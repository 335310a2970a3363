"""A generation's settings and what it returns: ``GenerationConfig`` (per request: token
budget, sampling, stop strings, verification rule), ``Stats`` (steps, acceptance, timings,
one ``StepInfo`` per step) and ``Generation`` (tokens, text, statistics).

Knows: the settings' checks (finite, in range, a rule that fits the sampling). Does not
know how decoding runs (``request``, ``engine``).
"""


from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from cadence.errors import CadenceError
from cadence.schedulers.base import StepInfo
from cadence.verify.rules import Rule
from cadence.verify.sampling import SamplingParams


@dataclass
class GenerationConfig:
    """Per-request decoding settings; CLI flags derive from these fields."""

    max_new_tokens: int = field(default=256, metadata={"help": "hard cap on generated tokens"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (T > 0), in (0, 1]"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (T > 0), 0 = off"})
    seed: int = field(default=0, metadata={"help": "RNG seed for sampling and acceptance tests"})
    stop: tuple[str, ...] = field(default=(), metadata={
        "help": "stop strings: generation ends when the text contains one (the text is cut before it)"})
    rule: Rule = field(default=Rule.AUTO, metadata={
        "help": "verification rule: auto = greedy at T=0, speculative sampling otherwise (both "
                "lossless); greedy needs T=0; typical is lossy"})
    drift: float = field(default=1.0, metadata={
        "help": "--rule relaxed (LOSSY): budget DELTA, in nats, on the cumulative log-probability gap "
                "log p(argmax) - log p(draft) along an accepted chain; 0 = greedy exactly"})
    top_m: int = field(default=3, metadata={
        "help": "--rule relaxed (LOSSY): a draft is accepted only if it is within the backbone's top-M "
                "at its parent (and the chain stays within --drift)"})

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise CadenceError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        # every number finite and in range now, not mid-step (where VerifyContext checks them too)
        if isinstance(self.drift, bool) or not isinstance(self.drift, (int, float)) \
                or not (math.isfinite(self.drift) and self.drift >= 0):
            raise CadenceError(f"drift must be a finite number >= 0, got {self.drift!r}")
        if isinstance(self.top_m, bool) or not isinstance(self.top_m, int) or self.top_m < 1:
            raise CadenceError(f"top_m must be an integer >= 1, got {self.top_m!r}")
        self.rule = Rule(self.rule)
        self.rule.check(self.sampling)  # also validates temperature (finite) / top_p / top_k

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


@dataclass
class Stats:
    """Statistics of one generation."""

    new_tokens: int = 0  # tokens returned (EOS included; nothing past a stop string)
    steps: int = 0  # commits; each commits 1 + accepted drafts
    forwards: int = 0  # backbone forwards after prefill
    accepted_at_depth: list[int] = field(default_factory=list)  # steps whose accepted length >= d, d=1..
    prefill_s: float = 0.0  # prompt forward
    wall_s: float = 0.0  # whole request, prefill included
    step_log: list[StepInfo] = field(default_factory=list)  # one record per step with a forward
    unverified_steps: int = 0  # steps committed without verification (lossy schedulers, opt-in)

    @property
    def tau(self) -> float:
        """Tokens committed per step (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Share of steps that accepted at least d drafts, d = 1.. (bench's acceptance per depth).
        Example: 10 steps, accepted_at_depth [6, 3] -> [0.6, 0.3]."""
        return [round(n / self.steps, 4) for n in self.accepted_at_depth] if self.steps else []

    def summary(self) -> dict:
        planned = Counter(s.planned for s in self.step_log)
        run = Counter(f"{s.tree} ({s.nodes} nodes)" for s in self.step_log)
        nodes = sum(s.nodes for s in self.step_log) / len(self.step_log) if self.step_log else 1.0
        return {"new_tokens": self.new_tokens, "steps": self.steps, "forwards": self.forwards,
                "tau": round(self.tau, 4), "accepted_at_depth": self.accepted_at_depth,
                "acceptance_by_depth": self.acceptance_by_depth,
                "prefill_s": round(self.prefill_s, 4), "wall_s": round(self.wall_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 3),
                "tree": planned.most_common(1)[0][0] if planned else "root",
                "mean_nodes": round(nodes, 3), "trees_run": dict(run.most_common()),
                "unverified_steps": self.unverified_steps}


@dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded)
    text: str  # decoded, special tokens skipped, cut at a stop string
    stats: Stats
