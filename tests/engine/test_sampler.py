"""Sampling transforms against a plain per-row reference, and seeded draws."""

from __future__ import annotations

import pytest
import torch
from dspark.engine.sampler import SamplingTensors, draw, logits_to_probs, sample
from dspark.engine.sampling_params import SamplingParams


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Textbook definition, one row at a time."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    x = logits.double() / p.temperature
    if p.top_k:
        kth = torch.sort(x, descending=True).values[min(p.top_k, x.numel()) - 1]
        x = torch.where(x < kth, -torch.inf, x)
    if p.top_p < 1:
        probs = torch.softmax(x, -1)
        order = torch.argsort(probs, descending=True)
        keep, mass = [], 0.0
        for i in order.tolist():
            keep.append(i)
            mass += probs[i].item()
            if mass >= p.top_p:
                break
        mask = torch.full_like(x, -torch.inf)
        mask[keep] = 0
        x = x + mask
    return torch.softmax(x, -1).float()


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=1),
]


def test_logits_to_probs_matches_reference_per_row():
    logits = torch.randn(len(PARAMS), 3, 40, generator=torch.Generator().manual_seed(0)) * 3
    got = logits_to_probs(logits, SamplingTensors.from_params(PARAMS))
    for r, p in enumerate(PARAMS):
        for j in range(3):
            torch.testing.assert_close(got[r, j], reference_probs(logits[r, j], p), atol=1e-6, rtol=1e-5)


def test_greedy_rows_are_one_hot_and_rows_sum_to_one():
    logits = torch.randn(len(PARAMS), 50)
    probs = logits_to_probs(logits, SamplingTensors.from_params(PARAMS))
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(PARAMS)))
    assert probs[0].max() == 1.0 and probs[0].argmax() == logits[0].argmax()


def test_draw_skips_the_distributions_only_when_every_row_is_greedy():
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(1)) * 3
    greedy = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 3)
    tokens, probs = draw(logits, greedy)
    assert probs is None and torch.equal(tokens, logits.argmax(-1))
    assert greedy.select([0, 2]).all_greedy  # rows of an all-greedy batch stay all greedy

    mixed = SamplingTensors.from_params(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    )
    tokens, probs = draw(logits[:2].repeat(2, 1, 1), mixed)
    assert not mixed.all_greedy and probs.shape == (4, 4, 50)
    assert torch.equal(tokens[0], logits[0].argmax(-1)) and torch.equal(probs[0].argmax(-1), tokens[0])
    assert bool((probs.gather(-1, tokens[..., None]) > 0).all())


def test_seeded_rows_reproduce_regardless_of_batch_neighbours():
    probs = torch.softmax(torch.randn(1, 100), -1)
    draws = []
    for neighbours in (0, 5):
        gen = torch.Generator().manual_seed(1234)
        batch = torch.cat([probs, torch.softmax(torch.randn(neighbours, 100), -1)])
        draws.append([sample(batch, [gen] + [None] * neighbours)[0].item() for _ in range(20)])
    assert draws[0] == draws[1]


@pytest.mark.parametrize(
    "field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("top_k", -1)]
)
def test_invalid_sampling_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
