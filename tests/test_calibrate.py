"""`cadence calibrate`: measured acceptance -> grown trees -> measured latency -> stored tree."""

import json

import pytest

from cadence.calibration.acceptance import rank_table
from cadence.calibration.command import CalibrateConfig, calibrate
from cadence.decode.generation import GenerationConfig
from cadence.heads import load_heads, new_heads, save_heads
from cadence.costs.latency import LatencyCurve
from cadence.costs.tree_choice import best_tree
from cadence.methods import Method, MethodSpec, make_engine
from cadence.training.trainer import train
from test_training_support import base_config, make_data, tiny_model_dir


def _setup(tmp_path):
    from cadence.backbone.load import load_backbone

    model = tiny_model_dir(tmp_path)
    data = make_data(tmp_path / "data", n_train=40, n_val=8)
    return load_backbone(str(model), device="cpu"), model, data


def test_acceptance_of_untrained_and_trained_heads(tmp_path):
    bb, model, data = _setup(tmp_path)
    fresh = new_heads("hydra", bb, 2, random=True)
    acc = rank_table(bb, fresh, data, tokens=500, ranks=4)
    assert len(acc) == 2 and all(len(r) == 4 for r in acc)
    assert all(0 <= v <= 1 for r in acc for v in r) and all(sum(r) <= 1 + 1e-6 for r in acc)
    # two independent implementations agree: head 1's rank-0 acceptance is the trainer's
    # held-out top-1 (same positions: t >= prompt_len - 1, target = data token)
    res = train(base_config(data, tmp_path / "run", model, steps=30, num_heads=2, lr=1e-2, eval_every=0),
                backbone=bb)
    trained = rank_table(bb, res.heads.eval(), data, tokens=10_000, ranks=4)
    assert abs(trained[0][0] - res.summary["heldout"]["top1"][0]) < 1e-4


def test_calibrate_stores_a_tree_that_auto_uses(tmp_path):
    bb, model, data = _setup(tmp_path)
    heads = new_heads("mtp", bb, 2, random=True)
    hdir = save_heads(heads, tmp_path / "heads")
    rep = calibrate(CalibrateConfig(heads=str(hdir), data=str(data), tokens=300, ranks=3, budgets=[1, 3],
                                    context=32, reps=2, model=str(model), device="cpu", copy_depth=4),
                    backbone=bb)
    assert [(r["drafter"], r["budget"]) for r in rep["trees"]] == [
        ("heads", 0), ("heads", 1), ("heads", 3), ("copy", 1), ("copy", 3)]
    assert all(r["latency_ms"] > 0 for r in rep["trees"])
    assert len(rep["acceptance"]) == 2 and len(rep["copy_acceptance"]) == 4  # copies reach depth 4
    assert all(v == 0 for row in rep["copy_acceptance"][2:] for v in row[1:])  # past K: the copy only
    conf = json.loads((hdir / "draft_config.json").read_text())  # the policy, apart from the weights
    assert not {"tree", "acceptance", "copy_tree", "copy_acceptance"} & set(json.loads((hdir / "config.json").read_text()))
    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig
    ids = bb.encode_prompt("abc", chat=True)
    cfg = GenerationConfig(max_new_tokens=20)
    ref = Engine(bb).generate(ids, cfg).tokens
    flat = LatencyCurve([1, 64], [0.01, 0.01])  # verification free: auto takes the largest useful tree
    steep = LatencyCurve([1, 2, 64], [0.01, 0.05, 1.0])  # a draft node costs 4 tokens: never speculate
    for name, key, copy in [("heads", "tree", False), ("copy", "copy_tree", True)]:
        rows = [r for r in rep["trees"] if r["drafter"] == name or r["budget"] == 0]
        best = max(rows, key=lambda r: r["expected_tok_s"])
        assert len(conf[key]) == best["budget"] == rep["chosen"][name]["budget"]
        table = conf["copy_acceptance" if copy else "acceptance"]
        spec = MethodSpec(method=Method.MTP, heads=str(hdir), tree="auto", copy=copy, scheduler="static")
        engine = make_engine(bb, spec, latency=flat)
        tree = engine.new_scheduler(GenerationConfig().sampling).plan.tree
        want = best_tree(table, flat, engine.tree_policy.draft_s, 2, len(table)).paths
        assert list(tree.paths) == want
        assert engine.generate(ids, cfg).tokens == ref  # calibrated heads still decode losslessly
        engine = make_engine(bb, spec, latency=steep)
        assert engine.new_scheduler(GenerationConfig().sampling).plan.tree.size == 1
    assert conf["acceptance"] == rep["acceptance"] and conf["copy_acceptance"] == rep["copy_acceptance"]
    assert (hdir / "calibration.json").is_file()
    assert load_heads(hdir, bb).policy.copy_tree == conf["copy_tree"]


def test_draft_config_rules_over_legacy_fields_and_a_bad_one_is_refused(tmp_path):
    """Heads saved before the split keep their tables in config.json (still read); a
    draft_config.json beside them wins; a malformed one is a clear error, not a traceback;
    saving calibrated heads writes draft_config.json and never the tables into config.json."""
    from cadence.errors import CadenceError

    bb, _, _ = _setup(tmp_path)
    hdir = save_heads(new_heads("hydra", bb, 2, random=True), tmp_path / "heads")
    conf = json.loads((hdir / "config.json").read_text())
    (hdir / "config.json").write_text(json.dumps({**conf, "acceptance": [[0.5], [0.4]]}))
    assert load_heads(hdir, bb).policy.acceptance == [[0.5], [0.4]]  # legacy heads
    (hdir / "draft_config.json").write_text(json.dumps({"acceptance": [[0.7], [0.6]]}))
    heads = load_heads(hdir, bb)
    assert heads.policy.acceptance == [[0.7], [0.6]] and heads.policy.calibrated
    save_heads(heads, tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "draft_config.json").read_text())["acceptance"] == [[0.7], [0.6]]
    assert "acceptance" not in json.loads((tmp_path / "copy" / "config.json").read_text())
    (hdir / "draft_config.json").write_text("{not json")
    with pytest.raises(CadenceError, match="draft_config.json is malformed"):
        load_heads(hdir, bb)
    assert not load_heads(save_heads(new_heads("hydra", bb, 2), tmp_path / "fresh"), bb).policy.calibrated


def test_auto_n_trees_grow_from_the_stored_acceptance(tmp_path):
    from cadence.errors import CadenceError
    from cadence.trees.tree import grow_tree

    bb, model, data = _setup(tmp_path)
    hdir = save_heads(new_heads("hydra", bb, 2, random=True), tmp_path / "heads")
    with pytest.raises(CadenceError, match="cadence calibrate"):
        make_engine(bb, MethodSpec(method=Method.HYDRA, heads=str(hdir), tree="auto-4"))
    conf = json.loads((hdir / "config.json").read_text())
    conf.update(acceptance=[[0.5, 0.2], [0.4, 0.1]],
                copy_acceptance=[[0.6, 0.2], [0.5, 0.1], [0.8, 0.0], [0.9, 0.0]])
    (hdir / "config.json").write_text(json.dumps(conf))
    for copy, table in [(False, conf["acceptance"]), (True, conf["copy_acceptance"])]:
        eng = make_engine(bb, MethodSpec(method=Method.HYDRA, heads=str(hdir), tree="auto-5", copy=copy))
        tree = eng.new_scheduler(GenerationConfig().sampling).plan.tree
        assert tree.name == "auto-5" + ("+copy" if copy else "") and list(tree.paths) == grow_tree(table, 5)
    assert eng.new_scheduler(GenerationConfig().sampling).plan.tree.max_depth == 4  # copies reach past the 2 heads
    with pytest.raises(CadenceError, match="auto-N needs a node count"):
        make_engine(bb, MethodSpec(method=Method.HYDRA, heads=str(hdir), tree="auto-x"))
