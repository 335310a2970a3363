"""The datastore copy: n-grams of a store's replies -> their most frequent next token, asked
where the request has no copy of its own; drafts only, so decoding with it stays lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.draft.context_copy import NgramIndex
from cadence.draft.copy_drafter import CopyDrafter
from cadence.draft.datastore import (Datastore, DatastoreConfig, _hash_windows, hash_tokens, load_datastore,
                                     store_replies)
from cadence.errors import CadenceError
from cadence.methods import Method, MethodSpec, make_engine
from cadence.training.store import encode_shard, new_manifest, write_manifest, write_store_shard
from cadence.trees.tree import chain, compile_tree
from cadence.verify.sampling import SamplingParams

BIGRAMS = DatastoreConfig(max_n=2, min_n=2, min_count=2, min_share=0.5)


def test_the_docstring_example():
    ds = Datastore.build([[1, 2, 3, 4], [9, 2, 3, 4], [2, 3, 5]], BIGRAMS)
    assert ds.lookup([7, 2, 3]) == 4  # 4 followed (2, 3) twice, 5 once
    assert ds.lookup([1, 2]) is None  # (1, 2) -> 3 once: below min_count
    assert ds.lookup([3, 4]) is None  # (3, 4) ends both replies: no next token
    assert ds.lookup([3]) is None  # shorter than every n
    assert ds.lookup([9, 2]) is None  # (9, 2) -> 3 once
    assert len(ds) == 1 and ds.tokens == 11  # the one entry: (2, 3) -> 4


def test_ngrams_do_not_cross_replies_and_share_is_required():
    # (5, 6) is followed by 7 inside a reply only once; across the boundary it would be twice
    ds = Datastore.build([[5, 6, 7], [5, 6], [7, 8]], DatastoreConfig(max_n=2, min_n=2, min_count=1, min_share=1.0))
    assert ds.lookup([5, 6]) == 7
    split = Datastore.build([[5, 6, 7], [5, 6, 8], [5, 6, 8]], DatastoreConfig(max_n=2, min_n=2, min_count=1,
                                                                       min_share=0.7))
    assert split.lookup([5, 6]) is None  # 8 in 2 of 3 occurrences: below a 0.7 share
    tie = Datastore.build([[5, 6, 9], [5, 6, 8]], DatastoreConfig(max_n=2, min_n=2, min_count=1, min_share=0.5))
    assert tie.lookup([5, 6]) == 8  # ties go to the smaller token id


def test_the_longest_ngram_wins():
    replies = [[1, 2, 3, 4], [1, 2, 3, 4], [7, 2, 3, 9], [8, 2, 3, 9], [6, 2, 3, 9]]
    ds = Datastore.build(replies, DatastoreConfig(max_n=3, min_n=2, min_count=2, min_share=0.5))
    assert ds.lookup([1, 2, 3]) == 4  # the trigram (1, 2, 3) -> 4
    assert ds.lookup([5, 2, 3]) == 9  # no such trigram: the bigram (2, 3) -> 9 (3 of 5)


def test_numpy_and_python_hashes_agree():
    seq = np.array([0, 5, 49151, 70000, 3, 3, 12], dtype=np.int64)
    for n in (1, 2, 4):
        assert _hash_windows(seq, n).tolist() == [hash_tokens(seq[i:i + n].tolist()) for i in range(seq.size - n + 1)]
    assert hash_tokens([1, 2]) != hash_tokens([2, 1]) and hash_tokens([1, 2]) >> 20 != hash_tokens([1, 3]) >> 20


def test_settings_it_cannot_use_are_refused():
    with pytest.raises(CadenceError, match="min_n"):
        DatastoreConfig(max_n=1, min_n=2)
    with pytest.raises(CadenceError, match="min_share"):
        DatastoreConfig(min_share=0)
    with pytest.raises(CadenceError, match="2\\^20"):
        Datastore.build([[1, 2, 1 << 21]], DatastoreConfig(max_n=2, min_n=2, min_count=1))


def test_the_request_copy_comes_first_and_the_datastore_fills_in():
    ds = Datastore.build([[5, 6, 9], [5, 6, 9]], BIGRAMS)
    index = NgramIndex(fallback=ds)
    index.sync([5, 6, 7, 1])  # the request itself saw 5 6 -> 7
    assert index.lookup([5, 6]) == 7 and index.lookup([1, 5, 6]) == 7
    assert NgramIndex(fallback=ds).lookup([5, 6]) == 9  # an empty request: the datastore's
    assert index.lookup([4, 4]) is None and index.max_tail == 3
    assert NgramIndex(fallback=Datastore.build([], DatastoreConfig(max_n=5))).max_tail == 5


def test_copy_drafter_chains_datastore_copies():
    ds = Datastore.build([[5, 6, 7, 8, 2]] * 2, BIGRAMS)
    d = CopyDrafter(depth=3, datastore=ds)
    out = d.draft(compile_tree(chain(3)), 6, torch.zeros(4), [1, 5], SamplingParams(), None, d.new_index())
    assert out.tokens.tolist() == [6, 7, 8, 2]  # (5, 6) -> 7, (6, 7) -> 8, (7, 8) -> 2
    alone = CopyDrafter(depth=3)
    short = alone.draft(compile_tree(chain(3)), 6, torch.zeros(4), [1, 5], SamplingParams(), None, alone.new_index())
    assert short.tokens.tolist() == [6]


def _store(tmp_path, train, val):
    """A store directory with one train and one val shard (prompt of 1 token each)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, (split, seqs) in enumerate((("train", train), ("val", val))):
        name = f"shard-{i:05d}.npz"
        write_store_shard(tmp_path / name, encode_shard(seqs, [1] * len(seqs), {}, 64))
        shards.append({"file": name, "split": split, "sequences": len(seqs)})
    manifest = new_manifest("tiny", 64)
    manifest["shards"] = shards
    write_manifest(tmp_path, manifest)
    return tmp_path


def test_store_replies_reads_train_replies_only(tmp_path):
    store = _store(tmp_path, [[60, 1, 2, 3], [61, 4, 5]], [[62, 7, 8, 9]])
    assert [r.tolist() for r in store_replies(store)] == [[1, 2, 3], [4, 5]]  # prompts and val left out
    with pytest.raises(CadenceError, match="not a readable self-distilled store"):
        store_replies(tmp_path / "nothing")
    (tmp_path / "shard-00000.npz").write_bytes(b"garbage")
    with pytest.raises(CadenceError, match="cannot read shard"):
        store_replies(store)


def test_decoding_with_a_datastore_is_lossless_and_uses_it(tmp_path, monkeypatch):
    """The store holds the tiny model's own greedy reply to the same prompt: its copies run ahead
    of the request's own, and every output equals plain decoding."""
    from tiny import tiny_backbone

    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))  # the built tables go there, not to ~/.cache

    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    cfg = GenerationConfig(max_new_tokens=48)
    seen = Engine(bb).generate([3, 1, 4], cfg).tokens
    store = _store(tmp_path, [[0] + seen] * 2, [[0, 1]])
    prompt = [3, 1, 4]  # the reply the store holds: its copies run ahead of the request's own
    plain = Engine(bb).generate(prompt, cfg)
    spec = MethodSpec(method=Method.NGRAM, datastore=str(store))
    with_store = make_engine(bb, spec).generate(prompt, cfg)
    without = make_engine(bb, MethodSpec(method=Method.NGRAM)).generate(prompt, cfg)
    assert with_store.tokens == plain.tokens == without.tokens
    assert with_store.stats.steps < without.stats.steps
    heads = make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random", datastore=str(store)))
    assert heads.generate(prompt, cfg).tokens == plain.tokens
    sampled = make_engine(bb, spec).generate(prompt, GenerationConfig(max_new_tokens=12, temperature=0.8, seed=3))
    assert len(sampled.tokens) == 12
    assert load_datastore(str(store)) is load_datastore(str(store))  # built once per process


def test_a_datastore_without_copies_is_refused(tmp_path, monkeypatch):
    from tiny import tiny_backbone

    bb = tiny_backbone("llama", vocab=16, tokenizer=False)
    with pytest.raises(CadenceError, match="needs --copy"):
        make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random", copy=False, datastore=str(tmp_path)))
    with pytest.raises(CadenceError, match="not a readable"):
        make_engine(bb, MethodSpec(method=Method.NGRAM, datastore=str(tmp_path / "none")))


def test_the_built_tables_are_cached_on_disk_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    store = _store(tmp_path / "store", [[60, 1, 2, 3, 4], [61, 1, 2, 3, 4]], [[62, 7]])
    build = load_datastore.__wrapped__  # past the per-process memo
    first = build(str(store))
    cached = list((tmp_path / "cache" / "datastore").glob("store-*.npz"))
    assert len(cached) == 1 and first.lookup([1, 2]) == 3
    again = build(str(store))
    assert again.lookup([1, 2, 3]) == 4 and again.tokens == first.tokens == 8 and len(again) == len(first)
    other = build(str(store), DatastoreConfig(min_count=3))  # another config: another entry
    assert other.lookup([1, 2]) is None and len(list(cached[0].parent.glob("*.npz"))) == 2
    cached[0].write_bytes(b"garbage")
    assert build(str(store)).lookup([1, 2]) == 3
