"""The adaptive scheduler's decisions, on a synthetic table and latency curve (no model)."""

import pytest

from cadence.costs.latency import LatencyCurve
from cadence.schedulers.adaptive import AdaptiveScheduler, frontier
from cadence.schedulers.base import StepInfo
from cadence.costs.step_costs import StepCosts

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


def shadowing(latency=DEAR, costs=None, **kw) -> AdaptiveScheduler:
    return AdaptiveScheduler(frontier(TABLE, latency, draft_s=0.0001, num_heads=3, max_depth=3),
                             shadow_q=TABLE[0][0], costs=costs, **kw)


def run_shadowed(s: AdaptiveScheduler, hit: bool, accepted: int = 0, seconds: float = 0.01):
    """One step: a shadow step reports ``hit``; a real step accepts ``accepted`` drafts."""
    plan = s.choose(None)
    shadows = (hit,) if plan.shadow else ()
    s.observe(StepInfo(tree=plan.tree.name, nodes=plan.tree.size, accepted=min(accepted, plan.tree.max_depth),
                       seconds=seconds, depth=plan.tree.max_depth, shadows=shadows))
    return plan


def test_greedy_requests_learn_from_shadows_before_paying_for_a_verify():
    s = shadowing(max_shadow_every=16)
    plans = [run_shadowed(s, hit=False) for _ in range(64)]
    assert all(p.tree.size == 1 for p in plans)  # drafts that never hit never cost a verify
    shadows = [i for i, p in enumerate(plans) if p.shadow]
    gaps = [b - a for a, b in zip(shadows, shadows[1:])]
    assert gaps[:12] == [1] * 7 + [2, 4, 8, 16, 16]  # 8 in a row, then spaced out while they miss


def test_by_default_every_root_step_carries_a_shadow_judged_in_batches():
    s = shadowing()
    plans = [run_shadowed(s, hit=False) for _ in range(32)]
    assert all(p.tree.size == 1 and p.shadow for p in plans)
    assert plans[0].shadow_batch == 1  # the request's first shadow at once: a hit opens step 2
    assert {p.shadow_batch for p in plans[1:]} == {4}


def test_a_shadow_hit_opens_only_the_cheapest_tree_and_a_real_hit_the_frontier():
    s = shadowing(LATENCY)
    assert run_shadowed(s, hit=True).shadow  # the first step is a shadow
    plan = run_shadowed(s, hit=False, accepted=1)
    assert plan.tree is s.cands[1].tree  # cheapest tree: a real try
    assert s.choose(None).tree.size > 2  # its draft was accepted: the whole frontier


def test_deeper_levels_without_evidence_follow_the_level_above():
    s = scheduler(DEAR)
    for _ in range(4):
        run(s, 0)
    f = s.factors()
    assert f[0] < 0.5 and f[1] == pytest.approx(f[0]) and f[2] == pytest.approx(f[0])


def test_observed_step_costs_correct_the_curve():
    """The curve says a 2-node step costs 1.05 root steps; they really cost 1.5: a request
    whose drafts are accepted half as often as calibrated then decodes plainly."""
    cheap = LatencyCurve(sizes=[1, 2, 4, 8, 16], seconds=[0.010, 0.0105, 0.011, 0.012, 0.014])

    def decide(costs):
        s = shadowing(cheap, costs)
        s.hits[0], s.expected[0], s.opened, s.proven = 4.0, 8.0, True, True  # f_1 = 0.5
        return s.choose(None).tree.size

    assert decide(StepCosts()) > 1  # as predicted: speculating pays
    costs = StepCosts(min_steps=4)
    for _ in range(4):
        costs.record(False, 0.010, 0.010)
        costs.record(True, 0.0105 * 1.5, 0.0105)
    assert costs.factor(True) / costs.factor(False) == pytest.approx(1.5)
    assert decide(costs) == 1


def test_step_costs_borrow_the_other_kind_until_observed_and_clip_outliers():
    c = StepCosts(min_steps=2, clip=3.0)
    assert c.factor(True) == c.factor(False) == 1.0
    c.record(False, 0.02, 0.01)
    c.record(False, 0.02, 0.01)
    assert c.factor(True) == c.factor(False) == pytest.approx(2.0)  # relative cost as predicted
    c.record(True, 10.0, 0.01)  # a step the OS stalled counts as 3x, not 1000x
    c.record(True, 0.01, 0.01)
    assert c.factor(True) == pytest.approx(2.0)


def test_entmtp_adaptive_refuses_bad_settings_clearly():
    from cadence.errors import CadenceError
    from cadence.methods import Method, MethodSpec, make_engine
    from tiny import tiny_backbone

    bb = tiny_backbone("llama")
    with pytest.raises(CadenceError, match="--ent-window must be >= 1"):
        make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random", scheduler="entmtp-adaptive",
                                       options={"ent_window": 0}))
    with pytest.raises(CadenceError, match="no 'general' acceptance profile"):
        make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random", scheduler="entmtp-adaptive"))
