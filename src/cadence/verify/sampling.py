"""Turning logits into the distribution that is sampled: temperature, top-k, top-p.

Plain decoding and every verification rule call ``probs`` with the same parameters,
which is what makes speculative sampling distribution-identical to plain sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.errors import CadenceError
from cadence.fast import native


MIN_TEMPERATURE = 1e-5  # below it decoding is greedy (as vLLM's _SAMPLING_EPS): logits / T would overflow


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from logits. A temperature below ``MIN_TEMPERATURE`` is read as
    0 (greedy): ``logits / 1e-39`` is infinite and its softmax NaN, and already at 1e-5 a
    logit gap of 0.001 weighs exp(-100), so the draw is the argmax but for exact ties."""

    temperature: float = 0.0  # 0 = greedy (argmax); below MIN_TEMPERATURE: 0
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # keep the k most likely tokens (0 = off)

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # also catches NaN
            raise CadenceError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise CadenceError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise CadenceError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``: each row's first maximum (NaN counts as the maximum). On CPU,
    where the native extension is loaded, through its one-pass kernel: torch's CPU argmax
    took 0.125 ms for one 49,152-logit row and 1.1 ms for a 32-node tree's, the kernel 0.022
    and 0.113 (``benchmarks/kernels/sampling_cost.py``, AMX Xeon, 2026-12-03, 6b59e7b); elsewhere torch's."""
    ops = native.loaded()
    if ops is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) \
            and logits.dim() >= 1 and logits.shape[-1] > 0:
        return ops.argmax_rows(logits)
    return logits.argmax(-1)


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature/top-k/top-p.

    Greedy parameters give a one-hot distribution at the argmax.
    """
    logits = logits.float()
    if p.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        logits = logits.masked_fill(outside_nucleus(logits.softmax(-1), p.top_p), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_FIRST_K = 128  # candidates tried first when looking for the nucleus (then 8x, then all)


def outside_nucleus(dist: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) probabilities -> (..., V) bool, True for the tokens top-p drops: in order of
    probability, a token is kept while the mass before it is below ``top_p`` (so the token
    that crosses ``top_p`` is kept). Only the k most likely tokens are sorted (k = 128, else
    1024, else all, until their mass reaches ``top_p`` in every row): every token past them
    has at least that mass before it. On a 49k vocabulary this costs about 0.2 ms against 4 ms for a
    full sort (AMD EPYC, 2 threads).

    Example: dist (.5, .1, .3, .1), top_p .7 -> sorted .5, .3, .1, .1 with mass before
    0, .5, .8, .9 -> keep tokens 0 and 2: (False, True, False, True)."""
    V = dist.shape[-1]
    k = min(NUCLEUS_FIRST_K, V)
    while True:
        vals, idx = dist.topk(k, dim=-1)  # (..., k), sorted descending
        cum = vals.cumsum(-1)
        if k == V or bool((cum[..., -1] >= top_p).all()):
            break
        k = 8 * k if k == NUCLEUS_FIRST_K and 8 * k < V else V
    keep = torch.zeros_like(dist, dtype=torch.bool).scatter(-1, idx, cum - vals < top_p)
    return ~keep


def uniform(generator: torch.Generator | None) -> float:
    """One draw from U[0, 1), made on the generator's own device (a CUDA generator
    cannot fill a CPU tensor, which is where ``torch.rand`` puts it by default)."""
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, device=device))


def categorical(dist: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` independent draws (with replacement) from each row of ``dist`` (..., V) (not
    necessarily normalised), by inverse CDF: uniforms from the generator (on its device)
    scaled by the row's mass, looked up in the row's float64 cumulative sums; returned on
    ``dist``'s device. Every random draw of decoding goes through ``uniform`` or
    ``categorical``. A token of zero probability is never drawn: the first cumulative sum
    above u is where the sums rise. (``torch.multinomial`` draws one sample of a 49k
    vocabulary through 49k exponentials: 1.4 ms here against about 0.2 ms.)

    Example: dist (.2, 0, .8), u .1 -> 0; u .2 -> 2 (sums .2, .2, 1.0: the first above .2)."""
    rows = dist.reshape(-1, dist.shape[-1])
    cdf = rows.double().cumsum(-1)  # (R, V)
    device = generator.device if generator is not None else dist.device
    u = torch.rand((rows.shape[0], n), generator=generator, device=device, dtype=torch.float64)
    u = u.to(dist.device) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True)  # (R, n)
    if bool((idx >= rows.shape[1]).any()):  # u rounded up to the row's total: its last token with mass
        last = rows.shape[1] - 1 - (rows.flip(-1) > 0).int().argmax(-1, keepdim=True)
        idx = torch.where(idx >= rows.shape[1], last, idx)
    return idx.reshape(*dist.shape[:-1], n)


def sample(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a (V,) distribution."""
    return int(categorical(dist, 1, generator)[0])


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the last axis."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
