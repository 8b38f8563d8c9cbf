"""The drafting gate: skip the drafter on steps expected to decode faster without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dspark.engine.policy_spec import PolicySettings
from dspark.engine.verify_policy import survival_probabilities
from dspark.policies import drafting_gate
from dspark.policies.acceptance import AcceptanceScale
from dspark.policies.drafting_gate import DraftCost, DraftingGate
from dspark.policies.dspark import dspark_async_policy, dspark_policy
from dspark.policies.ranking import prefix_greedy_lengths
from dspark.policies.sps_curve import OnlineSps, table_lookup
from dspark.profiling.synthetic import synthetic_profile

from tests.policies.helpers import step_stats

# Forward: 2 ms + 40 us per token, so 16 requests take ~2.6 ms to verify one token each.
PROFILE = synthetic_profile(max_batch_tokens=512, fixed_ms=2.0, per_token_us=40.0, tile=64, tile_ms=0.3)
FORWARD = table_lookup(PROFILE)
ONE_STEP = PolicySettings(memory_rows=16)  # one step's rows are enough evidence here


def gate_with(**settings) -> DraftingGate:
    return DraftingGate(PolicySettings(**settings))


def horizon(
    gate: DraftingGate, num_requests: int, other_s: float, plain_other_s: float | None, horizons
) -> int:
    """The gate's horizon when a drafted step spends `other_s` besides its forward and drafting,
    and an undrafted one `plain_other_s` (None: not measured yet)."""
    gate.other_s, gate.plain_other_s = other_s, plain_other_s
    return gate.draft_horizon(num_requests, FORWARD, horizons)


def drafts(gate: DraftingGate, num_requests: int, other_s: float, plain_other_s: float | None) -> bool:
    """Whether the gate drafts the 7 positions the tests' rows hold (or fewer: as many as they hold)."""
    return horizon(gate, num_requests, other_s, plain_other_s, [7]) > 0


def expected_rate(pool, num_requests: int, fixed_s: float) -> float:
    """The gate's expected rate drafting for `num_requests` requests like the `pool` rows."""
    return drafting_gate.expected_rate(np.asarray(pool, dtype=np.float64), num_requests, FORWARD, fixed_s)


def test_draft_cost_interpolates_between_measured_batch_sizes_and_is_flat_outside() -> None:
    cost = DraftCost(0.2)
    assert cost.seconds(4) is None
    cost.observe(2, 0.010)
    cost.observe(10, 0.050)
    cost.observe(0, 1.0)  # no requests drafted: ignored
    cost.observe(3, float("nan"))  # ignored
    assert cost.seconds(6) == pytest.approx(0.030)
    assert cost.seconds(1) == pytest.approx(0.010) and cost.seconds(64) == pytest.approx(0.050)
    cost.observe(10, 0.100)  # an EWMA, not the last value
    assert 0.050 < cost.seconds(10) < 0.100


def test_draft_cost_is_kept_per_horizon_and_interpolated_between_horizons() -> None:
    cost = DraftCost(0.2)
    cost.observe(4, 0.004, horizon=1)
    cost.observe(4, 0.008, horizon=7)
    assert cost.seconds(4, 1) == pytest.approx(0.004) and cost.seconds(4, 7) == pytest.approx(0.008)
    assert cost.seconds(4, 4) == pytest.approx(0.006)  # an unseen horizon: between its neighbours
    assert cost.seconds(4, 15) == pytest.approx(0.008)  # flat past the widest
    per_batch = cost.seconds(4)
    assert 0.004 < per_batch < 0.008  # the EWMA over both horizons
    assert cost.seconds(8, 1) == pytest.approx(per_batch)  # an unseen batch size: flat past the end


def test_gate_drafts_the_narrower_horizon_when_the_last_position_does_not_pay() -> None:
    gate = gate_with(memory_rows=16, reuse_steps=1)  # every call judges afresh
    # Position 2 is almost never accepted and drafting it costs 2 ms more.
    gate.remember(torch.tensor([[0.9, 0.01]] * 16, dtype=torch.float64))
    gate.cost.observe(16, 0.0002, horizon=1)
    gate.cost.observe(16, 0.0022, horizon=2)
    assert horizon(gate, 16, 0.001, 0.001, [1, 2]) == 1
    # Position 2 as likely as position 1 and no dearer: the wider horizon.
    gate.remember(torch.tensor([[0.9, 0.9]] * 16, dtype=torch.float64))
    gate.cost._by_horizon[16][2] = 0.0002
    assert horizon(gate, 16, 0.001, 0.001, [1, 2]) == 2
    # Neither beats plain decoding: skip.
    gate.cost._by_horizon[16].update({1: 0.05, 2: 0.05})
    assert horizon(gate, 16, 0.001, 0.001, [1, 2]) == 0


def test_gate_drafts_a_horizon_wider_than_its_rows_when_drafting_pays_so_it_gets_judged() -> None:
    gate = gate_with(memory_rows=16, reuse_steps=1)
    gate.remember(torch.full((16, 2), 0.9, dtype=torch.float64))
    gate.cost.observe(16, 0.0002, horizon=2)
    assert horizon(gate, 16, 0.001, 0.001, [2, 3]) == 3
    gate.cost._by_horizon[16][2] = 0.05  # drafting does not pay at all
    assert horizon(gate, 16, 0.001, 0.001, [2, 3]) == 0


def test_gate_reuses_a_horizons_expected_rate_for_reuse_steps_evaluations() -> None:
    gate = gate_with(memory_rows=16, reuse_steps=3)
    gate.remember(torch.full((16, 2), 0.9, dtype=torch.float64))
    gate.cost.observe(16, 0.0002, horizon=2)
    assert horizon(gate, 16, 0.001, 0.001, [2]) == 2
    gate.cost._by_horizon[16][2] = 0.05  # drafting stops paying: seen at the third evaluation on
    decisions = [horizon(gate, 16, 0.001, 0.001, [2]) for _ in range(4)]
    assert decisions == [2, 2, 0, 0]
    # Another R is judged afresh (drafting costs 0.0002 s at R = 8).
    assert horizon(gate, 8, 0.001, 0.001, [2]) == 2


def test_gate_drafts_until_it_has_measured_costs_and_confidences() -> None:
    gate = DraftingGate()
    assert drafts(gate, 16, 0.001, 0.001)  # nothing measured
    gate.cost.observe(16, 1.0)
    assert drafts(gate, 16, 0.001, 0.001)  # no confidences yet
    assert gate.skipped_steps == 0


def test_gate_drafts_until_it_remembers_memory_rows_of_confidences() -> None:
    """One unlucky first draft (or a cold first drafting time) must not switch drafting off."""
    gate = gate_with(memory_rows=64)
    gate.cost.observe(16, 0.005)  # twice the forward
    for _ in range(3):
        gate.remember(torch.full((16, 7), 0.3, dtype=torch.float64))
        assert drafts(gate, 16, 0.001, 0.001)
    gate.remember(torch.full((16, 7), 0.3, dtype=torch.float64))  # 64 rows: judged now
    assert not drafts(gate, 16, 0.001, 0.001)


def test_gate_judges_after_judge_steps_drafted_steps_at_one_request() -> None:
    """At one request memory_rows rows take as many drafted steps; judge_steps of them are evidence
    enough to stop drafting that does not pay (an exploration renews them later)."""
    gate = gate_with(memory_rows=64, judge_steps=8)
    gate.cost.observe(1, 0.005)  # twice the forward
    for _ in range(7):
        gate.remember(torch.full((1, 7), 0.3, dtype=torch.float64))
        assert drafts(gate, 1, 0.001, 0.001)
    gate.remember(torch.full((1, 7), 0.3, dtype=torch.float64))
    assert not drafts(gate, 1, 0.001, 0.001)


def test_gate_skips_expensive_drafting_of_unlikely_tokens_and_keeps_cheap_likely_drafts() -> None:
    expensive = gate_with(memory_rows=16)
    expensive.cost.observe(16, 0.005)  # twice the forward
    expensive.remember(torch.full((16, 7), 0.3, dtype=torch.float64))
    assert not drafts(expensive, 16, 0.001, 0.001)

    cheap = gate_with(memory_rows=16)
    cheap.cost.observe(16, 0.0002)
    cheap.remember(torch.full((16, 7), 0.9, dtype=torch.float64))
    assert drafts(cheap, 16, 0.001, 0.001)


def test_gate_decision_matches_the_expected_rates() -> None:
    """Drafts exactly when Algorithm 1's expected rate with drafting beats plain decoding."""
    conf = torch.rand(8, 5, generator=torch.Generator().manual_seed(0)).pow(0.5).double()
    other = 0.001
    plain = 8 / (other + 1 / float(FORWARD(torch.tensor([8]))[0]))
    decisions = []
    for draft_s in (1e-4, 1e-3, 3e-3, 1e-2, 3e-2):
        gate = gate_with(memory_rows=8)
        gate.cost.observe(8, draft_s)
        gate.remember(conf)
        expected = expected_rate(conf, 8, other + draft_s) > plain * (1 + gate.settings.min_gain)
        decisions.append(drafts(gate, 8, other, other))
        assert decisions[-1] == expected
    assert decisions[0] and not decisions[-1]


def test_expected_rate_is_algorithm_1s_objective_on_the_pooled_rows() -> None:
    conf = torch.rand(16, 7, generator=torch.Generator().manual_seed(1)).pow(0.4).double()
    fixed = 0.002

    def step_rate(b: torch.Tensor) -> torch.Tensor:
        return 1.0 / (fixed + 1.0 / FORWARD(b))

    lengths = prefix_greedy_lengths(conf, step_rate)
    verified = torch.arange(7)[None, :] < lengths[:, None]
    tokens = 16 + float(survival_probabilities(conf)[verified].sum())
    expected = tokens * float(step_rate(torch.tensor([16 + int(lengths.sum())]))[0])
    assert expected_rate(conf, 16, fixed) == pytest.approx(expected)
    # Twice the rows standing for the same 16 requests: the same expected rate.
    doubled = torch.cat([conf, conf])
    assert expected_rate(doubled, 16, fixed) == pytest.approx(expected)


def test_gate_explores_after_a_run_of_skipped_steps() -> None:
    gate = gate_with(explore_every=3, memory_rows=16, reuse_steps=1)
    gate.cost.observe(16, 0.01)
    gate.remember(torch.full((16, 7), 0.1, dtype=torch.float64))
    decisions = [drafts(gate, 16, 0.001, 0.001) for _ in range(25)]
    drafted = [i for i, d in enumerate(decisions) if d]
    assert drafted == [3, 10, 23]  # each exploration that changed nothing doubles the interval
    assert gate.skipped_steps == 22
    gate.remember(torch.full((16, 7), 0.99, dtype=torch.float64))  # drafting pays again
    gate.cost.observe(16, 1e-5)
    gate.cost._seconds[16] = 1e-5
    assert drafts(gate, 16, 0.001, 0.001)
    gate._shapes.clear()  # forget the remembered rows
    gate._pool = gate._pool[:0]
    gate.remember(torch.full((16, 7), 0.1, dtype=torch.float64))
    gate.cost._seconds[16] = 0.01
    decisions = [drafts(gate, 16, 0.001, 0.001) for _ in range(5)]
    assert decisions == [False, False, False, True, False]  # back to the short interval


def test_exploration_is_counted_per_request_count() -> None:
    """Steps at another R, where drafting pays (a closed loop's dip while a finished request's
    successor prefills), neither reset nor advance the exploration interval at 16 requests."""
    gate = gate_with(explore_every=3, memory_rows=16, reuse_steps=1)
    gate.cost.observe(16, 0.01)
    gate.cost.observe(1, 1e-6)
    gate.remember(torch.full((16, 7), 0.1, dtype=torch.float64))
    at_16 = []
    for i in range(25):
        at_16.append(drafts(gate, 16, 0.001, 0.001))
        if i % 4 == 3:
            assert drafts(gate, 1, 0.0, 0.001)  # drafting pays at one request
    assert [i for i, d in enumerate(at_16) if d] == [3, 10, 23]  # as if R never changed


def test_exploration_at_one_request_renews_a_quarter_of_the_pool() -> None:
    """At one request an explored step adds one row: the gate drafts a burst of memory_rows / 4
    steps, enough for better confidences (the load changed) to switch drafting back on, after
    explore_every skipped steps per step of the burst (exploring takes the same share of steps)."""
    gate = gate_with(explore_every=4, memory_rows=64)
    gate.cost.observe(1, 0.0005)
    for _ in range(64):
        gate.remember(torch.full((1, 7), 0.05, dtype=torch.float64))
    decisions = [drafts(gate, 1, 0.0002, 0.0002) for _ in range(64 + 16 + 128)]
    assert decisions == [False] * 64 + [True] * 16 + [False] * 128  # nothing changed: the interval doubled
    burst = []
    for _ in range(16):
        burst.append(drafts(gate, 1, 0.0002, 0.0002))
        gate.remember(torch.full((1, 7), 0.95, dtype=torch.float64))  # the drafts are good now
    assert all(burst)
    assert all(drafts(gate, 1, 0.0002, 0.0002) for _ in range(10))


def test_an_exploration_step_that_verifies_nothing_ends_its_burst() -> None:
    """On a steep curve the scheduler verifies none of the explored drafts: the rest of the burst
    would draft for nothing, so the gate goes back to skipping (and doubles the interval)."""
    gate = gate_with(explore_every=4, memory_rows=64)
    gate.cost.observe(1, 0.0005)
    for _ in range(64):
        gate.remember(torch.full((1, 7), 0.05, dtype=torch.float64))
    assert not any(drafts(gate, 1, 0.0002, 0.0002) for _ in range(64))
    assert drafts(gate, 1, 0.0002, 0.0002)  # the exploration
    gate.verified(1)  # something verified: the burst goes on
    assert drafts(gate, 1, 0.0002, 0.0002)
    gate.verified(0)
    decisions = [drafts(gate, 1, 0.0002, 0.0002) for _ in range(129)]
    assert decisions == [False] * 128 + [True]


def test_pool_keeps_the_newest_steps_covering_memory_rows_zero_padded() -> None:
    gate = gate_with(memory_rows=3)
    gate.remember(torch.tensor([[0.1, 0.2]], dtype=torch.float64))
    gate.remember(torch.tensor([[0.5], [0.6]], dtype=torch.float64))
    assert gate._pool.tolist() == [[0.1, 0.2], [0.5, 0.0], [0.6, 0.0]]
    gate.remember(torch.tensor([[0.7], [0.8]], dtype=torch.float64))  # 4 newest rows cover 3
    assert gate._pool.tolist() == [[0.5], [0.6], [0.7], [0.8]]
    # Updated step by step: always the newest steps covering memory_rows, padded to the widest.
    rng = torch.Generator().manual_seed(0)
    steps = [
        torch.tensor([[0.5], [0.6]], dtype=torch.float64),
        torch.tensor([[0.7], [0.8]], dtype=torch.float64),
    ]
    for width in (3, 1, 2, 2, 1, 1, 1):
        steps.append(torch.rand(int(torch.randint(1, 3, (1,), generator=rng)), width, generator=rng).double())
        gate.remember(steps[-1])
        while sum(c.shape[0] for c in steps) - steps[0].shape[0] >= gate.settings.memory_rows:
            steps.pop(0)
        widest = max(c.shape[1] for c in steps)
        rebuilt = torch.cat([torch.nn.functional.pad(c, (0, widest - c.shape[1])) for c in steps])
        assert gate._pool.tolist() == rebuilt.tolist()


@pytest.mark.parametrize("make", [dspark_policy, dspark_async_policy])
def test_policies_stop_drafting_when_drafting_costs_more_than_it_returns(make) -> None:
    policy = make(OnlineSps(PROFILE), ONE_STEP)
    low = torch.full((16, 7), 0.2, dtype=torch.float64)
    assert policy.max_length(7, 16) == 7  # nothing measured: draft
    policy.verify_lengths(low, 7, 16)
    # The engine reports drafting 16 requests at 10 ms against a ~2.6 ms forward.
    for _ in range(5):
        policy.observe_step(step_stats(16, 1 / PROFILE.sps(16.0), 0.0005, draft_s=0.010, drafted_requests=16))
    assert policy.max_length(7, 16) == 0
    assert policy.gate.skipped_steps == 1
    # A fixed curve learns no costs, so it keeps drafting.
    frozen = make(PROFILE)
    frozen.verify_lengths(low, 7, 16)
    frozen.observe_step(step_stats(16, 1.0, 0.0005, draft_s=0.010, drafted_requests=16))
    assert frozen.max_length(7, 16) > 0


def test_async_policy_warms_up_again_after_skipped_steps() -> None:
    policy = dspark_async_policy(OnlineSps(PROFILE), ONE_STEP)
    high = torch.full((16, 7), 0.9, dtype=torch.float64)
    for _ in range(3):
        policy.verify_lengths(high, 7, 16)
    warm = policy.split.warmup_steps
    policy.gate.cost.observe(16, 1.0)
    assert policy.max_length(7, 16) == 0
    policy.gate = DraftingGate(ONE_STEP)  # nothing measured again: drafts
    assert policy.max_length(7, 16) > 0
    policy.verify_lengths(high, 7, 16)  # capacity from the step before the skip
    assert policy.split.warmup_steps == warm == 2
    policy.verify_lengths(high, 7, 16)  # the skipped step is two steps back: Algorithm 1 instead
    assert policy.split.warmup_steps == 3


def test_plain_steps_overhead_is_measured_on_a_skipped_step_and_used_for_the_comparison() -> None:
    policy = dspark_policy(OnlineSps(PROFILE), ONE_STEP)
    high = torch.full((16, 7), 0.6, dtype=torch.float64)
    assert policy.max_length(7, 16) == 7
    policy.verify_lengths(high, 7, 16)
    # Drafted steps: accepting their tokens costs 2 ms besides a cheap 0.5 ms drafting.
    policy.observe_step(step_stats(16, 1 / PROFILE.sps(16.0), 0.002, draft_s=0.0005, drafted_requests=16))
    assert policy.gate.plain_other_s is None
    assert policy.max_length(7, 16) == 0  # one undrafted step, to measure it
    policy.observe_step(step_stats(16, 1 / PROFILE.sps(16.0), 0.0001))
    assert policy.gate.plain_other_s == pytest.approx(0.0001) and policy.gate.other_s > 0
    gate = policy.gate
    with_draft = expected_rate(gate._pool, 16, gate.other_s + gate.cost.seconds(16))
    plain = 16 / (0.0001 + 1 / float(FORWARD(torch.tensor([16]))[0]))
    assert (policy.max_length(7, 16) > 0) == (with_draft > plain * (1 + gate.settings.min_gain))


def test_acceptance_scale_tracks_observed_over_predicted_per_position_and_rescales_survival() -> None:
    scale = AcceptanceScale(PolicySettings(acceptance_decay=0.98, acceptance_prior_tokens=5.0))
    assert scale.factors(1)[0] == 1.0
    for _ in range(300):
        # Position 1 promised twice what it returns, position 2 half; position 3 never verified.
        scale.observe(predicted=[2.0, 0.5], accepted=[1, 1, 0])
        scale.observe(predicted=[float("nan"), 0.1], accepted=[5, 5, 0])  # ignored
    assert scale.factors(1)[0] == pytest.approx((50 + 5) / (100 + 5), rel=1e-3)  # steady sums 100, 50 + prior
    factors = scale.factors(3)
    assert factors[1] == pytest.approx((50 + 5) / (25 + 5), rel=1e-3) and factors[2] == 1.0
    conf = np.array([[0.8, 0.5, 0.9], [0.9, 0.95, 0.5]])
    scaled = scale.apply(conf)
    expected = np.minimum.accumulate(np.minimum(survival_probabilities(conf) * factors, 1.0), axis=1)
    assert survival_probabilities(scaled) == pytest.approx(expected)
    assert bool((scaled >= 0).all() and (scaled <= 1).all())
    assert conf[0, 0] == 0.8  # the input is left alone


def test_acceptance_scale_forgets_per_request_round_not_per_step() -> None:
    """At one request, position 2 predicts about 0.1 tokens a step: a window of 50 steps (the old
    per-step forgetting, 0.98) holds 5 predicted tokens, so the 5-token prior kept its factor near
    1 however little was accepted. Forgetting per request round gathers the evidence."""
    per_round, per_step = AcceptanceScale(), AcceptanceScale(PolicySettings(acceptance_decay=0.98))
    for _ in range(2000):  # one request a step; position 2 promises 0.1 and returns nothing
        per_round.observe(predicted=[0.5, 0.1], accepted=[1, 0], rounds=1)
        per_step.observe(predicted=[0.5, 0.1], accepted=[1, 0], rounds=1)
    assert float(per_round.factors(2)[1]) < 0.1
    assert float(per_step.factors(2)[1]) > 0.45
    many = AcceptanceScale()  # 64 requests a step: the same evidence in 1/64 of the steps
    for _ in range(2000 // 64):
        many.observe(predicted=[32.0, 6.4], accepted=[64, 0], rounds=64)
    assert float(many.factors(2)[1]) == pytest.approx(float(per_round.factors(2)[1]), rel=0.25)


def test_over_confident_drafts_stop_being_verified_and_drafted() -> None:
    """Steps whose drafts are accepted far less often than predicted teach the policy to verify less."""
    policy = dspark_policy(OnlineSps(PROFILE), ONE_STEP)
    conf = torch.full((16, 7), 0.8, dtype=torch.float64)
    before = int(policy.verify_lengths(conf, 7, 16).sum())
    for _ in range(100):
        policy.observe_step(
            step_stats(
                16 + before, 1 / PROFILE.sps(16.0 + before), 0.0005, 0.0005, 16, predicted=20.0, accepted=1
            )
        )
    assert policy.acceptance.factors(1)[0] < 0.1
    assert int(policy.verify_lengths(conf, 7, 16).sum()) < before


def test_a_slowdown_seen_only_on_undrafted_steps_does_not_make_drafting_look_cheap() -> None:
    """While the gate skips, only plain steps are timed. When the node then slows down, the
    drafted steps' costs, measured before, must slow down with it (the SPS curve's drift);
    otherwise plain decoding looks slow next to stale drafting costs and the gate flips. (The
    scheduler's right envelope of the curve also keeps B = 16 from looking slower than the
    stale larger drafted batch, so the drift is checked on the curve itself too.)"""
    curve = OnlineSps(PROFILE, PolicySettings(sps_drift_alpha=0.1))
    policy = dspark_policy(curve, ONE_STEP)
    conf = torch.full((16, 7), 0.3, dtype=torch.float64)
    policy.verify_lengths(conf, 7, 16)
    budget = int(policy.verify_lengths(conf, 7, 16).sum())
    drafted_b = 16 + budget

    def forward_s(b: int, slowdown: float = 1.0) -> float:
        return slowdown / PROFILE.sps(float(b))

    for _ in range(20):  # speed 1: drafting costs 1 ms for 16 requests
        policy.observe_step(
            step_stats(drafted_b, forward_s(drafted_b), 0.0002, 0.001, 16, budget * 0.3, round(budget * 0.3))
        )
        policy.observe_step(step_stats(16, forward_s(16), 0.0002))
    assert policy.max_length(7, 16) == 0  # drafting does not pay at this speed
    for _ in range(30):  # the node becomes twice as slow while only plain steps run
        policy.observe_step(step_stats(16, forward_s(16, 2.0), 0.0004))
    assert policy.max_length(7, 16) == 0
    # Most of the slowdown went into the drift, shared by every size (drift_alpha=0 leaves it 1),
    # so the drafted batch, not timed since, is estimated slower too.
    assert PROFILE.sps(16.0) / curve.sps(16.0) == pytest.approx(2.0, rel=0.05)  # the correction at B = 16
    assert curve.drift() > 1.5
    assert 1 / curve.sps(float(drafted_b)) > 1.5 * forward_s(drafted_b)
