"""Paper Appendix A: without the early break the scheduler is not lossless.

One request, gamma = 2, c_1 = 0.8, SPS(1..3) = (1.0, 0.5, 0.45), target (A: 0.7, B: 0.3), draft
(0.5, 0.5); the Markov confidence head gives c_2 = 0.9 after x_1 = A and 0 after x_1 = B. Each
round is scheduled, then verified by the engine's real verifier; we tally the first token out.
"""

from __future__ import annotations

import torch
from dspark.engine.verifier import verify_draft_tokens
from dspark.policies.dspark import dspark_async_policy, dspark_policy
from dspark.policies.ranking import global_argmax_lengths
from dspark.sps_format import SpsPoint, SpsProfile

ROUNDS = 12_000  # sd of a frequency near 0.7 is sqrt(0.21 / 12000) = 0.0042; TOL is ~5 sd
TOL = 0.02
P_TARGET = torch.tensor([0.7, 0.3])
P_DRAFT = torch.tensor([0.5, 0.5])


def appendix_profile() -> SpsProfile:
    points = [SpsPoint(batch_tokens=b, steps_per_second=s) for b, s in ((1, 1.0), (2, 0.5), (3, 0.45))]
    return SpsProfile(device="paper", model="appendix-a", dtype="float32", points=points)


def draw_rounds(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(P_DRAFT, 2 * ROUNDS, replacement=True, generator=gen).view(ROUNDS, 2)
    c2 = torch.where(tokens[:, 0] == 0, 0.9, 0.0)  # depends on the sampled x_1
    return tokens, torch.stack([torch.full((ROUNDS,), 0.8), c2], dim=1)


def first_token_frequencies(tokens: torch.Tensor, lengths: torch.Tensor, seed: int) -> torch.Tensor:
    target = P_TARGET.expand(ROUNDS, 3, 2)  # position 2 and the bonus: same distribution
    draft = P_DRAFT.expand(ROUNDS, 2, 2)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        accepted, next_token = verify_draft_tokens(tokens, draft, target, lengths, [None] * ROUNDS)
    first = torch.where(accepted > 0, tokens[:, 0], next_token)
    return torch.bincount(first, minlength=2).double() / ROUNDS


def per_round(schedule) -> torch.Tensor:
    return lambda conf: torch.cat([schedule(conf[i : i + 1]) for i in range(conf.shape[0])])


def test_causal_greedy_stays_lossless_and_never_admits_x1() -> None:
    tokens, conf = draw_rounds(seed=1)
    policy = dspark_policy(appendix_profile())
    lengths = per_round(lambda c: policy.verify_lengths(c, 2, 1))(conf)
    assert lengths.eq(0).all()  # Theta_1 = 0.9 < Theta_0 = 1.0: break before c_2 is looked at
    freq = first_token_frequencies(tokens, lengths, seed=2)
    assert abs(freq[0].item() - 0.7) < TOL, freq


def test_retrospective_global_search_is_biased_to_085() -> None:
    tokens, conf = draw_rounds(seed=3)
    profile = appendix_profile()
    lengths = per_round(lambda c: global_argmax_lengths(c, profile.sps))(conf)
    # x_1 is admitted exactly when it is A: its own value decided its admission.
    assert torch.equal(lengths > 0, tokens[:, 0] == 0)
    freq = first_token_frequencies(tokens, lengths, seed=4)
    assert abs(freq[0].item() - 0.85) < TOL, freq
    assert abs(freq[1].item() - 0.15) < TOL, freq


def test_async_capacity_from_two_steps_earlier_stays_lossless() -> None:
    tokens, conf = draw_rounds(seed=5)
    policy = dspark_async_policy(appendix_profile())
    lengths = per_round(lambda c: policy.verify_lengths(c, 2, 1))(conf)
    assert policy.split.warmup_steps == 2
    admitted = lengths[2:] > 0
    # x_1 is verified in about half the rounds (whenever x_1 two rounds back was A) ...
    assert 0.45 < admitted.double().mean().item() < 0.55
    # ... and that choice is blind to the current x_1.
    is_a = tokens[2:, 0] == 0
    gap = admitted[is_a].double().mean() - admitted[~is_a].double().mean()
    assert abs(gap.item()) < 0.04
    freq = first_token_frequencies(tokens, lengths, seed=6)
    assert abs(freq[0].item() - 0.7) < TOL, freq
