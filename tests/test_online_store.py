"""Online copies (``draft.online_store``): n-grams of the replies an engine finished become copy
sources for the next requests; drafts only, so decoding with them stays lossless."""

from __future__ import annotations

import pytest
from tiny import tiny_backbone

from cadence.decode.engine import Engine, not_learning
from cadence.decode.generation import GenerationConfig
from cadence.draft.context_copy import NgramIndex
from cadence.draft.datastore import Datastore, DatastoreConfig
from cadence.draft.online_store import OnlineStore
from cadence.errors import CadenceError
from cadence.methods import Method, MethodSpec, make_engine

BIGRAMS = DatastoreConfig(max_n=2, min_n=2, min_count=1, min_share=0.3)


def test_the_docstring_example():
    s = OnlineStore(100, BIGRAMS)
    s.add([1, 2, 3])
    s.add([1, 2, 4])
    assert s.lookup([1, 2]) == 3  # 3 and 4 once each: the first
    assert s.lookup([2, 3]) is None  # nothing followed it
    assert s.lookup([2]) is None  # shorter than every n
    assert s.describe() == {"replies": 2, "reply_tokens": 6, "ngrams": 1, "max_ngrams": 100}  # (1, 2) alone


def test_the_rule_and_the_longest_ngram_win():
    s = OnlineStore(100, DatastoreConfig(max_n=3, min_n=2, min_count=2, min_share=0.6))
    for reply in ([5, 6, 7], [5, 6, 7], [9, 6, 7], [8, 5, 6, 8]):
        s.add(reply)
    assert s.lookup([5, 6]) == 7  # 7, 7, 8: twice and 2/3 of the time
    s.add([4, 5, 6, 9])
    assert s.lookup([4, 5, 6]) is None  # the trigram followed once: below min_count ...
    assert s.lookup([0, 5, 6]) is None  # ... and the bigram now 7, 7, 8, 9: 2/4 < 0.6


def test_the_oldest_ngrams_go_first_and_the_store_behind_fills_in():
    behind = Datastore.build([[1, 2, 9], [1, 2, 9]], DatastoreConfig(max_n=2, min_n=2))
    s = OnlineStore(2, BIGRAMS, then=behind)
    s.add([1, 2, 3])  # (1, 2) -> 3
    assert s.lookup([1, 2]) == 3  # the online store first
    s.add([7, 8, 5, 6, 4])  # 3 new bigrams: (1, 2) is the oldest, gone
    assert len(s) == 2 and s.lookup([5, 6]) == 4
    assert s.lookup([1, 2]) == 9  # the store behind it
    s.clear()
    assert len(s) == 0 and s.replies == 0 and s.lookup([5, 6]) is None
    with pytest.raises(CadenceError):
        OnlineStore(0)
    with pytest.raises(CadenceError):
        OnlineStore(10, BIGRAMS, then=Datastore.build([[1, 2, 3]], DatastoreConfig(max_n=3, min_n=2)))


def test_an_index_asks_the_request_first():
    s = OnlineStore(100, BIGRAMS)
    s.add([3, 4, 9])
    idx = NgramIndex(fallback=s)
    idx.sync([3, 4, 5, 1, 3, 4])
    assert idx.lookup([1, 3, 4]) == 5  # the request's own copy
    assert NgramIndex(fallback=s).lookup([1, 3, 4]) == 9  # no request copy: the online store's


def test_an_engine_learns_finished_replies_and_stays_lossless():
    """The second request's reply is the first one's (same prompt, greedy): with the online store
    it is drafted from copies of the first; without it, from the request alone."""
    bb = tiny_backbone("llama", vocab=260, tokenizer=False)
    prompt = [11, 52, 93, 14, 25]
    cfg = GenerationConfig(max_new_tokens=32)
    plain = Engine(bb).generate(prompt, cfg)
    engine = make_engine(bb, MethodSpec(method=Method.NGRAM, tree="chain", online_store=1000))
    store = engine.drafter.datastore
    with not_learning(engine):  # a warm-up: nothing learnt
        engine.generate(prompt, cfg)
    assert store.replies == 0
    first = engine.generate(prompt, cfg)
    assert store.replies == 1 and store.tokens == len(first.tokens)
    second = engine.generate(prompt, cfg)
    assert first.tokens == second.tokens == plain.tokens
    assert second.stats.steps < first.stats.steps  # the first reply's n-grams drafted the second
    assert engine.drafter.learning
    hydra = make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random", online_store=1000))
    hydra.generate(prompt, cfg)
    assert hydra.generate(prompt, cfg).tokens == plain.tokens and hydra.drafter.datastore.replies == 2


def test_settings_it_cannot_use_are_refused():
    bb = tiny_backbone("llama", vocab=260, tokenizer=False)
    with pytest.raises(CadenceError, match="online-store"):
        make_engine(bb, MethodSpec(method=Method.NGRAM, online_store=-1))
    with pytest.raises(CadenceError, match="needs --copy"):
        make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random", copy=False, online_store=10))
    assert MethodSpec.parse("ngram,online_store=500").online_store == 500


def test_a_server_learns_what_it_serves_and_shows_it_on_metrics():
    """``cadence serve --online-store N``: each finished reply is counted, and /metrics shows the
    store's n-grams and replies; a repeated greedy question gets the same answer."""
    from server_support import serve

    from cadence.batch.serial import SerialEngine

    bb = tiny_backbone("llama", vocab=260)
    spec = MethodSpec(method=Method.NGRAM, tree="chain", online_store=5000)
    engine = make_engine(bb, spec)
    with serve(engine, SerialEngine(engine, max_batch=2), spec=spec) as srv:
        answers = [srv.client.completions.create(model="tiny", prompt="The sea", max_tokens=12, temperature=0)
                   .choices[0].text for _ in range(2)]
        m = srv.metrics()
    assert answers[0] == answers[1]
    assert m[("cadence:online_store_replies", ())] == 2
    assert m[("cadence:online_store_ngrams", ())] == len(engine.drafter.datastore) > 0


def test_an_ngram_costs_the_few_hundred_bytes_the_docs_say():
    import random
    import tracemalloc

    rng = random.Random(0)
    tracemalloc.start()
    try:
        s = OnlineStore(10 ** 6)
        for _ in range(100):
            s.add([rng.randrange(2000) for _ in range(128)])
        per = tracemalloc.get_traced_memory()[0] / len(s)
    finally:
        tracemalloc.stop()
    assert 150 < per < 600, per  # docs: about 380 bytes
