"""`cadence calibrate`: measured acceptance -> grown trees -> measured latency -> stored tree."""

import json

import torch

from cadence.calibrate import CalibrateConfig, calibrate, rank_table
from cadence.heads import load_heads, new_heads, save_heads
from cadence.methods import Method, MethodSpec, make_engine
from cadence.training.trainer import train
from test_training_support import base_config, make_data, tiny_model_dir


def _setup(tmp_path):
    from cadence.backbone import load_backbone

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
                                    context=32, reps=2, model=str(model), device="cpu"), backbone=bb)
    assert [r["budget"] for r in rep["trees"]] == [0, 1, 3]
    assert all(r["latency_ms"] > 0 for r in rep["trees"])
    best = max(rep["trees"], key=lambda r: r["expected_tok_s"])
    conf = json.loads((hdir / "config.json").read_text())
    assert len(conf["tree"]) == best["budget"] and conf["acceptance"] == rep["acceptance"]
    assert (hdir / "calibration.json").is_file()
    engine = make_engine(bb, MethodSpec(method=Method.MTP, heads=str(hdir), tree="auto"))
    tree = engine.scheduler.choose()
    assert tree.size == best["budget"] + 1
    # calibrated heads still decode losslessly
    ids = bb.encode_prompt("abc", chat=True)
    from cadence.engine import Engine, GenerationConfig
    cfg = GenerationConfig(max_new_tokens=20)
    assert engine.generate(ids, cfg).tokens == Engine(bb).generate(ids, cfg).tokens
    assert load_heads(hdir, bb).cfg.tree == conf["tree"]
