"""Shards -> packed rows, features from the backbone or the hidden cache, bad input."""

from pathlib import Path

import pytest
import torch

from cadence.backbone.load import load_backbone
from cadence.errors import CadenceError
from cadence.training.batches import Corpus, RowDataset, collate, pack, segments, to_batch
from cadence.training.hidden_cache import build_cache, open_cache
from test_training_support import make_data, tiny_model_dir


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tdata")
    model = tiny_model_dir(root)
    return {"root": root, "model": model, "data": make_data(root / "data"), "backbone": load_backbone(str(model))}


def _files(data, split):
    import json
    return [s["file"] for s in json.loads((data / "manifest.json").read_text())["shards"] if s["split"] == split]


def test_segments_and_packing(env):
    corpus = Corpus(env["data"], _files(env["data"], "train"), 260)
    K, max_len = 3, 24
    segs = segments(corpus, K, max_len)
    assert len(segs) == len(corpus.seqs)  # every synthetic sequence has a reply
    for sg in segs:
        ref = corpus.seqs[sg.seq]
        assert sg.start == max(0, ref.plen - 1 - K)
        assert sg.length == min(ref.length - sg.start, max_len)
    rows = pack(segs, max_len, seed=0)
    assert all(sum(s.length for s in r) <= max_len for r in rows)
    assert sorted(s.seq for r in rows for s in r) == list(range(len(segs)))
    assert [[s.seq for s in r] for r in rows] == [[s.seq for s in r] for r in pack(segs, max_len, seed=0)]
    item = RowDataset(corpus, rows)[0]
    p = 0
    for j, sg in enumerate(rows[0]):
        ref = corpus.seqs[sg.seq]
        toks = corpus.seq_tokens(ref)
        assert torch.equal(item["ids"][p:p + sg.length], toks[sg.start:sg.start + sg.length])
        assert (item["seg"][p:p + sg.length] == j).all()
        assert item["reply"][p:p + sg.length].tolist() == [sg.start + i >= ref.plen for i in range(sg.length)]
        p += sg.length


def test_topk_rows_map_to_positions(tmp_path):
    data = make_data(tmp_path / "d", n_train=4, n_val=0, topk=3)
    corpus = Corpus(data, _files(data, "train"), 260)
    rows = [[sg] for sg in segments(corpus, 2, 64)]
    ds = RowDataset(corpus, rows, topk=True)
    for i, row in enumerate(rows):
        ref = corpus.seqs[row[0].seq]
        item = ds[i]
        tids = corpus.topk[ref.shard][0]
        for q in range(row[0].length):
            pos = row[0].start + q
            if ref.plen - 1 <= pos < ref.length - 1:  # stored row r <-> position plen - 1 + r
                assert item["topk_ok"][q]
                assert torch.equal(item["topk_ids"][q], tids[ref.topk_row + pos - (ref.plen - 1)])
            else:
                assert not item["topk_ok"][q]


def test_missing_and_corrupt_shards(env, tmp_path):
    data = make_data(tmp_path / "d", n_train=4, n_val=0)
    name = _files(data, "train")[0]
    (data / name).write_bytes(b"not a safetensors file")
    with pytest.raises(CadenceError, match="corrupt"):
        Corpus(data, [name], 260)
    (data / name).unlink()
    with pytest.raises(CadenceError, match="missing"):
        Corpus(data, [name], 260)
    # token ids beyond the vocabulary: data made for another model
    with pytest.raises(CadenceError, match="vocabulary"):
        Corpus(env["data"], _files(env["data"], "train"), 100)


def test_cache_matches_backbone_features_and_checks_backbone(env, tmp_path):
    bb, data = env["backbone"], env["data"]
    files = _files(data, "train")[:1]
    cache = build_cache(tmp_path / "cache", bb, data, files, dtype="float32", progress=False)
    corpus = Corpus(data, files, 260)
    rows = pack(segments(corpus, 3, 64), 64, seed=0)[:3]
    boundary = (16, 2.0)
    direct = to_batch(collate([RowDataset(corpus, rows)[i] for i in range(3)]), "cpu", backbone=bb,
                      need_argmax=True, boundary=boundary)
    cached = to_batch(collate([RowDataset(corpus, rows, cache, True, boundary)[i] for i in range(3)]), "cpu")
    valid = direct.seg >= 0
    assert torch.allclose(direct.hidden[valid], cached.hidden[valid].float(), atol=1e-4)
    assert torch.equal(direct.argmax[valid], cached.argmax[valid])
    assert torch.equal(direct.boundary[valid], cached.boundary[valid])
    # reopening checks backbone and coverage
    open_cache(tmp_path / "cache", bb, data, files)
    with pytest.raises(CadenceError, match="lacks"):
        open_cache(tmp_path / "cache", bb, data, _files(data, "train"))
    # another model under the same name (same directory name, other weights): the fingerprint tells
    other = load_backbone(str(tiny_model_dir(env["root"] / "alt", seed=1, name=env["model"].name)))
    assert other.name == bb.name
    with pytest.raises(CadenceError, match="made by backbone"):
        open_cache(tmp_path / "cache", other, data, files)
    with pytest.raises(CadenceError, match="made by backbone"):
        build_cache(tmp_path / "cache", other, data, files, progress=False)


def test_merge_datasets_links_train_shards_and_takes_val_from_the_first(tmp_path):
    from cadence.cli import main
    from cadence.training.data import load_manifest

    a = make_data(tmp_path / "a", n_train=20, n_val=4, seed=1)
    b = make_data(tmp_path / "b", n_train=20, n_val=4, seed=2)
    ma, mb = load_manifest(a), load_manifest(b)
    assert main(["merge-data", "--out", str(tmp_path / "m"), str(a), f"{b}:1"]) == 0
    m = load_manifest(tmp_path / "m")
    train_a = [s for s in ma["shards"] if s["split"] == "train"]
    train_b = [s for s in mb["shards"] if s["split"] == "train"][:1]
    val_a = [s for s in ma["shards"] if s["split"] == "val"]
    assert [s["split"] for s in m["shards"]].count("val") == len(val_a)
    assert sum(s["reply_tokens"] for s in m["shards"] if s["split"] == "train") == \
        sum(s["reply_tokens"] for s in train_a + train_b)
    for s in m["shards"]:  # every entry is a readable link to a source shard
        assert (tmp_path / "m" / s["file"]).resolve().parent in {a.resolve(), b.resolve()}
        Corpus(tmp_path / "m", [s["file"]])
    assert main(["merge-data", "--out", str(tmp_path / "m2"), f"{a}:x"]) == 2
