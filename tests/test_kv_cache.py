"""KV compaction keeps exactly the committed entries, by hand and inside the engine."""

import random

import pytest
import torch
from tiny import OracleDrafter

from cadence.backbone.kv_cache import HFCache
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.schedulers.static import StaticScheduler
from cadence.trees.tree import compile_tree


def filled_cache(bb, n: int):
    """A DynamicCache whose entry at position s holds the value s (keys) and -s (values)."""
    cache = bb.new_cache()
    cfg = bb.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    pos = torch.arange(n, dtype=torch.float32)[None, None, :, None].expand(1, heads, n, dim)
    for layer in range(cfg.num_hidden_layers):
        cache.hf.update(pos + 1000 * layer, -pos - 1000 * layer, layer)
    return cache


def positions(cache, layer=0):
    keys, values = cache.hf.layers[layer].keys, cache.hf.layers[layer].values
    k = keys[0, 0, :, 0] - 1000 * layer
    assert torch.equal(values[0, 0, :, 0], -keys[0, 0, :, 0])  # keys and values move together
    assert torch.equal(keys, keys[..., :1].expand_as(keys))  # whole rows move
    return [int(x) for x in k]


@pytest.mark.parametrize("past, size, keep, expected", [
    (5, 4, [0, 2], [0, 1, 2, 3, 4, 5, 7]),  # the docstring example
    (5, 4, [0, 1], [0, 1, 2, 3, 4, 5, 6]),  # a chain prefix: cropped
    (5, 4, [0, 1, 2, 3], list(range(9))),  # everything accepted: unchanged
    (5, 4, [0], [0, 1, 2, 3, 4, 5]),  # only the root
    (3, 7, [0, 2, 5, 6], [0, 1, 2, 3, 5, 8, 9]),
    (0, 5, [0, 3], [0, 3]),
])
def test_compact_by_hand(llama, past, size, keep, expected):
    cache = filled_cache(llama, past + size)
    assert cache.length() == past + size
    cache.compact(past, keep)
    assert cache.length() == past + len(keep)
    for layer in range(llama.config.num_hidden_layers):
        assert positions(cache, layer) == expected


def test_reset(llama):
    cache = filled_cache(llama, 6)
    cache.reset()
    assert cache.length() == 0


def _capture_cache(monkeypatch, bb):
    made = []
    real = bb.new_cache

    def spy():
        made.append(real())
        return made[-1]

    monkeypatch.setattr(bb, "new_cache", spy)
    return made


@pytest.mark.parametrize("tree", ["tree-16", "tree-64", "mixed"])
def test_engine_cache_holds_exactly_the_committed_tokens(llama, monkeypatch, tree):
    """During generation the cache is the prefill of prompt + committed tokens, nothing else.

    The drafter puts the right token at a varying rank (sometimes outside the tree), so
    accepted paths branch away from rank 0 and are cut at varying depths.
    """
    ids = llama.encode_prompt("Write a poem about the sea.", chat=True)
    n = 40
    ref = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=n)).tokens
    rng = random.Random(tree)
    ranks = [rng.choice([0, 0, 1, 2, 5]) for _ in range(n + 8)]
    drafter = OracleDrafter(ref, len(ids), 3, llama.vocab_size, right_rank=lambda i: ranks[i])
    if tree == "mixed":
        sched = StaticScheduler(compile_tree([(0,), (1,), (2,), (1, 0), (1, 1), (2, 0), (1, 1, 0), (1, 1, 2)]))
    else:
        sched = StaticScheduler.from_preset(tree, 3)
    made = _capture_cache(monkeypatch, llama)
    eng = Engine(llama, drafter, sched)
    got: list[int] = []
    checked = 0
    req = eng.stream(ids, GenerationConfig(max_new_tokens=n))
    for chunk in req:
        got.extend(chunk)
        if len(got) == n:
            break  # the last chunk may be cut at the budget
        assert len(made) == 1
        cache = made[0]
        assert cache.length() == len(ids) + len(got)
        fresh = HFCache(llama.config)  # not through new_cache: the spy counts the engine's
        llama.forward(torch.tensor([ids + got]), fresh, need_logits=False)
        for a, b in zip(cache.hf.layers, fresh.hf.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)
        checked += 1
    assert got == ref
    st = req.stats
    assert checked >= 5 and 1.2 < st.tau < 4.0  # partial acceptance happened
    assert any(i.accepted >= 2 for i in st.step_log)
