"""Heads without an acceptance table draft the top-1 chain only; the user is told, once per
engine, and how to calibrate them (a freshly trained set ran 1.41x uncalibrated against 1.75x
calibrated on the categories bench)."""

from __future__ import annotations

from tiny import tiny_backbone

from cadence.heads import new_heads, save_heads
from cadence.heads.tables import DraftPolicy, save_policy
from cadence.methods import Method, MethodSpec, make_engine
from cadence.verify.sampling import SamplingParams


def test_uncalibrated_heads_say_so_and_calibrated_ones_do_not(tmp_path, capsys):
    bb = tiny_backbone("llama")
    heads = new_heads("hydra", bb, 3, random=True, seed=1)
    bare = save_heads(heads, tmp_path / "bare")
    engine = make_engine(bb, MethodSpec(method=Method.HYDRA, heads=str(bare)))
    err = capsys.readouterr().err
    assert "no acceptance table" in err and "cadence calibrate" in err
    assert engine.tree_policy.tree_for(SamplingParams()).size == 4  # the root + a chain of 3

    made = save_heads(heads, tmp_path / "made")
    save_policy(made, DraftPolicy(tree=[[0], [0, 0]], acceptance=[[0.6, 0.1], [0.5, 0.1], [0.4, 0.1]]))
    make_engine(bb, MethodSpec(method=Method.HYDRA, heads=str(made), scheduler="static"))
    assert "no acceptance table" not in capsys.readouterr().err
    make_engine(bb, MethodSpec(method=Method.HYDRA, heads="random"))  # random heads are never calibrated
    assert "no acceptance table" not in capsys.readouterr().err
