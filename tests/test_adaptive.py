"""The adaptive scheduler's decisions, on a synthetic table and latency curve (no model)."""

import pytest

from cadence.latency import LatencyCurve
from cadence.schedulers.adaptive import AdaptiveScheduler, frontier
from cadence.schedulers.base import StepInfo

# Verification nearly free, acceptance high: the calibrated favourite is a big tree.
TABLE = [[0.8, 0.1], [0.8, 0.1], [0.8, 0.1]]
LATENCY = LatencyCurve(sizes=[1, 2, 4, 8, 16], seconds=[0.010, 0.0102, 0.0104, 0.0108, 0.0116])


# As on a CPU in fp32: one more node costs a quarter of a step.
DEAR = LatencyCurve(sizes=[1, 2, 4, 8, 16], seconds=[0.010, 0.0125, 0.013, 0.014, 0.017])


def scheduler(latency=LATENCY) -> AdaptiveScheduler:
    return AdaptiveScheduler(frontier(TABLE, latency, draft_s=0.0001, num_heads=3, max_depth=3))


def run(s: AdaptiveScheduler, accepted: int):
    plan = s.choose(None)
    s.observe(StepInfo(tree=plan.tree.name, nodes=plan.tree.size, accepted=min(accepted, plan.tree.max_depth),
                       seconds=0.01, depth=plan.tree.max_depth))
    return plan.tree


@pytest.mark.parametrize("latency", [LATENCY, DEAR])
def test_a_request_starts_with_the_cheapest_tree(latency):
    s = scheduler(latency)
    favourite = max(s.cands, key=lambda c: s.value(c, [1.0] * 3)).tree
    cheapest = s.cands[1].tree  # cands[0] is the root alone
    assert favourite.size > cheapest.size  # the table's favourite is a bigger tree...
    assert run(s, 0) is cheapest  # ...but the first step risks the cheapest one


def test_one_accepted_draft_opens_the_frontier():
    s = scheduler()
    run(s, 1)  # the cheapest tree, accepted
    assert s.choose(None).tree.size > 2


def test_a_request_whose_drafts_all_miss_falls_back_and_backs_off():
    s = scheduler(DEAR)
    sizes = [run(s, 0).size for _ in range(60)]
    assert max(sizes) == s.cands[1].tree.size  # never more than the cheapest tree before a hit
    assert sizes[5:9] == [1, 1, 1, 1]  # plain decoding after a few misses
    tries = [i for i, n in enumerate(sizes) if n > 1]
    gaps = [b - a for a, b in zip(tries[1:], tries[2:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # tries get rarer while they fail
