"""``cadence train-pipo`` and ``cadence generate --pipo`` end to end on a tiny model and store:
training resumes to the same weights, the directory decodes in both modes, everything is labelled
lossy, and bad input is a clear error (exit 2), never a traceback."""

from __future__ import annotations

import json
import re

import pytest
import torch

from cadence.cli import main
from tiny import save_tiny


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from cadence.training.store import Store

    root = tmp_path_factory.mktemp("pipo")
    model = root / "model"
    bb = save_tiny(model, "llama", seed=11)
    g = torch.Generator().manual_seed(0)
    seqs, plens = [], []
    for i in range(12):
        p = torch.randint(0, 250, (5 + i % 4,), generator=g).tolist()
        r = torch.randint(0, 250, (10,), generator=g).tolist()
        seqs.append(p + r)
        plens.append(len(p))
    store = root / "store"
    with Store(store, bb.name, bb.vocab_size, None) as st:
        st.append("train", seqs[:10], plens[:10], [f"k{i}" for i in range(10)], [f"h{i}" for i in range(10)],
                  ["test"] * 10, {"model": bb.name})
        st.append("val", seqs[10:], plens[10:], ["k10", "k11"], ["h10", "h11"], ["test"] * 2, {"model": bb.name})
    return {"model": str(model), "store": str(store), "root": root}


def _train(env, out, steps, extra=()):
    return main(["train-pipo", "--model", env["model"], "--data", env["store"], "--out", str(out),
                 "--steps", str(steps), "--batch-size", "3", "--max-reply", "6", "--no-bf16", "--no-progress",
                 "--checkpoint-every", "1", "--snapshots", "1", "--warmup-steps", "1", *extra])


def test_train_resumes_to_the_same_weights(env, tmp_path, capsys):
    from safetensors.torch import load_file

    assert _train(env, tmp_path / "a", 3) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 3 and (tmp_path / "a" / "step-000001").is_dir()
    assert _train(env, tmp_path / "b", 2) == 0
    assert _train(env, tmp_path / "b", 3) == 0  # resumes at step 2
    assert "resuming" in capsys.readouterr().out
    wa, wb = (load_file(str(tmp_path / x / "final" / "pipo.safetensors")) for x in ("a", "b"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-2, rtol=1e-2)
    log = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    cfg = json.loads((tmp_path / "a" / "final" / "config.json").read_text())
    assert cfg["lossy"] is True and cfg["training"]["step"] == 3
    # another shape in the same run directory is refused
    assert _train(env, tmp_path / "b", 4, ("--lora-rank", "2")) == 2
    assert "other settings" in capsys.readouterr().err


def test_generate_both_modes_labelled_lossy(env, tmp_path, capsys):
    assert _train(env, tmp_path / "r", 1) == 0
    capsys.readouterr()
    d = str(tmp_path / "r" / "final")
    for mode, extra in (("prompt", []), ("pairs", []), ("pairs", ["--pipo-accept", "verify"])):
        rc = main(["generate", "--model", env["model"], "--prompt", "hello", "--max-new-tokens", "6", "--json",
                   "--pipo", d, "--pipo-mode", mode, *extra])
        assert rc == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rec["lossy"] is True and rec["lossless"] is False and rec["method"] == "pipo"
        assert rec["pipo_mode"] == mode and "LOSSY" in rec["note"] and 1 <= rec["new_tokens"] <= 6
    assert main(["generate", "--model", env["model"], "--prompt", "hello", "--max-new-tokens", "4",
                 "--pipo", d]) == 0
    assert "LOSSY" in capsys.readouterr().err


def test_help_says_lossy(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert re.search(r"--pipo PIPO\s+LOSSY", out) and re.search(r"train-pipo|LOSSY", out)


@pytest.mark.parametrize("argv, message", [
    (["--pipo", "/nonexistent/dir"], "not a PIPO directory"),
    (["--pipo", "X", "--pipo-mode", "both"], "pipo-mode"),
    (["--pipo", "X", "--backend", "fast"], "transformers backend"),
    (["--pipo", "X", "--compare"], "compare"),
])
def test_generate_bad_input_is_a_clear_error(env, capsys, argv, message):
    rc = main(["generate", "--model", env["model"], "--prompt", "hi", "--max-new-tokens", "2", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_train_bad_input_is_a_clear_error(env, tmp_path, capsys):
    assert main(["train-pipo", "--model", env["model"], "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--steps", "1"]) == 2
    assert "not a self-distillation store" in capsys.readouterr().err
    assert main(["train-pipo", "--model", env["model"], "--data", env["store"], "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
