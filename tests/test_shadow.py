"""Shadow drafts: a root-alone step that also drafts the depth-1 top candidate, never
commits it, and reports whether the backbone's next token matched (``Plan.shadow``)."""

import pytest

from cadence.engine import Engine, GenerationConfig
from cadence.schedulers.base import Plan
from cadence.trees import compile_tree
from tiny import OracleDrafter, tiny_backbone

ROOT = compile_tree([], name="root")


class ShadowEvery:
    """Root alone every step, always asking for a shadow draft; keeps what it observed."""

    def __init__(self):
        self.seen = []

    def choose(self, state):
        return Plan(ROOT, shadow=True)

    def observe(self, info):
        self.seen.append(info)


@pytest.fixture(scope="module")
def bb():
    return tiny_backbone("llama")


def run(bb, right_rank, temperature=0.0, n=16):
    ids = [5, 17, 33, 2, 9]
    cfg = GenerationConfig(max_new_tokens=n, temperature=temperature, seed=3)
    ref = Engine(bb).generate(ids, cfg)
    sched = ShadowEvery()
    drafter = OracleDrafter(ref.tokens, len(ids), 2, bb.vocab_size, right_rank=right_rank)
    out = Engine(bb, drafter, lambda sampling: sched).generate(ids, cfg)
    return ref, out, sched.seen


@pytest.mark.parametrize("right_rank, expect", [(0, True), (1, False)])
def test_shadow_reports_what_the_draft_would_have_scored_and_commits_nothing(bb, right_rank, expect):
    ref, out, seen = run(bb, right_rank)
    assert out.tokens == ref.tokens  # the shadow is never committed
    assert all(s.nodes == 1 and s.accepted == 0 for s in seen)  # only the root was verified
    # every step but the last one that drafts (its next token is past the reference's end)
    assert [s.shadow for s in seen[:-1]] == [expect] * (len(seen) - 1)


def test_no_shadow_when_sampling(bb):
    ref, out, seen = run(bb, 0, temperature=0.8)
    assert out.tokens == ref.tokens  # same seed, nothing drawn for a shadow: the same stream
    assert all(s.shadow is None for s in seen)


def test_shadow_is_none_unless_asked(bb):
    ids = [5, 17, 33]
    ref = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=8))
    assert all(s.shadow is None for s in ref.stats.step_log)


@pytest.mark.parametrize("copy", [False, True])
def test_the_cheap_shadow_is_the_token_a_one_draft_chain_carries(bb, copy):
    """HeadDrafter.shadow (the copy first, else head 1's argmax) == draft(chain of 1)."""
    import torch

    from cadence.context_copy import CopyConfig
    from cadence.drafter import HeadDrafter
    from cadence.engine import SHADOW_CHAIN
    from cadence.heads import new_heads
    from cadence.sampling import SamplingParams

    drafter = HeadDrafter(new_heads("hydra", bb, 2, random=True, seed=4), CopyConfig() if copy else None)
    gen = torch.Generator().manual_seed(0)
    context = [1, 2, 3, 4, 9, 1, 2]  # root 3: "1 2 3" was followed by 4 -> a copy
    for root in (3, 5, 8, 11, 40):
        h = torch.randn(bb.hidden_size, generator=gen)
        full = drafter.draft(SHADOW_CHAIN, root, h, context, SamplingParams(), None, drafter.new_index())
        cheap = drafter.shadow(root, h, context, drafter.new_index())
        assert cheap == int(full.tokens[1])
        if copy and root == 3:
            assert cheap == 4
