"""Latency-aware tree choice (``--tree auto``) and per-request tree resolution."""

import pytest

from cadence.drafter import HeadDrafter
from cadence.context_copy import CopyConfig
from cadence.engine import GenerationConfig
from cadence.heads import new_heads
from cadence.latency import LatencyCurve
from cadence.sampling import SamplingParams
from cadence.tree_policy import TreePolicy, best_tree
from cadence.trees import chain, expected_tau

TABLE = [[0.7, 0.15, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.0]]  # a[k][i], K = 3


def test_latency_curve_interpolates():
    c = LatencyCurve([1, 4, 8], [0.04, 0.07, 0.07])
    assert c(1) == 0.04 and c(2) == pytest.approx(0.05) and c(6) == pytest.approx(0.07)
    assert c(16) == pytest.approx(0.07) and c.ratio(4) == pytest.approx(1.75)


def test_costly_verification_means_no_speculation():
    steep = LatencyCurve([1, 2, 64], [0.01, 0.03, 1.0])  # one draft costs 2 tokens: tau <= 1.7 cannot pay
    assert best_tree(TABLE, steep, 0.0, 3, 3).paths == []


def test_free_verification_means_a_big_tree():
    flat = LatencyCurve([1, 64], [0.01, 0.01])
    c = best_tree(TABLE, flat, 0.0, 3, 3)
    assert len(c.paths) >= 9 and c.speedup == pytest.approx(expected_tau(c.paths, TABLE))


def test_a_pathological_size_is_skipped():
    """Measured on a Zen 5 EPYC through transformers: 3 nodes cost more than 4 or 8."""
    curve = LatencyCurve([1, 2, 3, 4, 8, 16], [0.041, 0.063, 0.077, 0.059, 0.063, 0.079])
    c = best_tree(TABLE, curve, 0.001, 3, 3)
    assert len(c.paths) + 1 not in (2, 3) and c.speedup > 1.05
    # the chosen tree beats the chain of 2 that a latency-blind choice would take
    chain2 = expected_tau(chain(2), TABLE) / (curve(3) + 0.002)
    assert c.tau / c.seconds > chain2


def test_margin_keeps_the_root_for_tiny_gains():
    curve = LatencyCurve([1, 2, 64], [0.010, 0.0135, 0.5])
    table = [[0.4]]  # tau 1.4 for 1.35x the cost: 3.7% faster, under the 5% margin
    assert best_tree(table, curve, 0.0, 1, 1).paths == []
    assert best_tree(table, curve, 0.0, 1, 1, margin=0.0).paths == [(0,)]


def test_tree_is_resolved_per_request_sampling(llama):
    """A greedy request gets the copy tree (deeper than K), a sampled one the heads' own."""
    heads = new_heads("hydra", llama, 3, random=True)
    heads.cfg.acceptance = TABLE
    heads.cfg.copy_acceptance = TABLE + [[0.8, 0.0, 0.0]] * 3  # past K: the copy only
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    flat = LatencyCurve([1, 64], [0.01, 0.01])
    policy = TreePolicy("auto", heads, drafter, flat)
    greedy, sampled = policy.tree_for(SamplingParams()), policy.tree_for(SamplingParams(temperature=0.7))
    assert greedy.name.endswith("+copy") and greedy.max_depth == 6
    assert not sampled.name.endswith("+copy") and sampled.max_depth <= 3
    assert list(sampled.paths) == best_tree(TABLE, flat, 0.0, 3, 3).paths
    assert GenerationConfig(temperature=0.7).sampling == SamplingParams(temperature=0.7)
