"""``cadence.verify.sampling``: the top-p mask without a full sort and inverse-CDF draws, against
their definitions (a full sort; exact probabilities by chi-square)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cadence.verify.sampling import SamplingParams, argmax, categorical, outside_nucleus, probs, sample


def full_sort_mask(dist: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort everything, drop a token once the mass before it reaches top_p."""
    vals, order = dist.sort(dim=-1, descending=True)
    drop_sorted = vals.cumsum(-1) - vals >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def test_nucleus_worked_example():
    assert outside_nucleus(torch.tensor([.5, .1, .3, .1]), .7).tolist() == [False, True, False, True]
    assert outside_nucleus(torch.tensor([.5, .1, .3, .1]), 1.0).tolist() == [False] * 4


@pytest.mark.parametrize("scale, top_p", [(6.0, 0.9), (3.0, 0.95), (0.3, 0.5), (0.05, 0.99)])
def test_nucleus_equals_a_full_sort(scale, top_p):
    """Peaked rows (the nucleus inside the first 128), flatter ones (1024) and a nearly flat
    one (the whole vocabulary): the same kept set as sorting everything."""
    g = torch.Generator().manual_seed(int(scale * 100))
    dist = (torch.randn(4, 49152, generator=g, dtype=torch.float64) * scale).softmax(-1)
    assert torch.equal(outside_nucleus(dist, top_p), full_sort_mask(dist, top_p))


def test_probs_with_top_p_keeps_the_nucleus():
    logits = torch.tensor([2.0, 0.0, 1.5, -1.0, 1.0])
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    ref = logits.softmax(-1)
    kept = ~full_sort_mask(ref, 0.8)
    assert torch.equal(p > 0, kept)
    assert torch.allclose(p[kept], ref[kept] / ref[kept].sum())


def test_categorical_worked_example_and_zero_mass():
    g = torch.Generator().manual_seed(0)
    d = torch.tensor([.2, 0.0, .8])
    draws = categorical(d, 20000, g)
    assert draws.shape == (20000,) and not (draws == 1).any()
    assert float((draws == 0).float().mean()) == pytest.approx(0.2, abs=0.015)


def test_categorical_rows_and_unnormalised_mass():
    g = torch.Generator().manual_seed(1)
    d = torch.tensor([[0.0, 3.0, 1.0], [1.0, 0.0, 0.0]])  # row sums 4 and 1
    draws = categorical(d, 8000, g)
    assert draws.shape == (2, 8000) and (draws[1] == 0).all() and not (draws[0] == 0).any()
    assert float((draws[0] == 1).float().mean()) == pytest.approx(0.75, abs=0.02)


def test_sample_follows_a_large_vocabulary_distribution():
    """Draws from a 49k-token distribution (most mass on 12 tokens, the rest spread thin)."""
    g = torch.Generator().manual_seed(2)
    dist = torch.full((49152,), 1e-7)
    dist[torch.arange(12) * 4000] = torch.linspace(1, 12, 12)
    dist /= dist.sum()
    counts = np.zeros(13)
    top = {int(i) * 4000: j for j, i in enumerate(torch.arange(12))}
    for _ in range(6000):
        counts[top.get(sample(dist, g), 12)] += 1
    expected = np.append(dist[torch.arange(12) * 4000].numpy(), 1 - float(dist[torch.arange(12) * 4000].sum()))
    exp = expected * 6000
    big = exp >= 5
    obs_b, exp_b = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
    exp_b *= obs_b.sum() / exp_b.sum()
    assert chisquare(obs_b, exp_b).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_maximum_on_every_kind_of_row(dtype):
    """The native kernel (loaded here by ``native.module()``) against torch.argmax: random
    rows, exact ties (the first wins), all -inf, NaN (the first NaN wins, as in torch),
    widths that are not a multiple of 16, 1-D and 3-D inputs."""
    from cadence.fast import native

    if native.module() is None:
        pytest.skip("the C++ extension could not be built here")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 49152, generator=gen).to(dtype)
    x[1, 100] = x[1, 40000] = x[1].max() + 1  # a tie: 100 wins
    x[2] = float("-inf")
    x[3, 500] = x[3, 30] = float("nan")  # first NaN: 30
    x[4, -1] = x[4].max() + 1  # in the last block
    for rows in (x, x[:, :1000 - 3], x[0], x.view(7, 4, 12288), x[:, :5]):
        assert torch.equal(argmax(rows), rows.argmax(-1)), rows.shape
    assert argmax(x).tolist()[1:4] == [100, 0, 30]


def test_argmax_falls_back_to_torch_off_cpu_dtypes():
    x = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(argmax(x), x.argmax(-1))
