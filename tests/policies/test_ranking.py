"""The vectorised schedulers against plain-loop reference implementations of the paper's pseudocode."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
from dspark.policies.baselines import ThresholdPolicy
from dspark.policies.ranking import global_argmax_lengths, prefix_greedy_lengths, topk_survival
from dspark.sps_format import SpsPoint, SpsProfile


def reference_schedule(conf: list[list[float]], sps: Callable[[int], float], early_break: bool) -> list[int]:
    """Algorithm 1 line by line (early_break=False: the retrospective global search)."""
    num_requests = len(conf)
    a = [[math.prod(min(1.0, max(0.0, c)) for c in row[: j + 1]) for j in range(len(row))] for row in conf]
    candidates = [(r, j) for r in range(num_requests) for j in range(1, len(conf[r]) + 1) if a[r][j - 1] > 0]
    candidates.sort(key=lambda rj: -a[rj[0]][rj[1] - 1])  # stable: row-major order on ties
    lengths, batch, tau = [0] * num_requests, num_requests, float(num_requests)
    best, chosen = num_requests * sps(num_requests), [0] * num_requests
    for r, j in candidates:
        assert lengths[r] == j - 1, "a ranked candidate must extend its request's prefix"
        lengths[r] = j
        batch += 1
        tau += a[r][j - 1]
        theta = tau * sps(batch)
        if theta > best:
            best, chosen = theta, list(lengths)
        elif early_break:
            break
    return chosen


def reference_topk(conf: list[list[float]], k: int) -> list[int]:
    a = [[math.prod(row[: j + 1]) for j in range(len(row))] for row in conf]
    candidates = [(r, j) for r in range(len(conf)) for j in range(1, len(conf[r]) + 1) if a[r][j - 1] > 0]
    candidates.sort(key=lambda rj: -a[rj[0]][rj[1] - 1])
    lengths = [0] * len(conf)
    for r, j in candidates[:k]:
        assert lengths[r] == j - 1
        lengths[r] = j
    return lengths


def random_confidences(rng: random.Random, num_requests: int, gamma: int) -> list[list[float]]:
    kind = rng.choice(["uniform", "high", "quantized"])
    if kind == "uniform":
        return [[rng.random() for _ in range(gamma)] for _ in range(num_requests)]
    if kind == "high":
        return [[rng.random() ** 0.2 for _ in range(gamma)] for _ in range(num_requests)]
    # Ties, exact ones and zeros: where a careless sort would break prefixes.
    return [[rng.choice([0.0, 0.5, 0.75, 1.0, 1.0]) for _ in range(gamma)] for _ in range(num_requests)]


def random_jagged_profile(rng: random.Random, max_b: int) -> SpsProfile:
    sizes = sorted(rng.sample(range(1, max_b + 8), k=min(max_b + 7, rng.randint(2, 24))))
    per_token = rng.uniform(0.001, 0.2)
    points = [
        SpsPoint(batch_tokens=b, steps_per_second=rng.uniform(0.8, 1.2) / (1 + per_token * b)) for b in sizes
    ]
    return SpsProfile(device="cpu", model="m", dtype="float32", points=points)


@pytest.mark.parametrize("early_break", [True, False])
def test_matches_reference_loop_on_random_cases(early_break: bool) -> None:
    rng = random.Random(1234 + early_break)
    scheduler = prefix_greedy_lengths if early_break else global_argmax_lengths
    nontrivial = 0
    for _ in range(400):
        num_requests, gamma = rng.randint(1, 10), rng.randint(1, 8)
        conf = random_confidences(rng, num_requests, gamma)
        profile = random_jagged_profile(rng, num_requests * (gamma + 1))
        got = scheduler(torch.tensor(conf, dtype=torch.float64), profile.sps).tolist()
        assert got == reference_schedule(conf, profile.sps, early_break)
        nontrivial += 0 < sum(got) < sum(gamma for _ in conf)
    assert nontrivial > 50  # the cases exercised partial schedules, not only all-or-nothing


def test_topk_matches_reference_and_respects_prefixes_under_ties() -> None:
    rng = random.Random(7)
    for _ in range(300):
        num_requests, gamma = rng.randint(1, 10), rng.randint(1, 8)
        conf = random_confidences(rng, num_requests, gamma)
        k = rng.randint(0, num_requests * gamma + 3)
        assert topk_survival(torch.tensor(conf), k).tolist() == reference_topk(conf, k)


def test_topk_never_verifies_zero_survival() -> None:
    conf = torch.tensor([[0.9, 0.0, 1.0], [1.0, 1.0, 1.0]])
    assert topk_survival(conf, 100).tolist() == [1, 3]


def test_early_break_stops_at_first_drop_where_global_search_goes_on() -> None:
    # Theta: 1.0 (l=0), 0.9 (l=1), 1.134 (l=2): a dip, then the global maximum.
    sps = {1: 1.0, 2: 0.5, 3: 0.45}
    fn = lambda b: np.array([sps[int(x)] for x in b])  # noqa: E731
    conf = torch.tensor([[0.8, 0.9]])
    assert prefix_greedy_lengths(conf, fn).tolist() == [0]
    assert global_argmax_lengths(conf, fn).tolist() == [2]


def test_flat_sps_verifies_every_surviving_token() -> None:
    gen = torch.Generator().manual_seed(0)
    conf = torch.rand(16, 7, generator=gen).clamp_min(1e-3)
    conf[3, 4] = 0.0  # survival is zero from position 5 on
    lengths = prefix_greedy_lengths(conf, np.ones_like)
    expected = torch.full((16,), 7)
    expected[3] = 4
    assert lengths.tolist() == expected.tolist()


def test_steep_sps_verifies_nothing() -> None:
    # SPS halves per extra token: no draft token can pay for itself.
    conf = torch.ones(8, 5)
    lengths = prefix_greedy_lengths(conf, lambda b: 0.5**b)
    assert lengths.tolist() == [0] * 8


def test_gamma_zero_and_no_requests() -> None:
    one = np.ones_like
    assert prefix_greedy_lengths(torch.empty(3, 0), one).tolist() == [0, 0, 0]
    assert global_argmax_lengths(torch.empty(0, 4), one).tolist() == []
    assert topk_survival(torch.empty(2, 0), 5).tolist() == [0, 0]


def test_threshold_stops_at_first_low_confidence() -> None:
    conf = torch.tensor([[0.9, 0.4, 0.9], [0.5, 0.5, 0.5], [0.1, 0.9, 0.9]])
    assert ThresholdPolicy(0.5).verify_lengths(conf, 3, 3).tolist() == [1, 3, 0]
