"""DSpark's propose over static padded shapes (what CUDA graphs replay) against the eager pass, on the CPU."""

from __future__ import annotations

import pytest
import torch
from dspark.drafters.factory import load_drafter
from dspark.models.static_batch import DEFAULT_BATCH_BUCKETS

from tests.drafters.helpers import FIXTURE, make_request, sampling_for, sequence, target_features

MAX_CONTEXT = 48
CONTEXTS = (16, 32, MAX_CONTEXT)  # context-length buckets: requests fall in each


@pytest.fixture(scope="module")
def contexts(target):
    """Eight token sequences and the target's features of each; requests take prefixes of them."""
    seqs = [sequence(MAX_CONTEXT + 1, seed=i) for i in range(8)]
    return [(s, target_features(target, s)) for s in seqs]


def _drafters(
    target, contexts, num_requests: int, static: bool, variant: str = "gated", longest: int = MAX_CONTEXT
):
    drafter = load_drafter(str(FIXTURE / f"draft_{variant}"), target.config)
    if static:
        drafter.use_static_shapes(DEFAULT_BATCH_BUCKETS, CONTEXTS)
        assert drafter.static is not None
    gen = torch.Generator().manual_seed(num_requests)
    requests = []
    for i in range(num_requests):
        tokens, feats = contexts[i % len(contexts)]
        n = int(torch.randint(2, longest + 1, (1,), generator=gen))
        request = make_request(f"r{i}", tokens[: n + 1], num_cached=n)
        drafter.admit(request)
        drafter.commit([request], [feats[:n]])
        requests.append(request)
    return drafter, requests


def _assert_same_blocks(
    target,
    contexts,
    num_requests: int,
    horizon: int | None,
    variant: str = "gated",
    longest: int = MAX_CONTEXT,
):
    eager, requests = _drafters(
        target, contexts, num_requests, static=False, variant=variant, longest=longest
    )
    static, _ = _drafters(target, contexts, num_requests, static=True, variant=variant, longest=longest)
    calls = static.static.graphs  # off CUDA nothing is captured: the padded code runs eagerly
    assert calls.num_graphs == 0
    expected = eager.propose(requests, sampling_for(requests), horizon)
    got = static.propose(requests, sampling_for(requests), horizon)
    assert got.tokens.shape == expected.tokens.shape
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.confidences, expected.confidences, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", DEFAULT_BATCH_BUCKETS)
def test_every_bucket_equals_eager(target, contexts, rows):
    _assert_same_blocks(target, contexts, rows, horizon=None)


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("num_requests,horizon", [(3, 4), (5, None), (11, 1)])
def test_padded_batches_and_horizons_equal_eager(target, contexts, variant, num_requests, horizon):
    _assert_same_blocks(target, contexts, num_requests, horizon, variant)


@pytest.mark.parametrize("longest", [CONTEXTS[0], CONTEXTS[1]])
@pytest.mark.parametrize("num_requests", [1, 6])
def test_shorter_context_buckets_equal_eager(target, contexts, longest, num_requests):
    """Batches whose contexts all fit a shorter bucket attend over that prefix of the buffer only."""
    _assert_same_blocks(target, contexts, num_requests, horizon=None, longest=longest)


def test_longer_contexts_and_larger_batches_run_eagerly(target, contexts):
    drafter, requests = _drafters(target, contexts, 3, static=True)
    assert drafter.static.bucket(3, MAX_CONTEXT) == (4, MAX_CONTEXT)
    assert drafter.static.bucket(3, CONTEXTS[0] + 1) == (4, CONTEXTS[1])
    assert drafter.static.bucket(3, MAX_CONTEXT + 1) is None
    assert drafter.static.bucket(DEFAULT_BATCH_BUCKETS[-1] + 1, 8) is None
    drafter.use_static_shapes((1, 2), CONTEXTS)  # 3 requests: outside every bucket
    eager, _ = _drafters(target, contexts, 3, static=False)
    got, expected = (d.propose(requests, sampling_for(requests)) for d in (drafter, eager))
    assert torch.equal(got.tokens, expected.tokens)
