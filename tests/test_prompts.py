"""GSM8K prompts: the repo stores them gzipped; a folder of plain .jsonl reads the same."""

from __future__ import annotations

import gzip
import itertools
import shutil

import pytest

from cadence.errors import CadenceError
from cadence.prompts import gsm8k_dir, gsm8k_items


def test_the_repo_gsm8k_is_gzipped_and_reads_whole(monkeypatch):
    monkeypatch.delenv("CADENCE_GSM8K_DIR", raising=False)
    folder = gsm8k_dir()
    assert (folder / "test.jsonl.gz").is_file() and (folder / "train.jsonl.gz").is_file()
    test = list(gsm8k_items("test"))
    assert len(test) == 1319 and test[0].key == "gsm8k-test:0"
    assert all(it.prompt and it.reference for it in test)
    assert sum(1 for _ in gsm8k_items("train")) == 7473


def test_plain_and_gzipped_folders_give_the_same_items(monkeypatch, tmp_path):
    monkeypatch.delenv("CADENCE_GSM8K_DIR", raising=False)
    src = gsm8k_dir() / "test.jsonl.gz"
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    with gzip.open(src, "rt", encoding="utf-8") as fh:
        (plain / "test.jsonl").write_text("".join(itertools.islice(fh, 20)), encoding="utf-8")
    with open(plain / "test.jsonl", "rb") as a, gzip.open(packed / "test.jsonl.gz", "wb") as b:
        shutil.copyfileobj(a, b)
    monkeypatch.setenv("CADENCE_GSM8K_DIR", str(plain))
    from_plain = list(gsm8k_items("test"))
    monkeypatch.setenv("CADENCE_GSM8K_DIR", str(packed))
    assert list(gsm8k_items("test")) == from_plain and len(from_plain) == 20


def test_a_folder_without_gsm8k_is_skipped_for_the_next(monkeypatch, tmp_path):
    monkeypatch.setenv("CADENCE_GSM8K_DIR", str(tmp_path))  # empty: falls through to the repo's
    assert gsm8k_dir() != tmp_path
    monkeypatch.setattr("cadence.prompts.Path.is_file", lambda self: False)
    with pytest.raises(CadenceError, match="GSM8K not found"):
        gsm8k_dir()
