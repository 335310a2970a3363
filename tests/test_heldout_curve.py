"""benchmarks/training/heldout_curve.py: held-out evaluations placed at the tokens seen by their step."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "training"))
import heldout_curve as H


def _log(tmp_path: Path) -> Path:
    recs = [
        {"kind": "eval", "step": 0, "top1": [0.5, 0.4], "chain": [0.5, 0.2], "tau": 1.7, "positions": [10, 9]},
        {"kind": "train", "step": 10, "tokens": 1000},
        {"kind": "train", "step": 20, "tokens": 2100},
        {"kind": "eval", "step": 25, "top1": [0.6, 0.5], "chain": [0.6, 0.3], "tau": 1.9},
        {"kind": "train", "step": 30, "tokens": 3000},
        {"kind": "eval", "step": 30, "top1": [0.7, 0.6], "chain": [0.7, 0.42], "tau": 2.12},
    ]
    path = tmp_path / "train_log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def test_evaluations_sit_at_the_tokens_seen_by_their_step(tmp_path):
    pts = H.read_curve(_log(tmp_path))
    assert [(p["step"], p["tokens"]) for p in pts] == [(0, 0), (25, 2100), (30, 3000)]
    assert pts[-1]["top1"] == [0.7, 0.6] and pts[-1]["tau"] == 2.12


def test_the_script_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    out = tmp_path / "res" / "curve"
    monkeypatch.setattr(sys, "argv", ["heldout_curve.py", f"run={_log(tmp_path)}", "--out", str(out)])
    H.main()
    md = out.with_suffix(".md").read_text()
    assert "| run | 30 | 3,000 | 0.700 | 0.600 | 2.120 |" in md
    assert json.loads(out.with_suffix(".json").read_text())["run"][1]["tokens"] == 2100
    assert out.with_suffix(".png").stat().st_size > 0
    monkeypatch.setattr(sys, "argv", ["heldout_curve.py", "no-label", "--out", str(out)])
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        H.main()
