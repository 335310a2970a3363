"""Passages for the broader self-distillation families: prose from the training split of
ShareGPT and from Python's own documentation.

Knows: which ShareGPT assistant replies are English prose of passage length (no code, markup,
refusals or role-played speakers; a conversational opener such as "Sure!" cut off), the human
turn each answered, passages joined from the paragraphs of ``pydoc_data.topics`` and standard-
library docstrings, and which ShareGPT turns ask for code. Does not know: prompt templates or
families (``cadence.training.families``), evaluation prompts, tokenizers.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cadence.prompts import sharegpt_conversations

_CODE_REQUEST = re.compile(
    r"```|\b(?:python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|regex|bash|php|kotlin|"
    r"react|node\.?js|pandas|numpy|django|flask)\b|\b(?:write|create|implement|fix|debug|refactor|optimi[sz]e|"
    r"explain|convert)\b[^\n]{0,80}\b(?:code|function|script|program|class|method|query|algorithm)\b", re.IGNORECASE)


def is_code_request(prompt: str) -> bool:
    return bool(_CODE_REQUEST.search(prompt[:1000]))


# # Passages and sentences come from the training split of ShareGPT (assistant replies, never a
# held-out conversation) and from Python's own documentation (``pydoc_data.topics``: the
# language reference as ``help()`` shows it; module docstrings of the standard library).

_PASSAGE_MIN, _PASSAGE_MAX = 250, 800  # characters: a passage plus its instruction fits 256 prompt tokens
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
MARKUP = re.compile(r"```|https?://|\|.*\||<[a-z/][^>]*>|\{\{|\}\}|\\[a-z]", re.IGNORECASE)
_REFUSAL = re.compile(r"^(?:i'?m sorry|i am sorry|as an ai|i apologi[sz]e|i'?m not able|i cannot|i can't)", re.IGNORECASE)


# a reply's conversational first sentence ("Sure! ...", "Of course, I'd be happy to help."), cut off a passage
_OPENER = re.compile(r"^(?:sure|of course|certainly|great|absolutely|okay|ok|alright|yes|no problem|understood|"
                     r"got it|thank you|thanks|hello|hi|i'd be happy|i would be happy|i understand)\b[^.!?\n]{0,100}"
                     r"[.!?]+\s*", re.IGNORECASE)
_SPEAKER = re.compile(r"^[A-Z][\w .'-]{0,30}:\s")  # "As Kyle: ...", "Narrator: ...": a role-played reply


@dataclass(frozen=True)
class Passage:
    """A passage to summarize, extract from or answer questions over."""

    key: str  # where it comes from, e.g. "sharegpt:ID:3" (turn 3) or "pydoc:assert:0"
    text: str
    question: str | None = None  # the human turn this reply answered (ShareGPT only), when short


@lru_cache(maxsize=1)
def train_conversations() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    return tuple((key, tuple(turns)) for key, turns in sharegpt_conversations("train"))


def ascii_share(text: str) -> float:
    return sum(ch.isascii() for ch in text) / max(len(text), 1)


def is_prose(text: str) -> bool:
    """English prose without code, tables or markup (lists are fine)."""
    if MARKUP.search(text) or _REFUSAL.match(text) or ascii_share(text) < 0.98:
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    return letters / max(len(text), 1) >= 0.8 and not is_code_request(text)


@lru_cache(maxsize=1)
def sharegpt_passages() -> tuple[Passage, ...]:
    """Assistant replies of training ShareGPT conversations that are prose of
    ``_PASSAGE_MIN``..``_PASSAGE_MAX`` characters; ``question`` is the human turn before it
    when that is a single line of at most 200 characters."""
    out = []
    for key, turns in train_conversations():
        for t, (role, text) in enumerate(turns):
            if role != "assistant":
                continue
            text = _OPENER.sub("", text, count=1).lstrip()
            if not (_PASSAGE_MIN <= len(text) <= _PASSAGE_MAX) or not is_prose(text) or _SPEAKER.match(text):
                continue
            q = turns[t - 1][1] if t and turns[t - 1][0] == "user" else None
            if q is not None and (len(q) > 200 or "\n" in q or ascii_share(q) < 0.98 or len(q) < 12):
                q = None
            out.append(Passage(key=f"{key}:{t}", text=text, question=q))
    return tuple(out)


def _unwrap(paragraph: str) -> str:
    lines = paragraph.splitlines()
    if any(line.startswith((" ", "\t")) for line in lines):  # a code or grammar block: keep its lines
        return paragraph
    return " ".join(line.strip() for line in lines)


def _chunks(name: str, text: str) -> list[Passage]:
    """Consecutive paragraphs of ``text`` joined into passages of the passage length."""
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    paras = [p for p in paras if not re.fullmatch(r"[^\n]*\n[*=\-^~]{3,}", p.strip())]  # reST titles
    out, cur = [], []
    for p in map(_unwrap, paras):
        if len(p) > _PASSAGE_MAX:
            cur = []
            continue
        if sum(len(x) + 2 for x in cur) + len(p) > _PASSAGE_MAX:
            cur = []
        cur.append(p)
        joined = "\n\n".join(cur)
        if len(joined) >= _PASSAGE_MIN and sum(not x.startswith(" ") for x in cur):
            out.append(Passage(key=f"{name}:{len(out)}", text=joined))
            cur = []
    return out


@lru_cache(maxsize=1)
def python_doc_passages() -> tuple[Passage, ...]:
    """Passages of the Python language reference (``pydoc_data.topics``) and of the
    docstrings of standard-library modules (the interpreter running this)."""
    out: list[Passage] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        topics = {}
    for name in sorted(topics):
        out += _chunks(f"pydoc:{name}", topics[name])
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if doc and not path.name.startswith("_"):
            out += _chunks(f"pydoc-module:{path.stem}", doc)
    return tuple(p for p in out if ascii_share(p.text) >= 0.98)
