"""The training-ablation runner (benchmarks/training/ablate_training.py) end to end on a tiny model."""

import json
import sys
from pathlib import Path

import pytest
from test_training_support import make_data, tiny_model_dir

from cadence.errors import CadenceError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "training"))
import ablate_report as R
import ablate_training as A

CELLS = ["sd-1x-ce", "ref-1x-ce+adamtp"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablate")
    model = tiny_model_dir(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count {i} {i + 1}"}) + "\n" for i in range(2)))
    cfg = A.AblateConfig(out=str(root / "grid"), pool=str(root / "pool"), store=str(make_data(root / "sd")),
                         reference=str(make_data(root / "ref", seed=1)), cache=str(root / "cache"),
                         val_percent=25, cells=CELLS, steps=4, batch_size=2, max_len=64, warmup_steps=1,
                         draft_vocab=40, bf16=False, eval_every=2, calib_tokens=200, calib_budgets=[1, 2],
                         calib_reps=1, tasks=["custom"], custom=str(prompts), limit=2, max_new_tokens=8,
                         in_process=True, model=str(model), progress=False)
    manifest = A.prepare(cfg)
    logs: list[str] = []
    results = A.run_grid(cfg, log=logs.append)
    return {"root": root, "cfg": cfg, "manifest": manifest, "results": results, "logs": logs}


def test_pool_splits_by_prompt_and_matches_token_budgets(grid):
    shards = grid["manifest"]["shards"]
    val = [s for s in shards if s["split"] == "val"]
    assert len(val) == 1 and val[0]["sequences"] > 0
    sd = [s["reply_tokens"] for s in shards if s.get("source") == "sd" and s["split"] == "train"]
    ref = [s["reply_tokens"] for s in shards if s.get("source") == "ref"]
    assert len(sd) == len(ref) == 4
    assert sum(ref) <= sum(sd)  # reference data never exceeds the self-distilled budget
    assert max(sd) - min(sd) <= 30  # parts are balanced to within one sequence
    sets = Path(grid["cfg"].pool) / "sets"
    half = json.loads((sets / "sd-0.5x" / "manifest.json").read_text())
    assert [s["file"] for s in half["shards"]] == ["sd-0.safetensors", "sd-1.safetensors", A.VAL]
    mix = json.loads((sets / "mix-1x" / "manifest.json").read_text())
    assert sorted(s["source"] for s in mix["shards"] if s["split"] == "train") == ["ref", "ref", "sd", "sd"]


def test_grid_records_every_cell_with_its_metrics(grid):
    res = grid["results"]
    assert list(res) == CELLS
    for name in CELLS:
        r = res[name]
        assert r["train"]["step"] == 4 and r["train"]["tokens"] > 0
        assert len(r["heldout"]["top1"]) == 3 and 1.0 <= r["heldout"]["tau"] <= 4.0
        assert [c["step"] for c in r["curve"]] == [2, 4] and all(c["tokens"] for c in r["curve"])
        assert set(r["bench"]) == {"vanilla", "hydra+static/nocopy", "hydra:chain+static/nocopy"}
        assert r["bench"]["vanilla"]["speedup"] == pytest.approx(1.0)
        assert all(v["identical_rate"] == 1.0 for v in r["bench"].values())  # lossless
    # each cell trained on its own data set, with the same draft vocabulary
    cfg = grid["cfg"]
    heads = [json.loads((Path(cfg.out) / "cells" / n / "heads" / "config.json").read_text()) for n in CELLS]
    assert heads[0]["training"]["data"].endswith("sd-1x") and heads[1]["training"]["data"].endswith("ref-1x")
    assert heads[1]["training"]["loss"] == "ce+adamtp"
    assert heads[0]["training"]["draft_vocab_from"] == heads[1]["training"]["draft_vocab_from"]
    from safetensors.torch import load_file
    vocabs = [load_file(str(Path(cfg.out) / "cells" / n / "heads" / "heads.safetensors"))["draft_vocab"] for n in CELLS]
    assert vocabs[0].tolist() == vocabs[1].tolist()


def test_rerun_skips_recorded_cells(grid):
    path = Path(grid["cfg"].out) / A.RESULTS
    before = path.read_text()
    logs: list[str] = []
    A.run_grid(grid["cfg"], log=logs.append)
    assert all("recorded, skipped" in line for line in logs) and len(logs) == len(CELLS)
    assert path.read_text() == before


def test_rerun_with_other_settings_is_refused(grid):
    import dataclasses

    with pytest.raises(CadenceError, match="other settings"):
        A.run_grid(dataclasses.replace(grid["cfg"], steps=5), log=lambda m: None)


def test_table_matches_the_recorded_json(grid, tmp_path):
    doc = tmp_path / "ablations.md"
    doc.write_text("# Ablations\n\nhand-written text stays.\n")
    R.write_report(grid["cfg"], doc, tmp_path / "plots")
    text = doc.read_text()
    assert text.startswith("# Ablations\n\nhand-written text stays.")
    rows = R.parse_table(text)
    assert set(rows) == set(CELLS)
    for name in CELLS:
        r = grid["results"][name]
        row = dict(zip(R.COLUMNS, rows[name]))
        assert row["top-1 (h1/h2/h3)"] == " / ".join(f"{x:.3f}" for x in r["heldout"]["top1"])
        assert row["expected tau"] == f"{r['heldout']['tau']:.3f}"
        assert row["measured tau (tree)"] == f"{r['bench']['hydra+static/nocopy']['tau']:.2f}"
        assert row["speedup (chain)"] == f"{r['bench']['hydra:chain+static/nocopy']['speedup']:.2f}x"
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["adamtp_c.png", "budget.png", "curves.png"]
    # regenerating replaces the section instead of appending a second one
    R.write_report(grid["cfg"], doc, tmp_path / "plots")
    assert doc.read_text().count(R.BEGIN) == 1


def test_unknown_cell_is_a_clear_error(grid):
    import dataclasses

    with pytest.raises(CadenceError, match="unknown cell"):
        A.run_grid(dataclasses.replace(grid["cfg"], cells=["sd-9x-ce"]), log=lambda m: None)


def test_remeasure_redoes_calibration_and_bench_and_keeps_the_training(grid, tmp_path):
    """A cell whose timing shared the machine is measured again: new calibrated / bench
    fields, the old ones under ``replaced``, training and held-out numbers untouched."""
    import dataclasses
    import shutil

    out = tmp_path / "grid"
    shutil.copytree(grid["cfg"].out, out)
    cfg = dataclasses.replace(grid["cfg"], out=str(out))
    before = A.load_results(out)
    (out / "cells" / "sd-1x-ce" / "bench" / "marker").write_text("old bench")
    after = A.remeasure(cfg, ["sd-1x-ce"])
    a, b = before["sd-1x-ce"], after["sd-1x-ce"]
    assert b["replaced"]["bench"] == a["bench"] and b["replaced"]["calibrated"] == a["calibrated"]
    assert (b["heldout"], b["train"], b["curve"]) == (a["heldout"], a["train"], a["curve"])
    assert set(b["bench"]) == set(a["bench"]) and b["seconds"]["train"] == a["seconds"]["train"]
    assert not (out / "cells" / "sd-1x-ce" / "bench" / "marker").exists()  # a fresh benchmark
    assert after["ref-1x-ce+adamtp"] == before["ref-1x-ce+adamtp"]
    with pytest.raises(CadenceError, match="not recorded"):
        A.remeasure(cfg, ["sd-0.25x-ce"])
