"""Sampling transforms against a plain per-row reference, and seeded draws."""

from __future__ import annotations

import pytest
import torch
from dspark.engine.sampler import (
    CDF_BLOCK,
    SamplingTensors,
    draw,
    invert_cdf,
    logits_to_probs,
    row_argmax,
    sample,
)
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


def _flat_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)


@pytest.mark.parametrize("vocab", [5, CDF_BLOCK, CDF_BLOCK + 44, 49152])
def test_the_blocked_cdf_draws_what_one_cumulative_sum_draws(vocab):
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(256, vocab, generator=g) ** 4
    probs[torch.rand(256, vocab, generator=g) < 0.5] = 0  # zero-mass tokens, whole zero blocks too
    probs[:, vocab // 2] += 0.01
    probs /= probs.sum(-1, keepdim=True)
    u = torch.rand(256, generator=g, dtype=torch.float64)
    tokens = invert_cdf(probs, u)
    assert torch.equal(tokens, _flat_inverse_cdf(probs, u))
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_the_blocked_cdf_never_steps_past_the_mass_at_the_edges():
    probs = torch.zeros(4, 3 * CDF_BLOCK)
    probs[0, 0] = probs[1, -1] = probs[2, CDF_BLOCK] = probs[3, CDF_BLOCK - 1] = 1.0
    u = torch.tensor([0.0, 1 - 2**-40, 0.5, 1 - 2**-40], dtype=torch.float64)
    assert invert_cdf(probs, u).tolist() == [0, 3 * CDF_BLOCK - 1, CDF_BLOCK, CDF_BLOCK - 1]
    # A draw of 0 skips leading zero-mass tokens.
    assert invert_cdf(probs[1:3], torch.zeros(2, dtype=torch.float64)).tolist() == [
        3 * CDF_BLOCK - 1,
        CDF_BLOCK,
    ]
    # Mass at the start of a row only, whose float32 block sum (0.30000001) exceeds the float64 sum
    # of its tokens (0.30000000447): a draw near 1 stays on the last token with mass.
    tail = torch.zeros(2, 2 * CDF_BLOCK)
    tail[:, :3] = 0.1
    assert tail[0].view(2, CDF_BLOCK).sum(-1)[0].item() > tail[0, :3].double().sum().item()
    assert invert_cdf(tail, torch.tensor([1 - 2**-50, 0.1], dtype=torch.float64)).tolist() == [2, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_with_ties_taken_first(dtype):
    # Few distinct values: most rows tie at their maximum, as bf16 logits often do.
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (16, 3, 257), generator=g).to(dtype)
    x[0, 0] = 7  # every entry tied
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert torch.equal(row_argmax(x[:, 0]), x[:, 0].argmax(-1))
    assert row_argmax(x)[0, 0] == 0
