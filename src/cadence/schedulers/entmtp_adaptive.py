"""``entmtp-adaptive``: EntMTP's entropy-binned acceptance tables inside the adaptive
scheduler. Each step the backbone's entropy at the root picks a bin of the profile
(``cadence.heads.profiles``); the candidates are that bin's frontier of trees, valued with the
bin's table times this request's learned factors (``adaptive``), with shadow drafts and
observed step costs as there.

Knows: the profile's bin edges and per-bin tables, how to smooth the entropy signal
(``window`` steps of a bias-corrected EMA; 1 = the current root alone), and the
adaptive scheduler's rule. Does not know how trees are drafted or verified: it only
changes which tree is drafted, so it is lossless under every lossless rule.

Why not plain EntMTP (``entmtp``): it runs one static tree per bin, so a request whose
drafts miss in every bin (a translation) keeps paying for them, and its smoothed signal
(W = 8) answers a change of text several tokens late. Here the per-request factors catch
the first, and the signal may follow the current root (this project's choice where the
shipped profiles show acceptance falling by half from the lowest to the highest entropy
bin; measured against ``entmtp`` and ``adaptive`` in ``benchmarks/e2e/categories.py``).

Example: edges [0.5, 1.5]; root entropy 0.2 -> bin 0, whose frontier holds a 9-node tree
the table favours; entropy 2.0 -> bin 2, whose best may be a 1-draft chain or the root.
"""

from __future__ import annotations

from cadence.errors import CadenceError
from cadence.schedulers.adaptive import AdaptiveScheduler, Candidate, frontier
from cadence.schedulers.base import Plan, StepState, register
from cadence.schedulers.entmtp import EntMTPOptions, EntropyEMA, profile_for
from cadence.costs.step_costs import StepCosts


class BinnedAdaptiveScheduler(AdaptiveScheduler):
    """One instance per request; ``bins[i]`` is bin i's candidate trees (root first)."""

    def __init__(self, edges: list[float], bins: list[list[Candidate]], shadow_qs: list[float] | None,
                 window: int = 1, **kw):
        if len(bins) != len(edges) + 1:
            raise ValueError("one candidate list per bin: len(bins) == len(edges) + 1")
        deepest = max((c for b in bins for c in b), key=lambda c: len(c.reach))
        super().__init__([bins[0][0], deepest], shadow_q=shadow_qs[0] if shadow_qs else None, **kw)
        self.edges, self.shadow_qs = list(edges), shadow_qs
        self.bins = [sorted(b, key=lambda c: c.seconds) for b in bins]
        self.ema = EntropyEMA(window)
        self.bin = 0

    def choose(self, state: StepState) -> Plan:
        est = self.ema.update(state.entropy)
        self.bin = sum(est >= e for e in self.edges)
        self.cands = self.bins[self.bin]
        if self.shadow_qs is not None:
            self.shadow_q = self.shadow_qs[self.bin]
        return super().choose(state)


@register("entmtp-adaptive", lossy=False, options=EntMTPOptions,
          help="the adaptive scheduler on EntMTP's entropy-binned tables: each step the root's "
               "entropy picks the bin, the bin's trees are valued with the acceptance seen so far "
               "in the request (--profile TASK; lossless)")
def build(ctx):
    if ctx.options.ent_window < 1:
        raise CadenceError(f"--ent-window must be >= 1, got {ctx.options.ent_window}")
    profile, cache, costs = profile_for(ctx, "entmtp-adaptive"), {}, StepCosts()

    def factory(sampling):
        copying = ctx.drafter.copy is not None and bool(profile.copy_tables)
        depth = ctx.drafter.max_depth(sampling)
        tables = profile.copy_tables if copying else profile.tables
        if (copying, depth) not in cache:
            suffix = "+copy" if copying else ""
            cache[copying, depth] = [frontier(ctx.policy.shape(t), ctx.policy.latency, ctx.policy.draft_s, ctx.heads.K, depth,
                                              suffix=f"{suffix}@b{i}") for i, t in enumerate(tables)]
        shadow_qs = [t[0][0] for t in tables] if sampling.greedy else None
        return BinnedAdaptiveScheduler(profile.edges, cache[copying, depth], shadow_qs,
                                       window=ctx.options.ent_window, margin=ctx.policy.margin, costs=costs)
    return factory
