"""``cadence generate`` end to end on a tiny saved model, and its error paths (exit 2, one line)."""

import json

import pytest
import torch
from tiny import save_tiny

from cadence.backbone.load import load_backbone
from cadence.cli import main
from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.heads import new_heads, save_heads

PROMPT = "Write a poem about the sea."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "tiny-model"
    save_tiny(d, "llama")
    return d


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_backbone(str(model_dir), "float32", "cpu")


def run(capsys, *argv):
    rc = main(["generate", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def json_lines(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def expected_text(bb, prompt, n):
    ids = bb.encode_prompt(prompt, chat=True)
    return Engine(bb).generate(ids, GenerationConfig(max_new_tokens=n)).text


def test_loaded_model_is_the_saved_one(loaded, model_dir):
    assert loaded.name == "tiny-model" and loaded.hidden_size == 64 and loaded.vocab_size == 260
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template
    assert loaded.eos_token_ids == {256}


def test_generate_json_vanilla(capsys, model_dir, loaded):
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", PROMPT, "--method", "vanilla",
                       "--max-new-tokens", 12, "--json")
    assert rc == 0, err
    [rec] = json_lines(out)
    assert rec["prompt"] == PROMPT and rec["method"] == "vanilla" and rec["heads"] is None
    assert rec["tree"] == "root" and rec["new_tokens"] == 12 and rec["steps"] == 12 and rec["tau"] == 1.0
    assert rec["text"] == expected_text(loaded, PROMPT, 12) and rec["datastore"] is None


def test_generate_json_names_the_datastore(capsys, tmp_path, monkeypatch, model_dir, loaded):
    from test_datastore import _store

    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    store = _store(tmp_path / "store", [[1, 5, 6, 7, 8], [1, 5, 6, 7, 8]], [[1, 2]])
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", PROMPT, "--method", "ngram", "--datastore",
                       str(store), "--max-new-tokens", 12, "--json")
    assert rc == 0, err
    [rec] = json_lines(out)
    assert rec["datastore"] == {"store": str(store), "reply_tokens": 8, "ngrams": 3}  # (5 6) -> 7, (6 7) -> 8, (5 6 7) -> 8
    assert rec["scheduler"] == "copy-chain" and rec["text"] == expected_text(loaded, PROMPT, 12)


@pytest.mark.parametrize("method, tree", [("hydra", "tree-8"), ("medusa", "chain"), ("mtp", "tree-16")])
def test_generate_json_random_heads_is_lossless(capsys, model_dir, loaded, method, tree):
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", PROMPT, "--method", method, "--heads", "random",
                       "--tree", tree, "--max-new-tokens", 16, "--json")
    assert rc == 0, err
    [rec] = json_lines(out)
    assert rec["method"] == method and rec["heads"] == "random" and rec["tree"] == tree + "+copy"
    assert rec["lossless"] is True and rec["mean_nodes"] > 1
    assert rec["new_tokens"] == 16 and rec["steps"] <= 16
    assert rec["text"] == expected_text(loaded, PROMPT, 16)
    # acceptance per depth: the share of steps that accepted at least d drafts, non-increasing
    acc = rec["acceptance_by_depth"]
    assert acc == [round(n / rec["steps"], 4) for n in rec["accepted_at_depth"]]
    assert all(0 <= b <= a <= 1 for a, b in zip(acc, acc[1:]))


def test_generate_with_saved_heads_and_prompt_file(capsys, tmp_path, model_dir, loaded):
    save_heads(new_heads("mtp", loaded, 2, random=True), tmp_path / "heads")
    pf = tmp_path / "prompts.jsonl"
    prompts = ["First prompt", "Second one, longer"]
    pf.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n\n")
    rc, out, err = run(capsys, "--model", model_dir, "--prompt-file", pf, "--method", "mtp",
                       "--heads", tmp_path / "heads", "--tree", "chain", "--max-new-tokens", 10, "--json")
    assert rc == 0, err
    recs = json_lines(out)
    assert [r["prompt"] for r in recs] == prompts
    for r in recs:
        assert r["text"] == expected_text(loaded, r["prompt"], 10) and r["tree"] == "chain+copy"


def test_generate_streams_text(capsys, model_dir, loaded):
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", PROMPT, "--method", "hydra", "--heads", "random",
                       "--tree", "tree-4", "--max-new-tokens", 12)
    assert rc == 0, err
    assert out.rstrip("\n") == expected_text(loaded, PROMPT, 12)
    assert "12 tokens" in err and "tau" in err
    assert err.rstrip().endswith(", float32]")  # the path that ran (the tiny model is no GGUF)


def test_the_summary_line_names_the_gguf_path():
    from types import SimpleNamespace

    from cadence.cli import path_label

    gguf = SimpleNamespace(dtype=torch.float32, quant="gguf", quant_reason="", kernels="gguf-avx2", dtype_reason="")
    assert path_label(gguf) == "float32 on gguf blocks"
    assert path_label(SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"


def test_sampling_flags_and_seed(capsys, model_dir):
    args = ["--model", model_dir, "--prompt", PROMPT, "--method", "medusa", "--heads", "random",
            "--tree", "tree-8", "--max-new-tokens", 14, "--temperature", 0.9, "--top-p", 0.9, "--json"]
    texts = []
    for seed in (3, 3):
        rc, out, err = run(capsys, *args, "--seed", seed)
        assert rc == 0, err
        texts.append(json_lines(out)[0]["text"])
    assert texts[0] == texts[1]


def _assert_error(rc, out, err, fragment):
    assert rc == 2
    assert "Traceback" not in err
    # transformers may draw a weight-loading progress bar first; the error is one line at the end
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("cadence: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert fragment in errors[0], err


def test_error_missing_model(capsys, tmp_path):
    _assert_error(*run(capsys, "--model", tmp_path / "nope", "--prompt", "hi"), "does not exist")


def test_error_unsupported_file(capsys, tmp_path):
    f = tmp_path / "model.txt"
    f.write_text("hello")
    _assert_error(*run(capsys, "--model", f, "--prompt", "hi"), "unsupported model file 'model.txt'")


def test_error_dir_without_config(capsys, tmp_path):
    _assert_error(*run(capsys, "--model", tmp_path, "--prompt", "hi"), "has no config.json")


def test_error_corrupt_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00 definitely not a model")
    _assert_error(*run(capsys, "--model", f, "--prompt", "hi"), "could not read GGUF")
    from cadence.system import cache as disk_cache

    assert disk_cache.entries(("models",)) == []  # no half-written conversion left behind
    assert not any(p.name.count(".tmp") for p in (tmp_path / "cache").rglob("*"))


@pytest.mark.parametrize("argv, message", [
    (["--kv-dtype", "bfloat16"], "--kv-dtype bfloat16 with a float32 backbone"),
    (["--kv-dtype", "float16", "--dtype", "bfloat16"], "--kv-dtype float16 with a bfloat16 backbone"),
    (["--kv-dtype", "float16", "--backend", "transformers"], "--kv-dtype float16 needs the fast backend"),
    (["--kv-dtype", "float16"], "--kv-dtype float16 needs the listed attention kernel"),  # a dense fp32 tiny model
])
def test_error_kv_dtype_it_cannot_run(capsys, model_dir, argv, message):
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--max-new-tokens", 2, *argv), message)


def test_generate_json_names_the_kv_cache(capsys, model_dir):
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", PROMPT, "--method", "vanilla",
                       "--max-new-tokens", 4, "--json", "--kv-dtype", "float32")
    assert rc == 0, err
    [rec] = json_lines(out)
    assert rec["kv_dtype"] == "float32" and "kv-" not in rec["kernels"]


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_error_empty_prompt(capsys, model_dir, prompt):
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", prompt, "--method", "vanilla"), "empty prompt")


def test_error_prompt_files(capsys, model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": broken\n')
    _assert_error(*run(capsys, "--model", model_dir, "--prompt-file", bad, "--method", "vanilla"),
                  "bad.jsonl:2: not valid JSON")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "no prompt key"}\n')
    _assert_error(*run(capsys, "--model", model_dir, "--prompt-file", wrong, "--method", "vanilla"),
                  "wrong.jsonl:1: expected")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt-file", empty, "--method", "vanilla"),
                  "holds no prompts")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt-file", tmp_path / "missing.jsonl",
                       "--method", "vanilla"), "does not exist")


def test_error_heads_for_another_backbone(capsys, model_dir, tmp_path):
    from tiny import tiny_backbone
    other = tiny_backbone("qwen2", hidden=32)
    save_heads(new_heads("hydra", other, 2), tmp_path / "h")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads", tmp_path / "h"),
                  "were made for tiny-qwen2")
    same_shape = tiny_backbone("qwen2")  # same sizes, another name
    save_heads(new_heads("hydra", same_shape, 2), tmp_path / "h2")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads",
                       tmp_path / "h2"), "trained for 'tiny-qwen2', not 'tiny-model'")


def test_heads_by_shipped_name(capsys, model_dir, loaded, tmp_path, monkeypatch):
    """--heads NAME loads a set shipped for the backbone (assets/heads/<model>/NAME); a directory
    of that name in the working directory wins; another kind's set is refused."""
    import cadence.heads.shipped as S
    import cadence.methods as M
    save_heads(new_heads("hydra", loaded, 2), tmp_path / "assets" / "tiny" / "hydra-wide")
    monkeypatch.setattr(S, "SHIPPED_HEADS", tmp_path / "assets")
    monkeypatch.setitem(S.SHIPPED_FOR, "tiny-model", "tiny")
    heads = M.resolve_heads(loaded, M.MethodSpec(method=M.Method.HYDRA, heads="hydra-wide"))
    assert heads.cfg.kind == "hydra" and S.shipped_names() == ["hydra-wide"]
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads", "hydra-wide",
                       "--max-new-tokens", "4")
    assert rc == 0, err
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "medusa", "--heads",
                       "hydra-wide"), "holds hydra heads, but --method is medusa")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hydra-wide").mkdir()  # a local directory of the same name is what the user meant
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads",
                       "hydra-wide"), "not a heads directory")


def test_error_heads_of_another_kind_or_missing(capsys, model_dir, loaded, tmp_path):
    save_heads(new_heads("hydra", loaded, 2), tmp_path / "h")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "medusa", "--heads",
                       tmp_path / "h"), "holds hydra heads, but --method is medusa")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "medusa", "--heads",
                       tmp_path / "nothing"), "not a heads directory")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra"),
                  "no hydra heads are shipped for tiny-model")



def test_mtp_attn_ships_no_heads_but_trained_ones_run(capsys, model_dir, loaded, tmp_path, monkeypatch):
    """No mtp-attn set ships for SmolLM2 (the tiny model stands in for it here): --method
    mtp-attn without --heads is one error line saying how to train a set; heads passed by
    --heads run."""
    import cadence.heads.shipped as S

    monkeypatch.setitem(S.SHIPPED_FOR, loaded.name, "smollm2")
    assert (S.SHIPPED_HEADS / "smollm2" / "eagle" / "config.json").is_file()  # the real folder
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "mtp-attn"),
                  "no mtp-attn heads are shipped for tiny-model: train a set with `cadence train --kind mtp-attn")
    save_heads(new_heads("mtp-attn", loaded, 2, random=True), tmp_path / "h")
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "mtp-attn", "--heads",
                       tmp_path / "h", "--max-new-tokens", 6, "--json")
    assert rc == 0, err
    assert json_lines(out)[0]["new_tokens"] == 6

def test_error_bad_tree_dtype_and_length(capsys, model_dir):
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads", "random",
                       "--tree", "tree-5"), "unknown tree 'tree-5'")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads", "random",
                       "--tree", "chain-9"), "9 levels deep; this drafter fills at most 8")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "hydra", "--heads", "random",
                       "--tree", "chain-4", "--no-copy"), "4 levels deep; this drafter fills at most 3")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--dtype", "float8"), "unknown dtype")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "vanilla",
                       "--max-new-tokens", 600), "exceeds the model's 512 positions")
    _assert_error(*run(capsys, "--model", model_dir, "--prompt", "hi", "--method", "vanilla",
                       "--max-new-tokens", 0), "max_new_tokens must be an integer >= 1")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--method", "bogus"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["generate"])  # a prompt source is required
    assert exc.value.code == 2
