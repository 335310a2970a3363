"""PIPO decoding, one request at a time (LOSSY: the output is not plain decoding's).

Knows: the two modes and the two ways of keeping pair-out's second token.

* ``prompt``: the prompt is read as pairs (``groups.prompt_groups``: about half the positions,
  half the prefill work and KV cache), then each reply token is one plain position decoded by
  the unmodified weights over that cache: ordinary decoding after a compressed prefill.
* ``pairs`` + ``confidence``: every forward reads one new position. From its hidden state h the
  LM head gives token a, the pair head gives b; if the confidence head's c(b) >= threshold both
  are committed and the next position is the pair latent of (a, b) (one forward per two tokens),
  otherwise only a is and the next position is a plain one.
* ``pairs`` + ``verify``: after a, the unmodified weights run over [a, b] as two plain
  positions; b is kept when it is what they would have chosen (greedy; min(1, p/q) at T > 0),
  else their own token replaces it: one or two tokens per forward, lossless relative to plain
  decoding *over the compressed prompt*, pair-in for the prompt only.

Does not know training; does not stream (the CLI prints whole replies). Times are wall-clock:
``ttft_s`` from the call to the first token chosen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from cadence.pipo.groups import pack, PAIR, PLAIN, prompt_groups


@dataclass
class PipoResult:
    """One PIPO generation."""

    tokens: list[int]  # reply token ids
    ttft_s: float  # seconds until the first reply token was chosen (prefill included)
    wall_s: float  # seconds for the whole call
    forwards: int  # backbone forwards, the prefill counted as one
    prompt_positions: int  # positions the prompt took (about half its tokens)
    pair_steps: int = 0  # forwards that committed two tokens
    confidences: list[float] = field(default_factory=list)  # confidence of every pair-out draft judged

    def summary(self) -> dict:
        n = len(self.tokens)
        decode_s = self.wall_s - self.ttft_s
        return {"new_tokens": n, "ttft_s": round(self.ttft_s, 5), "wall_s": round(self.wall_s, 5),
                "tokens_per_s": round(n / max(self.wall_s, 1e-9), 3),
                "per_token_s": round(decode_s / max(n - 1, 1), 6), "forwards": self.forwards,
                "prompt_positions": self.prompt_positions, "pair_steps": self.pair_steps,
                "tokens_per_forward": round(n / max(self.forwards, 1), 3)}


class PipoDecoder:
    def __init__(self, student, mode: str = "prompt", accept: str = "confidence", threshold: float = 0.5):
        self.s, self.mode, self.accept, self.threshold = student, mode, accept, float(threshold)

    def _pick(self, logits: torch.Tensor, temperature: float, gen) -> int:
        # logits: (V,) float32
        if temperature <= 0:
            return int(torch.argmax(logits))
        return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))

    def _step(self, cache, token: int, size: int, prev: int = 0) -> torch.Tensor:
        """One new position (a pair latent of (prev, token) when size == 2) -> hidden (d,)."""
        ids = torch.tensor([[[prev, token] if size == PAIR else [token, 0]]], device=self.s.base.device)
        sizes = torch.tensor([[size]], device=ids.device)
        return self.s.run(self.s.latents(ids, sizes), sizes.float() - 1, cache)[0, -1]

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 eos: set[int] | frozenset[int] = frozenset()) -> PipoResult:
        t0 = time.perf_counter()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        s = self.s
        sizes = prompt_groups(len(prompt))
        ids, sz = pack(prompt, sizes)
        ids, sz = ids[None].to(s.base.device), sz[None].to(s.base.device)
        cache = DynamicCache(config=s.base.config)
        h = s.run(s.latents(ids, sz), (sz == PAIR).float(), cache)[0, -1]
        a = self._pick(s.lm_logits(h), temperature, gen)
        res = PipoResult([], time.perf_counter() - t0, 0.0, 1, len(sizes))
        run = {"prompt": self._plain, "pairs": self._pairs if self.accept == "confidence" else self._verify}
        run[self.mode](res, cache, h, a, max_new_tokens, temperature, gen, eos)
        res.wall_s = time.perf_counter() - t0
        return res

    def _done(self, res, token, max_new, eos) -> bool:
        res.tokens.append(token)
        return token in eos or len(res.tokens) >= max_new

    def _plain(self, res, cache, h, a, max_new, temperature, gen, eos) -> None:
        while not self._done(res, a, max_new, eos):
            h = self._step(cache, a, PLAIN)
            res.forwards += 1
            a = self._pick(self.s.lm_logits(h), temperature, gen)

    def _pairs(self, res, cache, h, a, max_new, temperature, gen, eos) -> None:
        s = self.s
        while not self._done(res, a, max_new, eos):
            a_t = torch.tensor(a, device=h.device)
            g = s.pair_state(h, a_t)
            logq = torch.log_softmax(s.lm_logits(g), -1)
            b = self._pick(logq, temperature, gen)
            c = float(s.confidence_of(h, g, torch.tensor(b, device=h.device), logq))
            res.confidences.append(round(c, 4))
            if c >= self.threshold:
                res.pair_steps += 1
                if self._done(res, b, max_new, eos):
                    return
                h = self._step(cache, b, PAIR, prev=a)
            else:
                h = self._step(cache, a, PLAIN)
            res.forwards += 1
            a = self._pick(s.lm_logits(h), temperature, gen)

    def _verify(self, res, cache, h, a, max_new, temperature, gen, eos) -> None:
        s = self.s
        while not self._done(res, a, max_new, eos):
            g = s.pair_state(h, torch.tensor(a, device=h.device))
            ql = s.lm_logits(g)
            b = self._pick(ql, temperature, gen)
            ids = torch.tensor([[[a, 0], [b, 0]]], device=h.device)
            one = torch.ones(1, 2, dtype=torch.long, device=h.device)
            hh = s.run(s.latents(ids, one), torch.zeros(1, 2, device=h.device), cache)[0]
            res.forwards += 1
            p = s.lm_logits(hh[0])
            if temperature <= 0:
                keep, other = int(torch.argmax(p)) == b, int(torch.argmax(p))
            else:
                pp, qq = torch.softmax(p / temperature, -1), torch.softmax(ql / temperature, -1)
                keep = float(torch.rand((), generator=gen)) < min(1.0, float(pp[b] / qq[b].clamp_min(1e-20)))
                resid = (pp - qq).clamp_min(0)
                other = int(torch.multinomial(resid / resid.sum() if resid.sum() > 0 else pp, 1, generator=gen))
            if keep:
                res.pair_steps += 1
                if self._done(res, b, max_new, eos):
                    return
                h = hh[1]
                a = self._pick(s.lm_logits(h), temperature, gen)
            else:
                cache.crop(-1)  # b's position goes (a negative count removes that many)
                h, a = hh[0], other
