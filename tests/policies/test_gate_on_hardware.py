"""The DSpark policy against simulated engines: where drafting does not pay (a steep fp32 CPU
curve, a weak drafter) it must stop within a few steps; where it pays it must keep drafting."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from dspark.engine.outputs import StepStats
from dspark.engine.verify_policy import survival_probabilities
from dspark.policies.factory import build_policy
from dspark.profiling.synthetic import synthetic_profile
from dspark.sps_format import SpsProfile

from tests.policies.helpers import profile

# A 2-core AVX2-only EPYC in fp32 (docs/bench/serve-cpu-avx2-fp32): a 2-token forward costs 1.6x a
# 1-token one, and from 16 tokens on the step time grows almost in proportion to the tokens.
AVX2_FP32 = profile(
    {1: 18.3, 2: 11.4, 3: 9.0, 4: 10.9, 6: 9.7, 8: 9.3, 12: 8.5, 16: 7.2, 24: 6.0, 32: 5.2, 64: 3.5, 128: 2.1}
)
GPU_LIKE = synthetic_profile(max_batch_tokens=512)  # 20 ms a step, 15 us a token: verifying is cheap


@dataclass
class Drafter:
    """A drafter's cost and calibrated quality: the first draft token is accepted with probability
    about `first`, each later one, given the ones before, about `later`."""

    first: float
    later: float
    seconds_at_one: float  # drafting one request the whole block; R requests cost (1 + R / 4) times it

    def confidences(self, rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
        spread = rng.uniform(0.5, 1.5, (rows, width))
        mean = np.full(width, self.later)
        mean[0] = self.first
        return np.clip(spread * mean, 0.0, 1.0)


WEAK = Drafter(first=0.35, later=0.55, seconds_at_one=0.012)  # tau about 1.5, as on the CPU
STRONG = Drafter(first=0.9, later=0.9, seconds_at_one=0.002)


def simulate(curve: SpsProfile, drafter: Drafter, requests: int, steps: int, seed: int = 0) -> list[int]:
    """Draft tokens the `dspark` policy verifies at each of `steps` decode steps of `requests`
    requests, on an engine whose forwards run exactly at `curve` and whose drafts are accepted as
    their calibrated confidences say; -1 marks a step that drafted and verified nothing."""
    rng = np.random.default_rng(seed)
    policy = build_policy("dspark", sps=curve)
    verified = []
    for _ in range(steps):
        horizon = policy.max_length(7, requests)
        lengths, accepted = np.zeros(requests, dtype=np.int64), [0] * requests
        predicted, draft_s = [], 0.0
        if horizon:
            conf = drafter.confidences(rng, requests, horizon)
            lengths = policy.verify_lengths(torch.from_numpy(conf), horizon, requests).numpy()
            survival = survival_probabilities(conf)
            taken = np.arange(horizon)[None, :] < lengths[:, None]
            predicted = np.where(taken, survival, 0.0).sum(axis=0).tolist()
            accepted = [int(np.cumprod(rng.random(n) < conf[r, :n]).sum()) for r, n in enumerate(lengths)]
            draft_s = drafter.seconds_at_one * (0.5 + 0.5 * horizon / 7) * (1 + requests / 4)
        batch = requests + int(lengths.sum())
        forward_s = 1.0 / curve.sps(float(batch))
        per_position = [sum(n > k for n in accepted) for k in range(7)]
        policy.observe_step(
            StepStats(
                verify_batch_tokens=batch,
                verify_budgets=lengths.tolist(),
                drafted=horizon > 0,
                draft_horizon=horizon,
                draft_time_s=draft_s,
                forward_time_s=forward_s,
                step_time_s=forward_s + draft_s + 0.0005 * requests,
                predicted_accepted_tokens=sum(predicted) if horizon else None,
                predicted_per_position=predicted,
                accepted_per_position=per_position,
                num_accepted_tokens=sum(accepted),
            )
        )
        verified.append(int(lengths.sum()) if horizon == 0 or lengths.sum() else -1)
    return verified


@pytest.mark.parametrize("requests", [1, 4, 16])
def test_weak_drafter_on_an_avx2_fp32_curve_stops_drafting_within_a_few_steps(requests) -> None:
    """The defaults on an AVX2-only CPU in fp32: every drafted step costs more than the half token
    it adds. After a few drafted steps the policy decodes plainly, exploring rarely."""
    verified = simulate(AVX2_FP32, WEAK, requests, steps=600)
    drafted = [i for i, n in enumerate(verified) if n != 0]
    assert len([i for i in drafted if i < 20]) <= 10  # finds out within a few steps
    assert all(n == 0 for n in verified[12:36])
    assert len(drafted) <= 0.04 * len(verified)  # exploring included


@pytest.mark.parametrize(("curve", "requests"), [(GPU_LIKE, 1), (GPU_LIKE, 16), (AVX2_FP32, 2)])
def test_drafting_that_pays_keeps_drafting(curve, requests) -> None:
    """A strong cheap drafter where verifying is cheap, and the AVX2 curve at two requests (the
    2-token cliff is already paid), keep drafting and verifying on nearly every step."""
    drafter = STRONG if curve is GPU_LIKE else WEAK
    verified = simulate(curve, drafter, requests, steps=300)
    assert sum(n > 0 for n in verified) >= 0.95 * len(verified)
    assert np.mean([n for n in verified if n > 0]) >= requests
