"""Speculative sampling through the whole engine is lossless at T > 0.

On a tiny vocabulary (8 tokens) the exact distribution of the first three generated
tokens is computed from the model (every 2-token continuation in one batched forward).
Samples from plain sampling (Engine without drafter) and from speculative sampling
(random heads, an oracle-like drafter whose q is the backbone's own distribution, a mixed
q, deterministic drafts; chains and branching trees; temperature / top-k / top-p) are
compared with it by chi-square tests: the joint of the three tokens (cells with expected
count < 5 pooled) and the marginals of tokens 2 and 3 (token 1 comes from the prefill,
tokens 2 and 3 from verification). The engine is seeded, so each test is deterministic.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import BackboneDrafter, OracleDrafter, tiny_backbone

from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.heads import new_heads
from cadence.verify.sampling import SamplingParams, probs
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree

V = 8
PROMPT = [1, 5, 2, 7, 3]
N_NEW = 3
ALPHA = 1e-3
SAMPLES = 700


@pytest.fixture(scope="module")
def small():
    return {arch: tiny_backbone(arch, vocab=V, tokenizer=False, seed=1) for arch in ("llama", "qwen2")}


def exact_joint(bb, sampling: SamplingParams, prompt=PROMPT) -> np.ndarray:
    """P(x1, x2, x3 | prompt) under plain sampling, shape (V, V, V)."""
    seqs = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    logits = bb.forward(seqs).logits  # (V*V, len+2, V)
    L = len(prompt)
    p1 = probs(logits[0, L - 1], sampling).double()  # (V,)
    p2 = probs(logits[::V, L], sampling).double()  # (V, V): row a = p(x2 | x1 = a)
    p3 = probs(logits[:, L + 1], sampling).double().reshape(V, V, V)  # p(x3 | a, b)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(float(joint.sum()) - 1) < 1e-6
    return joint.numpy()


def sample_joint(engine, cfg: GenerationConfig, n: int, prompt=PROMPT):
    counts = np.zeros((V, V, V))
    taus = []
    for seed in range(n):
        g = engine.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, temperature=cfg.temperature,
                                                     top_p=cfg.top_p, top_k=cfg.top_k, seed=seed))
        assert len(g.tokens) == N_NEW
        counts[tuple(g.tokens)] += 1
        taus.append(g.stats.tau)
    return counts, float(np.mean(taus))


def gof(counts: np.ndarray, expected_p: np.ndarray, what: str) -> None:
    counts, expected_p = counts.ravel(), expected_p.ravel()
    n = counts.sum()
    zero = expected_p <= 1e-12
    assert counts[zero].sum() == 0, f"{what}: a token sequence outside the sampling support was emitted"
    exp = n * expected_p[~zero]
    obs = counts[~zero]
    big = exp >= 5
    exp_b = np.append(exp[big], exp[~big].sum())
    obs_b = np.append(obs[big], obs[~big].sum())
    if exp_b[-1] == 0:
        exp_b, obs_b = exp_b[:-1], obs_b[:-1]
    exp_b = exp_b * obs_b.sum() / exp_b.sum()  # exact renormalisation (float rounding)
    stat, pval = chisquare(obs_b, exp_b)
    assert pval > ALPHA, f"{what}: chi2 {stat:.1f} over {len(obs_b)} bins, p = {pval:.2e}"


def check_lossless(engine, bb, cfg, n=SAMPLES, prompt=PROMPT):
    joint = exact_joint(bb, cfg.sampling, prompt)
    counts, tau = sample_joint(engine, cfg, n, prompt)
    gof(counts, joint, "joint(x1,x2,x3)")
    gof(counts.sum(axis=(0, 2)), joint.sum(axis=(0, 2)), "marginal x2")
    gof(counts.sum(axis=(0, 1)), joint.sum(axis=(0, 1)), "marginal x3")
    gof(counts.sum(axis=2), joint.sum(axis=2), "joint(x1,x2)")
    return tau


def test_plain_sampling_matches_exact(small):
    bb = small["llama"]
    cfg = GenerationConfig(temperature=1.0)
    tau = check_lossless(Engine(bb), bb, cfg, n=400)
    assert tau == 1.0


CASES = {
    # name: (arch, drafter kind, tree, temperature, top_p, top_k)
    "medusa-tree8-T1": ("llama", "medusa", "tree-8", 1.0, 1.0, 0),
    "hydra-chain-topk": ("llama", "hydra", "chain", 0.8, 1.0, 4),
    "mtp-tree16-topp-qwen2": ("qwen2", "mtp", "tree-16", 1.2, 0.85, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_random_heads_sampling_is_lossless(small, case):
    arch, kind, tree, T, top_p, top_k = CASES[case]
    bb = small[arch]
    heads = new_heads(kind, bb, 3, random=True, seed=2)
    eng = Engine(bb, HeadDrafter(heads), StaticScheduler.from_preset(tree, 3))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=T, top_p=top_p, top_k=top_k))
    assert 1.0 < tau < 3.0  # with 8 tokens random drafts are sometimes right


def test_oracle_q_equals_p_chain_accepts_everything_and_is_lossless(small):
    bb = small["llama"]
    eng = Engine(bb, BackboneDrafter(bb, 3, mix=0.0), StaticScheduler.from_preset("chain", 3))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=1.0), n=400)
    assert tau == 3.0  # q == p: every draft accepted, one step for three tokens


def test_mixed_q_branching_tree_topk_topp_is_lossless(small):
    bb = small["qwen2"]
    tree = compile_tree([(0,), (1,), (0, 0), (0, 1)], name="small-tree")
    eng = Engine(bb, BackboneDrafter(bb, 3, mix=0.5), StaticScheduler(tree))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=0.9, top_p=0.95, top_k=6), n=800)
    assert 1.3 < tau < 3.0


def test_deterministic_drafts_tree_is_lossless(small):
    """Drafts without q (point masses, e.g. a greedy drafter) on a branching tree."""
    bb = small["llama"]
    ref = Engine(bb).generate(PROMPT, GenerationConfig(max_new_tokens=8)).tokens
    eng = Engine(bb, OracleDrafter(ref, len(PROMPT), 3, V), StaticScheduler.from_preset("tree-4", 3))
    check_lossless(eng, bb, GenerationConfig(temperature=1.0), n=600)


def test_greedy_drafter_q_at_t0_reduces_to_greedy(small):
    """At T = 0 the speculative rule is the greedy rule: output = plain greedy output."""
    bb = small["qwen2"]
    cfg = GenerationConfig(max_new_tokens=20)
    ref = Engine(bb).generate(PROMPT, cfg).tokens
    for drafter in (BackboneDrafter(bb, 3, mix=0.3), HeadDrafter(new_heads("hydra", bb, 3, random=True))):
        g = Engine(bb, drafter, StaticScheduler.from_preset("tree-8", 3)).generate(PROMPT, cfg)
        assert g.tokens == ref


@pytest.mark.parametrize("kind", ["vanilla", "medusa", "oracle"])
def test_seeded_sampling_is_deterministic(kind):
    bb = tiny_backbone("llama")
    ids = bb.encode_prompt("Seeds make runs repeatable.", chat=True)
    if kind == "vanilla":
        eng = Engine(bb)
    elif kind == "medusa":
        eng = Engine(bb, HeadDrafter(new_heads("medusa", bb, 3, random=True)), StaticScheduler.from_preset("tree-16", 3))
    else:
        eng = Engine(bb, BackboneDrafter(bb, 3, mix=0.2), StaticScheduler.from_preset("tree-4", 3))
    outs = {}
    for seed in (0, 0, 1, 1, 2):
        cfg = GenerationConfig(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=seed)
        toks = eng.generate(ids, cfg).tokens
        assert outs.setdefault(seed, toks) == toks, f"seed {seed} gave two different outputs"
    assert len({tuple(v) for v in outs.values()}) > 1  # different seeds, different samples


def test_draft_vocabulary_sampling_is_lossless(small):
    """Heads that can only draft 4 of the 8 tokens (q is zero elsewhere): still plain sampling."""
    bb = small["llama"]
    heads = new_heads("hydra", bb, 3, random=True, seed=3).set_draft_vocab(torch.tensor([0, 2, 5, 6]))
    eng = Engine(bb, HeadDrafter(heads), StaticScheduler.from_preset("tree-4", 3))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=1.0), n=600)
    assert tau > 1.0


def test_context_vocabulary_sampling_is_lossless(small):
    """Draft vocabulary {0, 2} plus the context's own tokens outside it (PROMPT holds 1, 5,
    7, 3): q covers a per-step set of ids and is zero elsewhere; still plain sampling."""
    bb = small["llama"]
    heads = new_heads("hydra", bb, 3, random=True, seed=3).set_draft_vocab(torch.tensor([0, 2]))
    drafter = HeadDrafter(heads, context_vocab=3)
    eng = Engine(bb, drafter, StaticScheduler.from_preset("tree-4", 3))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=1.0), n=600)
    assert tau > 1.0


def de_bruijn_prompt() -> list[int]:
    """A prompt holding every bigram of the 8 tokens (a de Bruijn sequence, 65 tokens), so a
    context copy exists after every root and along every drafted path."""
    seq, seen, cur = [0], set(), 0
    while len(seen) < V * V:
        nxt = next(b for b in reversed(range(V)) if (cur, b) not in seen)
        seen.add((cur, nxt))
        seq.append(nxt)
        cur = nxt
    return seq


class FixedCounter:
    """Wraps a drafter; counts the point-mass (copy) proposals it makes at T > 0."""

    def __init__(self, inner):
        self.inner, self.fixed, self.drafts = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, *args, **kw):
        d = self.inner.draft(*args, **kw)
        self.fixed += len(d.fixed)
        self.drafts += 1
        return d


def test_sampled_context_copies_are_lossless(small):
    """Context copies at T > 0: a point-mass proposal first, then head draws from q without
    the copy's token, copies alone past the heads (depth 4 > K = 3); still plain sampling."""
    from cadence.draft.context_copy import CopyConfig

    bb = small["llama"]
    prompt = de_bruijn_prompt()
    heads = new_heads("hydra", bb, 3, random=True, seed=4)
    drafter = FixedCounter(HeadDrafter(heads, CopyConfig(), copy_depth=4))
    tree = compile_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)], name="copy-tree")
    eng = Engine(bb, drafter, StaticScheduler(tree))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=0.9, top_k=6), n=700, prompt=prompt)
    assert drafter.fixed >= drafter.drafts  # a copy in every draft (the 3-token budget cuts the tree to 2 levels)
    assert tau > 1.2


def test_sampled_ngram_is_lossless(small):
    """The copy-only drafter (``--method ngram``) at T > 0: every draft a point mass."""
    from cadence.methods import Method, MethodSpec, make_engine

    bb = small["qwen2"]
    prompt = de_bruijn_prompt()
    eng = make_engine(bb, MethodSpec(method=Method.NGRAM))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=1.0, top_p=0.9), n=700, prompt=prompt)
    assert tau > 1.0  # some copies accepted (each with the backbone's probability of its token)


def test_sampled_copy_first_is_lossless(small):
    """Copies first at T > 0: steps whose root has a copy run the copy chain alone (point masses)
    or the heads' tree (draws from q), per the request's own rates; still plain sampling."""
    from cadence.costs.latency import LatencyCurve
    from cadence.draft.context_copy import CopyConfig
    from cadence.schedulers.copy_chain import CopyChainScheduler
    from cadence.schedulers.copy_first import CopyFirst

    bb = small["llama"]
    prompt = de_bruijn_prompt()
    curve = LatencyCurve([1, 2, 4, 8], [0.010, 0.011, 0.012, 0.016])
    heads = new_heads("hydra", bb, 3, random=True, seed=6)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=4)
    tree = compile_tree([(0,), (1,), (0, 0)], name="heads-tree")
    eng = Engine(bb, drafter, lambda s: CopyFirst(StaticScheduler(tree), CopyChainScheduler(curve, 4), curve))
    tau = check_lossless(eng, bb, GenerationConfig(temperature=0.9, top_p=0.9), n=700, prompt=prompt)
    assert tau > 1.0


@pytest.mark.parametrize("kind, copy", [("hydra", False), ("hydra", True), ("eagle", True), ("eagle3", True)])
def test_dynamic_tree_sampling_is_lossless(small, kind, copy):
    """EAGLE-2 dynamic trees at T > 0: candidates are the drafter's top-k under the sampling
    settings (and context copies), chosen by value, every node verified as a point mass."""
    from cadence.draft.context_copy import CopyConfig
    from cadence.draft.grow import DynamicTree
    from cadence.schedulers.dynamic import DynamicScheduler

    bb = small["llama"]
    prompt = de_bruijn_prompt() if copy else PROMPT
    heads = new_heads(kind, bb, 3, random=True, seed=5)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=4) if copy else HeadDrafter(heads)
    spec = DynamicTree(topk=3, max_nodes=6)
    eng = Engine(bb, drafter, lambda s: DynamicScheduler(spec))
    cfg = GenerationConfig(temperature=0.8, top_p=0.95)
    tau = check_lossless(eng, bb, cfg, n=700, prompt=prompt)
    g = eng.generate(prompt, GenerationConfig(max_new_tokens=N_NEW, temperature=0.8, top_p=0.95, seed=1))
    assert all(s.tree.startswith("dynamic-") for s in g.stats.step_log)
    assert tau > 1.1
