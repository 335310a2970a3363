"""Incremental detokenization with stop strings: text as tokens are committed, never
an incomplete character and never any part of a stop string.

Knows: a tokenizer's ``decode`` and the request's stop strings. Does not know models,
trees or the engine loop.

Decoding each new token alone is wrong for byte-level and SentencePiece vocabularies
(a character may span tokens, a leading space depends on the token before), and
decoding everything again per token is quadratic. As in Hugging Face's TextStreamer and
vLLM's detokenizer, the text of a short window ``tokens[prefix:]`` is compared with the
text of ``tokens[prefix:read]``: what it adds is the new text, unless it ends in U+FFFD
(an incomplete UTF-8 sequence), in which case it is held back until the next token.

Stop strings: after each token the text is searched for every stop string; at a hit
the text is cut before it and the request is over. Until then the text that could
still become the start of a stop string (a suffix that is a prefix of one) is held
back from ``take`` so a stop string is never partly shown.

Example, stop "\\n\\n": tokens decode to "Hi", "\\n", "\\n", "x" -> take() gives "Hi",
then "" (the "\\n" might start the stop string), then push reports the stop and the
final text is "Hi".
"""

from __future__ import annotations

from typing import Sequence

WINDOW = 6  # tokens of left context kept for decoding (spaces and merges depend on them)


class Detokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text = ""  # text so far (complete characters), cut at a stop string once hit
        self.stopped = False
        self._prefix = 0  # tokens[_prefix:_read] decode to the tail of self.text
        self._read = 0
        self._shown = 0  # characters of self.text handed out by take()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> bool:
        """Add one committed token; True when the text now contains a stop string."""
        if self.stopped:
            raise RuntimeError("push after a stop string was hit")
        self.tokens.append(int(token))
        if self.tokenizer is None:
            return False
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if after.endswith("\ufffd") or not after.startswith(before):
            return False  # incomplete character: wait for the next token
        new = after[len(before):]
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += new
        self._read = len(self.tokens)
        if self._read - self._prefix > WINDOW:
            self._prefix = self._read - WINDOW
        hit = min((self.text.find(s, start) for s in self.stop if self.text.find(s, start) >= 0), default=-1)
        if hit >= 0:
            self.text = self.text[:hit]
            self.stopped = True
        return self.stopped

    def take(self) -> str:
        """Text not handed out yet that is safe to show: everything, except (while not
        stopped) a tail that could be the beginning of a stop string."""
        end = len(self.text)
        if not self.stopped:
            end -= _held_back(self.text, self.stop)
        out = self.text[self._shown:end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return out

    def finish(self) -> str:
        """The rest of the text at the end of the request (a held-back tail that did
        not become a stop string is shown now)."""
        if not self.stopped and self.tokenizer is not None and self._read < len(self.tokens):
            self.text += self._decode(self.tokens[self._prefix:])[len(self._decode(
                self.tokens[self._prefix:self._read])):]
            self._read = len(self.tokens)
        out = self.text[self._shown:]
        self._shown = len(self.text)
        return out


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.
    Example: text "abc\\n", stop ("\\n\\n",) -> 1."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
