"""Chain-aware relaxed verification (lossy, opt-in): DELTA = 0 is greedy exactly (rule level on
random trees with tied logits, engine level with random heads and the oracle drafter); a
top-2 draft within the budget is accepted and the chain stops when the cumulative gap
exceeds DELTA; the top-M bound; labelled lossy everywhere."""

import argparse
import dataclasses
import random

import pytest
import torch
from tiny import OracleDrafter

from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads
from cadence.verify.sampling import SamplingParams, probs
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree
from cadence.verify.rules import RULES, Rule, VerifyContext, greedy, relaxed

K = 3
N = 32
PROMPT = "Write a poem about the sea."


def random_tree(rng: random.Random, size: int):
    """A random prefix-closed tree of ``size`` draft nodes (ranks 0.. among siblings)."""
    paths: list[tuple] = []
    kids: dict[tuple, int] = {(): 0}
    for _ in range(size):
        parent = rng.choice(list(kids))
        child = parent + (kids[parent],)
        kids[parent] += 1
        kids[child] = 0
        paths.append(child)
    return compile_tree(paths)


def random_case(seed: int, vocab: int = 8):
    """Tree, tokens and logits with frequent argmax matches and frequent logit ties."""
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randint(1, 12))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (tree.size, vocab), generator=g).float()  # small ints: many ties
    if seed % 2:
        logits = logits + 0.1 * torch.randn(tree.size, vocab, generator=g)
    tokens = torch.randint(0, vocab, (tree.size,), generator=g)
    best = logits.argmax(-1)
    for n in range(1, tree.size):  # make roughly half the drafts the argmax at their parent
        if rng.random() < 0.5:
            tokens[n] = best[tree.parents[n]]
    return tree, tokens, logits


def ctx(drift: float, top_m: int = 3, sampling: SamplingParams | None = None) -> VerifyContext:
    return VerifyContext(sampling or SamplingParams(), None, torch.Generator().manual_seed(0), drift=drift, top_m=top_m)


# ------------------------------------------------------------------ rule level

@pytest.mark.parametrize("top_m", [1, 3, 8])
def test_delta_zero_equals_greedy_on_random_trees(top_m):
    for seed in range(400):
        tree, tokens, logits = random_case(seed)
        want = greedy(tree, tokens, logits, VerifyContext())
        got = relaxed(tree, tokens, logits, ctx(0.0, top_m))
        assert (got.path, got.bonus) == (want.path, want.bonus), seed


def test_top_m_one_equals_greedy_whatever_delta():
    for seed in range(200):
        tree, tokens, logits = random_case(seed)
        want = greedy(tree, tokens, logits, VerifyContext())
        got = relaxed(tree, tokens, logits, ctx(100.0, 1))
        assert (got.path, got.bonus) == (want.path, want.bonus), seed


def test_tied_non_argmax_refused_at_delta_zero():
    """A token whose logit ties the argmax's is not the argmax: DELTA = 0 refuses it, as greedy does."""
    tree = compile_tree([(0,)])
    logits = torch.zeros(2, 4)
    logits[0, 1] = logits[0, 2] = 3.0  # argmax() picks 1; token 2 ties it
    tokens = torch.tensor([0, 2])
    assert relaxed(tree, tokens, logits, ctx(0.0)).path == [0]
    assert relaxed(tree, tokens, logits, ctx(0.1)).path == [0, 1]  # a free tie once DELTA > 0


def test_accepted_paths_respect_top_m_and_budget():
    """Property: every accepted draft is in the top-M at its parent and the path's gap sum <= DELTA;
    the path only stops where no child is acceptable; a larger DELTA never accepts less on a chain."""
    for seed in range(300):
        tree, tokens, logits = random_case(seed)
        for delta in (0.0, 0.5, 1.0, 2.5):
            for m in (1, 2, 3):
                v = relaxed(tree, tokens, logits, ctx(delta, m))
                spent = 0.0
                for parent, child in zip(v.path, v.path[1:]):
                    row, x = logits[parent], int(tokens[child])
                    rank = int((row > row[x]).sum())  # strictly better tokens
                    assert rank < m
                    spent += float(row.max() - row[x])
                    assert x == int(row.argmax()) or spent <= delta + 1e-9
                last = v.path[-1]
                row = logits[last]
                assert v.bonus == int(row.argmax())
                for c in tree.children[last]:  # nothing further was acceptable
                    x = int(tokens[c])
                    gap = float(row.max() - row[x])
                    inside = int((row > row[x]).sum()) < m  # top-M, ties included
                    assert not (x == int(row.argmax()) or (delta > 0 and m > 1 and inside and spent + gap <= delta))


def chain_case():
    """The docstring's worked example: chain [r, a, b, c] with gaps 0.4, 0, 0.5."""
    V = 10
    r, a, b, c, x, y, z = 0, 1, 2, 3, 4, 5, 6
    tree = compile_tree([(0,), (0, 0), (0, 0, 0)])
    logits = torch.zeros(4, V)
    logits[0, x], logits[0, a] = 2.0, 1.6  # a: rank 2 at the root, gap 0.4
    logits[1, b] = 1.0  # b: the argmax after a
    logits[2, y], logits[2, z], logits[2, c] = 3.0, 2.9, 2.5  # c: rank 3, gap 0.5
    logits[3, 7] = 1.0  # bonus after c
    return tree, torch.tensor([r, a, b, c]), logits, (x, y)


def test_worked_example_top2_within_budget_then_chain_stops():
    tree, tokens, logits, (x, y) = chain_case()
    v = relaxed(tree, tokens, logits, ctx(1.0, 3))
    assert v.path == [0, 1, 2, 3] and v.bonus == 7  # D = 0.4, 0.4, 0.9 <= 1.0
    v = relaxed(tree, tokens, logits, ctx(0.8, 3))
    assert v.path == [0, 1, 2] and v.bonus == y  # D_3 = 0.9 > 0.8: the chain stops before c
    v = relaxed(tree, tokens, logits, ctx(0.3, 3))
    assert v.path == [0] and v.bonus == x  # the top-2 draft alone (0.4) is over budget
    v = relaxed(tree, tokens, logits, ctx(0.0, 3))
    assert v.path == [0] and v.bonus == x  # greedy
    v = relaxed(tree, tokens, logits, ctx(1.0, 2))
    assert v.path == [0, 1, 2] and v.bonus == y  # c is rank 3: outside the top-2


def test_budget_is_cumulative_not_per_token():
    """Two top-2 drafts of gap 0.6 each: each is within DELTA = 1 alone, the pair is not."""
    tree = compile_tree([(0,), (0, 0)])
    logits = torch.zeros(3, 5)
    logits[0, 1], logits[0, 2] = 1.0, 0.4
    logits[1, 3], logits[1, 4] = 1.0, 0.4
    tokens = torch.tensor([0, 2, 4])
    assert relaxed(tree, tokens, logits, ctx(1.0)).path == [0, 1]
    assert relaxed(tree, tokens, logits, ctx(1.2)).path == [0, 1, 2]


def test_top_m_bound():
    """A draft ranked 4th with a tiny gap: refused with M = 3 whatever DELTA, accepted with M = 4."""
    tree = compile_tree([(0,)])
    logits = torch.zeros(2, 8)
    logits[0, :4] = torch.tensor([5.0, 4.99, 4.98, 4.97])
    tokens = torch.tensor([7, 3])
    assert relaxed(tree, tokens, logits, ctx(100.0, 3)).path == [0]
    assert relaxed(tree, tokens, logits, ctx(100.0, 4)).path == [0, 1]


def test_smallest_gap_sibling_wins():
    """Siblings [rank-2 token, argmax]: the argmax child is taken (no budget spent), then a
    second top-2 step still fits; ties in gap go to rank order."""
    tree = compile_tree([(0,), (1,), (1, 0)])
    logits = torch.zeros(4, 6)
    logits[0, 1], logits[0, 2] = 2.0, 1.5  # argmax 1, token 2 gap 0.5
    logits[2, 3], logits[2, 4] = 2.0, 1.2  # after the argmax child: token 4 gap 0.8
    tokens = torch.tensor([0, 2, 1, 4])  # node 1 = token 2 (rank 0), node 2 = token 1 (rank 1)
    v = relaxed(tree, tokens, logits, ctx(1.0))
    assert v.path == [0, 2, 3]  # 0 + 0.8 <= 1; taking node 1 would have left no room
    tree = compile_tree([(0,), (1,)])
    logits = torch.zeros(3, 6)
    logits[0, 1], logits[0, 2], logits[0, 3] = 2.0, 1.5, 1.5
    assert relaxed(tree, torch.tensor([0, 3, 2]), logits, ctx(1.0)).path == [0, 1]
    logits[0, 3] = 2.0  # token 3 ties the argmax (1): the argmax child still wins
    assert relaxed(tree, torch.tensor([0, 3, 1]), logits, ctx(1.0)).path == [0, 2]


def test_sampling_bonus_and_support():
    """T > 0: the bonus is a sample from the filtered distribution at the last accepted node; a
    draft in the top-M but outside the top-p support is refused."""
    tree = compile_tree([(0,)])
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(p)[None].repeat(2, 1)
    tokens = torch.tensor([0, 2])  # rank 3, gap log(0.4/0.2) = 0.69
    s = SamplingParams(temperature=1.0, top_p=0.6)
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(200):
        v = relaxed(tree, tokens, logits, VerifyContext(s, None, g, drift=1.0, top_m=3))
        assert v.path == [0]  # top-p 0.6 keeps tokens {0, 1} only
        seen.add(v.bonus)
    assert seen == {0, 1} and all(probs(logits[0], s)[t] > 0 for t in seen)
    s = SamplingParams(temperature=1.0)
    v = relaxed(tree, tokens, logits, VerifyContext(s, None, g, drift=1.0, top_m=3))
    assert v.path == [0, 1]


def test_invalid_parameters_refused():
    with pytest.raises(CadenceError, match="top-m"):
        VerifyContext(top_m=0)
    with pytest.raises(CadenceError, match="drift"):
        VerifyContext(drift=-0.5)
    with pytest.raises(CadenceError, match="drift"):
        VerifyContext(drift=float("nan"))


# ------------------------------------------------------------------ labelled lossy

def test_labelled_lossy():
    assert RULES[Rule.RELAXED] is relaxed and Rule("relaxed") is Rule.RELAXED
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8)):
        assert not Rule.RELAXED.lossless(sampling)
        Rule.RELAXED.check(sampling)  # accepted at any temperature
    GenerationConfig(rule=Rule.RELAXED, temperature=0.7, drift=0.5, top_m=2)
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(GenerationConfig)}
    assert "LOSSY" in helps["drift"] and "LOSSY" in helps["top_m"]
    assert "lossy" in relaxed.__doc__.lower()
    from cadence.cliargs import add_fields
    p = argparse.ArgumentParser()
    add_fields(p, GenerationConfig)
    a = p.parse_args(["--rule", "relaxed", "--drift", "2", "--top-m", "4"])
    assert (a.rule, a.drift, a.top_m) == (Rule.RELAXED, 2.0, 4)


# ------------------------------------------------------------------ engine level

def reference(bb, n=N):
    ids = bb.encode_prompt(PROMPT, chat=True)
    return ids, Engine(bb).generate(ids, GenerationConfig(max_new_tokens=n))


def spec_engine(bb, drafter, tree):
    return Engine(bb, drafter, StaticScheduler.from_preset(tree, K))


@pytest.mark.parametrize("kind", ["hydra", "medusa"])
def test_engine_delta_zero_random_heads_byte_identical(llama, kind):
    ids, ref = reference(llama)
    heads = new_heads(kind, llama, K, random=True, seed=1)
    for tree in ("chain", "tree-16"):
        g = spec_engine(llama, HeadDrafter(heads), tree).generate(
            ids, GenerationConfig(max_new_tokens=N, rule=Rule.RELAXED, drift=0.0, top_m=3))
        assert g.tokens == ref.tokens and g.text == ref.text, (kind, tree)


@pytest.mark.parametrize("right_rank", [0, 1])
def test_engine_delta_zero_oracle_byte_identical(qwen2, right_rank):
    ids, ref = reference(qwen2)
    oracle = OracleDrafter(ref.tokens, len(ids), K, qwen2.vocab_size, right_rank=right_rank)
    for tree in ("tree-8", "tree-32"):
        g = spec_engine(qwen2, oracle, tree).generate(
            ids, GenerationConfig(max_new_tokens=N, rule=Rule.RELAXED, drift=0.0, top_m=5))
        assert g.tokens == ref.tokens and g.text == ref.text, (right_rank, tree)
        assert g.stats.tau >= 2.0  # the oracle's right tokens are still accepted


def test_engine_positive_delta_runs_and_accepts_at_least_as_much(llama):
    """Random heads on a random model: DELTA > 0 accepts sub-argmax drafts (tau grows), every
    committed token count is right, and the tiny model's output may differ (lossy)."""
    ids, _ = reference(llama)
    heads = new_heads("hydra", llama, K, random=True, seed=1)
    taus = []
    for delta in (0.0, 4.0):
        g = spec_engine(llama, HeadDrafter(heads), "tree-16").generate(
            ids, GenerationConfig(max_new_tokens=N, rule=Rule.RELAXED, drift=delta, top_m=8))
        assert len(g.tokens) == N
        taus.append(g.stats.tau)
    assert taus[1] > taus[0]
    g = spec_engine(llama, HeadDrafter(heads), "tree-8").generate(
        ids, GenerationConfig(max_new_tokens=N, rule=Rule.RELAXED, drift=1.0, temperature=0.8, seed=3))
    assert len(g.tokens) == N or g.tokens[-1] in llama.eos_token_ids
