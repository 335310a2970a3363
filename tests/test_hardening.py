"""Defects of the core found by review (issue: core hardening), one test or more each.

Each test here failed on the engine before the fix it names."""

import inspect

import pytest
import torch
from tiny import OracleDrafter, tiny_backbone
from transformers import MistralConfig, MistralForCausalLM

from cadence.backbone.base import Backbone, cache_kwarg
from cadence.draft.context_copy import CopyConfig
from cadence.draft.head_drafter import HeadDrafter
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.heads import new_heads
from cadence.verify.sampling import SamplingParams, categorical, uniform
from cadence.schedulers.base import Plan
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree, preset
from cadence.verify.rules import Rule

PROMPT = "Write a poem about the sea."


# 1. Every random draw happens on its generator's device, through one helper.

def test_draws_follow_the_generator_device():
    g = torch.Generator(device="cpu").manual_seed(0)
    u = uniform(g)
    assert 0.0 <= u < 1.0
    dist = torch.tensor([0.0, 1.0, 0.0])
    assert categorical(dist, 3, g).tolist() == [1, 1, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draws_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    assert 0.0 <= uniform(g) < 1.0
    dist = torch.tensor([0.0, 1.0], device="cuda")
    assert categorical(dist, 2, g).device.type == "cuda"
    cpu_gen = torch.Generator().manual_seed(0)
    assert categorical(dist, 1, cpu_gen).device.type == "cuda"  # drawn on the CPU, returned where dist is


def test_every_draw_goes_through_the_helper(llama, monkeypatch):
    """Sampled speculative decoding (drafter, rule, root picks, typical) draws only via
    ``cadence.verify.sampling.uniform`` / ``categorical``: torch's samplers called from anywhere
    else would ignore the generator's device."""
    calls = {"rand": 0, "multinomial": 0}
    real_rand, real_mult = torch.rand, torch.multinomial

    def guarded(name, real):
        def fn(*args, **kwargs):
            caller = inspect.stack()[1]
            module = caller.frame.f_globals.get("__name__")
            assert module == "cadence.verify.sampling", f"torch.{name} called from {module}:{caller.function}"
            calls[name] += 1
            return real(*args, **kwargs)
        return fn

    heads = new_heads("hydra", llama, 3, random=True, seed=1)
    ids = llama.encode_prompt(PROMPT, chat=True)
    monkeypatch.setattr(torch, "rand", guarded("rand", real_rand))
    monkeypatch.setattr(torch, "multinomial", guarded("multinomial", real_mult))
    for rule in (Rule.SPECULATIVE, Rule.TYPICAL):
        eng = Engine(llama, HeadDrafter(heads), StaticScheduler.from_preset("tree-8", 3))
        eng.generate(ids, GenerationConfig(max_new_tokens=12, temperature=0.8, rule=rule))
    assert calls["rand"] > 0 and calls["multinomial"] == 0  # draws are inverse-CDF lookups of torch.rand


# 2. The KV cache is really passed to (and reused by) the installed transformers.

def test_cache_is_reused(llama):
    ids = torch.tensor([llama.encode_prompt(PROMPT, chat=True)])
    cache = llama.new_cache()
    llama.forward(ids[:, :-1], cache)
    assert cache.length() == ids.shape[1] - 1
    step = llama.forward(ids[:, -1:], cache)
    assert cache.length() == ids.shape[1]
    full = llama.forward(ids)
    torch.testing.assert_close(step.logits[0, -1], full.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_cache_keyword_follows_the_installed_signature():
    class V4:
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            pass

    class V5:
        def forward(self, input_ids=None, cache=None, **kwargs):
            pass

    class Neither:
        def forward(self, input_ids=None, **kwargs):
            pass

    assert cache_kwarg(V4()) == "past_key_values" and cache_kwarg(V5()) == "cache"
    with pytest.raises(CadenceError, match="takes no KV cache"):
        cache_kwarg(Neither())


# 3. Stop strings: the token ids plain decoding returns, and a stream that ends at the stop.

def _plain_with_stop(bb, ids, n, stop):
    """Plain decoding with a stop string, by hand: the shortest prefix whose text holds it."""
    ref = Engine(bb).generate(ids, GenerationConfig(max_new_tokens=n)).tokens
    for i in range(1, len(ref) + 1):
        if stop in bb.tokenizer.decode(ref[:i], skip_special_tokens=True):
            return ref[:i], ref
    return ref, ref


@pytest.mark.parametrize("tree", ["chain", "tree-16"])
def test_stop_string_token_ids_equal_plain_decoding(llama, tree):
    ids = llama.encode_prompt(PROMPT, chat=True)
    n = 40
    full = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=n))
    text = full.text
    i = next(i for i in range(8, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[i:i + 2]  # two printable characters from the middle of the (random) reply
    want, ref = _plain_with_stop(llama, ids, n, stop)
    assert len(want) < n
    cfg = GenerationConfig(max_new_tokens=n, stop=(stop,))
    oracle = OracleDrafter(ref, len(ids), 3, llama.vocab_size)  # accepts everything: chunks overshoot
    for eng in (Engine(llama), Engine(llama, oracle, StaticScheduler.from_preset(tree, 3))):
        g = eng.generate(ids, cfg)
        assert g.tokens == want
        assert g.stats.new_tokens == len(want)
        assert g.text == text[:text.index(stop)]
        req = eng.stream(ids, cfg)
        shown = ""
        for _ in req:
            shown += req.take_text()
            assert stop not in shown and not any(shown.endswith(stop[:k]) for k in range(1, len(stop)))
        shown += req.take_text()
        assert shown == g.text and req.tokens == want


# 4. The tree is resolved per request and the tree that ran is reported.

def test_dropped_nodes_are_reported_with_the_real_node_count(llama):
    heads = new_heads("hydra", llama, 3, random=True, seed=1)
    drafter = HeadDrafter(heads, CopyConfig(), copy_depth=6)
    tree = compile_tree(preset("chain", 6), name="deep")
    g = Engine(llama, drafter, StaticScheduler(tree)).generate(
        llama.encode_prompt(PROMPT, chat=True), GenerationConfig(max_new_tokens=24))
    log = g.stats.step_log
    assert all(s.planned.startswith("deep") for s in log)
    pruned = [s for s in log if s.tree != s.planned]
    assert pruned, "a reply without repeats leaves copy-only levels empty"
    for s in pruned:
        assert s.tree.endswith(f"~{s.nodes}") and s.nodes < tree.size and s.depth < 6
    assert g.stats.summary()["mean_nodes"] == pytest.approx(sum(s.nodes for s in log) / len(log), abs=1e-3)


def test_sampled_request_on_a_copy_engine_gets_the_copy_tree(llama):
    """Copies are drafted at T > 0 too (point-mass proposals): a sampled
    request runs the same copy tree as a greedy one; without copy, the heads' own tree."""
    from cadence.methods import Method, MethodSpec, make_engine

    eng = make_engine(llama, MethodSpec(method=Method.HYDRA, heads="random", tree="chain", copy_depth=6))
    greedy = eng.new_scheduler(SamplingParams()).plan.tree
    sampled = eng.new_scheduler(SamplingParams(temperature=0.7)).plan.tree
    assert greedy.max_depth == sampled.max_depth == 6
    g = eng.generate(llama.encode_prompt(PROMPT, chat=True), GenerationConfig(max_new_tokens=12, temperature=0.7))
    assert len(g.tokens) == 12
    plain = make_engine(llama, MethodSpec(method=Method.HYDRA, heads="random", tree="chain", copy=False))
    assert plain.new_scheduler(SamplingParams(temperature=0.7)).plan.tree.max_depth == 3


# 5. Per-request state: interleaved requests on one engine == sequential runs.

class CountingScheduler:
    """A scheduler with memory: its tree grows with the steps it has seen."""

    def __init__(self):
        self.seen = 0

    def choose(self, state):
        depth = min(1 + self.seen // 3, 3)
        return Plan(compile_tree(preset("chain", depth), name=f"c{depth}"))

    def observe(self, info):
        self.seen += 1


def test_interleaved_requests_equal_sequential(llama):
    heads = new_heads("hydra", llama, 3, random=True, seed=2)
    eng = Engine(llama, HeadDrafter(heads, CopyConfig(), copy_depth=3), lambda sampling: CountingScheduler())
    prompts = [llama.encode_prompt(p, chat=True) for p in (PROMPT, "Count to ten.", "abc abc abc abc")]
    cfgs = [GenerationConfig(max_new_tokens=30), GenerationConfig(max_new_tokens=25, temperature=0.9, seed=4),
            GenerationConfig(max_new_tokens=30)]
    alone = [eng.generate(p, c) for p, c in zip(prompts, cfgs)]
    reqs = [eng.start(p, c) for p, c in zip(prompts, cfgs)]
    while not all(r.done for r in reqs):
        for r in reqs:
            r.step()
    for a, r in zip(alone, reqs):
        assert r.tokens == a.tokens
        assert [s.planned for s in r.stats.step_log] == [s.planned for s in a.stats.step_log]


# 6. The scheduler sees the state that produced the root, and returns a plan.

class RecordingScheduler:
    def __init__(self):
        self.states = []

    def choose(self, state):
        self.states.append(state)
        return Plan(compile_tree(preset("chain", 2), name="c2"))

    def observe(self, info):
        pass


def test_scheduler_state(llama):
    ids = llama.encode_prompt(PROMPT, chat=True)
    ref = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=20)).tokens
    sched = RecordingScheduler()
    g = Engine(llama, OracleDrafter(ref, len(ids), 3, llama.vocab_size), sched).generate(
        ids, GenerationConfig(max_new_tokens=20))
    assert g.tokens == ref and len(sched.states) >= 5
    for i, st in enumerate(sched.states):
        assert st.step == i and st.new_tokens == 3 * i and st.past == len(ids) + 3 * i
        prefix = torch.tensor([ids + ref[:st.new_tokens]])
        out = llama.forward(prefix)
        torch.testing.assert_close(st.hidden, out.hidden[0, -1], atol=1e-4, rtol=1e-4)
        logp = torch.log_softmax(out.logits[0, -1], -1)
        assert st.entropy == pytest.approx(float(-(logp.exp() * logp).sum()), abs=1e-3)
        assert int(st.root_logits.argmax()) == ref[st.new_tokens]


def test_unverified_plans_are_refused(llama):
    class Unverified(RecordingScheduler):
        def choose(self, state):
            return Plan(compile_tree([(0,)]), verify=False)

    heads = new_heads("hydra", llama, 3, random=True)
    with pytest.raises(CadenceError, match="unverified"):
        Engine(llama, HeadDrafter(heads), Unverified()).generate([1, 2, 3], GenerationConfig(max_new_tokens=5))
    eng = Engine(llama, HeadDrafter(heads), Unverified())
    eng.allow_unverified = True  # opted in: every draft is committed, the output is the heads' as well
    g = eng.generate([1, 2, 3], GenerationConfig(max_new_tokens=9))
    assert g.stats.steps == 5 and g.stats.unverified_steps == 4 and g.stats.tau == 9 / 5


# 7. Validation of sampling settings and rules.

@pytest.mark.parametrize("kwargs, fragment", [
    ({"rule": Rule.GREEDY, "temperature": 0.7}, "--rule greedy needs --temperature 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
])
def test_bad_settings_are_refused(kwargs, fragment):
    with pytest.raises(CadenceError) as err:
        GenerationConfig(**kwargs)
    assert fragment in str(err.value)


def test_greedy_rule_is_not_lossless_when_sampling():
    assert Rule.GREEDY.lossless(SamplingParams()) and not Rule.GREEDY.lossless(SamplingParams(temperature=0.5))


# 8. Sliding-window caches are refused at load, not corrupted.

def test_sliding_window_model_is_refused():
    cfg = MistralConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        max_position_embeddings=512)
    with pytest.raises(CadenceError, match="sliding-window attention"):
        Backbone(MistralForCausalLM(cfg))
    cfg.sliding_window = None  # full attention: fine
    Backbone(MistralForCausalLM(cfg))
