"""Verification rules on hand-made logits: greedy, speculative sampling (statistically), typical."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cadence.verify.sampling import SamplingParams, probs
from cadence.trees.tree import compile_tree
from cadence.verify.rules import RULES, Rule, VerifyContext, greedy, speculative, typical

V = 6
P = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])  # backbone distribution at the root
Q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])  # draft distribution, far from P
ALPHA = 1e-4  # p-value below which a test fails (the draws are seeded: results are fixed)


def logits_of(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p)


def first_token(verdict, tokens) -> int:
    """The first token this step emits: the first accepted draft, else the bonus."""
    return int(tokens[verdict.path[1]]) if len(verdict.path) > 1 else verdict.bonus


def draw_first_tokens(tree, p_logits, q, sampling, n, seed, deterministic=None):
    """Run ``speculative`` n times; children drawn i.i.d. from q (or fixed tokens if deterministic)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.zeros(tree.size, V)
    logits[0] = p_logits
    for i in range(1, tree.size):
        logits[i] = torch.randn(V, generator=g)
    counts = np.zeros(V)
    accepted = 0
    kids = list(tree.children[0])
    qmat = None
    if q is not None:
        qmat = torch.zeros(tree.size, V)
        qmat[0] = q
    ctx = VerifyContext(sampling=sampling, q=qmat, generator=g)
    for _ in range(n):
        tokens = torch.zeros(tree.size, dtype=torch.long)
        if deterministic is None:
            tokens[kids] = torch.multinomial(q, len(kids), replacement=True, generator=g)
        else:
            tokens[kids] = torch.tensor(deterministic)
        v = speculative(tree, tokens, logits, ctx)
        counts[first_token(v, tokens)] += 1
        accepted += len(v.path) > 1
    return counts, accepted / n


def assert_distribution(counts, p):
    p = np.asarray(p, dtype=float)
    n = counts.sum()
    zero = p == 0
    assert counts[zero].sum() == 0, "emitted a token outside the sampling support"
    stat, pval = chisquare(counts[~zero], n * p[~zero] / p[~zero].sum())
    assert pval > ALPHA, (counts / n, p, pval)


@pytest.mark.parametrize("paths", [[(0,)], [(0,), (1,), (2,)], [(0,), (1,), (2,), (0, 0), (1, 0)]])
def test_speculative_emits_p_with_q_draws(paths):
    tree = compile_tree(paths)
    sampling = SamplingParams(temperature=1.0)
    counts, acc = draw_first_tokens(tree, logits_of(P), Q, sampling, 6000, seed=len(paths))
    assert_distribution(counts, P)
    if len(paths) == 1:
        # a single draft x ~ q is accepted with probability sum_x min(p(x), q(x))
        assert acc == pytest.approx(float(torch.minimum(P, Q).sum()), abs=0.025)
    else:
        assert acc > float(torch.minimum(P, Q).sum()) + 0.05  # more candidates, more acceptance


def test_speculative_q_equal_p_always_accepts():
    tree = compile_tree([(0,), (1,)])
    counts, acc = draw_first_tokens(tree, logits_of(P), P.clone(), SamplingParams(temperature=1.0), 2000, seed=5)
    assert acc == 1.0
    assert_distribution(counts, P)


@pytest.mark.parametrize("draft", [[1], [1, 3, 5]])
def test_speculative_deterministic_drafts(draft):
    """q = None: drafts are point masses (e.g. a greedy drafter); emission still follows p."""
    paths = [(i,) for i in range(len(draft))]
    tree = compile_tree(paths)
    counts, acc = draw_first_tokens(tree, logits_of(P), None, SamplingParams(temperature=1.0), 5000, seed=11,
                                    deterministic=draft)
    assert_distribution(counts, P)
    assert acc == pytest.approx(float(P[draft].sum()), abs=0.025)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.7, top_k=3),
                                      SamplingParams(temperature=1.3, top_p=0.7),
                                      SamplingParams(temperature=0.5, top_p=0.9, top_k=4)])
def test_speculative_matches_filtered_distribution(sampling):
    """With temperature / top-k / top-p the emitted token follows probs(logits, sampling)."""
    target = probs(logits_of(P), sampling)
    assert (target == 0).any() or sampling.top_k == 0
    tree = compile_tree([(0,), (1,), (2,)])
    counts, _ = draw_first_tokens(tree, logits_of(P), Q, sampling, 5000, seed=7)
    assert_distribution(counts, target)


def test_speculative_deeper_acceptance_uses_child_logits():
    """After the first child is accepted, the next decision uses the logits at that child."""
    tree = compile_tree([(0,), (0, 0)])
    logits = torch.full((3, V), -30.0)
    logits[0, 2] = 0.0  # root: certainly token 2
    logits[1, 4] = 0.0  # after token 2: certainly token 4
    logits[2, 1] = 0.0  # after 4: certainly 1
    tokens = torch.tensor([9, 2, 4])
    q = torch.zeros(3, V)
    q[0, 2] = q[1, 4] = 1.0  # the drafts were certain
    v = speculative(tree, tokens, logits, VerifyContext(SamplingParams(temperature=1.0), q,
                                                        torch.Generator().manual_seed(0)))
    assert v.path == [0, 1, 2] and v.bonus == 1
    tokens = torch.tensor([9, 2, 3])  # a drafter certain of a wrong second token (3)
    q[1] = 0
    q[1, 3] = 1.0  # -> rejected, bonus drawn from the residual max(0, p - q) = token 4
    v = speculative(tree, tokens, logits, VerifyContext(SamplingParams(temperature=1.0), q,
                                                        torch.Generator().manual_seed(0)))
    assert v.path == [0, 1] and v.bonus == 4


def test_greedy_docstring_example():
    # tokens [r, a, b, c] for paths [(0,), (1,), (0,0)]; argmax per node [b, c, _, _]
    tree = compile_tree([(0,), (1,), (0, 0)])
    r, a, b, c = 5, 1, 2, 3
    tokens = torch.tensor([r, a, b, c])
    logits = torch.zeros(4, V)
    logits[0, b] = logits[1, c] = 5.0
    logits[2, 4] = 5.0
    v = greedy(tree, tokens, logits, VerifyContext())
    assert v.path == [0, 2] and v.bonus == 4


def test_greedy_follows_the_argmax_path():
    tree = compile_tree([(0,), (1,), (0, 0), (1, 0), (1, 1)])
    tokens = torch.arange(tree.size)
    logits = torch.zeros(tree.size, V)
    logits[0, 2] = 1  # node 2 (token 2) is right
    logits[2, 5] = 1  # its child node 5 (token 5, path (1,1)) is right
    logits[5, 0] = 1  # bonus 0
    v = greedy(tree, tokens, logits, VerifyContext())
    assert v.path == [0, 2, 5] and v.bonus == 0
    logits[0] = 0
    logits[0, 3] = 1  # no child holds 3
    assert greedy(tree, tokens, logits, VerifyContext()).path == [0]
    # speculative with greedy sampling parameters is the greedy rule
    assert speculative(tree, tokens, logits, VerifyContext()).path == [0]
    assert speculative(tree, tokens, logits, VerifyContext()).bonus == 3


def test_typical_threshold():
    tree = compile_tree([(0,), (1,)])
    p = torch.tensor([0.5, 0.3, 0.12, 0.04, 0.03, 0.01])
    logits = torch.log(p)[None].repeat(3, 1)
    h = float(-(p * p.log()).sum())
    thresh = min(0.09, 0.3 * np.exp(-h))
    ctx = VerifyContext()
    for tok in range(V):
        other = 5  # the rank-1 sibling holds the least likely token
        tokens = torch.tensor([0, tok, other])
        v = typical(tree, tokens, logits, ctx)
        assert float(p[other]) < thresh
        assert v.path == ([0, 1] if float(p[tok]) > thresh else [0])
        assert v.bonus == 0  # greedy bonus: argmax at the last accepted node


def test_rules_registry():
    assert RULES[Rule.AUTO] is speculative and RULES[Rule.GREEDY] is greedy
    t0, t1 = SamplingParams(), SamplingParams(temperature=0.7)
    assert RULES[Rule.TYPICAL] is typical and not Rule.TYPICAL.lossless(t0) and not Rule.TYPICAL.lossless(t1)
    assert Rule.GREEDY.lossless(t0) and not Rule.GREEDY.lossless(t1)
    assert all(r.lossless(t) for r in (Rule.SPECULATIVE, Rule.AUTO) for t in (t0, t1))
    assert str(Rule.TYPICAL) == "typical" and Rule("speculative") is Rule.SPECULATIVE


@pytest.mark.parametrize("copy", [1, 4])
def test_speculative_copy_point_mass_then_draws_from_q_without_it(copy):
    """A context copy at T > 0 (node 1 in ``fixed``: a point mass) then two head draws from q
    with the copy's token taken out (what ``HeadDrafter`` does): emission still follows p,
    and the copy alone is accepted with probability p(copy)."""
    tree = compile_tree([(0,), (1,), (2,)])
    q_wo = Q.clone()
    q_wo[copy] = 0.0
    q_wo /= q_wo.sum()
    g = torch.Generator().manual_seed(copy)
    logits = torch.zeros(tree.size, V)
    logits[0] = logits_of(P)
    qmat = torch.zeros(tree.size, V)
    qmat[0] = q_wo
    ctx = VerifyContext(SamplingParams(temperature=1.0), qmat, g, fixed=frozenset({1}))
    counts, copy_hits, n = np.zeros(V), 0, 6000
    for _ in range(n):
        tokens = torch.zeros(tree.size, dtype=torch.long)
        tokens[1] = copy
        tokens[2:] = torch.multinomial(q_wo, 2, replacement=True, generator=g)
        v = speculative(tree, tokens, logits, ctx)
        counts[first_token(v, tokens)] += 1
        copy_hits += v.path[1:2] == [1]
    assert_distribution(counts, P)
    assert copy_hits / n == pytest.approx(float(P[copy]), abs=0.02)


def test_speculative_copy_worked_example():
    """The docstring's example: p = (.6, .3, .1), copy of token 1, one draw (token 0) from
    q = (1, 0, 0): P(token 0) = .7 * 6/7 = .6 exactly; any other q would be wrong here."""
    p = torch.tensor([0.6, 0.3, 0.1])
    tree = compile_tree([(0,), (1,)])
    logits = torch.log(p)[None].repeat(3, 1)
    tokens = torch.tensor([0, 1, 0])
    q = torch.zeros(3, 3)
    q[0, 0] = 1.0
    g = torch.Generator().manual_seed(0)
    ctx = VerifyContext(SamplingParams(temperature=1.0), q, g, fixed=frozenset({1}))
    counts = np.zeros(3)
    for _ in range(6000):
        counts[first_token(speculative(tree, tokens, logits, ctx), tokens)] += 1
    assert_distribution(counts, p.double().numpy())


def _speculative_with_one_hots(tree, tokens, logits, ctx):
    """``speculative`` as it was written before point masses skipped the one-hot: the reference
    the faster code must match draw for draw."""
    from cadence.verify.rules import Verdict
    from cadence.verify.sampling import sample, uniform

    toks = tokens.tolist()
    node, path = 0, [0]
    while True:
        r = probs(logits[node], ctx.sampling)
        accepted = None
        for c in tree.children[node]:
            x = toks[c]
            point = ctx.q is None or c in ctx.fixed
            q = torch.nn.functional.one_hot(tokens[c], r.shape[-1]).to(r.dtype) if point else ctx.q[node]
            if uniform(ctx.generator) < min(1.0, float(r[x]) / max(float(q[x]), 1e-20)):
                accepted = c
                break
            r = torch.clamp(r - q, min=0)
            total = float(r.sum())
            if total <= 1e-12:
                r = probs(logits[node], ctx.sampling)
                break
            r = r / total
        if accepted is None:
            return Verdict(path, sample(r, ctx.generator))
        node = accepted
        path.append(node)


def test_point_masses_are_rejected_without_a_vocabulary_sized_one_hot(monkeypatch):
    """A rejected point mass (a context or datastore copy) leaves r without its token: the same
    residual, bit for bit, as max(0, r - onehot(x)), without allocating a V-wide one-hot per copy."""
    tree = compile_tree([(0,), (1,), (2,), (0, 0), (0, 1)])
    rng = torch.Generator().manual_seed(5)
    logits = torch.randn(tree.size, 50, generator=rng) * 2
    tokens = torch.tensor([0, 3, 7, 3, 11, 12])
    q = torch.softmax(torch.randn(tree.size, 50, generator=rng), -1)
    for fixed, qs in ((frozenset({1, 4}), q), (frozenset(), None)):
        for seed in range(200):
            new = VerifyContext(SamplingParams(temperature=0.9, top_p=0.95), qs, torch.Generator().manual_seed(seed),
                                fixed=fixed)
            old = VerifyContext(SamplingParams(temperature=0.9, top_p=0.95), qs, torch.Generator().manual_seed(seed),
                                fixed=fixed)
            assert speculative(tree, tokens, logits, new) == _speculative_with_one_hots(tree, tokens, logits, old)

    def no_one_hot(*a, **k):
        raise AssertionError("a one-hot over the vocabulary was built for a point mass")
    monkeypatch.setattr(torch.nn.functional, "one_hot", no_one_hot)
    ctx = VerifyContext(SamplingParams(temperature=0.9), None, torch.Generator().manual_seed(0))
    speculative(tree, tokens, logits, ctx)
