"""Incremental detokenization: complete characters only, stop strings never shown."""

import pytest
from tiny import byte_tokenizer

from cadence.decode.detok import Detokenizer, _held_back

TEXT = "Tea 🍵 and 日本語 text, ok. 👍🏽 done"


def stream(tok, ids, stop=()):
    d = Detokenizer(tok, stop)
    pieces = []
    for t in ids:
        hit = d.push(t)
        pieces.append(d.take())
        if hit:
            break
    pieces.append(d.finish())
    return d, pieces


def test_byte_level_multibyte_characters_are_never_split():
    tok = byte_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT)  # emoji and CJK span several byte tokens
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == TEXT == tok.decode(ids) == d.text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop", ["日本", "ok.", "🍵", "done", "\n\n"])
def test_stop_strings_are_cut_and_never_shown(stop):
    tok = byte_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    d, pieces = stream(tok, ids, (stop,))
    shown = "".join(pieces)
    want = TEXT[:TEXT.index(stop)] if stop in TEXT else TEXT
    assert shown == want == d.text and d.stopped == (stop in TEXT)
    partial = ""
    for p in pieces:  # at no point was any part of the stop string on screen
        partial += p
        assert stop not in partial


def test_a_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    tok = byte_tokenizer()
    d = Detokenizer(tok, ("abc",))
    for ch in "xab":
        d.push(tok.convert_tokens_to_ids(ch))
    assert d.take() == "x"  # "ab" might begin "abc"
    d.push(tok.convert_tokens_to_ids("d"))
    assert d.take() == "abd"


def test_held_back_examples():
    assert _held_back("abc\n", ("\n\n",)) == 1
    assert _held_back("abc", ("bcd", "c!")) == 2
    assert _held_back("abc", ("xyz",)) == 0
