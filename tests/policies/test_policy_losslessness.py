"""Every policy, through the real verifier, leaves the first emitted token distributed as the target.

The confidences depend on the sampled draft tokens (c_{k+1} is high after a token the target
likes more than the drafter), the case in which a non-causal scheduler leaks a token's value
into its own admission (paper Appendix A). A retrospective global search in the same harness
must fail, which shows the harness can tell.
"""

from __future__ import annotations

import math

import pytest
import torch
from dspark.engine.verifier import verify_draft_tokens
from dspark.engine.verify_policy import VerifyChoice, VerifyPolicy
from dspark.policies.factory import build_policy
from dspark.policies.ranking import global_argmax_lengths
from dspark.sps_format import SpsProfile

from tests.policies.helpers import profile

VOCAB, GAMMA = 6, 4
TV_LIMIT = 0.01
BIAS_TO_CATCH = 0.03


def dirichlet(gen: torch.Generator, *shape: int) -> torch.Tensor:
    e = -torch.rand(*shape, generator=gen).log()
    return e / e.sum(-1, keepdim=True)


GEN = torch.Generator().manual_seed(20261129)
P_TARGET = dirichlet(GEN, GAMMA + 1, VOCAB)  # position-wise; index GAMMA is the bonus
P_DRAFT = dirichlet(GEN, GAMMA, VOCAB)
# Markov confidence head: after x_k, the next confidence is high iff the target favours x_k.
NEXT_CONF = torch.where(P_TARGET[:GAMMA] > P_DRAFT, 0.95, 0.1)


def required_draws(p: torch.Tensor) -> int:
    """Draws so that, with every frequency within 4 sd of its mean (a union bound leaves
    < VOCAB * 6.4e-5 of failing), the sampling noise in TV stays <= TV_LIMIT:
    0.5 * sum_i 4 * sqrt(p_i (1 - p_i) / N) <= TV_LIMIT. A real bias of BIAS_TO_CATCH then
    shows as TV >= BIAS_TO_CATCH - TV_LIMIT > TV_LIMIT and fails."""
    return math.ceil((2 * (p * (1 - p)).sqrt().sum().item() / TV_LIMIT) ** 2)


def staircase_profile(max_b: int) -> SpsProfile:
    # Step time grows with B and jumps every 40 tokens: a jagged curve with local optima, where
    # the causal greedy stops at a cliff and the async variant's global capacity search does not.
    return profile({b: 1.0 / (1 + b / 150 + 0.03 * (b // 40)) for b in range(1, max_b + 1)})


class GlobalArgmaxPolicy(VerifyPolicy):
    """The non-causal search on the current confidences: NOT lossless (the negative control)."""

    name = "global-argmax"

    def __init__(self, profile: SpsProfile) -> None:
        self.profile = profile

    def choose(self, confidences, gamma, num_requests):
        return VerifyChoice(global_argmax_lengths(confidences, self.profile.sps))


def first_token_distribution(
    policy: VerifyPolicy, rows_per_step: int, steps: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = rows_per_step * steps
    tokens = torch.stack(
        [torch.multinomial(P_DRAFT[k], n, replacement=True, generator=gen) for k in range(GAMMA)], 1
    )
    # c_1 depends on the context only; a per-step sharpness makes the load vary between steps.
    sharpness = (0.1 + 2 * torch.rand(steps, 1, generator=gen)).repeat_interleave(rows_per_step, 0)
    first_conf = torch.rand(n, 1, generator=gen) ** sharpness
    later_conf = NEXT_CONF[torch.arange(GAMMA - 1)[None, :], tokens[:, :-1]]
    conf = torch.cat([first_conf, later_conf], dim=1)
    lengths = torch.cat(
        [
            policy.verify_lengths(conf[s : s + rows_per_step], GAMMA, rows_per_step)
            for s in range(0, n, rows_per_step)
        ]
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        accepted, next_token = verify_draft_tokens(
            tokens, P_DRAFT.expand(n, -1, -1), P_TARGET.expand(n, -1, -1), lengths, [None] * n
        )
    first = torch.where(accepted > 0, tokens[:, 0], next_token)
    return torch.bincount(first, minlength=VOCAB).double() / n, lengths


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q.double()).abs().sum().item()


ROWS_PER_STEP = 64
STEPS = 3200


@pytest.mark.parametrize("spec", ["none", "static:2", "full", "threshold:0.5", "dspark", "dspark-async"])
def test_first_token_matches_target(spec: str) -> None:
    assert required_draws(P_TARGET[0]) <= ROWS_PER_STEP * STEPS
    assert BIAS_TO_CATCH - TV_LIMIT > TV_LIMIT
    policy = build_policy(spec, sps=staircase_profile(ROWS_PER_STEP * (GAMMA + 1)))
    freq, lengths = first_token_distribution(policy, ROWS_PER_STEP, STEPS, seed=hash(spec) % 1000)
    if spec.startswith(("threshold", "dspark")):
        counts = torch.bincount(lengths, minlength=GAMMA + 1)
        assert (counts > 0).sum() >= 3, counts  # the policy really varied the lengths
    assert total_variation(freq, P_TARGET[0]) < TV_LIMIT


def test_harness_catches_the_non_causal_global_search() -> None:
    # One request per step, as in Appendix A, where one token's value sways the whole search.
    # Its true bias here is about BIAS_TO_CATCH (TV ~0.031); with 20k draws the noise is < 0.01.
    appendix_like = profile({1: 1.0, 2: 0.5, 3: 0.48, 4: 0.46, 5: 0.44})
    freq, _ = first_token_distribution(GlobalArgmaxPolicy(appendix_like), 1, 20_000, seed=9)
    assert total_variation(freq, P_TARGET[0]) > 2 * TV_LIMIT
