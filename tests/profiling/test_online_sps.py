"""OnlineSps: a wrong prior (an idle-node profile) corrects itself from observed step times."""

from __future__ import annotations

import random

import pytest
import torch
from dspark.engine.policy_spec import PolicySettings
from dspark.policies.sps_curve import OnlineSps
from dspark.sps_format import SpsPoint, SpsProfile

GRID = [1, 8, 16, 32, 64, 128, 256, 512]


def idle_node_prior() -> SpsProfile:
    # Measured alone on the node: 10 ms fixed + 20 us per token.
    points = [SpsPoint(batch_tokens=b, steps_per_second=1 / (0.010 + 20e-6 * b)) for b in GRID]
    return SpsProfile(device="cpu", model="m", dtype="float32", points=points)


def true_step_seconds(b: float) -> float:
    # In service: neighbours slow the fixed part by 40% and the per-token part doubles.
    return 0.014 + 40e-6 * b


def correction(online: OnlineSps, b: int) -> float:
    """Estimated / prior step time at B = b (the drift alone where nothing was observed)."""
    return online.prior.sps(float(b)) / online.sps(float(b))


def test_converges_to_the_shifted_true_curve_where_observed() -> None:
    online = OnlineSps(idle_node_prior())
    rng = random.Random(0)
    for _ in range(3000):
        b = rng.randint(1, 256)
        online.observe(b, true_step_seconds(b) * rng.uniform(0.9, 1.1))  # timing noise
    for b in (1, 8, 16, 32, 64, 128, 256):
        assert online.sps(b) == pytest.approx(1 / true_step_seconds(b), rel=0.05)
        assert abs(idle_node_prior().sps(b) * true_step_seconds(b) - 1) > 0.25  # the prior was badly off
    # Never observed near 512: only the shared drift moves it, the prior's shape is kept there.
    assert correction(online, GRID[-1]) == pytest.approx(online.drift(), rel=1e-12)
    assert online.sps(512) == pytest.approx(idle_node_prior().sps(512) / online.drift(), rel=1e-12)


def test_follows_later_drift() -> None:
    online = OnlineSps(idle_node_prior())
    for _ in range(300):
        online.observe(64, true_step_seconds(64))
    for _ in range(300):
        online.observe(64, 2 * true_step_seconds(64))  # the node gets twice as slow
    assert online.sps(64) == pytest.approx(1 / (2 * true_step_seconds(64)), rel=0.03)


def test_drift_seen_at_one_batch_size_moves_the_others() -> None:
    """The gate compares B = R (undrafted steps) with B > R (drafted ones): when only one of them
    runs while the node slows down, the other must not keep the old speed."""
    online = OnlineSps(idle_node_prior())
    rng = random.Random(1)
    for _ in range(400):  # both measured: the shape between 1 and 8 is learned
        b = rng.choice([1, 8])
        online.observe(b, true_step_seconds(b))
    ratio = online.sps(1) / online.sps(8)
    for _ in range(200):  # then only B = 1 runs, on a node 1.5x slower
        online.observe(1, 1.5 * true_step_seconds(1))
    assert online.sps(1) == pytest.approx(1 / (1.5 * true_step_seconds(1)), rel=0.02)
    assert online.sps(8) == pytest.approx(1 / (1.5 * true_step_seconds(8)), rel=0.1)
    assert online.sps(1) / online.sps(8) == pytest.approx(ratio, rel=0.1)
    without = OnlineSps(idle_node_prior(), PolicySettings(sps_drift_alpha=0.0))  # per-size corrections alone
    for _ in range(400):
        b = rng.choice([1, 8])
        without.observe(b, true_step_seconds(b))
    for _ in range(200):
        without.observe(1, 1.5 * true_step_seconds(1))
    assert without.sps(8) == pytest.approx(1 / true_step_seconds(8), rel=0.05)  # stale: the old speed


def test_one_stalled_step_moves_the_estimate_at_most_by_max_jump() -> None:
    online = OnlineSps(idle_node_prior(), PolicySettings(sps_max_jump=2.0))
    before = online.sps(64)
    online.observe(64, 100.0)  # a 100 s hiccup
    assert online.sps(64) >= before / 2


def test_observation_is_shared_between_neighbouring_grid_points() -> None:
    settings = PolicySettings(sps_prior_weight=1.0, sps_alpha=0.01, sps_drift_alpha=0.0)
    online = OnlineSps(idle_node_prior(), settings)
    b = 48  # halfway between 32 and 64: half an observation each, against one pseudo-observation
    online.observe(b, 1.5 / idle_node_prior().sps(b))
    corr = {g: correction(online, g) for g in GRID}
    assert corr[32] == pytest.approx(1.5 ** (1 / 3)) and corr[64] == pytest.approx(1.5 ** (1 / 3))
    assert corr[16] == pytest.approx(1.0, rel=1e-12) and corr[128] == pytest.approx(1.0, rel=1e-12)
    no_prior = OnlineSps(idle_node_prior(), PolicySettings(sps_prior_weight=0.0, sps_drift_alpha=0.0))
    no_prior.observe(b, 1.5 / idle_node_prior().sps(b))
    assert no_prior.sps(b) == pytest.approx(idle_node_prior().sps(b) / 1.5)  # taken at face value


def test_table_tracks_refinement_in_batches() -> None:
    online = OnlineSps(idle_node_prior(), PolicySettings(sps_refresh_every=4))
    first = online.table(300).clone()
    for i in range(4):
        online.observe(100, 0.05)
        if i < 3:
            assert torch.equal(online.table(300), first)  # not rebuilt yet
    assert torch.equal(online.table(300)[:301], online.sps(torch.arange(301)))


@pytest.mark.parametrize(
    ("b", "seconds"), [(0, 0.1), (8, 0.0), (8, -1.0), (8, float("nan")), (8, float("inf"))]
)
def test_bad_observations_are_refused(b: int, seconds: float) -> None:
    with pytest.raises(ValueError):
        OnlineSps(idle_node_prior()).observe(b, seconds)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sps_alpha": 0.0},
        {"sps_alpha": 1.5},
        {"sps_prior_weight": -1},
        {"sps_max_jump": 1.0},
        {"sps_refresh_every": 0},
        {"sps_drift_alpha": -0.1},
        {"sps_drift_alpha": 1.5},
    ],
)
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        OnlineSps(idle_node_prior(), PolicySettings(**kwargs))
