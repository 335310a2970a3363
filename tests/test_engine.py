"""The decoding loop at T = 0: speculative output == plain greedy output, for every head type,
tree preset and backbone; vanilla == transformers generate; stopping; statistics."""

import math
import random

import pytest
import torch
from tiny import OracleDrafter, tiny_backbone

from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.heads import new_heads
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree, preset_names

K = 3
N = 32  # new tokens per generation
PROMPT = "Write a poem about the sea."
KINDS = ("medusa", "hydra", "mtp")
PRESETS = preset_names(K)
_refs: dict = {}


@pytest.fixture(params=["llama", "qwen2"])
def bb(request, llama, qwen2):
    return {"llama": llama, "qwen2": qwen2}[request.param]


def reference(bb, n=N, prompt=PROMPT):
    """Plain greedy output (Engine without drafter), cached per backbone."""
    key = (bb.name, n, prompt)
    if key not in _refs:
        ids = bb.encode_prompt(prompt, chat=True)
        g = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=n))
        _refs[key] = (ids, g)
    return _refs[key]


def spec_engine(bb, drafter, tree):
    sched = StaticScheduler.from_preset(tree, K) if isinstance(tree, str) else StaticScheduler(tree)
    return Engine(bb, drafter, sched)


def test_vanilla_stats(bb):
    ids, g = reference(bb)
    assert len(g.tokens) == N  # the tiny models do not hit EOS on this prompt
    s = g.stats
    assert s.new_tokens == N and s.steps == N and s.forwards == N - 1
    assert s.tau == 1.0 and s.accepted_at_depth == []
    assert len(s.step_log) == N - 1 and all(i.accepted == 0 and i.nodes == 1 for i in s.step_log)
    assert g.text == bb.tokenizer.decode(g.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("kind", KINDS)
def test_random_heads_equal_greedy_every_preset(bb, kind):
    ids, ref = reference(bb)
    heads = new_heads(kind, bb, K, random=True, seed=1)
    for tree in PRESETS:
        g = spec_engine(bb, HeadDrafter(heads), tree).generate(ids, GenerationConfig(max_new_tokens=N))
        assert g.tokens == ref.tokens, (kind, tree)
        assert g.text == ref.text
        assert g.stats.new_tokens == N
        assert g.stats.tau < 1.5, (kind, tree)  # random heads: (almost) nothing accepted
        assert all(i.tree.split("@")[0] == tree for i in g.stats.step_log)  # "@d": cut near the end


@pytest.mark.parametrize("tree", PRESETS)
def test_oracle_equals_greedy_and_accepts_everything(bb, tree):
    ids, ref = reference(bb)
    oracle = OracleDrafter(ref.tokens, len(ids), K, bb.vocab_size)
    eng = spec_engine(bb, oracle, tree)
    g = eng.generate(ids, GenerationConfig(max_new_tokens=N))
    assert g.tokens == ref.tokens
    D = eng.new_scheduler(GenerationConfig().sampling).plan.tree.max_depth
    s = g.stats
    # every step commits D + 1 tokens except the last, which commits what is left
    assert s.steps == math.ceil(N / (D + 1))
    assert s.tau == pytest.approx(N / math.ceil(N / (D + 1)))
    assert s.tau >= (D + 1) * 0.9
    if D:
        assert s.accepted_at_depth[D - 1] >= s.steps - 1
    last = N - (D + 1) * (s.steps - 1)  # tokens of the last step; a lone root needs no forward
    assert s.forwards == s.steps - (1 if last == 1 else 0)


def test_oracle_non_first_rank_branch(bb):
    """The right token is always the rank-1 candidate: accepted nodes are not contiguous."""
    ids, ref = reference(bb)
    paths = [(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)]
    oracle = OracleDrafter(ref.tokens, len(ids), K, bb.vocab_size, right_rank=1)
    eng = spec_engine(bb, oracle, compile_tree(paths, name="rank1"))
    g = eng.generate(ids, GenerationConfig(max_new_tokens=N))
    assert g.tokens == ref.tokens
    assert g.stats.steps == math.ceil(N / 4)


@pytest.mark.parametrize("tree", ["tree-8", "tree-64"])
def test_partial_acceptance_equals_greedy(bb, tree):
    """The right token sits at a varying rank, sometimes outside the tree: paths of every length."""
    ids, ref = reference(bb)
    rng = random.Random(5)
    ranks = [rng.choice([0, 0, 1, 2, 11]) for _ in range(N + 8)]  # rank 11 is in neither tree
    oracle = OracleDrafter(ref.tokens, len(ids), K, bb.vocab_size, right_rank=lambda i: ranks[i])
    g = spec_engine(bb, oracle, tree).generate(ids, GenerationConfig(max_new_tokens=N))
    assert g.tokens == ref.tokens
    accepted = {i.accepted for i in g.stats.step_log}
    assert 0 in accepted and max(accepted) >= 2


def test_streamed_chunks_concatenate_to_generate(llama):
    ids, ref = reference(llama)
    oracle = OracleDrafter(ref.tokens, len(ids), K, llama.vocab_size)
    eng = spec_engine(llama, oracle, "tree-8")
    req = eng.stream(ids, GenerationConfig(max_new_tokens=N))
    chunks = list(req)
    assert [t for c in chunks for t in c] == ref.tokens == req.tokens
    assert all(1 <= len(c) <= 4 for c in chunks)
    assert len(chunks) == req.stats.steps


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 9])
def test_max_new_tokens_is_exact(llama, n):
    ids, ref = reference(llama)
    heads = new_heads("hydra", llama, K, random=True)
    for drafter, tree in [(None, None), (OracleDrafter(ref.tokens, len(ids), K, llama.vocab_size), "chain"),
                          (OracleDrafter(ref.tokens, len(ids), K, llama.vocab_size), "tree-16"),
                          (HeadDrafter(heads), "tree-8")]:
        eng = Engine(llama) if drafter is None else spec_engine(llama, drafter, tree)
        g = eng.generate(ids, GenerationConfig(max_new_tokens=n))
        assert g.tokens == ref.tokens[:n], (tree, n)
        assert g.stats.new_tokens == n


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eos_stops_generation_identically(arch):
    base = tiny_backbone(arch)
    ids = base.encode_prompt(PROMPT, chat=True)
    free = Engine(base).generate(ids, GenerationConfig(max_new_tokens=N)).tokens
    stop_tok = free[9]  # make this token the EOS of the same weights
    first = free.index(stop_tok)
    bb = tiny_backbone(arch, eos=stop_tok)
    assert bb.eos_token_ids == {stop_tok}
    ref = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=N))
    assert ref.tokens == free[:first + 1]  # EOS included, nothing after it
    heads = new_heads("mtp", bb, K, random=True)
    for drafter, tree in [(HeadDrafter(heads), "tree-8"),
                          (OracleDrafter(ref.tokens, len(ids), K, bb.vocab_size), "chain"),
                          (OracleDrafter(ref.tokens, len(ids), K, bb.vocab_size), "tree-32")]:
        g = spec_engine(bb, drafter, tree).generate(ids, GenerationConfig(max_new_tokens=N))
        assert g.tokens == ref.tokens, tree
        assert g.stats.new_tokens == len(ref.tokens)


def test_stop_strings(llama):
    ids, ref = reference(llama)
    full = ref.text
    assert len(full) > 12
    stop = full[8:11]
    cut = full[:full.index(stop)]
    cfg = GenerationConfig(max_new_tokens=N, stop=(stop,))
    g = Engine(llama).generate(ids, cfg)
    assert g.text == cut and stop not in g.text
    assert len(g.tokens) < N
    oracle = OracleDrafter(ref.tokens, len(ids), K, llama.vocab_size)
    g2 = spec_engine(llama, oracle, "chain").generate(ids, cfg)
    assert g2.text == cut
    assert g2.tokens == ref.tokens[:len(g2.tokens)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vanilla_equals_transformers_generate(arch, llama, qwen2):
    bb = {"llama": llama, "qwen2": qwen2}[arch]
    for prompt, n in [(PROMPT, 40), ("x", 25), ("The quick brown fox jumps over the lazy dog", 30)]:
        ids = bb.encode_prompt(prompt, chat=False)
        ours = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=n)).tokens
        with torch.inference_mode():
            out = bb.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=n, pad_token_id=257)
        theirs = out[0, len(ids):].tolist()
        assert ours == theirs, prompt


def test_vanilla_equals_transformers_generate_with_eos():
    bb0 = tiny_backbone("llama")
    ids = bb0.encode_prompt(PROMPT, chat=True)
    free = Engine(bb0).generate(ids, GenerationConfig(max_new_tokens=N)).tokens
    bb = tiny_backbone("llama", eos=free[5])
    ours = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=N)).tokens
    with torch.inference_mode():
        out = bb.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=N, pad_token_id=257)
    assert ours == out[0, len(ids):].tolist()
    assert ours[-1] == free[5] and len(ours) < N


def test_head_drafter_greedy_drafts_are_head_argmax(llama):
    """At T = 0 the HeadDrafter puts head k's rank-i token at rank i, along the node's own path."""
    heads = new_heads("hydra", llama, K, random=True, seed=3)
    tree = compile_tree([(0,), (1,), (0, 0), (1, 0), (1, 1)])
    hidden = torch.randn(llama.hidden_size)
    from cadence.verify.sampling import SamplingParams
    d = HeadDrafter(heads).draft(tree, 7, hidden, [1, 2, 3], SamplingParams(), None)
    assert d.q is None and d.tokens[0] == 7
    s0 = heads.init_state(hidden[None])
    l1, s1 = heads.step(1, s0, torch.tensor([7]))
    top = l1[0].topk(2).indices
    assert d.tokens[1:3].tolist() == top.tolist()
    for node, parent in [(3, 1), (4, 2)]:
        l2, _ = heads.step(2, s1, d.tokens[parent][None])
        top2 = l2[0].topk(2).indices.tolist()
        for child in tree.children[parent]:
            assert d.tokens[child] == top2[tree.ranks[child]]


def test_typical_with_greedy_drafts_at_t0_equals_greedy(llama):
    """The argmax always passes the typical threshold (p_max >= exp(-H) > alpha exp(-H))."""
    from cadence.verify.rules import Rule
    ids, ref = reference(llama)
    oracle = OracleDrafter(ref.tokens, len(ids), K, llama.vocab_size)
    g = spec_engine(llama, oracle, "tree-8").generate(ids, GenerationConfig(max_new_tokens=N, rule=Rule.TYPICAL))
    assert g.tokens == ref.tokens and g.stats.tau == pytest.approx(N / math.ceil(N / 4))


def test_bfloat16_backbone_tree_decoding():
    from cadence.backbone.base import Backbone
    base = tiny_backbone("qwen2")
    bb = Backbone(base.model.to(torch.bfloat16), base.tokenizer, name="tiny-qwen2-bf16")
    ids = bb.encode_prompt("Once upon a time", chat=True)
    ref = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=N)).tokens
    g = spec_engine(bb, OracleDrafter(ref, len(ids), K, bb.vocab_size), "tree-16").generate(
        ids, GenerationConfig(max_new_tokens=N))
    assert len(g.tokens) == len(ref) and g.stats.tau > 2.5
    heads = new_heads("hydra", bb, K, random=True).to(torch.bfloat16)
    g = spec_engine(bb, HeadDrafter(heads), "tree-8").generate(ids, GenerationConfig(max_new_tokens=N, temperature=0.7))
    assert len(g.tokens) == N or g.tokens[-1] in bb.eos_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_default_model_random_heads_equal_greedy(kind, default_backbone):
    """The real default model (SmolLM2-135M, converted from the GGUF on first use)."""
    bb = default_backbone
    ids = bb.encode_prompt("What is the capital of France?", chat=True)
    cfg = GenerationConfig(max_new_tokens=24)
    ref = Engine(bb).generate(ids, cfg)
    heads = new_heads(kind, bb, K, random=True)
    for tree in ("chain", "tree-16"):
        assert spec_engine(bb, HeadDrafter(heads), tree).generate(ids, cfg).tokens == ref.tokens
    oracle = OracleDrafter(ref.tokens, len(ids), K, bb.vocab_size)
    g = spec_engine(bb, oracle, "tree-64").generate(ids, cfg)
    assert g.tokens == ref.tokens and g.stats.tau > 3


@pytest.mark.parametrize("kind", KINDS)
def test_draft_vocabulary_keeps_greedy_output(bb, kind):
    """Heads restricted to a draft vocabulary that holds the reference tokens: still identical."""
    ids, ref = reference(bb)
    subset = torch.tensor(sorted(set(ref.tokens) | {0, 1, 2}))
    heads = new_heads(kind, bb, K, random=True).set_draft_vocab(subset)
    for tree in ("chain", "tree-16"):
        g = spec_engine(bb, HeadDrafter(heads), tree).generate(ids, GenerationConfig(max_new_tokens=N))
        assert g.tokens == ref.tokens


SHIPPED_PROMPTS = ["Explain what a hash table is.", "Write a Python function that reverses a list.",
                   "Janet has 3 apples and buys 5 more. How many apples does she have?",
                   "Write a short poem about the sea."]


def _shipped_tau(bb, specs) -> float:
    """Generate SHIPPED_PROMPTS with each MethodSpec in ``specs``; assert every output equals
    plain decoding; return tokens per step pooled over all of them."""
    from cadence.methods import make_engine
    cfg = GenerationConfig(max_new_tokens=48)
    new = steps = 0
    for spec in specs:
        engine = make_engine(bb, spec)
        for prompt in SHIPPED_PROMPTS:
            ids = bb.encode_prompt(prompt, chat=True)
            g = engine.generate(ids, cfg)
            assert g.tokens == Engine(bb).generate(ids, cfg).tokens, (spec, prompt)
            new, steps = new + g.stats.new_tokens, steps + g.stats.steps
    return new / steps


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_shipped_heads_are_lossless_and_accept_drafts(kind, default_backbone):
    """The heads shipped for the default model: greedy output identical to vanilla (fp32),
    on prompts never trained on, with their calibrated tree and with a 16-node tree; and
    they do accept drafts (tau above 1.1 pooled over the prompts)."""
    from cadence.methods import Method, MethodSpec
    specs = [MethodSpec(method=Method(kind), heads="default", tree=tree) for tree in ("auto", "tree-16")]
    assert _shipped_tau(default_backbone, specs) > 1.1


@pytest.mark.slow
@pytest.mark.parametrize("kind,heads", [("eagle", "default"), ("eagle", "eagle-taps")])
def test_shipped_attention_heads_are_lossless(kind, heads, default_backbone):
    """The attention-bearing sets shipped for the default model (by name for the variants):
    greedy output identical to vanilla with the default (dynamic) scheduler, with and without
    context copy, on prompts never trained on; and they accept drafts (tau above 1.5)."""
    from cadence.methods import Method, MethodSpec
    specs = [MethodSpec(method=Method(kind), heads=heads, copy=copy) for copy in (True, False)]
    assert _shipped_tau(default_backbone, specs) > 1.5


@pytest.mark.slow
def test_no_mtp_attn_heads_ship_for_the_default_model(default_backbone):
    """mtp-attn trains (``cadence train --kind mtp-attn``) but no set ships: the default
    model's --method mtp-attn without --heads says how to get one."""
    from cadence.errors import CadenceError
    from cadence.methods import Method, MethodSpec, make_engine
    with pytest.raises(CadenceError, match="no mtp-attn heads are shipped .*cadence train --kind mtp-attn"):
        make_engine(default_backbone, MethodSpec(method=Method.MTP_ATTN))
