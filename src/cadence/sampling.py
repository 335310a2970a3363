"""Turning logits into the distribution that is sampled: temperature, top-k, top-p.

Plain decoding and every verification rule call ``probs`` with the same parameters,
which is what makes speculative sampling distribution-identical to plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.errors import CadenceError


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from logits."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)

    def __post_init__(self):
        if not self.temperature >= 0:  # also catches NaN
            raise CadenceError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise CadenceError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise CadenceError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature/top-k/top-p.

    Greedy parameters give a one-hot distribution at the argmax.
    """
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def uniform(generator: torch.Generator | None) -> float:
    """One draw from U[0, 1), made on the generator's own device (a CUDA generator
    cannot fill a CPU tensor, which is where ``torch.rand`` puts it by default)."""
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, device=device))


def categorical(dist: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` independent draws (with replacement) from each row of ``dist`` (..., V),
    made on the generator's device; returned on ``dist``'s device. Every random draw of
    decoding goes through ``uniform`` or ``categorical``."""
    if generator is not None and generator.device != dist.device:
        return torch.multinomial(dist.to(generator.device), n, replacement=True,
                                 generator=generator).to(dist.device)
    return torch.multinomial(dist, n, replacement=True, generator=generator)


def sample(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a (V,) distribution."""
    return int(categorical(dist, 1, generator)[0])


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the last axis."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
