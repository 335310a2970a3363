"""Decoding settings are finite numbers, checked when a request is made (never mid-step,
where a batched engine would fail every row), and temperatures below
``sampling.MIN_TEMPERATURE`` decode greedily instead of overflowing ``logits / T``."""

from __future__ import annotations

import pytest
import torch

from cadence.decode.engine import Engine
from cadence.decode.generation import GenerationConfig
from cadence.errors import CadenceError
from cadence.verify.sampling import MIN_TEMPERATURE, SamplingParams, probs


@pytest.mark.parametrize("kwargs", [{"drift": float("inf")}, {"drift": float("nan")}, {"drift": -1.0},
                                    {"temperature": float("inf")}, {"top_p": float("nan")}, {"top_m": 0}])
def test_settings_that_are_not_finite_are_refused(kwargs):
    with pytest.raises(CadenceError):
        GenerationConfig(**kwargs)


def test_temperatures_below_the_floor_are_greedy():
    assert SamplingParams(temperature=1e-30).greedy and SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    assert (probs(logits, SamplingParams(temperature=1e-39)) == probs(logits, SamplingParams())).all()
    assert not probs(logits, SamplingParams(temperature=MIN_TEMPERATURE)).isnan().any()


def test_a_tiny_temperature_generates_the_greedy_text(llama):
    ids = llama.encode_prompt("Write a poem about the sea.", chat=False)
    ref = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=12))
    for t in (1e-30, 1e-45):
        got = Engine(llama).generate(ids, GenerationConfig(max_new_tokens=12, temperature=t, seed=3))
        assert got.tokens == ref.tokens, t
