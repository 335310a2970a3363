"""Backbone taps (intermediate decoder-layer outputs) and drafters that read them (EAGLE-3-style
feature fusion): both backbones tap the same states in every kind of forward without changing
them, hidden caches store and extend them, an eagle drafter grown with taps starts as the
drafter it was grown from, the batched engine drafts from the same taps as the serial one, and
export (no vLLM counterpart) refuses them.
Lossless decoding with taps drafters runs with the other attention heads (test_attention_heads,
kind "eagle-taps")."""

from __future__ import annotations

import pytest
import torch
from test_fast_model import close, pair

from cadence.errors import CadenceError


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_and_transformers_tap_the_same_layers(family):
    ref, fast = pair(family)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    a = ref.forward(ids, taps=(1,), need_logits=False)
    b = fast.forward(ids, taps=(1,), need_logits=False)
    assert a.taps.shape == (2, 9, 1, 64) and b.taps.shape == a.taps.shape
    close(a.taps, b.taps)
    close(a.hidden, b.hidden)
    # the tap is the residual stream after layer 1: not the final (normed) hidden state
    assert (a.taps[:, :, 0] - a.hidden).abs().max() > 1e-2
    plain = fast.forward(ids, need_logits=False)
    assert plain.taps is None
    close(plain.hidden, b.hidden)


@pytest.mark.parametrize("taps", [(0,), (2,), (1, 1), (-1,)])
def test_bad_taps_are_refused(taps):
    ref, fast = pair("llama")  # 2 layers: only layer 1 can be tapped
    ids = torch.zeros(1, 3, dtype=torch.long)
    for bb in (ref, fast):
        with pytest.raises(CadenceError, match="taps"):
            bb.forward(ids, taps=taps)


# ----------------------------------------------------------------------------- hidden cache


def test_cache_builds_and_extends_taps(tmp_path):
    from test_training_support import make_data  # tiny distilled store
    from cadence.training.hidden_cache import build_cache, open_cache
    from tiny import tiny_backbone

    bb = tiny_backbone(layers=3)
    data = make_data(tmp_path / "data")
    plain = build_cache(tmp_path / "cache", bb, data, progress=False)
    files = list(plain.meta["shards"])
    with pytest.raises(CadenceError, match="lacks taps"):
        open_cache(tmp_path / "cache", bb, data, files, taps=(1,))
    before = {f: plain.read(f, "hidden", 0, 5).clone() for f in files}
    build_cache(tmp_path / "cache", bb, data, progress=False, taps=(2,))
    build_cache(tmp_path / "cache", bb, data, progress=False, taps=(1,))  # keeps 2, adds 1
    c = open_cache(tmp_path / "cache", bb, data, files, taps=(1, 2))
    assert all(c.meta["shards"][f]["taps"] == [1, 2] for f in files)
    assert c.tap_index((2,)) == {f: [1] for f in files}
    f = files[0]
    n = c.meta["shards"][f]["tokens"]
    torch.testing.assert_close(c.read(f, "hidden", 0, 5), before[f])
    # the cached taps are the backbone's own, sequence by sequence
    from cadence.training.data import iter_sequences, read_shard

    ids = next(iter_sequences(read_shard(data / f)))[0]
    want = bb.forward(ids[None], need_logits=False, taps=(1, 2)).taps[0]
    got = c.read(f, "taps", 0, ids.numel()).float()
    assert got.shape == (ids.numel(), 2, bb.hidden_size) and n >= ids.numel()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 cache


# ----------------------------------------------------------------------------- eagle heads with taps


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from test_training_support import make_data, tiny_model_dir

    from cadence.backbone.load import load_backbone

    root = tmp_path_factory.mktemp("taps")
    model = tiny_model_dir(root)  # 2 decoder layers: layer 1 is the one tap
    return {"root": root, "model": model, "data": make_data(root / "data"), "backbone": load_backbone(str(model))}


def _features(heads, bb, ids, taps=None):
    fwd = bb.forward(ids, need_logits=False, taps=(1,))
    return heads.train_features(fwd.hidden, ids, taps=fwd.taps if taps else None)


def test_added_taps_start_as_the_drafter_and_then_train(env):
    from cadence.heads import new_heads

    bb = env["backbone"]
    heads = new_heads("eagle", bb, 3, random=True, seed=3)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(5))
    before = _features(heads, bb, ids)
    heads.add_taps([1])
    assert heads.cfg.taps == [1] and heads.fc.weight.shape == (64, 3 * 64)
    with pytest.raises(CadenceError, match="train them with those taps"):
        _features(heads, bb, ids)
    after = _features(heads, bb, ids, taps=True)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)
    sum(f.square().sum() for f in after).backward()
    assert heads.fc.weight.grad[:, 2 * 64:].abs().sum() > 0  # the tap's columns learn
    with pytest.raises(CadenceError, match="already read taps"):
        heads.add_taps([1])


def test_taps_round_trip_and_refuse_drafting_and_export(env, tmp_path):
    from cadence.draft.head_drafter import HeadDrafter
    from cadence.heads.export import export_heads
    from cadence.heads import load_heads, new_heads, save_heads

    bb = env["backbone"]
    plain = save_heads(new_heads("eagle", bb, 3, random=True), tmp_path / "plain")
    assert "taps" not in (plain / "config.json").read_text()  # older configs stay as they were
    heads = new_heads("eagle", bb, 3, random=True, taps=[1])
    back = load_heads(save_heads(heads, tmp_path / "tapped"), bb)
    assert back.cfg.taps == [1]
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    for a, b in zip(_features(heads, bb, ids, True), _features(back, bb, ids, True)):
        torch.testing.assert_close(a, b)
    assert HeadDrafter(back).taps == (1,)
    with pytest.raises(CadenceError, match="not exportable"):
        export_heads(tmp_path / "tapped", "eagle", tmp_path / "out")


def test_training_grows_taps_from_a_drafter_without_them_and_resumes(env, tmp_path):
    from test_training_support import base_config

    from cadence.heads import load_heads, new_heads, save_heads
    from cadence.training.trainer import train

    bb = env["backbone"]
    start = save_heads(new_heads("eagle", bb, 3, random=True, seed=1), tmp_path / "start")
    kw = dict(kind="eagle", init_from=str(start), taps=(1,), cache_hidden=str(tmp_path / "cache"), steps=8,
              eval_every=8, save_every=3, feature_loss=0.5)
    full = train(base_config(env["data"], tmp_path / "full", env["model"], **kw), backbone=bb)
    heads = load_heads(tmp_path / "full" / "heads", bb)
    assert heads.cfg.taps == [1] and heads.fc.weight.shape[1] == 3 * 64
    assert heads.fc.weight[:, 2 * 64:].abs().sum() > 0  # trained, not left at zero
    part = train(base_config(env["data"], tmp_path / "res", env["model"], stop_after=5, **kw), backbone=bb)
    assert part.status == "stopped"
    rest = train(base_config(env["data"], tmp_path / "res", env["model"], **kw), backbone=bb)
    assert all(torch.equal(a, b) for a, b in zip(full.heads.state_dict().values(), rest.heads.state_dict().values()))
    # without a cache the backbone taps itself (same run, features computed on the fly)
    live = train(base_config(env["data"], tmp_path / "live", env["model"], **{**kw, "cache_hidden": ""}), backbone=bb)
    assert live.status == "finished" and live.heads.cfg.taps == [1]


@pytest.mark.parametrize("bad, match", [
    (dict(kind="hydra", taps=(1,)), "eagle heads only"),
    (dict(kind="eagle", taps=(1, 1)), "increasing"),
    (dict(kind="eagle", taps=(5,)), "taps"),  # the tiny backbone has 2 layers
])
def test_bad_taps_settings_are_clear_errors(env, tmp_path, bad, match):
    from test_training_support import base_config

    from cadence.training.trainer import train

    with pytest.raises(CadenceError, match=match):
        train(base_config(env["data"], tmp_path / "x", env["model"], **bad), backbone=env["backbone"])


def test_init_from_a_drafter_with_other_taps_is_refused(env, tmp_path):
    from test_training_support import base_config

    from cadence.heads import new_heads, save_heads
    from cadence.training.trainer import train

    start = save_heads(new_heads("eagle", env["backbone"], 3, random=True, taps=[1]), tmp_path / "t1")
    with pytest.raises(CadenceError, match="not changed"):
        train(base_config(env["data"], tmp_path / "x", env["model"], kind="eagle", init_from=str(start)),
              backbone=env["backbone"])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_taps_through_decode_and_tree_verify_match_transformers_and_change_nothing(family):
    from test_fast_model import tree_mask

    ref, fast = pair(family)
    g = torch.Generator().manual_seed(3)
    prompt, tree = torch.randint(0, 256, (1, 11), generator=g), torch.randint(0, 256, (1, 4), generator=g)
    parents = [-1, 0, 0, 1]
    pos = torch.tensor([[11, 12, 12, 13]])
    outs = {}
    for name, bb in (("ref", ref), ("fast", fast), ("fast-plain", fast)):
        taps = () if name == "fast-plain" else (1,)
        cache = bb.new_cache()
        a = bb.forward(prompt, cache, taps=taps)
        b = bb.forward(tree, cache, pos, tree_mask(parents), taps=taps)
        c = bb.forward(tree[:, :1], cache, taps=taps)  # a one-token decode step
        outs[name] = (a, b, c)
    for x, y, z in zip(outs["ref"], outs["fast"], outs["fast-plain"]):
        close(x.taps, y.taps)
        close(x.logits, y.logits)
        assert torch.equal(y.logits, z.logits) and z.taps is None  # tapping changes nothing


def test_taps_in_the_bf16_listed_verify_change_nothing():
    """bf16 row-consistent forwards (the C++ loop, listed attention where built): taps of a
    tree verify are the states a tap-free forward passes through (its logits bit-identical)."""
    from test_fast_model import FAMILIES, tree_mask

    from cadence.fast.model import FastBackbone
    from tiny import byte_tokenizer

    runs = []
    for taps in ((), (1,)):
        torch.manual_seed(0)
        bb = FastBackbone(FAMILIES["llama"]().to(torch.bfloat16), byte_tokenizer(), "fast")
        cache = bb.new_cache()
        g = torch.Generator().manual_seed(7)
        bb.forward(torch.randint(0, 256, (1, 9), generator=g), cache, taps=taps)
        out = bb.forward(torch.randint(0, 256, (1, 4), generator=g), cache, torch.tensor([[9, 10, 10, 11]]),
                         tree_mask([-1, 0, 0, 1]), taps=taps)
        runs.append(out)
    assert torch.equal(runs[0].logits, runs[1].logits)
    assert runs[1].taps.shape == (1, 4, 1, 64) and runs[1].taps.dtype == torch.bfloat16
    assert torch.isfinite(runs[1].taps.float()).all() and runs[1].taps.abs().sum() > 0


def test_calibration_ranks_of_a_drafter_grown_by_taps_are_its_own(env):
    """``cadence calibrate``'s teacher-forced ranks tap the backbone for heads that read taps;
    zero-weight taps rank exactly as the drafter they were grown from."""
    import copy

    from cadence.calibration.acceptance import sequence_ranks
    from cadence.heads import new_heads

    bb = env["backbone"]
    plain = new_heads("eagle", bb, 3, random=True, seed=4).eval()
    grown = copy.deepcopy(plain).add_taps([1]).bind(bb).eval()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = sequence_ranks(bb, plain, ids, 8, 4)
        b = sequence_ranks(bb, grown, ids, 8, 4)
    assert all(torch.equal(x, y) for x, y in zip(a.plain, b.plain))


# ----------------------------------------------------------------------------- batched engine


class _Spy:
    """A drafter that records every draft (context length, drafted tokens) per prompt."""

    def __init__(self, inner, prompts):
        self.inner, self.prompts, self.log = inner, prompts, {tuple(p): [] for p in prompts}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, tree, root, hidden, context, *args, **kw):
        d = self.inner.draft(tree, root, hidden, context, *args, **kw)
        key = next(p for p in self.log if tuple(context[:len(p)]) == p)
        self.log[key].append((len(context), root, d.tokens.tolist()))
        return d


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_rows_draft_from_the_same_taps_as_the_serial_engine(temperature, kind):
    """Three requests with a taps drafter through ``BatchEngine`` (2 slots: one joins
    later) give each request's tokens, steps and every draft of ``Engine`` run alone."""
    from tiny import tiny_backbone

    from cadence.batch.engine import BatchEngine
    from cadence.batch.narrow import NarrowConfig
    from cadence.draft.head_drafter import HeadDrafter
    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    from cadence.fast.model import FastBackbone
    from cadence.heads import new_heads
    from cadence.schedulers.static import StaticScheduler

    bb = FastBackbone.from_backbone(tiny_backbone("llama", layers=3))
    heads = new_heads(kind, bb, 3, random=True, seed=4, taps=[1, 2])
    if kind == "eagle":
        with torch.no_grad():  # make the taps matter: their fc columns are not small
            heads.fc.weight[:, 2 * 64:].normal_(0, 0.5, generator=torch.Generator().manual_seed(6))
    prompts = [[5, 9, 11, 3, 7, 9, 11, 3], [40, 41, 42], [7] * 12 + [100, 101]]
    cfg = GenerationConfig(max_new_tokens=24, temperature=temperature, seed=11)
    sched = StaticScheduler.from_preset("tree-8", 3)
    serial = _Spy(HeadDrafter(heads), prompts)
    refs = [Engine(bb, serial, lambda s: sched).generate(p, cfg) for p in prompts]
    batched = _Spy(HeadDrafter(heads), prompts)
    be = BatchEngine(bb, batched, lambda s: sched, max_batch=2, narrow=NarrowConfig(mode="none"))
    rids = [be.add(p, cfg) for p in prompts[:2]]
    toks, stats = {r: [] for r in rids}, {}
    while be.has_work():
        for ev in be.step():
            toks.setdefault(ev.rid, [])
            toks[ev.rid] += ev.tokens
            if ev.finished:
                stats[ev.rid] = ev.stats
        if len(rids) == 2 and len(stats) == 0:
            rids.append(be.add(prompts[2], cfg))
    for rid, p, ref in zip(rids, prompts, refs):
        assert toks[rid] == ref.tokens
        assert stats[rid].steps == ref.stats.steps
    assert batched.log == serial.log
    assert sum(len(v) for v in serial.log.values()) >= 12
