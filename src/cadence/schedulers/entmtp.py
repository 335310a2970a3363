"""EntMTP: switch among trees calibrated per entropy bin, following a running estimate of
the backbone's entropy at the committed roots (docs/methods.md section 5).

Knows: the profile's bin edges and per-bin acceptance tables (``cadence.heads.profiles``), this
machine's verify latency, a bias-corrected EMA of the root entropy (W = 8, reset per
request), and hysteresis. Does not know how trees are drafted or verified: it only picks
which tree is drafted, so it is lossless under every lossless rule.

Per bin, the tree is the one of highest expected tokens/s under that bin's table
(``tree_choice.best_tree``; the root alone when nothing pays). The estimate moves to a
new bin only when it is past the bin's edge by ``hysteresis`` (in nats), so noise inside
a bin, or at its edge, does not flip the tree every step.

Example: edges [0.5, 1.5], hysteresis 0.1, estimate in bin 1; it drifts to 1.55: stays in
bin 1 (not past 1.6); then 1.7: bin 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cadence.errors import CadenceError
from cadence.heads.profiles import Profile, load_profiles
from cadence.schedulers.base import Plan, StepInfo, StepState, register
from cadence.costs.tree_choice import best_tree
from cadence.trees.tree import CompiledTree, compile_tree


@dataclass(frozen=True)
class EntMTPOptions:
    """Settings of ``entmtp`` and ``entmtp-adaptive``; CLI flags and method-name options derive from them."""

    profile: str = field(default="general", metadata={
        "help": "entmtp: acceptance profile (general | humaneval | gsm8k | sharegpt | writing)"})
    ent_window: int = field(default=1, metadata={
        "help": "entmtp-adaptive: steps of root entropy averaged to pick the bin (1 = the current root)"})



class EntropyEMA:
    """Bias-corrected exponential moving average: m_t = beta m_{t-1} + (1 - beta) x_t,
    estimate m_t / (1 - beta^t), beta = 1 - 1/W. Example, W = 2 (beta 0.5): x = 4 -> m 2.0,
    estimate 2.0 / 0.5 = 4.0; then x = 0 -> m 1.0, estimate 1.0 / 0.75 = 1.333."""

    def __init__(self, window: int = 8):
        self.beta = 1.0 - 1.0 / window
        self.m, self.t = 0.0, 0

    def update(self, x: float) -> float:
        self.t += 1
        self.m = self.beta * self.m + (1.0 - self.beta) * x
        return self.m / (1.0 - self.beta ** self.t)


class EntMTPScheduler:
    """One instance per request; ``trees[i]`` is bin i's tree."""

    def __init__(self, edges: list[float], trees: list[CompiledTree], window: int = 8, hysteresis: float = 0.1):
        if len(trees) != len(edges) + 1:
            raise ValueError("one tree per bin: len(trees) == len(edges) + 1")
        self.edges, self.trees, self.hysteresis = list(edges), trees, hysteresis
        self.ema = EntropyEMA(window)
        self.bin: int | None = None
        self.switches = 0

    def _bin_of(self, h: float) -> int:
        return sum(h >= e for e in self.edges)

    def update(self, h: float) -> int:
        """Feed one root entropy; the bin whose tree runs next."""
        est = self.ema.update(h)
        new = self._bin_of(est)
        if self.bin is None:
            self.bin = new
        elif new != self.bin:
            lo = self.edges[self.bin - 1] if self.bin > 0 else float("-inf")
            hi = self.edges[self.bin] if self.bin < len(self.edges) else float("inf")
            if est < lo - self.hysteresis or est >= hi + self.hysteresis:
                self.bin = new
                self.switches += 1
        return self.bin

    def choose(self, state: StepState) -> Plan:
        return Plan(self.trees[self.update(state.entropy)])

    def observe(self, info: StepInfo) -> None:
        pass


def bin_trees(profile: Profile, copying: bool, latency, draft_s: float, num_heads: int, max_depth: int,
              margin: float, suffix: str = "", shape=lambda table: table) -> list[CompiledTree]:
    """The best tree of each bin under this machine's latency (``shape``: the policy's
    table filter, e.g. chains only)."""
    tables = profile.copy_tables if copying and profile.copy_tables else profile.tables
    out = []
    for i, table in enumerate(tables):
        choice = best_tree(shape(table), latency, draft_s, num_heads, max_depth, margin)
        out.append(compile_tree(choice.paths, name=f"entmtp-b{i}-{len(choice.paths)}{suffix}"))
    return out


def profile_for(ctx, scheduler: str) -> Profile:
    """The heads' ``--profile`` acceptance profile, or a clear error (no profiles.json, no
    such task, no latency curve: heads without acceptance tables)."""
    heads_dir = getattr(ctx.heads, "source_dir", None)
    profiles = load_profiles(heads_dir)
    name = ctx.options.profile
    if name not in profiles:
        raise CadenceError(f"no {name!r} acceptance profile for these heads ({heads_dir or 'random heads'}): "
                           f"run `cadence calibrate --heads DIR` (profiles there: {', '.join(profiles) or 'none'})")
    if ctx.policy.latency is None:
        raise CadenceError(f"{scheduler} needs this machine's verify latency (heads without acceptance tables?)")
    return profiles[name]


@register("entmtp", lossy=False, options=EntMTPOptions,
          help="entropy-guided switching among trees calibrated per entropy bin (--profile TASK; "
               "needs profiles.json from `cadence calibrate`; lossless)")
def build_entmtp(ctx):
    profile, cache = profile_for(ctx, "entmtp"), {}

    def factory(sampling):
        copying = ctx.drafter.copy is not None
        depth = ctx.drafter.max_depth(sampling)
        if (copying, depth) not in cache:
            cache[copying, depth] = bin_trees(profile, copying, ctx.policy.latency, ctx.policy.draft_s,
                                              ctx.heads.K, depth, ctx.policy.margin, "+copy" if copying else "",
                                              shape=ctx.policy.shape)
        return EntMTPScheduler(profile.edges, cache[copying, depth])
    return factory
